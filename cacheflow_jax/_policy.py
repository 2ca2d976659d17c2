"""Eviction and admission policies: pure functions over an explicit state, optax-style.

A policy never stores blocks; the cache asks it which resident key to evict from a tier, whether a
newcomer may displace that victim, and which keys have outlived their TTL. Each policy is a
`Policy` of functions; its state is created by ``init(num_tiers)`` and passed back on every call.
The state is a NamedTuple of containers that the functions update in place: a copy-on-write
state would allocate on every cache hit, which the hot path must not do. The same functions run
in replay and in the live cache (and, once the Pallas kernels land, on the device for counters).

Policies:

* ``lru()``: least recently used. O(1) per access and eviction.
* ``lfu(half_life=None, count_cap=2, window=0.01, ttl=86400, ghost_entries=65536, history=1)``,
  the default: a decayed frequency count over an adaptive LIRS-style window. Described below.
* ``lfu_plain(ttl=...)``: ``lfu`` with no decay and no cap (LFU order in the protected segment).

The ``lfu`` policy
------------------

*Score.* Every access updates a decayed count ``s <- min(s * 2**(-dt / half_life) + 1, count_cap)``
(``dt`` in accesses, a logical clock). A short half-life orders like LRU, a long one like LFU; the
cap keeps an idle key's past popularity from protecting it for more than ``log2(count_cap)``
half-lives (2 by default: one half-life; with 4, a pure-recency pattern missed .04-.06 more than
LRU at 1-5% and a moving hot set kept stale keys longer, see `bench.synthetic`). Because every score decays by the same factor, ``s_a(now) < s_b(now)`` iff
``log2(s_a) + t_a / h < log2(s_b) + t_b / h`` where ``t`` is the key's last update: that *priority*
does not change while a key is idle, so a lazy min-heap (entries are lower bounds, refreshed when
they reach the top) keeps exact order with no heap work on a hit.

*Segments.* Each tier is split into a *window* (a share of its resident bytes, 1% at first, LRU
order) and a *protected* segment ordered by priority. Shares are in bytes, not entries: with
mixed sizes, a big newcomer must make room in the window, not take one window entry and the rest
from the protected segment. A newcomer enters the protected segment only if its
priority *before this access* is at least the protected segment's lowest current priority (with
a short half-life: if it came back sooner than the weakest protected key has been idle: LIRS's
inter-reference-recency test), or while the protected segment is not full; otherwise it enters
the window. A window hit promotes the key by the same test. When the protected segment outgrows
its share, its lowest key goes back to the window for a second chance. Victims come from the
window's LRU end while the window is over its share, else from the protected segment's lowest
priority. So a scan or a burst of one-hit blocks only churns the window, and a loop larger than
the cache keeps part of itself protected instead of thrashing. ``admit`` always says yes: the
window, not the admission test, filters newcomers.

*Ghost history.* The scores of keys that left the cache are remembered (FIFO) up to ``history``
times the resident bytes (at least 64 keys, at most ``ghost_entries``), so a key evicted and seen
again soon is judged on its history, not as new; one gone longer is new again. This bound is
LIRS's (its stack holds at most twice the cache, residents included). An unbounded history did
much worse on cloudPhysicsIO (20%: .697 against .631): old keys coming back were promoted and
pushed out protected keys that were about to be reused; Mooncake would rather keep more (see the
benchmark notes).

*Adaptive window.* The window's share follows ARC's rule for its recency list: a missed key that
left from the window recently says the window was too small, and the share grows by one resident
entry's worth; one demoted from the protected segment that left within the protected segment's
bytes says the opposite. "Recently" for a window ghost is within 8x the window's bytes and
within the protected segment's bytes of evictions (ARC's B1 list holds at most the cache less
its T1; without that bound the window grew to 0.9 on Mooncake at 1% and the policy fell to LRU's
miss ratio), and such a key enters the protected segment, as ARC moves a B1 hit to T2 (only in
a tier with the adapted share: with blocks in L2, L1 judges a newcomer by its priority alone;
protecting window ghosts in L1 cost the demo's log 2 points of L1 hits). The share stays between ``window`` and 0.9. A step is one resident entry's worth times ARC's ratio: on a
window ghost's return, max(1, protected ghosts' bytes / window ghosts' bytes), and the inverse
on a protected ghost's, so that the more numerous kind of ghost does not move the share by
numbers alone (with plain steps the window grew to 0.9 on a Zipf pattern, where most evictions
and so most ghosts come from the window, and the policy fell to LRU's miss ratio, .11 above
S3-FIFO's at 1%). Each ghost keeps its eviction age (bytes removed since) for this test. The share is of the whole cache's bytes, as in one tier of the
summed size. A tier above the last one that holds blocks keeps the least share of its own bytes,
so L1 stays frequency-protected (on the demo's log, L1 1/6 and L2 1/3 of the weights, L1 served
37% of accesses when it had L2's adapted share, 51% with the least); the last tier (the one
whose evictions leave the cache) holds the rest of the window's bytes.

*Two tiers.* A block demoted from L1 to L2 keeps its segment (a window block enters L2's window,
a protected one L2's protected segment): a demotion is not an access, so it is not judged
again. With L2 = 4x L1 this keeps L1 + L2 within 0.018 of one tier of the summed size on the
shared traces (0.026 when L2 had the adapted share of its own bytes, not of the whole cache's);
judging demoted blocks again let L1's window victims crowd L2's protected
segment (0.12 worse on cloudPhysicsIO).

*Half-life.* By default (``half_life=None``) it adapts online, as below. On the shared traces a
fixed 4096 accesses did about as well (with count cap 4: mean miss ratio over the policy
benchmark's 8 points .76045 against .76079), but a constant tuned on two traces is a guess
elsewhere, so the default adapts and a number fixes it.
SHARDS-style sampled shadow caches at half-lives x4 apart were also tried: over a whole trace
their ranking matched fixed-half-life runs, but within a period it was too noisy and came too late
on ~100k-access traces, and they cost up to a third of the replay speed.

*Adaptive half-life.* With ``half_life=None`` the half-life is tuned online by hill climbing
on the L1 hit ratio (as Caffeine tunes its window): every ``max(16384, 32 * residents)`` accesses
``log2(half_life)`` moves one step (x2 or /2, within 2**8 .. 2**20); the direction is kept while the
hit ratio improves and reversed when it drops. A change re-expresses every priority under the
new half-life (the decayed counts are unchanged), an O(keys + residents log residents) rebuild
per period, O(1) amortised per access.

*TTL.* A sweep over the residents every ``ttl / 8`` seconds returns those idle for ``ttl``.

*Cost per access.* A hit in the protected segment: two dict writes, one ``log2`` and two dict
lookups (no heap work). A window hit: an ``OrderedDict.move_to_end``, or O(log n) for a
promotion. A miss: O(log n) amortised (heap push, lazy refresh), plus O(1) for the window rule
and for dropping the oldest ghost. Memory: a priority and a last-access time per key (residents
and ghosts), an eviction age per ghost, a segment dict entry (holding the size) and a heap tuple
per resident.
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
      insert: ``insert(state, tier, key, now, nbytes=1)``; ``key`` (of ``nbytes`` bytes) became
        resident in ``tier``.
      remove: ``remove(state, tier, key)``; ``key`` left ``tier`` (evicted, promoted or deleted).
      victim: ``victim(state, tier) -> key | None``; the resident to evict next (not removed).
      admit: ``admit(state, key, victim) -> bool``; may ``key`` displace ``victim``?
      expired: ``expired(state, tier, now) -> list[key]``; residents older than the TTL.
      describe: ``describe(state) -> dict``; settings and adaptive values, for stats.
    """

    name: str
    init: Callable[[int], Any]
    access: Callable[[Any, Key, float], None]
    insert: Callable[..., None]
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


def admit_all(state: Any, key: Key, victim_key: Key) -> bool:
    """The ``admit`` of policies that take every newcomer (``lru``, ``lfu``).

    The cache sees this function and skips the call on its eviction path.
    """
    return True


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

    def insert(state: LruState, tier: int, key: Key, now: float, nbytes: int = 1) -> None:
        state.order[tier][key] = now

    def remove(state: LruState, tier: int, key: Key) -> None:
        state.order[tier].pop(key, None)

    def victim(state: LruState, tier: int) -> Key | None:
        order = state.order[tier]
        return next(iter(order)) if order else None

    def expired(state: LruState, tier: int, now: float) -> list[Key]:
        return _expired(state.order[tier], now, state.ttl)

    def describe(state: LruState) -> dict:
        return {"name": "lru", "ttl": None if state.ttl == math.inf else state.ttl}

    return Policy("lru", init, access, insert, remove, victim, admit_all, expired, describe)


# --------------------------------------------------------------------------------------------- LFU

# Indices into ``LfuState.params`` (a list, so that the hot path updates floats in place).
_INV, _TICK, _GHOSTS, _SWEEP, _LOGCAP, _WINDOW = 0, 1, 2, 3, 4, 5
_MISSES, _PERIOD_END, _PREV_HIT, _DIR, _LOGH, _ADAPT, _START, _FULL = 6, 7, 8, 9, 10, 11, 12, 13
_MAX_PENDING = 4096  # misses between an access and its insert (get_many batches) kept at most
_LOWP = 14  # main's lowest priority when last looked up (a cheap threshold for window hits)
_HISTORY = 15  # ghost bytes kept per resident byte (all tiers); math.inf: only ghost_entries
_GBYTES, _EVICTED, _MIN_WINDOW = 16, 17, 18  # ghosts' bytes; bytes ever removed; window floor
_RESIDENT = 19  # resident bytes, all tiers
_GWINDOW = 20  # bytes of the ghosts that left from the window (ARC's B1); the rest: B2
_MIN_GHOSTS = 64  # ghosts kept whatever their bytes (a tier of a few huge blocks needs some)
_MAX_WINDOW = 0.9  # the adaptive window share stays within window .. 0.9
_NEG = -math.inf
_MIN_LOG_H, _MAX_LOG_H = 8.0, 20.0  # the adaptive half-life stays within 256 .. 1M accesses


class LfuState(NamedTuple):
    # Sizes are stored as ``nbytes``, or ``-nbytes - 1`` for a key that was in the protected segment
    # (demoted to the window, or a ghost that left from there): one int says size and origin.
    window: list  # per tier: OrderedDict[key, size], newcomers in LRU order (oldest first)
    main: list  # per tier: dict[key, nbytes], the protected keys, ordered by priority
    heaps: list  # per tier: list[(priority, key)], lazy min-heap of lower bounds over ``main``
    prio: dict  # key -> priority log2(min(s, cap)) + tick/half_life, for residents and ghosts
    last: dict  # key -> last access time in seconds (TTL), same keys as ``prio``
    ghosts: OrderedDict  # key -> size (0: accessed, never resident) of non-residents, oldest first
    params: list  # see the _INV.. indices above
    ttl: float
    pending: dict  # key -> its priority before the access that missed, until it is inserted
    nbytes: list  # per tier: [window bytes, main bytes]
    stamps: dict  # ghost key -> params[_EVICTED] when it left the cache (its eviction age)


def lfu(
    *,
    half_life: float | None = None,
    count_cap: float = 2.0,
    window: float = 0.01,
    ttl: float | None = 86400.0,
    ghost_entries: int = 65536,
    history: float = 1.0,
) -> Policy:
    """Decayed LFU over a LIRS-style window, with ghost history and a TTL (the default policy).

    Args:
      half_life: accesses after which an idle key's count halves. ``None`` (the default) adapts it
        online by hill climbing on the hit ratio, between 256 and 2**20 accesses; a number fixes
        it (4096 did well on the shared traces). ``math.inf`` gives plain LFU order in the main
        segment.
      count_cap: the decayed count saturates at this value (2 by default), so that a key's past
        popularity cannot protect it for longer than ``log2(count_cap)`` half-lives once it goes
        idle.
        ``math.inf`` for no cap.
      window: the least share of a tier's resident bytes kept for newcomers (a LRU queue, 1% by
        default); the share adapts between this and 0.9. ``1.0`` makes the whole tier one LRU
        queue: exact LRU.
      ttl: seconds without an access after which a block leaves L1/L2; ``None`` for no TTL.
      ghost_entries: how many non-resident keys' scores are remembered at most.
      history: the bytes of non-resident keys remembered, per resident byte (at least 64 keys).
        ``math.inf``: only ``ghost_entries`` bounds it.

    Returns:
      The policy.

    >>> p = lfu(half_life=100.0)
    >>> s = p.init(1)
    >>> p.access(s, "a", 0.0); p.insert(s, 0, "a", 0.0); p.victim(s, 0)
    'a'
    """
    adaptive = half_life is None
    if adaptive:
        half_life = 2.0**12
    if not half_life > 0:
        raise ValueError(f"half_life={half_life!r} must be > 0 accesses (math.inf for plain LFU)")
    if not count_cap >= 1:
        raise ValueError(f"count_cap={count_cap!r} must be >= 1 (math.inf for no cap)")
    if not 0 <= window <= 1:
        raise ValueError(f"window={window!r} must be a share between 0 and 1")
    if ghost_entries < 0:
        raise ValueError(f"ghost_entries={ghost_entries!r} must be >= 0")
    if not history > 0:
        raise ValueError(f"history={history!r} must be > 0 (math.inf: only ghost_entries)")
    ttl_s = _check_ttl(ttl)
    name = "lfu-plain" if half_life == math.inf and count_cap == math.inf else "lfu"
    log2 = math.log2
    heappush, heappop, heapreplace = heapq.heappush, heapq.heappop, heapq.heapreplace
    all_window = window >= 1.0

    def init(num_tiers: int) -> LfuState:
        return LfuState(
            [OrderedDict() for _ in range(num_tiers)],
            [{} for _ in range(num_tiers)],
            [[] for _ in range(num_tiers)],
            {},
            {},
            OrderedDict(),
            [
                1.0 / half_life, 0.0, int(ghost_entries), _NEG, log2(count_cap),
                float(window), 0.0, 8192.0, -1.0, 1.0, log2(half_life), adaptive, 0.0,
                [False] * num_tiers, _NEG, float(history), 0, 0, float(window), 0, 0,
            ],
            ttl_s,
            {},
            [[0, 0] for _ in range(num_tiers)],
            {},
        )

    def _top(state: LfuState, tier: int) -> tuple:
        """(priority, key) of the lowest-priority key of ``main[tier]``, or (-inf, None)."""
        heap, main, prio = state.heaps[tier], state.main[tier], state.prio
        while heap:
            p, key = heap[0]
            if key not in main:
                heappop(heap)
                continue
            current = prio[key]
            if current == p:
                state.params[_LOWP] = p
                return p, key
            heapreplace(heap, (current, key))  # priorities only grow: a lower bound
        return _NEG, None

    def _demote_overflow(state: LfuState, tier: int) -> None:
        # Keep main within its share of the tier's bytes: its lowest keys go back to the window
        # (a second chance).
        main, win, used = state.main[tier], state.window[tier], state.nbytes[tier]
        share = 1.0 - _share(state, tier)
        while len(main) > 1 and used[1] > share * (used[0] + used[1]):
            _, low = _top(state, tier)
            heappop(state.heaps[tier])
            n = main.pop(low)
            win[low] = -n - 1  # negative: demoted from main (see remove)
            used[0] += n
            used[1] -= n

    def access(state: LfuState, key: Key, now: float) -> None:
        # The hot path (every hit, in batches): literal indices into ``params`` (see _INV..),
        # and the rare window hit handled out of line.
        params = state.params
        tick = params[1] = params[1] + 1.0  # _TICK
        base = tick * params[0]  # _INV
        prio = state.prio
        old = prio.get(key)
        if old is None:
            prio[key] = base  # log2(1) + base
            ghosts = state.ghosts
            ghosts[key] = 0
            if len(ghosts) > params[2]:  # _GHOSTS
                _trim_ghosts(state)
        else:
            x = old - base  # log2 of the decayed count
            if x <= 60.0:
                x = log2(1.0 + 2.0**x)
            cap = params[4]  # _LOGCAP
            prio[key] = base + (x if x < cap else cap)
        state.last[key] = now
        if key in state.window[0]:
            _window_hit(state, 0, key, old)
        elif key not in state.main[0]:
            # Not in L1, so the cache will insert it there (a key in L2 moves up): ``insert``
            # judges it on its priority *before* this access. The cache may access several keys
            # before inserting them (get_many), so this is kept per key.
            if old is not None and not all_window and state.ghosts.get(key):
                _adapt_window(state, key)
            pending = state.pending
            if len(pending) >= _MAX_PENDING:
                pending.clear()  # keys accessed but never inserted (bypassed)
            pending[key] = _NEG if old is None else old
        if params[11] and tick >= params[7]:  # _ADAPT, _PERIOD_END
            _adapt(state)

    def _window_hit(state: LfuState, tier: int, key: Key, old: float) -> None:
        # Promote if main is below its share or the key's previous priority beats main's lowest.
        win, main, params = state.window[tier], state.main[tier], state.params
        used = state.nbytes[tier]
        # No heap work on a hit: the test uses main's lowest priority as of the last eviction or
        # insert, and main's overflow goes back to the window at the next insert.
        if not all_window and (
            old >= params[_LOWP] or used[1] < (1.0 - _share(state, tier)) * (used[0] + used[1])
        ):
            n = win.pop(key)
            if n < 0:
                n = -n - 1
            main[key] = n
            used[0] -= n
            used[1] += n
            heappush(state.heaps[tier], (state.prio[key], key))
        else:
            win.move_to_end(key)

    def insert(state: LfuState, tier: int, key: Key, now: float, nbytes: int = 1) -> None:
        prio, params = state.prio, state.params
        p = prio.get(key)
        pre = state.pending.pop(key, None)
        if pre is not None and tier == 0:
            params[_MISSES] += 1.0  # an L1 insert right after its access: a miss
        if p is None:  # inserted without an access (e.g. a prefetch): a fresh count
            p = prio[key] = params[_TICK] * params[_INV]
            state.last[key] = now
            pre = _NEG
        else:
            g = state.ghosts.pop(key, 0)
            params[_GBYTES] -= g if g >= 0 else -g - 1
            if g > 0:
                params[_GWINDOW] -= g
            stamp = state.stamps.pop(key, None)
            if pre is None:  # moved between tiers without an access (a demotion): it keeps its
                pre = math.inf if g < 0 else _NEG  # segment, protected (g < 0) or window
            elif (
                g > 0
                and stamp is not None
                and (tier + 1 == len(state.nbytes) or not any(state.nbytes[tier + 1]))
                and _recent(state, params[_EVICTED] - stamp, g)
            ):
                # A window ghost back soon, into the tier with the adapted share: protect it,
                # as ARC moves a B1 hit to T2.
                pre = math.inf
        main, used = state.main[tier], state.nbytes[tier]
        params[_RESIDENT] += nbytes
        if all_window:
            state.window[tier][key] = nbytes
            used[0] += nbytes
            return
        win = state.window[tier]
        full = params[_FULL][tier]  # did the cache ask for a victim to make room for this key?
        params[_FULL][tier] = False
        if (
            not main
            or pre != _NEG
            and pre >= _top(state, tier)[0]  # it was back sooner than main's weakest: protect it
            or not full
            and used[1] + nbytes <= (1.0 - _share(state, tier)) * (used[0] + used[1] + nbytes)
        ):
            main[key] = nbytes
            used[1] += nbytes
            heap = state.heaps[tier]
            heappush(heap, (p, key))
            _demote_overflow(state, tier)
            if len(heap) > 64 and len(heap) > 4 * len(main):
                heap[:] = [(prio[k], k) for k in main]
                heapq.heapify(heap)
        else:
            win[key] = nbytes
            used[0] += nbytes

    def remove(state: LfuState, tier: int, key: Key) -> None:
        win, used = state.window[tier], state.nbytes[tier]
        g = win.pop(key, None)
        if g is not None:
            n = g if g >= 0 else -g - 1
            used[0] -= n
        else:
            n = state.main[tier].pop(key, None)
            if n is None:
                return
            used[1] -= n
            g = -n - 1
        params = state.params
        resident = params[_RESIDENT] = params[_RESIDENT] - n
        ghosts = state.ghosts
        ghosts[key] = g
        if g > 0:
            params[_GWINDOW] += g
        gbytes = params[_GBYTES] = params[_GBYTES] + n
        evicted = params[_EVICTED] = params[_EVICTED] + n
        stamps = state.stamps
        stamps[key] = evicted
        # `_trim_ghosts`, inlined: once the history is full every eviction drops a ghost.
        blimit = params[_HISTORY] * resident
        limit = params[_GHOSTS]
        if gbytes > blimit or len(ghosts) > limit:
            prio, last = state.prio, state.last
            while len(ghosts) > limit or gbytes > blimit and len(ghosts) > _MIN_GHOSTS:
                old, g = ghosts.popitem(False)
                if g > 0:
                    gbytes -= g
                    params[_GWINDOW] -= g
                else:
                    gbytes -= -g - 1 if g else 0
                stamps.pop(old, None)
                del prio[old]
                last.pop(old, None)
            params[_GBYTES] = gbytes

    def victim(state: LfuState, tier: int) -> Key | None:
        win, main = state.window[tier], state.main[tier]
        params = state.params
        params[_FULL][tier] = True
        if win:
            if not main:
                return next(iter(win))
            nbytes = state.nbytes
            used = nbytes[tier]
            share = params[_WINDOW]  # `_share`, inlined for one tier: victim runs on every eviction
            if tier + 1 < len(nbytes) and (nbytes[tier + 1][0] or nbytes[tier + 1][1]):
                share = params[_MIN_WINDOW]
            elif tier:
                share = _share(state, tier)
            if used[0] > share * (used[0] + used[1]):
                return next(iter(win))
        return _top(state, tier)[1]

    def expired(state: LfuState, tier: int, now: float) -> list[Key]:
        # A sweep over the residents every ttl/8 seconds: O(1) amortised per access, and no
        # per-access bookkeeping. A block leaves between ttl and 9/8 ttl after its last access.
        ttl = state.ttl
        params = state.params
        if ttl == math.inf or now < params[_SWEEP]:
            return []
        if tier == len(state.main) - 1:
            params[_SWEEP] = now + ttl / 8
        limit = now - ttl
        last = state.last
        out = [k for k in state.window[tier] if last[k] <= limit]
        out += [k for k in state.main[tier] if last[k] <= limit]
        return out

    def describe(state: LfuState) -> dict:
        params = state.params
        inv = params[_INV]
        return {
            "name": name,
            "half_life": None if inv == 0 else 1.0 / inv,
            "adaptive": bool(params[_ADAPT]),
            "count_cap": 2.0 ** params[_LOGCAP],
            "window": params[_MIN_WINDOW],
            "window_now": params[_WINDOW],
            "history": params[_HISTORY],
            "ttl": None if state.ttl == math.inf else state.ttl,
            "ghost_entries": params[_GHOSTS],
        }

    # Newcomers enter the window; the window, not admission, filters them.
    return Policy(name, init, access, insert, remove, victim, admit_all, expired, describe)


def _share(state: LfuState, tier: int) -> float:
    """The window share of ``tier``'s bytes.

    Tiers above the last one that holds blocks keep the least share. The adaptive share is of the
    whole cache's bytes, as in one tier of the summed size: the last tier (whose evictions leave
    the cache and become ghosts) holds the window bytes that the tiers above it do not.
    """
    params = state.params
    nbytes = state.nbytes
    if tier + 1 < len(nbytes):
        below = nbytes[tier + 1]
        if below[0] or below[1]:
            return params[_MIN_WINDOW]
    share = params[_WINDOW]
    if tier:
        above_window = above = 0
        for u in nbytes[:tier]:
            above_window += u[0]
            above += u[0] + u[1]
        mine = nbytes[tier][0] + nbytes[tier][1]
        if mine > 0:
            share = (share * (above + mine) - above_window) / mine
            share = 0.0 if share < 0.0 else 1.0 if share > 1.0 else share
    return share


def _recent(state: LfuState, age: float, g: int) -> bool:
    """Did a ghost that left ``age`` bytes of evictions ago leave recently enough to say that a
    modestly bigger segment would have kept it? ``g``: its stored size (> 0 for a window ghost).

    A window ghost: within 8x the window's bytes and within the protected bytes (ARC's B1 list
    holds at most the cache less its T1). A protected ghost: within the protected bytes. The
    segments' bytes are summed over the tiers (ghosts leave from the last one).
    """
    used = state.nbytes
    if len(used) == 1:
        window_bytes, main_bytes = used[0]
    else:
        window_bytes = sum(u[0] for u in used)
        main_bytes = sum(u[1] for u in used)
    if g > 0:
        return age <= 8.0 * window_bytes and age <= main_bytes
    return age <= main_bytes


def _adapt_window(state: LfuState, key: Key) -> None:
    """ARC's adaptation of its recency share, on ghost hits.

    A missed ``key`` that left the cache recently (`_recent`) from the window (a newcomer never
    promoted) means the window was too small for it: the share grows (and ``insert`` protects the
    key, as ARC moves a B1 hit to T2). One that left recently from the protected segment means
    that segment was too small: the share shrinks. A step is one L1 entry's worth times ARC's
    ratio of the other kind of ghost's bytes to this kind's, when above 1.
    """
    g = state.ghosts.get(key)
    stamp = state.stamps.get(key)
    if not g or stamp is None:  # 0: never resident; None: no eviction age
        return
    params = state.params
    if not _recent(state, params[_EVICTED] - stamp, g):
        return
    step = 1.0 / (len(state.main[0]) + len(state.window[0]) + 1)
    # ARC's step: max(1, |B2| / |B1|) entries on a B1 hit, max(1, |B1| / |B2|) on a B2 hit, so
    # that the more numerous kind of ghost does not win by numbers alone.
    b1 = params[_GWINDOW]
    b2 = params[_GBYTES] - b1
    if g > 0:
        if b1 > 0 and b2 > b1:
            step *= b2 / b1
        params[_WINDOW] = min(params[_WINDOW] + step, max(_MAX_WINDOW, params[_MIN_WINDOW]))
    else:
        if b2 > 0 and b1 > b2:
            step *= b1 / b2
        params[_WINDOW] = max(params[_WINDOW] - step, params[_MIN_WINDOW])


def _adapt(state: LfuState) -> None:
    """Hill climbing on the L1 hit ratio: keep moving log2(half_life) while it helps, else turn."""
    params = state.params
    tick = params[_TICK]
    resident = len(state.main[0]) + len(state.window[0])
    period = max(16384.0, 32.0 * resident)
    hit = 1.0 - params[_MISSES] / max(tick - params[_START], 1.0)
    params[_START] = tick
    params[_MISSES] = 0.0
    params[_PERIOD_END] = tick + period
    prev = params[_PREV_HIT]
    if prev >= 0.0 and hit < prev:
        params[_DIR] = -params[_DIR]
    params[_PREV_HIT] = hit
    log_h = min(max(params[_LOGH] + params[_DIR], _MIN_LOG_H), _MAX_LOG_H)
    if log_h == params[_LOGH]:
        params[_DIR] = -params[_DIR]
        return
    params[_LOGH] = log_h
    # Re-express every priority under the new half-life: the decayed counts are unchanged.
    old_inv, new_inv = params[_INV], 2.0**-log_h
    params[_INV] = new_inv
    shift = tick * (new_inv - old_inv)
    prio = state.prio
    for k in prio:
        prio[k] += shift
    for tier, main in enumerate(state.main):
        heap = state.heaps[tier]
        heap[:] = [(prio[k], k) for k in main]
        heapq.heapify(heap)


def lfu_plain(*, ttl: float | None = 86400.0, ghost_entries: int = 65536) -> Policy:
    """Classic LFU (no decay, no cap) over the same window, with a TTL, for comparison."""
    return lfu(half_life=math.inf, count_cap=math.inf, ttl=ttl, ghost_entries=ghost_entries)


def _trim_ghosts(state: LfuState) -> None:
    """Drops the oldest ghosts while they exceed ``ghost_entries`` or their share of the bytes."""
    ghosts, params = state.ghosts, state.params
    limit = params[_GHOSTS]
    blimit = params[_HISTORY] * params[_RESIDENT]
    popitem, forget, prio, last = ghosts.popitem, state.stamps.pop, state.prio, state.last
    # No ghost is resident (``insert`` takes a key out of the ghosts, ``remove`` puts it back), so
    # its bookkeeping goes with it. A key accessed but not inserted yet may go too: its insert then
    # counts it as new.
    while len(ghosts) > limit or params[_GBYTES] > blimit and len(ghosts) > _MIN_GHOSTS:
        key, g = popitem(False)
        params[_GBYTES] -= g if g >= 0 else -g - 1
        if g > 0:
            params[_GWINDOW] -= g
        forget(key, None)
        del prio[key]
        last.pop(key, None)


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
