"""Belady's MIN: the offline optimum, for replay (it must know the trace's future).

The victim is the resident whose next use is farthest away, and a newcomer is admitted only if it
is used again sooner than that victim (MIN with bypass), which no online policy can beat with unit
sizes. For sized traces it looks at the 16 residents with the farthest next use and evicts the one
with the largest ``size * distance to next use``, in the spirit of libCacheSim's ``BeladySize``
(the exact size-aware optimum is NP-hard). Cost per access: O(log n) (a lazy max-heap per tier).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from cacheflow_jax.policies.base import Key, Policy

if TYPE_CHECKING:
    from cacheflow_jax.trace.reader import Trace

_SIZE_SAMPLE = 16  # residents scored by size * distance in the size-aware variant


class BeladyState(NamedTuple):
    """The state of `belady`."""

    resident: list[dict]  # per tier: key -> None
    heaps: list[list]  # per tier: (-next_use, key), lazy (stale entries skipped)
    next_use: dict  # key -> index of its next access (inf: never again)
    nxt: np.ndarray  # per access index: index of the next access to the same key
    sizes: dict  # key -> nbytes
    position: list  # [index of the current access]
    size_aware: bool


def next_uses(keys: Sequence[str]) -> np.ndarray:
    """For each access, the index of the next access to the same key (``len(keys)`` if none).

    >>> next_uses(["a", "b", "a"]).tolist()
    [2, 3, 3]
    """
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
    """The offline optimum over ``trace``; it must see the trace's accesses in order, once each.

    Args:
      trace: the trace that replay will feed, access by access.
      size_aware: score victims by size times distance (default: when sizes differ).

    Returns:
      The policy (replay only: its ``access`` reads the trace's future).
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

    def access(state: BeladyState, key: Key, now: float) -> None:
        i = state.position[0] = state.position[0] + 1
        n = float(state.nxt[i]) if i < len(state.nxt) else end
        state.next_use[key] = n if n < end else math.inf
        for tier, resident in enumerate(state.resident):
            if key in resident:
                heapq.heappush(state.heaps[tier], (-state.next_use[key], key))
                break

    def insert(state: BeladyState, tier: int, key: Key, now: float, nbytes: int = 1) -> None:
        state.resident[tier][key] = None
        heapq.heappush(state.heaps[tier], (-state.next_use.get(key, math.inf), key))

    def remove(state: BeladyState, tier: int, key: Key, moving: bool = False) -> None:
        state.resident[tier].pop(key, None)

    def _top(state: BeladyState, tier: int) -> Key | None:
        heap, resident, next_use = state.heaps[tier], state.resident[tier], state.next_use
        while heap:
            p, key = heap[0]
            if key in resident and -p == next_use[key]:
                return key
            heapq.heappop(heap)
        return None

    def victim(state: BeladyState, tier: int) -> Key | None:
        top = _top(state, tier)
        if top is None or not state.size_aware:
            return top
        now = state.position[0]
        heap, resident, next_use = state.heaps[tier], state.resident[tier], state.next_use
        taken = []  # the farthest valid entries, scored and pushed back
        while heap and len(taken) < _SIZE_SAMPLE:
            p, key = heapq.heappop(heap)
            if key in resident and -p == next_use[key]:
                taken.append((p, key))
        best = max(taken, key=lambda e: (next_use[e[1]] - now) * state.sizes[e[1]])[1]
        for entry in taken:
            heapq.heappush(heap, entry)
        return best

    def admit(state: BeladyState, key: Key, victim_key: Key) -> bool:
        return state.next_use.get(key, math.inf) < state.next_use.get(victim_key, math.inf)

    def expired(state: BeladyState, tier: int, now: float) -> list[Key]:
        return []

    def describe(state: BeladyState) -> dict:
        return {"name": "belady", "size_aware": state.size_aware}

    return Policy("belady", init, access, insert, remove, victim, admit, expired, describe)
