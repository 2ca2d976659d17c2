"""``cacheflow demo``: serve a byte-level MoE on real text, with its experts behind the cache.

What it does, in order:

1. Builds a Flax NNX MoE stack with a byte embedding (`cacheflow_jax.cli.demo_model`) once and saves
   it with an orbax ``CheckpointManager`` under the work directory; later runs reuse it while its
   ``demo.json`` matches the requested size and the checkpoint opens.
2. Reads text that ships with Python (`pydoc_data.topics`, the help topics, about 460 KB) as
   bytes. A step is ``tokens`` consecutive bytes pushed through every layer; each layer's router
   picks the step's ``top_k`` experts from that layer's input, so the experts come from the model
   and the text, with the text's locality, and layer ``l + 1``'s are known only once layer ``l``
   has run. The first half of the text is the warm-up's, the second half is served.
3. Warm-up: serves ``record`` steps of the first half through a cache without prefetch and
   records their access log. Unless ``predictor`` names a checkpoint, trains the MLP predictor
   on that log (``python -m training.main``, a subprocess: the library never imports
   ``training/``), with small settings (`TRAIN_ARGS`).
4. Serves ``warmup + requests`` steps of the second half five ways, the rows taking turns of
   `SEGMENT` steps (a slow spell of a shared machine then falls on every row alike, where whole
   passes one after another put it on whichever row ran then). Each row but ``all-resident``
   reads its own copy of the checkpoint's files (under ``rows/`` beside the checkpoint), whose
   page cache is dropped (``POSIX_FADV_DONTNEED``) once before the first turn, so the first L3
   read of each chunk in a row is really cold, as if the row ran alone. The first ``warmup``
   steps (jit compilation) are not measured:

   * ``baseline``: each layer reads its routed experts' chunks from TensorStore
     (``read_many``) and ``device_put``\\ s them; nothing is kept between steps;
   * ``cacheflow``: the experts come from ``cfj.serving(cache)``, one ``get_many`` per layer;
   * ``cacheflow+markov`` and ``cacheflow+mlp``: the same, with ``TieredCache(prefetcher=...)``:
     the cache's prefetch worker is fed each layer's ``get_many`` and, while the layer computes,
     loads the blocks the predictor expects next (layer-ahead, as MoE offloading systems such as
     ProMoE and MoE-Infinity do). Both predictors first observe the warm-up's accesses, so each
     starts serving with the same history; the cache's clock continues the log's and runs only
     during the row's turns (`ServedPass.elapsed`); after each turn the worker's last loads land
     before the next row starts;
   * ``all-resident``: every expert is put on the device once up front (the limit).

   The dense weights (embedding, norms, routers) are on the device in every pass.

Each step runs the same jitted functions on the same inputs in every pass, so the passes' outputs
and routes must agree bitwise; the demo checks that. Latencies are per step (all layers, up to
the output being ready). Times on a CPU are for comparing the passes of one run, not absolute
claims; on a CPU "device" memory is host memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from cacheflow_jax.cli.demo_model import MoEConfig, build, embed, experts_layer, route
from cacheflow_jax.prefetch.scheduler import PrefetchSettings
from cacheflow_jax.session.session import serving
from cacheflow_jax.store.tensorstore_store import open_store
from cacheflow_jax.orbax import LazyArray, restore_lazy

if TYPE_CHECKING:  # the library imports `predictor` only through the Predictor protocol
    import predictor

MiB = 2**20
DEMO_FORMAT = 2
ROWS = ("baseline", "cacheflow", "cacheflow+markov", "cacheflow+mlp", "all-resident")
COLUMNS = (
    ("name", "name"),
    ("l1_hit_ratio", "L1 hit"),
    ("l3_share", "to L3"),
    ("prefetch_accuracy", "pf acc"),
    ("prefetch_coverage", "pf cov"),
    ("p50_ms", "p50 ms"),
    ("p95_ms", "p95 ms"),
    ("p95_ratio_to_baseline", "p95/base"),
    ("p95_ratio_to_resident", "p95/resident"),
)
# `python -m training.main` settings for the MLP trained on the warm-up log: a window of two
# layers' experts (what the layer-ahead prefetcher needs); about 10 s on 2 cores.
SEGMENT = 10  # steps each row serves in its turn
TRAIN_ARGS = ("--epochs", "12", "--history", "4", "--lookahead", "4", "--eval-fraction", "0.2")


class DemoError(ValueError):
    """The demo's settings are invalid, or a step of it failed; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """Everything ``cacheflow demo`` can be told.

    Attributes:
      workdir: where the model checkpoint and the run's files live (default: `default_workdir`).
      requests: measured steps per pass.
      warmup: unmeasured steps before each pass (jit compilation, first reads).
      record: warm-up steps whose access log trains the MLP and primes the predictors.
      seed: seeds the model weights.
      layers: MoE layers.
      experts: experts per layer.
      expert_mb: MiB per expert (both matrices); sets the expert hidden width.
      d_model: width of the residual stream.
      top_k: experts per layer per step.
      tokens: bytes of text per step.
      device_bytes: L1 budget (default: a sixth of the experts' bytes).
      host_bytes: L2 budget (default: three quarters of the experts' bytes: as in MoE offloading,
        host memory holds most experts and the device a few).
      access_log: where to write the ``cacheflow`` pass's access log, if anywhere.
      predictor: an MLP predictor checkpoint (``cacheflow train ... --out OUT`` writes
        ``OUT/checkpoint``) to serve ``cacheflow+mlp`` with instead of training one.
      plot: where to save the latency CDF (default: ``latency_cdf.png`` in the run directory).
      prefetch_k: keys asked of each predictor per prediction (default: twice ``top_k``, the
        next layer's experts and as many hedges).
      progress: show a progress bar on stderr.
    """

    workdir: Path | None = None
    requests: int = 200
    warmup: int = 5
    record: int = 300
    seed: int = 0
    layers: int = 8
    experts: int = 8
    expert_mb: float = 2.0
    d_model: int = 512
    top_k: int = 2
    tokens: int = 64
    device_bytes: int | None = None
    host_bytes: int | None = None
    access_log: Path | None = None
    predictor: Path | None = None
    plot: Path | None = None
    prefetch_k: int | None = None
    progress: bool = True

    def model_config(self) -> MoEConfig:
        """The model size these settings ask for.

        Raises:
          DemoError: a size is out of range.
        """
        for name in ("requests", "record", "layers", "experts", "d_model", "top_k", "tokens"):
            if getattr(self, name) < 1:
                raise DemoError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.warmup < 0:
            raise DemoError(f"--warmup must be >= 0, got {self.warmup}")
        if self.top_k > self.experts:
            raise DemoError(f"--top-k {self.top_k} is more than --experts {self.experts}")
        if self.prefetch_k is not None and self.prefetch_k < 1:
            raise DemoError(f"--prefetch-k must be at least 1, got {self.prefetch_k}")
        if not self.expert_mb > 0:
            raise DemoError(f"--expert-mb must be > 0, got {self.expert_mb}")
        d_ff = round(self.expert_mb * MiB / (2 * self.d_model * 4))
        if d_ff < 1:
            raise DemoError(
                f"--expert-mb {self.expert_mb} is too small for --d-model {self.d_model}: an "
                "expert needs at least one hidden unit"
            )
        return MoEConfig(layers=self.layers, experts=self.experts, d_model=self.d_model, d_ff=d_ff)


def default_workdir() -> Path:
    """``$XDG_CACHE_HOME/cacheflow-jax/demo``, else ``~/.cache/cacheflow-jax/demo``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cacheflow-jax" / "demo"


# --------------------------------------------------------------------------------------------
# The checkpoint


def prepare_checkpoint(config: MoEConfig, workdir: Path, *, seed: int) -> tuple[Path, bool]:
    """Returns the step directory of the demo checkpoint, building it unless a valid one exists.

    Args:
      config: the model size.
      workdir: the directory that holds demo checkpoints (one sub-directory per size and seed).
      seed: the weights' seed.

    Returns:
      ``(step directory, whether it was built now)``.

    Raises:
      DemoError: ``workdir`` exists and is not a directory.
    """
    import orbax.checkpoint as ocp

    if workdir.exists() and not workdir.is_dir():
        raise DemoError(f"--workdir {workdir} is a file, not a directory")
    model_dir = workdir / f"{config.name()}-s{seed}"
    manifest = model_dir / "demo.json"
    want = {"format": DEMO_FORMAT, "config": dataclasses.asdict(config), "seed": seed}
    step_dir = model_dir / "ckpt" / "0"
    if _valid(manifest, want, step_dir, config):
        return step_dir, False
    if model_dir.exists():
        shutil.rmtree(model_dir)  # an incomplete or stale build of exactly this configuration
    model_dir.mkdir(parents=True)
    weights = build(config, seed=seed)
    with ocp.CheckpointManager(model_dir / "ckpt") as manager:
        manager.save(0, args=ocp.args.StandardSave(weights))
        manager.wait_until_finished()
    del weights
    manifest.write_text(json.dumps({**want, "step_dir": "ckpt/0"}, indent=1))
    return step_dir, True


def _valid(manifest: Path, want: dict, step_dir: Path, config: MoEConfig) -> bool:
    """True if ``manifest`` describes ``want`` and the checkpoint opens with every array."""
    try:
        have = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    if {k: have.get(k) for k in want} != want:
        return False
    try:
        store = open_store(step_dir)
    except (OSError, ValueError):
        return False
    return len(store.arrays()) == 1 + config.layers * (2 + config.experts)


def drop_page_cache(root: Path) -> None:
    """Flushes and drops the page cache of every file under ``root`` (no root needed)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# --------------------------------------------------------------------------------------------
# The text


def demo_text() -> bytes:
    """The text the demo serves: Python's help topics (`pydoc_data.topics`) as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


def text_steps(text: bytes, *, start: int, end: int, steps: int, tokens: int) -> np.ndarray:
    """``steps`` consecutive windows of ``tokens`` bytes of ``text[start:end]`` (wrapping around).

    Returns:
      ``(steps, tokens)`` int32 byte values.

    Raises:
      DemoError: the part is shorter than one step.
    """
    part = np.frombuffer(text[start:end], np.uint8)
    if len(part) < tokens:
        raise DemoError(f"--tokens {tokens} is longer than the text part ({len(part)} bytes)")
    idx = (np.arange(steps * tokens) % (len(part) - len(part) % tokens)).reshape(steps, tokens)
    return part[idx].astype(np.int32)


# --------------------------------------------------------------------------------------------
# The model as the passes serve it


@dataclasses.dataclass
class DemoModel:
    """What every pass serves: the dense weights on the device and each expert's leaf.

    Attributes:
      config: the model size.
      step_dir: the checkpoint.
      table: the byte embedding, on the device.
      norms: each layer's norm scale, on the device.
      routers: each layer's router, on the device.
      experts: ``experts[l][e]``: expert ``e`` of layer ``l`` (its block keys and `assemble`).
      expert_keys: every expert block key, layer by layer.
      largest: the largest expert block, in bytes.
    """

    config: MoEConfig
    step_dir: Path
    table: jax.Array
    norms: list[jax.Array]
    routers: list[jax.Array]
    experts: list[list[LazyArray]]
    expert_keys: list[str]
    largest: int


def open_model(step_dir: Path, config: MoEConfig) -> DemoModel:
    """Opens the checkpoint lazily and puts the dense weights on the device."""
    # A cache only for this: the dense leaves are read through it; the passes use their own.
    tree = restore_lazy(step_dir, device_bytes=config.weight_bytes, host_bytes=0)
    layers = [tree["layers"][str(i)] for i in range(config.layers)]
    experts = [[node["experts"][str(e)]["w"] for e in range(config.experts)] for node in layers]
    keys = [k for row in experts for leaf in row for k in leaf.keys]
    cache = tree["embed"]["embedding"].cache
    largest = max(cache.info(k).nbytes for k in keys)

    def dense(leaf: LazyArray) -> jax.Array:
        return jax.device_put(np.asarray(leaf))

    return DemoModel(
        config=config,
        step_dir=step_dir,
        table=dense(tree["embed"]["embedding"]),
        norms=[dense(node["norm"]["scale"]) for node in layers],
        routers=[dense(node["router"]) for node in layers],
        experts=experts,
        expert_keys=keys,
        largest=largest,
    )


@dataclasses.dataclass
class PassResult:
    """One pass: the measured steps' latencies (s), a digest of every step's output, the routes."""

    latencies: list[float]
    digest: str
    routes: np.ndarray  # (steps, layers, top_k) int32


class ServedPass:
    """One row's serving, a segment of steps at a time: per layer, route, ``fetch`` the routed
    experts, compute. The demo runs its rows' segments in turn (`SEGMENT`), so that a slow spell
    of the machine falls on every row alike.

    Args:
      model: the model.
      tokens: one device array of byte tokens per step.
      fetch: returns the blocks of the given keys on the device, in order.
      warmup: leading steps that are not measured.
      top_k: experts per layer and step.
      on_measure: called once, before the first measured step.
      tick: called after each step.
    """

    def __init__(
        self,
        model: DemoModel,
        tokens: Sequence[jax.Array],
        fetch: Callable[[list[str]], list[jax.Array]],
        *,
        warmup: int,
        top_k: int,
        on_measure: Callable[[], None] = lambda: None,
        tick: Callable[[], None] = lambda: None,
    ) -> None:
        self.model, self.tokens, self.fetch = model, tokens, fetch
        self.warmup, self.top_k = warmup, top_k
        self.on_measure, self.tick = on_measure, tick
        self.latencies: list[float] = []
        self.routes = np.empty((len(tokens), model.config.layers, top_k), np.int32)
        self.next = 0  # the next step to serve
        self.active = 0.0  # seconds spent serving so far (the pass's own clock)
        self._since: float | None = None  # when the running segment started
        self._digest = hashlib.blake2b(digest_size=16)

    @property
    def done(self) -> bool:
        return self.next >= len(self.tokens)

    def elapsed(self) -> float:
        """Seconds this pass has been serving: its cache's clock, which stands still while the
        other rows run (the predictors' time features see one stream)."""
        since = self._since
        return self.active + (0.0 if since is None else time.monotonic() - since)

    def run(self, steps: int) -> None:
        """Serves the next ``steps`` steps (fewer at the end)."""
        model, top_k, fetch = self.model, self.top_k, self.fetch
        layers = list(zip(model.norms, model.routers, model.experts))
        self._since = time.monotonic()
        try:
            for i in range(self.next, min(self.next + steps, len(self.tokens))):
                if i == self.warmup:
                    self.on_measure()
                t0 = time.perf_counter()
                x = embed(model.table, self.tokens[i])
                for j, (norm, router, experts) in enumerate(layers):
                    h, selected, gates = route(x, norm, router, top_k=top_k)
                    ids = np.asarray(selected)  # waits for the layer before: routing needs it
                    leaves = [experts[e] for e in ids]
                    blocks = iter(fetch([k for leaf in leaves for k in leaf.keys]))
                    w = tuple(leaf.assemble([next(blocks) for _ in leaf.keys]) for leaf in leaves)
                    x = experts_layer(x, h, gates, w)
                    self.routes[i, j] = ids
                x.block_until_ready()
                if i >= self.warmup:
                    self.latencies.append(time.perf_counter() - t0)
                self._digest.update(np.asarray(x).tobytes())
                self.next = i + 1
                self.tick()
        finally:
            self.active += time.monotonic() - self._since
            self._since = None

    def result(self) -> PassResult:
        """The measured steps' latencies, the outputs' digest and the routes."""
        return PassResult(self.latencies, self._digest.hexdigest(), self.routes)


def serve_pass(
    model: DemoModel,
    tokens: Sequence[jax.Array],
    fetch: Callable[[list[str]], list[jax.Array]],
    **options: Any,
) -> PassResult:
    """Serves every step of ``tokens`` in one go; ``options`` are `ServedPass`'s keywords
    (``warmup`` and ``top_k`` required). Only the measured steps' latencies are kept."""
    served = ServedPass(model, tokens, fetch, **options)
    served.run(len(tokens))
    return served.result()


# --------------------------------------------------------------------------------------------
# The predictors


def load_checkpoint(path: Path, log: Callable[[str], None]) -> predictor.Predictor | None:
    """Loads an MLP predictor checkpoint; a damaged one warns once and gives None.

    Raises:
      predictor.CheckpointError: ``path`` is missing or not a checkpoint (pointing at
        ``path/checkpoint`` when ``path`` is a training output directory).
    """
    from predictor import CheckpointError, CorruptCheckpointError
    from predictor import load as load_predictor

    try:
        return load_predictor(path)
    except CorruptCheckpointError as err:
        # A damaged checkpoint must not stop serving: serve without it, and say so once.
        log(f"warning: {err}; serving cacheflow+mlp without the predictor (no prefetch)")
        return None
    except CheckpointError as err:
        inner = Path(path) / "checkpoint"
        if not (inner / "meta").is_dir():
            raise
        raise CheckpointError(f"{err} (did you mean --predictor {inner}?)") from err


def train_mlp(log_path: Path, out: Path, *, k: int, log: Callable[[str], None]) -> Path:
    """Trains the MLP predictor on ``log_path`` with ``python -m training.main`` (a subprocess).

    Returns:
      The checkpoint directory (``out/checkpoint``).

    Raises:
      DemoError: the training failed (the message has its last error line).
    """
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "training.main", str(log_path), "--out", str(out),
           *TRAIN_ARGS, "--top-k", str(k), "--json", "--no-progress"]  # fmt: skip
    log(f"demo: training the MLP predictor: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    # training/ sits beside cacheflow_jax/ in the checkout and in the installed wheel alike.
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DemoError(
            f"training the MLP predictor on {log_path} failed (exit {proc.returncode}): {last}; "
            "pass a trained checkpoint with --predictor instead"
        )
    metrics = json.loads(proc.stdout)
    ev = metrics["eval"]
    log(
        f"demo: trained in {time.perf_counter() - t0:.1f} s; held-out precision/recall: mlp "
        f"{ev['mlp']['precision']:.3f}/{ev['mlp']['recall']:.3f}, markov "
        f"{ev['markov']['precision']:.3f}/{ev['markov']['recall']:.3f}"
    )
    return out / "checkpoint"


def read_log(path: Path) -> list[dict]:
    """The records of an access log v1 file written by `serving` (JSON Lines)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def primed(p: predictor.Predictor, records: Sequence[dict], *, k: int) -> predictor.Predictor:
    """``p`` after a reset and observing ``records``: it starts with the warm-up's history.

    One ``predict(k)`` follows (it changes no state): the MLP's jit compilation happens here,
    not in the prefetch worker during the first served steps.
    """
    p.reset()
    for record in records:
        p.observe(record)
    p.predict(k)
    return p


# --------------------------------------------------------------------------------------------
# The demo


def run_demo(settings: DemoSettings, *, log: Callable[[str], None] = print) -> dict:
    """Runs the demo (see the module note).

    Args:
      settings: what to run.
      log: receives progress lines for people (the CLI sends them to stderr).

    Returns:
      ``{"rows": [...], "setup": {...}}``: one row per pass, named as `ROWS`, with at least the
      keys of `COLUMNS`, ``host_hit_ratio``, ``mean_ms`` and ``steps``; ``setup`` describes the
      run (``header``: the backend, device and what a step is; ``plot``: the CDF's path;
      ``outputs_match``).

    Raises:
      DemoError: invalid settings, or the MLP's training failed.
      cacheflow_jax.BudgetError: a budget is smaller than one block.
      predictor.CheckpointError: ``settings.predictor`` is missing or not a checkpoint
        (checked before any pass runs). A damaged checkpoint (`CorruptCheckpointError`) is
        not an error: the demo warns once and serves ``cacheflow+mlp`` without prefetch.
    """
    from tqdm import tqdm

    import predictor as predictors
    from cacheflow_jax.cache.tiered import TieredCache

    config = settings.model_config()
    mlp, trained = None, None
    if settings.predictor is not None:
        mlp = load_checkpoint(settings.predictor, log)
    expert_total = config.layers * config.experts * config.expert_bytes
    device_bytes = expert_total // 6 if settings.device_bytes is None else settings.device_bytes
    host_bytes = expert_total * 3 // 4 if settings.host_bytes is None else settings.host_bytes
    largest = config.expert_bytes
    for flag, value in (("--device-bytes", device_bytes), ("--host-bytes", host_bytes)):
        if value < largest and not (flag == "--host-bytes" and value == 0):
            raise DemoError(
                f"{flag} {value} is smaller than the model's largest block ({largest} bytes, one "
                f"expert); raise it to at least {largest}"
            )
    workdir = settings.workdir or default_workdir()
    t_build = time.perf_counter()
    step_dir, built = prepare_checkpoint(config, workdir, seed=settings.seed)
    run_dir = step_dir.parent.parent
    log(
        f"demo: {'built' if built else 'reusing'} {config.name()} "
        f"({config.weight_bytes / MiB:.1f} MiB of weights) at {step_dir}"
        + (f" in {time.perf_counter() - t_build:.1f} s" if built else "")
    )
    model = open_model(step_dir, config)
    k = settings.prefetch_k or 2 * settings.top_k * len(model.experts[0][0].keys)
    # As many loads in flight as guesses per prediction: the next layer's experts at once.
    pf_settings = PrefetchSettings(k=k, inflight_bytes=k * model.largest)

    def new_cache(prefetcher: predictor.Predictor | None = None, clock: Any = time.monotonic):
        return TieredCache(
            open_store(step_dir),
            device_bytes=device_bytes,
            host_bytes=host_bytes,
            block_bytes=model.largest,  # one block per expert, whatever the budgets
            prefetcher=prefetcher,
            prefetch=pf_settings if prefetcher is not None else None,
            clock=clock,
        )

    new_cache().close()  # budgets checked before anything runs
    text = demo_text()
    half = len(text) // 2
    steps = settings.warmup + settings.requests
    tokens = settings.tokens
    record_tokens = text_steps(text, start=0, end=half, steps=settings.record, tokens=tokens)
    serve_tokens = text_steps(text, start=half, end=len(text), steps=steps, tokens=tokens)
    record_dev = [jax.device_put(t) for t in record_tokens]
    serve_dev = [jax.device_put(t) for t in serve_tokens]
    device = jax.devices()[0]
    header = (
        f"JAX backend {jax.default_backend()}, device {device.device_kind} ({device}); a step = "
        f"{tokens} bytes of Python's help text through {config.layers} MoE layers, each routing "
        f"the step to its top-{settings.top_k} of {config.experts} experts from the layer's input "
        f"({config.expert_bytes / MiB:g} MiB each), timed until the output is ready"
    )
    log(f"demo: {header}")
    log(
        f"demo: {settings.requests} measured steps (+{settings.warmup} warm-up) per pass, "
        f"{settings.record} recorded warm-up steps; L1 budget {device_bytes / MiB:.1f} MiB, "
        f"L2 {host_bytes / MiB:.1f} MiB of {expert_total / MiB:.1f} MiB of experts; the rows "
        f"take turns of {SEGMENT} steps, each reading its own copy of the checkpoint's files "
        "(page cache dropped before the first turn)"
    )
    bar = tqdm(
        total=settings.record + 5 * steps,
        desc="demo",
        unit="step",
        file=sys.stderr,
        disable=not settings.progress,
        mininterval=0.5,
    )
    common = {"warmup": settings.warmup, "top_k": settings.top_k, "tick": bar.update}
    rows, results = [], {}
    try:
        # Warm-up: record the access log the MLP trains on and the predictors start from.
        bar.set_description("warm-up")
        warm_log = run_dir / "warmup_access.jsonl"
        with new_cache() as cache, serving(cache, access_log=warm_log) as session:
            serve_pass(model, record_dev, session.get_many, **{**common, "warmup": 0})
        records = read_log(warm_log)
        if settings.predictor is None:
            bar.clear()
            trained = train_mlp(warm_log, run_dir / "mlp", k=k, log=log)
            mlp = predictors.load(trained)
        # The prefetching caches' clock continues the warm-up log's: the predictors' time
        # features see one stream, not a jump of the time spent between the two.
        gap = (records[-1]["t"] - records[0]["t"]) / max(len(records) - 1, 1) if records else 0.0
        t_end = (records[-1]["t"] if records else 0.0) + gap

        # all-resident: every expert on the device up front, read from the original files.
        bar.set_description("loading")
        keys = model.expert_keys
        store = open_store(step_dir)
        resident = dict(
            zip(keys, (jax.device_put(f.result(), device) for f in store.read_many(keys)))
        )
        jax.block_until_ready(list(resident.values()))
        # Each other row reads its own copy of the checkpoint's files, whose page cache is
        # dropped once, here: the first L3 read of each chunk in a row is cold, as if the row ran
        # alone, while the rows take turns.
        copies = {name: _row_copy(step_dir, run_dir / "rows" / name) for name in ROWS[:-1]}
        for path in copies.values():
            drop_page_cache(path)
        # baseline: on-demand TensorStore reads, no cache.
        base_store = open_store(copies["baseline"])

        def read_direct(keys: list[str]) -> list[jax.Array]:
            return [jax.device_put(f.result(), device) for f in base_store.read_many(keys)]

        prefetchers = {
            "cacheflow": None,
            "cacheflow+markov": primed(predictors.markov(), records, k=k),
            "cacheflow+mlp": None if mlp is None else primed(mlp, records, k=k),
        }
        passes = {"baseline": ServedPass(model, serve_dev, read_direct, **common)}
        caches = {}
        with contextlib.ExitStack() as stack:
            for name, prefetcher in prefetchers.items():
                # The cache's clock continues the warm-up log's and runs only while its row
                # serves, so the predictors' time features see one stream.
                served: list[ServedPass] = []
                cache = stack.enter_context(TieredCache(
                    open_store(copies[name]),
                    device_bytes=device_bytes,
                    host_bytes=host_bytes,
                    block_bytes=model.largest,  # one block per expert, whatever the budgets
                    prefetcher=prefetcher,
                    prefetch=pf_settings if prefetcher is not None else None,
                    clock=lambda s=served: t_end + (s[0].elapsed() if s else 0.0),
                ))  # fmt: skip
                access_log = settings.access_log if name == "cacheflow" else None
                session = stack.enter_context(serving(cache, access_log=access_log))
                served.append(ServedPass(
                    model, serve_dev, session.get_many, on_measure=cache.reset_counters, **common
                ))  # fmt: skip
                passes[name], caches[name] = served[0], cache
            passes["all-resident"] = ServedPass(
                model, serve_dev, lambda ks: [resident[k] for k in ks], **common
            )
            # The rows take turns of SEGMENT steps: a slow spell of a shared machine falls on
            # all of them, not on whichever row happened to run then.
            while not all(p.done for p in passes.values()):
                for name, served_pass in passes.items():
                    bar.set_description(name)
                    served_pass.run(SEGMENT)
                    if name in caches:
                        _quiet(caches[name])  # its prefetch worker's last loads land now
        results = {name: served_pass.result() for name, served_pass in passes.items()}
        rows = [
            _row("baseline", results["baseline"].latencies),
            *(_row(name, results[name].latencies, caches[name].stats()) for name in caches),
            _row("all-resident", results["all-resident"].latencies, resident=True),
        ]
        resident.clear()
    finally:
        bar.close()
    base, limit = rows[0]["p95_ms"], rows[-1]["p95_ms"]
    for row in rows:
        row["p95_ratio_to_baseline"] = row["p95_ms"] / base if base else 0.0
        row["p95_ratio_to_resident"] = row["p95_ms"] / limit if limit else 0.0
    ref = results["baseline"]
    same = all(
        r.digest == ref.digest and np.array_equal(r.routes, ref.routes) for r in results.values()
    )
    if not same:
        log("demo: WARNING: the passes' outputs differ; the cache served wrong data")
    plot = settings.plot or run_dir / "latency_cdf.png"
    plot_cdf(results, plot, title=f"cacheflow demo: {config.name()}, {settings.requests} steps")
    log(f"demo: latency CDF saved to {plot}")
    setup = {
        "model": config.name(),
        "step_dir": str(step_dir),
        "header": header,
        "backend": jax.default_backend(),
        "device": str(device),
        "weight_bytes": config.weight_bytes,
        "expert_bytes": config.expert_bytes,
        "blocks": len(model.expert_keys),
        "device_bytes": device_bytes,
        "host_bytes": host_bytes,
        "requests": settings.requests,
        "warmup": settings.warmup,
        "record": settings.record,
        "tokens": tokens,
        "top_k": settings.top_k,
        "prefetch": dataclasses.asdict(pf_settings),
        "predictor": str(settings.predictor or trained),
        "predictor_trained": settings.predictor is None,
        "warmup_log": str(warm_log),
        "outputs_match": same,
        "plot": str(plot),
        "loadavg": list(os.getloadavg()),
    }
    return {"rows": rows, "setup": setup}



def _row_copy(step_dir: Path, dst: Path) -> Path:
    """A copy of the checkpoint's files for one row (kept while it matches, else made again)."""
    want = sorted(
        (str(f.relative_to(step_dir)), f.stat().st_size) for f in step_dir.rglob("*") if f.is_file()
    )
    if dst.is_dir():
        have = sorted(
            (str(f.relative_to(dst)), f.stat().st_size) for f in dst.rglob("*") if f.is_file()
        )
        if have == want:
            return dst
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(step_dir, dst)
    return dst


def _quiet(cache: Any, timeout: float = 1.0) -> None:
    """Waits (up to ``timeout`` s) until the cache's prefetch worker has nothing left to do, so
    that its work does not run into the next row's turn."""
    worker = cache._pf_worker
    end = time.monotonic() + timeout
    while worker is not None and time.monotonic() < end:
        if worker.idle and not worker.feed and not worker.arrived and not cache._pf_inflight:
            return
        time.sleep(0.0005)

def _row(
    name: str, latencies: Sequence[float], stats: dict | None = None, *, resident: bool = False
) -> dict:
    """One result row; the p95 ratios are filled in once every pass ran.

    ``stats`` (a cache's, counted over the measured steps) gives the hit ratios and prefetch
    figures; without it the row is the baseline (nothing on the device before a step) or, with
    ``resident``, the all-resident limit.
    """
    ms = np.asarray(latencies) * 1e3
    if stats is None:
        l1, host, l3 = (1.0, 0.0, 0.0) if resident else (0.0, 0.0, 1.0)
        accuracy = coverage = 0.0
        prefetch = None
    else:
        n = max(stats["requests"], 1)
        l1, host, l3 = stats["hits"]["device"] / n, stats["hits"]["host"] / n, stats["misses"] / n
        prefetch = stats["prefetch"]
        accuracy, coverage = prefetch["accuracy"], prefetch["coverage"]
    row = {
        "name": name,
        "l1_hit_ratio": round(float(l1), 4),
        "host_hit_ratio": round(float(host), 4),
        "l3_share": round(float(l3), 4),
        "prefetch_accuracy": round(float(accuracy), 4),
        "prefetch_coverage": round(float(coverage), 4),
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "p95_ratio_to_baseline": 1.0,
        "p95_ratio_to_resident": 1.0,
        "mean_ms": float(ms.mean()),
        "steps": len(ms),
    }
    if prefetch is not None:
        row["prefetch"] = prefetch
    return row


def plot_cdf(results: dict[str, PassResult], path: Path, *, title: str) -> None:
    """Saves the step-latency CDF of every pass to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, result in results.items():
        ms = np.sort(np.asarray(result.latencies) * 1e3)
        ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=name)
    ax.set_xscale("log")
    # Labelled ticks at 1, 2, 3 and 5 of each decade: the steps often span less than one decade
    # (15 to 80 ms), where decade ticks alone would leave the axis without a number.
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.LogLocator(base=10, subs="auto"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("step latency (ms, log scale)")
    ax.set_ylabel("fraction of steps")
    ax.axhline(0.95, color="grey", lw=0.5, ls=":")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(rows: Sequence[dict]) -> str:
    """The rows as a plain-text table with the `COLUMNS`."""
    cells = [[title for _, title in COLUMNS]]
    for row in rows:
        cells.append(
            [row["name"]]
            + [f"{row[c]:.3f}" for c in ("l1_hit_ratio", "l3_share")]
            + [
                f"{row[c]:.3f}" if row.get("prefetch", {}).get("issued") else "-"
                for c in ("prefetch_accuracy", "prefetch_coverage")
            ]
            + [f"{row[c]:.2f}" for c in ("p50_ms", "p95_ms")]
            + [f"{row[c]:.2f}x" for c in ("p95_ratio_to_baseline", "p95_ratio_to_resident")]
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
