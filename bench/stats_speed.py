"""``cacheflow stats`` against replay: one pass for LRU's whole curve, or one replay per size.

Run: ``python -m bench.stats_speed [--traces PATH ...] [--sizes 1%,5%,10%,20%] [--runs 7]``

For each trace (read once, outside the timings) each run times, in a shuffled order:

* ``replays``: ``replay(trace, policy="lru", host_bytes=0)`` once per size, all sizes in a row
  (the baseline: what a user runs to get the curve from ``cacheflow replay --sizes``);
* ``stats``: `trace_stats` with the same sizes (keys and bytes by kind, reuse-distance histogram,
  and LRU's miss ratio at every size, from one pass of stack distances).

It reports the median and p95 of the per-run ratio replays / stats, and checks that the two give
the same miss ratios (the tests check this too). **Target: >= 5x on the median.**
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Sequence
from typing import Any

from bench._common import Report, Target, check_runs, fmt_ratio, parser, summarize, timed
from cacheflow_jax.replay.engine import replay
from cacheflow_jax.trace.reader import parse_size, read_trace
from cacheflow_jax.trace.stats import trace_stats

SHARED = os.path.join(os.path.dirname(__file__), "..", "data", "traces")
DEFAULT_TRACES = [
    os.path.join(SHARED, "mooncake_synthetic_trace.jsonl"),
    os.path.join(SHARED, "cloudPhysicsIO.csv.gz"),
]
TARGET = Target("replays / stats", ">=", 5.0)


def measure(path: str, sizes: Sequence[str], runs: int, warmup: int, seed: int) -> dict[str, Any]:
    """Times the replays and the stats pass on one trace; returns samples and the agreement."""
    trace = read_trace(path)
    total, largest = trace.distinct_bytes(), int(trace.nbytes.max())
    unit = largest == 1
    budgets = [
        parse_size(s, total=total, largest=largest, setting="--sizes", unit_size=unit)
        for s in sizes
    ]
    out: dict[str, Any] = {}

    def replays() -> None:
        out["replay"] = [
            replay(trace, device_bytes=b, host_bytes=0, policy="lru")["miss_ratio"] for b in budgets
        ]

    def stats() -> None:
        out["stats"] = [row["miss_ratio"] for row in trace_stats(trace, sizes=sizes)["lru"]]

    rng = random.Random(seed)
    samples: dict[str, list[float]] = {"replays": [], "stats": [], "ratio": []}
    for i in range(warmup + runs):
        order = [("replays", replays), ("stats", stats)]
        rng.shuffle(order)
        times = {name: timed(fn) for name, fn in order}
        if i >= warmup:
            samples["replays"].append(times["replays"])
            samples["stats"].append(times["stats"])
            samples["ratio"].append(times["replays"] / times["stats"])
    diff = max(abs(a - b) for a, b in zip(out["replay"], out["stats"]))
    return {
        "trace": os.path.basename(path),
        "accesses": len(trace),
        "replays_s": summarize(samples["replays"], better="low"),
        "stats_s": summarize(samples["stats"], better="low"),
        "ratio": summarize(samples["ratio"], better="high"),
        "miss_ratios": {"replay": out["replay"], "stats": out["stats"]},
        "max_difference": diff,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = parser("stats_speed", __doc__.split("\n\n")[0])
    p.add_argument("--traces", nargs="+", default=DEFAULT_TRACES)
    p.add_argument("--sizes", default="1%,5%,10%,20%")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    check_runs(args)
    sizes = [s for s in args.sizes.split(",") if s]
    rows = []
    for path in args.traces:
        rows.append(measure(path, sizes, args.runs, args.warmup, args.seed))
        print(f"{rows[-1]['trace']}: ratio median {rows[-1]['ratio']['median']:.2f}x",
              file=sys.stderr)  # fmt: skip
    report = Report(
        name="stats_speed",
        title="cacheflow stats (one pass) against one LRU replay per size",
        settings={"sizes": ",".join(sizes), "runs": args.runs, "warmup": args.warmup},
    )
    report.add_table(
        "seconds per run (median / p95) and the per-run ratio replays / stats",
        ["trace", "accesses", "replays s", "stats s", "ratio median", "ratio p95", "max |diff|"],
        [
            [
                r["trace"],
                str(r["accesses"]),
                f"{r['replays_s']['median']:.3f} / {r['replays_s']['p95']:.3f}",
                f"{r['stats_s']['median']:.3f} / {r['stats_s']['p95']:.3f}",
                fmt_ratio(r["ratio"]["median"]),
                fmt_ratio(r["ratio"]["p95"]),
                f"{r['max_difference']:.2g}",
            ]
            for r in rows
        ],
    )
    report.results["traces"] = rows
    for r in rows:
        verdict = TARGET.verdict(r["ratio"])
        verdict["label"] = f"{r['trace']}: {TARGET.label}"
        report.verdicts.append(verdict)
    report.notes.append(
        "the trace is read once per trace, outside the timings; both sides get the same "
        "Trace object; the stats side also computes the by-kind counts and the histogram"
    )
    report.emit(args)
    return report.payload()


if __name__ == "__main__":
    main()
