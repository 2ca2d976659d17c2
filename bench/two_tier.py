"""Two tiers against one: L1 = s with L2 = 4 s against one tier of 5 s.

Run: ``python -m bench.two_tier [--traces PATH ...] [--sizes 1%,5%,10%,20%] [--policies lfu,lru]
[--out bench/out]`` (or ``cacheflow bench two_tier``).

For each trace, policy and L1 size ``s`` (a share of the trace's distinct bytes) it replays (a)
L1 = ``s`` with L2 = ``4 s`` and (b) one tier of ``5 s``, and reports the share of L1 misses that
L2 served and the difference between the L3 miss ratios of (a) and (b). Tiers are exclusive, so
with ``lru`` the two are identical; ``lfu`` runs one cache's segments over both tiers, and the
target is a difference within 0.01 at every point of the Mooncake and cloudPhysics traces (the
default traces). With byte sizes a demotion can force L2 to give up more bytes than one cache
would, so the two differ a little. It writes ``two_tier.md`` and ``two_tier.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from bench.policies import shared_traces_dir
from cacheflow_jax.replay.engine import replay
from cacheflow_jax.trace.reader import parse_size, read_trace

TARGET = 0.01


def default_traces() -> list[str]:
    """The Mooncake and cloudPhysics traces of the shared folder."""
    folder = shared_traces_dir()
    return [os.path.join(folder, "mooncake_synthetic_trace.jsonl"),
            os.path.join(folder, "cloudPhysicsIO.csv.gz")]


def _job(args: tuple) -> dict:
    path, policy, size = args
    trace = read_trace(path)
    s = parse_size(size, total=trace.distinct_bytes(), largest=int(trace.nbytes.max()),
                   setting="--sizes")
    two = replay(trace, device_bytes=s, host_bytes=4 * s, policy=policy)
    one = replay(trace, device_bytes=5 * s, host_bytes=0, policy=policy)
    l1_misses = two["requests"] - two["hits"]["device"]
    return {
        "trace": os.path.basename(path),
        "policy": policy,
        "size": size,
        "l1_misses": l1_misses,
        "served_by_l2": two["hits"]["host"] / l1_misses if l1_misses else 0.0,
        "miss_ratio_two_tiers": two["miss_ratio"],
        "miss_ratio_one_tier": one["miss_ratio"],
        "difference": two["miss_ratio"] - one["miss_ratio"],
    }


def run(traces: list[str], sizes: list[str], policies: list[str], *, workers: int) -> list[dict]:
    """Returns one row per (trace, policy, size)."""
    jobs = [(p, policy, size) for p in traces for policy in policies for size in sizes]
    with ProcessPoolExecutor(workers) as ex:
        rows = list(ex.map(_job, jobs))
    for row in rows:
        print(row, file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.two_tier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", nargs="+")
    parser.add_argument("--sizes", default="1%,5%,10%,20%")
    parser.add_argument("--policies", default="lfu,lru")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = run(args.traces or default_traces(), args.sizes.split(","),
               args.policies.split(","), workers=args.workers)
    worst = {p: max(abs(r["difference"]) for r in rows if r["policy"] == p)
             for p in args.policies.split(",")}
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"Two tiers (L1 = s, L2 = 4 s) against one tier of 5 s, {stamp}, "
        f"`python -m bench.two_tier --sizes {args.sizes}`.\n",
        "| trace | policy | s | L1 misses served by L2 | L3 miss ratio, L1+L2 | one tier | "
        "difference |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['trace']} | {r['policy']} | {r['size']} | {r['served_by_l2']:.3f} | "
            f"{r['miss_ratio_two_tiers']:.4f} | {r['miss_ratio_one_tier']:.4f} | "
            f"{r['difference']:+.4f} |"
        )
    lines.append("")
    for policy, value in worst.items():
        verdict = "met" if value <= TARGET else "not met"
        lines.append(f"- `{policy}`: largest |difference| {value:.4f} (target <= {TARGET}: "
                     f"{verdict})")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "two_tier.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "two_tier.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
