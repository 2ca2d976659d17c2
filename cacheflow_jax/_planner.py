"""The planner: the one place that decides how blocks move between tiers.

Every path that moves blocks asks it: the threaded `TieredCache.get` / `get_many` /
`get_host_many`, replay's `access_sync`, `put`, `evict`, TTL expiry, and the prefetch scheduler's
loads. The cache carries the decisions out, with data (live) or without (replay), so the same
access stream leaves the same blocks in the same tiers either way (a test checks residency after
every access, with prefetch on and off).

The decisions:

* ``access(key, now)``: the policy sees the access. A prefetched block seen for the first time
  is *used*: it stops being an unused prefetch (``access`` says so, for the counters).
* ``victim(tier, newcomer, prefetch=..., rank=...)``: which resident leaves to make room:

  1. a stale prefetched block: a guess not used by the time it was expected to be (its rank, in
     accesses, after it landed), oldest first. A guess that has not paid off leaves before
     anything the stream asked for; a guess whose time has not come is an ordinary resident;
  2. else the policy's victim, if the policy admits the newcomer against it (`Policy.admit`);
  3. for a prefetch, only if the victim is not worth more than the guess. The policy judges the
     long run, and it chose this block as the least worth keeping; the predictor judges the next
     few accesses, and if it ranks the victim itself above the guess (it expects the victim back
     sooner), the victim stays and the guess is refused.

  It returns the victim's key, ``None`` when nothing can leave (every byte is in transit), or
  `REFUSED` when the newcomer may not displace the victim (it then goes to a lower tier or is
  not cached).
* ``destination(tier, was_unused)``: where a victim goes: L1's to L2 when there is an L2, L2's out
  of the cache; an unused prefetched block leaves the cache from any tier (demoting a wrong
  guess would only push a useful block out of L2).
* ``insert`` / ``remove``: the policy's bookkeeping, plus which blocks are unused prefetches.
* ``ranking``: the predictor's latest proposals, key -> rank (1 first), set by the scheduler.

Cost: with prefetch off, one attribute test per access on top of the policy's; on, a counter
increment and a dict lookup per tier.
"""

from __future__ import annotations

from typing import Any

from cacheflow_jax.policies import Policy, admit_all

DEVICE, HOST = 0, 1


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
      tracking: keep the prefetch bookkeeping (access count, unused prefetched blocks, the
        predictor's ranking); off, it costs nothing per access.

    Not thread-safe: the cache calls it under its lock (replay from one thread).
    """

    __slots__ = (
        "policy", "state", "admit", "has_host", "tracking", "count", "unused", "unused_blocks",
        "ranking",
        "_access", "_victim", "_insert", "_remove",
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
        # Per tier, the unused prefetched blocks: key -> the access count by which each was
        # expected to be used, oldest first.
        self.unused: list[dict[str, int]] = [{} for _ in range(num_tiers)]
        self.unused_blocks = 0  # their number, over all tiers
        self.ranking: dict[str, int] = {}  # the predictor's latest proposals: key -> rank
        self._access = policy.access
        self._victim = policy.victim
        self._insert = policy.insert
        self._remove = policy.remove

    def access(self, key: str, now: float) -> bool:
        """The policy sees an access; returns True if it is the first use of a prefetched block."""
        self._access(self.state, key, now)
        if not self.tracking:
            return False
        self.count += 1
        if self.unused_blocks:  # the usual case on a hit: no guess waits to be used
            for unused in self.unused:
                if key in unused:
                    del unused[key]
                    self.unused_blocks -= 1
                    return True
        return False

    def victim(
        self, tier: int, newcomer: str | None, *, prefetch: bool = False, rank: int = 1
    ) -> Any:
        """The resident of ``tier`` to evict for ``newcomer`` (None: an explicit put, admitted).

        For a ``prefetch``, ``rank`` is the guess's place in the predictor's proposals (1 first):
        a victim the predictor ranks above it is worth more and stays.

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
        if prefetch and self.ranking.get(victim, rank + 1) < rank:
            return REFUSED
        return victim

    def remove(self, tier: int, key: str) -> bool:
        """Forgets ``key`` in ``tier``; returns True if it was an unused prefetch (wasted)."""
        self._remove(self.state, tier, key)
        if self.unused_blocks and self.unused[tier].pop(key, None) is not None:
            self.unused_blocks -= 1
            return True
        return False

    def insert(
        self,
        tier: int,
        key: str,
        now: float,
        nbytes: int,
        *,
        prefetched: bool = False,
        rank: int = 1,
    ) -> None:
        """Records ``key`` as resident in ``tier``.

        A prefetched block starts unused, expected to be used within ``rank`` accesses (its
        place in the predictor's proposals); if it is not, it is stale.
        """
        self._insert(self.state, tier, key, now, nbytes)
        if prefetched and self.tracking:
            unused = self.unused[tier]
            if key not in unused:
                self.unused_blocks += 1
            unused[key] = self.count + rank

    def destination(self, tier: int, was_unused: bool) -> int | None:
        """Where a victim of ``tier`` goes: L2 (for L1's, when there is one) or None (out)."""
        if tier == DEVICE and self.has_host and not was_unused:
            return HOST
        return None

    def expired(self, tier: int, now: float) -> list[str]:
        """The residents of ``tier`` past the policy's TTL."""
        return self.policy.expired(self.state, tier, now)

    def describe(self) -> dict:
        """The policy's description (for stats)."""
        return self.policy.describe(self.state)
