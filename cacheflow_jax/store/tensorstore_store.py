"""The L3 store: TensorStore arrays (zarr3 stores and orbax checkpoints) read block by block.

Design note. A block is one stored chunk of one array, or, for a chunk larger than the store's
``block_bytes``, a run of its leading rows (a sub-block, see ``_subblocks``). The store is opened
once: it lists the arrays, opens every array handle concurrently and builds a
``key -> entry`` table (info, handle, slices, chunk file), so ``info`` is a dict lookup and
``read`` is one indexing of an open handle plus ``.read()``. Nothing is cached here: L2 is the
host cache, so TensorStore's ``cache_pool`` is set to 0 bytes (see ``_locations._CONTEXT_SPEC``).

The store is split by concern:

* ``_locations``: paths, URLs and kvstore specs, and the TensorStore context;
* ``_futures``: the futures every operation returns (one base class);
* ``_fastread``: the fast read path for zarr3 chunk files with a crc32c codec;
* ``_subblocks``: sub-blocks of large chunks, partial and shared chunk reads, read counters;
* ``_runtime_blocks`` and ``_runtime_store``: runtime blocks (KV blocks), their file format and
  the writable location they go to;
* ``_manifest``: chunk manifests (CRC-32C of every chunk);
* ``_orbax_open``: opening an orbax checkpoint in place, ``CheckpointManager`` steps;
* this module: the block table (`TensorStoreStore`), opening a store, `write_store`.

What :func:`open_store` understands:

* a cacheflow store: zarr3 arrays under a root (written by :func:`write_store`, or any zarr3
  hierarchy); the array path is the array's directory relative to the root, ``/``-separated;
* an orbax checkpoint (an item directory holding ``_METADATA`` / ``manifest.ocdbt``, a
  ``CheckpointManager`` step directory holding one item, or the manager's root, whose latest
  step is opened), read in place through the ``ocdbt`` kvstore; the array path is the orbax tree
  path joined with ``/`` (``layers/0/w``);
* runtime blocks (keys without ``@``, e.g. KV blocks) written with :meth:`TensorStoreStore.write`
  under ``_runtime/`` of the store's runtime location: the store itself for a cacheflow store, a
  separate one for a checkpoint, which is never written (``_runtime_store``).

:meth:`TensorStoreStore.tree` returns the stored pytree's skeleton (nested dicts and lists whose
leaves are array paths), shaped like ``ocp.StandardCheckpointer().restore(path)`` for orbax
checkpoints and like the tree given to :func:`write_store` for cacheflow stores.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import shutil
import threading
import types
import uuid
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import tensorstore as ts

from cacheflow_jax.core.blocks import (
    HOW_TO_REPAIR,
    KEY_SEPARATOR,
    ArrayInfo,
    BlockInfo,
    StoreError,
    block_key,
)
from cacheflow_jax.store.fastread import (
    _fast_layout,
    _FastArray,
    _file_pool,
    _read_chunk_file,
    _zarr3_chunk_where,
)
from cacheflow_jax.store.futures import (
    ChunkFuture,
    Deadline,
    FastChunkFuture,
    StoreFuture,
    VerifiedChunkFuture,
    WriteFuture,
    _result,
    _wait_all,
)
from cacheflow_jax.store.locations import (
    _CONTEXT,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    _join,
    _list,
    _location,
    _open_kvstore,
    _resolve,
    store_context,
)
from cacheflow_jax.store.manifest import (
    MANIFEST_NAME,
    array_crcs,
    chunk_crc32c,
    decode_checkpoint_manifest,
    decode_manifest,
    encode_manifest,
)
from cacheflow_jax.store.orbax_source import (
    ORBAX_MARKERS,
    STEP_MARKER,
    _open_orbax,
    checkpoint_fingerprint,
    find_steps,
    manifest_label,
    manifest_location,
    parent_location,
)
from cacheflow_jax.store.runtime_format import _RUNTIME_PREFIX, Version, _numeric
from cacheflow_jax.store.runtime_area import (
    RuntimeArea,
    clean_local,
    default_runtime_dir,
    runtime_keys,
)
from cacheflow_jax.store.subblocks import (
    ChunkRead,
    PartialRange,
    PartialReadFuture,
    ReadCounters,
    SiblingListener,
    SubBlockFuture,
    raw_chunk_layout,
    sub_block_shape,
)

if TYPE_CHECKING:
    from cacheflow_jax.core.blocks import KeyKind

__all__ = ["TensorStoreStore", "chunk_shape_for", "open_store", "write_store"]

_CODECS: list[dict[str, Any]] = [
    {"name": "bytes", "configuration": {"endian": "little"}},
    {"name": "crc32c"},
]
_ATTR = "cacheflow"

_HOW_TO_CREATE = (
    "Create a store with cacheflow_jax.write_store(tree, path) or `cacheflow demo`, or point at "
    "an orbax checkpoint directory"
)
_HOW_TO_LIST = "list the store's keys with store.keys() or `cacheflow inspect <store>`"


class _Entry:
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
        self.fast: _FastArray | None = None
        self.fast_key: str | None = None  # the chunk file's absolute path
        self.clip: tuple[slice, ...] | None = None  # the block within its chunk, if smaller
        self.crc: int | None = None  # the manifest's CRC-32C of the chunk
        # The shape the manifest's CRC covers: the full chunk (write_store's manifests, edge
        # chunks padded with the fill value) or the block itself (checkpoint manifests).
        self.chunk_shape: tuple[int, ...] = info.shape
        self.covers = "chunk"  # what the manifest's CRC covers: "chunk", or "block" (decoded)
        self.chunk: _Entry | None = None  # a sub-block's whole stored chunk
        self.within: tuple[slice, ...] = ()  # a sub-block's elements within its chunk
        self.partial: PartialRange | None = None  # a sub-block readable as one byte range
        self.subs: list[_Entry] = []  # a whole chunk's sub-blocks
        self.index_in_chunks: tuple[int, ...] = info.index  # the stored chunk's grid index


class TensorStoreStore:
    """The L3 store over TensorStore: blocks of zarr3 / orbax arrays plus runtime blocks.

    Build one with :func:`open_store` or :func:`write_store`. Thread-safe: reads touch only
    immutable tables; runtime writes update the runtime table under a lock.
    """

    def __init__(
        self,
        *,
        label: str,
        kvstore: ts.KvStore,
        kvstore_spec: Mapping[str, Any],
        arrays: Mapping[str, ArrayInfo],
        handles: Mapping[str, ts.TensorStore],
        chunk_where: Mapping[str, Callable[[tuple[int, ...]], str]],
        tree_paths: Mapping[str, tuple[KeyKind, ...]],
        empty_nodes: Mapping[tuple[KeyKind, ...], Any],
        value_types: Mapping[str, str],
        runtime: RuntimeArea,
        source: str,
        fast_arrays: Mapping[str, _FastArray] | None = None,
        chunk_crcs: Mapping[str, Sequence[int]] | None = None,
        crc_covers: str = "chunk",
        raw_layouts: Mapping[str, Any] | None = None,
        context: ts.Context | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        block_bytes: int | None = None,
        writer_chose_chunks: bool = False,
        steps: Sequence[int] = (),
        step: int | None = None,
        manifest: str | None = None,
        manifest_at: tuple[dict[str, Any], str, str] | None = None,
        checkpoint_item: tuple[str, bytes] | None = None,
    ) -> None:
        """Builds the block table; use :func:`open_store` instead of calling this.

        ``fast_arrays`` names the arrays whose chunk files are read directly (see :meth:`read`);
        ``chunk_crcs`` is a chunk manifest (see ``_manifest``), checked on every read, whose CRCs
        cover each full chunk (``crc_covers="chunk"``) or each chunk clipped at the array's edge
        (``"block"``). ``raw_layouts`` names arrays whose chunks are raw bytes (sub-blocks are
        then read as byte ranges). ``timeout`` bounds the store's own blocking calls.
        """
        self._parts = {k: v for k, v in locals().items() if k not in ("self", "block_bytes")}
        self._label = label
        self._context = context or _CONTEXT
        self._timeout = timeout
        self._kv = kvstore
        self._kv_spec = dict(kvstore_spec)
        self._handles = dict(handles)
        self._tree_paths = dict(tree_paths)
        self._empty_nodes = dict(empty_nodes)
        self._value_types = dict(value_types)
        self._source = source
        self._rt = runtime
        self._block_bytes = block_bytes
        self._writer_chose_chunks = writer_chose_chunks
        self._steps = tuple(steps)
        self._step = step
        self._manifest = manifest
        self._manifest_at = manifest_at
        self._checkpoint_item = checkpoint_item  # (item prefix, its _METADATA bytes)
        self._counters = ReadCounters()
        self._listeners: list[Any] = []
        self._chunk_reads: dict[int, ChunkRead] = {}
        self._reads_lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._arrays: dict[str, ArrayInfo] = {}
        # The fast path reads chunk files directly, so only stores on the file driver take it:
        # other kvstores hand bytes to Python through ts.KvStore.ReadResult.value, which copies
        # twice and is slower than TensorStore's own zarr decode (measured on memory://).
        root = self._kv_spec.get("path") if self._kv_spec.get("driver") == "file" else None
        root = os.path.abspath(root) if root is not None else None
        self._root = root  # the local directory of a file store, else None
        fast_arrays = (fast_arrays or {}) if root is not None else {}
        for path, arr in arrays.items():
            self._add_array(
                path,
                arr,
                chunk_where[path],
                fast_arrays.get(path),
                list((chunk_crcs or {}).get(path) or ()),
                crc_covers,
                (raw_layouts or {}).get(path),
            )
        self._chunk_keys = tuple(self._entries)
        self._keys_cache: tuple[int, tuple[str, ...]] | None = None

    def _add_array(
        self,
        path: str,
        arr: ArrayInfo,
        chunk_where: Callable[[tuple[int, ...]], str],
        fast: _FastArray | None,
        crcs: list[int],
        crc_covers: str,
        raw: Any,
    ) -> None:
        """Adds one array's blocks (sub-blocks of its chunks if they exceed the block size)."""
        handle = self._handles[path]
        stored = arr.chunk_shape
        stored_grid = arr.grid_shape
        block = stored
        if self._block_bytes is not None and arr.shape:
            block = sub_block_shape(stored, arr.dtype.itemsize, self._block_bytes, stored_grid)
        self._arrays[path] = ArrayInfo(
            path=path,
            shape=arr.shape,
            dtype=arr.dtype,
            chunk_shape=block,
            stored_chunk_shape=stored,
        )
        chunks: dict[tuple[int, ...], _Entry] = {}
        for n, idx in enumerate(np.ndindex(*stored_grid)):
            entry = self._make_entry(path, arr, stored, idx, handle, chunk_where, fast)
            entry.crc = crcs[n] if n < len(crcs) else None
            if crc_covers == "block":
                entry.chunk_shape = entry.info.shape
                entry.covers = "block"
            chunks[entry.info.index] = entry
        if block == stored:
            for entry in chunks.values():
                self._entries[entry.info.key] = entry
            return
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
            entry = self._entries[key] = _Entry(info, handle, index, chunk.where)
            entry.chunk = chunk
            entry.index_in_chunks = cidx
            entry.within = tuple(
                slice(o - c * k, o - c * k + s)
                for o, c, k, s in zip(origin, stored, cidx, shape, strict=True)
            )
            chunk.subs.append(entry)
            if raw is not None and chunk.crc is None and fast is None and info.nbytes:
                entry.partial = _partial_range(entry, raw, handle, stored, block)

    def _make_entry(
        self,
        path: str,
        arr: ArrayInfo,
        chunk_shape: tuple[int, ...],
        idx: tuple[int, ...],
        handle: ts.TensorStore,
        chunk_where: Callable[[tuple[int, ...]], str],
        fast: _FastArray | None,
    ) -> _Entry:
        """The entry of one whole stored chunk (clipped at the array's edge)."""
        info = _block_info(path, arr, chunk_shape, idx)
        index = tuple(slice(o, o + s) for o, s in zip(info.origin, info.shape, strict=True))
        entry = _Entry(info, handle, index, chunk_where(info.index))
        entry.chunk_shape = chunk_shape
        if fast is not None and info.nbytes > 0:
            entry.fast = fast
            entry.fast_key = os.path.join(self._root, path, fast.name(info.index))
            if info.shape != fast.chunk_shape:
                entry.clip = tuple(slice(0, n) for n in info.shape)
        return entry

    # ---- Store protocol

    @property
    def spec(self) -> str:
        """The store's path or URL, as used in error messages."""
        return self._label

    def arrays(self) -> Mapping[str, ArrayInfo]:
        """The stored arrays by path (runtime blocks are not arrays).

        Each `ArrayInfo`'s ``chunk_shape`` is the block shape; ``stored_chunk_shape`` is the
        chunk as stored (larger when the store serves sub-blocks, see ``block_bytes``).
        """
        return types.MappingProxyType(self._arrays)

    def info(self, key: str) -> BlockInfo:
        """The block's metadata, without reading its data.

        Args:
          key: a block key ``"<array path>@<i,j,...>"`` or a runtime block key.

        Returns:
          The block's ``BlockInfo`` (shape clipped at the array edge, origin in elements).

        Raises:
          KeyError: no such block in this store.
          CorruptBlockError: a runtime block's header is damaged.
        """
        entry = self._entries.get(key)
        if entry is not None:
            return entry.info
        info = self._rt.info(key)
        if info is None:
            raise self._missing(key)
        return info

    def holds(self, key: str) -> bool:
        """Whether there is a block ``key``: a chunk, or a runtime block listed on open or
        written since (no I/O)."""
        return key in self._entries or key in self._rt

    def keys(self) -> Sequence[str]:
        """Every block key: blocks of stored arrays in array order, then runtime blocks."""
        cached = self._keys_cache
        version = self._rt.version
        if cached is None or cached[0] != version:
            cached = self._keys_cache = (version, self._chunk_keys + self._rt.keys())
        return cached[1]

    def read(self, key: str) -> StoreFuture:
        """Starts reading one block.

        Chunks of zarr3 arrays on local disk whose codecs are exactly ``bytes`` (little endian)
        + ``crc32c`` (every array :func:`write_store` writes) take a fast path: the chunk file
        is read whole into an aligned buffer by a reader thread, its CRC32C is checked there
        (google_crc32c) and the block is a view of that buffer, so no decode copy is made.
        Everything else (orbax checkpoints, other codecs, other kvstores, missing chunk files)
        is read by TensorStore's zarr driver. A sub-block (see ``block_bytes``) is read as one
        byte range where its chunk is raw bytes without a checksum, and otherwise cut from one
        read of its whole chunk (shared with the other sub-blocks asked for meanwhile; the rest
        go to the sibling listeners, see `add_sibling_listener`).

        Args:
          key: a key from :meth:`keys`.

        Returns:
          A future whose ``result()`` is a numpy array of ``info(key).shape`` and dtype, bitwise
          equal to what was written. It may be read-only (a fast-path full chunk).

        Raises:
          KeyError: no such block (raised now, not by ``result()``).
        """
        entry = self._entries.get(key)
        if entry is None:
            if key not in self._rt:
                raise self._missing(key)
            return self._rt.read(key)
        if entry.chunk is not None:
            if entry.partial is None:
                return self._read_subs([entry])[0]
            return self._read_partial(entry)
        self._counters.add(bytes_served=entry.info.nbytes, blocks_served=1)
        return self._read_whole(entry)

    def read_many(self, keys: Sequence[str]) -> list[StoreFuture]:
        """Starts reading many blocks; every read is issued before any is waited on.

        Sub-blocks of one stored chunk share one read of it.

        Args:
          keys: keys from :meth:`keys`.

        Returns:
          One future per key, in order.

        Raises:
          KeyError: a key is unknown (checked before any read is issued).
        """
        entries = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None and key not in self._rt:
                raise self._missing(key)
            entries.append(entry)
        shared = [e for e in entries if e is not None and e.chunk is not None and not e.partial]
        futures = dict(zip((e.info.key for e in shared), self._read_subs(shared)))
        return [
            futures[key] if key in futures else self.read(key)
            for key, entry in zip(keys, entries, strict=True)
        ]

    def write(
        self, key: str, value: np.ndarray | jax.Array, *, version: Version | None = None
    ) -> WriteFuture:
        """Starts writing a runtime block (for example a KV block) under ``_runtime/``.

        Runtime blocks go to the store's runtime location (`runtime_spec`): the store itself
        for a store written by `write_store`, a separate location for an orbax checkpoint,
        which is never written. After this returns, ``info(key)``, ``read(key)`` and ``keys()``
        see the block. The file is replaced atomically, so a crash leaves either the old block
        or the new one: on local disk the block goes to a temporary file that is synced and then
        renamed over the old one; on an object store it is one PUT. The write counts as durable
        only once the block has been read back from the store and found byte-identical.

        Args:
          key: a non-empty key without ``@`` (chunk keys are read-only); see
            `check_runtime_key`.
          value: the block; copied before this returns, so the caller may reuse the buffer.
          version: the write's place in its writer's order (`next_version`); the store then
            refuses to publish it over a later version of the same writer (compare-and-publish),
            so a write-back still in flight never replaces a newer one. None: always publish.

        Returns:
          A future whose ``result()`` returns ``"written"`` once the block is durable, or
          ``"superseded"`` when a later version was already stored (nothing was written), and
          raises `StoreError` if it could not be written or read back.

        Raises:
          TypeError: ``key`` is not a str.
          ValueError: ``key`` cannot name a runtime block, ``value`` is not a numeric array,
            or the store is read-only.
        """
        return self._rt.write(key, value, version=version)

    # ---- Beyond the protocol

    @property
    def kvstore_spec(self) -> dict[str, Any]:
        """The TensorStore kvstore spec of the store's root."""
        return dict(self._kv_spec)

    @property
    def source(self) -> str:
        """What the store reads: ``"cacheflow"`` (zarr3 arrays) or ``"orbax"`` (a checkpoint)."""
        return self._source

    @property
    def runtime_spec(self) -> str:
        """Where runtime blocks are written (see `write`)."""
        return self._rt.label

    @property
    def block_bytes(self) -> int | None:
        """The block size: chunks larger than this are served as sub-blocks (None: never)."""
        return self._block_bytes

    @property
    def writer_chose_chunks(self) -> bool:
        """True for stores written by `write_store`, whose ``chunk_bytes`` set the blocks."""
        return self._writer_chose_chunks

    @property
    def step(self) -> int | None:
        """The step opened, when the store is a ``CheckpointManager`` root or step (else None)."""
        return self._step

    @property
    def steps(self) -> tuple[int, ...]:
        """Every step of the ``CheckpointManager`` root opened, ascending (else empty)."""
        return self._steps

    @property
    def manifest(self) -> str | None:
        """The chunk manifest checked on every read (its location), or None."""
        return self._manifest

    @property
    def manifest_location(self) -> tuple[dict[str, Any], str, str] | None:
        """Where ``cacheflow verify`` keeps an orbax checkpoint's chunk manifest: (kvstore spec
        of the directory beside the checkpoint, key, readable location); None otherwise."""
        return self._manifest_at

    def checkpoint_fingerprint(self) -> str | None:
        """The fingerprint a chunk manifest of this orbax checkpoint records (None otherwise).

        Raises:
          StoreError: the checkpoint's ``manifest.ocdbt`` cannot be read.
        """
        if self._checkpoint_item is None:
            return None
        item, metadata_raw = self._checkpoint_item
        return checkpoint_fingerprint(self._kv, item, metadata_raw, Deadline(self._timeout))

    def with_block_bytes(self, block_bytes: int | None) -> TensorStoreStore:
        """The same store with another block size: a view sharing handles and runtime blocks.

        Args:
          block_bytes: chunks larger than this many bytes are served as sub-blocks along their
            leading axis (see ``_subblocks``); None serves every chunk whole.

        Returns:
          ``self`` if the block size is the same, else a new store over the same data.

        Raises:
          ValueError: ``block_bytes`` is not a positive integer.
        """
        block_bytes = check_block_bytes(block_bytes)
        if block_bytes == self._block_bytes:
            return self
        parts = dict(self._parts)
        parts["arrays"] = {
            p: dataclasses.replace(a, chunk_shape=a.stored_chunks, stored_chunk_shape=None)
            for p, a in self._arrays.items()
        }
        return TensorStoreStore(block_bytes=block_bytes, **parts)

    def add_sibling_listener(self, listener: SiblingListener) -> None:
        """Registers a listener for sub-blocks read along with the ones asked for.

        Where a sub-block's chunk must be read whole, the listener gets the chunk's other
        sub-blocks (key -> read-only view; copy what you keep) once per read, on the thread
        that takes the first result, and returns the keys it kept (counted in `read_stats`).
        A bound method is held weakly, so a cache that goes away is dropped.
        """
        ref = weakref.WeakMethod(listener) if inspect.ismethod(listener) else (lambda: listener)
        with self._reads_lock:
            self._listeners.append(ref)

    def read_stats(self) -> dict[str, Any]:
        """What the store read from L3 and served (see `ReadCounters.snapshot`).

        ``bytes_read`` counts chunk data as stored before compression (a whole chunk read
        through TensorStore counts its decoded size; a fast-path file its size; a partial read
        its byte range).
        """
        return self._counters.snapshot()

    def handle(self, path: str) -> ts.TensorStore:
        """The open TensorStore handle of array ``path`` (for partial reads across chunks).

        Raises:
          KeyError: no array ``path`` in this store.
        """
        try:
            return self._handles[path]
        except KeyError:
            raise KeyError(
                f"no array {path!r} in store {self._label}; arrays: {sorted(self._arrays)[:10]}"
            ) from None

    def tree_paths(self) -> Mapping[str, tuple[KeyKind, ...]]:
        """Each array path's key path in the stored pytree.

        Returns:
          ``{array path: (DictKey | SequenceKey, ...)}``, as ``jax.tree_util`` key paths.
          ``SequenceKey`` marks a list index; dict keys keep their saved type (orbax saves every
          key as a string, so an NNX pure dict's ``0`` layer comes back as ``DictKey('0')``,
          exactly as orbax restores it).
        """
        return types.MappingProxyType(self._tree_paths)

    def tree(self) -> Any:
        """The stored pytree's skeleton: nested dicts and lists whose leaves are array paths.

        For an orbax checkpoint it has the structure ``ocp.StandardCheckpointer().restore``
        returns (tuples come back as lists, empty dicts and ``None`` leaves are kept), so
        ``jax.tree.map(load, store.tree())`` rebuilds the checkpoint lazily.

        >>> store.tree()  # doctest: +SKIP
        {'layers': [{'w': 'layers/0/w'}, {'w': 'layers/1/w'}]}
        """
        items: list[tuple[tuple[KeyKind, ...], Any]] = [
            (kp, path) for path, kp in self._tree_paths.items()
        ] + list(self._empty_nodes.items())
        if not items:
            return {}
        if any(not kp for kp, _ in items):
            return next(v for kp, v in items if not kp)  # the whole tree is one leaf
        # Nodes are dicts keyed by (key type, key), tagged with the type of their own keys.
        root: dict = {_KIND: type(items[0][0][0])}
        for kp, value in items:
            node = root
            for k, nxt in zip(kp[:-1], kp[1:], strict=True):
                node = node.setdefault((type(k), _key_of(k)), {_KIND: type(nxt)})
            node[(type(kp[-1]), _key_of(kp[-1]))] = value
        return _materialize(root)

    def value_types(self) -> Mapping[str, str]:
        """For orbax checkpoints, each array's orbax ``value_type`` (``np.ndarray``,
        ``jax.Array``, ``scalar``); empty for cacheflow stores.

        Orbax restores ``scalar`` leaves as Python scalars; the store serves them as 0-d arrays.
        """
        return types.MappingProxyType(self._value_types)

    def __repr__(self) -> str:
        return (
            f"TensorStoreStore({self._label!r}, source={self._source!r}, "
            f"arrays={len(self._arrays)}, blocks={len(self.keys())})"
        )

    # ---- Internals

    def _read_whole(self, entry: _Entry) -> StoreFuture:
        """Reads a whole stored chunk (the fast path where it applies)."""
        stored = int(np.prod(entry.chunk_shape, dtype=np.int64)) * entry.info.dtype.itemsize
        self._counters.add(bytes_read=stored if entry.info.nbytes else 0)
        if entry.fast_key is not None:
            future = _file_pool().submit(_read_chunk_file, entry, self._label)
            return FastChunkFuture(future, self, entry)
        return self._read_ts(entry)

    def _read_ts(self, entry: _Entry) -> ChunkFuture:
        """Reads a chunk block through TensorStore's array driver."""
        view = entry.view
        if view is None:
            # Indexing costs more than issuing the read; keep the view of blocks once read.
            view = entry.view = entry.handle[entry.index]
        if entry.crc is not None:
            return VerifiedChunkFuture(view.read(), entry, self._label)
        return ChunkFuture(view.read(), entry.info.key, self._label, entry.where)

    def _read_subs(self, entries: Sequence[_Entry]) -> list[StoreFuture]:
        """Reads sub-blocks cut from whole chunks: one read per chunk, shared while it runs."""
        out = []
        started: list[ChunkRead] = []
        batch: dict[int, ChunkRead] = {}  # one read per chunk in this call, done or not
        with self._reads_lock:
            for entry in entries:
                chunk = entry.chunk
                assert chunk is not None
                read = batch.get(id(chunk)) or self._chunk_reads.get(id(chunk))
                if read is None or (id(chunk) not in batch and read.done()):
                    # Issuing a read does not wait for it, so it may happen under the lock.
                    read = ChunkRead(self._read_whole(chunk), chunk)
                    self._chunk_reads[id(chunk)] = read
                    started.append(read)
                batch[id(chunk)] = read
                with read.lock:
                    read.requested.add(entry.info.key)
                out.append((read, entry))
        self._counters.add(chunk_reads=len(started))
        for read in started:
            read.future.add_done_callback(lambda _f, read=read: self._forget(read))
        self._counters.add(
            bytes_served=sum(e.info.nbytes for e in entries), blocks_served=len(entries)
        )
        return [SubBlockFuture(read, entry, self) for read, entry in out]

    def _forget(self, read: ChunkRead) -> None:
        """Drops a finished chunk read from the table of reads to share (its buffer with it)."""
        with self._reads_lock:
            if self._chunk_reads.get(id(read.chunk)) is read:
                del self._chunk_reads[id(read.chunk)]

    def _read_partial(self, entry: _Entry) -> StoreFuture:
        """Reads a sub-block as one byte range of its raw chunk."""
        part = entry.partial
        assert part is not None
        self._counters.add(
            bytes_served=entry.info.nbytes,
            blocks_served=1,
            partial_reads=1,
        )
        future = part.kvstore.read(part.key, byte_range=slice(part.start, part.stop))
        return PartialReadFuture(future, entry, self)

    def _offer_siblings(self, read: ChunkRead, chunk: np.ndarray) -> None:
        """Hands the sub-blocks of ``read`` nobody asked for to the listeners (once per read)."""
        with read.lock:
            if read.offered:
                return
            read.offered = True
            requested = set(read.requested)
        with self._reads_lock:
            listeners = [fn for fn in (ref() for ref in self._listeners) if fn is not None]
        if not listeners:
            return
        siblings = {
            e.info.key: chunk[e.within] for e in read.chunk.subs if e.info.key not in requested
        }
        if not siblings:
            return
        self._counters.add(siblings_offered=len(siblings))
        for listener in listeners:
            kept = [k for k in listener(siblings) if k in siblings]
            self._counters.add(
                siblings_kept=len(kept),
                siblings_kept_bytes=sum(self._entries[k].info.nbytes for k in kept),
            )

    def _missing(self, key: str) -> KeyError:
        """The KeyError for an unknown key, with a hint on how to find the right one."""
        hint = ""
        if KEY_SEPARATOR in key:
            path = key.rpartition(KEY_SEPARATOR)[0]
            arr = self._arrays.get(path)
            if arr is not None and arr.stored_chunks == arr.chunk_shape:
                hint = f" (array {path!r} has chunk grid {arr.grid_shape})"
            elif arr is not None:
                hint = (
                    f" (array {path!r} has block grid {arr.grid_shape}: sub-blocks of "
                    f"{arr.chunk_shape} of its stored chunks {arr.stored_chunks})"
                )
        return KeyError(f"no block {key!r} in store {self._label}{hint}; {_HOW_TO_LIST}")


def check_block_bytes(block_bytes: Any) -> int | None:
    """``block_bytes`` as an int, or None; ValueError unless None or a positive integer."""
    if block_bytes is None:
        return None
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int | np.integer):
        raise ValueError(f"block_bytes={block_bytes!r} must be a positive integer number of bytes")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes={block_bytes} must be > 0 (or None for whole chunks)")
    return int(block_bytes)


def _partial_range(
    entry: _Entry,
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


_KIND = object()  # the tree() builder's tag for a node's key type


def _key_of(k: KeyKind) -> Any:
    """The plain key (dict key or list index) of a key path entry."""
    return k.key if isinstance(k, jax.tree_util.DictKey) else k.idx


def _materialize(node: Any) -> Any:
    """Turns the tree() builder's tagged dicts into plain dicts and lists."""
    if not isinstance(node, dict) or _KIND not in node:
        return node
    kind = node.pop(_KIND, jax.tree_util.DictKey)
    children = {k: _materialize(v) for k, v in node.items()}
    if kind is jax.tree_util.SequenceKey and all(
        t is jax.tree_util.SequenceKey for t, _ in children
    ):
        idxs = sorted(i for _, i in children)
        if idxs == list(range(len(idxs))):
            return [children[(jax.tree_util.SequenceKey, i)] for i in idxs]
    return {k: v for (_, k), v in sorted(children.items(), key=lambda kv: str(kv[0][1]))}


def _kp_from_cacheflow(attr: Any, path: str) -> tuple[KeyKind, ...]:
    """The key path of a cacheflow array: from its attributes, else from its path."""
    try:
        out: list[KeyKind] = []
        for kind, k in attr["tree_path"]:
            out.append(
                jax.tree_util.SequenceKey(int(k)) if kind == "seq" else jax.tree_util.DictKey(k)
            )
        return tuple(out)
    except (TypeError, KeyError, ValueError):
        return tuple(jax.tree_util.DictKey(p) for p in path.split("/"))


def _array_fingerprint(meta: Mapping[str, Any]) -> str:
    """A digest of what decides an array's bytes in its zarr.json (not its attributes)."""
    fields = ("shape", "data_type", "chunk_grid", "chunk_key_encoding", "codecs", "fill_value")
    canon = json.dumps({f: meta.get(f) for f in fields}, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(canon.encode()):08x}"


def _read_manifest(
    kv: ts.KvStore, label: str, record: Any, deadline: Deadline
) -> dict[str, list[int]]:
    """The chunk manifest named by the root group's ``record``, checked; {} if there is none."""
    if not isinstance(record, Mapping):
        return {}
    name = str(record.get("name", MANIFEST_NAME))
    where = _location(label, name)
    res = _wait_all([kv.read(name)], f"reading the chunk manifest {where}", deadline)[0]
    if res.state != "value":
        raise StoreError(f"the chunk manifest {where} is missing. {HOW_TO_REPAIR}")
    data = bytes(res.value)
    if chunk_crc32c(np.frombuffer(data, np.uint8), (len(data),)) != record.get("crc32c"):
        raise StoreError(
            f"the chunk manifest {where} does not match the CRC recorded in the store's "
            f"zarr.json. {HOW_TO_REPAIR}"
        )
    return decode_manifest(data, where)


def _open_cacheflow(
    kv: ts.KvStore,
    kv_spec: Mapping[str, Any],
    label: str,
    keys: Sequence[str],
    *,
    context: ts.Context,
    deadline: Deadline,
) -> dict[str, Any]:
    """Finds and opens the zarr3 arrays of a cacheflow store.

    A store written by `write_store` (its root group says so) has a file for every chunk and
    records a fingerprint of each array's metadata: a missing chunk is then an error, not the
    fill value, and an edited ``zarr.json`` is refused. Other zarr3 hierarchies follow zarr's
    rule that a chunk without a file holds the fill value.
    """
    meta_keys = [
        k
        for k in keys
        if (k == "zarr.json" or k.endswith("/zarr.json")) and not k.startswith(_RUNTIME_PREFIX)
    ]
    metas = _wait_all(
        [kv.read(k) for k in meta_keys], f"reading metadata of store {label}", deadline
    )
    found: dict[str, dict] = {}
    root_attr: dict[str, Any] = {}
    for k, res in zip(meta_keys, metas, strict=True):
        try:
            meta = json.loads(res.value)
            if not isinstance(meta, dict):
                raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
        except ValueError as err:
            raise StoreError(
                f"{_location(label, k)} is not valid zarr metadata: {err}. {HOW_TO_REPAIR}"
            ) from None
        path = k[: -len("zarr.json")].rstrip("/")
        if meta.get("node_type") == "group" and path == "":
            root_attr = (meta.get("attributes") or {}).get(_ATTR) or {}
            if root_attr.get("complete") is False:
                raise StoreError(
                    f"store {label} was not completely written (a write_store call was "
                    "interrupted); re-run write_store(tree, path, overwrite=True)"
                )
        if meta.get("node_type") != "array":
            continue
        if not path:
            raise StoreError(
                f"store {label} is a single zarr3 array, not a hierarchy; write it with "
                "write_store({'name': array}, path) or open its parent directory"
            )
        found[path] = meta
    written = root_attr.get("arrays")
    every_chunk = "complete" in root_attr  # written by write_store: every chunk has a file
    if isinstance(written, Mapping):
        for p in sorted(set(written) | set(found)):
            if p not in found:
                raise StoreError(
                    f"store {label} lost array {p!r}: write_store wrote it but "
                    f"{_location(label, p + '/zarr.json')} is missing. {HOW_TO_REPAIR}"
                )
            if p not in written:
                continue  # an array added to the hierarchy later, by another writer
            expected = (written[p] or {}).get("fingerprint")
            if expected is not None and expected != _array_fingerprint(found[p]):
                raise StoreError(
                    f"{_location(label, p + '/zarr.json')} was changed after write_store wrote "
                    f"it (its shape, data type, chunking or codecs differ from the store's "
                    f"record); its chunks cannot be trusted. {HOW_TO_REPAIR}"
                )
    chunk_crcs = _read_manifest(kv, label, root_attr.get("manifest"), deadline)
    paths = sorted(found)
    futures = [
        ts.open(
            {
                "driver": "zarr3",
                "kvstore": _join(kv_spec, p + "/"),
                "fill_missing_data_reads": not every_chunk,
            },
            context=context,
            read=True,
        )
        for p in paths
    ]
    handles = dict(
        zip(paths, _wait_all(futures, f"opening arrays of store {label}", deadline), strict=True)
    )
    arrays, where, tree_paths, fast, raw_layouts = {}, {}, {}, {}, {}
    for p in paths:
        meta, h = found[p], handles[p]
        arrays[p] = ArrayInfo(
            path=p,
            shape=tuple(h.shape),
            dtype=np.dtype(h.dtype.numpy_dtype),
            chunk_shape=tuple(h.chunk_layout.read_chunk.shape or ()),
        )
        where[p] = _zarr3_chunk_where(label, p, meta.get("chunk_key_encoding"))
        tree_paths[p] = _kp_from_cacheflow(meta.get("attributes", {}).get(_ATTR), p)
        layout = _fast_layout(meta, arrays[p])
        if layout is not None:
            fast[p] = layout
        raw = raw_chunk_layout(meta, "zarr3")
        if raw is not None:
            raw_layouts[p] = raw
        crcs = chunk_crcs.get(p)
        if crcs is not None and len(crcs) != math.prod(arrays[p].grid_shape):
            raise StoreError(
                f"the chunk manifest of store {label} lists {len(crcs)} chunks for array {p!r}, "
                f"whose grid {arrays[p].grid_shape} has {math.prod(arrays[p].grid_shape)}. "
                f"{HOW_TO_REPAIR}"
            )
    return {
        "arrays": arrays,
        "fast_arrays": fast,
        "raw_layouts": raw_layouts,
        "writer_chose_chunks": every_chunk,
        "chunk_crcs": chunk_crcs,
        "handles": handles,
        "chunk_where": where,
        "tree_paths": tree_paths,
        "empty_nodes": {},
        "value_types": {},
        "source": "cacheflow",
    }


def open_store(
    spec_or_path: str | os.PathLike[str] | Mapping[str, Any],
    *,
    s3_endpoint: str | None = None,
    s3_region: str | None = None,
    create: bool = False,
    timeout: float | None = DEFAULT_TIMEOUT,
    retries: int = DEFAULT_RETRIES,
    step: int | None = None,
    block_bytes: int | None = None,
    runtime: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    manifest: bool = True,
) -> TensorStoreStore:
    """Opens an L3 store: a cacheflow zarr3 store or an orbax checkpoint, read in place.

    Args:
      spec_or_path: a local directory; a URL (``file:///abs/dir``, ``memory://name/``,
        ``s3://bucket/prefix``, ``gs://bucket/prefix``); or a TensorStore kvstore spec dict such
        as ``{"driver": "file", "path": "/data/store"}``. An orbax checkpoint may be given as its
        item directory, as a ``CheckpointManager`` step directory holding one item, or as the
        manager's root directory (its latest step is opened, as orbax's ``latest_step``).
      s3_endpoint: S3 endpoint URL (default: env ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``).
      s3_region: S3 region (default: env ``AWS_REGION`` / ``AWS_DEFAULT_REGION``; ``us-east-1``
        when only an endpoint is set).
      create: allow an empty or missing location (a store of runtime blocks only); a missing
        local directory is created. Without it, nothing is created or changed.
      timeout: seconds the whole open may take, and the deadline of each of the store's own
        blocking calls later (runtime headers, write-backs); None waits forever.
      retries: how often a failed S3/GCS request is retried (0.1 s to 2 s apart) before it
        counts as failed. TensorStore's own default, 32, takes about 11 minutes against a
        dead server.
      step: the step to open from a ``CheckpointManager`` root (default: the latest).
      block_bytes: serve stored chunks larger than this many bytes as sub-blocks along their
        leading axis (see `TensorStoreStore.with_block_bytes`); None (the default) serves
        chunks whole. `TieredCache` chooses a block size itself (``block_bytes=``).
      runtime: where runtime blocks (``write``) go: a path, URL or kvstore spec. Default: the
        store itself for a cacheflow store; for an orbax checkpoint, which is never written,
        ``$XDG_CACHE_HOME/cacheflow_jax/runtime/<name>-<digest>/`` (``~/.cache`` by default;
        see ``_runtime_store.default_runtime_dir``).
      manifest: check every read of an orbax checkpoint against its chunk manifest, where
        ``cacheflow verify`` recorded one (see `cacheflow_jax.verify_checkpoint`); False ignores
        it (``cacheflow verify --update`` records a new one).

    Returns:
      The opened store.

    Raises:
      FileNotFoundError: a local path does not exist (and ``create`` is False).
      StoreError: the location is neither a cacheflow store nor an orbax checkpoint, or cannot
        be read; ``step`` is not among a root's steps; a checkpoint's chunk manifest is damaged
        or older than the checkpoint.
      StoreTimeoutError: the store did not answer within ``timeout`` (a `StoreError`).
      ValueError: an unsupported URL or spec, a bad ``timeout`` / ``retries`` /
        ``block_bytes``, or ``step`` given for a location that is not a ``CheckpointManager``
        root.

    >>> store = open_store("memory://demo/", create=True)
    >>> store.keys()
    ()
    """
    if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
        raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0, or None")
    block_bytes = check_block_bytes(block_bytes)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int | np.integer)):
        raise ValueError(f"step={step!r} must be an integer step number, or None for the latest")
    context = store_context(retries)
    deadline = Deadline(timeout)
    kv_spec, label, local = _resolve(spec_or_path, s3_endpoint, s3_region)
    if local is not None:
        if not local.exists():
            if not create:
                raise FileNotFoundError(
                    f"no store at {local}: the path does not exist. {_HOW_TO_CREATE}, or pass "
                    "create=True for an empty store of runtime blocks"
                )
            local.mkdir(parents=True)
        elif not local.is_dir():
            raise StoreError(f"{local} is a file, not a store directory. {_HOW_TO_CREATE}")
    kv = _open_kvstore(kv_spec, label, context=context, deadline=deadline)
    keys = _list(kv, label, deadline)
    runtime_here = runtime_keys(keys)
    data_keys = [k for k in keys if not k.startswith(_RUNTIME_PREFIX)]
    items = sorted(
        {
            k.split("/")[0]
            for k in data_keys
            if k.count("/") == 1 and k.split("/")[1] in ORBAX_MARKERS
        }
    )
    has_zarr = any(k == "zarr.json" or k.endswith("/zarr.json") for k in data_keys)
    steps = (
        find_steps(data_keys)
        if not items and not any(m in data_keys for m in ORBAX_MARKERS)
        else {}
    )
    if step is not None and not steps:
        raise ValueError(
            f"step={step} was given, but {label} is not a CheckpointManager root (it has no "
            "step directories); pass the root, or drop step="
        )
    item = None
    if any(m in data_keys for m in ORBAX_MARKERS):
        item = ""
    elif len(items) == 1 and not has_zarr:
        item = items[0] + "/"
    elif len(items) > 1 and not has_zarr:
        raise StoreError(
            f"{label} is an orbax step directory with {len(items)} items {items}; open one item "
            f"directory, e.g. {label.rstrip('/')}/{items[0]}"
        )
    elif steps:
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise StoreError(
                f"{label} has no step {step}; its steps are {sorted(steps)}. Pass one of them, "
                "or omit step= for the latest"
            )
        item = steps[step]
        if not item:
            raise StoreError(
                f"step {step} of {label} holds several orbax items; open one item directory, "
                f"e.g. {label.rstrip('/')}/{step}/<item>"
            )
    if item is not None:
        parts = _open_orbax(kv, kv_spec, label, item, data_keys, context=context, deadline=deadline)
        if steps:
            label = f"{label.rstrip('/')}/{step}"
        parts.update(
            _checkpoint_manifest(
                kv,
                kv_spec,
                label,
                item,
                steps or None,
                step,
                parts,
                context,
                deadline,
                check=manifest,
            )
        )
        parts["checkpoint_item"] = (item, parts.pop("metadata_raw"))
        rt = _runtime_area(runtime, label, s3_endpoint, s3_region, context, deadline, own=None)
    elif has_zarr:
        parts = _open_cacheflow(kv, kv_spec, label, data_keys, context=context, deadline=deadline)
        own = (kv, label, str(local) if local is not None else None, runtime_here)
        rt = _runtime_area(runtime, label, s3_endpoint, s3_region, context, deadline, own=own)
    elif data_keys:
        raise StoreError(
            f"{label} is neither a cacheflow store (no zarr.json arrays) nor an orbax "
            f"checkpoint (no _METADATA or manifest.ocdbt); it holds {len(data_keys)} other files, "
            f"e.g. {data_keys[:3]}. {_HOW_TO_CREATE}"
        )
    elif not runtime_here and not create:
        raise StoreError(
            f"store {label} is empty. {_HOW_TO_CREATE}, or pass create=True for an empty store "
            "of runtime blocks"
        )
    else:
        parts = {
            "arrays": {},
            "handles": {},
            "chunk_where": {},
            "tree_paths": {},
            "empty_nodes": {},
            "value_types": {},
            "source": "cacheflow",
        }
        own = (kv, label, str(local) if local is not None else None, runtime_here)
        rt = _runtime_area(runtime, label, s3_endpoint, s3_region, context, deadline, own=own)
    return TensorStoreStore(
        label=label,
        kvstore=kv,
        kvstore_spec=kv_spec,
        runtime=rt,
        context=context,
        timeout=timeout,
        block_bytes=block_bytes,
        steps=tuple(sorted(steps)),
        step=step if steps else None,
        **parts,
    )


def _runtime_area(
    runtime: Any,
    label: str,
    s3_endpoint: str | None,
    s3_region: str | None,
    context: ts.Context,
    deadline: Deadline,
    *,
    own: tuple[ts.KvStore, str, str | None, list[str]] | None,
) -> RuntimeArea:
    """The runtime area of a store: ``runtime`` if given, else its own location (``own``), else
    (a read-only checkpoint) the default one in the user's cache folder."""
    timeout = deadline.seconds
    if runtime is None and own is not None:
        kv, where, root, keys = own
        if root is not None:
            clean_local(root)
        return RuntimeArea(kvstore=kv, label=where, root=root, keys=keys, timeout=timeout)
    if runtime is None:
        runtime = default_runtime_dir(label)
    rt_spec, rt_label, rt_local = _resolve(runtime, s3_endpoint, s3_region)
    rt_kv = _open_kvstore(rt_spec, rt_label, context=context, deadline=deadline)
    # A runtime location that does not exist yet lists nothing; it is made by the first write.
    keys = runtime_keys(_list(rt_kv, rt_label, deadline))
    root = str(rt_local) if rt_local is not None else None
    if root is not None:
        clean_local(root)
    return RuntimeArea(kvstore=rt_kv, label=rt_label, root=root, keys=keys, timeout=timeout)


def _checkpoint_manifest(
    kv: ts.KvStore,
    kv_spec: Mapping[str, Any],
    label: str,
    item: str,
    steps: Mapping[int, str] | None,
    step: int | None,
    parts: Mapping[str, Any],
    context: ts.Context,
    deadline: Deadline,
    *,
    check: bool,
) -> dict[str, Any]:
    """Where a checkpoint's chunk manifest (``cacheflow verify``) goes, and, with ``check``,
    the manifest itself if there is one (checked against the checkpoint), as store parts."""
    in_step = False
    if steps is None and item == "":
        # An item directory opened directly: is it inside a CheckpointManager step?
        up = parent_location(kv_spec)
        if up is not None:
            parent = _open_kvstore(up[0], label, context=context, deadline=deadline)
            got = _result(parent.read(STEP_MARKER), deadline, f"reading beside {label}")
            in_step = got.state == "value"
    beside = manifest_location(kv_spec, item, steps, step, in_step)
    if beside is None:
        return {}
    spec, name = beside
    where = manifest_label(spec, name)
    found = {"manifest_at": (spec, name, where)}
    if not check:
        return found
    holder = _open_kvstore(spec, where, context=context, deadline=deadline)
    res = _result(holder.read(name), deadline, f"reading the chunk manifest {where}")
    if res.state != "value":
        return found
    manifest = decode_checkpoint_manifest(bytes(res.value), where)
    fingerprint = checkpoint_fingerprint(kv, item, parts["metadata_raw"], deadline)
    if manifest.fingerprint != fingerprint:
        raise StoreError(
            f"the chunk manifest {where} was made for another version of checkpoint {label} "
            "(the checkpoint was saved again after `cacheflow verify` recorded it); run "
            f"`cacheflow verify {label} --update` to record the checkpoint as it is now"
        )
    arrays = parts["arrays"]
    for path, crcs in manifest.arrays.items():
        if path not in arrays or len(crcs) != math.prod(arrays[path].grid_shape):
            raise StoreError(
                f"the chunk manifest {where} does not match checkpoint {label} (array {path!r}); "
                f"run `cacheflow verify {label} --update`"
            )
    return {**found, "chunk_crcs": manifest.arrays, "crc_covers": "block", "manifest": where}


# --------------------------------------------------------------------------------------------
# Writing


def chunk_shape_for(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """The regular chunk shape :func:`write_store` uses: each chunk at most ``chunk_bytes``.

    Trailing dimensions are kept whole while they fit; the first one that does not is split,
    and every dimension before it gets chunk size 1. Chunk sizes are at least 1.

    Args:
      shape: the array's shape.
      itemsize: bytes per element.
      chunk_bytes: the largest chunk in bytes (> 0).

    Returns:
      The chunk shape (``()`` for a 0-d array).

    >>> chunk_shape_for((10, 4, 8), 4, 256)
    (2, 4, 8)
    """
    budget = max(1, chunk_bytes // max(1, itemsize))
    out = [1] * len(shape)
    inner = 1
    for d in range(len(shape) - 1, -1, -1):
        size = max(1, int(shape[d]))
        if inner * size <= budget:
            out[d] = size
            inner *= size
        else:
            out[d] = max(1, budget // inner)
            break
    return tuple(out)


def _kp_part(k: Any) -> tuple[str, str | int]:
    """(kind, key) of one jax key path entry, for naming and for the saved tree path."""
    if isinstance(k, jax.tree_util.SequenceKey):
        return "seq", k.idx
    if isinstance(k, jax.tree_util.DictKey):
        return "dict", k.key
    if isinstance(k, jax.tree_util.GetAttrKey):
        return "dict", k.name
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return "seq", k.key
    return "dict", str(k)


def write_store(
    tree: Any,
    path: str | os.PathLike[str] | Mapping[str, Any],
    *,
    chunk_bytes: int = 4 * 2**20,
    overwrite: bool = False,
    s3_endpoint: str | None = None,
    s3_region: str | None = None,
) -> TensorStoreStore:
    """Writes a pytree of arrays as a cacheflow store (zarr3, CRC32C-checked chunks).

    Each leaf becomes the array ``"/".join(key path)`` (``{"params": {"w": x}}`` ->
    ``params/w``; list index -> ``0``); a bare array is named ``array``. All arrays are written
    concurrently, every chunk gets a file (all-zero ones too), and the root group records a
    fingerprint of each array's metadata. The root group marks the store incomplete until every
    chunk is written, so an interrupted write is refused on open instead of serving zero-filled
    chunks; a chunk missing later, or an edited ``zarr.json``, is an error on read or open.

    With ``overwrite=True`` only a cacheflow store (or an empty location) is replaced. A local
    store is written beside the old one and swapped in only when complete, so a failed write
    leaves the old store as it was; other locations are cleared first (after every leaf has
    been checked).

    Args:
      tree: nested dicts/lists/tuples of numpy or JAX arrays (or numbers).
      path: where to write: as for :func:`open_store`.
      chunk_bytes: the largest chunk (= block) in bytes; see :func:`chunk_shape_for`.
      overwrite: replace an existing cacheflow store at ``path``.
      s3_endpoint: as for :func:`open_store`.
      s3_region: as for :func:`open_store`.

    Returns:
      The written store, opened.

    Raises:
      ValueError: ``chunk_bytes`` <= 0, a leaf is not a numeric array, a leaf's name is not
        usable as an array path, or two leaves map to the same array path.
      FileExistsError: ``path`` holds data and ``overwrite`` is False, or ``path`` holds data
        that is not a cacheflow store (never deleted).
      StoreError: a write failed.

    >>> store = write_store({"w": np.ones((4, 4), np.float32)}, "memory://doc/", overwrite=True)
    >>> store.keys()
    ('w@0,0',)
    """
    if (
        isinstance(chunk_bytes, bool)
        or not isinstance(chunk_bytes, int | np.integer)
        or (chunk_bytes <= 0)
    ):
        raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
    kv_spec, label, local = _resolve(path, s3_endpoint, s3_region)
    leaves = _leaves_to_write(tree)
    if local is not None and local.exists() and not local.is_dir():
        raise FileExistsError(f"{local} is a file, not a store directory; choose another path")
    kv = _open_kvstore(kv_spec, label)
    existing = _list(kv, label)
    if existing:
        if not overwrite:
            raise FileExistsError(
                f"{label} already holds data; pass overwrite=True to replace it, or choose "
                "another path"
            )
        _check_replaceable(kv, label, existing)
    if local is not None and existing:
        _write_local_swap(leaves, local, int(chunk_bytes))
    else:
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
        if existing:
            _wait_all([kv.delete_range(ts.KvStore.KeyRange())], f"clearing {label}")
        _write_arrays(kv, kv_spec, label, leaves, int(chunk_bytes))
    return open_store(path, s3_endpoint=s3_endpoint, s3_region=s3_region)


def _leaves_to_write(tree: Any) -> dict[str, tuple[np.ndarray, list[list]]]:
    """Checks every leaf of ``tree`` and names it (before anything on disk is touched)."""
    leaves: dict[str, tuple[np.ndarray, list[list]]] = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [_kp_part(k) for k in kp]
        names = [str(k) for _, k in parts]
        name = "/".join(names) if names else "array"
        if any(not n or "/" in n or KEY_SEPARATOR in n for n in names) or name.split("/")[
            0
        ] == _RUNTIME_PREFIX.rstrip("/"):
            raise ValueError(
                f"cannot name leaf {jax.tree_util.keystr(kp)!r} as an array path: keys must be "
                f"non-empty and contain no '/' or {KEY_SEPARATOR!r}, and a top-level "
                f"{_RUNTIME_PREFIX.rstrip('/')!r} is reserved for runtime blocks; rename it"
            )
        if name in leaves:
            raise ValueError(f"two leaves map to the same array path {name!r}; rename one")
        arr = np.asarray(leaf)
        if not _numeric(arr.dtype):
            raise ValueError(f"leaf {name!r} has dtype {arr.dtype}; only numeric arrays are stored")
        leaves[name] = (arr, [list(p) for p in parts])
    return leaves


def _check_replaceable(kv: ts.KvStore, label: str, keys: Sequence[str]) -> None:
    """Raises FileExistsError unless the keys under ``kv`` are a cacheflow store's."""
    attr = None
    if "zarr.json" in keys:
        try:
            meta = json.loads(_wait_all([kv.read("zarr.json")], f"reading {label}")[0].value)
            attr = (meta.get("attributes") or {}).get(_ATTR) if isinstance(meta, dict) else None
        except (StoreError, ValueError):
            attr = None
    if not isinstance(attr, Mapping) or "complete" not in attr:
        others = [k for k in keys if not k.startswith(_RUNTIME_PREFIX)][:3] or list(keys[:3])
        raise FileExistsError(
            f"{label} holds data that is not a store written by write_store (e.g. {others}); "
            "overwrite=True only replaces cacheflow stores, so nothing was deleted. Choose "
            "another path, or remove the data yourself"
        )


def _write_local_swap(
    leaves: dict[str, tuple[np.ndarray, list[list]]], local: Path, chunk_bytes: int
) -> None:
    """Writes a new store beside ``local`` and swaps it in once complete."""
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    stage = local.parent / f".{local.name}.cacheflow-new-{tag}"
    old = local.parent / f".{local.name}.cacheflow-old-{tag}"
    spec = {"driver": "file", "path": str(stage) + "/"}
    try:
        stage.mkdir()
        _write_arrays(_open_kvstore(spec, str(stage)), spec, str(local), leaves, chunk_bytes)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    os.rename(local, old)
    os.rename(stage, local)
    shutil.rmtree(old, ignore_errors=True)


def _write_arrays(
    kv: ts.KvStore,
    kv_spec: Mapping[str, Any],
    label: str,
    leaves: dict[str, tuple[np.ndarray, list[list]]],
    chunk_bytes: int,
) -> None:
    """Writes the arrays under an empty ``kv``; the root group is marked complete last."""

    def group(complete: bool, arrays: Mapping[str, Any], manifest: bytes = b"") -> bytes:
        attr: dict[str, Any] = {"complete": complete, "arrays": arrays}
        if manifest:
            attr["manifest"] = {
                "name": MANIFEST_NAME,
                "crc32c": chunk_crc32c(np.frombuffer(manifest, np.uint8), (len(manifest),)),
            }
        meta = {"zarr_format": 3, "node_type": "group", "attributes": {_ATTR: attr}}
        return json.dumps(meta).encode()

    _wait_all([kv.write("zarr.json", group(False, {}))], f"writing {label}/zarr.json")
    opens = []
    crcs: dict[str, list[int]] = {}
    for name, (arr, parts) in leaves.items():
        chunks = chunk_shape_for(arr.shape, arr.dtype.itemsize, chunk_bytes)
        crcs[name] = array_crcs(arr, chunks)
        spec = {
            "driver": "zarr3",
            "kvstore": _join(kv_spec, name + "/"),
            "create": True,
            # Every chunk gets a file (also all-zero ones), so every block has a checksum.
            "store_data_equal_to_fill_value": True,
            "metadata": {
                "shape": list(arr.shape),
                "data_type": arr.dtype.name,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
                "codecs": _CODECS,
                "attributes": {_ATTR: {"tree_path": parts}},
            },
        }
        opens.append(ts.open(spec, context=_CONTEXT))
    handles = _wait_all(opens, f"creating arrays in {label}")
    writes = [h.write(arr) for h, (arr, _) in zip(handles, leaves.values(), strict=True)]
    _wait_all(writes, f"writing arrays to {label}")
    metas = _wait_all(
        [kv.read(name + "/zarr.json") for name in leaves], f"reading back metadata of {label}"
    )
    fingerprints = {
        name: {"fingerprint": _array_fingerprint(json.loads(res.value))}
        for name, res in zip(leaves, metas, strict=True)
    }
    manifest = encode_manifest(crcs)
    _wait_all([kv.write(MANIFEST_NAME, manifest)], f"writing {label}/{MANIFEST_NAME}")
    root = group(True, fingerprints, manifest)
    _wait_all([kv.write("zarr.json", root)], f"writing {label}/zarr.json")


# The default block size of a cache over a store whose chunks nobody chose for caching (an orbax
# checkpoint): this fraction of the L1 budget, so that L1 holds at least this many blocks.
DEFAULT_BLOCKS_PER_L1 = 8


def fit_blocks(store: Any, device_bytes: Any, block_bytes: int | None) -> Any:
    """The store a `TieredCache` with L1 budget ``device_bytes`` serves (see its ``block_bytes``).

    Returns ``store`` itself unless a chunk is larger than the block size, else its view with
    sub-blocks (`TensorStoreStore.with_block_bytes`).

    Raises:
      ValueError: ``block_bytes`` is not a positive integer, or is given for a store that is
        not a `TensorStoreStore`.
    """
    block_bytes = check_block_bytes(block_bytes)
    if not isinstance(store, TensorStoreStore):
        if block_bytes is not None:
            raise ValueError(
                f"block_bytes={block_bytes} applies to stores from open_store/write_store; "
                f"{type(store).__name__} {store.spec} cannot cut its blocks"
            )
        return store
    if block_bytes is None:
        if store.block_bytes is not None or store.writer_chose_chunks:
            return store
        if isinstance(device_bytes, bool) or not isinstance(device_bytes, int | np.integer):
            return store  # the cache reports the bad budget
        if device_bytes < DEFAULT_BLOCKS_PER_L1:
            return store
        block_bytes = int(device_bytes) // DEFAULT_BLOCKS_PER_L1
    largest = max(
        (
            math.prod(min(c, n) for c, n in zip(a.stored_chunks, a.shape)) * a.dtype.itemsize
            for a in store.arrays().values()
            if a.shape
        ),
        default=0,
    )
    if largest <= block_bytes and store.block_bytes is None:
        return store
    return store.with_block_bytes(block_bytes)


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
