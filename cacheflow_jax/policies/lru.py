"""Least recently used, per tier, with an optional TTL.

Each tier keeps its residents in an ``OrderedDict`` in access order; the victim is the first.
Since tiers are exclusive and an access promotes a block to L1, L1 + L2 under ``lru`` hold exactly
what one LRU cache of the summed size holds. Cost per access, insert, remove and victim: O(1).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

from cacheflow_jax.policies.base import Key, Policy, admit_all, check_ttl, expired_prefix


class LruState(NamedTuple):
    """The state of `lru`."""

    order: list[OrderedDict]  # per tier: key -> last access time (seconds), least recent first
    ttl: float  # seconds; math.inf: no TTL
    moving: dict  # key -> last access time of a key that left a tier during the current access


def lru(*, ttl: float | None = None) -> Policy:
    """Least recently used, with an optional TTL.

    Args:
      ttl: seconds without an access after which a block leaves L1/L2; None (the default): never.

    Returns:
      The policy.

    Raises:
      ValueError: ``ttl`` is not a positive number.

    >>> p = lru()
    >>> s = p.init(1)
    >>> for k in "ab": p.access(s, k, 0.0); p.insert(s, 0, k, 0.0)
    >>> p.access(s, "a", 1.0); p.victim(s, 0)
    'b'
    """
    ttl_s = check_ttl(ttl)

    def init(num_tiers: int) -> LruState:
        return LruState([OrderedDict() for _ in range(num_tiers)], ttl_s, {})

    def access(state: LruState, key: Key, now: float) -> None:
        if state.moving:
            state.moving.clear()  # keys that left during the previous access and were not put back
        for order in state.order:
            if key in order:
                order[key] = now
                order.move_to_end(key)
                return

    def insert(state: LruState, tier: int, key: Key, now: float, nbytes: int = 1) -> None:
        # A block moved between tiers keeps its last access time: a move is not an access.
        state.order[tier][key] = state.moving.pop(key, now) if state.moving else now

    def remove(state: LruState, tier: int, key: Key, moving: bool = False) -> None:
        last = state.order[tier].pop(key, None)
        if last is not None and state.ttl != math.inf:
            state.moving[key] = last

    def victim(state: LruState, tier: int) -> Key | None:
        order = state.order[tier]
        return next(iter(order)) if order else None

    def expired(state: LruState, tier: int, now: float) -> list[Key]:
        return expired_prefix(state.order[tier], now, state.ttl)

    def describe(state: LruState) -> dict:
        return {"name": "lru", "ttl": None if state.ttl == math.inf else state.ttl}

    return Policy("lru", init, access, insert, remove, victim, admit_all, expired, describe)
