"""Two tiers against one: how many L1 misses L2 serves, and what L2 costs in L3 misses.

Run: ``python -m bench.two_tier [--traces PATH ...] [--sizes 1%,5%,10%,20%] [--out bench/out]``

For each trace, policy and L1 size ``s`` it replays (a) L1 = ``s`` with L2 = ``4 s`` and (b) one
tier of ``5 s``, and reports the share of L1 misses that L2 served and the difference between the
L3 miss ratios of (a) and (b). Tiers are exclusive, so with LRU the two are identical; the target
for the other policies is a difference within 0.02.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench.policies import DEFAULT_TRACES
from cacheflow_jax._replay import replay
from cacheflow_jax._trace import parse_size, read_trace


def run(traces: list[str], sizes: list[str], policies: list[str]) -> list[dict]:
    """Returns one row per (trace, policy, size)."""
    rows = []
    for path in traces:
        trace = read_trace(path)
        total = trace.distinct_bytes()
        largest = int(trace.nbytes.max())
        for policy in policies:
            for size in sizes:
                s = parse_size(size, total=total, largest=largest, setting="--sizes")
                two = replay(trace, device_bytes=s, host_bytes=4 * s, policy=policy)
                one = replay(trace, device_bytes=5 * s, host_bytes=0, policy=policy)
                l1_misses = two["requests"] - two["hits"]["device"]
                rows.append({
                    "trace": os.path.basename(path),
                    "policy": policy,
                    "size": size,
                    "l1_misses": l1_misses,
                    "served_by_l2": two["hits"]["host"] / l1_misses if l1_misses else 0.0,
                    "miss_ratio_two_tiers": two["miss_ratio"],
                    "miss_ratio_one_tier": one["miss_ratio"],
                    "difference": two["miss_ratio"] - one["miss_ratio"],
                })
                print(rows[-1], file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.two_tier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", nargs="+", default=DEFAULT_TRACES)
    parser.add_argument("--sizes", default="1%,5%,10%,20%")
    parser.add_argument("--policies", default="lfu,lru")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = run(args.traces, args.sizes.split(","), args.policies.split(","))
    lines = [
        f"Two tiers (L1 = s, L2 = 4 s) against one tier of 5 s, {time.strftime('%Y-%m-%d')}, "
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
    table = "\n".join(lines)
    with open(os.path.join(args.out, "two_tier.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "two_tier.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
