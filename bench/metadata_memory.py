"""Bookkeeping memory per resident block, measured with ``tracemalloc``.

    python -m bench.metadata_memory [--json] [--runs N] [--warmup N] [--out DIR] [--blocks N]

What is counted. The cache is built over `MetadataStore`, a store defined here that answers
``info`` from a dict of ``BlockInfo`` and ``read`` with a small numpy array of zeros (cacheflow-jax
has no metadata-only store yet). The store, its ``BlockInfo`` objects and the key strings are all
made *before* the baseline measurement, and the keys handed to the cache are the store's own string
objects, so none of them is counted. The cache uses `MetadataTier` for L1 and L2, which hold a
shared placeholder instead of data, so no block payload is counted either. What remains is the
cache's own bookkeeping: the tiers' key maps, the policy's state (priorities, last-access times,
heap entries, recency order, ghost history) and any other per-key structure the cache keeps.
Figure: (traced bytes after filling and draining - traced bytes before) / resident blocks, for
policies lfu and lru, with L1 only and with L1+L2 (half the blocks in each).

For information, the same fill with the real tiers (``DeviceTier`` + ``HostTier``, 64-byte
``jax.Array`` / numpy payloads): tracemalloc sees the Python objects (``jax.Array`` wrappers, numpy
arrays and their data) but not XLA's buffers allocated in C++, so the RSS growth is shown too.

Target: <= 256 bytes per resident block (metadata tiers). Memory is deterministic up to dict
resizing, so runs default to 3; a dict's size jumps at powers of two, so the figure depends
somewhat on ``--blocks``.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import tracemalloc
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from bench._common import Report, Target, check_runs, parser, summarize
from cacheflow_jax.cache.tiered import TieredCache
from cacheflow_jax.core.blocks import ArrayInfo, BlockInfo, block_key
from cacheflow_jax.tiers.memory import MetadataTier

NAME = "metadata_memory"
ARRAY = "blocks"
ROW = 16  # float32 elements per block: 64 bytes
TARGET = Target("cache bookkeeping per resident block", "<=", 256.0, " B")


class _Ready:
    """A read future that is already done."""

    __slots__ = ("_value",)

    def __init__(self, value: np.ndarray) -> None:
        self._value = value

    def result(self, timeout: float | None = None) -> np.ndarray:
        return self._value

    def done(self) -> bool:
        return True


class MetadataStore:
    """A read-only `Store` of ``n`` blocks of shape ``(1, 16)`` float32, all zeros, kept in memory.

    It exists so that the benchmark measures the cache's bookkeeping, not a store: ``info`` is a
    dict lookup of a prebuilt ``BlockInfo`` and ``read`` returns zeros without I/O.
    """

    def __init__(self, n: int) -> None:
        self._array = ArrayInfo(ARRAY, (n, ROW), np.dtype(np.float32), (1, ROW))
        self._infos: dict[str, BlockInfo] = {}
        for i in range(n):
            key = block_key(ARRAY, (i, 0))
            self._infos[key] = BlockInfo(
                key, (1, ROW), np.dtype(np.float32), ROW * 4, ARRAY, (i, 0), (i, 0)
            )
        self._keys = tuple(self._infos)

    @property
    def spec(self) -> str:
        return f"metadata-store({len(self._keys)} blocks)"

    def arrays(self) -> Mapping[str, ArrayInfo]:
        return {ARRAY: self._array}

    def info(self, key: str) -> BlockInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise KeyError(f"no block {key!r} in store {self.spec}") from None

    def holds(self, key: str) -> bool:
        return key in self._infos

    def keys(self) -> Sequence[str]:
        return self._keys

    def read(self, key: str) -> _Ready:
        info = self.info(key)
        return _Ready(np.zeros(info.shape, info.dtype))

    def read_many(self, keys: Sequence[str]) -> list[_Ready]:
        return [self.read(k) for k in keys]

    def write(self, key: str, value: np.ndarray, *, version: Any = None) -> _Ready:
        raise PermissionError(f"{self.spec} is read-only; cannot write {key!r}")


def _rss() -> int:
    """Resident set size of this process in bytes (Linux), or 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _make_cache(store: MetadataStore, policy: str, layout: str, real: bool) -> TieredCache:
    n = len(store.keys())
    block = ROW * 4
    l1 = n * block if layout == "L1" else (n - n // 2) * block
    l2 = 0 if layout == "L1" else (n // 2) * block
    tiers = None
    if not real:
        tiers = [
            MetadataTier(l1, name="device", setting="device_bytes"),
            MetadataTier(l2, name="host", setting="host_bytes"),
        ]
    return TieredCache(store, device_bytes=l1, host_bytes=l2, policy=policy, tiers=tiers)


def measure(
    store: MetadataStore, policy: str, layout: str, *, real: bool, top: int = 0
) -> dict[str, Any]:
    """Fills a fresh cache with every block of ``store``; returns bytes per resident block.

    Args:
      store: the store; built before this call, so its objects are not counted.
      policy: ``"lfu"`` or ``"lru"``.
      layout: ``"L1"`` (all blocks in L1) or ``"L1+L2"`` (half in each).
      real: use the real device and host tiers (payloads included) instead of metadata tiers.
      top: also return the ``top`` source lines that allocated the most (0 for none).
    """
    keys = store.keys()
    gc.collect()
    tracemalloc.start()
    try:
        empty = tracemalloc.get_traced_memory()[0]
        cache = _make_cache(store, policy, layout, real)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        snap0 = tracemalloc.take_snapshot() if top else None
        rss0 = _rss()
        for key in keys:
            cache.get(key)
        stats = cache.stats()  # applies buffered accesses, so the policy state is complete
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        rss1 = _rss()
        lines = []
        if snap0 is not None:
            snap1 = tracemalloc.take_snapshot()
            for d in snap1.compare_to(snap0, "lineno")[:top]:
                frame = d.traceback[0]
                where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
                lines.append((where, d.size_diff))
    finally:
        tracemalloc.stop()
    resident = sum(t["blocks"] for t in stats["tiers"].values())
    if resident != len(keys) or stats["misses"] != len(keys):
        raise SystemExit(
            f"{policy}/{layout}: {resident} of {len(keys)} blocks resident after filling "
            f"({stats['misses']} misses); the per-block figure would be wrong"
        )
    del cache
    return {
        "per_block": (after - before) / resident,
        "fixed": before - empty,
        "rss_per_block": (rss1 - rss0) / resident,
        "resident": resident,
        "tiers": {k: v["blocks"] for k, v in stats["tiers"].items()},
        "top_lines": [(w, s / resident) for w, s in lines],
    }


def _fresh_process(policy: str, layout: str, n: int) -> dict[str, Any]:
    """`measure` with the real tiers, run in a new process so that its RSS growth is its own."""
    measure(MetadataStore(256), policy, layout, real=True)  # jax's first-use allocations
    return measure(MetadataStore(n), policy, layout, real=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints the report and returns its JSON document."""
    p = parser(NAME, __doc__.split("\n\n")[0], runs=3)
    p.add_argument("--blocks", type=int, default=20_000, help="resident blocks (default 20000)")
    p.add_argument(
        "--real-blocks",
        type=int,
        default=2_000,
        help="blocks for the real-tier variants, each run once in a fresh process (default 2000)",
    )
    p.add_argument("--top", type=int, default=8, help="allocation sites to list (lfu, L1)")
    args = p.parse_args(argv)
    check_runs(args)
    n = args.blocks
    store = MetadataStore(n)  # every BlockInfo and key string exists before any measurement
    meta = [(pol, layout) for pol in ("lfu", "lru") for layout in ("L1", "L1+L2")]
    real = [("lfu", "L1"), ("lfu", "L1+L2")]

    small = MetadataStore(256)
    for _ in range(args.warmup):  # first-use allocations happen here
        for pol, layout in meta:
            measure(small, pol, layout, real=False)
    samples: dict[str, list[dict[str, Any]]] = {f"{p_}, {l_}": [] for p_, l_ in meta}
    top: list[tuple[str, float]] = []
    for run in range(args.runs):
        for pol, layout in meta:
            want_top = args.top if (run == 0 and (pol, layout) == ("lfu", "L1")) else 0
            got = measure(store, pol, layout, real=False, top=want_top)
            samples[f"{pol}, {layout}"].append(got)
            if want_top:
                top = got["top_lines"]
    spawn = multiprocessing.get_context("spawn")
    real_got: dict[str, dict[str, Any]] = {}
    for pol, layout in real:
        with ProcessPoolExecutor(1, mp_context=spawn) as ex:
            real_got[f"{pol}, {layout}"] = ex.submit(
                _fresh_process, pol, layout, args.real_blocks
            ).result()

    per_block = {
        k: summarize([s["per_block"] for s in ss], better="low") for k, ss in samples.items()
    }
    report = Report(
        NAME,
        f"Cache bookkeeping memory per resident block ({n:,} blocks of {ROW * 4} bytes)",
        {
            "blocks": n,
            "block_bytes": ROW * 4,
            "real_blocks": args.real_blocks,
            "runs": args.runs,
            "warmup": args.warmup,
        },
    )
    report.add_table(
        f"metadata tiers: bytes per resident block (tracemalloc), {args.runs} runs",
        ["policy, tiers", "median B", "p95 B", "L1/L2 blocks", "empty cache B"],
        [
            [
                k,
                f"{s['median']:.1f}",
                f"{s['p95']:.1f}",
                "/".join(str(b) for b in samples[k][0]["tiers"].values()),
                f"{samples[k][0]['fixed']:,}",
            ]
            for k, s in per_block.items()
        ],
    )
    if top:
        report.add_table(
            f"where the bytes go (lfu, L1, metadata tiers; top {len(top)} lines, per block)",
            ["allocated at", "B/block"],
            [[w, f"{b:.1f}"] for w, b in top],
        )
    report.add_table(
        f"for information: real tiers, payloads included ({args.real_blocks:,} blocks of "
        f"{ROW * 4} bytes, one run each in a fresh process)",
        ["policy, tiers", "tracemalloc B/block", "RSS B/block", "L1/L2 blocks"],
        [
            [
                k,
                f"{g['per_block']:.0f}",
                f"{g['rss_per_block']:.0f}",
                "/".join(str(b) for b in g["tiers"].values()),
            ]
            for k, g in real_got.items()
        ],
    )
    for k, s in per_block.items():
        verdict = TARGET.verdict(s)
        verdict["label"] = f"{TARGET.label} ({k})"
        report.verdicts.append(verdict)
    report.notes += [
        "counted: every byte allocated through Python's allocators while filling the cache and "
        "applying the buffered accesses (tiers' key maps, policy state, other per-key maps); "
        "not counted: the store, its BlockInfo objects and the key strings (made before the "
        "baseline), block payloads (metadata tiers hold a shared placeholder)",
        "'empty cache B' is the cost of an empty TieredCache, not divided among blocks",
        "real tiers: tracemalloc includes jax.Array wrappers and numpy arrays but not XLA's C++ "
        "buffers; 'RSS B/block' is the fresh process's resident-set growth per block (coarse: "
        "pages, allocator pools)",
        f"block keys look like {store.keys()[0]!r}; dicts grow at powers of two, so the figure "
        f"depends on --blocks (here {n:,}; next doubling at {2 ** math.ceil(math.log2(n)):,})",
    ]
    report.results = {
        "bytes_per_block": per_block,
        "fixed_bytes": {k: ss[0]["fixed"] for k, ss in samples.items()},
        "tiers": {k: ss[0]["tiers"] for k, ss in samples.items()},
        "top_lines_lfu_L1": top,
        "real_tiers": real_got,
    }
    report.emit(args)
    return report.payload()


if __name__ == "__main__":
    main()
