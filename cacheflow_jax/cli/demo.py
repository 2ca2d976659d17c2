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

The parts: `cacheflow_jax.cli.demo_settings` (`DemoSettings`, `DemoError`),
`cacheflow_jax.cli.demo_data` (the checkpoint and the text), `cacheflow_jax.cli.demo_passes` (the
model as the passes serve it, `ServedPass`), `cacheflow_jax.cli.demo_predictors` (the MLP and the
warm-up's history), `cacheflow_jax.cli.demo_report` (the rows, the table, the CDF); this module
runs them (`run_demo`), is the ``cacheflow demo`` command (`cmd_demo`), and re-exports their
public names.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from cacheflow_jax.cli.common import check_output_file, human_size
from cacheflow_jax.cli.demo_data import (
    DEMO_FORMAT,
    demo_text,
    drop_page_cache,
    prepare_checkpoint,
    row_copy,
    text_steps,
)
from cacheflow_jax.cli.demo_model import MoEConfig
from cacheflow_jax.cli.demo_passes import (
    DemoModel,
    PassResult,
    ServedPass,
    open_model,
    quiet,
    serve_pass,
)
from cacheflow_jax.cli.demo_predictors import (
    TRAIN_ARGS,
    load_checkpoint,
    primed,
    read_log,
    train_mlp,
)
from cacheflow_jax.cli.demo_report import COLUMNS, LEGEND, format_table, plot_cdf, result_row
from cacheflow_jax.cli.demo_settings import DemoError, DemoSettings, MiB, default_workdir
from cacheflow_jax.prefetch.scheduler import PrefetchSettings
from cacheflow_jax.session.session import serving
from cacheflow_jax.store.open import open_store

if TYPE_CHECKING:  # the library imports `predictor` only through the Predictor protocol
    import predictor
    from cacheflow_jax.cache.tiered import TieredCache

# The demo's parts, importable from here as before they had modules of their own.
__all__ = [
    "COLUMNS",
    "DEMO_FORMAT",
    "LEGEND",
    "MiB",
    "ROWS",
    "SEGMENT",
    "TRAIN_ARGS",
    "DemoError",
    "DemoModel",
    "DemoSettings",
    "PassResult",
    "ServedPass",
    "cmd_demo",
    "default_workdir",
    "demo_text",
    "drop_page_cache",
    "format_table",
    "load_checkpoint",
    "open_model",
    "plot_cdf",
    "prepare_checkpoint",
    "primed",
    "read_log",
    "run_demo",
    "serve_pass",
    "text_steps",
    "train_mlp",
]

ROWS = ("baseline", "cacheflow", "cacheflow+markov", "cacheflow+mlp", "all-resident")
SEGMENT = 10  # steps each row serves in its turn


@dataclasses.dataclass
class _Run:
    """A demo run once its inputs are ready: the checkpoint, the model, the budgets, the steps."""

    settings: DemoSettings
    config: MoEConfig
    step_dir: Path
    run_dir: Path
    model: DemoModel
    device_bytes: int
    host_bytes: int
    k: int  # keys asked of each predictor per prediction
    pf_settings: PrefetchSettings
    record_dev: list[jax.Array] = dataclasses.field(default_factory=list)  # warm-up steps
    serve_dev: list[jax.Array] = dataclasses.field(default_factory=list)  # served steps
    device: Any = None  # where the steps run
    header: str = ""  # the backend, the device and what a step is

    def new_cache(
        self,
        prefetcher: predictor.Predictor | None = None,
        clock: Any = time.monotonic,
        *,
        files: Path | None = None,
    ) -> TieredCache:
        """A cache with the run's budgets over the checkpoint, or a row's copy of its ``files``."""
        from cacheflow_jax.cache.tiered import TieredCache

        return TieredCache(
            open_store(self.step_dir if files is None else files),
            device_bytes=self.device_bytes,
            host_bytes=self.host_bytes,
            block_bytes=self.model.largest,  # one block per expert, whatever the budgets
            prefetcher=prefetcher,
            prefetch=self.pf_settings if prefetcher is not None else None,
            clock=clock,
        )


@dataclasses.dataclass
class _WarmUp:
    """What the warm-up left: its access log and records, the MLP, the cache clock's start."""

    log: Path
    records: list[dict]
    mlp: predictor.Predictor | None
    trained: Path | None  # the MLP trained on the log (None: given with --predictor)
    t_end: float


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

    config = settings.model_config()
    mlp = None
    if settings.predictor is not None:
        mlp = load_checkpoint(settings.predictor, log)
    run = _prepare(settings, config, log)
    steps = settings.warmup + settings.requests
    bar = tqdm(
        total=settings.record + 5 * steps,
        desc="demo",
        unit="step",
        file=sys.stderr,
        disable=not settings.progress,
        mininterval=0.5,
    )
    common = {"warmup": settings.warmup, "top_k": settings.top_k, "tick": bar.update}
    try:
        warm = _warm_up(run, mlp, bar, common, log)
        results, rows = _serve_rows(run, warm, bar, common)
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
    plot = settings.plot or run.run_dir / "latency_cdf.png"
    plot_cdf(results, plot, title=f"cacheflow demo: {config.name()}, {settings.requests} steps")
    log(f"demo: latency CDF saved to {plot}")
    return {"rows": rows, "setup": _setup(run, warm, same=same, plot=plot)}


def _prepare(settings: DemoSettings, config: MoEConfig, log: Callable[[str], None]) -> _Run:
    """Checks the budgets, builds (or reuses) the checkpoint, opens the model, puts the steps'
    tokens on the device and says what runs; nothing is served yet."""
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
    copies = len(ROWS) - 1  # every row but all-resident reads its own copy of the files
    log(
        f"demo: writes under {workdir} (choose the place with --workdir): the checkpoint "
        f"({human_size(config.weight_bytes)}, built once and reused), a copy of it for each "
        f"of {copies} rows, the warm-up's access log and the MLP: about "
        f"{human_size((1 + copies) * config.weight_bytes)} in all; delete the folder to free it"
    )
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
    run = _Run(
        settings=settings,
        config=config,
        step_dir=step_dir,
        run_dir=run_dir,
        model=model,
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        k=k,
        # As many loads in flight as guesses per prediction: the next layer's experts at once.
        pf_settings=PrefetchSettings(k=k, inflight_bytes=k * model.largest),
    )
    run.new_cache().close()  # budgets checked before anything runs
    text = demo_text()
    half = len(text) // 2
    steps = settings.warmup + settings.requests
    tokens = settings.tokens
    record_tokens = text_steps(text, start=0, end=half, steps=settings.record, tokens=tokens)
    serve_tokens = text_steps(text, start=half, end=len(text), steps=steps, tokens=tokens)
    run.record_dev = [jax.device_put(t) for t in record_tokens]
    run.serve_dev = [jax.device_put(t) for t in serve_tokens]
    device = run.device = jax.devices()[0]
    run.header = (
        f"JAX backend {jax.default_backend()}, device {device.device_kind} ({device}); a step = "
        f"{tokens} bytes of Python's help text through {config.layers} MoE layers, each routing "
        f"the step to its top-{settings.top_k} of {config.experts} experts from the layer's input "
        f"({config.expert_bytes / MiB:g} MiB each), timed until the output is ready"
    )
    log(f"demo: {run.header}")
    log(
        f"demo: {settings.requests} measured steps (+{settings.warmup} warm-up) per pass, "
        f"{settings.record} recorded warm-up steps; L1 budget {device_bytes / MiB:.1f} MiB, "
        f"L2 {host_bytes / MiB:.1f} MiB of {expert_total / MiB:.1f} MiB of experts; the rows "
        f"take turns of {SEGMENT} steps, each reading its own copy of the checkpoint's files "
        "(page cache dropped before the first turn)"
    )
    return run


def _warm_up(
    run: _Run,
    mlp: predictor.Predictor | None,
    bar: Any,
    common: dict[str, Any],
    log: Callable[[str], None],
) -> _WarmUp:
    """Records the access log the MLP trains on and the predictors start from; trains the MLP
    on it unless a checkpoint was given (``mlp``)."""
    import predictor as predictors

    settings, trained = run.settings, None
    bar.set_description("warm-up")
    warm_log = run.run_dir / "warmup_access.jsonl"
    with run.new_cache() as cache, serving(cache, access_log=warm_log) as session:
        serve_pass(run.model, run.record_dev, session.get_many, **{**common, "warmup": 0})
    records = read_log(warm_log)
    if settings.predictor is None:
        bar.clear()
        trained = train_mlp(warm_log, run.run_dir / "mlp", k=run.k, log=log)
        mlp = predictors.load(trained)
    # The prefetching caches' clock continues the warm-up log's: the predictors' time
    # features see one stream, not a jump of the time spent between the two.
    gap = (records[-1]["t"] - records[0]["t"]) / max(len(records) - 1, 1) if records else 0.0
    t_end = (records[-1]["t"] if records else 0.0) + gap
    return _WarmUp(log=warm_log, records=records, mlp=mlp, trained=trained, t_end=t_end)


def _serve_rows(
    run: _Run, warm: _WarmUp, bar: Any, common: dict[str, Any]
) -> tuple[dict[str, PassResult], list[dict]]:
    """Serves the steps once per row, the rows taking turns of `SEGMENT` steps.

    Returns:
      Each row's `PassResult`, and its result row (the p95 ratios not filled in yet).
    """
    import predictor as predictors

    model, serve_dev, device, k = run.model, run.serve_dev, run.device, run.k
    # all-resident: every expert on the device up front, read from the original files.
    bar.set_description("loading")
    keys = model.expert_keys
    store = open_store(run.step_dir)
    resident = dict(
        zip(keys, (jax.device_put(f.result(), device) for f in store.read_many(keys)))
    )
    jax.block_until_ready(list(resident.values()))
    # Each other row reads its own copy of the checkpoint's files, whose page cache is
    # dropped once, here: the first L3 read of each chunk in a row is cold, as if the row ran
    # alone, while the rows take turns.
    copies = {name: row_copy(run.step_dir, run.run_dir / "rows" / name) for name in ROWS[:-1]}
    for path in copies.values():
        drop_page_cache(path)
    # baseline: on-demand TensorStore reads, no cache.
    base_store = open_store(copies["baseline"])

    def read_direct(keys: list[str]) -> list[jax.Array]:
        return [jax.device_put(f.result(), device) for f in base_store.read_many(keys)]

    prefetchers = {
        "cacheflow": None,
        "cacheflow+markov": primed(predictors.markov(), warm.records, k=k),
        "cacheflow+mlp": None if warm.mlp is None else primed(warm.mlp, warm.records, k=k),
    }
    passes = {"baseline": ServedPass(model, serve_dev, read_direct, **common)}
    caches = {}
    with contextlib.ExitStack() as stack:
        for name, prefetcher in prefetchers.items():
            # The cache's clock continues the warm-up log's and runs only while its row
            # serves, so the predictors' time features see one stream.
            served: list[ServedPass] = []
            cache = stack.enter_context(run.new_cache(
                prefetcher,
                clock=lambda s=served: warm.t_end + (s[0].elapsed() if s else 0.0),
                files=copies[name],
            ))  # fmt: skip
            access_log = run.settings.access_log if name == "cacheflow" else None
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
                    quiet(caches[name])  # its prefetch worker's last loads land now
    results = {name: served_pass.result() for name, served_pass in passes.items()}
    rows = [
        result_row("baseline", results["baseline"].latencies),
        *(result_row(name, results[name].latencies, caches[name].stats()) for name in caches),
        result_row("all-resident", results["all-resident"].latencies, resident=True),
    ]
    resident.clear()
    return results, rows


def _setup(run: _Run, warm: _WarmUp, *, same: bool, plot: Path) -> dict[str, Any]:
    """The run's ``setup``: what ran, where, with which budgets and predictor."""
    settings, config = run.settings, run.config
    return {
        "model": config.name(),
        "step_dir": str(run.step_dir),
        "header": run.header,
        "backend": jax.default_backend(),
        "device": str(run.device),
        "weight_bytes": config.weight_bytes,
        "expert_bytes": config.expert_bytes,
        "blocks": len(run.model.expert_keys),
        "device_bytes": run.device_bytes,
        "host_bytes": run.host_bytes,
        "requests": settings.requests,
        "warmup": settings.warmup,
        "record": settings.record,
        "tokens": settings.tokens,
        "top_k": settings.top_k,
        "prefetch": dataclasses.asdict(run.pf_settings),
        "predictor": str(settings.predictor or warm.trained),
        "predictor_trained": settings.predictor is None,
        "warmup_log": str(warm.log),
        "outputs_match": same,
        "plot": str(plot),
        "loadavg": list(os.getloadavg()),
    }


def cmd_demo(args: argparse.Namespace) -> int:
    """``cacheflow demo``: runs the demo and prints its table (or JSON); 1 if the passes'
    outputs differ."""
    if args.access_log:
        check_output_file(args.access_log, setting="--access-log")
    settings = DemoSettings(
        workdir=Path(args.workdir).expanduser().resolve() if args.workdir else None,
        requests=args.requests,
        warmup=args.warmup,
        record=args.record,
        seed=args.seed,
        layers=args.layers,
        experts=args.experts,
        expert_mb=args.expert_mb,
        d_model=args.d_model,
        top_k=args.top_k,
        tokens=args.tokens,
        device_bytes=args.device_bytes,
        host_bytes=args.host_bytes,
        access_log=Path(args.access_log) if args.access_log else None,
        predictor=Path(args.predictor).expanduser().resolve() if args.predictor else None,
        plot=Path(args.plot).expanduser().resolve() if args.plot else None,
        prefetch_k=args.prefetch_k,
        progress=not args.no_progress,
    )
    result = run_demo(settings, log=lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(result["rows"], indent=1))
    else:
        print(result["setup"]["header"])
        print(format_table(result["rows"]))
        print(LEGEND)
        print(f"latency CDF: {result['setup']['plot']}")
    if not result["setup"]["outputs_match"]:
        print("cacheflow demo: error: the passes' outputs differ", file=sys.stderr)
        return 1
    return 0
