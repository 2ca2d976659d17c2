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
     anything the stream asked for; a guess whose time has not come is an ordinary resident,
     and so is an overdue one that the predictor's latest proposals (``ranking``) name again:
     its wait restarts at its new rank (a guess ranked 3rd may be the 4th access ahead);
  2. with ``adaptive``, a foreseen block (`Foresight`): one whose latest access was a prefetch
     used, while such blocks come back uncovered no more often than the policy's victims;
  3. else the policy's victim, if the policy admits the newcomer against it (`Policy.admit`);
  4. for a prefetch, only if the victim is not worth more than the guess. The policy judges the
     long run, and it chose this block as the least worth keeping; the predictor judges the next
     few accesses, and if it ranks the victim itself above the guess (it expects the victim back
     sooner), the victim stays and the guess is refused;
  5. for a prefetch, with ``adaptive`` on, only if guesses of its rank have been worth more
     than the victims they displace (`Admission`): the share of rank-``r`` guesses used before
     they left, against the hits lost per guess (displaced victims demanded again while the
     room they left was still held by unused guesses). Both are measured online, with priors
     that admit as rule 3 alone does until the evidence says otherwise.

  It returns the victim's key, ``None`` when nothing can leave (every byte is in transit), or
  `REFUSED` when the newcomer may not displace the victim (it then goes to a lower tier or is
  not cached).
* ``destination(tier, was_unused)``: where a victim goes: L1's to L2 when there is an L2, L2's out
  of the cache; an unused prefetched block leaves the cache from any tier (demoting a wrong
  guess would only push a useful block out of L2).
* ``insert`` / ``remove``: the policy's bookkeeping, plus which blocks are unused prefetches.
* ``ranking``: the predictor's latest proposals, key -> rank (1 first), set by the scheduler.

Cost: with prefetch off, one attribute test per access on top of the policy's; on, a counter
increment and a dict lookup per tier (and one more while displaced victims are watched), plus,
with ``adaptive``, `Foresight`'s few dict operations per access and per move. The live cache's
hit path only appends the key to a buffer; the buffered hits reach the planner in batches under
the lock (`_drain`), and skip it while no guess is unused and no resident is foreseen.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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

    Two rates, measured online (the module doc, rule 5):

    * ``useful(r)``: of the guesses of rank ``r`` that landed and were resolved, the share used
      before they left (used against wasted);
    * ``victim_return()``: the hits lost per guess that landed: the policy's victims that a
      prefetch displaced and that were demanded again while the room they left was still held
      by unused guesses, per guess (most guesses displace a stale guess, which costs nothing,
      or fill free room). That is what a guess costs: a guess that is used would have come in
      on its demand miss anyway, displacing a victim then; one that is never used has kept the
      victim out for nothing for as long as it, and the guesses that displace it in turn when
      it goes stale, hold its room. So a displaced victim is watched until the guess holding
      its room (the last of that chain) is used or leaves for a demand newcomer; accessed
      before, it *returned* (a hit lost).

    A guess displaces a victim only when ``useful(r) >= victim_return()``, and the scheduler
    loads a guess only if its score reaches ``victim_return()``. While a rank is refused, one
    guess in `EXPLORE` is admitted anyway, so that its rate goes on being measured and a
    stream that changes is followed. Priors: each rank starts with `PRIOR` used guesses and none
    wasted (usefulness 1), the victims with `PRIOR` at the rate ``prior_return`` (the cache
    passes ``min_score``), so a cold cache behaves as with the fixed rule. Counts are halved
    past `HALF` events, so both rates follow a stream that changes.
    """

    PRIOR = 2.0  # pseudo-events behind the cold-start rates
    HALF = 512.0  # counts are halved past this many events: the rates follow the recent stream
    MAX_WATCHED = 4096  # displaced victims watched at once (the oldest are resolved first)
    EXPLORE = 16  # while refused, one guess in this many is admitted to keep measuring

    __slots__ = ("prior_return", "used", "tried", "returned", "landed", "holder", "held",
                 "watching", "refused")

    def __init__(self, num_tiers: int, *, prior_return: float = 0.0) -> None:
        self.prior_return = prior_return
        self.used: dict[int, float] = {}  # rank -> guesses used (decayed)
        self.tried: dict[int, float] = {}  # rank -> guesses resolved, used or wasted (decayed)
        self.returned = 0.0  # displaced victims demanded again in time (decayed)
        self.landed = 0.0  # guesses that landed (decayed with ``returned``)
        self.holder: dict[str, str] = {}  # watched victim -> the guess holding its room
        self.held: dict[str, list[str]] = {}  # guess -> the victims whose room it holds
        self.watching = 0  # len(holder): tested on each access
        self.refused = 0  # guesses this rule kept out

    def useful(self, rank: int) -> float:
        """The share of rank-``rank`` guesses used before they left (with the prior)."""
        prior = self.PRIOR
        return (self.used.get(rank, 0.0) + prior) / (self.tried.get(rank, 0.0) + prior)

    def victim_return(self) -> float:
        """Displaced victims demanded again while a guess held their room, per guess landed."""
        prior = self.PRIOR
        return min(1.0, (self.returned + prior * self.prior_return) / (self.landed + prior))

    def admits(self, rank: int) -> bool:
        """Whether a rank-``rank`` guess may displace a policy victim now."""
        if self.useful(rank) >= self.victim_return():
            return True
        self.refused += 1
        return self.refused % self.EXPLORE == 0

    def guess_resolved(self, rank: int, used: bool) -> None:
        """A guess of rank ``rank`` was used, or left unused."""
        tried = self.tried.get(rank, 0.0) + 1.0
        used_n = self.used.get(rank, 0.0) + (1.0 if used else 0.0)
        if tried > self.HALF:
            tried, used_n = tried / 2, used_n / 2
        self.tried[rank] = tried
        self.used[rank] = used_n

    def guess_landed(self) -> None:
        """A guess went into a tier."""
        self.landed += 1.0
        if self.landed > self.HALF:
            self.landed /= 2
            self.returned /= 2

    def victim_displaced(self, victim: str, guess: str) -> None:
        """The guess ``guess`` displaced the policy's victim ``victim``: watch it."""
        holder = self.holder
        if victim in holder:
            return
        if len(holder) >= self.MAX_WATCHED:
            oldest, by = next(iter(holder.items()))
            del holder[oldest]
            victims = self.held[by]
            victims.remove(oldest)
            if not victims:
                del self.held[by]
        holder[victim] = guess
        self.held.setdefault(guess, []).append(victim)
        self.watching = len(holder)

    def room_passed(self, stale: str, guess: str) -> None:
        """The stale guess ``stale`` leaves for the guess ``guess``: the room stays with guesses."""
        victims = self.held.pop(stale, None)
        if victims:
            holder = self.holder
            for victim in victims:
                holder[victim] = guess
            self.held.setdefault(guess, []).extend(victims)

    def room_freed(self, guess: str) -> None:
        """``guess`` was used, or left for a demand newcomer: its victims' watch ends."""
        victims = self.held.pop(guess, None)
        if victims:
            holder = self.holder
            for victim in victims:
                del holder[victim]
            self.watching = len(holder)

    def accessed(self, key: str) -> None:
        """``key`` is accessed: a watched victim demanded again has returned."""
        guess = self.holder.pop(key, None)
        if guess is not None:
            victims = self.held[guess]
            victims.remove(key)
            if not victims:
                del self.held[guess]
            self.watching = len(self.holder)
            self.returned += 1.0

    def describe(self) -> dict:
        """The rates, for stats: per-rank usefulness, the victims' return rate, refusals."""
        return {
            "useful": {r: round(self.useful(r), 4) for r in sorted(self.tried)},
            "victim_return": round(self.victim_return(), 4),
            "refused": self.refused,
        }


class Foresight:
    """Foreseen blocks leave first, while that costs fewer misses than the policy's victims.

    A block whose latest access was the first use of a prefetched copy was *foreseen*: the
    predictor brought it in before it was asked for, so it may well do so again, and keeping it
    would spend room on a block that need not be resident. Such a block leaves its tier before
    the policy's victim (after stale guesses), as long as that has paid: of the blocks that left
    a tier, both kinds are watched (a FIFO of the last `WATCH` of each), and each that comes back
    *uncovered* (on a demand access, not as a prefetch used) counts against its kind. Foreseen
    blocks go first while their uncovered returns per byte evicted are at most the policy
    victims' (bytes, since the room a newcomer needs is in bytes). A foreseen block accessed
    again while resident is an ordinary resident again (the stream wanted it without a guess).
    This is the idea of integrated prefetching and caching (Cao et al., SIGMETRICS'95): evicting
    what can be prefetched back in time costs nothing.

    Priors: each kind starts with `PRIOR` evictions (of its mean size) and no returns, so
    foreseen blocks go first until the evidence says otherwise; counts are halved past `HALF`
    evictions of a kind.
    """

    PRIOR = 2.0  # pseudo-evictions behind each kind's cold-start rate
    HALF = 512.0  # counts are halved past this many evictions of a kind
    WATCH = 4096  # blocks that left watched per kind (the oldest are dropped first)

    __slots__ = ("blocks", "sizes", "gone", "left", "left_bytes", "returned", "first")

    def __init__(self, num_tiers: int) -> None:
        # Per tier, the foreseen residents, oldest first.
        self.blocks: list[dict[str, None]] = [{} for _ in range(num_tiers)]
        self.sizes: dict[str, int] = {}  # resident key -> nbytes
        # Blocks that left a tier: key -> foreseen when it left (kind 1) or not (kind 0).
        self.gone: list[dict[str, None]] = [{}, {}]
        self.left = [0.0, 0.0]  # evictions per kind (decayed)
        self.left_bytes = [0.0, 0.0]  # their bytes (decayed alike)
        self.returned = [0.0, 0.0]  # uncovered returns per kind (decayed alike)
        self.first = True  # whether foreseen blocks go first now

    def rate(self, kind: int) -> float:
        """Uncovered returns per byte evicted of ``kind`` (1: foreseen, 0: the policy's victims)."""
        left, nbytes = self.left[kind], self.left_bytes[kind]
        mean = nbytes / left if left > 0 and nbytes > 0 else 1.0
        return self.returned[kind] / (nbytes + self.PRIOR * mean)

    def accessed(self, key: str, tier: int | None) -> None:
        """``key`` is accessed: as a prefetch used in ``tier`` (covered), or on demand (None)."""
        covered = tier is not None
        for kind in (0, 1):
            gone = self.gone[kind]
            if gone and gone.pop(key, 0) is None:
                if not covered:
                    self.returned[kind] += 1.0
                    self.first = self.rate(1) <= self.rate(0)
                break
        if covered:
            self.blocks[tier][key] = None
        else:
            for blocks in self.blocks:
                if blocks:
                    blocks.pop(key, None)

    def left_tier(self, tier: int, key: str) -> None:
        """``key`` left ``tier`` (evicted, or moving to another tier: `arrived` undoes that)."""
        blocks = self.blocks[tier]
        kind = 1 if blocks and blocks.pop(key, 0) is None else 0
        other = self.gone[1 - kind]
        if other:
            other.pop(key, None)
        gone = self.gone[kind]
        gone[key] = None
        if len(gone) > self.WATCH:
            del gone[next(iter(gone))]
        self.left[kind] += 1.0
        self.left_bytes[kind] += self.sizes.pop(key, 1)  # `arrived` sets it again on a move
        if self.left[kind] > self.HALF:
            self.left[kind] /= 2
            self.left_bytes[kind] /= 2
            self.returned[kind] /= 2
        self.first = self.rate(1) <= self.rate(0)

    def arrived(self, key: str, nbytes: int, *, prefetched: bool) -> None:
        """``key`` (``nbytes``) went into a tier without an access: a move between tiers undoes
        its `left_tier`; a prefetch of a block that left is a covered return (not counted)."""
        self.sizes[key] = nbytes
        for kind in (0, 1):
            gone = self.gone[kind]
            if gone and gone.pop(key, 0) is None:
                if not prefetched:
                    self.left[kind] = max(self.left[kind] - 1.0, 0.0)
                    self.left_bytes[kind] = max(self.left_bytes[kind] - nbytes, 0.0)
                return

    def describe(self) -> dict:
        """Each kind's uncovered returns per eviction, and whether foreseen blocks go first."""
        return {
            "foreseen_return": round(self.returned[1] / (self.left[1] + self.PRIOR), 4),
            "victim_return": round(self.returned[0] / (self.left[0] + self.PRIOR), 4),
            "foreseen_first": self.first,
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
        (`Admission`, rule 5 of the module doc) and let foreseen blocks leave first while that
        pays (`Foresight`, rule 2).
      prior_return: `Admission`'s cold-start victim return rate (the cache passes
        ``PrefetchSettings.min_score``, so a cold scheduler keeps today's score floor).

    Not thread-safe: the cache calls it under its lock (replay from one thread).
    """

    __slots__ = (
        "policy", "state", "admit", "has_host", "tracking", "count", "unused", "unused_blocks",
        "ranking", "admission", "foresight",
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
        self.foresight = Foresight(num_tiers) if tracking and adaptive else None
        self._access = policy.access
        self._victim = policy.victim
        self._insert = policy.insert
        self._remove = policy.remove

    def watch_transit(self, in_transit: dict) -> None:
        """Hands the live cache's keys in transit to a policy state that asks for them (one with
        an ``in_transit`` attribute, as `lfu`'s): see `Policy`."""
        if hasattr(self.state, "in_transit"):
            self.state.in_transit = in_transit

    def direct(self) -> tuple[Callable[[int], Any], Callable[[Any, str, str], bool] | None,
                              Callable[[int, str], None], Callable[[int, str, float, int], None]]:
        """``(victim, admit, remove, insert)``: the policy's own functions over its state, for a
        planner that does not track prefetches (rules 1, 2, 4 and 5 never apply then).

        ``victim(tier)`` is rule 3's candidate, which leaves only if ``admit`` (None: always)
        takes the newcomer against it: ``admit(state, newcomer, victim)``. Replay's one-tier
        loop calls these instead of `victim` / `remove` / `insert`, whose checks for prefetch
        bookkeeping it would pay on every miss (with L1's bookkeeping in locals, that loop took
        replay's from 0.64x to 0.71x the accesses per second of libCacheSim's LRU loop).

        Raises:
          RuntimeError: the planner tracks prefetches (its own rules apply: call its methods).
        """
        if self.tracking:
            raise RuntimeError("Planner.direct: this planner tracks prefetches; use its methods")
        state = self.state
        return (
            functools.partial(self._victim, state),
            self.admit,
            functools.partial(self._remove, state),
            functools.partial(self._insert, state),
        )

    def access_function(self) -> Callable[[str, float], Any]:
        """The access call to make per access: `access` when the planner tracks prefetches,
        else the policy's own ``access`` over its state (it returns None: never a prefetch's
        first use)."""
        if self.tracking:
            return self.access
        return functools.partial(self.policy.access, self.state)

    def access(self, key: str, now: float) -> bool:
        """The policy sees an access; returns True if it is the first use of a prefetched block."""
        self._access(self.state, key, now)
        if not self.tracking:
            return False
        self.count += 1
        admission = self.admission
        if admission is not None and admission.watching:
            admission.accessed(key)
        used = None  # the tier of a prefetched block used now
        if self.unused_blocks:  # the usual case on a hit: no guess waits to be used
            for tier, unused in enumerate(self.unused):
                if key in unused:
                    rank = unused.pop(key)[1]
                    self.unused_blocks -= 1
                    if admission is not None:
                        admission.guess_resolved(rank, True)
                        admission.room_freed(key)
                    used = tier
                    break
        if self.foresight is not None:
            self.foresight.accessed(key, used)
        return used is not None

    def foreseen_blocks(self) -> bool:
        """Whether any resident is a foreseen block (`Foresight`): then every hit matters."""
        foresight = self.foresight
        return foresight is not None and any(foresight.blocks)

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
        ranking = self.ranking
        while unused:
            key, (due, rank_in) = next(iter(unused.items()))
            if due >= self.count:
                break
            renewed = ranking.get(key)
            if renewed is not None:
                # Overdue, but the predictor's latest proposals name it again: it is still
                # expected (a guess ranked 3rd may be 4 accesses ahead), so its wait restarts.
                del unused[key]
                unused[key] = (self.count + renewed, rank_in)
                continue
            if admission is not None and newcomer is not None:
                if prefetch:
                    admission.room_passed(key, newcomer)
                else:
                    admission.room_freed(key)
            return key  # stale: it was not used when it was expected to be
        foresight = self.foresight
        if foresight is not None and foresight.first:
            foreseen = foresight.blocks[tier]
            if foreseen:
                return next(iter(foreseen))  # the predictor brought it in; it can again
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
            if admission is not None and newcomer is not None:
                if not admission.admits(rank):
                    return REFUSED
                admission.victim_displaced(victim, newcomer)
        return victim

    def remove(self, tier: int, key: str, *, moving: bool = False) -> bool:
        """Forgets ``key`` in ``tier``; returns True if it was an unused prefetch (wasted).

        ``moving``: it goes to another tier without an access (a prefetch promotion); the
        policy keeps it (`Policy.remove`).
        """
        if moving:
            self._remove(self.state, tier, key, True)
        else:
            self._remove(self.state, tier, key)
        if self.foresight is not None:
            self.foresight.left_tier(tier, key)
        if self.unused_blocks:
            guess = self.unused[tier].pop(key, None)
            if guess is not None:
                self.unused_blocks -= 1
                if self.admission is not None:
                    self.admission.guess_resolved(guess[1], False)
                    self.admission.room_freed(key)
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
        if self.foresight is not None:
            self.foresight.arrived(key, nbytes, prefetched=prefetched)
        if prefetched and self.tracking:
            unused = self.unused[tier]
            if key not in unused:
                self.unused_blocks += 1
            unused[key] = (self.count + rank, rank)
            if self.admission is not None:
                self.admission.guess_landed()
        elif self.admission is not None and key in self.admission.held:
            # A newcomer admitted as a prefetch that goes in as an ordinary resident (the live
            # worker's promotion from L2, or a prefetch a demand access took over): it landed,
            # and the room it took is no guess's any more.
            self.admission.guess_landed()
            self.admission.room_freed(key)

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
