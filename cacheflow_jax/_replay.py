"""Replay: drive the live cache's objects over a trace, with a store that holds metadata only.

`replay` builds the very `TieredCache` and `Policy` that serve live traffic, swaps the data tiers
for `MetadataTier` (residency and bytes, no payload) and the store for a `TraceStore` (block sizes
from the trace), and feeds it the trace's accesses with the trace's own clock. The counters it
returns are therefore the live cache's counters on that access stream.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from tqdm.auto import tqdm

from cacheflow_jax._blocks import ArrayInfo, BlockInfo, BudgetError
from cacheflow_jax._cache import TieredCache
from cacheflow_jax._policy import Policy, get_policy
from cacheflow_jax._prefetch import PrefetchSettings
from cacheflow_jax._tiers import PRESENT, MetadataTier
from cacheflow_jax._trace import Trace

_U8 = np.dtype(np.uint8)


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
    """key -> BlockInfo; a missing key is a KeyError naming the key and the store."""

    def __init__(self, spec: str, items: dict) -> None:
        super().__init__(items)
        self.spec = spec

    def __missing__(self, key: str) -> BlockInfo:
        raise KeyError(f"no block {key!r} in store {self.spec}")


class TraceStore:
    """A `Store` that knows each key's size from a trace and holds no data."""

    def __init__(self, trace: Trace) -> None:
        self.spec = f"trace:{trace.path}"
        self._sizes = trace.sizes()
        infos = {k: BlockInfo(k, (n,), _U8, n) for k, n in self._sizes.items()}
        # ``info`` is the dict's own lookup: replay asks for a size on every access.
        self.info = _Infos(self.spec, infos).__getitem__

    def arrays(self) -> Mapping[str, ArrayInfo]:
        return {}

    def keys(self) -> Sequence[str]:
        return list(self._sizes)

    def read(self, key: str) -> _Ready:
        return _PRESENT_FUTURE

    def read_many(self, keys: Sequence[str]) -> list[_Ready]:
        return [_PRESENT_FUTURE] * len(keys)

    def write(self, key: str, value: Any) -> _Ready:
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


# ------------------------------------------------------------------------------------ Belady


class BeladyState(NamedTuple):
    resident: list  # per tier: dict[key, None]
    heaps: list  # per tier: list[(-next_use, key)]
    next_use: dict  # key -> index of its next access (inf: never again)
    nxt: np.ndarray  # per access index: index of the next access to the same key
    sizes: dict  # key -> nbytes
    position: list  # [index of the current access]
    size_aware: bool


def next_uses(keys: Sequence[str]) -> np.ndarray:
    """For each access, the index of the next access to the same key (``len(keys)`` if none)."""
    n = len(keys)
    out = np.full(n, n, dtype=np.int64)
    seen: dict[str, int] = {}
    for i in range(n - 1, -1, -1):
        key = keys[i]
        j = seen.get(key)
        if j is not None:
            out[i] = j
        seen[key] = i
    return out


def belady(trace: Trace, *, size_aware: bool | None = None) -> Policy:
    """The offline optimum for replay: evict the block whose next use is farthest away.

    For unit sizes this is Belady's MIN with bypass: a newcomer is admitted only if it is used again
    sooner than the victim, which no online policy can beat. ``size_aware`` (on by default when
    sizes differ) looks at the 16 residents with the farthest next use and evicts the one with the
    largest ``size * distance to next use``, a heuristic in the spirit of libCacheSim's
    ``BeladySize`` (the exact size-aware optimum is NP-hard).

    It must see the trace's accesses in order, exactly once each: replay only.
    """
    sizes = trace.sizes()
    if size_aware is None:
        size_aware = len(set(sizes.values())) > 1
    nxt = next_uses(trace.keys)
    end = float(len(trace.keys))

    def init(num_tiers: int) -> BeladyState:
        return BeladyState(
            [{} for _ in range(num_tiers)],
            [[] for _ in range(num_tiers)],
            {},
            nxt,
            sizes,
            [-1],
            bool(size_aware),
        )

    def access(state: BeladyState, key: str, now: float) -> None:
        i = state.position[0] = state.position[0] + 1
        n = float(state.nxt[i]) if i < len(state.nxt) else end
        state.next_use[key] = n if n < end else math.inf
        for tier, resident in enumerate(state.resident):
            if key in resident:
                heapq.heappush(state.heaps[tier], (-state.next_use[key], key))
                break

    def insert(state: BeladyState, tier: int, key: str, now: float, nbytes: int = 1) -> None:
        state.resident[tier][key] = None
        heapq.heappush(state.heaps[tier], (-state.next_use.get(key, math.inf), key))

    def remove(state: BeladyState, tier: int, key: str) -> None:
        state.resident[tier].pop(key, None)

    def _top(state: BeladyState, tier: int) -> str | None:
        heap, resident, next_use = state.heaps[tier], state.resident[tier], state.next_use
        while heap:
            p, key = heap[0]
            if key in resident and -p == next_use[key]:
                return key
            heapq.heappop(heap)
        return None

    def victim(state: BeladyState, tier: int) -> str | None:
        top = _top(state, tier)
        if top is None or not state.size_aware:
            return top
        now = state.position[0]
        heap, resident, next_use = state.heaps[tier], state.resident[tier], state.next_use
        # Pop the 16 farthest valid entries (O(16 log n)), score them, push them back.
        taken = []
        while heap and len(taken) < 16:
            p, key = heapq.heappop(heap)
            if key in resident and -p == next_use[key]:
                taken.append((p, key))
        best = max(taken, key=lambda e: (next_use[e[1]] - now) * state.sizes[e[1]])[1]
        for entry in taken:
            heapq.heappush(heap, entry)
        return best

    def admit(state: BeladyState, key: str, victim_key: str) -> bool:
        return state.next_use.get(key, math.inf) < state.next_use.get(victim_key, math.inf)

    def expired(state: BeladyState, tier: int, now: float) -> list[str]:
        return []

    def describe(state: BeladyState) -> dict:
        return {"name": "belady", "size_aware": state.size_aware}

    return Policy("belady", init, access, insert, remove, victim, admit, expired, describe)


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

    Raises:
      BudgetError: a budget is negative, or a non-zero budget is smaller than the largest object.
    """
    store = TraceStore(trace)
    largest = store.largest
    for setting, value in (("device_bytes", device_bytes), ("host_bytes", host_bytes)):
        if value < 0:
            raise BudgetError(f"{setting}={value} is negative")
        if 0 < value < largest or (setting == "device_bytes" and value == 0):
            raise BudgetError(
                f"{setting}={value} is smaller than the largest object of {trace.path} "
                f"({largest} bytes); give at least {largest} bytes or a percentage such as 5%"
            )
    pol = belady(trace) if policy == "belady" else get_policy(policy)
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
    get = cache.access_sync
    times = trace.t.tolist()
    keys = trace.keys
    # The bar stays on screen when done (leave=True), so a capture of stderr shows each run's
    # final count and rate rather than an erased line.
    bar = tqdm(total=len(keys), disable=not progress, unit="acc", mininterval=0.5, desc=label)
    start = time.perf_counter()
    step = 8192
    if warmup:
        cache.pause_prefetch(True)
    lo = 0
    while lo < len(keys):
        hi = min(lo + step, len(keys))
        if lo < warmup < hi:
            hi = warmup  # the counters start exactly at the end of the warm-up
        for key, now in zip(keys[lo:hi], times[lo:hi]):
            get(key, now)
        if hi == warmup:
            cache.reset_counters()
            cache.pause_prefetch(False)
        bar.update(hi - lo)
        lo = hi
    elapsed = time.perf_counter() - start
    bar.close()
    if times:
        clock.now = times[-1]
    stats = cache.stats()
    stats["trace"] = trace.path
    stats["device_bytes"] = device_bytes
    stats["host_bytes"] = host_bytes
    stats["accesses_per_second"] = len(keys) / elapsed if elapsed > 0 else 0.0
    return stats
