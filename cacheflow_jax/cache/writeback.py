"""Write-back of runtime blocks to L3: one owner of the background work, as orbax's
``_AsyncManager`` is for an async checkpoint.

Design note.

* Each `put` gives its block a new `Version` (`next_version`: later than every earlier version
  made by this process). A block is *dirty* from its put until that version, or a later one,
  is durable in L3; the dirty blocks' bytes are held to ``budget`` (``writeback_bytes``).
* A dirty block that leaves L1/L2 is *parked* here (readers are served from it) until its write
  is durable, so no reader sees L3 before the write lands. A dirty block still resident is
  written by `flush`, or when a put needs write-back room.
* At most one write per key is in flight. When it ends and the key was put again meanwhile, the
  newer version is written next (`flush` waits for it), so an older write-back can never be the
  last one of a key. The store enforces the same order itself (compare-and-publish: it refuses
  an older version of this writer over a newer one), which covers two caches over one store and
  any retry.
* The copy to the host, the checksum and the store's I/O run on background threads: a put or an
  eviction only hands a value over.
* The state is guarded by the cache's lock, which the tiers share, so that a block changes tier
  and dirtiness in one step. Nothing here waits while holding it.
* In a shared store (``open_store(..., shared=True)``) a key is published once. A write-back
  that finds other bytes published under its key fails with a `ConflictError`: the block is no
  longer dirty (it is never retried), the cache drops its own copy (``forget``), so that it
  serves the published bytes as every other process does, and ``flush`` (or
  ``check_for_errors``) raises the error once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from cacheflow_jax.core.blocks import ConflictError, StoreError
from cacheflow_jax.core.pytree import leaves_of
from cacheflow_jax.store.runtime_format import SUPERSEDED, Version, next_version

# The background thread that copies blocks to the host, encodes them and hands them to the store
# (whose own threads do the file or network I/O and answer with a future, so it never waits for
# them). One: every such thread takes the interpreter from the serving thread, and a second one
# made puts slower without making write-backs faster (docs/kv_cache.md).
_THREADS = 1
# Blocks handed to the store's `write_many` at once (a store without it gets one `write` each).
_BATCH = 64


class WriteBack:
    """The runtime blocks not yet durable in L3, and their writes.

    Args:
      store: the L3 `Store` (``write(key, value, version=...)``).
      lock: the cache's lock; every method that says "under the lock" expects it held.
      budget: the most bytes of dirty blocks at once (``writeback_bytes``).
      resident: under the lock, the resident (L1/L2) value of a key, or None.
      to_host: turns a resident value into a numpy array (called on a background thread).
      forget: under the lock, drops the cache's copy of a key whose write-back was refused
        because the shared store holds other bytes under it (`ConflictError`).
    """

    def __init__(
        self,
        store: Any,
        lock: threading.Lock,
        *,
        budget: int,
        resident: Callable[[str], Any],
        to_host: Callable[[Any], Any],
        forget: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self._forget = forget
        self._conflicts: list[ConflictError] = []  # refused write-backs, raised once by flush
        self.budget = budget
        self.lock = lock
        self._resident = resident
        self._to_host = to_host
        self.parked: dict[str, Any] = {}  # dirty blocks that left L1/L2: key -> value
        self._to_start: dict[str, None] = {}  # parked since `start` last looked (an ordered set)
        self._dirty: dict[str, int] = {}  # key -> nbytes, while its latest version is not durable
        self.dirty_bytes = 0
        self._latest: dict[str, Version] = {}  # dirty keys: the version of their last put
        self._durable: dict[str, int] = {}  # dirty keys: the seq of the version L3 holds
        self._writing: dict[str, Version] = {}  # key -> the version being written
        self._futures: dict[str, Future] = {}  # key -> its write's future (done when durable)
        self._errors: dict[str, BaseException] = {}  # key -> its last failed write
        self._written = threading.Condition(lock)  # notified whenever a write ends
        self.counts = {"count": 0, "bytes": 0, "superseded": 0, "conflicts": 0, "stalls": 0,
                       "stall_seconds": 0.0}  # fmt: skip

    # ---------------------------------------------------------------- under the cache lock

    def is_dirty(self, key: str) -> bool:
        """Under the lock: is L3 missing the latest value of ``key``?"""
        return key in self._dirty

    def room(self, key: str) -> int:
        """Under the lock: bytes a put of ``key`` may make dirty (its own dirty bytes count)."""
        return self.budget - self.dirty_bytes + self._dirty.get(key, 0)

    def record_put(self, key: str, nbytes: int) -> None:
        """Under the lock: a put of ``key`` (``nbytes``) supersedes its earlier versions."""
        self.parked.pop(key, None)
        self._to_start.pop(key, None)
        self._latest[key] = next_version()
        self.dirty_bytes += nbytes - self._dirty.get(key, 0)
        self._dirty[key] = nbytes

    def park(self, key: str, value: Any, *, replace: bool = True) -> None:
        """Under the lock: ``key`` left L1/L2 with ``value``; kept here while it is dirty.

        With ``replace=False`` a value already parked stays (it is as new: one version).
        """
        if key in self._dirty and (replace or key not in self.parked):
            self.parked[key] = value
            self._to_start[key] = None

    def _claim(self, keys: Iterable[str]) -> list[tuple[str, Any, Version, Future]]:
        """Under the lock: marks writes of the latest version of each dirty ``key`` as started.

        A key already being written, clean, or in transit between tiers (neither parked nor
        resident: it is written once it lands) is skipped.
        """
        todo = []
        for key in keys:
            if key in self._writing or key not in self._dirty:
                continue
            value = self.parked.get(key)
            if value is None:
                value = self._resident(key)
                if value is None:
                    continue
            version = self._latest[key]
            self._writing[key] = version
            self._futures[key] = future = Future()
            todo.append((key, value, version, future))
        return todo

    # ------------------------------------------------------------------- outside the lock

    def start(self) -> None:
        """Starts writes of the blocks parked since the last call (those not being written
        already; a parked block whose write is in flight is written again when it ends, if a
        newer version was parked meanwhile). O(blocks parked since), not O(blocks parked)."""
        if not self._to_start:
            return
        with self.lock:
            keys = [k for k in self._to_start if k in self.parked]
            self._to_start.clear()
            todo = self._claim(keys)
        self._submit(todo)

    def start_all(self) -> None:
        """Starts writes of every dirty block, parked or resident."""
        with self.lock:
            todo = self._claim(list(self._dirty))
        self._submit(todo)

    def _submit(self, todo: list[tuple[str, Any, Version, Future]]) -> None:
        if not todo:
            return
        from cacheflow_jax.store.futures import work_queue  # TensorStore's side: not for replay

        pool = work_queue("writeback", _THREADS)
        if getattr(self.store, "write_many", None) is None:
            for item in todo:
                pool.submit(self._write, *item)
            return
        for start in range(0, len(todo), _BATCH):
            pool.submit(self._write_many, todo[start : start + _BATCH])

    def _write(self, key: str, value: Any, version: Version, future: Future) -> None:
        """On a background thread: copies the block to the host and starts the store's write."""
        try:
            host = self._to_host(value)
            nbytes = sum(int(leaf.nbytes) for leaf in leaves_of(host))
            write = self.store.write(key, host, version=version)
        except BaseException as err:
            self._done([(key, version, future, 0)], [err])
            return

        def done(write: Any) -> None:
            try:
                outcome = write.result(timeout=0)
            except BaseException as err:
                outcome = err
            self._done([(key, version, future, nbytes)], [outcome])

        write.add_done_callback(done)

    def _write_many(self, todo: list[tuple[str, Any, Version, Future]]) -> None:
        """On a background thread: `_write` of several blocks, with one `write_many` of the
        store (one future and one record of the outcomes for them all)."""
        items, ends, outcomes = [], [], []
        for key, value, version, future in todo:
            try:
                host = self._to_host(value)
                nbytes = sum(int(leaf.nbytes) for leaf in leaves_of(host))
            except BaseException as err:
                ends.append((key, version, future, 0))
                outcomes.append(err)
                continue
            items.append((key, host, version))
            ends.append((key, version, future, nbytes))
            outcomes.append(None)
        written = [end for end, outcome in zip(ends, outcomes) if outcome is None]
        failed = [(end, outcome) for end, outcome in zip(ends, outcomes) if outcome is not None]
        if failed:
            self._done([end for end, _ in failed], [outcome for _, outcome in failed])
        if not items:
            return
        try:
            write = self.store.write_many(items)
        except BaseException as err:
            self._done(written, [err] * len(written))
            return
        write.add_done_callback(lambda f: self._done(written, f.result()))

    def _done(self, ends: list[tuple[str, Version, Future, int]], outcomes: list[Any]) -> None:
        """Writes ended (on a store thread): ``ends`` are their ``(key, version, future,
        nbytes)``, ``outcomes`` what each gave (the store's answer or an exception). Records
        them and writes the newer versions parked meanwhile."""
        todo = []
        with self.lock:
            for (key, version, _, nbytes), outcome in zip(ends, outcomes):
                todo += self._record(key, version, nbytes, outcome)
            self._written.notify_all()
        for (_, _, future, _), outcome in zip(ends, outcomes):
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        self._submit(todo)

    def _record(
        self, key: str, version: Version, nbytes: int, outcome: Any
    ) -> list[tuple[str, Any, Version, Future]]:
        """Under the lock: one write ended with ``outcome``; returns the write to start next
        (a newer version of the key parked meanwhile), if any."""
        self._writing.pop(key, None)
        self._futures.pop(key, None)
        if isinstance(outcome, ConflictError):
            self._refused(key, outcome)
            return []
        if isinstance(outcome, BaseException):
            self._errors[key] = outcome  # the block stays in memory for a retry
            return []
        # A later successful write of the key supersedes its earlier failure.
        self._errors.pop(key, None)
        if outcome == SUPERSEDED:
            self.counts["superseded"] += 1
        else:
            self.counts["count"] += 1
            self.counts["bytes"] += nbytes
        if key in self._dirty:
            if self._latest[key] == version:
                self._clean(key)
            else:
                self._durable[key] = max(self._durable.get(key, 0), version.seq)
        return self._claim([key]) if key in self.parked else []

    def _refused(self, key: str, error: ConflictError) -> None:
        """Under the lock: the shared store holds other bytes under ``key``: ours are dropped
        (never retried), so that the cache serves the published block."""
        self.counts["conflicts"] += 1
        self._conflicts.append(error)
        self._errors.pop(key, None)
        if key in self._dirty:
            self._clean(key)
        if self._forget is not None:
            self._forget(key)

    def _clean(self, key: str) -> None:
        """Under the lock: ``key``'s latest version is durable."""
        self.parked.pop(key, None)
        self._to_start.pop(key, None)
        self.dirty_bytes -= self._dirty.pop(key)
        self._latest.pop(key, None)
        self._durable.pop(key, None)

    def _reached(self, key: str, seq: int) -> bool:
        """Under the lock: L3 holds version ``seq`` of ``key`` or a later one."""
        return key not in self._dirty or self._durable.get(key, 0) >= seq

    def wait_for_room(self, key: str, nbytes: int, deadline: float | None, timeout: Any) -> None:
        """Starts every dirty block's write and waits until one ends (a put needs room).

        Raises:
          StoreError: ``deadline`` has passed (the write-backs keep failing or hang).
        """
        self.start_all()
        with self.lock:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                last = next(reversed(self._errors.values()), None)
                raise StoreError(
                    f"cannot put runtime block {key!r} ({nbytes} bytes): {self.dirty_bytes} "
                    f"bytes of runtime blocks are still waiting to be written to store "
                    f"{self.store.spec}, and writeback_bytes={self.budget} leaves no room "
                    f"after l3_timeout={timeout} s"
                    + (f"; the last write-back failed with: {last}" if last is not None else "")
                    + ". The blocks stay in memory and are retried; free space in L3 or fix "
                    "its server, then flush()"
                )
            if self.room(key) < nbytes:
                self._written.wait(0.05 if left is None else min(0.05, left))

    def reset_counts(self) -> None:
        """Under the lock: zeroes the counters (`TieredCache.reset_counters`)."""
        for name in self.counts:
            self.counts[name] = 0

    def count_stall(self, seconds: float) -> None:
        """Under the lock: a put waited ``seconds`` for write-back room."""
        self.counts["stalls"] += 1
        self.counts["stall_seconds"] += seconds

    def flush(self, timeout: float | None) -> None:
        """Writes the latest version of every dirty block and waits until each is durable.

        Each block's write is tried at most twice within the call; a block whose second try
        failed raises its error once nothing else of the flush is in flight (the block stays in
        memory for the next flush).

        Raises:
          StoreError: a write-back failed twice.
          ConflictError: a shared store refused a write-back since this was last raised (the
            key holds other bytes; the cache serves those now).
          TimeoutError: write-backs were still pending after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        tries: collections.Counter[str] = collections.Counter()
        with self.lock:
            target = {key: version.seq for key, version in self._latest.items()}
        left = list(target)
        while True:
            with self.lock:
                left = [k for k in left if not self._reached(k, target[k])]
                if not left:
                    if self._conflicts:
                        conflict = self._conflicts[0]
                        self._conflicts.clear()
                        raise conflict
                    return
                retry, failed = [], []  # (one pass: a test of ``k in retry`` is O(n) per key)
                for k in left:
                    (retry if k not in self._errors or tries[k] < 2 else failed).append(k)
                if failed and not any(k in self._writing for k in left):
                    error = self._errors[failed[0]]
                    self._errors.clear()
                    raise error
                todo = self._claim(retry)
                for key, *_ in todo:
                    tries[key] += 1
                # The writes this flush waits for: their futures end after the state changed.
                pending = [f for f in (self._futures.get(k) for k in left) if f is not None]
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise TimeoutError(
                        f"{len(left)} write-backs of runtime blocks to store "
                        f"{self.store.spec} still pending after {timeout} s (for example "
                        f"{left[0]!r}); the blocks stay in memory, flush() again"
                    )
                if not pending:  # nothing in flight: blocks between tiers land first
                    self._written.wait(0.05 if wait is None else min(0.05, wait))
                    continue
            self._submit(todo)
            # Outside the lock, so that the writes can finish: one scan per batch of them, not
            # one per write (a scan is O(blocks left)).
            concurrent.futures.wait(pending, timeout=0.5 if wait is None else min(0.5, wait))

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Waits for the writes in flight; raises the first recorded error (data stays in memory).

        Raises:
          TimeoutError: writes were still in flight after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"{len(self._writing)} write-backs still pending after {timeout} s"
                    )
                self._written.wait(0.05 if left is None else min(0.05, left))
        self.check_for_errors()

    def check_for_errors(self) -> None:
        """Raises the first recorded write-back error, once."""
        with self.lock:
            errors = list(self._errors.values()) + self._conflicts
            self._errors.clear()
            self._conflicts.clear()
        if errors:
            raise errors[0]
