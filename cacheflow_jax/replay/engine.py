"""Replay: drive the live cache's objects over a trace, with a store that holds metadata only.

`replay` builds the very `TieredCache` and `Policy` that serve live traffic, swaps the data tiers
for `MetadataTier` (residency and bytes, no payload) and the store for a `TraceStore` (block sizes
from the trace), and feeds it the trace's accesses with the trace's own clock. The counters it
returns are therefore the live cache's counters on that access stream.

A trace without timestamps (one key per line, or a CSV without a time column) has no clock: its
accesses are replayed at time 0, so no block expires by TTL, and the JSON says so (``clock``,
``ttl_applied``). Counting accesses as seconds would expire a block after ``ttl`` accesses, a
limit no user set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cacheflow_jax.cache.advice import prefetch_advice, stream_advice, trace_budget_advice
from cacheflow_jax.cache.tiered import TieredCache
from cacheflow_jax.core.blocks import ArrayInfo, BlockInfo, BudgetError
from cacheflow_jax.core.log import logger
from cacheflow_jax.policies import Policy, get_policy
from cacheflow_jax.prefetch.scheduler import PrefetchSettings
from cacheflow_jax.tiers.memory import PRESENT, MetadataTier
from cacheflow_jax.trace.reader import Trace


class _Ready:
    """A completed future."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> Any:
        return self.value

    def done(self) -> bool:
        return True

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        fn(self)


_PRESENT_FUTURE = _Ready(PRESENT)


class _Infos(dict):
    """key -> BlockInfo, made on a key's first lookup; an unknown key is a KeyError naming the
    key and the store."""

    def __init__(self, spec: str, sizes: dict[str, int]) -> None:
        super().__init__()
        self.spec = spec
        self.sizes = sizes

    def __missing__(self, key: str) -> BlockInfo:
        n = self.sizes.get(key)
        if n is None:
            raise KeyError(f"no block {key!r} in store {self.spec}")
        import numpy as np  # only for a key's info: replay itself needs no numpy

        info = self[key] = BlockInfo(key, (n,), np.dtype(np.uint8), n)
        return info


class TraceStore:
    """A `Store` that knows each key's size from a trace and holds no data."""

    def __init__(self, trace: Trace) -> None:
        self.spec = f"trace:{trace.path}"
        self._sizes = trace.sizes()
        # ``info`` is the dict's own lookup: replay asks for a size on every access.
        self.info = _Infos(self.spec, self._sizes).__getitem__

    @property
    def sizes(self) -> dict[str, int]:
        """Each key's size: its largest ``nbytes`` in the trace."""
        return self._sizes

    def sizes_of(self, keys: Sequence[str]) -> list[int]:
        """The size of each of ``keys``, in order (they are the trace's keys)."""
        return list(map(self._sizes.__getitem__, keys))

    def arrays(self) -> Mapping[str, ArrayInfo]:
        return {}

    def holds(self, key: str) -> bool:
        return key in self._sizes

    def keys(self) -> Sequence[str]:
        return list(self._sizes)

    def read(self, key: str) -> _Ready:
        return _PRESENT_FUTURE

    def read_many(self, keys: Sequence[str]) -> list[_Ready]:
        return [_PRESENT_FUTURE] * len(keys)

    def write(self, key: str, value: Any, *, version: Any = None) -> _Ready:
        return _Ready(None)

    @property
    def largest(self) -> int:
        return max(self._sizes.values(), default=0)


class _Clock:
    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------------------------ replay


def replay(
    trace: Trace,
    *,
    device_bytes: int,
    host_bytes: int,
    policy: str | Policy = "lfu",
    prefetcher: Any = None,
    prefetch: PrefetchSettings | None = None,
    warmup: int = 0,
    progress: bool = False,
    label: str = "replay",
    names: tuple[str, str] = ("device_bytes", "host_bytes"),
    unit: str = "bytes",
) -> dict:
    """Replays ``trace`` through a `TieredCache` and returns its stats (the replay JSON).

    Args:
      trace: the accesses (see `read_trace`).
      device_bytes: L1 budget in bytes.
      host_bytes: L2 budget in bytes; 0 disables L2.
      policy: a policy name (``lfu``, ``lru``, ``lfu-plain``, ``belady``) or a `Policy`.
      prefetcher: a `predictor.Predictor` driving prefetch (see `TieredCache`), or None.
      prefetch: prefetch settings; ``lead`` models timeliness (a load issued at access ``i`` is
        usable from access ``i + lead``), ``keys_known`` says every key is in L3 from the start.
      warmup: accesses that only warm the cache and the predictor up: the counters start after
        them, and no prefetch is issued during them (e.g. the predictor's training part).
      progress: show a progress bar on stderr.
      label: the progress bar's label (the CLI names the policy and the size).
      names: how the budgets are named in warnings (the CLI's ``--device-bytes 5%``).
      unit: what sizes count, in warnings (``blocks`` on a unit-size trace).

    Returns:
      The cache's stats (the replay JSON of docs/design.md) plus ``trace``, ``device_bytes``,
      ``host_bytes``, ``accesses_per_second``, ``clock`` (``"trace"``, or ``"none"`` for a trace
      without timestamps) and ``ttl_applied``. Blocks larger than both budgets are never cached
      (each access to one is a miss), as in libCacheSim.

    Logs a warning (logger ``cacheflow_jax``, `cacheflow_jax.cache.advice`) where a budget is
    smaller than a block, where the trace re-reads its blocks yet L1 serves almost none of them
    (a streamed working set larger than L1), and where a prefetcher can issue nothing or
    issued nothing.

    Raises:
      BudgetError: a budget is negative, or ``device_bytes`` is 0.
    """
    store = TraceStore(trace)
    largest = store.largest
    for setting, value in (("device_bytes", device_bytes), ("host_bytes", host_bytes)):
        if value < 0:
            raise BudgetError(f"{setting}={value} is negative")
    if device_bytes == 0:
        raise BudgetError(f"device_bytes=0 cannot hold any object of {trace.path}; give a "
                          f"budget in bytes (its largest object has {largest}) or a percentage")
    if policy == "belady":
        from cacheflow_jax.policies.belady import belady

        pol = belady(trace)
    else:
        pol = get_policy(policy)
    clock = _Clock()
    tiers = [
        MetadataTier(device_bytes, name="device", setting="device_bytes"),
        MetadataTier(host_bytes, name="host", setting="host_bytes"),
    ]
    cache = TieredCache(
        store,
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        policy=pol,
        prefetcher=prefetcher,
        prefetch=prefetch,
        clock=clock,
        tiers=tiers,
        read_buffer=1,
    )
    if not 0 <= warmup <= len(trace.keys):
        raise ValueError(f"warmup={warmup} must be between 0 and the trace's {len(trace.keys)} accesses")
    for text in trace_budget_advice(store.sizes, trace.keys, device_bytes=device_bytes,
                                    host_bytes=host_bytes, prefetch=prefetcher is not None,
                                    names=names, unit=unit):  # fmt: skip
        logger.warning("%s: %s", trace.path, text)
    stats = _run(cache, clock, trace, store, (device_bytes, host_bytes), warmup, progress, label)
    _advise(trace, store, stats, device_bytes, warmup, (names, unit),
            None if prefetcher is None else prefetch or PrefetchSettings())  # fmt: skip
    return stats


def _run(cache: TieredCache, clock: _Clock, trace: Trace, store: TraceStore,
         budgets: tuple[int, int], warmup: int, progress: bool, label: str) -> dict:  # fmt: skip
    """Feeds the trace's accesses to the cache; returns its stats with the run's fields."""
    access = cache.access_many_sync
    keys = trace.keys
    sizes = store.sizes_of(keys)
    # No timestamps: time stands still at 0, so idle time (and TTL expiry) never accrues.
    times = trace.times() if trace.timed else [0.0] * len(keys)
    bar = None
    if progress:
        from tqdm.auto import tqdm  # only with a progress bar: it costs startup time

        # The bar stays on screen when done (leave=True), so a capture of stderr shows each
        # run's final count and rate rather than an erased line.
        bar = tqdm(total=len(keys), unit="acc", mininterval=0.5, desc=label)
    start = time.perf_counter()
    step = 8192
    if warmup:
        cache.pause_prefetch(True)
    lo = 0
    while lo < len(keys):
        hi = min(lo + step, len(keys))
        if lo < warmup < hi:
            hi = warmup  # the counters start exactly at the end of the warm-up
        access(keys[lo:hi], times[lo:hi], sizes[lo:hi])
        if hi == warmup:
            cache.reset_counters()
            cache.pause_prefetch(False)
        if bar is not None:
            bar.update(hi - lo)
        lo = hi
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    if times:
        clock.now = times[-1]
    stats = cache.stats()
    stats["trace"] = trace.path
    stats["device_bytes"], stats["host_bytes"] = budgets
    stats["accesses_per_second"] = len(keys) / elapsed if elapsed > 0 else 0.0
    stats["clock"] = "trace" if trace.timed else "none"
    stats["ttl_applied"] = trace.timed and stats["policy"].get("ttl") is not None
    return stats


def _advise(
    trace: Trace, store: TraceStore, stats: dict, device_bytes: int, warmup: int,
    words: tuple[tuple[str, str], str], prefetch: PrefetchSettings | None,
) -> None:  # fmt: skip
    """Logs what the counted run says went wrong (see `cacheflow_jax.cache.advice`)."""
    counted = len(trace.keys) - warmup
    if not counted:
        return
    distinct = store.sizes if not warmup else dict.fromkeys(trace.keys[warmup:])
    reused = counted - len(distinct)
    working = sum(store.sizes[k] for k in distinct)
    text = stream_advice(stats, reused=reused, working_bytes=working, device_bytes=device_bytes,
                         names=words[0], unit=words[1])  # fmt: skip
    if text is not None:
        logger.warning("%s: %s", trace.path, text)
    if prefetch is not None:
        text = prefetch_advice(stats, keys_known=prefetch.keys_known)
        if text is not None:
            logger.warning("%s: %s", trace.path, text)
