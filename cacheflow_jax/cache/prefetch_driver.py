"""The cache's side of prefetching: the moves a prefetch makes, and who drives them.

`cacheflow_jax.prefetch.scheduler` decides what to load (a predictor's guesses, scored and
ranked); this module carries the loads out through the cache's mover, with prefetch admission:

* live, a background `PrefetchWorker` calls `PrefetchDriver` through the `PrefetchTarget`
  protocol: `issue` starts an L3 read (or, for a block in L2, a promotion), `install` lands an
  arrived block (L1, else L2, else dropped), `abandon` forgets the loads of a stopped worker;
* synchronously (replay, or ``PrefetchSettings(synchronous=True)``), `ReplayPrefetch` observes
  each access, issues what the scheduler proposes and lands it just before access
  ``i + lead``.

The counters (``issued``, ``used``, ``timely``, ``late``, ``wasted``, ``dropped``, ``promoted``)
are the cache's (`Counters.pf`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from cacheflow_jax.cache.advice import inflight_advice, smallest_block
from cacheflow_jax.cache.mover import DEVICE, HOST, Transit
from cacheflow_jax.core.log import logger
from cacheflow_jax.prefetch.scheduler import PrefetchScheduler, PrefetchSettings, PrefetchWorker
from cacheflow_jax.tiers.memory import MetadataTier, narrowed

if TYPE_CHECKING:
    import jax

    from cacheflow_jax.cache.demand import Demand
    from cacheflow_jax.cache.mover import Mover
    from cacheflow_jax.cache.replay_moves import SyncMoves
    from predictor import Predictor


class PrefetchDriver:
    """Runs a predictor's guesses through the cache (see the module docstring).

    Logs a warning (logger ``cacheflow_jax``) where ``settings.inflight_bytes`` is below every
    block of the store: such a prefetcher can issue nothing.

    Args:
      mover: the cache's mover.
      demand: the demand path (the gets a feeding or synchronous `get` wraps).
      predictor: the `predictor.Predictor`.
      settings: the `PrefetchSettings`.
      largest: the store's largest block (the default in-flight bound is at least one).
      describe: ``describe(key) -> (nbytes, kind)`` for the predictor's features.
    """

    def __init__(self, mover: Mover, demand: Demand, predictor: Predictor,
                 settings: PrefetchSettings, largest: int, describe: Any) -> None:  # fmt: skip
        self.mover = mover
        self.demand = demand
        self.settings = settings
        self.limit = settings.inflight_bytes or max(largest, mover.tiers[DEVICE].budget // 4)
        store = mover.store
        text = inflight_advice(settings.inflight_bytes, smallest_block(store), store.spec)
        if text is not None:
            logger.warning("%s", text)
        self.inflight_bytes = 0  # bytes of prefetch loads issued and not installed
        replay = isinstance(mover.tiers[DEVICE], MetadataTier)
        seen: set[str] | None = None if settings.keys_known or not replay else set()

        def fetchable(key: str) -> bool:
            if seen is not None:
                return key in seen
            try:
                mover.info(key)
            except (KeyError, TypeError):
                return False
            return True

        self.scheduler = PrefetchScheduler(predictor, settings, describe=describe,
                                           fetchable=fetchable,
                                           admission=mover.planner.admission)  # fmt: skip
        self.worker: PrefetchWorker | None = None
        self.replay: ReplayPrefetch | None = None
        self.promote_l2 = False  # the live worker moves L2 guesses up to L1
        if replay or settings.synchronous:
            self.replay = ReplayPrefetch(self, settings, seen, data=not replay)
        else:
            self.promote_l2 = settings.promote

    # ------------------------------------------------------------------- the cache's calls

    @property
    def wraps_gets(self) -> bool:
        """Whether `get` / `get_many` go through `get` / `get_many` here (a running worker
        is fed each access; synchronous prefetch lands loads around each access)."""
        return (self.worker is not None) or (self.replay is not None and self.replay.data)

    def start(self) -> None:
        """Starts the live worker (if it prefetches live and the worker is stopped)."""
        if self.replay is not None or (self.worker is not None and self.worker.alive):
            return
        self.worker = PrefetchWorker(self, self.scheduler)

    def stop(self) -> None:
        """Stops the worker: no thread is left and no load lands after this returns."""
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.stop()

    def pause(self, paused: bool) -> None:
        """While paused, accesses still teach the predictor, but no prefetch is issued."""
        if self.replay is not None:
            self.replay.paused = paused
        elif self.worker is not None:
            self.worker.paused = paused

    def settled(self) -> bool:
        """No prefetch work is pending: the worker sleeps with nothing fed or arrived, and no
        load is in flight."""
        worker = self.worker
        idle = worker is None or (worker.idle and not worker.feed and not worker.arrived)
        return idle and not self.inflight_bytes

    def get(self, key: str) -> jax.Array:
        """`Demand.get` of one key, fed to the worker or wrapped by synchronous prefetch."""
        replay = self.replay
        if replay is not None:
            now = self.mover.clock()
            replay.before(key, now)
            value = self.demand.get(key)
            replay.after(key, now)
            return value
        value = self.demand.get(key)
        worker = self.worker
        if worker is not None:
            worker.feed.append(key)
            if worker.idle:
                worker.poke()
        return value

    def get_many(self, keys: Iterable[str]) -> list[jax.Array]:
        """`Demand.get_many`, the batch fed to the worker as one item; synchronous prefetch
        takes one access at a time, in order."""
        keys = list(keys)
        if self.replay is not None:
            return [self.get(key) for key in keys]
        values = self.demand.get_many(keys)
        worker = self.worker
        if worker is not None:
            worker.feed.append(tuple(keys))
            if worker.idle:
                worker.poke()
        return values

    def describe(self) -> dict[str, Any]:
        """The scheduler's part of ``stats()["prefetch"]``."""
        scheduler = self.scheduler
        return {"disabled_reason": scheduler.disabled, "predictions": scheduler.predictions,
                "predict_us": scheduler.predict_seconds * 1e6 / scheduler.predictions
                if scheduler.predictions else 0.0,
                "read_gate": self.mover.counters.gate.describe()}  # fmt: skip

    # --------------------------------------------------------- PrefetchTarget: the worker's

    def now(self) -> float:
        return self.mover.clock()

    def rank(self, ranking: dict[str, int]) -> None:
        """The predictor's ranks of its newest guesses, for the planner's prefetch admission."""
        self.mover.planner.ranking = ranking

    def issue(self, key: str, worker: PrefetchWorker, rank: int, *, promote: bool = True) -> str:
        """Starts one prefetch load (worker thread); ``rank``: see `Planner.victim`.

        A key resident in L2 is promoted to L1 instead (`promote`), when the settings allow it;
        with ``promote=False`` it is left for the caller to promote later.

        Returns ``"issued"``, ``"skip"`` (resident, moving, unknown, or unusable), ``"full"``
        (the in-flight bytes are at their bound) or ``"promote"`` (in L2, ``promote=False``).
        """
        mover = self.mover
        with mover.lock:
            if not mover.fresh(key):
                host = mover.host
                if not (self.promote_l2 and host is not None and key in host.entries
                        and key not in mover.inflight):  # fmt: skip
                    return "skip"
                if not promote:
                    return "promote"
                in_host = host.sizes.get(key) or mover.info(key).nbytes
            else:
                in_host = 0
        if in_host:
            return self.promote(key, in_host, rank)
        with mover.lock:
            if not mover.fresh(key):
                return "skip"
            try:
                info = mover.info(key)
            except KeyError:
                return "skip"
            if mover.check_dtypes and narrowed(info.dtype):
                return "skip"  # a demand get raises DtypeError for it; a prefetch must not
            if self.inflight_bytes + info.nbytes > self.limit:
                return "full"
            if not mover.counters.gate.allows():
                return "skip"
            mover.inflight[key] = transit = Transit(prefetch=True)
            transit.rank = rank
            self.inflight_bytes += info.nbytes
            mover.counters.prefetch("issued", info.nbytes)
        try:
            future = mover.read(key)
        except Exception:
            self.fail(key, info.nbytes, None)
            return "skip"
        future.add_done_callback(lambda f: worker.arrive(key, f))
        return "issued"

    def promote(self, key: str, nbytes: int, rank: int) -> str:
        """Moves an L2 block the predictor expects soon up to L1 (worker thread).

        The layer-ahead step of MoE offloading: the host copy goes to the device before the
        access. As on a demand L2 hit, the block leaves L2 first, so that L1's victim, demoted,
        takes its room there: a promotion swaps two blocks and pushes nothing out of the cache.
        L1 takes it only with prefetch admission (`Planner.victim`); refused, it goes back to
        L2 and nothing else moves. It keeps its policy state and last access, as a demotion
        does, so a promotion that is not used is demoted again in its turn instead of leaving
        the cache. Counted in ``promoted`` (not in ``issued``: no L3 read).

        Returns:
          ``"issued"`` if it moved, else ``"skip"``.
        """
        mover = self.mover
        with mover.lock:
            host = mover.host
            if host is None or key not in host.entries or key in mover.inflight or key in mover.l1:
                return "skip"  # it moved meanwhile
            mover.planner.remove(HOST, key, moving=True)
            raw = host.pop(key)
            host.release(nbytes)
            mover.inflight[key] = transit = Transit()
            mover.notify_room()
        value = None
        device = mover.tiers[DEVICE]
        try:
            if mover.make_room(DEVICE, nbytes, key, prefetch=True, rank=rank):
                try:
                    value = device.load(raw, owned=True)
                finally:
                    if value is None:
                        with mover.lock:
                            device.release(nbytes)
        finally:
            back = value is None and mover.make_room(HOST, nbytes, None)
            with mover.lock:
                if value is not None:
                    mover.install(DEVICE, key, value, nbytes)
                    mover.counters.prefetch("promoted", nbytes)
                elif back:  # refused by L1 (or the copy failed): it stays in L2
                    host.put_reserved(key, raw, nbytes)
                    mover.planner.insert(HOST, key, mover.clock(), nbytes)
                else:
                    mover.leave(key, raw)  # never lose a runtime block
                del mover.inflight[key]
                mover.notify_room()
            transit.finish()  # an access that waited looks again and finds it where it is
        return "issued" if value is not None else "skip"

    def fail(self, key: str, nbytes: int, error: BaseException | None) -> None:
        """A prefetch load failed or was abandoned: forget it; a waiting access gets the error
        (or, with none, reads the block itself)."""
        mover = self.mover
        with mover.lock:
            transit = mover.inflight.get(key)
            if transit is None or not transit.prefetch:
                return
            del mover.inflight[key]
            self.inflight_bytes -= nbytes
            mover.counters.prefetch("dropped", nbytes)
            demanded = transit.demanded
            mover.notify_room()
        transit.finish(error=error if demanded else None)

    def install(self, key: str, future: Any) -> None:
        """Installs an arrived prefetch (worker thread): L3 -> host buffer -> device.

        A block nobody asked for yet goes in with prefetch admission (L1, else L2, else it is
        dropped); one an access is waiting for is installed as a demand load and handed over.
        """
        mover = self.mover
        transit = mover.inflight.get(key)
        if transit is None or not transit.prefetch:
            return  # abandoned
        nbytes = mover.info(key).nbytes
        try:
            raw = future.result(timeout=0)
        except BaseException as err:
            self.fail(key, nbytes, err)
            return
        demanded = transit.demanded
        value = None
        try:
            value = self._land(key, raw, nbytes, transit)
            demanded = transit.demanded  # an access may have come meanwhile
        except BaseException as err:
            with mover.lock:
                if mover.inflight.get(key) is transit:
                    del mover.inflight[key]
                    self.inflight_bytes -= nbytes
                    mover.counters.prefetch("dropped", nbytes)
                mover.notify_room()
            transit.finish(error=err if transit.demanded else None)
            return
        if demanded and value is None:
            value = mover.tiers[DEVICE].load(raw, owned=True)
        transit.finish(value=value if demanded else None)

    def _land(self, key: str, raw: Any, nbytes: int, transit: Transit) -> Any:
        """Puts an arrived block in L1, else L2, else drops it; returns its device value or
        None."""
        mover = self.mover
        device = mover.tiers[DEVICE]
        value = host_value = None
        in_l1 = mover.make_room(DEVICE, nbytes, key, prefetch=not transit.demanded,
                                rank=transit.rank)  # fmt: skip
        if in_l1 or transit.demanded:
            try:
                value = device.load(raw, owned=True)
            except BaseException:
                if in_l1:
                    with mover.lock:
                        device.release(nbytes)
                raise
        if not in_l1:
            host_value = mover.load_host(key, nbytes, raw, prefetch=not transit.demanded,
                                         rank=transit.rank)  # fmt: skip
        with mover.lock:
            demanded = transit.demanded
            now = mover.clock()
            guess = {"prefetched": not demanded, "rank": transit.rank}
            if in_l1:
                mover.install(DEVICE, key, value, nbytes, **guess)
            elif host_value is not None:
                mover.tiers[HOST].put_reserved(key, host_value, nbytes)
                mover.planner.insert(HOST, key, now, nbytes, **guess)
            else:
                mover.counters.prefetch("dropped", nbytes)
            del mover.inflight[key]
            self.inflight_bytes -= nbytes
            mover.notify_room()
        return value

    def abandon(self, worker: PrefetchWorker) -> None:
        """The worker stopped: drops its loads still in flight (worker thread, last)."""
        mover = self.mover
        with mover.lock:
            mine = [(k, mover.info(k).nbytes) for k, t in mover.inflight.items() if t.prefetch]
        for key, nbytes in mine:
            self.fail(key, nbytes, None)


class ReplayPrefetch:
    """Prefetch driven access by access, as replay does (and the live cache when synchronous).

    After access ``i`` the scheduler observes it and proposes keys; each fetchable one that is not
    resident or pending is issued (within the in-flight byte bound) and lands just before access
    ``i + lead``, through the planner's prefetch admission. An access to a key still pending is a
    late prefetch: it counts as a demand miss and the pending load is dropped. With ``data``
    (the live cache) the loads really read L3 and land in the tiers with their bytes.
    """

    def __init__(self, driver: PrefetchDriver, settings: PrefetchSettings,
                 seen: set[str] | None, *, data: bool) -> None:  # fmt: skip
        self.driver = driver
        self.lead = settings.lead
        self.seen = seen
        self.data = data
        self.moves: SyncMoves | None = None  # replay's moves (set by the cache), for landing
        self.index = 0  # the index of the next access
        self.pending: dict[str, tuple[int, int]] = {}  # key -> (nbytes, rank), not landed
        self.due: dict[int, list[str]] = {}  # access index -> keys that land just before it
        self.futures: dict[str, Any] = {}  # live: key -> read future
        self.paused = False  # accesses teach the predictor, but nothing is issued

    def before(self, key: str, now: float) -> None:
        """Lands the loads due before this access; counts a late one for ``key``."""
        driver = self.driver
        counters = driver.mover.counters
        due = self.due.pop(self.index, None)
        if due:
            for k in due:
                issued = self.pending.pop(k, None)
                if issued is None:
                    continue  # an access already took it (late)
                nbytes, rank = issued
                driver.inflight_bytes -= nbytes
                if self.data:
                    self._land_live(k, rank)
                elif not self.moves.install(k, nbytes, now, prefetched=True, rank=rank):
                    counters.prefetch("dropped", nbytes)
        issued = self.pending.pop(key, None)
        if issued is not None:
            nbytes = issued[0]
            driver.inflight_bytes -= nbytes
            counters.prefetch_use(nbytes, late=True)  # the access below counts as the miss
            if self.data:
                self.futures.pop(key, None)

    def after(self, key: str, now: float) -> None:
        """Gives the access to the scheduler and issues the loads it proposes."""
        driver = self.driver
        mover, scheduler = driver.mover, driver.scheduler
        self.index += 1
        if self.seen is not None:
            self.seen.add(key)
        scheduler.observe(key, now)
        if self.paused:
            return
        land = self.index + self.lead - 1
        candidates = scheduler.candidates()
        mover.planner.ranking = {k: rank + 1 for rank, (k, _) in enumerate(candidates)}
        for rank, (k, _) in enumerate(candidates):
            if k in self.pending or not mover.fresh(k):
                continue
            nbytes = mover.info(k).nbytes
            if driver.inflight_bytes + nbytes > driver.limit:
                break
            self.pending[k] = (nbytes, rank + 1)
            self.due.setdefault(land, []).append(k)
            driver.inflight_bytes += nbytes
            mover.counters.prefetch("issued", nbytes)
            if self.data:
                self.futures[k] = mover.read(k)

    def _land_live(self, key: str, rank: int) -> None:
        driver = self.driver
        mover = driver.mover
        future = self.futures.pop(key)
        with mover.lock:
            mover.inflight[key] = transit = Transit(prefetch=True)
            transit.rank = rank
            driver.inflight_bytes += mover.info(key).nbytes
        future.result(timeout=mover.l3_timeout)  # the read finishes before the next access
        driver.install(key, future)
