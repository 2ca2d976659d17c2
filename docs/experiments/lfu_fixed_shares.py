"""`lfu` at fixed window shares on one trace, beside the adaptive default and LRU.

    python docs/experiments/lfu_fixed_shares.py TRACE PERCENT [--chunks]

Prints the miss ratio of the default `lfu`, of `lfu(window=w)` for w in 0, .01, .05, .1, .2, .5,
1 and of `lru`, replayed through `cacheflow_jax.replay.engine.replay` as `bench.policies` does (one
tier, the cache PERCENT of the trace's distinct bytes). With ``--chunks``, the misses per twentieth
of the trace of the default (with its share at the chunk's end), of a fixed share of 0 and of LRU.
docs/policies.md quotes it for the nine points outside .005 and for cloudPhysics at 20%.
"""

from __future__ import annotations

import argparse

from lfu_trace import misses_per_chunk  # this directory's

from cacheflow_jax.policies import get_policy, lfu
from cacheflow_jax.replay.engine import replay
from cacheflow_jax.trace.reader import read_trace

SHARES = (0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0)


def chunks(trace, size: int) -> None:
    chunk = max(len(trace.keys) // 20, 1)
    policies = {"lfu": get_policy("lfu", ttl=None), "w=0": lfu(window=0.0, ttl=None),
                "lru": get_policy("lru", ttl=None)}
    runs = {name: misses_per_chunk(trace, size, policy, chunk)[1]
            for name, policy in policies.items()}
    print("chunk  lfu misses (share)  w=0 misses  lru misses")
    for i, ((m, share), (m0, _), (ml, _)) in enumerate(zip(*runs.values())):
        print(f"{i:5d}  {m:10d} ({share:.2f})  {m0:10d}  {ml:10d}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("percent", type=float)
    p.add_argument("--chunks", action="store_true", help="misses per twentieth of the trace")
    args = p.parse_args()
    trace = read_trace(args.trace)
    size = int(sum(trace.sizes().values()) * args.percent / 100)
    if args.chunks:
        chunks(trace, size)
        return
    ratios = {"lfu": replay(trace, device_bytes=size, host_bytes=0, policy="lfu")["miss_ratio"]}
    for w in SHARES:
        ratios[f"w={w:g}"] = replay(
            trace, device_bytes=size, host_bytes=0, policy=lfu(window=w))["miss_ratio"]
    ratios["lru"] = replay(trace, device_bytes=size, host_bytes=0, policy="lru")["miss_ratio"]
    print(f"{args.trace} at {args.percent:g}% ({size} bytes):")
    print("  ".join(f"{name} {mr:.4f}" for name, mr in ratios.items()))


if __name__ == "__main__":
    main()
