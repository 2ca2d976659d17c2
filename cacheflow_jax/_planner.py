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
increment and a dict lookup per tier (and one more while displaced victims are watched). A hit
on a block that is no unused guess never reaches the planner in the live cache (`_drain`), so
none of this is on the hit path.
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


class Admission:
    """Adaptive prefetch admission: is a guess of rank ``r`` worth the victim it displaces?

    Two rates, measured online (the module doc, rule 4):

    * ``useful(r)``: of the guesses of rank ``r`` that landed and were resolved, the share used
      before they left (used against wasted);
    * ``victim_return()``: of the policy's victims that a prefetch displaced, the share demanded
      again before they would have left anyway. A victim is the policy's next to go: without
      the prefetch it would have left at its tier's next demand eviction. So a displaced victim
      is watched until then; accessed before, it *returned* (the prefetch cost a hit), else not.

    A guess displaces a victim only when ``useful(r) >= victim_return()``. Priors: each rank
    starts with `PRIOR` used guesses and none wasted (usefulness 1), the victims with `PRIOR`
    that did not return (rate 0), so a cold cache admits as it would without this rule. Counts
    are halved past `HALF` events, so both rates follow a stream that changes. No constant is
    fitted to a trace: the window is the tier's own eviction clock.
    """

    PRIOR = 2.0  # pseudo-events behind the cold-start rates
    HALF = 512.0  # counts are halved past this many events: the rates follow the recent stream
    MAX_WATCHED = 4096  # displaced victims watched at once (the oldest are resolved first)

    __slots__ = ("prior_return", "used", "tried", "returned", "resolved", "displaced", "watching", "refused")

    def __init__(self, num_tiers: int, *, prior_return: float = 0.0) -> None:
        self.prior_return = prior_return
        self.used: dict[int, float] = {}  # rank -> guesses used (decayed)
        self.tried: dict[int, float] = {}  # rank -> guesses resolved, used or wasted (decayed)
        self.returned = 0.0  # displaced victims demanded again in time (decayed)
        self.resolved = 0.0  # displaced victims resolved (decayed)
        # Per tier, the watched victims (key -> None), oldest first; ``watching``: their number.
        self.displaced: list[dict[str, None]] = [{} for _ in range(num_tiers)]
        self.watching = 0
        self.refused = 0  # guesses this rule kept out

    def useful(self, rank: int) -> float:
        """The share of rank-``rank`` guesses used before they left (with the prior)."""
        prior = self.PRIOR
        return (self.used.get(rank, 0.0) + prior) / (self.tried.get(rank, 0.0) + prior)

    def victim_return(self) -> float:
        """The share of displaced victims demanded again before they would have left."""
        prior = self.PRIOR
        return (self.returned + prior * self.prior_return) / (self.resolved + prior)

    def admits(self, rank: int) -> bool:
        """Whether a rank-``rank`` guess may displace a policy victim now."""
        if self.useful(rank) >= self.victim_return():
            return True
        self.refused += 1
        return False

    def guess_resolved(self, rank: int, used: bool) -> None:
        """A guess of rank ``rank`` was used, or left unused."""
        tried = self.tried.get(rank, 0.0) + 1.0
        used_n = self.used.get(rank, 0.0) + (1.0 if used else 0.0)
        if tried > self.HALF:
            tried, used_n = tried / 2, used_n / 2
        self.tried[rank] = tried
        self.used[rank] = used_n

    def victim_displaced(self, key: str, tier: int) -> None:
        """A prefetch displaced the policy's victim ``key`` from ``tier``: watch it."""
        displaced = self.displaced[tier]
        if len(displaced) >= self.MAX_WATCHED:
            del displaced[next(iter(displaced))]
            self.watching -= 1
            self._resolve(False)
        if key not in displaced:
            self.watching += 1
        displaced[key] = None

    def demand_evicted(self, tier: int) -> None:
        """A demand newcomer evicts from ``tier``: its watched victims would have left now."""
        displaced = self.displaced[tier]
        if displaced:
            for _ in range(len(displaced)):
                self._resolve(False)
            self.watching -= len(displaced)
            displaced.clear()

    def accessed(self, key: str) -> None:
        """``key`` is accessed: a watched victim demanded again has returned."""
        for displaced in self.displaced:
            if key in displaced:
                del displaced[key]
                self.watching -= 1
                self._resolve(True)

    def _resolve(self, returned: bool) -> None:
        self.resolved += 1.0
        self.returned += 1.0 if returned else 0.0
        if self.resolved > self.HALF:
            self.resolved /= 2
            self.returned /= 2

    def describe(self) -> dict:
        """The rates, for stats: per-rank usefulness, the victims' return rate, refusals."""
        return {
            "useful": {r: round(self.useful(r), 4) for r in sorted(self.tried)},
            "victim_return": round(self.victim_return(), 4),
            "refused": self.refused,
        }


class Planner:
    """Decides victims, admission and destinations over one policy's state (see the module doc).

    Args:
      policy: the eviction policy.
      num_tiers: the number of tiers (L1, L2).
      has_host: whether L2 holds blocks (budget > 0); L1's victims go there if so.
      tracking: keep the prefetch bookkeeping (access count, unused prefetched blocks, the
        predictor's ranking); off, it costs nothing per access.
      adaptive: with ``tracking``, judge guesses against their victims by measured rates
        (`Admission`, rule 4 of the module doc).
      prior_return: `Admission`'s cold-start victim return rate (the cache passes
        ``PrefetchSettings.min_score``, so a cold scheduler keeps today's score floor).

    Not thread-safe: the cache calls it under its lock (replay from one thread).
    """

    __slots__ = (
        "policy", "state", "admit", "has_host", "tracking", "count", "unused", "unused_blocks",
        "ranking", "admission",
        "_access", "_victim", "_insert", "_remove",
    )  # fmt: skip

    def __init__(
        self,
        policy: Policy,
        num_tiers: int,
        *,
        has_host: bool,
        tracking: bool = False,
        adaptive: bool = False,
        prior_return: float = 0.0,
    ) -> None:
        self.policy = policy
        self.state = policy.init(num_tiers)
        self.admit = None if policy.admit is admit_all else policy.admit
        self.has_host = has_host
        self.tracking = tracking
        self.count = 0  # accesses seen (prefetch bookkeeping only)
        # Per tier, the unused prefetched blocks: key -> (the access count by which each was
        # expected to be used, its rank), oldest first.
        self.unused: list[dict[str, tuple[int, int]]] = [{} for _ in range(num_tiers)]
        self.unused_blocks = 0  # their number, over all tiers
        self.ranking: dict[str, int] = {}  # the predictor's latest proposals: key -> rank
        self.admission = (
            Admission(num_tiers, prior_return=prior_return) if tracking and adaptive else None
        )
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
        admission = self.admission
        if admission is not None and admission.watching:
            admission.accessed(key)
        if self.unused_blocks:  # the usual case on a hit: no guess waits to be used
            for unused in self.unused:
                if key in unused:
                    rank = unused.pop(key)[1]
                    self.unused_blocks -= 1
                    if admission is not None:
                        admission.guess_resolved(rank, True)
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
        admission = self.admission
        if unused:
            key, (due, _) = next(iter(unused.items()))
            if due < self.count:
                if admission is not None and not prefetch and newcomer is not None:
                    admission.demand_evicted(tier)
                return key  # stale: it was not used when it was expected to be
        victim = self._victim(self.state, tier)
        if victim is None:
            return None
        if newcomer is not None and self.admit is not None and not self.admit(
            self.state, newcomer, victim
        ):
            return REFUSED
        if prefetch:
            if self.ranking.get(victim, rank + 1) < rank:
                return REFUSED
            if admission is not None:
                if not admission.admits(rank):
                    return REFUSED
                admission.victim_displaced(victim, tier)
        elif admission is not None and newcomer is not None:
            admission.demand_evicted(tier)
        return victim

    def remove(self, tier: int, key: str) -> bool:
        """Forgets ``key`` in ``tier``; returns True if it was an unused prefetch (wasted)."""
        self._remove(self.state, tier, key)
        if self.unused_blocks:
            guess = self.unused[tier].pop(key, None)
            if guess is not None:
                self.unused_blocks -= 1
                if self.admission is not None:
                    self.admission.guess_resolved(guess[1], False)
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
            unused[key] = (self.count + rank, rank)

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
