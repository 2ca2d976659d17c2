"""Miniature simulations: shadow caches of fixed settings, run on a sample of the keys.

Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations" (USENIX ATC'17):
a cache of ``r`` times the bytes, fed only the accesses to keys whose hash falls in a sample of
rate ``r``, misses about as often as the full cache. `lfu` runs one such shadow per candidate
window share and compares their hits with its own hits on the same sampled accesses.

The rate is 1 (every key) while the cache holds at most ``2 * sample`` blocks and halves each time
the cache outgrows that again; the new sample is a subset of the old one (one more low bit of
the hash must be 0), so the shadows keep their sampled residents and evict the rest. Only sampled
accesses touch the shadows; telling a sampled key from another is one set lookup.
"""

from __future__ import annotations

import math
import operator
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from cacheflow_jax.policies.base import Key, Policy


def key_hash(key: Key) -> int:
    """A hash of ``key`` that is the same in every process (``hash(str)`` is salted)."""
    return zlib.crc32(key.encode() if isinstance(key, str) else repr(key).encode())


class Shadow:
    """A policy at one fixed setting over a cache of the sampled bytes, counting its hits."""

    __slots__ = ("setting", "policy", "state", "sizes", "used", "hits", "_access", "_victim",
                 "_remove", "_insert", "_hit")

    def __init__(
        self, setting: float, policy: Policy, hit: Callable[[Any, Key], None] | None = None
    ) -> None:
        self.setting = setting
        self.policy = policy
        self.state = policy.init(1)
        self.sizes: dict = {}  # resident key -> nbytes
        self.used = 0
        self.hits = 0
        # The policy's functions, bound once (a NamedTuple's fields cost a lookup each).
        self._access, self._victim = policy.access, policy.victim
        self._remove, self._insert = policy.remove, policy.insert
        self._hit = hit or (lambda state, key: policy.access(state, key, 0.0))

    def step(self, key: Key, nbytes: int, budget: float) -> None:
        """One sampled access of ``key`` (``nbytes``) to a cache of ``budget`` bytes."""
        state, sizes = self.state, self.sizes
        if key in sizes:
            self._hit(state, key)
            self.hits += 1
            return
        self._access(state, key, 0.0)
        if nbytes > budget:
            return
        used = self.used
        while used + nbytes > budget and sizes:
            gone = self._victim(state, 0)
            used -= sizes.pop(gone)
            self._remove(state, 0, gone)
        self._insert(state, 0, key, 0.0, nbytes)
        sizes[key] = nbytes
        self.used = used + nbytes

    def prune(self, keep: Callable[[Key], bool]) -> None:
        """Evicts the residents that left the sample."""
        for key in [k for k in self.sizes if not keep(k)]:
            self.used -= self.sizes.pop(key)
            self.policy.remove(self.state, 0, key)


class LruShadow:
    """The share 1 of `lfu`, which is exactly LRU, as a plain LRU list (a fifth of the cost)."""

    __slots__ = ("setting", "sizes", "used", "hits")

    def __init__(self) -> None:
        self.setting = 1.0
        self.sizes: OrderedDict = OrderedDict()  # key -> nbytes, least recent first
        self.used = 0
        self.hits = 0

    def step(self, key: Key, nbytes: int, budget: float) -> None:
        """One sampled access of ``key`` (``nbytes``) to a cache of ``budget`` bytes."""
        sizes = self.sizes
        if key in sizes:
            sizes.move_to_end(key)
            self.hits += 1
            return
        if nbytes > budget:
            return
        while self.used + nbytes > budget and sizes:
            self.used -= sizes.popitem(last=False)[1]
        sizes[key] = nbytes
        self.used += nbytes

    def prune(self, keep: Callable[[Key], bool]) -> None:
        """Evicts the residents that left the sample."""
        for key in [k for k in self.sizes if not keep(k)]:
            self.used -= self.sizes.pop(key)


class MiniSims:
    """Shadows of ``make(setting)`` per setting, refereeing the live cache on sampled accesses.

    ``hit(state, key)``, if given, is ``make(s).access(state, key, 0.0)`` for a key the shadow
    holds, only faster (`lfu` passes one).

    Each shadow and the live cache count their hits on the sampled accesses since the last
    jump. When the shadow with the most hits leads, by ``lead`` times the blocks a shadow holds,
    the lower of the live cache and the shadow nearest the live setting (the lower setting on a
    tie), `step` returns its setting (the jump) and every count starts again from 0. The nearest
    shadow is the fair reference for a setting (a miniature cache misses a little more than the
    full one); the live cache is the reference for its contents (a cache that holds what an
    earlier setting chose can trail the shadow of its own setting).
    """

    __slots__ = ("shadows", "shift", "mask", "members", "known", "budget", "live", "sample",
                 "lead", "near", "near_setting")

    def __init__(
        self, make: Callable[[float], Policy], settings: Sequence[float], *, sample: int,
        lead: float, known: Iterable[Key], hit: Callable[[Any, Key], None] | None = None,
    ) -> None:
        self.shadows = [LruShadow() if s == 1.0 else Shadow(s, make(s), hit) for s in settings]
        self.shift = 0  # a key is sampled when the low ``shift`` bits of its hash are 0
        self.mask = 0
        self.members: set = set()  # the sampled keys among ``known`` (only while mask != 0)
        self.known = known  # every key the live cache remembers (its scores)
        self.budget = 0.0  # the shadows' bytes: the most the live cache held, times the rate
        self.live = 0  # the live cache's hits on sampled accesses since the last jump
        self.sample = sample
        self.lead = lead
        self.near = self.shadows[0]  # the shadow nearest ``near_setting`` (the lower on a tie)
        self.near_setting = math.nan  # the live setting ``near`` was found for (none yet)

    def sampled(self, key: Key) -> bool:
        """Is ``key`` in the sample (computed from its hash)?"""
        return not key_hash(key) & self.mask

    def new_key(self, key: Key) -> None:
        """The live cache met ``key`` (again): note it if it is sampled."""
        if self.mask and not key_hash(key) & self.mask:
            self.members.add(key)

    def step(
        self, key: Key, nbytes: int, hit: bool, resident: int, count: int, setting: float,
    ) -> float | None:
        """A sampled access; ``resident``/``count``/``setting``: the live cache's bytes, blocks
        and setting now.

        Returns:
          The setting to jump to, or None.
        """
        shift = self.shift
        budget = resident / (1 << shift)
        if budget > self.budget:
            self.budget = budget
        if count >> shift > 2 * self.sample:  # the cache outgrew the sample: halve the rate
            shift = self.shift = shift + 1
            self.mask = (1 << shift) - 1
            self.budget /= 2
            self.members = {k for k in self.known if self.sampled(k)}
            for shadow in self.shadows:
                shadow.prune(self.sampled)
            if key not in self.members:
                return None
        budget = self.budget
        shadows = self.shadows
        for shadow in shadows:
            shadow.step(key, nbytes, budget)
        live = self.live = self.live + hit
        leader = max(shadows, key=_hits)
        need = self.lead * max(count >> shift, 8)
        if leader.hits - live < need:
            if setting != self.near_setting:
                self.near_setting = setting
                self.near = min(shadows, key=lambda shadow: abs(shadow.setting - setting))
            if leader.hits - self.near.hits < need:
                return None
        for shadow in shadows:
            shadow.hits = 0
        self.live = 0
        return leader.setting


_hits = operator.attrgetter("hits")
