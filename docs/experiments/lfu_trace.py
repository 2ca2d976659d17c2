"""Watch `lfu` over one trace: misses per chunk against LRU, the window share, the shadows.

    python docs/experiments/lfu_trace.py TRACE PERCENT [--chunk N]

For each chunk of accesses it prints `lfu`'s and LRU's misses and `lfu`'s window share; at the
end, the hits of the live cache and of each shadow on the sampled accesses since the last jump,
and the jumps (access, share before, share after). One tier, no TTL; the cache holds PERCENT of
the trace's distinct bytes (of its keys where it lists no sizes), as `bench.policies` sizes it.
docs/policies.md quotes it for `lirs_backf` at 20% and `cache2k_web12` at 5%.
"""

from __future__ import annotations

import argparse
import importlib

from cacheflow_jax.cache.tiered import TieredCache
from cacheflow_jax.policies import get_policy
from cacheflow_jax.replay.engine import TraceStore
from cacheflow_jax.tiers.memory import MetadataTier
from cacheflow_jax.trace.reader import read_trace


def misses_per_chunk(trace, size: int, policy, chunk: int) -> tuple[TieredCache, list[tuple]]:
    """Replays ``trace`` through one tier of ``size`` bytes under ``policy`` (no clock).

    Returns:
      The cache, and per chunk of ``chunk`` accesses its misses and the policy's window share
      at the chunk's end (None for a policy without one).
    """
    cache = TieredCache(
        TraceStore(trace), device_bytes=size, host_bytes=0, policy=policy,
        clock=lambda: 0.0, read_buffer=1,
        tiers=[MetadataTier(size, name="device", setting="device_bytes"),
               MetadataTier(0, name="host", setting="host_bytes")],
    )  # fmt: skip
    rows, before = [], 0
    for i, key in enumerate(trace.keys):
        cache.access_sync(key, float(i))
        if (i + 1) % chunk == 0:
            misses = cache.stats()["misses"]
            rows.append((misses - before, getattr(cache.planner.state, "share", None)))
            before = misses
    return cache, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("percent", type=float)
    p.add_argument("--chunk", type=int, default=0, help="accesses per line (default: 1/20)")
    args = p.parse_args()
    lfu_module = importlib.import_module("cacheflow_jax.policies.lfu")  # the package exports lfu()
    trace = read_trace(args.trace)
    keys = trace.keys
    size = int(sum(trace.sizes().values()) * args.percent / 100)  # bytes (1 per key if unsized)
    chunk = args.chunk or max(len(keys) // 20, 1)
    jumps = []
    jump = lfu_module._jump

    def logged(state, share):
        jumps.append((state.tick, round(state.share, 3), share))
        jump(state, share)

    lfu_module._jump = logged
    runs = {name: misses_per_chunk(trace, size, get_policy(name, ttl=None), chunk)
            for name in ("lfu", "lru")}
    print(f"{args.trace}: {len(keys)} accesses, {len(set(keys))} keys, cache {size} bytes")
    print("chunk  lfu misses  lru misses  lfu share")
    for i, ((m, share), (m_lru, _)) in enumerate(zip(runs["lfu"][1], runs["lru"][1])):
        print(f"{i:5d}  {m:10d}  {m_lru:10d}  {share:9.3f}")
    sims = runs["lfu"][0].planner.state.sims
    print(f"sampled hits since the last jump: live {sims.live}, shadows "
          + ", ".join(f"{s.setting:g}: {s.hits}" for s in sims.shadows))
    print(f"jumps (access, share, to): {jumps}")


if __name__ == "__main__":
    main()
