"""Host-to-device paths for one block size: numpy -> device, pinned_host -> device, and the cache.

Run: ``python -m bench.h2d [--block-mib 4 | --block-kib K] [--blocks 16] [--runs 7] [--leaves 2000]``

Reports GB/s (median and p95 over runs, after a warm-up) for ``jax.device_put`` of numpy arrays,
for arrays already in ``pinned_host`` memory moved with ``device_put`` (JAX's own host
offloading); device -> host copies to numpy and to ``pinned_host`` (what a demotion to L2 costs);
``device_put`` waiting for each block; the slab's way in, in its two parts; and L2 -> L1
promotions through `TieredCache` (blocks resident in L2, each ``get`` promotes one and demotes
L1's one block) with L2 pageable (numpy) and pinned (``host_memory``), and their ratio per run. On a CPU backend "device" is host memory; the numbers mean something only
on an accelerator.

Then the cost per leaf of small leaves (1 KiB, bfloat16, as in a KV block), where the time is
JAX's Python rather than bytes: ``jax.device_put`` of a list of numpy leaves against the cache's
`Placement.put`, and committing a leaf already on the device with
``jax.make_array_from_single_device_arrays`` against `Placement.commit` (us per leaf, median and
p95 over runs, and the ratio per run).
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
    parser.add_argument("--block-kib", type=int, default=None,
                        help="the block size in KiB instead (small blocks: KV blocks are a few)")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--leaves", type=int, default=2000, help="small leaves per timed call")
    args = parser.parse_args(argv)
    dev = jax.devices()[0]
    n = args.block_kib << 10 if args.block_kib else args.block_mib << 20
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
    results["device -> numpy (device_get)"] = _device_to_host(
        host, dev, lambda x: np.asarray(jax.device_get(x)), args.runs)
    if "pinned_host" in kinds:
        results["device -> pinned_host"] = _device_to_host(
            host, dev, lambda x: jax.block_until_ready(jax.device_put(x, pinned)), args.runs)
    results["per block, waiting: numpy -> device"] = timed(
        lambda: [jax.block_until_ready(jax.device_put(h, dev)) for h in host])
    results.update(_slab_parts(dev, host, timed))
    store = cfj.write_store({"x": np.stack(host)}, f"memory://h2d-{time.time_ns()}/",
                            chunk_bytes=n)
    keys = list(store.keys())
    memories = ["pageable"] + (["pinned"] if "pinned_host" in kinds else [])
    for memory in memories:
        results[f"cache promotion, L2 {memory}"] = _promotions(store, keys, n, total, memory,
                                                               args.runs)  # fmt: skip
    size = f"{args.block_kib} KiB" if args.block_kib else f"{args.block_mib} MiB"
    print(f"{jax.default_backend()} {dev.device_kind}, {args.blocks} x {size}")
    for name, secs in results.items():
        nbytes = total if "promotion" not in name else n * (args.blocks - 1)
        med, p95 = _gbps(nbytes, secs)
        per = statistics.median(secs) / (nbytes // n) * 1e6
        print(f"{name:36s} median {med:7.2f} GB/s  p95 {p95:7.2f} GB/s  ({per:8.1f} us a block)")
    print("  (a promotion also demotes L1's one block to L2: L1 holds one block)")
    if len(memories) == 2:
        ratios = [a / b for a, b in zip(results["cache promotion, L2 pinned"],
                                        results["cache promotion, L2 pageable"])]  # fmt: skip
        print(f"  promotion time, L2 pinned / pageable: median {statistics.median(ratios):.2f}x  "
              f"p95 {np.percentile(ratios, 95):.2f}x")
    _small_leaves(dev, args.leaves, args.runs)
    return 0


def _device_to_host(host: list[np.ndarray], dev: jax.Device, copy, runs: int) -> list[float]:
    """Seconds per run of ``copy`` over fresh device arrays: a ``jax.Array`` keeps the numpy
    value it was once converted to, so converting the same arrays again would copy nothing."""
    seconds = []
    for run in range(runs + 1):
        fresh = jax.block_until_ready([jax.device_put(h, dev) for h in host])
        start = time.perf_counter()
        for x in fresh:
            copy(x)
        if run:
            seconds.append(time.perf_counter() - start)
    return seconds


def _promotions(store, keys, n: int, total: int, memory: str, runs: int) -> list[float]:
    """Seconds per run of L2 -> L1 promotions through `TieredCache` with L2 in ``memory``."""
    seconds = []
    for run in range(runs + 1):
        cache = cfj.TieredCache(store, device_bytes=n, host_bytes=total, host_memory=memory)
        cache.get_many(keys)  # all end in L2 but the last
        cache.evict(keys[-1])
        start = time.perf_counter()
        jax.block_until_ready([cache.get(k) for k in keys[:-1]])  # each an L2 -> L1 promotion
        if run:
            seconds.append(time.perf_counter() - start)
        cache.close()
    return seconds


def _slab_parts(dev: jax.Device, host: list[np.ndarray], timed) -> dict[str, list[float]]:
    """The slab's way in, in two parts: the block to the device (`SlabTier.load`, which waits
    for each block), then its lines written into the slab (`put_reserved` of a device array)."""
    from cacheflow_jax.tiers.slab import SlabTier

    n = host[0].nbytes
    tier = SlabTier(n * len(host), line_bytes=min(64 << 10, n & -n), device=dev)
    loaded = [tier.load(h) for h in host]

    def pack() -> None:
        for i, value in enumerate(loaded):
            assert tier.reserve(n)
            tier.put_reserved(f"b{i}", value, n)
        tier.slab.array.block_until_ready()
        for i in range(len(loaded)):
            tier.pop(f"b{i}")
            tier.release(n)

    return {"slab: load (block to device)": timed(lambda: [tier.load(h) for h in host]),
            "slab: pack a device block": timed(pack)}  # fmt: skip


def _small_leaves(dev: jax.Device, count: int, runs: int) -> None:
    """Per-leaf time of the public calls and of `Placement` for 1 KiB leaves (module docstring)."""
    import ml_dtypes

    from cacheflow_jax.tiers.placement import Placement

    sharding = jax.sharding.SingleDeviceSharding(dev)
    placement = Placement(dev, sharding)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((2, 16, 16)).astype(ml_dtypes.bfloat16) for _ in range(count)]
    # Uncommitted arrays on the device, as a jitted step returns them.
    on_device = jax.block_until_ready(list(jax.jit(lambda x: [y + 0 for y in x])(host[:64])))
    on_device = (on_device * (count // len(on_device) + 1))[:count]
    assert not on_device[0].committed
    ways = {
        "device_put (list)": lambda: jax.device_put(host, dev),
        "Placement.put": lambda: placement.put(host),
        "make_array_from_single_device_arrays": lambda: [
            jax.make_array_from_single_device_arrays(x.shape, sharding, [x]) for x in on_device],
        "Placement.commit": lambda: [placement.commit(x) for x in on_device],
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for run in range(runs + 1):  # the first is a warm-up (and Placement's first checks)
        for name, fn in ways.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            if run:
                times[name].append((time.perf_counter() - start) / count * 1e6)
    print(f"small leaves ({count} x 1 KiB bfloat16 per call, us per leaf over {runs} runs)")
    for name, us in times.items():
        print(f"  {name:38s} median {statistics.median(us):6.2f}  p95 {np.percentile(us, 95):6.2f}")
    for fast, slow in (("Placement.put", "device_put (list)"),
                       ("Placement.commit", "make_array_from_single_device_arrays")):
        ratios = [a / b for a, b in zip(times[fast], times[slow])]
        print(f"  {fast} / {slow}: median {statistics.median(ratios):.2f}x  "
              f"p95 {np.percentile(ratios, 95):.2f}x")


if __name__ == "__main__":
    sys.exit(main())
