"""The cache's counters: accesses by tier, prefetch outcomes, L3 reads; and `stats()` from them.

Every count changes under the cache lock, except L3 reads: they finish on store threads, so
their counters have a lock of their own, never held across a wait, and a finishing read never
waits for the cache lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from cacheflow_jax.prefetch.scheduler import new_counters

# Prefetch outcomes that judge an L3 read of the live worker (`ReadGate`).
READ_OUTCOMES = frozenset(("timely", "late", "wasted", "dropped"))


class ReadGate:
    """Whether the live worker may start another L3 prefetch read: while its recent loads were
    used in time at least as often as they came late, went unused or were dropped.

    A timely load saves a demand read; the others cost a read of the store and the cores that
    the demand reads and the model need (replay counts no such cost, and has no gate). Counts
    are halved past `HALF` outcomes, so the gate follows a stream that changes; while it is shut,
    one read in `EXPLORE` goes ahead so that the rate is still measured.
    """

    PRIOR = 2.0  # timely loads assumed at first: a cold cache reads
    HALF = 256.0
    EXPLORE = 16

    __slots__ = ("good", "bad", "shut")

    def __init__(self) -> None:
        self.good, self.bad, self.shut = self.PRIOR, 0.0, 0

    def outcome(self, timely: bool) -> None:
        if timely:
            self.good += 1.0
        else:
            self.bad += 1.0
        if self.good + self.bad > self.HALF:
            self.good, self.bad = self.good / 2, self.bad / 2

    def allows(self) -> bool:
        if self.good >= self.bad:
            return True
        self.shut += 1
        return self.shut % self.EXPLORE == 0

    def describe(self) -> dict[str, Any]:
        return {"open": self.good >= self.bad, "timely": round(self.good, 1),
                "other": round(self.bad, 1), "held_back": self.shut}  # fmt: skip


class Counters:
    """Hits, misses and bytes by tier (``n``), prefetch counts (``pf``) and L3 reads (``l3``)."""

    def __init__(self) -> None:
        self.n = {"device": 0, "host": 0, "miss": 0, "bytes": 0, "miss_bytes": 0, "host_bytes": 0}
        self.pf = new_counters()
        self.gate = ReadGate()  # the live worker's L3 reads earn their rate
        self.l3_lock = threading.Lock()
        self.l3 = {"reads": 0, "read_bytes": 0, "read_seconds": 0.0}

    def access(self, where: str, nbytes: int) -> None:
        """One access served from ``where`` (``device``, ``host`` or ``miss``)."""
        n = self.n
        n[where] += 1
        n["bytes"] += nbytes
        if where == "miss":
            n["miss_bytes"] += nbytes
        elif where == "host":
            n["host_bytes"] += nbytes

    def hits(self, count: int, nbytes: int) -> None:
        """``count`` buffered L1 hits of ``nbytes`` in all."""
        self.n["device"] += count
        self.n["bytes"] += nbytes

    def add(self, device: int, host: int, miss: int, total: int, host_bytes: int,
            miss_bytes: int) -> None:  # fmt: skip
        """A replay loop's counts, kept in locals over the loop."""
        n = self.n
        n["device"] += device
        n["host"] += host
        n["miss"] += miss
        n["bytes"] += total
        n["host_bytes"] += host_bytes
        n["miss_bytes"] += miss_bytes

    def prefetch(self, name: str, nbytes: int) -> None:
        pf = self.pf
        pf[name] += 1
        pf[name + "_bytes"] += nbytes
        if name in READ_OUTCOMES:
            self.gate.outcome(name == "timely")

    def prefetch_use(self, nbytes: int, *, late: bool) -> None:
        """A prefetched block was asked for (timely: resident; late: still loading)."""
        self.prefetch("used", nbytes)
        self.prefetch("late" if late else "timely", nbytes)

    def reset(self) -> None:
        for counts in (self.n, self.pf):
            for name in counts:
                counts[name] = 0

    def timed_reads(self, keys: list[str], futures: list[Any],
                    info: Callable[[str], Any]) -> list[Any]:  # fmt: skip
        """Wraps a batch of L3 reads so that their count, bytes and time are recorded.

        The time is from issuing the batch until the last of its reads was collected. Reads
        issued together overlap, so this is the batch's wall time, not the sum of its reads'
        times, and bytes / seconds is the bandwidth L3 gave.
        """
        batch = ReadBatch(self, sum(info(k).nbytes for k in keys), len(futures))
        return [TimedRead(f, batch) for f in futures]


class ReadBatch:
    """L3 reads issued together; records them in the counters when the last is collected."""

    __slots__ = ("_counters", "_nbytes", "_left", "_count", "_start")

    def __init__(self, counters: Counters, nbytes: int, count: int) -> None:
        self._counters = counters
        self._nbytes = nbytes
        self._left = self._count = count
        self._start = time.perf_counter()

    def collected(self) -> None:
        counters = self._counters
        with counters.l3_lock:
            self._left -= 1
            if self._left:
                return
            l3 = counters.l3
            l3["reads"] += self._count
            l3["read_bytes"] += self._nbytes
            l3["read_seconds"] += time.perf_counter() - self._start


class TimedRead:
    """A store's read future whose first ``result()`` (value or error) counts for its batch."""

    __slots__ = ("_future", "_batch")

    def __init__(self, future: Any, batch: ReadBatch) -> None:
        self._future = future
        self._batch: ReadBatch | None = batch

    def result(self, timeout: float | None = None) -> Any:
        try:
            value = self._future.result(timeout)
        except TimeoutError:
            raise  # still pending: not collected yet
        except BaseException:
            self._collected()
            raise
        self._collected()
        return value

    def _collected(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.collected()

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        self._future.add_done_callback(lambda _: fn(self))


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def stats_of(counters: Counters, mover: Any, writeback: Any, driver: Any,
             read_stats: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """`TieredCache.stats()` from its parts (see there and docs/design.md)."""
    with mover.lock:
        mover.drain()
        n, pf = dict(counters.n), dict(counters.pf)
        with counters.l3_lock:
            l3: dict[str, Any] = dict(counters.l3)
        tiers = {t.name: {"used": t.used, "budget": t.budget, "blocks": len(t.entries)}
                 for t in mover.tiers}  # fmt: skip
        l1 = tiers[mover.tiers[0].name]
        l1["pinned_bytes"], l1["pinned_blocks"] = mover.pins.bytes, len(mover.pins.counts)
        planner = mover.planner
        policy = planner.describe()
        admission = planner.admission.describe() if planner.admission is not None else None
        if admission is not None and planner.foresight is not None:
            admission["foresight"] = planner.foresight.describe()
        writebacks = dict(writeback.counts, dirty_bytes=writeback.dirty_bytes)
    if read_stats is not None:
        l3.update(read_stats)  # bytes read vs served (read amplification)
    requests = n["device"] + n["host"] + n["miss"]
    prefetch: dict[str, Any] = dict(pf)
    prefetch["accuracy"] = ratio(pf["used"], pf["issued"])
    prefetch["coverage"] = ratio(pf["timely"], pf["timely"] + n["miss"])
    prefetch["enabled"] = driver is not None and driver.scheduler.disabled is None
    if driver is not None:
        prefetch.update(driver.describe())
    if admission is not None:
        prefetch["admission"] = admission
    return {
        "requests": requests,
        "hits": {"device": n["device"], "host": n["host"]},
        "misses": n["miss"],
        "device_miss_ratio": ratio(requests - n["device"], requests),
        "miss_ratio": ratio(n["miss"], requests),
        "byte_miss_ratio": ratio(n["miss_bytes"], n["bytes"]),
        "prefetch": prefetch,
        "policy": policy,
        "tiers": tiers,
        "bytes": {
            "requested": n["bytes"],
            "device": n["bytes"] - n["host_bytes"] - n["miss_bytes"],
            "host": n["host_bytes"],
            "miss": n["miss_bytes"],
        },
        "l3": l3,
        "writebacks": writebacks,
    }
