"""The block table's entries: one per block, and the chunk layouts an entry points at.

The bottom of the store package: it imports no other store module, so every module may name an
`Entry` in its annotations without an import cycle.

* `Entry`: one block of a stored array (a whole stored chunk or a sub-block cut from one);
* `FastArray`: how the chunk files of one zarr3 array (codecs ``bytes`` + ``crc32c``) are laid
  out, for the fast read path (``fastread``);
* `PartialRange`: where a sub-block's bytes are in its raw chunk's file (``subblocks``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import tensorstore as ts

    from cacheflow_jax.core.blocks import BlockInfo


class Entry:
    """One block: its info, the open array handle and its index expression; for the fast path
    also its chunk file's path, the chunk layout and the edge clipping; the chunk's CRC-32C from
    a chunk manifest, if there is one; and, for a sub-block, the stored chunk it is cut from."""

    __slots__ = (
        "info", "handle", "index", "where", "view", "fast", "fast_key", "clip", "crc",
        "chunk_shape", "covers", "chunk", "within", "partial", "subs", "index_in_chunks",
    )  # fmt: skip

    def __init__(self, info: BlockInfo, handle: ts.TensorStore, index: tuple, where: str) -> None:
        self.info = info
        self.handle = handle
        self.index = index
        self.where = where
        self.view: ts.TensorStore | None = None  # handle[index], made on first read
        self.fast: FastArray | None = None
        self.fast_key: str | None = None  # the chunk file's absolute path
        self.clip: tuple[slice, ...] | None = None  # the block within its chunk, if smaller
        self.crc: int | None = None  # the manifest's CRC-32C of the chunk
        # The shape the manifest's CRC covers: the full chunk (write_store's manifests, edge
        # chunks padded with the fill value) or the block itself (checkpoint manifests).
        self.chunk_shape: tuple[int, ...] = info.shape
        self.covers = "chunk"  # what the manifest's CRC covers: "chunk", or "block" (decoded)
        self.chunk: Entry | None = None  # a sub-block's whole stored chunk
        self.within: tuple[slice, ...] = ()  # a sub-block's elements within its chunk
        self.partial: PartialRange | None = None  # a sub-block readable as one byte range
        self.subs: list[Entry] = []  # a whole chunk's sub-blocks
        self.index_in_chunks: tuple[int, ...] = info.index  # the stored chunk's grid index


class FastArray:
    """How the chunk files of one zarr3 array (codecs bytes + crc32c) are laid out."""

    __slots__ = ("dtype", "chunk_shape", "count", "nbytes", "name")

    def __init__(
        self, dtype: np.dtype, chunk_shape: tuple[int, ...], name: Callable[[tuple[int, ...]], str]
    ) -> None:
        self.dtype = dtype
        self.chunk_shape = chunk_shape
        self.count = int(np.prod(chunk_shape, dtype=np.int64))
        self.nbytes = self.count * dtype.itemsize  # payload of every chunk file, edge ones too
        self.name = name  # grid index -> chunk key under the array's directory


class PartialRange:
    """Where a sub-block's bytes are in its chunk's file: one contiguous range."""

    __slots__ = ("kvstore", "key", "start", "stop", "dtype", "shape", "clip")

    def __init__(
        self,
        kvstore: Any,
        key: str,
        start: int,
        stop: int,
        dtype: np.dtype,
        shape: tuple[int, ...],
        clip: tuple[slice, ...],
    ) -> None:
        self.kvstore = kvstore  # the array's kvstore (TensorStore's ``handle.kvstore``)
        self.key = key  # the chunk's key under it
        self.start, self.stop = start, stop
        self.dtype = dtype  # as stored (byte order included)
        self.shape = shape  # the rows read, at the stored chunk's full trailing extent
        self.clip = clip  # the block within those rows (an edge chunk is stored padded)
