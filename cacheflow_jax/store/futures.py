"""Futures of the L3 store: one base class, one small subclass per kind of pending work.

Every store operation returns at once with a future (TensorStore's style); ``result(timeout)``
waits, and turns TensorStore's errors (a ``ValueError`` carrying an absl status) into cacheflow's:
`CorruptBlockError` for a failed checksum, `StoreError` for anything else, each naming the key, the
store and the file. ``TimeoutError`` passes through unchanged, so that callers can tell "not yet"
from "failed".
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from cacheflow_jax.core.blocks import (
    HOW_TO_REPAIR,
    CorruptBlockError,
    StoreError,
    StoreTimeoutError,
)
from cacheflow_jax.core.pytree import block_info, tree_map
from cacheflow_jax.store.runtime_format import decode_runtime

if TYPE_CHECKING:
    from cacheflow_jax.core.blocks import BlockInfo
    from cacheflow_jax.store.entry import Entry


# TensorStore reports a chunk it cannot decode (truncated, or damaged compressed data) as
# FAILED_PRECONDITION with the decoder's reason, and a value shorter than its recorded size (a
# truncated OCDBT data file) as OUT_OF_RANGE; both mean the stored bytes are damaged.
_UNDECODABLE = (
    "Not enough data",
    "compress",
    "decod",
    "Decod",
    "Invalid",
    "Truncated",
    "truncated",
    "corrupt",
)


def _corrupt_status(msg: str) -> bool:
    """True if a TensorStore error message says that stored bytes are damaged."""
    if "DATA_LOSS" in msg or "OUT_OF_RANGE" in msg:
        return True
    return "FAILED_PRECONDITION" in msg and any(m in msg for m in _UNDECODABLE)


def translate_error(err: BaseException, key: str, store: str, where: str) -> BaseException:
    """Maps a TensorStore error for block ``key`` to a cacheflow error."""
    msg = str(err)
    if _corrupt_status(msg):
        return CorruptBlockError(
            f"block {key!r} in store {store} is corrupt ({where}): {msg}. {HOW_TO_REPAIR}."
        )
    if "NOT_FOUND" in msg and "is missing" in msg:
        # The store wrote every chunk, so a missing one was lost (deleted, or never uploaded).
        return StoreError(
            f"block {key!r} in store {store} is missing its chunk ({where}): {msg}. The store "
            "wrote every chunk, so this one was deleted or never uploaded; re-write the store "
            "from its source (write_store(tree, path, overwrite=True)) or restore the file "
            "from a backup"
        )
    return StoreError(f"reading block {key!r} from store {store} ({where}) failed: {msg}")


class Deadline:
    """A point in time by which an L3 operation must finish (``seconds=None``: no deadline)."""

    __slots__ = ("seconds", "at")

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float | None:
        """Seconds left (0 once past), or None without a deadline."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())


def wait_for(future: Any, deadline: Deadline, what: str) -> Any:
    """Waits for ``future`` until ``deadline``; a timeout raises `StoreTimeoutError` on ``what``.

    Other errors pass through unchanged.
    """
    try:
        return future.result(timeout=deadline.left())
    except TimeoutError as err:
        if isinstance(err, StoreError):
            raise
        cancel = getattr(future, "cancel", None)
        if cancel is not None:
            cancel()
        raise StoreTimeoutError(
            f"{what}: no answer within {deadline.seconds} s; the store may be unreachable or "
            "stopped. Check the server or network, or raise the timeout (open_store(timeout=) "
            "or TieredCache(l3_timeout=))"
        ) from None


class StoreFuture:
    """A pending store operation on one block.

    Subclasses say how a finished operation's raw result becomes the block (``_value``) and how
    a failure is reported (``_error``). ``result()`` raises `CorruptBlockError` (a checksum
    failed), `StoreError` (any other failure) or ``TimeoutError`` (``timeout`` passed first).
    """

    __slots__ = ("_future", "_key", "_store", "_where")

    def __init__(self, future: Any, key: str, store: str, where: str) -> None:
        self._future = future  # a TensorStore or concurrent.futures future
        self._key = key
        self._store = store
        self._where = where

    def result(self, timeout: float | None = None) -> Any:
        """Waits for the operation and returns its result (see the subclass)."""
        try:
            raw = self._future.result(timeout=timeout)
        except (TimeoutError, StoreError):
            raise
        except Exception as err:
            raise self._error(err) from err
        return self._value(raw, timeout)

    def _value(self, raw: Any, timeout: float | None) -> Any:
        return raw

    def _error(self, err: BaseException) -> BaseException:
        return translate_error(err, self._key, self._store, self._where)

    def done(self) -> bool:
        """True once the operation finished (successfully or not)."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        """Calls ``fn(self)`` when the operation finishes (on a TensorStore or reader thread)."""
        self._future.add_done_callback(lambda _: fn(self))


class ChunkFuture(StoreFuture):
    """A chunk read through TensorStore's array driver; ``result()`` is the block's array."""

    __slots__ = ()


class VerifiedChunkFuture(StoreFuture):
    """A chunk read through TensorStore, checked against the store's chunk manifest."""

    __slots__ = ("_entry",)

    def __init__(self, future: Any, entry: Entry, store: str) -> None:
        super().__init__(future, entry.info.key, store, entry.where)
        self._entry = entry

    def _value(self, raw: Any, timeout: float | None) -> np.ndarray:
        from cacheflow_jax.store.manifest import chunk_crc32c

        entry = self._entry
        got = chunk_crc32c(raw, entry.chunk_shape)
        if got != entry.crc:
            if entry.covers == "block":
                # A checkpoint manifest (cacheflow verify): CRCs of the decoded chunks.
                why = (
                    "the checkpoint's chunk manifest (written by `cacheflow verify`) records "
                    f"0x{entry.crc:08x} for this chunk: its bytes changed after they were "
                    "recorded. Restore the checkpoint from a copy or save it again (then run "
                    "`cacheflow verify --update`)"
                )
            else:
                why = (
                    f"the store's chunk manifest records 0x{entry.crc:08x} for this chunk (a "
                    f"chunk file swapped or replaced by another). {HOW_TO_REPAIR}"
                )
            raise CorruptBlockError(
                f"block {self._key!r} in store {self._store} is corrupt ({self._where}): "
                f"DATA_LOSS: its bytes have crc32c 0x{got:08x}, but {why}."
            )
        return raw


class EntryReader(Protocol):
    """What a future that may fall back to TensorStore needs of the reads that started it (a
    `cacheflow_jax.store.reads.BlockReads`)."""

    @property
    def spec(self) -> str:
        """The store's path or URL, as used in error messages."""
        ...

    def read_ts(self, entry: Entry) -> StoreFuture:
        """Reads the block of ``entry`` through TensorStore's array driver."""
        ...


class FastChunkFuture(StoreFuture):
    """A fast-path chunk read (see ``fastread``); ``result()`` is the block's array.

    The chunk file is read and checked on a reader thread. A chunk without a file is handed to
    TensorStore by ``result()``, which decides what a missing chunk means for the store.
    """

    __slots__ = ("_owner", "_entry")

    def __init__(self, future: Any, owner: EntryReader, entry: Entry) -> None:
        super().__init__(future, entry.info.key, owner.spec, entry.where)
        self._owner = owner
        self._entry = entry

    def result(self, timeout: float | None = None) -> np.ndarray:
        """Waits for the read and returns the block (raises as `StoreFuture.result`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        value = self._future.result(timeout=timeout)  # TimeoutError, or the reader's error
        if value is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self._owner.read_ts(self._entry).result(timeout=left)
        return value


class RuntimeReadFuture(StoreFuture):
    """A runtime-block read; ``result()`` decodes and checks the block file.

    Args:
      future: the kvstore read.
      key, store, where: the block, its store and its file or object (for errors).
      expect: the block's metadata as the store announced it: a block of another shape or
        dtype is refused with ``changed(key, got, expect)``'s error.
      changed: see ``expect``.
      gone: the error of a block that is missing (default: a `StoreError`).
    """

    __slots__ = ("_expect", "_changed", "_gone")

    def __init__(
        self,
        future: Any,
        key: str,
        store: str,
        where: str,
        *,
        expect: BlockInfo | None = None,
        changed: Callable[[str, BlockInfo, BlockInfo], BaseException] | None = None,
        gone: Callable[[str], BaseException] | None = None,
    ) -> None:
        super().__init__(future, key, store, where)
        self._expect = expect
        self._changed = changed
        self._gone = gone

    def _value(self, raw: Any, timeout: float | None) -> Any:
        if raw.state != "value":
            if self._gone is not None:
                raise self._gone(self._key)
            raise StoreError(
                f"runtime block {self._key!r} in store {self._store} is listed but its file "
                f"{self._where} is missing; another process may have deleted it"
            )
        value = decode_runtime(raw.value, self._key, self._store, self._where)
        expect = self._expect
        if expect is not None and self._changed is not None:
            got = block_info(self._key, value)
            if (got.shape, got.dtype, got.leaves) != (expect.shape, expect.dtype, expect.leaves):
                raise self._changed(self._key, got, expect)
        return value


class WriteFuture(StoreFuture):
    """A runtime-block write; ``result()`` returns ``"written"`` once the block is durable, or
    ``"superseded"`` when the store already held a later version (nothing was written)."""

    __slots__ = ()

    def _value(self, raw: Any, timeout: float | None) -> str:
        return raw

    def _error(self, err: BaseException) -> BaseException:
        return write_error(err, self._key, self._store, self._where)


def write_error(err: BaseException, key: str, store: str, where: str) -> BaseException:
    """The error a failed runtime-block write reports (`WriteFuture.result` raises it): a
    `StoreError` or ``TimeoutError`` as it is, anything else of ``Exception`` as a `StoreError`
    naming the block."""
    if isinstance(err, (StoreError, TimeoutError)) or not isinstance(err, Exception):
        return err
    return StoreError(f"writing runtime block {key!r} to store {store} ({where}) failed: {err}")


class ReadyFuture(StoreFuture):
    """An operation that is already done: ``result()`` returns ``value`` (copied if asked)."""

    __slots__ = ("_ready", "_copy")

    def __init__(self, value: Any, *, copy: bool = False) -> None:
        super().__init__(None, "", "", "")
        self._ready = value
        self._copy = copy

    def result(self, timeout: float | None = None) -> Any:
        """Returns the value (a copy when made with ``copy=True``)."""
        return tree_map(np.copy, self._ready) if self._copy else self._ready

    def done(self) -> bool:
        """Always True."""
        return True

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        """Calls ``fn(self)`` now."""
        fn(self)


def wait_all(futures: Iterable[Any], what: str, deadline: Deadline | None = None) -> list[Any]:
    """Waits for every future (all issued already) and raises StoreError on the first error.

    With a ``deadline``, a future still pending at the deadline raises `StoreTimeoutError`.
    """
    deadline = deadline or Deadline(None)
    out = []
    for f in futures:
        try:
            out.append(wait_for(f, deadline, what))
        except StoreError:
            raise
        except Exception as err:
            raise StoreError(f"{what}: {err}") from err
    return out


_POOLS: dict[str, tuple[int, ThreadPoolExecutor]] = {}  # name -> (pid that made it, pool)
_POOLS_LOCK = threading.Lock()


def thread_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The process's thread pool called ``name`` (made on first use, and again after a fork,
    whose copy of a pool has no threads)."""
    entry = _POOLS.get(name)
    if entry is None or entry[0] != os.getpid():
        with _POOLS_LOCK:
            entry = _POOLS.get(name)
            if entry is None or entry[0] != os.getpid():
                pool = ThreadPoolExecutor(workers, thread_name_prefix=f"cacheflow-{name}")
                entry = _POOLS[name] = (os.getpid(), pool)
    return entry[1]


class WorkQueue:
    """Daemon threads that run handed-over calls, first come first served.

    `submit` is one put on a ``queue.SimpleQueue``: no future, no Python-level lock, so a
    serving step that hands work over allocates little and never waits on a lock a worker
    holds (``ThreadPoolExecutor.submit`` takes its semaphore's lock, which a worker between
    tasks may hold while it waits for the interpreter). A call records its own outcome; an
    error that escapes it is dropped, as a ``ThreadPoolExecutor.submit`` nobody waits on drops
    it. Pending calls are not run at interpreter exit: what must be durable is flushed first
    (`TieredCache.close`).
    """

    def __init__(self, name: str, workers: int) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(workers):
            threading.Thread(target=self._run, name=f"cacheflow-{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs ``fn(*args)`` on a worker."""
        self._queue.put((fn, args))

    def _run(self) -> None:
        get = self._queue.get
        while True:
            fn, args = get()
            try:
                fn(*args)
            except BaseException:  # noqa: S110  (recorded by the call itself, see above)
                pass
            del fn, args  # drop the references while waiting for the next call


_QUEUES: dict[str, tuple[int, WorkQueue]] = {}  # name -> (pid that made it, queue)


def work_queue(name: str, workers: int) -> WorkQueue:
    """The process's `WorkQueue` called ``name`` (made on first use, and again after a fork,
    whose copy has no threads)."""
    entry = _QUEUES.get(name)
    if entry is None or entry[0] != os.getpid():
        with _POOLS_LOCK:
            entry = _QUEUES.get(name)
            if entry is None or entry[0] != os.getpid():
                entry = _QUEUES[name] = (os.getpid(), WorkQueue(name, workers))
    return entry[1]
