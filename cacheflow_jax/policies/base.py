"""What every policy is: a `Policy` of pure functions over a state that ``init`` makes.

A policy never stores blocks; the cache (`TieredCache`) asks it which resident key to evict from a
tier, whether a newcomer may displace that victim, and which keys have outlived their TTL. Its state
is a class with named fields whose containers the functions update in place: a copy-on-write state
would allocate on every cache hit, which the hot path must not do. The same functions run in replay
and in the live cache.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

Key = str


class Policy(NamedTuple):
    """A cache policy: functions over a state made by ``init``.

    The cache calls them in this order for one access: ``access`` (hit or miss), then, for a key
    that must move into a tier, ``victim``/``admit``/``remove`` until it fits, then ``insert``. A
    block demoted from L1 to L2 is ``remove(0, key)`` then ``insert(1, key)``; one promoted from L2
    is ``access``, ``remove(1, key)``, then ``insert(0, key)``. One promoted without an access (the
    prefetch worker's layer-ahead step) is ``remove(1, key, moving=True)`` then ``insert(0, key)``:
    it moves, it does not leave the cache.

    In the live cache a move spans a transfer, and another thread's access can come between the
    ``remove`` and the ``insert``. A state with an ``in_transit`` attribute gets the cache's map of
    keys in transit there (`Planner.watch_transit`): a key removed from a tier and still in it is
    on its way, not gone. Replay moves blocks at once and leaves it empty.

    Attributes:
      name: short name used in stats and the CLI.
      init: ``init(num_tiers) -> state``.
      access: ``access(state, key, now)``; records one access (hit or miss) before any insert.
      insert: ``insert(state, tier, key, now, nbytes=1)``; ``key`` (of ``nbytes`` bytes) became
        resident in ``tier``.
      remove: ``remove(state, tier, key, moving=False)``; ``key`` left ``tier`` (evicted, moved or
        deleted); ``moving``: it goes to another tier without an access.
      victim: ``victim(state, tier) -> key | None``; the resident of ``tier`` to evict next (the
        caller removes it).
      admit: ``admit(state, key, victim) -> bool``; may ``key`` enter the tier in place of
        ``victim``? (`admit_all` says yes to all; the cache then skips the call.)
      expired: ``expired(state, tier, now) -> list[key]``; residents idle longer than the TTL.
      describe: ``describe(state) -> dict``; settings and adaptive values, for stats.
      hits: optional ``hits(state, keys, now)``: ``access`` of each of ``keys`` in turn, for a
        batch of hits the cache buffered; it must leave the state exactly as those accesses
        would (it is only faster). None: the cache calls ``access`` for each.
    """

    name: str
    init: Callable[[int], Any]
    access: Callable[[Any, Key, float], None]
    insert: Callable[..., None]
    remove: Callable[..., None]
    victim: Callable[[Any, int], Key | None]
    admit: Callable[[Any, Key, Key], bool]
    expired: Callable[[Any, int, float], list[Key]]
    describe: Callable[[Any], dict]
    hits: Callable[[Any, Sequence[Key], float], None] | None = None


def admit_all(state: Any, key: Key, victim_key: Key) -> bool:
    """The ``admit`` of policies that take every newcomer; the cache skips calling it."""
    return True


def check_ttl(ttl: float | None) -> float:
    """``ttl`` in seconds as a float (``math.inf`` for None).

    Raises:
      ValueError: ``ttl`` is not a positive number.
    """
    if ttl is None:
        return math.inf
    if not ttl > 0:
        raise ValueError(f"ttl={ttl!r} must be a positive number of seconds, or None for no TTL")
    return float(ttl)


def expired_prefix(order: OrderedDict, now: float, ttl: float) -> list[Key]:
    """The keys of ``order`` (key -> last access time, oldest first) idle for ``ttl`` or more."""
    out: list[Key] = []
    if ttl == math.inf:
        return out
    limit = now - ttl
    for key, last in order.items():
        if last > limit:
            break
        out.append(key)
    return out
