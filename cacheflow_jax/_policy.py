"""Eviction and admission policies: pure functions over an explicit state, optax-style.

A policy never stores blocks; the cache asks it which resident key to evict from a tier, whether a
newcomer may displace that victim, and which keys have outlived their TTL. Each policy is a
`Policy` of functions; its state is created by ``init(num_tiers)`` and passed back on every call.
The state is a NamedTuple of containers that the functions update in place: a copy-on-write
state would allocate on every cache hit, which the hot path must not do. The same functions run
in replay, in the live cache, and (for counters) on the device through ``lfu_update``.

Policies:

* ``lru()``: least recently used. O(1) per access and eviction.
* ``lfu(half_life=..., ttl=...)``: a decayed frequency count ``s <- s * 2**(-dt / half_life) + 1``
  (``dt`` in accesses, a logical clock), with admission against a bounded ghost history and a TTL in
  seconds. ``half_life -> 0`` orders like LRU, ``half_life -> inf`` like plain LFU.
  Ordering trick: because every score decays by the same factor, ``s_a(now) < s_b(now)`` iff
  ``log2(s_a) + t_a / h < log2(s_b) + t_b / h`` where ``t`` is the key's last update. That quantity
  (the *priority*) does not change while a key is idle, so a lazy min-heap keeps exact order.
  Cost: O(1) per access (two dict writes; no heap work, since priorities only grow and the heap
  keeps lower bounds that are refreshed when they reach the top), O(log n) per insert, amortised
  O(log n) per eviction, and a TTL sweep over the residents every ttl/8 seconds.
* ``lfu_plain(ttl=...)``: ``lfu`` with no decay (classic LFU with ghost admission).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

Key = str


class Policy(NamedTuple):
    """A cache policy: functions over a state made by ``init``.

    Attributes:
      name: short name used in stats and the CLI.
      init: ``init(num_tiers) -> state``.
      access: ``access(state, key, now)``; records one access (hit or miss) before any insert.
      insert: ``insert(state, tier, key, now)``; ``key`` became resident in ``tier``.
      remove: ``remove(state, tier, key)``; ``key`` left ``tier`` (evicted, promoted or deleted).
      victim: ``victim(state, tier) -> key | None``; the resident to evict next (not removed).
      admit: ``admit(state, key, victim) -> bool``; may ``key`` displace ``victim``?
      expired: ``expired(state, tier, now) -> list[key]``; residents older than the TTL.
      describe: ``describe(state) -> dict``; settings and adaptive values, for stats.
    """

    name: str
    init: Callable[[int], Any]
    access: Callable[[Any, Key, float], None]
    insert: Callable[[Any, int, Key, float], None]
    remove: Callable[[Any, int, Key], None]
    victim: Callable[[Any, int], Key | None]
    admit: Callable[[Any, Key, Key], bool]
    expired: Callable[[Any, int, float], list[Key]]
    describe: Callable[[Any], dict]


def _check_ttl(ttl: float | None) -> float:
    if ttl is None:
        return math.inf
    if not ttl > 0:
        raise ValueError(f"ttl={ttl!r} must be a positive number of seconds, or None for no TTL")
    return float(ttl)


def _expired(order: OrderedDict, now: float, ttl: float) -> list[Key]:
    # ``order`` maps key -> last access time in recency order, so the stale ones are a prefix.
    out = []
    if ttl == math.inf:
        return out
    limit = now - ttl
    for key, last in order.items():
        if last > limit:
            break
        out.append(key)
    return out


# --------------------------------------------------------------------------------------------- LRU


class LruState(NamedTuple):
    order: list  # per tier: OrderedDict[key, last access time], least recent first
    ttl: float
    last: dict  # key -> last access time, for keys resident anywhere (read by insert)


def lru(*, ttl: float | None = None) -> Policy:
    """Least recently used, with an optional TTL in seconds.

    Cost per access and per eviction: O(1).
    """
    ttl_s = _check_ttl(ttl)

    def init(num_tiers: int) -> LruState:
        return LruState([OrderedDict() for _ in range(num_tiers)], ttl_s, {})

    def access(state: LruState, key: Key, now: float) -> None:
        for order in state.order:
            if key in order:
                order[key] = now
                order.move_to_end(key)
                return

    def insert(state: LruState, tier: int, key: Key, now: float) -> None:
        state.order[tier][key] = now

    def remove(state: LruState, tier: int, key: Key) -> None:
        state.order[tier].pop(key, None)

    def victim(state: LruState, tier: int) -> Key | None:
        order = state.order[tier]
        return next(iter(order)) if order else None

    def admit(state: LruState, key: Key, victim_key: Key) -> bool:
        return True

    def expired(state: LruState, tier: int, now: float) -> list[Key]:
        return _expired(state.order[tier], now, state.ttl)

    def describe(state: LruState) -> dict:
        return {"name": "lru", "ttl": None if state.ttl == math.inf else state.ttl}

    return Policy("lru", init, access, insert, remove, victim, admit, expired, describe)


# --------------------------------------------------------------------------------------------- LFU


class LfuState(NamedTuple):
    resident: list  # per tier: dict[key, None], the keys resident in that tier
    heaps: list  # per tier: list[(priority, key)], lazy min-heap of lower bounds
    prio: dict  # key -> priority log2(s) + tick/half_life, for residents and ghosts
    last: dict  # key -> last access time in seconds (TTL), same keys as ``prio``
    ghosts: OrderedDict  # non-resident keys with a remembered score, oldest first
    params: list  # [1/half_life, tick (accesses so far), ghost limit, next TTL sweep]
    ttl: float


def lfu(
    *,
    half_life: float = 2048.0,
    ttl: float | None = 3600.0,
    ghost_entries: int = 65536,
) -> Policy:
    """Decayed LFU with ghost admission and a TTL (the default policy).

    Args:
      half_life: accesses after which an idle key's count halves. ``math.inf`` gives plain LFU;
        small values approach LRU.
      ttl: seconds without an access after which a block leaves L1/L2; ``None`` for no TTL.
      ghost_entries: how many non-resident keys' scores are remembered at most.

    Returns:
      The policy.

    >>> p = lfu(half_life=100.0)
    >>> s = p.init(1)
    >>> p.access(s, "a", 0.0); p.insert(s, 0, "a", 0.0); p.victim(s, 0)
    'a'
    """
    if not half_life > 0:
        raise ValueError(f"half_life={half_life!r} must be > 0 accesses (math.inf for plain LFU)")
    if ghost_entries < 0:
        raise ValueError(f"ghost_entries={ghost_entries!r} must be >= 0")
    ttl_s = _check_ttl(ttl)
    name = "lfu-plain" if half_life == math.inf else "lfu"
    log2 = math.log2

    def init(num_tiers: int) -> LfuState:
        return LfuState(
            [{} for _ in range(num_tiers)],
            [[] for _ in range(num_tiers)],
            {},
            {},
            OrderedDict(),
            [1.0 / half_life, 0.0, int(ghost_entries), -math.inf],
            ttl_s,
        )

    def access(state: LfuState, key: Key, now: float) -> None:
        params = state.params
        tick = params[1] = params[1] + 1.0
        base = tick * params[0]
        prio = state.prio
        old = prio.get(key)
        if old is None:
            prio[key] = base  # log2(1) + base
            state.ghosts[key] = None
            _trim_ghosts(state)
        else:
            x = old - base  # log2 of the decayed count
            prio[key] = base + (x if x > 60.0 else log2(1.0 + 2.0**x))
        state.last[key] = now

    def insert(state: LfuState, tier: int, key: Key, now: float) -> None:
        prio = state.prio
        p = prio.get(key)
        if p is None:  # inserted without an access (e.g. a prefetch): a fresh count
            params = state.params
            p = prio[key] = params[1] * params[0]
            state.last[key] = now
        else:
            state.ghosts.pop(key, None)
        state.resident[tier][key] = None
        heap = state.heaps[tier]
        heapq.heappush(heap, (p, key))
        if len(heap) > 64 and len(heap) > 4 * len(state.resident[tier]):
            heap[:] = [(prio[k], k) for k in state.resident[tier]]
            heapq.heapify(heap)

    def remove(state: LfuState, tier: int, key: Key) -> None:
        if state.resident[tier].pop(key, 0) is None:
            state.ghosts[key] = None
            _trim_ghosts(state)

    def victim(state: LfuState, tier: int) -> Key | None:
        heap, resident, prio = state.heaps[tier], state.resident[tier], state.prio
        while heap:
            p, key = heap[0]
            if key not in resident:
                heapq.heappop(heap)
                continue
            current = prio[key]
            if current == p:
                return key
            heapq.heapreplace(heap, (current, key))  # priorities only grow: a lower bound
        return None

    def admit(state: LfuState, key: Key, victim_key: Key) -> bool:
        prio = state.prio
        return prio.get(key, -math.inf) >= prio.get(victim_key, -math.inf)

    def expired(state: LfuState, tier: int, now: float) -> list[Key]:
        # A sweep over the residents every ttl/8 seconds: O(1) amortised per access, and no
        # per-access bookkeeping. A block leaves between ttl and 9/8 ttl after its last access.
        ttl = state.ttl
        params = state.params
        if ttl == math.inf or now < params[3]:
            return []
        if tier == len(state.resident) - 1:
            params[3] = now + ttl / 8
        limit = now - ttl
        last = state.last
        return [k for k in state.resident[tier] if last[k] <= limit]

    def describe(state: LfuState) -> dict:
        inv = state.params[0]
        return {
            "name": name,
            "half_life": None if inv == 0 else 1.0 / inv,
            "ttl": None if state.ttl == math.inf else state.ttl,
            "ghost_entries": state.params[2],
        }

    return Policy(name, init, access, insert, remove, victim, admit, expired, describe)


def lfu_plain(*, ttl: float | None = 3600.0, ghost_entries: int = 65536) -> Policy:
    """Classic LFU (no decay) with ghost admission and a TTL, for comparison."""
    return lfu(half_life=math.inf, ttl=ttl, ghost_entries=ghost_entries)


def _trim_ghosts(state: LfuState) -> None:
    ghosts = state.ghosts
    limit = state.params[2]
    while len(ghosts) > limit:
        key, _ = ghosts.popitem(last=False)
        if not any(key in r for r in state.resident):
            del state.prio[key]
            del state.last[key]


POLICIES: dict[str, Callable[..., Policy]] = {"lfu": lfu, "lru": lru, "lfu-plain": lfu_plain}


def get_policy(name_or_policy: str | Policy, **settings: Any) -> Policy:
    """Returns a policy by name (``lfu``, ``lru``, ``lfu-plain``) or passes a `Policy` through.

    Raises:
      ValueError: the name is unknown; the message lists the known names.
    """
    if isinstance(name_or_policy, Policy):
        return name_or_policy
    try:
        factory = POLICIES[name_or_policy]
    except KeyError:
        raise ValueError(
            f"unknown policy {name_or_policy!r}; choose one of {sorted(POLICIES)}"
        ) from None
    return factory(**settings)
