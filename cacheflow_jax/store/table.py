"""The block table: ``key -> Entry`` for every block of a store's arrays, built once on open.

`block_table` lays the block grid over each array of a `StoreParts`: one entry per stored chunk,
or, where a chunk is larger than the store's ``block_bytes``, one entry per sub-block (see
``subblocks``) pointing at an entry of its whole chunk. Each entry gets what its reads need: the
fast path's chunk file (local file stores only), the manifest's CRC-32C, and for a sub-block of a
raw chunk the byte range it is (`PartialRange`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from cacheflow_jax.core.blocks import ArrayInfo, BlockInfo, block_key
from cacheflow_jax.store.entry import Entry, FastArray, PartialRange
from cacheflow_jax.store.subblocks import sub_block_shape

if TYPE_CHECKING:
    import tensorstore as ts

    from cacheflow_jax.store.parts import StoreParts


def block_table(
    parts: StoreParts, block_bytes: int | None
) -> tuple[dict[str, Entry], dict[str, ArrayInfo]]:
    """The entries of every block of ``parts``' arrays by key, in array order, and the arrays
    as served (`ArrayInfo.chunk_shape` the block shape, ``stored_chunk_shape`` the chunk)."""
    # The fast path reads chunk files directly, so only stores on the file driver take it:
    # other kvstores hand bytes to Python through ts.KvStore.ReadResult.value, which copies
    # twice and is slower than TensorStore's own zarr decode (measured on memory://).
    spec = parts.kvstore_spec
    root = spec.get("path") if spec.get("driver") == "file" else None
    root = os.path.abspath(root) if root is not None else None  # a file store's directory
    fast_arrays = (parts.fast_arrays or {}) if root is not None else {}
    entries: dict[str, Entry] = {}
    arrays: dict[str, ArrayInfo] = {}
    for path, arr in parts.arrays.items():
        arrays[path] = _add_array(
            entries,
            path,
            arr,
            parts.handles[path],
            parts.chunk_where[path],
            (root, fast_arrays.get(path)),
            list((parts.chunk_crcs or {}).get(path) or ()),
            parts.crc_covers,
            (parts.raw_layouts or {}).get(path),
            block_bytes,
        )
    return entries, arrays


def _add_array(
    entries: dict[str, Entry],
    path: str,
    arr: ArrayInfo,
    handle: ts.TensorStore,
    chunk_where: Callable[[tuple[int, ...]], str],
    fast: tuple[str | None, FastArray | None],
    crcs: list[int],
    crc_covers: str,
    raw: Any,
    block_bytes: int | None,
) -> ArrayInfo:
    """Adds one array's blocks (sub-blocks of its chunks if they exceed the block size) to
    ``entries``; returns the array as served."""
    stored = arr.chunk_shape
    stored_grid = arr.grid_shape
    block = stored
    if block_bytes is not None and arr.shape:
        block = sub_block_shape(stored, arr.dtype.itemsize, block_bytes, stored_grid)
    served = ArrayInfo(
        path=path,
        shape=arr.shape,
        dtype=arr.dtype,
        chunk_shape=block,
        stored_chunk_shape=stored,
    )
    chunks: dict[tuple[int, ...], Entry] = {}
    for n, idx in enumerate(np.ndindex(*stored_grid)):
        entry = _chunk_entry(path, arr, stored, idx, handle, chunk_where, fast)
        entry.crc = crcs[n] if n < len(crcs) else None
        if crc_covers == "block":
            entry.chunk_shape = entry.info.shape
            entry.covers = "block"
        chunks[entry.info.index] = entry
    if block == stored:
        for entry in chunks.values():
            entries[entry.info.key] = entry
        return served
    for chunk in chunks.values():
        chunk.info = dataclasses.replace(
            chunk.info, key=f"{path} (stored chunk {','.join(map(str, chunk.info.index))})"
        )
    block_grid = tuple(-(-s // b) for s, b in zip(arr.shape, block, strict=True))
    for idx in np.ndindex(*block_grid):
        info = _block_info(path, arr, block, idx)
        key, origin, shape = info.key, info.origin, info.shape
        cidx = tuple(o // c for o, c in zip(origin, stored, strict=True))
        chunk = chunks[cidx]
        index = tuple(slice(o, o + s) for o, s in zip(origin, shape, strict=True))
        entry = entries[key] = Entry(info, handle, index, chunk.where)
        entry.chunk = chunk
        entry.index_in_chunks = cidx
        entry.within = tuple(
            slice(o - c * k, o - c * k + s)
            for o, c, k, s in zip(origin, stored, cidx, shape, strict=True)
        )
        chunk.subs.append(entry)
        if raw is not None and chunk.crc is None and fast[1] is None and info.nbytes:
            entry.partial = _partial_range(entry, raw, handle, stored, block)
    return served


def _chunk_entry(
    path: str,
    arr: ArrayInfo,
    chunk_shape: tuple[int, ...],
    idx: tuple[int, ...],
    handle: ts.TensorStore,
    chunk_where: Callable[[tuple[int, ...]], str],
    fast: tuple[str | None, FastArray | None],
) -> Entry:
    """The entry of one whole stored chunk (clipped at the array's edge); ``fast`` is (the
    store's local directory, the array's fast-path layout or None)."""
    info = _block_info(path, arr, chunk_shape, idx)
    index = tuple(slice(o, o + s) for o, s in zip(info.origin, info.shape, strict=True))
    entry = Entry(info, handle, index, chunk_where(info.index))
    entry.chunk_shape = chunk_shape
    root, layout = fast
    if layout is not None and info.nbytes > 0:
        assert root is not None
        entry.fast = layout
        entry.fast_key = os.path.join(root, path, layout.name(info.index))
        if info.shape != layout.chunk_shape:
            entry.clip = tuple(slice(0, n) for n in info.shape)
    return entry


def _partial_range(
    entry: Entry,
    raw: tuple[np.dtype, tuple[int, ...], Callable[[tuple[int, ...]], str]],
    handle: ts.TensorStore,
    stored: tuple[int, ...],
    block: tuple[int, ...],
) -> PartialRange | None:
    """Where a sub-block's bytes are in its raw chunk (one C-order range), or None."""
    dtype, chunks, name = raw
    if tuple(chunks) != tuple(stored):
        return None
    split = max(d for d in range(len(stored)) if block[d] < stored[d])
    item = dtype.itemsize
    strides = [int(np.prod(stored[d + 1 :], dtype=np.int64)) * item for d in range(len(stored))]
    start = sum(w.start * s for w, s in zip(entry.within[: split + 1], strides, strict=False))
    rows = entry.within[split].stop - entry.within[split].start
    shape = (1,) * split + (rows,) + tuple(stored[split + 1 :])
    clip = tuple(slice(0, n) for n in entry.info.shape)
    return PartialRange(
        handle.kvstore,
        name(entry.index_in_chunks),
        start,
        start + rows * strides[split],
        dtype,
        shape,
        clip,
    )


def _block_info(
    path: str, arr: ArrayInfo, block: tuple[int, ...], idx: tuple[int, ...]
) -> BlockInfo:
    """The block at grid index ``idx`` of ``arr`` cut in ``block``s (clipped at the edge)."""
    origin = tuple(i * b for i, b in zip(idx, block, strict=True))
    shape = tuple(min(b, s - o) for b, s, o in zip(block, arr.shape, origin, strict=True))
    return BlockInfo(
        key=block_key(path, idx),
        shape=shape,
        dtype=arr.dtype,
        nbytes=int(np.prod(shape, dtype=np.int64)) * arr.dtype.itemsize,
        array=path,
        index=tuple(int(i) for i in idx),
        origin=origin,
    )
