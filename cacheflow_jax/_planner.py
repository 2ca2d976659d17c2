"""The planner: the one place that decides how blocks move between tiers.

Every path that moves blocks asks it: the threaded `TieredCache.get` / `get_many` /
`get_host_many`, replay's `access_sync`, `put`, `evict`, TTL expiry, and the prefetch scheduler's
loads. The cache carries the decisions out, with data (live) or without (replay), so the same
access stream leaves the same blocks in the same tiers either way (a test checks residency after
every access, with prefetch on and off).

The decisions:

* ``access(key, now)``: the policy sees the access. A prefetched block seen for the first time
  is *used*: it stops being an unused prefetch (``access`` says so, for the counters).
* ``victim(tier, newcomer, prefetch=...)``: which resident leaves to make room in ``tier``:

  1. a stale prefetched block: one not used by the time it was expected to be (see 3), oldest
     first. A guess that has not paid off leaves before anything the stream asked for; a guess
     whose time has not come yet is an ordinary resident, counted as accessed at the time it is
     expected to be used (so other guesses do not push it out before its turn);
  2. else the policy's victim, if the policy admits the newcomer against it (`Policy.admit`);
  3. for a prefetch, only if the victim is not worth more than the guess. The policy already
     chose the least valuable resident; what it cannot know is that the stream is about to use
     it again. A guess the predictor ranks ``r``-th (its ranking orders by urgency) is expected
     about ``r`` accesses from now (the caller passes that as ``min_age``). When the victim was
     accessed at least twice, the accesses between its last two (its reuse gap, remembered
     across tiers) say when it is due again: the guess is refused if that falls within the next
     ``r`` accesses, and displaces it otherwise (a victim overdue, or due after the guess). So
     in a loop of accesses, such as a model's layers step after step, the block just used is
     due a whole loop later and makes room for the next one's. Without a gap, the recency
     assumption LRU rests on applies: a victim accessed within the last ``r`` accesses is still
     in use and is expected again no later than the guess, so it is refused. (Weak guesses are
     not issued at all: the scheduler's ``min_score``.)

  It returns the victim's key, ``None`` when nothing can leave (every byte is in transit), or
  `REFUSED` when the newcomer may not displace the victim (it then goes to a lower tier or is
  not cached).
* ``destination(tier, was_unused)``: where a victim goes: L1's to L2 when there is an L2, L2's out
  of the cache; an unused prefetched block leaves the cache from any tier (demoting a wrong
  guess would only push a useful block out of L2).
* ``insert`` / ``remove``: the policy's bookkeeping, plus which blocks are unused prefetches.

Cost: two dict lookups and two stores per access on top of the policy's when prefetch is on
(the reuse gaps of at most `GAP_KEYS` keys are kept, the oldest dropped first); none when off.
"""

from __future__ import annotations

import itertools
from typing import Any

from cacheflow_jax._policy import Policy, admit_all

DEVICE, HOST = 0, 1
_NEVER = -(1 << 62)  # the access count of a block never accessed (a prefetch not used yet)
GAP_KEYS = 1 << 16  # keys whose reuse gap is remembered, at most


def _trim(table: dict) -> None:
    """Drops the oldest quarter of ``table``'s entries."""
    for key in list(itertools.islice(table, len(table) // 4)):
        del table[key]


class _Refused:
    __slots__ = ()

    def __repr__(self) -> str:
        return "REFUSED"


REFUSED: Any = _Refused()  # `Planner.victim`: the newcomer may not displace the victim


class Planner:
    """Decides victims, admission and destinations over one policy's state (see the module doc).

    Args:
      policy: the eviction policy.
      num_tiers: the number of tiers (L1, L2).
      has_host: whether L2 holds blocks (budget > 0); L1's victims go there if so.
      tracking: keep the prefetch bookkeeping (access counts, unused prefetched blocks); off, it
        costs nothing per access.

    Not thread-safe: the cache calls it under its lock (replay from one thread).
    """

    __slots__ = (
        "policy", "state", "admit", "has_host", "tracking", "count", "last_seen",
        "unused", "left", "gap", "_access", "_victim", "_insert", "_remove",
    )  # fmt: skip

    def __init__(
        self, policy: Policy, num_tiers: int, *, has_host: bool, tracking: bool = False
    ) -> None:
        self.policy = policy
        self.state = policy.init(num_tiers)
        self.admit = None if policy.admit is admit_all else policy.admit
        self.has_host = has_host
        self.tracking = tracking
        self.count = 0  # accesses seen (prefetch bookkeeping only)
        self.last_seen: dict[str, int] = {}  # resident key -> the access count at its last access
        # Per tier, the unused prefetched blocks (key -> the access count at which each is
        # expected to be used), oldest first.
        self.unused: list[dict[str, float]] = [{} for _ in range(num_tiers)]
        # Keys that left a tier (to another, or out): the access count of their last access, so
        # that the next access knows their reuse gap. And any key's reuse gap: the accesses
        # between its last two. Both bounded by GAP_KEYS (trimmed on the miss path).
        self.left: dict[str, int] = {}
        self.gap: dict[str, int] = {}
        self._access = policy.access
        self._victim = policy.victim
        self._insert = policy.insert
        self._remove = policy.remove

    def access(self, key: str, now: float) -> bool:
        """The policy sees an access; returns True if it is the first use of a prefetched block."""
        self._access(self.state, key, now)
        if not self.tracking:
            return False
        count = self.count = self.count + 1
        first_use = any(unused and unused.pop(key, None) is not None for unused in self.unused)
        last_seen = self.last_seen
        seen = last_seen.get(key)
        if seen is not None:
            last_seen[key] = count
        elif self.left:
            seen = self.left.pop(key, None)
        if seen is not None and not first_use:  # a first use's `seen` is when it was expected
            self.gap[key] = count - seen
        return first_use

    def victim(
        self, tier: int, newcomer: str | None, *, prefetch: bool = False, min_age: float = 0.0
    ) -> Any:
        """The resident of ``tier`` to evict for ``newcomer`` (None: an explicit put, admitted).

        For a ``prefetch``, ``min_age`` is the guess's expected distance to its use (its rank):
        a victim accessed within it is worth more and stays.

        Returns:
          A key, None (nothing resident can leave), or `REFUSED`.
        """
        unused = self.unused[tier]
        if unused:
            key, due = next(iter(unused.items()))
            if due < self.count:
                return key  # stale: it was not used when it was expected to be
        victim = self._victim(self.state, tier)
        if victim is None:
            return None
        if newcomer is not None and self.admit is not None and not self.admit(
            self.state, newcomer, victim
        ):
            return REFUSED
        if prefetch:
            age = self.count - self.last_seen.get(victim, _NEVER)
            gap = self.gap.get(victim)
            if (age <= min_age) if gap is None else (0 <= gap - age <= min_age):
                return REFUSED
        return victim

    def remove(self, tier: int, key: str) -> tuple[bool, int | None]:
        """Forgets ``key`` in ``tier``.

        Returns:
          ``(was_unused, seen)``: whether it was an unused prefetch (wasted), and the access count
          of its last access, to pass to `insert` when the block is demoted (None when
          prefetch bookkeeping is off).
        """
        self._remove(self.state, tier, key)
        if not self.tracking:
            return False, None
        was_unused = self.unused[tier].pop(key, None) is not None
        seen = self.last_seen.pop(key, None)
        if seen is not None and not was_unused:
            left = self.left
            left[key] = seen
            if len(left) > GAP_KEYS:
                _trim(left)
            if len(self.gap) > GAP_KEYS:
                _trim(self.gap)
        return was_unused, seen

    def insert(
        self,
        tier: int,
        key: str,
        now: float,
        nbytes: int,
        *,
        prefetched: bool = False,
        expected: float = 0.0,
        seen: int | None = None,
    ) -> None:
        """Records ``key`` as resident in ``tier``.

        A prefetched block starts unused, counted as accessed when it is ``expected`` to be
        (that many accesses from now); a demoted block keeps its last access (``seen``, from
        `remove`); any other block counts as accessed now.
        """
        self._insert(self.state, tier, key, now, nbytes)
        if self.tracking:
            if seen is not None:
                self.left.pop(key, None)  # a demotion: `seen` is still its last access
            if prefetched:
                due = self.count + expected
                self.last_seen[key] = due  # type: ignore[assignment]
                self.unused[tier][key] = due
            else:
                self.last_seen[key] = self.count if seen is None else seen

    def destination(self, tier: int, was_unused: bool) -> int | None:
        """Where a victim of ``tier`` goes: L2 (for L1's, when there is one) or None (out)."""
        if tier == DEVICE and self.has_host and not was_unused:
            return HOST
        return None

    def is_unused(self, key: str) -> bool:
        """True if ``key`` is an unused prefetched block in any tier."""
        return any(key in unused for unused in self.unused)

    def expired(self, tier: int, now: float) -> list[str]:
        """The residents of ``tier`` past the policy's TTL."""
        return self.policy.expired(self.state, tier, now)

    def describe(self) -> dict:
        """The policy's description (for stats)."""
        return self.policy.describe(self.state)
