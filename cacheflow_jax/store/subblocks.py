"""Sub-blocks: a stored chunk larger than the block size is served as runs of its leading rows.

Design note. Orbax writes one chunk per array by default, so an embedding table or an LM head is
one chunk, larger than a device budget can hold. A store lays a finer, regular block grid over such
an array: blocks of at most ``block_bytes``, `DEFAULT_BLOCK_BYTES` (4 MiB) unless given. The grid
follows from the array's shape, dtype and stored chunk shape and from that block size only, never
from a cache's budget, so a key names the same elements whatever the budget. Within one stored
chunk a block is ``(1, ..., 1, r, full, ..., full)``: ``r`` rows along the first axis that does not
fit whole (the leading axis for a table or a head), the same rule as `chunk_shape_for`. Where an
array has several stored chunks along an axis, ``r`` divides the chunk there, so no block straddles
two chunks. Keys keep the form ``"<array path>@<i,j,...>"``, with the index in the block grid, and
a block's `BlockInfo` origin and shape say exactly which elements it holds.

A sub-block is read in one of two ways:

* partial: an uncompressed chunk with no checksum (zarr v2 with no compressor and no filters in C
  order, or zarr3 with only the ``bytes`` codec) holds the block as one byte range of its file,
  so only that range is read (`PartialReadFuture`). TensorStore 0.1.86 itself reads such chunks
  whole; it reads parts only of sharded zarr3 arrays, whose inner chunks are already the store's
  chunks.
* whole chunk: otherwise (compressed, or covered by a checksum of the whole chunk) the chunk is
  read once, checked, and cut (`ChunkRead`). Sub-blocks of one chunk asked for together share
  the read, and the sub-blocks nobody asked for go to the store's sibling listeners (the cache
  offers them to L2 under its policy's admission) instead of being thrown away.

Every read is counted (`ReadCounters`): bytes read from L3 against bytes served, which is the
read amplification that ``stats()["l3"]`` reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from cacheflow_jax.core.blocks import StoreError
from cacheflow_jax.store.entry import Entry
from cacheflow_jax.store.fastread import FAST_DTYPES, zarr3_chunk_name, zarr3_codec
from cacheflow_jax.store.futures import EntryReader, StoreFuture, translate_error

# The block size of a store whose chunks nobody chose for caching (an orbax checkpoint, a zarr3
# store written by another tool): write_store's default chunk size. It is a constant, never a
# budget, so that a key names the same elements at every budget (docs/orbax.md, "Blocks and
# keys"); ``block_bytes=`` chooses another grid on purpose.
DEFAULT_BLOCK_BYTES = 4 * 2**20

# A sibling listener gets the sub-blocks of a whole-chunk read that nobody asked for, as
# read-only views of the chunk (copy what you keep), and returns the keys it kept.
SiblingListener = Callable[[Mapping[str, np.ndarray]], Sequence[str]]


def check_block_bytes(block_bytes: Any) -> int | None:
    """``block_bytes`` as an int, or None; ValueError unless None or a positive integer."""
    if block_bytes is None:
        return None
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int | np.integer):
        raise ValueError(f"block_bytes={block_bytes!r} must be a positive integer number of bytes")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes={block_bytes} must be > 0 (or None for whole chunks)")
    return int(block_bytes)


def sub_block_shape(
    chunk_shape: Sequence[int],
    itemsize: int,
    block_bytes: int,
    chunks_per_axis: Sequence[int],
) -> tuple[int, ...]:
    """The block shape for chunks of ``chunk_shape`` with blocks of at most ``block_bytes``.

    Trailing dimensions are kept whole while they fit; the first that does not is cut into runs
    of ``r`` rows and every dimension before it gets 1 (a block is then one byte range of a C
    order chunk). Where ``chunks_per_axis`` is above 1, ``r`` divides the chunk. A block never
    gets smaller than one element; a chunk that fits is returned as it is.

    Args:
      chunk_shape: the stored chunk's shape.
      itemsize: bytes per element.
      block_bytes: the largest block wanted, in bytes (> 0).
      chunks_per_axis: how many stored chunks the array has along each axis.

    >>> sub_block_shape((1000, 64), 4, 4096, (1, 1))
    (16, 64)
    >>> sub_block_shape((10, 64), 4, 1024, (3, 1))
    (2, 64)
    """
    chunk = tuple(int(c) for c in chunk_shape)
    if int(np.prod(chunk, dtype=np.int64)) * itemsize <= block_bytes:
        return chunk
    budget = max(1, block_bytes // max(1, itemsize))
    out = list(chunk)
    inner = 1
    for d in range(len(chunk) - 1, -1, -1):
        if inner * chunk[d] <= budget:
            inner *= chunk[d]
            continue
        rows = max(1, budget // inner)
        if chunks_per_axis[d] > 1:
            rows = max(r for r in range(1, rows + 1) if chunk[d] % r == 0)
        out[d] = rows
        for e in range(d):
            out[e] = 1
        break
    return tuple(out)


class ReadCounters:
    """What a store read from L3 and what it served; thread-safe (misses only, never hits)."""

    __slots__ = ("_lock", "_n")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = dict.fromkeys(
            (
                "bytes_read",
                "bytes_served",
                "blocks_served",
                "chunk_reads",
                "partial_reads",
                "siblings_offered",
                "siblings_kept",
                "siblings_kept_bytes",
            ),
            0,
        )

    def add(self, **counts: int) -> None:
        """Adds to the named counters."""
        with self._lock:
            for name, value in counts.items():
                self._n[name] += value

    def snapshot(self) -> dict[str, Any]:
        """The counters, and ``read_amplification``: bytes read from L3 per byte served.

        Bytes served are the blocks handed to readers plus the sibling sub-blocks a listener
        kept; a chunk read whole for one block and whose other rows were dropped counts them
        as read, not served.
        """
        with self._lock:
            out: dict[str, Any] = dict(self._n)
        served = out["bytes_served"] + out["siblings_kept_bytes"]
        out["read_amplification"] = out["bytes_read"] / served if served else 0.0
        return out


class ChunkRead:
    """One read of a whole stored chunk, shared by the sub-blocks asked for while it runs.

    The first sub-block to take its result hands the sub-blocks nobody asked for to the
    listeners (once); the chunk's buffer lives as long as a future of this read does.
    """

    __slots__ = ("future", "chunk", "lock", "requested", "offered", "_value", "_error")

    def __init__(self, future: StoreFuture, chunk: Entry) -> None:
        self.future = future  # yields the whole chunk (clipped at the array's edge), checked
        self.chunk = chunk
        self.lock = threading.Lock()
        self.requested: set[str] = set()
        self.offered = False
        self._value: np.ndarray | None = None
        self._error: BaseException | None = None

    def result(self, timeout: float | None) -> np.ndarray:
        """The chunk (raises the read's error, or ``TimeoutError``)."""
        if self._value is not None:
            return self._value
        if self._error is not None:
            raise self._error
        try:
            value = self.future.result(timeout=timeout)
        except TimeoutError as err:
            if isinstance(err, StoreError):
                self._error = err
            raise
        except BaseException as err:
            self._error = err
            raise
        value = np.asarray(value)
        value.flags.writeable = False
        self._value = value
        return value

    def done(self) -> bool:
        return self.future.done()


class SubBlockReader(EntryReader, Protocol):
    """What sub-block futures need of the reads that started them (`reads.BlockReads`)."""

    @property
    def counters(self) -> ReadCounters:
        """The store's read counters."""
        ...

    def offer_siblings(self, read: ChunkRead, chunk: np.ndarray) -> None:
        """Hands the sub-blocks of ``read`` nobody asked for to the sibling listeners."""
        ...


class SubBlockFuture(StoreFuture):
    """A sub-block cut from a whole-chunk read; ``result()`` is the block's array (a copy)."""

    __slots__ = ("_read", "_entry", "_owner")

    def __init__(self, read: ChunkRead, entry: Entry, owner: SubBlockReader) -> None:
        super().__init__(read.future, entry.info.key, owner.spec, entry.where)
        self._read = read
        self._entry = entry
        self._owner = owner

    def result(self, timeout: float | None = None) -> np.ndarray:
        """Waits for the chunk and returns this block (errors name this block's key)."""
        entry = self._entry
        try:
            chunk = self._read.result(timeout)
        except TimeoutError as err:
            if not isinstance(err, StoreError):
                raise
            raise type(err)(self._explain(err)) from err
        except StoreError as err:
            raise type(err)(self._explain(err)) from err
        except Exception as err:
            raise translate_error(err, entry.info.key, self._store, entry.where) from err
        block = chunk[entry.within].copy()
        self._owner.offer_siblings(self._read, chunk)
        return block

    def _explain(self, err: BaseException) -> str:
        info = self._entry.info
        rows = ", ".join(f"{s.start}:{s.stop}" for s in self._entry.within)
        return (
            f"block {info.key!r} (elements [{rows}] of stored chunk "
            f"{','.join(map(str, self._entry.chunk.index_in_chunks))}): {err}"
        )


class PartialReadFuture(StoreFuture):
    """A sub-block read as one byte range of an uncompressed chunk; ``result()`` decodes it."""

    __slots__ = ("_entry", "_owner", "_started")

    def __init__(self, future: Any, entry: Entry, owner: SubBlockReader) -> None:
        super().__init__(future, entry.info.key, owner.spec, entry.where)
        self._entry = entry
        self._owner = owner
        self._started = time.monotonic()

    def result(self, timeout: float | None = None) -> np.ndarray:
        """Waits for the byte range and returns the block.

        A chunk without a file is read through TensorStore, which applies the store's rule for
        missing chunks; a file too short for the range is a `CorruptBlockError` (truncated).
        """
        entry = self._entry
        part = entry.partial
        assert part is not None
        try:
            raw = self._future.result(timeout=timeout)
        except (TimeoutError, StoreError):
            raise
        except Exception as err:
            raise translate_error(err, entry.info.key, self._store, entry.where) from err
        if raw.state != "value":
            left = None
            if timeout is not None:
                left = max(0.0, timeout - (time.monotonic() - self._started))
            return self._owner.read_ts(entry).result(timeout=left)
        data = raw.value
        if len(data) != part.stop - part.start:
            raise translate_error(
                ValueError(
                    f"OUT_OF_RANGE: the chunk file ended within the block's bytes "
                    f"[{part.start}, {part.stop}) (got {len(data)} bytes): it is truncated"
                ),
                entry.info.key,
                self._store,
                entry.where,
            )
        self._owner.counters.add(bytes_read=len(data))
        arr = np.frombuffer(data, dtype=part.dtype).reshape(part.shape)
        if part.dtype.byteorder == ">":
            arr = arr.astype(part.dtype.newbyteorder("="))
        block = arr[part.clip]
        return np.array(block, dtype=entry.info.dtype, copy=True)


def raw_chunk_layout(
    meta: Mapping[str, Any], driver: str
) -> tuple[np.dtype, tuple[int, ...], Callable[[tuple[int, ...]], str]] | None:
    """(stored dtype, stored chunk shape, chunk key from grid index) of an array whose chunks
    are raw C-order bytes with no checksum, or None if a part of a chunk cannot be read alone.

    Raw: zarr v2 with no compressor, no filters and ``order: C``; zarr3 with a regular grid,
    exactly one ``bytes`` codec and no storage transformers.
    """
    try:
        if driver == "zarr":
            if meta.get("compressor") is not None or meta.get("filters"):
                return None
            if meta.get("order", "C") != "C":
                return None
            dtype = np.dtype(meta["dtype"])
            if dtype.fields is not None or dtype.kind in "OUSMV":
                return None
            chunks = tuple(int(c) for c in meta["chunks"])
            sep = meta.get("dimension_separator", ".")
            return dtype, chunks, (lambda idx: sep.join(map(str, idx)) or "0")
        if driver == "zarr3":
            if meta.get("storage_transformers"):
                return None
            grid = meta.get("chunk_grid") or {}
            if grid.get("name") != "regular":
                return None
            codecs = [zarr3_codec(c) for c in meta.get("codecs") or ()]
            if len(codecs) != 1 or codecs[0] is None or codecs[0][0] != "bytes":
                return None
            data_type = meta.get("data_type")
            if data_type not in FAST_DTYPES:
                return None
            dtype = np.dtype(data_type)
            endian = codecs[0][1].get("endian", "little")
            if dtype.itemsize > 1:
                dtype = dtype.newbyteorder("<" if endian == "little" else ">")
            chunks = tuple(int(c) for c in grid["configuration"]["chunk_shape"])
            name = zarr3_chunk_name(meta.get("chunk_key_encoding"))
            if name is None:
                return None
            return dtype, chunks, name
    except (KeyError, TypeError, ValueError):
        return None
    return None
