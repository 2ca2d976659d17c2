"""How a store reads the blocks of its table: one `BlockReads` per store.

A whole stored chunk is read through the fast path where its entry has one (``fastread``), else
through TensorStore's array driver (checked against the chunk manifest where there is one). A
sub-block is read as one byte range of its raw chunk (`PartialReadFuture`), or cut from one read of
its whole chunk, shared by the sub-blocks asked for while it runs (`ChunkRead`); the sub-blocks
nobody asked for go to the sibling listeners. Every read is counted (`ReadCounters`).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from cacheflow_jax.store.entry import Entry
from cacheflow_jax.store.fastread import file_pool, read_chunk_file
from cacheflow_jax.store.futures import (
    ChunkFuture,
    FastChunkFuture,
    StoreFuture,
    VerifiedChunkFuture,
)
from cacheflow_jax.store.subblocks import (
    ChunkRead,
    PartialReadFuture,
    ReadCounters,
    SiblingListener,
    SubBlockFuture,
)


class BlockReads:
    """The reads of one store's blocks: read counters, sibling listeners, shared chunk reads.

    Thread-safe: the shared reads and the listeners are kept under one lock.
    """

    def __init__(self, label: str) -> None:
        """``label``: the store's path or URL, as used in error messages."""
        self._label = label
        self.counters = ReadCounters()
        self._listeners: list[Any] = []
        self._chunk_reads: dict[int, ChunkRead] = {}
        self._lock = threading.Lock()

    @property
    def spec(self) -> str:
        """The store's path or URL, as used in error messages."""
        return self._label

    def read(self, entry: Entry) -> StoreFuture:
        """Starts reading the block of ``entry`` (see `TensorStoreStore.read`)."""
        if entry.chunk is not None:
            if entry.partial is None:
                return self.read_subs([entry])[0]
            return self.read_partial(entry)
        self.counters.add(bytes_served=entry.info.nbytes, blocks_served=1)
        return self.read_whole(entry)

    def read_whole(self, entry: Entry) -> StoreFuture:
        """Reads a whole stored chunk (the fast path where it applies)."""
        stored = int(np.prod(entry.chunk_shape, dtype=np.int64)) * entry.info.dtype.itemsize
        self.counters.add(bytes_read=stored if entry.info.nbytes else 0)
        if entry.fast_key is not None:
            future = file_pool().submit(read_chunk_file, entry, self._label)
            return FastChunkFuture(future, self, entry)
        return self.read_ts(entry)

    def read_ts(self, entry: Entry) -> ChunkFuture:
        """Reads a chunk block through TensorStore's array driver."""
        view = entry.view
        if view is None:
            # Indexing costs more than issuing the read; keep the view of blocks once read.
            view = entry.view = entry.handle[entry.index]
        if entry.crc is not None:
            return VerifiedChunkFuture(view.read(), entry, self._label)
        return ChunkFuture(view.read(), entry.info.key, self._label, entry.where)

    def read_subs(self, entries: Sequence[Entry]) -> list[StoreFuture]:
        """Reads sub-blocks cut from whole chunks: one read per chunk, shared while it runs."""
        out = []
        started: list[ChunkRead] = []
        batch: dict[int, ChunkRead] = {}  # one read per chunk in this call, done or not
        with self._lock:
            for entry in entries:
                chunk = entry.chunk
                assert chunk is not None
                read = batch.get(id(chunk)) or self._chunk_reads.get(id(chunk))
                if read is None or (id(chunk) not in batch and read.done()):
                    # Issuing a read does not wait for it, so it may happen under the lock.
                    read = ChunkRead(self.read_whole(chunk), chunk)
                    self._chunk_reads[id(chunk)] = read
                    started.append(read)
                batch[id(chunk)] = read
                with read.lock:
                    read.requested.add(entry.info.key)
                out.append((read, entry))
        self.counters.add(chunk_reads=len(started))
        for read in started:
            read.future.add_done_callback(lambda _f, read=read: self._forget(read))
        self.counters.add(
            bytes_served=sum(e.info.nbytes for e in entries), blocks_served=len(entries)
        )
        return [SubBlockFuture(read, entry, self) for read, entry in out]

    def _forget(self, read: ChunkRead) -> None:
        """Drops a finished chunk read from the table of reads to share (its buffer with it)."""
        with self._lock:
            if self._chunk_reads.get(id(read.chunk)) is read:
                del self._chunk_reads[id(read.chunk)]

    def read_partial(self, entry: Entry) -> StoreFuture:
        """Reads a sub-block as one byte range of its raw chunk."""
        part = entry.partial
        assert part is not None
        self.counters.add(
            bytes_served=entry.info.nbytes,
            blocks_served=1,
            partial_reads=1,
        )
        future = part.kvstore.read(part.key, byte_range=slice(part.start, part.stop))
        return PartialReadFuture(future, entry, self)

    def add_listener(self, listener: SiblingListener) -> None:
        """Registers a sibling listener (see `TensorStoreStore.add_sibling_listener`); a bound
        method is held weakly."""
        ref = weakref.WeakMethod(listener) if inspect.ismethod(listener) else (lambda: listener)
        with self._lock:
            self._listeners.append(ref)

    def offer_siblings(self, read: ChunkRead, chunk: np.ndarray) -> None:
        """Hands the sub-blocks of ``read`` nobody asked for to the listeners (once per read)."""
        with read.lock:
            if read.offered:
                return
            read.offered = True
            requested = set(read.requested)
        with self._lock:
            listeners = [fn for fn in (ref() for ref in self._listeners) if fn is not None]
        if not listeners:
            return
        subs = {e.info.key: e for e in read.chunk.subs if e.info.key not in requested}
        siblings = {key: chunk[e.within] for key, e in subs.items()}
        if not siblings:
            return
        self.counters.add(siblings_offered=len(siblings))
        for listener in listeners:
            kept = [k for k in listener(siblings) if k in siblings]
            self.counters.add(
                siblings_kept=len(kept),
                siblings_kept_bytes=sum(subs[k].info.nbytes for k in kept),
            )
