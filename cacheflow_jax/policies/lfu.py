"""``lfu``, the default policy: decayed frequency weighed with recency, adapted online.

The idea.

* A key's *score* is a decayed count, ``s <- s * 2**(-dt / h) + 1`` per access, with a half-life
  ``h`` of 4 accesses per block the cache holds. Stored as ``log2(s) + t / h`` (t counts
  accesses), it does not change while the key is idle: keys compare without touching the clock.
* Residents are split, as in W-TinyLFU (Caffeine), into a *window* that takes every newcomer in
  LRU order and a *main* part, an SLRU of probation and protected (80% of main) blocks.
* When the window is full, its oldest block is a candidate for main. It enters main if its score
  *before its last access* is at least the score of main's weakest block (probation's oldest),
  which is then evicted; otherwise the candidate is. With a short half-life this is LIRS's test
  (was it reused sooner than main's weakest has been idle?), so a loop larger than the cache keeps
  part of itself; with a long one it is LFU's. A scan's blocks have no past and never get in.
* Evicted keys are remembered as *ghosts* (their scores, segment and eviction time) up to 8x the
  resident bytes, so a key back from a short absence is judged on its history.
* Until the first reuse (a hit, or a key back from a ghost) the share is 1 (LRU): nothing yet
  says what to protect, and a trace that turns back on a scan wants its recent blocks. At the
  first reuse the share drops to 1% (the window's overflow becomes main, in LRU order); a
  zig-zag, whose first turn the shadow at 0 misses, goes back to 1 within that turn (below).
* The window's share of the bytes moves online between 0 (frequency-protected) and 1 (plain LRU):
  - a miss on a ghost that left its segment (window or main) within the last 2% of the cache's
    bytes evicted from that segment says that segment was a step too small: the share moves one
    step (2% of the cache) toward it. These are ARC's ghost hits, counted only near the margin:
    ghosts of a loop come back from far and say nothing about one step;
  - *miniature simulations* (Waldspurger et al., ATC'17) referee it: shadow caches at fixed
    shares (0, 5%, 20%, and 1, which is LRU) run on a hashed sample of the keys with the same
    share of the bytes (every key while the cache holds <= 64 blocks, then a shadow holds 32 to
    64 blocks). When the shadow with the most hits on the sampled accesses leads by half a
    shadow's blocks the lower of our own hits and those of the shadow nearest our share (a
    miniature cache misses a little more than ours: the nearest shadow is the fair reference for
    the share, ours for what we hold), the share jumps to the leader's and the counts restart.
    A jump up is the votes' floor (a zig-zag that wants LRU is invisible to them); a jump down
    gives the window's overflow to probation. Only sampled accesses touch the shadows.
  - while the shadows see at least every other key (<= 128 blocks), they are close copies of
    the cache and a step is a block or two: the votes since the share last moved must then
    lean one way by 2 standard deviations (net^2 >= 4 votes) to move it, or single ghost
    hits walk the share off the shadows' choice and back.
* Sizes count in bytes everywhere (shares, ghosts, the shadows), so a big block takes the room
  of many small ones.
* TTL: a block idle for ``ttl`` seconds leaves whatever its score (a sweep every ``ttl / 8``).
* Two tiers are one cache. The segments, scores, ghosts and shadows span L1 and L2, and what
  leaves the cache is what one cache of the summed size would evict: each block L1 gives up on a
  miss pairs with that cache's loser, which L2 gives up, or, when it is in L1 or is the block
  moving down, L2 refuses (``admit``). L1's victim, a block moving down to L2, is its block with
  the lowest score, so L1 keeps the most used blocks. With unit sizes two tiers hold exactly what
  one tier holds; with sizes a demotion can need more room in L2 than the loser frees, and L2
  then gives up that cache's next loser.

Every constant here (0.8, a half-life of 4 caches, 8x, 2%, 1%, the shadows' shares, 32 blocks,
half a shadow, every other key, 2 deviations) was chosen on all 19 shared traces at 4 sizes
each; docs/policies.md has the sweeps and what else was tried.

Cost per access: O(1) amortised. A hit is a few dict operations and one ``log2``; a miss adds a
duel, a ghost and O(1) amortised trimming; a sampled access (all of them in a cache of <= 64
blocks, 1 in 32 at 3,000 blocks) also steps 3 shadow caches and an LRU list; the half-life is
re-expressed (O(keys)) only when the resident count has doubled or halved since the last time.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence

from cacheflow_jax.policies.base import Key, Policy, check_ttl
from cacheflow_jax.policies.minisim import MiniSims

# Each constant's sweep over the 19 shared traces is in docs/policies.md.
PROTECTED = 0.8  # protected share of main (Caffeine's)
HALF_LIFE_PER_BLOCK = 4.0  # half-life of a count, in accesses per resident block
HISTORY = 8.0  # ghosts kept, in bytes (and in keys) per resident byte (key)
STEP = 0.02  # the margin and step of the window's share, as a share of the resident bytes
START = 0.01  # the window's share at first (Caffeine's)
CANDIDATES = (0.0, 0.05, 0.2, 1.0)  # the shadows' fixed window shares (1.0 is LRU)
SAMPLE_BLOCKS = 32  # a shadow holds 32-64 blocks (every key while the cache holds <= 64)
JUMP_LEAD = 0.5  # a shadow's lead over the live cache that makes it jump, in shadow blocks
CLOSE_SAMPLE = 2  # while the shadows sample >= 1 key in 2 (<= 128 blocks), votes must agree
SIGNIFICANCE = 2.0  # ... by this many standard deviations (z) before the share moves
_MIN_GHOSTS = 64  # ghost keys kept whatever the bytes (a cache of a few huge blocks needs some)
_NEVER = -math.inf  # the score before a first access
_log2 = math.log2


@dataclasses.dataclass(slots=True, eq=False)
class LfuState:
    """The state of `lfu`: one cache's segments over all tiers, plus tier placement.

    Segments map key -> nbytes, least recent first. Scores map key -> ``log2(count) + tick *
    rate`` for residents and ghosts.
    """

    window: OrderedDict
    probation: OrderedDict
    protected: OrderedDict
    score: dict  # key -> log2(decayed count) + tick * rate
    before: dict  # window key -> its score before its last access (the duel's evidence)
    # key -> (nbytes, from_window, stamp), oldest first: what is remembered of an evicted key,
    # the segment it left (window or main) and that segment's eviction clock when it left.
    ghosts: OrderedDict
    ttl: float
    last: dict  # key -> last access time in seconds (only with a TTL)
    num_tiers: int
    window_bytes: int = 0
    probation_bytes: int = 0
    protected_bytes: int = 0
    resident: int = 0  # bytes in all segments (all tiers)
    count: int = 0  # blocks in all segments
    ghost_bytes: int = 0
    window_out: int = 0  # bytes that left the window, ever (window ghosts' clock)
    main_out: int = 0  # bytes evicted from main, ever (main ghosts' clock)
    tick: int = 0  # accesses
    rate: float = 1.0 / 64  # 1 / half-life, per access
    rated_for: int = 0  # resident blocks when the half-life was last set
    next_rate_check: int = 64
    share: float = 0.01  # the window's target share of the resident bytes
    cold: bool = False  # adaptive, and no access has hit or come back from a ghost yet
    least: float = 0.0  # the share's lower bound: where the last jump up went
    votes: int = 0  # votes since the share last moved (counted only while they need agreement)
    net_votes: int = 0  # of which up (toward the window) minus down
    adaptive: bool = True
    full: bool = False  # a victim was asked for since the last insert
    filled: bool = False  # the last tier has given up a block (two tiers: the cache is full)
    next_sweep: float = -math.inf
    timed: bool = False  # a TTL is set: accesses record their time
    current: Key | None = None  # the key of the latest access
    missing: bool = False  # the latest access missed the whole cache
    loser: Key | None = None  # the block the whole cache gives up for the current miss
    drop: Key | None = None  # that block, when it is moving down from L1: L2 refuses it
    gone: Key | None = None  # one tier: the latest block evicted, and its ``before``
    gone_before: float = _NEVER
    # Tier placement, from the first block in L2 on (None before: one tier).
    tier_of: dict | None = None  # resident key -> tier
    moving: dict | None = None  # key -> tier it left, until it is inserted again
    # The live cache's keys in transit (`Policy` docs): a moving key in it is still on its way
    # to a tier, and is not taken for gone by the next access. Empty in replay (no transfers).
    in_transit: dict | tuple = ()
    heaps: list | None = None  # per tier: (score, key) lower bounds, a lazy min-heap
    sims: MiniSims | None = None  # the shadows (adaptive only)
    pending: Key | None = None  # a sampled miss, stepped through the shadows at its insert


def lfu(
    *,
    window: float | None = None,
    half_life: float | None = None,
    ttl: float | None = 86400.0,
    name: str = "lfu",
) -> Policy:
    """Decayed frequency weighed with recency, with an adaptive window and a TTL (the default).

    Args:
      window: the window's share of the bytes. None (the default): adaptive between 0
        (frequency-protected) and 1 (plain LRU); 1 until the first reuse, then from 1%. A number
        fixes it; 1.0 is exactly LRU.
      half_life: accesses after which an idle key's count halves. None (the default): 4 per
        block the cache holds. ``math.inf``: plain counts (no decay).
      ttl: seconds without an access after which a block leaves L1/L2; None for no TTL.
      name: the name in stats.

    Returns:
      The policy.

    Raises:
      ValueError: a setting is out of range (the message names it).

    >>> p = lfu()
    >>> s = p.init(1)
    >>> p.access(s, "a", 0.0); p.insert(s, 0, "a", 0.0, 64); p.victim(s, 0)
    'a'
    """
    if window is not None and not 0.0 <= window <= 1.0:
        raise ValueError(f"window={window!r} must be a share between 0 and 1, or None to adapt")
    if half_life is not None and not half_life > 0:
        raise ValueError(f"half_life={half_life!r} must be > 0 accesses (math.inf: no decay)")
    ttl_s = check_ttl(ttl)

    def init(num_tiers: int) -> LfuState:
        return _new_state(num_tiers, window, half_life, ttl_s)

    def describe(state: LfuState) -> dict:
        return {
            "name": name,
            "window": window,
            "window_now": state.share,
            "window_least": state.least,
            "cold": state.cold,
            "sample_rate": None if state.sims is None else 1.0 / (1 << state.sims.shift),
            "half_life": None if state.rate == 0 else 1.0 / state.rate,
            "history": HISTORY,
            "ttl": None if state.ttl == math.inf else state.ttl,
        }

    return Policy(name, init, _access, _insert, _remove, _victim, _admit, _expired, describe,
                  _hits)  # fmt: skip


def lfu_plain(*, ttl: float | None = 86400.0) -> Policy:
    """``lfu`` with plain counts (no decay), for comparison: LFU's test at the window's exit."""
    return lfu(half_life=math.inf, ttl=ttl, name="lfu-plain")


# ---------------------------------------------------------------- the rest of the Policy


def _access(state: LfuState, key: Key, now: float) -> None:
    """`lfu`'s ``access``: one access of ``key`` (a hit or a miss) at ``now``."""
    if state.moving:
        _settle(state)
    tick = state.tick = state.tick + 1
    base = tick * state.rate
    score = state.score
    old = score.get(key)
    if old is None:
        score[key] = base
        old = _NEVER
        if state.sims is not None:
            state.sims.new_key(key)
    else:
        x = old - base  # log2 of the count now
        score[key] = base + (_log2(1.0 + 2.0**x) if x < 50.0 else x)
    if state.timed:
        state.last[key] = now
    nbytes = state.probation.pop(key, None)  # (segments are disjoint: any order of tests)
    if nbytes is not None:  # a probation hit: protected's oldest overflow go back
        state.protected[key] = nbytes
        state.probation_bytes -= nbytes
        protected_bytes = state.protected_bytes = state.protected_bytes + nbytes
        if protected_bytes > PROTECTED * (state.resident - state.window_bytes):
            _demote(state)
        hit = True
    elif key in state.protected:
        state.protected.move_to_end(key)
        hit = True
    elif key in state.window:
        state.window.move_to_end(key)
        state.before[key] = old
        hit = True
    else:
        hit = False
        ghost = state.ghosts.pop(key, None)
        if ghost is not None:
            state.ghost_bytes -= ghost[0]
            if state.adaptive:
                _vote(state, ghost)
            if state.cold:
                _warm(state)
        state.before[key] = old
    if hit and state.cold:
        _warm(state)
    if state.tier_of is not None:  # for victim: is this access a miss of the whole cache?
        state.current = key
        state.missing = not hit
        state.loser = state.drop = None
    sims = state.sims
    if sims is not None and (not sims.mask or key in sims.members):
        if hit:
            if nbytes is None:  # (``None`` tests, not ``or``: a block may have 0 bytes)
                nbytes = state.protected.get(key)
                if nbytes is None:
                    nbytes = state.window[key]
            jump = sims.step(key, nbytes, True, state.resident, state.count, state.share)
            if jump is not None:
                _jump(state, jump)
        else:
            state.pending = key  # its size comes with its insert
    if tick >= state.next_rate_check:
        _check_rate(state)


def _held(state: LfuState, key: Key) -> None:
    """`_access` of a key a shadow holds: in a shadow's state (one tier, a fixed share, no TTL,
    no shadows) a hit needs none of the checks `_access` makes first."""
    tick = state.tick = state.tick + 1
    base = tick * state.rate
    score = state.score
    old = score[key]
    x = old - base  # log2 of the count now
    score[key] = base + (_log2(1.0 + 2.0**x) if x < 50.0 else x)
    nbytes = state.probation.pop(key, None)
    if nbytes is not None:  # as in `_access`
        state.protected[key] = nbytes
        state.probation_bytes -= nbytes
        protected_bytes = state.protected_bytes = state.protected_bytes + nbytes
        if protected_bytes > PROTECTED * (state.resident - state.window_bytes):
            _demote(state)
    elif key in state.protected:
        state.protected.move_to_end(key)
    else:
        state.window.move_to_end(key)
        state.before[key] = old
    if tick >= state.next_rate_check:
        _check_rate(state)


def _hits(state: LfuState, keys: Sequence[Key], now: float) -> None:
    """`access` of each of ``keys`` in turn (the cache's buffered L1 hits), with the common case
    inline: a resident key's hit while nothing else is due (no move to settle, not cold).
    Anything else goes through ``access`` itself, so the result is the same to the bit.

    The counters a hit changes (the tick, the SLRU's bytes) live in locals over the loop; they
    go back to the state before anything else reads it (``access``, the shadows, the
    half-life's check) and at the end.
    """
    score, window, protected = state.score, state.window, state.protected
    probation, before, last, timed, log2 = (
        state.probation, state.before, state.last, state.timed, math.log2)
    score_get, probation_pop, demote = score.get, probation.pop, protected.popitem
    protected_to_end, window_to_end = protected.move_to_end, window.move_to_end
    placed = state.tier_of is not None
    sims = state.sims
    members = sims.members if sims is not None else ()
    everyone = sims is not None and not sims.mask  # the shadows see every key
    rate, tick, next_check = state.rate, state.tick, state.next_rate_check
    probation_bytes, protected_bytes = state.probation_bytes, state.protected_bytes
    limit = PROTECTED * (state.resident - state.window_bytes)  # no hit changes it
    busy = state.moving or state.cold
    for key in keys:
        old = score_get(key)
        if busy or old is None:
            nbytes = segment = None
        else:
            nbytes = probation_pop(key, None)
            if nbytes is not None:  # a probation hit, as in `_access`
                protected[key] = nbytes
                probation_bytes -= nbytes
                protected_bytes += nbytes
                while protected_bytes > limit and len(protected) > 1:
                    oldest, n = demote(False)
                    protected_bytes -= n
                    probation[oldest] = n
                    probation_bytes += n
                segment = protected
            elif key in protected:
                protected_to_end(key)
                segment = protected
            elif key in window:
                window_to_end(key)
                before[key] = old
                segment = window
            else:
                segment = None
        if segment is None:  # not a plain hit: `access` itself
            state.tick, state.probation_bytes = tick, probation_bytes
            state.protected_bytes = protected_bytes
            _access(state, key, now)
            tick, rate, next_check = state.tick, state.rate, state.next_rate_check
            probation_bytes, protected_bytes = state.probation_bytes, state.protected_bytes
            limit = PROTECTED * (state.resident - state.window_bytes)
            busy = state.moving or state.cold
            members = sims.members if sims is not None else ()
            everyone = sims is not None and not sims.mask
            continue
        tick += 1
        base = tick * rate
        x = old - base  # log2 of the count now
        score[key] = base + (log2(1.0 + 2.0**x) if x < 50.0 else x)
        if timed:
            last[key] = now
        if placed:
            state.current = key
            state.missing = False
            state.loser = state.drop = None
        if everyone or key in members:
            state.tick, state.probation_bytes = tick, probation_bytes
            state.protected_bytes = protected_bytes
            if nbytes is None:
                nbytes = segment[key]
            jump = sims.step(key, nbytes, True, state.resident, state.count, state.share)
            if jump is not None:
                _jump(state, jump)
                probation_bytes = state.probation_bytes
                limit = PROTECTED * (state.resident - state.window_bytes)
            members = sims.members
            everyone = not sims.mask
        if tick >= next_check:
            state.tick = tick
            _check_rate(state)
            rate, next_check = state.rate, state.next_rate_check
    state.tick, state.probation_bytes = tick, probation_bytes
    state.protected_bytes = protected_bytes


def _new_state(
    num_tiers: int, window: float | None, half_life: float | None, ttl: float
) -> LfuState:
    """`lfu`'s ``init``: an empty state for ``num_tiers`` tiers (settings already checked)."""
    state = LfuState(
        OrderedDict(), OrderedDict(), OrderedDict(), {}, {}, OrderedDict(), ttl, {}, num_tiers,
    )
    state.timed = ttl != math.inf
    state.adaptive = window is None
    if window is None:  # LRU until the first reuse (see _warm), then from START
        state.share = 1.0
        state.cold = True
        state.sims = MiniSims(
            lambda w: lfu(window=w, half_life=half_life, ttl=None), CANDIDATES,
            sample=int(SAMPLE_BLOCKS), lead=JUMP_LEAD, known=state.score, hit=_held)
    else:
        state.share = float(window)
    if half_life is not None:
        state.rate = 0.0 if half_life == math.inf else 1 / half_life
        state.next_rate_check = 1 << 62
    return state


def _insert(state: LfuState, tier: int, key: Key, now: float, nbytes: int = 1) -> None:
    if state.tier_of is None and tier > 0:
        _layer(state, key)
    if key == state.pending:
        state.pending = None
        jump = state.sims.step(
            key, nbytes, False, state.resident + nbytes, state.count + 1, state.share)
        if jump is not None:
            _jump(state, jump)
    if state.moving and key in state.moving:  # moved between tiers: not judged again
        del state.moving[key]
        _place(state, tier, key)
        if key == state.drop or state.loser is not None:
            # The tier below had room after all. Before the whole cache was ever full, one
            # cache would have evicted nothing, and the window's overflow joins probation at
            # the newcomer's insert; after, it is the room that sizes leave unused in a tier.
            state.drop = state.loser = None
            state.full = state.filled
        return
    before = state.before
    # A key that missed has its ghost taken out and its score and ``before`` set by that
    # access; one inserted without an access (a prefetch) gets them here.
    if key not in before:
        ghost = state.ghosts.pop(key, None)
        if ghost is not None:
            state.ghost_bytes -= ghost[0]
        if key not in state.score:  # a fresh count
            state.score[key] = state.tick * state.rate
            if state.sims is not None:
                state.sims.new_key(key)
            if state.timed:
                state.last[key] = now
        before[key] = _NEVER
    state.window[key] = nbytes
    state.window_bytes += nbytes
    resident = state.resident = state.resident + nbytes
    state.count += 1
    if not state.full:  # the cache had room: the window's overflow joins probation, no duel
        limit = state.share * resident
        while state.window_bytes > limit and len(state.window) > 1:
            _to_probation(state, next(iter(state.window)))
    state.full = False
    if state.tier_of is not None:
        _place(state, tier, key)
        if key == state.current:
            state.missing = False

def _remove(state: LfuState, tier: int, key: Key, moving: bool = False) -> None:
    if state.tier_of is None:
        if not tier:  # it may be moving down to L2, the first block there: see _layer
            state.gone = key
            state.gone_before = state.before.get(key, _NEVER)
        _forget(state, key)
        return
    if state.tier_of.get(key) != tier:
        return
    _unplace(state, tier, key)
    if tier == state.num_tiers - 1 and key != state.current and not moving:
        _forget(state, key)  # left the last tier, not promoted: it left the cache
    else:
        state.moving[key] = tier  # moved (demoted or promoted), or gone: see _settle

def _victim(state: LfuState, tier: int) -> Key | None:
    if state.tier_of is None:
        state.full = True
        return _loser(state)
    last = tier == state.num_tiers - 1
    if not last:
        # Each block L1 gives up on a miss pairs with the block one cache gives up (if the
        # tier below has room after all, `insert` undoes the pairing).
        if state.missing and state.loser is None and state.drop is None:
            state.full = True
            loser = _loser(state)
            if loser is not None and state.tier_of.get(loser) == tier:
                state.drop = loser  # one cache would evict it: the tier below refuses it
                return loser
            state.loser = loser
        return _coldest(state, tier)
    state.filled = state.full = True
    loser, state.loser = state.loser, None
    if loser is None and state.drop is None:  # more room than one cache frees: its next
        loser = _loser(state)
    if loser is None or state.tier_of.get(loser) != tier:
        if loser is not None and loser in state.moving and loser != state.current:
            state.drop = loser  # the block moving down is the loser: this tier refuses it
        return _next_in(state, tier)
    return loser

def _admit(state: LfuState, key: Key, victim_key: Key) -> bool:
    if key == state.drop:
        state.drop = None
        state.moving.pop(key, None)
        _forget(state, key)
        return False
    return True

def _expired(state: LfuState, tier: int, now: float) -> list[Key]:
    # A sweep every ttl/8 seconds: a block leaves between ttl and 9/8 ttl after its last
    # access, with no per-access bookkeeping beyond its time.
    if state.ttl == math.inf or now < state.next_sweep:
        return []
    if tier == state.num_tiers - 1:
        state.next_sweep = now + state.ttl / 8
    limit = now - state.ttl
    last = state.last
    if state.tier_of is None:
        if tier:
            return []
        keys = [*state.window, *state.probation, *state.protected]
    else:
        keys = [k for k, t in state.tier_of.items() if t == tier]
    return [k for k in keys if last.get(k, now) <= limit]


# ------------------------------------------------------------------------------ one cache


def _loser(state: LfuState) -> Key | None:
    """The block that one cache of all the tiers' bytes gives up now (its duel, if the window
    is full: the window's oldest against probation's oldest)."""
    window = state.window
    main = state.probation or state.protected
    if window and (not main or state.window_bytes >= state.share * state.resident):
        candidate = next(iter(window))
        if not main:
            if state.share < 1.0:  # main emptied while the share was 1: the candidate starts it
                _to_probation(state, candidate)
                return _loser(state)
            return candidate
        weakest = next(iter(main))
        if state.before.get(candidate, _NEVER) >= state.score[weakest]:
            _to_probation(state, candidate)  # the candidate proved itself
            return weakest
        return candidate
    if main:
        return next(iter(main))
    return next(iter(window)) if window else None


def _to_probation(state: LfuState, key: Key) -> None:
    """Moves ``key`` from the window to probation's recent end."""
    nbytes = state.window.pop(key)
    state.before.pop(key, None)
    state.window_bytes -= nbytes
    state.window_out += nbytes
    state.probation[key] = nbytes
    state.probation_bytes += nbytes


def _demote(state: LfuState) -> None:
    """Protected's oldest go back to probation's recent end while protected is over its share."""
    protected, probation = state.protected, state.probation
    limit = PROTECTED * (state.resident - state.window_bytes)
    while state.protected_bytes > limit and len(protected) > 1:
        old, n = protected.popitem(False)
        state.protected_bytes -= n
        probation[old] = n
        state.probation_bytes += n


def _forget(state: LfuState, key: Key) -> None:
    """``key`` left the cache: out of its segment, into the ghosts."""
    nbytes = state.window.pop(key, None)
    if nbytes is not None:
        state.window_bytes -= nbytes
        out = state.window_out = state.window_out + nbytes
        state.before.pop(key, None)
        ghost = (nbytes, True, out)
    else:
        nbytes = state.probation.pop(key, None)
        if nbytes is not None:
            state.probation_bytes -= nbytes
        else:
            nbytes = state.protected.pop(key, None)
            if nbytes is None:
                return
            state.protected_bytes -= nbytes
        out = state.main_out = state.main_out + nbytes
        ghost = (nbytes, False, out)
    resident = state.resident = state.resident - nbytes
    count = state.count = state.count - 1
    if state.tier_of is not None:
        state.tier_of.pop(key, None)
    ghosts = state.ghosts
    ghosts[key] = ghost
    ghost_bytes = state.ghost_bytes = state.ghost_bytes + nbytes
    if len(ghosts) > HISTORY * count or ghost_bytes > HISTORY * resident:
        _trim_ghosts(state)


def _trim_ghosts(state: LfuState) -> None:
    """Forgets the oldest ghosts beyond HISTORY times the residents (bytes, and keys)."""
    ghosts = state.ghosts
    max_bytes = HISTORY * state.resident
    max_keys = max(HISTORY * state.count, _MIN_GHOSTS)
    while len(ghosts) > max_keys or state.ghost_bytes > max_bytes and len(ghosts) > _MIN_GHOSTS:
        key, ghost = ghosts.popitem(last=False)
        state.ghost_bytes -= ghost[0]
        del state.score[key]
        state.before.pop(key, None)
        state.last.pop(key, None)
        if state.sims is not None:
            state.sims.members.discard(key)


def _check_rate(state: LfuState) -> None:
    """Keeps the half-life at HALF_LIFE_PER_BLOCK accesses per resident block.

    Scores are re-expressed (the counts stay) only when the resident count has doubled or
    halved since the last time: O(keys) then, O(1) amortised.
    """
    n = max(state.count, 16)
    state.next_rate_check = state.tick + n
    if state.rated_for // 2 < n < 2 * state.rated_for:
        return
    state.rated_for = n
    rate = 1.0 / (HALF_LIFE_PER_BLOCK * n)
    shift = state.tick * (rate - state.rate)
    state.rate = rate
    score = state.score
    for key in score:
        score[key] += shift
    before = state.before
    for key, value in before.items():
        if value != _NEVER:
            before[key] = value + shift
    if state.heaps is not None:
        for tier, heap in enumerate(state.heaps):
            heap[:] = [(score[k], k) for k, t in state.tier_of.items() if t == tier]
            heapq.heapify(heap)


# ------------------------------------------------------------------------------ adaptation


def _set_share(state: LfuState, share: float) -> None:
    """The window's share becomes ``share``; a window over it gives its oldest to probation."""
    state.share = share
    window = state.window
    limit = share * state.resident
    while len(window) > 1:
        oldest = next(iter(window))
        if state.window_bytes - window[oldest] < limit:
            break
        _to_probation(state, oldest)


def _warm(state: LfuState) -> None:
    """The first reuse (a hit, or a key back from a ghost): the window's share leaves 1 (LRU)
    for START, and the window's overflow becomes main, in LRU order. Before any reuse nothing says
    which blocks to protect: a trace that begins with a scan can turn back on it (a zig-zag wants
    the recent blocks, LRU's) or loop over it (after the turn, main keeps the blocks it holds)."""
    state.cold = False
    _set_share(state, START)


def _jump(state: LfuState, share: float) -> None:
    """A shadow at ``share`` hit more than we did: take its share. Up, it is the floor of the
    margin votes (they cannot see what made the jump, e.g. a zig-zag that wants LRU); down, the
    floor is gone."""
    state.least = share if share > state.share else 0.0
    state.votes = state.net_votes = 0
    _set_share(state, share)


def _vote(state: LfuState, ghost: tuple) -> None:
    """A miss on a ghost that left its segment within STEP of the bytes: one step toward it.

    While the shadows sample at least one key in CLOSE_SAMPLE, they are close copies of the
    cache at their shares and a step is a few blocks: the votes since the share last moved must
    then lean one way by SIGNIFICANCE standard deviations (net^2 >= z^2 votes) before it moves.
    """
    margin = STEP * state.resident
    _, from_window, stamp = ghost
    if from_window:
        if state.window_out - stamp > margin:
            return
        up = True
    elif state.main_out - stamp <= margin:
        up = False
    else:
        return
    if 1 << state.sims.shift <= CLOSE_SAMPLE:
        net = state.net_votes = state.net_votes + (1 if up else -1)
        votes = state.votes = state.votes + 1
        if net * net < SIGNIFICANCE * SIGNIFICANCE * votes:
            return
        up = net > 0
        state.votes = state.net_votes = 0
    if up:
        state.share = min(state.share + STEP, 1.0)
    else:
        state.share = max(state.share - STEP, state.least)


# ------------------------------------------------------------------------------ tiers


def _layer(state: LfuState, key: Key) -> None:
    """The first block in a lower tier, ``key``: from now on, track which tier holds each block.

    Until then the state was one tier's, so ``key``, moving down from L1, was taken for an
    eviction: it is put back where it was, at the old end of its segment, as if it never left
    (`_loser` gives up the oldest of the window, or of main: probation's, else protected's).
    """
    gone = state.gone == key and key in state.ghosts
    state.gone = None
    if gone:
        nbytes, from_window, _ = state.ghosts.pop(key)
        state.ghost_bytes -= nbytes
        segment = (state.window if from_window else state.probation if state.probation
                   else state.protected)
        segment[key] = nbytes
        segment.move_to_end(key, last=False)
        if from_window:
            state.window_bytes += nbytes
            state.window_out -= nbytes
            state.before[key] = state.gone_before
        else:
            state.main_out -= nbytes
            if segment is state.probation:
                state.probation_bytes += nbytes
            else:
                state.protected_bytes += nbytes
        state.resident += nbytes
        state.count += 1
        state.full = False  # one cache of both tiers' bytes had room
    state.moving = {}
    state.tier_of = dict.fromkeys([*state.window, *state.probation, *state.protected], 0)
    state.heaps = [[] for _ in range(state.num_tiers)]
    state.heaps[0] = [(state.score[k], k) for k in state.tier_of]
    heapq.heapify(state.heaps[0])
    if gone:
        del state.tier_of[key]
        state.moving[key] = 0  # `insert` places it in its new tier


def _place(state: LfuState, tier: int, key: Key) -> None:
    state.tier_of[key] = tier
    heap = state.heaps[tier]
    heapq.heappush(heap, (state.score[key], key))
    if len(heap) > 64 and len(heap) > 4 * len(state.tier_of):  # mostly stale: rebuild
        heap[:] = [(state.score[k], k) for k, t in state.tier_of.items() if t == tier]
        heapq.heapify(heap)


def _unplace(state: LfuState, tier: int, key: Key) -> None:
    del state.tier_of[key]  # its heap entry goes stale and is skipped


def _next_in(state: LfuState, tier: int) -> Key | None:
    """The block of ``tier`` that one cache would give up first (probation's, protected's, then
    the window's oldest), when the one it gives up now is elsewhere. Lower tiers hold the older
    blocks, so the scan from the old ends is short."""
    tier_of = state.tier_of
    for segment in (state.probation, state.protected, state.window):
        for key in segment:
            if tier_of.get(key) == tier:
                return key
    return None


def _coldest(state: LfuState, tier: int) -> Key | None:
    """The block ``tier`` gives up first: the one with the lowest score.

    Heap entries are lower bounds (scores only grow while a key is resident), refreshed when
    they reach the top: no heap work on a hit.
    """
    heap, tier_of, score = state.heaps[tier], state.tier_of, state.score
    while heap:
        value, key = heap[0]
        if tier_of.get(key) != tier:
            heapq.heappop(heap)
        elif score[key] != value:
            heapq.heapreplace(heap, (score[key], key))
        else:
            return key
    return None


def _settle(state: LfuState) -> None:
    """Blocks that left a tier during earlier accesses and were not put back have left, unless
    the live cache still moves them (another thread's access can come before the insert)."""
    transit = state.in_transit
    for key in list(state.moving):
        if key not in transit:
            del state.moving[key]
            _forget(state, key)
