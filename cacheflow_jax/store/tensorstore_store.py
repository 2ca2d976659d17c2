"""The L3 store: TensorStore arrays (zarr3 stores and orbax checkpoints) read block by block.

Design note. A block is one stored chunk of one array, or, for a chunk larger than the store's
``block_bytes``, a run of its leading rows (a sub-block, see ``subblocks``). The block grid depends
on the stored array and the block size only (4 MiB unless chosen, for stores whose chunks nobody
chose for caching), never on a cache's budget, so one key names one thing. The store is opened
once: it lists the arrays, opens every array handle concurrently and builds a ``key -> entry``
table (info, handle, slices, chunk file), so ``info`` is a dict lookup and ``read`` is one indexing
of an open handle plus ``.read()``. Nothing is cached here: L2 is the host cache, so TensorStore's
``cache_pool`` is set to 0 bytes (see ``locations.CONTEXT_SPEC``).

The store is split by concern (modules of ``cacheflow_jax.store``):

* ``entry``: the block table's entry (`Entry`) and the chunk layouts it points at;
* ``locations``: paths, URLs and kvstore specs, and the TensorStore context;
* ``futures``: the futures every operation returns (one base class);
* ``fastread``: the fast read path for zarr3 chunk files with a crc32c codec;
* ``subblocks``: sub-blocks of large chunks, partial and shared chunk reads, read counters;
* ``table``: building the block table; ``reads``: reading its blocks (`BlockReads`);
* ``tree``: the stored pytree's key paths and skeleton (`tree`);
* ``runtime_format`` and ``runtime_area``: runtime blocks (KV blocks), their file format and
  the writable location they go to;
* ``manifest``: chunk manifests (CRC-32C of every chunk);
* ``parts``: what a store is built from (`StoreParts`), as a source opened it;
* ``sources``: the registry of formats `open_store` understands, one class each:
  ``zarr_source`` (cacheflow stores) and ``orbax_source`` (orbax checkpoints in place,
  ``CheckpointManager`` steps);
* ``open``: `open_store`; ``write``: `write_store` and `chunk_shape_for`;
* ``verify``: ``cacheflow verify``, a checkpoint's chunk manifest;
* this module: the store itself (`TensorStoreStore`), `fit_blocks` and `largest_block`.

What :func:`open_store` understands:

* a cacheflow store: zarr3 arrays under a root (written by :func:`write_store`, or any zarr3
  hierarchy); the array path is the array's directory relative to the root, ``/``-separated;
* an orbax checkpoint (an item directory holding ``_METADATA`` / ``manifest.ocdbt``, a
  ``CheckpointManager`` step directory holding one item, or the manager's root, whose latest
  step is opened), read in place through the ``ocdbt`` kvstore; the array path is the orbax tree
  path joined with ``/`` (``layers/0/w``);
* runtime blocks (keys without ``@``, e.g. KV blocks) written with :meth:`TensorStoreStore.write`
  under ``_runtime/`` of the store's runtime location: the store itself for a cacheflow store, a
  separate one for a checkpoint, which is never written (``runtime_area``).

:meth:`TensorStoreStore.tree` returns the stored pytree's skeleton (nested dicts and lists whose
leaves are array paths), shaped like ``ocp.StandardCheckpointer().restore(path)`` for orbax
checkpoints and like the tree given to :func:`write_store` for cacheflow stores.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import tensorstore as ts

from cacheflow_jax.core.blocks import KEY_SEPARATOR, ArrayInfo, BlockInfo, BudgetError, block_key
from cacheflow_jax.store.futures import Deadline, StoreFuture, WriteFuture
from cacheflow_jax.store.orbax_source import checkpoint_fingerprint
from cacheflow_jax.store.parts import StoreParts
from cacheflow_jax.store.reads import BlockReads
from cacheflow_jax.store.runtime_format import Version
from cacheflow_jax.store.subblocks import SiblingListener, check_block_bytes
from cacheflow_jax.store.table import block_table
from cacheflow_jax.store.tree import skeleton

if TYPE_CHECKING:
    from cacheflow_jax.core.blocks import KeyKind
    from cacheflow_jax.store.runtime_area import RuntimeArea

__all__ = ["TensorStoreStore", "fit_blocks", "largest_block"]

_HOW_TO_LIST = "list the store's keys with store.keys() or `cacheflow inspect <store>`"


class TensorStoreStore:
    """The L3 store over TensorStore: blocks of zarr3 / orbax arrays plus runtime blocks.

    Build one with :func:`open_store` or :func:`write_store`. Thread-safe: reads touch only
    immutable tables; runtime writes update the runtime table under a lock.
    """

    def __init__(self, parts: StoreParts, *, block_bytes: int | None = None) -> None:
        """Builds the block table; use :func:`open_store` instead of calling this.

        Args:
          parts: what a source opened (see `StoreParts`).
          block_bytes: serve stored chunks larger than this as sub-blocks (see
            `with_block_bytes`); None serves every chunk whole.
        """
        self._parts = parts
        self._label = parts.label
        self._timeout = parts.timeout
        self._kv = parts.kvstore
        self._kv_spec = dict(parts.kvstore_spec)
        self._handles = dict(parts.handles)
        self._tree_paths = dict(parts.tree_paths)
        self._empty_nodes = dict(parts.empty_nodes)
        self._value_types = dict(parts.value_types)
        self._rt = parts.runtime
        self._block_bytes = block_bytes
        self._reads = BlockReads(self._label)
        self._entries, self._arrays = block_table(parts, block_bytes)
        self._chunk_keys = tuple(self._entries)
        self._keys_cache: tuple[int, tuple[str, ...]] | None = None

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

        A runtime key the store does not know yet is looked up in the store (another process
        may have written it since the store was opened; see ``runtime_area``).

        Raises:
          KeyError: no such block in this store.
          CorruptBlockError: a runtime block's header is damaged.
          StoreError: the store could not be asked.
        """
        entry = self._entries.get(key)
        if entry is not None:
            return entry.info
        info = self._rt.info(key)
        if info is None:
            raise self._missing(key)
        return info

    def holds(self, key: str) -> bool:
        """Whether there is a block ``key``: a chunk, or a runtime block listed on open, found
        since or written since (no I/O; `info` looks an unknown runtime key up in the store)."""
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
            if key not in self._rt and self._rt.info(key) is None:
                raise self._missing(key)
            return self._rt.read(key)
        return self._reads.read(entry)

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
            if entry is None and key not in self._rt and self._rt.info(key) is None:
                raise self._missing(key)
            entries.append(entry)
        shared = [e for e in entries if e is not None and e.chunk is not None and not e.partial]
        futures = dict(zip((e.info.key for e in shared), self._reads.read_subs(shared)))
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

    def write_many(self, items: Sequence[tuple[str, Any, Version | None]]) -> Future:
        """Starts writing several runtime blocks ``(key, value, version)`` with one future.

        Each block is written as `write` writes it; on local disk several go to one writer
        thread and their directory is synced once for them (it is synced before any counts as
        written). The future's result is one outcome per item, in order: ``"written"``,
        ``"superseded"``, or the exception that item's `write` would have raised (at once, or
        from its future). The cache's write-back uses this to write what it evicted in batches.
        """
        return self._rt.write_many(items)

    # ---- Beyond the protocol

    @property
    def kvstore_spec(self) -> dict[str, Any]:
        """The TensorStore kvstore spec of the store's root."""
        return dict(self._kv_spec)

    @property
    def source(self) -> str:
        """What the store reads: ``"cacheflow"`` (zarr3 arrays) or ``"orbax"`` (a checkpoint)."""
        return self._parts.source

    @property
    def shared(self) -> bool:
        """Whether many processes write the runtime blocks (``open_store(..., shared=True)``):
        each block is published once and never replaced (see `ConflictError`)."""
        return self._rt.shared

    @property
    def runtime_area(self) -> RuntimeArea:
        """Where the runtime blocks live (their table, reads and writes)."""
        return self._rt

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
        return self._parts.writer_chose_chunks

    @property
    def step(self) -> int | None:
        """The step opened, when the store is a ``CheckpointManager`` root or step (else None)."""
        return self._parts.step

    @property
    def steps(self) -> tuple[int, ...]:
        """Every step of the ``CheckpointManager`` root opened, ascending (else empty)."""
        return self._parts.steps

    @property
    def manifest(self) -> str | None:
        """The chunk manifest checked on every read (its location), or None."""
        return self._parts.manifest

    @property
    def manifest_location(self) -> tuple[dict[str, Any], str, str] | None:
        """Where ``cacheflow verify`` keeps an orbax checkpoint's chunk manifest: (kvstore spec
        of the directory beside the checkpoint, key, readable location); None otherwise."""
        return self._parts.manifest_at

    def checkpoint_fingerprint(self) -> str | None:
        """The fingerprint a chunk manifest of this orbax checkpoint records (None otherwise).

        Raises:
          StoreError: the checkpoint's ``manifest.ocdbt`` cannot be read.
        """
        if self._parts.checkpoint_item is None:
            return None
        item, metadata_raw = self._parts.checkpoint_item
        return checkpoint_fingerprint(self._kv, item, metadata_raw, Deadline(self._timeout))

    def with_block_bytes(self, block_bytes: int | None) -> TensorStoreStore:
        """The same store with another block size: a view sharing handles and runtime blocks.

        Args:
          block_bytes: chunks larger than this many bytes are served as sub-blocks along their
            leading axis (see ``subblocks``); None serves every chunk whole.

        Returns:
          ``self`` if the block size is the same, else a new store over the same data.

        Raises:
          ValueError: ``block_bytes`` is not a positive integer.
        """
        block_bytes = check_block_bytes(block_bytes)
        if block_bytes == self._block_bytes:
            return self
        arrays = {
            p: dataclasses.replace(a, chunk_shape=a.stored_chunks, stored_chunk_shape=None)
            for p, a in self._arrays.items()
        }
        return TensorStoreStore(
            dataclasses.replace(self._parts, arrays=arrays), block_bytes=block_bytes
        )

    def add_sibling_listener(self, listener: SiblingListener) -> None:
        """Registers a listener for sub-blocks read along with the ones asked for.

        Where a sub-block's chunk must be read whole, the listener gets the chunk's other
        sub-blocks (key -> read-only view; copy what you keep) once per read, on the thread
        that takes the first result, and returns the keys it kept (counted in `read_stats`).
        A bound method is held weakly, so a cache that goes away is dropped.
        """
        self._reads.add_listener(listener)

    def read_stats(self) -> dict[str, Any]:
        """What the store read from L3 and served (see `ReadCounters.snapshot`).

        ``bytes_read`` counts chunk data as stored before compression (a whole chunk read
        through TensorStore counts its decoded size; a fast-path file its size; a partial read
        its byte range).
        """
        return self._reads.counters.snapshot()

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
        return skeleton(self._tree_paths, self._empty_nodes)

    def value_types(self) -> Mapping[str, str]:
        """For orbax checkpoints, each array's orbax ``value_type`` (``np.ndarray``,
        ``jax.Array``, ``scalar``); empty for cacheflow stores.

        Orbax restores ``scalar`` leaves as Python scalars; the store serves them as 0-d arrays.
        """
        return types.MappingProxyType(self._value_types)

    def __repr__(self) -> str:
        return (
            f"TensorStoreStore({self._label!r}, source={self._parts.source!r}, "
            f"arrays={len(self._arrays)}, blocks={len(self.keys())})"
        )

    # ---- Internals

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


def largest_block(store: Any) -> tuple[str, int] | None:
    """The key and size in bytes of the largest block of ``store``'s arrays (None without one).

    The first block of an array is a full block (only blocks at the far edges are clipped), so
    it is the array's largest.
    """
    best: tuple[str, int] | None = None
    for a in store.arrays().values():
        n = math.prod(min(c, s) for c, s in zip(a.chunk_shape, a.shape)) * a.dtype.itemsize
        if best is None or n > best[1]:
            best = (block_key(a.path, (0,) * len(a.shape)), n)
    return best


def fit_blocks(store: Any, device_bytes: Any, block_bytes: int | None) -> Any:
    """The store a `TieredCache` with L1 budget ``device_bytes`` serves (see its ``block_bytes``).

    The blocks never follow the budget: a key names the same elements at every budget. The
    store's own blocks are kept (for an orbax checkpoint, at most `DEFAULT_BLOCK_BYTES`; see
    `open_store`) unless ``block_bytes`` asks for others.

    Args:
      store: the cache's store.
      device_bytes: the cache's L1 budget, as given.
      block_bytes: the block size asked for (None: the store's own).

    Returns:
      ``store`` itself, or its view with blocks of at most ``block_bytes``
      (`TensorStoreStore.with_block_bytes`).

    Raises:
      ValueError: ``block_bytes`` is not a positive integer, or is given for a store that is
        not a `TensorStoreStore`.
      BudgetError: ``device_bytes`` is smaller than the largest block; the message names the
        block and a ``block_bytes`` that fits.
    """
    block_bytes = check_block_bytes(block_bytes)
    if not isinstance(store, TensorStoreStore):
        if block_bytes is not None:
            raise ValueError(
                f"block_bytes={block_bytes} applies to stores from open_store/write_store; "
                f"{type(store).__name__} {store.spec} cannot cut its blocks"
            )
        return store
    if block_bytes is not None and block_bytes != store.block_bytes:
        whole = all(a.chunk_shape == a.stored_chunks for a in store.arrays().values())
        largest = max(
            (
                math.prod(min(c, n) for c, n in zip(a.stored_chunks, a.shape)) * a.dtype.itemsize
                for a in store.arrays().values()
                if a.shape
            ),
            default=0,
        )
        if not (whole and largest <= block_bytes):
            store = store.with_block_bytes(block_bytes)
    _check_device_budget(store, device_bytes, block_bytes)
    return store


def _check_device_budget(store: TensorStoreStore, device_bytes: Any, asked: int | None) -> None:
    """Raises `BudgetError` where L1 cannot hold the store's largest block."""
    if isinstance(device_bytes, bool) or not isinstance(device_bytes, int | np.integer):
        return  # the cache's own check reports a budget that is not a number
    found = largest_block(store)
    if found is None or device_bytes <= 0 or found[1] <= device_bytes:
        return
    key, nbytes = found
    fit = 1 << max(0, (int(device_bytes) // 8).bit_length() - 1)
    given = f"block_bytes={asked}" if asked is not None else (
        f"its default blocks (at most {store.block_bytes} bytes)"
        if store.block_bytes is not None and not store.writer_chose_chunks
        else "its stored chunks (write_store's chunk_bytes)"
    )
    raise BudgetError(
        f"device_bytes={device_bytes} is smaller than block {key!r} ({nbytes} bytes) of "
        f"{store.spec}, served with {given}. Blocks do not shrink with the budget, so that a "
        f"key names the same data at every budget: raise device_bytes to at least {nbytes}, "
        f"or choose smaller blocks with block_bytes= (e.g. block_bytes={fit}, an eighth of L1; "
        "TieredCache, restore_lazy and open_store take it, and keys then follow that block "
        "size: use the same value wherever you use the keys)"
    )
