"""Host-to-device paths for one block size: numpy -> device, pinned_host -> device, and the cache.

Run: ``python -m bench.h2d [--block-mib 4] [--blocks 16] [--runs 7]``

Reports GB/s (median and p95 over runs, after a warm-up) for ``jax.device_put`` of numpy arrays,
for arrays already in ``pinned_host`` memory moved with ``device_put`` (JAX's own host
offloading), and for L2 -> L1 promotions through `TieredCache` (blocks resident in L2, each
``get`` promotes one). On a CPU backend "device" is host memory; the numbers mean something only
on an accelerator.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np

import cacheflow_jax as cfj


def _gbps(nbytes: int, seconds: list[float]) -> tuple[float, float]:
    rates = sorted(nbytes / s / 1e9 for s in seconds)
    return statistics.median(rates), rates[max(0, int(0.05 * len(rates)) - 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.h2d", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-mib", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    dev = jax.devices()[0]
    n = args.block_mib << 20
    host = [np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8) for i in range(args.blocks)]
    total = n * args.blocks
    results = {}

    def timed(fn) -> list[float]:
        fn()
        out = []
        for _ in range(args.runs):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out

    results["numpy -> device"] = timed(
        lambda: jax.block_until_ready([jax.device_put(h, dev) for h in host]))
    kinds = {m.kind for m in dev.addressable_memories()}
    if "pinned_host" in kinds:
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        staged = jax.block_until_ready([jax.device_put(h, pinned) for h in host])
        results["pinned_host -> device"] = timed(
            lambda: jax.block_until_ready([jax.device_put(h, on_device) for h in staged]))
    store = cfj.write_store({"x": np.stack(host)}, f"memory://h2d-{time.time_ns()}/",
                            chunk_bytes=n)
    keys = list(store.keys())

    def promote() -> None:
        cache = cfj.TieredCache(store, device_bytes=n, host_bytes=total)
        cache.get_many(keys)  # all end in L2 but the last
        cache.evict(keys[-1])
        start = time.perf_counter()
        jax.block_until_ready([cache.get(k) for k in keys[:-1]])  # each an L2 -> L1 promotion
        promote.seconds.append(time.perf_counter() - start)

    promote.seconds = []
    for _ in range(args.runs + 1):
        promote()
    results["cache L2 -> L1 promotion"] = promote.seconds[1:]
    print(f"{jax.default_backend()} {dev.device_kind}, {args.blocks} x {args.block_mib} MiB")
    for name, secs in results.items():
        nbytes = total if "promotion" not in name else n * (args.blocks - 1)
        med, p95 = _gbps(nbytes, secs)
        print(f"{name:28s} median {med:7.2f} GB/s  p95 {p95:7.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
