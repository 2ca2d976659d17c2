"""The prefetch scheduler: accesses go in to a `predictor.Predictor`; planned loads come out.

Design note. Prefetching replaces a demand miss by a load that finished before the block was
asked for. What it must not do is slow the hit path or pollute the cache with wrong guesses. So:

* The hit path only appends the key to a feed (a deque; no lock, no I/O) and wakes the worker
  if it sleeps. A background worker thread feeds the accesses to the predictor, asks it for its
  top ``k`` keys after each batch of accesses, and keeps the candidates whose score is at least
  the floor (``min_score``; with adaptive admission, the measured share of displaced victims
  that came back, see `PrefetchScheduler.floor`), that the store holds and that are not
  resident or already moving. A newer
  prediction replaces the candidates not issued yet: those went stale.
* Loads are issued in the predictor's order (its score ranks value and urgency together), at
  most ``inflight_bytes`` at a time. They read L3 asynchronously; the worker installs each block
  as it arrives, L3 -> host buffer -> device, through the cache's planner with *prefetch
  admission* (`cacheflow_jax.planning.planner`): a guess displaces the policy's victim unless the
  predictor ranks the victim itself above the guess (it expects the victim back sooner);
  otherwise it goes to L2 by the same rule, or is dropped. A guess not used within its rank (in
  accesses) after it landed is stale, and stale guesses leave any tier first.
  With ``adaptive`` (the default), a guess also displaces a victim only while guesses of its
  rank have been used more often than displaced victims came back (`_planner.Admission`).
* A guess already in L2 is *promoted*: the worker copies it up to L1, by the same prefetch
  admission, after issuing the round's L3 reads (``PrefetchSettings.promote``). This is the
  layer-ahead step of MoE offloading systems (experts in host memory go to the device while the
  layer before computes). A promoted block keeps its policy state, like a demoted one: it is no
  guess the planner tracks, and unused it goes back down in its turn. Promotions are counted
  apart (``promoted``), not in ``issued``: they read nothing from L3.
* A demand access that finds its block still loading waits for that load (it is *late*); one
  that finds it resident is a hit (*timely*).
* When accesses pile up faster than the worker takes them (more than a round's 32 waiting: a
  tight loop of hits, where there is nothing to prefetch anyway), the worker takes at most
  ``max_duty`` of the time: it sleeps in
  proportion to its work, so on a machine with few cores it does not starve the serving thread
  of the GIL. A serving loop that computes between its accesses (one ``get_many`` per layer, then
  the layer's math) finds the worker idle, and each batch is answered at once.
* A predictor that raises, or whose ``predict`` takes longer than ``predict_budget_s`` (median of
  its last 16 calls), turns prefetching off with one warning; the cache goes on without it.

Replay runs the same scheduler synchronously: after each access it observes, predicts and
schedules; a load issued at access ``i`` lands before access ``i + lead``. With
``synchronous=True`` the live cache does the same (lead 1) inside each `get`, which makes its
residency comparable with replay's step by step.

Counters (`TieredCache.stats()["prefetch"]`, replay's JSON): ``issued``, ``used`` (accessed
before leaving), ``timely`` (used while resident: a hit), ``late`` (used while still loading),
``wasted`` (left unused), ``dropped`` (arrived but not admitted, or failed), ``promoted`` (L2
guesses moved up to L1 by the live worker), each also in bytes;
``accuracy = used / issued``; ``coverage = timely / (timely + demand misses)``, the share of
the accesses that would have gone to L3 without prefetch and were hits with it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cacheflow_jax.planning.planner import Admission
    from predictor import Predictor


def load_prefetcher(path: str | os.PathLike) -> Predictor | None:
    """Loads a predictor checkpoint for a cache; a damaged one warns once and gives None.

    A checkpoint that fails its integrity check (`predictor.CorruptCheckpointError`) must not
    stop serving: the cache runs without prefetch, and says so once.

    Raises:
      predictor.CheckpointError: ``path`` is missing or not a checkpoint (a user error: fix the
        path; a training output directory ``OUT`` holds its checkpoint in ``OUT/checkpoint``).
    """
    from predictor import CorruptCheckpointError
    from predictor import load as load_predictor

    try:
        return load_predictor(path)
    except CorruptCheckpointError as err:
        warnings.warn(
            f"prefetching turned off: {err}; the cache goes on serving without it",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


@dataclasses.dataclass(frozen=True)
class PrefetchSettings:
    """How the cache prefetches (see the module docstring).

    Attributes:
      k: keys asked of the predictor per prediction.
      min_score: the lowest score of a key worth loading (scores are probabilities for the MLP
        and Markov predictors, 1 for last-successor).
      inflight_bytes: bytes of prefetch loads in flight at once; None: a quarter of L1, and at
        least the largest block.
      predict_budget_s: a ``predict`` slower than this (median of the last 16) turns prefetch off.
      max_duty: the largest share of time the live worker spends working while accesses pile
        up (more than a round's 32 waiting when it wakes).
      lead: replay only: a load issued at access ``i`` is usable from access ``i + lead`` on.
      keys_known: replay only: every key of the trace is in L3 from the start (weights); by
        default a key is fetchable only after its first access (KV blocks are written first).
      synchronous: live only: predict and load inside each access, as replay does with lead 1
        (deterministic; for tests and comparisons).
      promote: live worker only: a guess resident in L2 is moved up to L1 (with prefetch
        admission) instead of being skipped; counted in ``promoted``.
      adaptive: a guess displaces the policy's victim only while guesses of its rank have been
        used more often than a guess costs (hits lost to the victims it displaced), and it is
        loaded only if its score reaches that cost, instead of ``min_score`` (both measured
        online; `cacheflow_jax.planning.planner.Admission`); and a block the prefetch brought in and
        that was then used (foreseen) leaves first while foreseen blocks come back uncovered no
        more often, per byte, than the policy's victims (`cacheflow_jax.planning.planner.Foresight`).
        Off: ``min_score``, every guess the predictor does not rank below its victim is
        admitted, and the policy alone picks victims after stale guesses.
    """

    k: int = 4
    min_score: float = 0.25
    inflight_bytes: int | None = None
    predict_budget_s: float = 0.05
    max_duty: float = 0.05
    lead: int = 1
    keys_known: bool = False
    synchronous: bool = False
    promote: bool = True
    adaptive: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.k >= 1, "k must be >= 1"),
            (0.0 <= self.min_score <= 1.0, "min_score must be in [0, 1]"),
            (self.inflight_bytes is None or self.inflight_bytes > 0, "inflight_bytes must be > 0"),
            (self.predict_budget_s > 0, "predict_budget_s must be > 0"),
            (0.0 < self.max_duty <= 1.0, "max_duty must be in (0, 1]"),
            (self.lead >= 1, "lead must be >= 1"),
        ]
        for ok, what in checks:
            if not ok:
                raise ValueError(f"PrefetchSettings: {what}; got {self}")


COUNTERS = ("issued", "used", "timely", "late", "wasted", "dropped", "promoted", "staged")


def new_counters() -> dict[str, int]:
    """Zeroed prefetch counters: each name, and ``<name>_bytes``."""
    out = {}
    for name in COUNTERS:
        out[name] = 0
        out[name + "_bytes"] = 0
    return out


class PrefetchScheduler:
    """Feeds accesses to a predictor and turns its predictions into keys worth loading.

    Shared by the live worker and replay. Never raises: a predictor that fails or is too slow
    turns the scheduler off (``disabled`` says why) with one ``RuntimeWarning``.

    Args:
      predictor: the `predictor.Predictor`.
      settings: the `PrefetchSettings`.
      describe: ``describe(key) -> (nbytes, kind)`` for the accesses given to the predictor.
      fetchable: ``fetchable(key)``: whether the store holds ``key`` (a prefetch is never issued
        for a key it does not).
      admission: the planner's `cacheflow_jax.planning.planner.Admission` when ``settings.adaptive``:
        its measured victim return rate is the score a guess must reach (`floor`), instead of
        the fixed ``min_score``.
    """

    def __init__(
        self,
        predictor: Predictor,
        settings: PrefetchSettings,
        *,
        describe: Callable[[str], tuple[int, str]],
        fetchable: Callable[[str], bool],
        admission: Admission | None = None,
    ) -> None:
        self.predictor = predictor
        self.admission = admission
        self.settings = settings
        self._describe = describe
        self._fetchable = fetchable
        self._times: collections.deque[float] = collections.deque(maxlen=16)
        self.disabled: str | None = None
        self.predict_seconds = 0.0
        self.predictions = 0

    def observe(self, key: str, t: float) -> None:
        """Gives one access to the predictor."""
        if self.disabled is not None:
            return
        try:
            nbytes, kind = self._describe(key)
            self.predictor.observe({"key": key, "t": t, "nbytes": nbytes, "kind": kind})
        except Exception as err:
            self.disable(f"predictor.observe raised {type(err).__name__}: {err}")

    def candidates(self) -> list[tuple[str, float]]:
        """The predictor's keys worth loading now, best first (``[]`` when off)."""
        if self.disabled is not None:
            return []
        start = time.perf_counter()
        try:
            proposed = self.predictor.predict(self.settings.k)
        except Exception as err:
            self.disable(f"predictor.predict raised {type(err).__name__}: {err}")
            return []
        took = time.perf_counter() - start
        self.predict_seconds += took
        self.predictions += 1
        self._times.append(took)
        if len(self._times) == self._times.maxlen:
            median = statistics.median(self._times)
            if median > self.settings.predict_budget_s:
                self.disable(
                    f"predictor.predict takes {median * 1e3:.1f} ms (median of the last "
                    f"{len(self._times)}), more than predict_budget_s="
                    f"{self.settings.predict_budget_s} s"
                )
                return []
        out = []
        floor = self.floor()
        for item in proposed:
            try:
                key, score = item
                score = float(score)
            except (TypeError, ValueError):
                self.disable(f"predictor.predict returned {item!r}, not a (key, score) pair")
                return []
            if score >= floor and isinstance(key, str) and self._fetchable(key):
                out.append((key, score))
        return out

    def floor(self) -> float:
        """The lowest score of a guess worth loading now.

        Without adaptive admission, ``min_score``. With it, what a guess has cost: the hits lost
        per guess landed (`Admission.victim_return`, its prior at ``min_score``); a guess at
        least that likely to be used is worth loading. Where displaced victims never come back,
        unlikely guesses are still worth it; where they often do, only likely ones are.
        """
        admission = self.admission
        if admission is None:
            return self.settings.min_score
        return admission.victim_return()

    def disable(self, reason: str) -> None:
        """Turns prefetching off, warning once."""
        if self.disabled is not None:
            return
        self.disabled = reason
        warnings.warn(
            f"prefetching turned off: {reason}; the cache goes on serving without it",
            RuntimeWarning,
            stacklevel=2,
        )


_FEED = 1 << 16  # accesses (or batches) waiting for the worker, at most
_ROUND = 32  # feed items observed per round of the worker, at most


class PrefetchTarget(Protocol):
    """What the worker moves blocks through (the cache's
    `cacheflow_jax.cache.prefetch_driver.PrefetchDriver`)."""

    def now(self) -> float:
        """The cache's clock."""
        ...

    def rank(self, ranking: dict[str, int]) -> None:
        """The predictor's ranks of its newest guesses (1 is the best)."""
        ...

    def issue(self, key: str, worker: PrefetchWorker, rank: int, *, promote: bool = True) -> str:
        """Starts a load of ``key`` (or promotes it from L2); ``"issued"``, ``"skip"``,
        ``"full"`` or ``"promote"``."""
        ...

    def install(self, key: str, future: Any) -> None:
        """Lands an arrived load."""
        ...

    def abandon(self, worker: PrefetchWorker) -> None:
        """Forgets the loads of a stopped worker."""
        ...


class PrefetchWorker:
    """The live cache's background thread: observes the feed, issues loads, installs arrivals.

    Args:
      target: where loads go (a `PrefetchTarget`: the cache's prefetch driver).
      scheduler: the `PrefetchScheduler`.
    """

    def __init__(self, target: PrefetchTarget, scheduler: PrefetchScheduler) -> None:
        self.target = target
        self.scheduler = scheduler
        # Keys, or tuples of keys (a get_many). Bounded: when the worker falls behind (it works at
        # most max_duty of the time), the oldest accesses are dropped; the predictor sees the
        # recent ones, which are the ones its next prediction depends on.
        self.feed: collections.deque[Any] = collections.deque(maxlen=_FEED)
        self.arrived: collections.deque[tuple[str, Any]] = collections.deque()
        self.idle = True
        self._wake = threading.Event()
        self._stop = False
        self._queue: list[tuple[str, int]] = []
        self.paused = False  # accesses teach the predictor, but nothing is issued
        self.skipped = 0  # feed items dropped because they piled up
        self._thread = threading.Thread(target=self._run, name="cacheflow-prefetch", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Wakes the worker (called by the hit path only when it sleeps)."""
        self.idle = False
        self._wake.set()

    def arrive(self, key: str, future: Any) -> None:
        """A load finished (called from a reader thread); the worker installs it."""
        self.arrived.append((key, future))
        if self.idle:
            self.poke()

    def stop(self) -> None:
        """Stops the thread and waits for it; loads not installed yet are abandoned."""
        self._stop = True
        self._wake.set()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        target, scheduler = self.target, self.scheduler
        duty = scheduler.settings.max_duty
        while not self._stop:
            self.idle = True
            if not self.feed and not self.arrived:
                self._wake.wait(0.1)
            self._wake.clear()
            self.idle = False
            if self._stop:
                break
            start = time.perf_counter()
            # Accesses piled up past what one round takes (a tight loop of hits): throttle. A
            # serving loop that computes between its batches never gets that far behind.
            backlog = len(self.feed) > _ROUND
            while self.arrived:
                key, future = self.arrived.popleft()
                target.install(key, future)
            observed = False
            now = target.now()
            feed = self.feed
            # Take what is waiting now, at most _ROUND items: when accesses pile up, the oldest
            # are skipped (the next prediction depends on the newest), and the round stays short.
            waiting = len(feed)
            for _ in range(waiting - _ROUND):
                feed.popleft()
                self.skipped += 1
            for _ in range(min(waiting, _ROUND)):
                item = feed.popleft()
                if isinstance(item, str):
                    scheduler.observe(item, now)
                else:
                    for key in item:
                        scheduler.observe(key, now)
                observed = True
            if observed and not self.paused:
                # The rest of the old queue went stale. Each guess carries its rank, for the
                # planner's prefetch admission (a victim the predictor ranks higher stays).
                proposed = scheduler.candidates()
                target.rank({key: r + 1 for r, (key, _) in enumerate(proposed)})
                self._queue = [(key, r + 1) for r, (key, _) in enumerate(proposed)]
            # L3 reads first, in the predictor's order: they take longest, and promotions (a
            # host-to-device copy each, done here) would only delay them.
            later = []
            while self._queue:
                key, rank = self._queue[0]
                verdict = target.issue(key, self, rank, promote=False)
                if verdict == "full":
                    break  # in-flight bytes at their bound: try again after an arrival
                self._queue.pop(0)
                if verdict == "promote":
                    later.append((key, rank))
            for key, rank in later:
                target.issue(key, self, rank)
            busy = time.perf_counter() - start
            if backlog and duty < 1.0 and busy > 0:
                time.sleep(busy * (1.0 / duty - 1.0))
        target.abandon(self)
