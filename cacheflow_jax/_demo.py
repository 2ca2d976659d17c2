"""``cacheflow demo``: serve a mixture-of-experts model whose weights do not fit on the device.

What it does, in order:

1. Builds a Flax NNX MoE stack (`cacheflow_jax._demo_model`) once and saves it with an orbax
   ``CheckpointManager`` under the work directory; later runs reuse it while its ``demo.json``
   matches the requested size and the checkpoint opens.
2. Draws one request stream: per step and layer, ``top_k`` experts from a Zipf distribution
   (a different expert ranking per layer), from ``seed``.
3. Serves that stream three times, each after a few unmeasured warm-up steps (jit compilation)
   and after dropping the page cache of the checkpoint's files (``POSIX_FADV_DONTNEED``), so the
   first L3 read of each chunk is really cold:

   * ``baseline``: each step reads the routed experts' chunks from TensorStore (``read_many``)
     and ``device_put``\\ s them; nothing is kept between steps;
   * ``cacheflow``: the blocks come from ``cfj.serving(cache)`` over ``restore_lazy(step_dir)``,
     one ``get_many`` per layer;
   * ``all-resident``: every weight is put on the device once up front (the limit).

4. With ``predictor=`` (``cacheflow demo --predictor DIR``), after the three passes, replays the
   cacheflow pass's accesses (the same keys in the same order, warm-up steps included) through the
   loaded predictor: it ``observe``\\ s each access and calls ``predict(k)`` once per step, after
   the step's last access, with ``k`` = the blocks of one layer step (what a prefetcher would
   fetch ahead for the next layer). `PREDICT_WARMUP` calls before the replay and the calls of
   the warm-up steps are not timed; the median of the measured steps' calls (``predict_us``) is
   compared with the cacheflow pass's median step time from the same run. The replay runs
   outside the timed passes, so it does not change their numbers.

Each step runs the same jitted layer function on the same inputs in every pass, so the passes'
outputs must agree bitwise; the demo checks that. Latencies are per step (all layers, up to the
output being ready). Times on a CPU are for comparing the passes of one run, not absolute claims.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from cacheflow_jax._demo_model import MoEConfig, build, moe_layer
from cacheflow_jax._serving import serving
from cacheflow_jax._store import open_store
from cacheflow_jax.orbax import LazyArray, restore_lazy

if TYPE_CHECKING:  # the library imports `predictor` only when the demo is given one
    import predictor

MiB = 2**20
DEMO_FORMAT = 1
COLUMNS = ("name", "l1_hit_ratio", "host_hit_ratio", "p50_ms", "p95_ms", "p95_ratio_to_baseline")
PREDICT_WARMUP = 5  # untimed predict calls before the replay: jit compilation, first features


class DemoError(ValueError):
    """The demo's settings are invalid; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """Everything ``cacheflow demo`` can be told.

    Attributes:
      workdir: where the model checkpoint lives (default: `default_workdir`).
      requests: measured steps per pass.
      warmup: unmeasured steps before each pass (jit compilation, first reads).
      seed: seeds the model weights and the request stream.
      layers: MoE layers.
      experts: experts per layer.
      expert_mb: MiB per expert (both matrices); sets the expert hidden width.
      d_model: width of the residual stream.
      top_k: experts per layer per step.
      tokens: tokens per step.
      zipf: the Zipf exponent of expert popularity.
      device_bytes: L1 budget (default: a sixth of the weights).
      host_bytes: L2 budget (default: a third of the weights).
      access_log: where to write the cacheflow pass's access log, if anywhere.
      predictor: a predictor checkpoint (``cacheflow train ... --out OUT`` writes
        ``OUT/checkpoint``) to time against the cacheflow pass's steps, if any.
      progress: show a progress bar on stderr.
    """

    workdir: Path | None = None
    requests: int = 200
    warmup: int = 5
    seed: int = 0
    layers: int = 8
    experts: int = 8
    expert_mb: float = 2.0
    d_model: int = 512
    top_k: int = 2
    tokens: int = 8
    zipf: float = 1.1
    device_bytes: int | None = None
    host_bytes: int | None = None
    access_log: Path | None = None
    predictor: Path | None = None
    progress: bool = True

    def model_config(self) -> MoEConfig:
        """The model size these settings ask for.

        Raises:
          DemoError: a size is out of range.
        """
        for name in ("requests", "layers", "experts", "d_model", "top_k", "tokens"):
            if getattr(self, name) < 1:
                raise DemoError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.warmup < 0:
            raise DemoError(f"--warmup must be >= 0, got {self.warmup}")
        if self.top_k > self.experts:
            raise DemoError(f"--top-k {self.top_k} is more than --experts {self.experts}")
        if not self.expert_mb > 0:
            raise DemoError(f"--expert-mb must be > 0, got {self.expert_mb}")
        if not self.zipf >= 0:
            raise DemoError(f"--zipf must be >= 0, got {self.zipf}")
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
    return len(store.arrays()) == config.layers * (2 + 2 * config.experts)


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
# The request stream


def request_stream(
    config: MoEConfig, steps: int, *, top_k: int, zipf: float, seed: int
) -> np.ndarray:
    """Draws the routed experts: ``(steps, layers, top_k)`` int32, distinct within a layer.

    Expert popularity follows ``p(rank) ~ 1 / (rank + 1) ** zipf``; each layer ranks its experts
    by its own random permutation, so the hot experts differ between layers.
    """
    rng = np.random.default_rng([seed, 1])
    p = 1.0 / np.arange(1, config.experts + 1) ** zipf
    p /= p.sum()
    ranking = [rng.permutation(config.experts) for _ in range(config.layers)]
    out = np.empty((steps, config.layers, top_k), np.int32)
    for s in range(steps):
        for layer in range(config.layers):
            out[s, layer] = ranking[layer][rng.choice(config.experts, top_k, replace=False, p=p)]
    return out


# --------------------------------------------------------------------------------------------
# Serving passes


@dataclasses.dataclass
class _LayerStep:
    """What one layer of one step needs: its leaves, their block keys and the routed ids."""

    leaves: list[LazyArray]
    keys: list[str]
    selected: jax.Array


def _plan(tree: Any, routes: np.ndarray, top_k: int) -> list[list[_LayerStep]]:
    """Turns the routed expert ids into per-step, per-layer leaves and block keys."""
    layers = tree["layers"]
    out = []
    for step in routes:
        plan = []
        for layer, sel in enumerate(step):
            node = layers[str(layer)]
            experts = [node["experts"][str(int(e))] for e in sel]
            leaves = [node["norm"]["scale"], node["router"]]
            leaves += [e["w_in"] for e in experts] + [e["w_out"] for e in experts]
            keys = [k for leaf in leaves for k in leaf.keys]
            plan.append(_LayerStep(leaves, keys, jax.device_put(np.asarray(sel, np.int32))))
        out.append(plan)
    return out


def _run_pass(
    plan: list[list[_LayerStep]],
    inputs: Sequence[jax.Array],
    fetch: Callable[[list[str]], list[jax.Array]],
    *,
    warmup: int,
    top_k: int,
    on_measure: Callable[[], None],
    tick: Callable[[], None],
) -> tuple[list[float], jax.Array]:
    """Serves every step; returns the measured steps' latencies (s) and the last output."""
    latencies = []
    x = inputs[0]
    for i, (layers, x0) in enumerate(zip(plan, inputs)):
        if i == warmup:
            on_measure()
        t0 = time.perf_counter()
        x = x0
        for ls in layers:
            blocks = iter(fetch(ls.keys))
            w = [leaf.assemble([next(blocks) for _ in leaf.keys]) for leaf in ls.leaves]
            x = moe_layer(
                x, w[0], w[1], ls.selected, tuple(w[2 : 2 + top_k]), tuple(w[2 + top_k :])
            )
        x.block_until_ready()
        if i >= warmup:
            latencies.append(time.perf_counter() - t0)
        tick()
    return latencies, x


def run_demo(settings: DemoSettings, *, log: Callable[[str], None] = print) -> dict:
    """Runs the demo (see the module note).

    Args:
      settings: what to run.
      log: receives progress lines for people (the CLI sends them to stderr).

    Returns:
      ``{"rows": [...], "setup": {...}}``: one row per pass with at least the keys of `COLUMNS`;
      with ``settings.predictor`` the ``cacheflow`` row also has ``"predictor"`` (see
      `time_predictor`).

    Raises:
      DemoError: invalid settings.
      cacheflow_jax.BudgetError: a budget is smaller than one block.
      predictor.CheckpointError: ``settings.predictor`` is missing or not a checkpoint
        (checked before any pass runs). A damaged checkpoint (`CorruptCheckpointError`) is
        not an error: the demo warns once and runs without the predictor.
    """
    from tqdm import tqdm

    from cacheflow_jax._cache import TieredCache

    config = settings.model_config()
    mlp = None
    if settings.predictor is not None:
        from predictor import CheckpointError, CorruptCheckpointError
        from predictor import load as load_predictor

        try:
            mlp = load_predictor(settings.predictor)
        except CorruptCheckpointError as e:
            # A damaged checkpoint must not stop serving: run without the predictor, and say so.
            log(f"warning: {e}; running without the predictor")
            mlp = None
        except CheckpointError as e:
            inner = Path(settings.predictor) / "checkpoint"
            if not (inner / "meta").is_dir():
                raise
            raise CheckpointError(f"{e} (did you mean --predictor {inner}?)") from e
    device_bytes = (
        config.weight_bytes // 6 if settings.device_bytes is None else settings.device_bytes
    )
    host_bytes = config.weight_bytes // 3 if settings.host_bytes is None else settings.host_bytes
    largest = config.d_model * max(config.d_ff, config.experts) * 4
    for flag, value in (("--device-bytes", device_bytes), ("--host-bytes", host_bytes)):
        if value < largest and not (flag == "--host-bytes" and value == 0):
            raise DemoError(
                f"{flag} {value} is smaller than the model's largest block ({largest} bytes, one "
                f"expert matrix); raise it to at least {largest}"
            )
    workdir = Path(settings.workdir) if settings.workdir is not None else default_workdir()
    t_build = time.perf_counter()
    step_dir, built = prepare_checkpoint(config, workdir, seed=settings.seed)
    log(
        f"demo: {'built' if built else 'reusing'} {config.name()} "
        f"({config.weight_bytes / MiB:.1f} MiB of weights) at {step_dir}"
        + (f" in {time.perf_counter() - t_build:.1f} s" if built else "")
    )
    tree = restore_lazy(step_dir, device_bytes=device_bytes, host_bytes=host_bytes)
    cache: TieredCache = tree["layers"]["0"]["router"].cache
    store = cache.store
    steps = settings.warmup + settings.requests
    routes = request_stream(
        config, steps, top_k=settings.top_k, zipf=settings.zipf, seed=settings.seed
    )
    plan = _plan(tree, routes, settings.top_k)
    rng = np.random.default_rng([settings.seed, 2])
    inputs = [
        jax.device_put(rng.standard_normal((settings.tokens, config.d_model), np.float32))
        for _ in range(steps)
    ]
    blocks_per_step = sum(len(ls.keys) for ls in plan[0])
    log(
        f"demo: {settings.requests} requests (+{settings.warmup} warm-up) x {config.layers} "
        f"layers, top-{settings.top_k} of {config.experts} experts (Zipf {settings.zipf}), "
        f"{blocks_per_step} blocks/step; device budget {device_bytes / MiB:.1f} MiB, host "
        f"budget {host_bytes / MiB:.1f} MiB; page cache dropped before each pass"
    )
    device = jax.devices()[0]
    bar = tqdm(
        total=3 * steps,
        desc="demo",
        unit="step",
        file=sys.stderr,
        disable=not settings.progress,
        mininterval=0.5,
    )
    common = {"warmup": settings.warmup, "top_k": settings.top_k, "tick": bar.update}
    rows, outputs = [], {}
    try:
        # baseline: on-demand TensorStore reads, no cache.
        bar.set_description("baseline")
        drop_page_cache(step_dir)

        def read_direct(keys: list[str]) -> list[jax.Array]:
            return [jax.device_put(f.result(), device) for f in store.read_many(keys)]

        lat, outputs["baseline"] = _run_pass(
            plan, inputs, read_direct, on_measure=lambda: None, **common
        )
        rows.append(_row("baseline", lat, l1=0.0, host=0.0))

        # cacheflow: the tiered cache, through serving().
        bar.set_description("cacheflow")
        drop_page_cache(step_dir)
        marks: list[dict] = []
        with serving(cache, access_log=settings.access_log) as session:
            lat, outputs["cacheflow"] = _run_pass(
                plan,
                inputs,
                session.get_many,
                on_measure=lambda: marks.append(cache.stats()),
                **common,
            )
            end = cache.stats()
        start = marks[0] if marks else _zero_stats()
        requests = end["requests"] - start["requests"]
        l1 = (end["hits"]["device"] - start["hits"]["device"]) / max(requests, 1)
        l2 = (end["hits"]["host"] - start["hits"]["host"]) / max(requests, 1)
        rows.append(_row("cacheflow", lat, l1=l1, host=l2))
        cache_stats = end

        # all-resident: every weight on the device up front.
        bar.set_description("all-resident")
        drop_page_cache(step_dir)
        keys = list(store.keys())
        resident = dict(
            zip(keys, (jax.device_put(f.result(), device) for f in store.read_many(keys)))
        )
        jax.block_until_ready(list(resident.values()))
        lat, outputs["all-resident"] = _run_pass(
            plan,
            inputs,
            lambda ks: [resident[k] for k in ks],
            on_measure=lambda: None,
            **common,
        )
        rows.append(_row("all-resident", lat, l1=1.0, host=0.0))
        resident.clear()
    finally:
        bar.close()
    base = rows[0]["p95_ms"]
    for row in rows:
        row["p95_ratio_to_baseline"] = row["p95_ms"] / base if base else 0.0
    if mlp is not None:
        log(f"demo: replaying the cacheflow pass's accesses through {settings.predictor}")
        accesses = _accesses(plan, cache, step_seconds=rows[1]["p50_ms"] / 1e3)
        timing = time_predictor(mlp, accesses, warmup=settings.warmup, k=len(plan[0][0].keys))
        step_us = rows[1]["p50_ms"] * 1e3
        rows[1]["predictor"] = {
            "checkpoint": str(Path(settings.predictor).expanduser().resolve()),
            **timing,
            "step_p50_ms": rows[1]["p50_ms"],
            "predict_share_of_step": timing["predict_us"] / step_us if step_us else 0.0,
            "observe_share_of_step": timing["observe_us_per_step"] / step_us if step_us else 0.0,
        }
    ref = np.asarray(outputs["baseline"])
    same = all(np.array_equal(np.asarray(v), ref) for v in outputs.values())
    if not same:
        log("demo: WARNING: the passes' outputs differ; the cache served wrong data")
    setup = {
        "model": config.name(),
        "step_dir": str(step_dir),
        "weight_bytes": config.weight_bytes,
        "blocks": len(store.keys()),
        "device_bytes": device_bytes,
        "host_bytes": host_bytes,
        "requests": settings.requests,
        "warmup": settings.warmup,
        "blocks_per_step": blocks_per_step,
        "outputs_match": same,
        "cache": cache_stats,
        "backend": jax.default_backend(),
    }
    return {"rows": rows, "setup": setup}


def _accesses(
    plan: list[list[_LayerStep]], cache: Any, *, step_seconds: float
) -> list[list[predictor.Access]]:
    """The accesses of a pass over ``plan``, per step, as `predictor.Access` records.

    A pass makes one ``get_many`` per layer, so a layer's blocks share a time; the times advance
    by ``step_seconds`` (the pass's median step time) per step, spread evenly over the layers.
    """
    from predictor import Access

    info: dict[str, tuple[int, str]] = {}
    out = []
    for i, layers in enumerate(plan):
        step = []
        for j, ls in enumerate(layers):
            t = (i + j / len(layers)) * step_seconds
            for key in ls.keys:
                if key not in info:
                    info[key] = (cache.info(key).nbytes, cache.kind(key))
                step.append(Access(key, t, *info[key], f"r{i}"))
        out.append(step)
    return out


def time_predictor(
    mlp: predictor.Predictor,
    accesses: Sequence[Sequence[predictor.Access]],
    *,
    warmup: int,
    k: int,
) -> dict[str, Any]:
    """Times ``mlp`` on a stream: per step, ``observe`` each access, then one ``predict(k)``.

    The predictor is reset first. `PREDICT_WARMUP` calls after observing the first step, then a
    reset, warm it up (jit compilation); the calls of the first ``warmup`` steps are not timed
    either, so the timed calls are those of the steps whose latencies the demo measures.

    Args:
      mlp: the predictor.
      accesses: the accesses of each step, in order.
      warmup: leading steps whose calls are not timed.
      k: keys asked for per ``predict`` call.

    Returns:
      ``{"predict_us", "predict_p95_us": median and p95 microseconds of one predict call,
      "observe_us_per_step": median microseconds to observe one step's accesses, "calls": timed
      calls, "k", "accesses_per_step", "warmup_calls": untimed calls}``.

    Raises:
      DemoError: no step is left to time after ``warmup``.
    """
    if len(accesses) <= warmup:
        raise DemoError(
            f"no step to time the predictor on: {len(accesses)} steps, {warmup} warm-up"
        )
    mlp.reset()
    for access in accesses[0]:
        mlp.observe(access)
    for _ in range(PREDICT_WARMUP):
        mlp.predict(k)
    mlp.reset()
    clock = time.perf_counter_ns
    predict_ns, observe_ns = [], []
    for i, step in enumerate(accesses):
        t0 = clock()
        for access in step:
            mlp.observe(access)
        t1 = clock()
        mlp.predict(k)
        t2 = clock()
        if i >= warmup:
            observe_ns.append(t1 - t0)
            predict_ns.append(t2 - t1)
    predict_us = np.asarray(predict_ns) / 1e3
    return {
        "predict_us": float(np.median(predict_us)),
        "predict_p95_us": float(np.percentile(predict_us, 95)),
        "observe_us_per_step": float(np.median(np.asarray(observe_ns) / 1e3)),
        "calls": len(predict_ns),
        "k": k,
        "accesses_per_step": len(accesses[0]),
        "warmup_calls": PREDICT_WARMUP + warmup,
    }


def format_predictor(row: dict) -> str:
    """One line comparing the predictor's cost with the ``row``'s median step time."""
    p = row["predictor"]
    return (
        f"predictor: predict({p['k']}) median {p['predict_us']:.1f} us (p95 "
        f"{p['predict_p95_us']:.1f} us, {p['calls']} calls) = {100 * p['predict_share_of_step']:.2f}% "
        f"of the {row['name']} step p50 {p['step_p50_ms']:.2f} ms; observing a step's "
        f"{p['accesses_per_step']} accesses {p['observe_us_per_step']:.1f} us "
        f"({100 * p['observe_share_of_step']:.2f}%)"
    )


def _zero_stats() -> dict:
    return {"requests": 0, "hits": {"device": 0, "host": 0}}


def _row(name: str, latencies: Sequence[float], *, l1: float, host: float) -> dict:
    """One result row; ``p95_ratio_to_baseline`` is filled in once the baseline is known."""
    ms = np.asarray(latencies) * 1e3
    return {
        "name": name,
        "l1_hit_ratio": round(float(l1), 4),
        "host_hit_ratio": round(float(host), 4),
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "p95_ratio_to_baseline": 1.0,
        "mean_ms": float(ms.mean()),
        "steps": len(ms),
    }


def format_table(rows: Sequence[dict]) -> str:
    """The rows as a plain-text table with the `COLUMNS`."""
    cells = [list(COLUMNS)]
    for row in rows:
        cells.append(
            [row["name"]]
            + [f"{row[c]:.3f}" for c in ("l1_hit_ratio", "host_hit_ratio")]
            + [f"{row[c]:.2f}" for c in ("p50_ms", "p95_ms", "p95_ratio_to_baseline")]
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
