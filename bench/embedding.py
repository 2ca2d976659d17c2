"""The device slab against one array per block: embedding lookups, and the demo's step time.

    python -m bench.embedding [--json] [--runs N] [--warmup N] [--out DIR] [--rows N] [--dim N]
                              [--batch 64] [--lookups N] [--zipf A] [--seed N]
                              [--demo-requests N] [--no-demo]

Part 1, embedding rows. A float32 table of ``--rows`` x ``--dim`` (16 MiB by default) is written
to a store on ``memory://``; L1 is an eighth of it (half of that reserved for rows), L2 holds all
of it. Each run serves the same ``--lookups`` batches of ``--batch`` Zipf-distributed ids
(exponent ``--zipf``, over a random permutation of the rows) through ``session.lookup`` with:

* ``slab``: ``device_layout="slab"``: hot rows in L1's slab, one ``gather_lines`` per lookup,
  promotions written with ``pack_lines``;
* ``arrays`` (**baseline**): ``device_layout="arrays"``: each hot row its own array, brought in by
  its own ``jax.device_put``, a lookup stacks them;
* ``all-resident`` (the limit): ``jnp.take`` on the whole table kept on the device.

Both cached layouts see the same ids and make the same promotions (the same counters), so they
serve the same rows from the device; only the device layout differs. After ``--warmup-lookups``
unmeasured lookups (promotions settle, jit compiles), each lookup's latency is measured up to the
rows being ready. Per run: mean and p95 lookup latency per variant, and the ratio
arrays / slab of the means (> 1: the slab is faster).

Part 2, the demo (``cacheflow demo``'s model and text, ``--demo-requests`` steps after 5 warm-up
steps, its default budgets, no prefetch): each run serves the steps through ``serving(cache)``
once with each layout, in a shuffled order, each after dropping the checkpoint's page cache, and
reports the step p95 of each and their ratio slab / arrays (< 1: the slab is faster).

Ratios are per run; the report gives their median and p95 over ``--runs``. On a CPU backend the
"device" is host memory: the numbers say what the layouts cost in dispatch and copies here, not
what they cost on a GPU.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench._common import Report, check_runs, fmt_ratio, parser, summarize
from cacheflow_jax import write_store
from cacheflow_jax.cache.tiered import TieredCache
from cacheflow_jax.session.session import serving

NAME = "embedding"
LAYOUTS = ("slab", "arrays")


def _ids(rng: np.random.Generator, rows: int, batch: int, count: int, zipf: float) -> list:
    perm = rng.permutation(rows)
    return [
        jax.device_put(perm[(rng.zipf(zipf, batch) - 1) % rows].astype(np.int32))
        for _ in range(count)
    ]


def _serve_lookups(
    store, layout: str, ids: list, *, warmup: int, device_bytes: int, host_bytes: int
) -> tuple[list[float], dict]:
    cache = TieredCache(
        store, device_bytes=device_bytes, host_bytes=host_bytes, device_layout=layout
    )
    latencies = []
    with serving(cache, embedding_bytes=device_bytes // 2) as s:
        for i, batch in enumerate(ids):
            start = time.perf_counter()
            s.lookup("emb", batch).block_until_ready()
            if i >= warmup:
                latencies.append(time.perf_counter() - start)
        stats = s.stats()["embedding"]["emb"]
    return latencies, stats


def _resident_lookups(table: np.ndarray, ids: list, *, warmup: int) -> list[float]:
    full = jax.device_put(table)
    take = jax.jit(lambda t, i: jnp.take(t, i, axis=0))
    latencies = []
    for i, batch in enumerate(ids):
        start = time.perf_counter()
        take(full, batch).block_until_ready()
        if i >= warmup:
            latencies.append(time.perf_counter() - start)
    return latencies


def _p95(xs: list[float]) -> float:
    return float(np.percentile(xs, 95))


def embedding_part(args, report: Report) -> None:
    rng = np.random.default_rng(args.seed)
    table = rng.standard_normal((args.rows, args.dim)).astype(np.float32)
    rows_per_chunk = max(1, (64 << 10) // (args.dim * 4))  # 64 KiB chunks
    store = write_store(
        {"emb": table},
        f"memory://bench-embedding-{time.time_ns()}/",
        chunk_bytes=rows_per_chunk * args.dim * 4,
    )
    device_bytes = table.nbytes // 8
    ids = _ids(rng, args.rows, args.batch, args.warmup_lookups + args.lookups, args.zipf)
    ratio, per_variant, stats = (
        [],
        {v: {"mean": [], "p95": []} for v in (*LAYOUTS, "all-resident")},
        {},
    )
    for run in range(args.warmup + args.runs):
        order = [*LAYOUTS, "all-resident"]
        random.Random(run).shuffle(order)
        means = {}
        for variant in order:
            if variant == "all-resident":
                lat = _resident_lookups(table, ids, warmup=args.warmup_lookups)
            else:
                lat, stats[variant] = _serve_lookups(
                    store,
                    variant,
                    ids,
                    warmup=args.warmup_lookups,
                    device_bytes=device_bytes,
                    host_bytes=table.nbytes,
                )
            means[variant] = statistics.fmean(lat)
            if run >= args.warmup:
                per_variant[variant]["mean"].append(means[variant])
                per_variant[variant]["p95"].append(_p95(lat))
        if run >= args.warmup:
            ratio.append(means["arrays"] / means["slab"])
    rows = []
    for variant, d in per_variant.items():
        m, p = summarize(d["mean"], better="low"), summarize(d["p95"], better="low")
        hit = stats.get(variant, {}).get("device_hit_ratio")
        rows.append(
            [
                variant,
                f"{m['median'] * 1e6:,.0f}",
                f"{p['median'] * 1e6:,.0f}",
                "" if hit is None else f"{hit:.3f}",
            ]
        )
        report.results[f"lookup_{variant}"] = {"mean_s": m, "p95_s": p, "stats": stats.get(variant)}
    r = summarize(ratio, better="high")
    report.results["lookup_ratio_arrays_over_slab"] = r
    report.add_table(
        f"embedding lookup, {args.rows} x {args.dim} float32 table ({table.nbytes >> 20} MiB), "
        f"L1 {device_bytes >> 10} KiB (rows {device_bytes >> 11} KiB), batch {args.batch}, "
        f"Zipf {args.zipf}, {args.lookups} lookups per run (medians over runs)",
        ["variant", "mean_us", "p95_us", "rows_from_device"],
        rows,
    )
    report.add_table(
        "ratio arrays / slab of the mean lookup time, per run (> 1: the slab is faster)",
        ["ratio", "median", "p95"],
        [["arrays / slab", fmt_ratio(r["median"]), fmt_ratio(r["p95"])]],
    )
    same = stats["slab"]["rows_device"] == stats["arrays"]["rows_device"]
    report.notes.append(
        "both layouts served the same rows from the device: "
        + (
            "yes"
            if same
            else f"NO ({stats['slab']['rows_device']} vs {stats['arrays']['rows_device']})"
        )
    )


def demo_part(args, report: Report) -> None:
    from cacheflow_jax.cli.demo import (
        DemoSettings,
        default_workdir,
        demo_text,
        drop_page_cache,
        open_model,
        prepare_checkpoint,
        serve_pass,
        text_steps,
    )
    from cacheflow_jax.store.open import open_store

    settings = DemoSettings(requests=args.demo_requests, progress=False)
    config = settings.model_config()
    step_dir, _ = prepare_checkpoint(config, default_workdir(), seed=settings.seed)
    model = open_model(step_dir, config)
    steps = settings.warmup + settings.requests
    text = demo_text()
    tokens = text_steps(
        text, start=len(text) // 2, end=len(text), steps=steps, tokens=settings.tokens
    )
    inputs = [jax.device_put(t) for t in tokens]
    expert_total = config.layers * config.experts * config.expert_bytes
    device_bytes, host_bytes = expert_total // 6, expert_total // 2
    p95 = {layout: [] for layout in LAYOUTS}
    hits: dict[str, Any] = {}
    ratio = []
    for run in range(args.warmup + args.runs):
        order = list(LAYOUTS)
        random.Random(1000 + run).shuffle(order)
        this = {}
        for layout in order:
            cache = TieredCache(
                open_store(step_dir),
                device_bytes=device_bytes,
                host_bytes=host_bytes,
                device_layout=layout,
                block_bytes=model.largest,
            )
            drop_page_cache(step_dir)
            with serving(cache) as session:
                result = serve_pass(
                    model, inputs, session.get_many, warmup=settings.warmup, top_k=settings.top_k
                )
            this[layout] = _p95(result.latencies)
            stats = cache.stats()
            hits[layout] = stats["hits"]["device"] / max(stats["requests"], 1)
        if run >= args.warmup:
            for layout in LAYOUTS:
                p95[layout].append(this[layout])
            ratio.append(this["slab"] / this["arrays"])
    r = summarize(ratio, better="low")
    report.results["demo_p95_ratio_slab_over_arrays"] = r
    report.results["demo_p95_s"] = {k: summarize(v, better="low") for k, v in p95.items()}
    report.add_table(
        f"demo step p95 ({config.name()}, {settings.requests} steps + {settings.warmup} warm-up, "
        f"L1 {device_bytes / 2**20:.1f} MiB, L2 {host_bytes / 2**20:.1f} MiB, page cache dropped "
        "before each pass; medians over runs)",
        ["layout", "p95_ms", "l1_hit_ratio"],
        [[k, f"{statistics.median(v) * 1e3:.2f}", f"{hits[k]:.3f}"] for k, v in p95.items()],
    )
    report.add_table(
        "ratio slab / arrays of the demo's step p95, per run (< 1: the slab is faster)",
        ["ratio", "median", "p95"],
        [["slab / arrays", fmt_ratio(r["median"]), fmt_ratio(r["p95"])]],
    )


def main(argv: list[str] | None = None) -> int:
    p = parser(NAME, __doc__.split("\n\n")[0], runs=5)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lookups", type=int, default=300)
    p.add_argument("--warmup-lookups", type=int, default=100)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demo-requests", type=int, default=100)
    p.add_argument("--no-demo", action="store_true", help="skip part 2 (the demo)")
    args = p.parse_args(argv)
    check_runs(args)
    report = Report(
        NAME,
        "device slab against one array per block",
        {
            k: getattr(args, k)
            for k in (
                "runs",
                "warmup",
                "rows",
                "dim",
                "batch",
                "lookups",
                "warmup_lookups",
                "zipf",
                "seed",
                "demo_requests",
            )
        },
    )
    embedding_part(args, report)
    if not args.no_demo:
        demo_part(args, report)
    report.notes.append(
        f"jax backend {jax.default_backend()}: kernels ran as "
        + ("Pallas (Triton)" if jax.default_backend() == "gpu" else "XLA (auto: Pallas on GPU)")
    )
    report.emit(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
