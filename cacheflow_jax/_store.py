"""The L3 store: TensorStore arrays (zarr3 stores and orbax checkpoints) read block by block.

Design note. A block is one chunk of one stored array, so a block read is exactly one chunk read
in TensorStore: no read amplification, and the chunk's own checksum covers the whole block. The
store is opened once: it lists the arrays, opens every array handle concurrently and builds a
``key -> (BlockInfo, handle, slices)`` table, so ``info`` is a dict lookup and ``read`` is one
indexing of an open handle plus ``.read()``. Nothing is cached here: L2 is the host cache, so
TensorStore's ``cache_pool`` is set to 0 bytes (see ``_locations._CONTEXT_SPEC``).

The store is split by concern:

* ``_locations``: paths, URLs and kvstore specs, and the TensorStore context;
* ``_futures``: the futures every operation returns (one base class);
* ``_fastread``: the fast read path for zarr3 chunk files with a crc32c codec;
* ``_runtime_blocks``: the file format of runtime blocks (KV blocks);
* ``_orbax_open``: opening an orbax checkpoint in place;
* this module: the block table (`TensorStoreStore`), opening a cacheflow store, `write_store`.

Three kinds of location are understood by :func:`open_store`:

* a cacheflow store: zarr3 arrays under a root (written by :func:`write_store`, or any zarr3
  hierarchy); the array path is the array's directory relative to the root, ``/``-separated;
* an orbax checkpoint (an item directory holding ``_METADATA`` / ``manifest.ocdbt``, or a
  ``CheckpointManager`` step directory holding exactly one item), read in place through the
  ``ocdbt`` kvstore; the array path is the orbax tree path joined with ``/`` (``layers/0/w``);
* runtime blocks (keys without ``@``, e.g. KV blocks) written with :meth:`TensorStoreStore.write`
  into ``_runtime/`` under the root, one small self-describing file per block (see
  ``_runtime_blocks._RUNTIME_FORMAT``). They are found again on open by listing that prefix; their
  headers are read lazily, on the first ``info`` of each.

:meth:`TensorStoreStore.tree` returns the stored pytree's skeleton (nested dicts and lists whose
leaves are array paths), shaped like ``ocp.StandardCheckpointer().restore(path)`` for orbax
checkpoints and like the tree given to :func:`write_store` for cacheflow stores.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import types
import urllib.parse
import uuid
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from cacheflow_jax._blocks import (
    HOW_TO_REPAIR,
    KEY_SEPARATOR,
    ArrayInfo,
    BlockInfo,
    KeyKind,
    StoreError,
    block_key,
)
from cacheflow_jax._fastread import (
    _fast_layout,
    _FastArray,
    _file_pool,
    _read_chunk_file,
    _zarr3_chunk_where,
)
from cacheflow_jax._futures import (
    ChunkFuture,
    Deadline,
    FastChunkFuture,
    ReadyFuture,
    RuntimeReadFuture,
    StoreFuture,
    VerifiedChunkFuture,
    WriteFuture,
    _result,
    _thread_pool,
    _translate,
    _wait_all,
)
from cacheflow_jax._locations import (
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
from cacheflow_jax._manifest import (
    MANIFEST_NAME,
    array_crcs,
    chunk_crc32c,
    decode_manifest,
    encode_manifest,
)
from cacheflow_jax._orbax_open import ORBAX_MARKERS, _open_orbax
from cacheflow_jax._runtime_blocks import (
    _RUNTIME_MIN_HEADER,
    _RUNTIME_PREFIX,
    _RUNTIME_SUFFIX,
    _atomic_write_file,
    _encode_runtime,
    _numeric,
    _parse_runtime_header,
    _remove_stale_temporaries,
    _runtime_name,
    check_runtime_key,
)

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
# Write-backs run on their own threads (a write and its read-back block one thread each).
_WRITE_THREADS = 8


class _Entry:
    """One chunk block: its info, the open array handle and its index expression; for the fast
    path also its chunk file's kvstore key, the array's chunk layout and the edge clipping; and
    the chunk's CRC-32C from the store's manifest, if it has one."""

    __slots__ = (
        "info", "handle", "index", "where", "view", "fast", "fast_key", "clip", "crc",
        "chunk_shape",
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
        self.crc: int | None = None  # the manifest's CRC-32C of the chunk's stored payload
        self.chunk_shape: tuple[int, ...] = info.shape


class TensorStoreStore:
    """The L3 store over TensorStore: chunks of zarr3 / orbax arrays plus runtime blocks.

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
        runtime_keys: Iterable[str],
        source: str,
        fast_arrays: Mapping[str, _FastArray] | None = None,
        chunk_crcs: Mapping[str, Sequence[int]] | None = None,
        context: ts.Context | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        read_only: bool = False,
    ) -> None:
        """Builds the block table; use :func:`open_store` instead of calling this.

        ``fast_arrays`` names the arrays whose chunk files are read directly (see :meth:`read`);
        ``chunk_crcs`` is the store's chunk manifest (see ``_manifest``), checked on every read.
        ``timeout`` bounds the store's own blocking calls (runtime headers, write-backs).
        """
        self._label = label
        self._context = context or _CONTEXT
        self._timeout = timeout
        self._read_only = read_only
        self._kv = kvstore
        self._kv_spec = dict(kvstore_spec)
        self._arrays = dict(arrays)
        self._handles = dict(handles)
        self._tree_paths = dict(tree_paths)
        self._empty_nodes = dict(empty_nodes)
        self._value_types = dict(value_types)
        self._source = source
        self._entries: dict[str, _Entry] = {}
        # The fast path reads chunk files directly, so only stores on the file driver take it:
        # other kvstores hand bytes to Python through ts.KvStore.ReadResult.value, which copies
        # twice and is slower than TensorStore's own zarr decode (measured on memory://).
        root = self._kv_spec.get("path") if self._kv_spec.get("driver") == "file" else None
        root = os.path.abspath(root) if root is not None else None
        self._root = root  # the local directory of a file store, else None
        fast_arrays = (fast_arrays or {}) if root is not None else {}
        for path, arr in self._arrays.items():
            handle = self._handles[path]
            fast = fast_arrays.get(path)
            crcs = iter((chunk_crcs or {}).get(path) or ())
            for idx in np.ndindex(*arr.grid_shape):
                origin = tuple(i * c for i, c in zip(idx, arr.chunk_shape, strict=True))
                shape = tuple(
                    min(c, s - o)
                    for c, s, o in zip(arr.chunk_shape, arr.shape, origin, strict=True)
                )
                key = block_key(path, idx)
                info = BlockInfo(
                    key=key,
                    shape=shape,
                    dtype=arr.dtype,
                    nbytes=int(np.prod(shape, dtype=np.int64)) * arr.dtype.itemsize,
                    array=path,
                    index=tuple(int(i) for i in idx),
                    origin=origin,
                )
                index = tuple(slice(o, o + s) for o, s in zip(origin, shape, strict=True))
                entry = self._entries[key] = _Entry(
                    info, handle, index, chunk_where[path](info.index)
                )
                entry.crc = next(crcs, None)
                entry.chunk_shape = arr.chunk_shape
                if fast is not None and info.nbytes > 0:
                    entry.fast = fast
                    entry.fast_key = os.path.join(root, path, fast.name(info.index))
                    if shape != fast.chunk_shape:
                        entry.clip = tuple(slice(0, n) for n in shape)
        self._chunk_keys = tuple(self._entries)
        self._lock = threading.Lock()
        # key -> BlockInfo, or None until its header is read (blocks found by listing on open).
        self._runtime: dict[str, BlockInfo | None] = dict.fromkeys(runtime_keys)
        # key -> (write future, value) for writes still in flight; reads are answered from value.
        self._pending: dict[str, tuple[Any, np.ndarray]] = {}
        self._keys_cache: tuple[str, ...] | None = None

    # ---- Store protocol

    @property
    def spec(self) -> str:
        """The store's path or URL, as used in error messages."""
        return self._label

    def arrays(self) -> Mapping[str, ArrayInfo]:
        """The stored arrays by path (runtime blocks are not arrays)."""
        return types.MappingProxyType(self._arrays)

    def info(self, key: str) -> BlockInfo:
        """The block's metadata, without reading its data.

        Args:
          key: a chunk key ``"<array path>@<i,j,...>"`` or a runtime block key.

        Returns:
          The block's ``BlockInfo`` (shape clipped at the array edge, origin in elements).

        Raises:
          KeyError: no such block in this store.
          CorruptBlockError: a runtime block's header is damaged.
        """
        entry = self._entries.get(key)
        if entry is not None:
            return entry.info
        with self._lock:
            if key not in self._runtime:
                raise self._missing(key)
            info = self._runtime[key]
        if info is None:
            info = self._load_runtime_info(key)
        return info

    def keys(self) -> Sequence[str]:
        """Every block key: chunks of stored arrays in array order, then runtime blocks."""
        with self._lock:
            if self._keys_cache is None:
                self._keys_cache = self._chunk_keys + tuple(self._runtime)
            return self._keys_cache

    def read(self, key: str) -> StoreFuture:
        """Starts reading one block.

        Args:
          key: a key from :meth:`keys`.

        Chunks of zarr3 arrays on local disk whose codecs are exactly ``bytes`` (little endian)
        + ``crc32c`` (every array :func:`write_store` writes) take a fast path: the chunk file
        is read whole into an aligned buffer by a reader thread, its CRC32C is checked there
        (google_crc32c) and the block is a view of that buffer, so no decode copy is made.
        Everything else (orbax checkpoints, other codecs, other kvstores, missing chunk files)
        is read by TensorStore's zarr driver.

        Args:
          key: a key from :meth:`keys`.

        Returns:
          A future whose ``result()`` is a numpy array of ``info(key).shape`` and dtype, bitwise
          equal to what was written. It may be read-only (a fast-path full chunk).

        Raises:
          KeyError: no such block (raised now, not by ``result()``).
        """
        entry = self._entries.get(key)
        if entry is not None:
            if entry.fast_key is not None:
                future = _file_pool().submit(_read_chunk_file, entry, self._label)
                return FastChunkFuture(future, self, entry)
            return self._read_ts(entry)
        with self._lock:
            if key not in self._runtime:
                raise self._missing(key)
            pending = self._pending.get(key)
        if pending is not None:
            return ReadyFuture(pending[1], copy=True)
        name = _runtime_name(key)
        return RuntimeReadFuture(self._kv.read(name), key, self._label, self._where(name))

    def read_many(self, keys: Sequence[str]) -> list[StoreFuture]:
        """Starts reading many blocks; every read is issued before any is waited on.

        Args:
          keys: keys from :meth:`keys`.

        Returns:
          One future per key, in order.

        Raises:
          KeyError: a key is unknown (checked before any read is issued).
        """
        for key in keys:
            if key not in self._entries and key not in self._runtime:
                raise self._missing(key)
        return [self.read(key) for key in keys]

    def write(self, key: str, value: np.ndarray | jax.Array) -> WriteFuture:
        """Starts writing a runtime block (for example a KV block) under ``_runtime/``.

        After this returns, ``info(key)``, ``read(key)`` and ``keys()`` see the block. The file
        is replaced atomically, so a crash leaves either the old block or the new one: on local
        disk the block goes to a temporary file that is synced and then renamed over the old
        one; on an object store it is one PUT. The write counts as durable only once the block
        has been read back from the store and found byte-identical.

        Args:
          key: a non-empty key without ``@`` (chunk keys are read-only); see
            `check_runtime_key`.
          value: the block; copied before this returns, so the caller may reuse the buffer.

        Returns:
          A future whose ``result()`` returns ``None`` once the block is durable, and raises
          `StoreError` if it could not be written or read back.

        Raises:
          TypeError: ``key`` is not a str.
          ValueError: ``key`` cannot name a runtime block, ``value`` is not a numeric array,
            or the store is read-only.
        """
        check_runtime_key(key, self._label)
        if self._read_only:
            raise ValueError(
                f"cannot write runtime block {key!r}: store {self._label} is read-only"
            )
        arr = np.array(value, copy=True, order="C")
        if not _numeric(arr.dtype):
            raise ValueError(
                f"cannot write block {key!r}: dtype {arr.dtype} is not a numeric array dtype"
            )
        info = BlockInfo(key=key, shape=arr.shape, dtype=arr.dtype, nbytes=arr.nbytes)
        name = _runtime_name(key)
        data = _encode_runtime(arr)
        with self._lock:
            future = _thread_pool("write", _WRITE_THREADS).submit(self._write_sync, name, data)
            if key not in self._runtime:
                self._keys_cache = None
            self._runtime[key] = info
            self._pending[key] = (future, arr)

        def _done(f: Any) -> None:
            with self._lock:
                if self._pending.get(key, (None,))[0] is f:
                    del self._pending[key]

        future.add_done_callback(_done)
        return WriteFuture(future, key, self._label, self._where(name))

    def _write_sync(self, name: str, data: bytes) -> None:
        """Writes one runtime block file atomically, then reads it back (on a writer thread)."""
        deadline = Deadline(self._timeout)
        what = f"writing {self._where(name)}"
        if self._root is not None:
            path = os.path.join(self._root, name)
            _atomic_write_file(path, data)
            with open(path, "rb") as f:
                back = f.read()
        else:
            _result(self._kv.write(name, data), deadline, what)
            res = _result(self._kv.read(name), deadline, f"reading back {self._where(name)}")
            back = res.value if res.state == "value" else None
        if back != data:
            got = "nothing" if back is None else f"{len(back)} different bytes"
            raise StoreError(
                f"{what}: the store acknowledged the write but reading it back gave {got} "
                f"(expected {len(data)} bytes); the block stays in memory and is retried"
            )

    # ---- Beyond the protocol

    @property
    def kvstore_spec(self) -> dict[str, Any]:
        """The TensorStore kvstore spec of the store's root."""
        return dict(self._kv_spec)

    @property
    def source(self) -> str:
        """What the store reads: ``"cacheflow"`` (zarr3 arrays) or ``"orbax"`` (a checkpoint)."""
        return self._source

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

    def _read_ts(self, entry: _Entry) -> ChunkFuture:
        """Reads a chunk block through TensorStore's array driver."""
        view = entry.view
        if view is None:
            # Indexing costs more than issuing the read; keep the view of blocks once read.
            view = entry.view = entry.handle[entry.index]
        if entry.crc is not None:
            return VerifiedChunkFuture(view.read(), entry, self._label)
        return ChunkFuture(view.read(), entry.info.key, self._label, entry.where)

    def _missing(self, key: str) -> KeyError:
        """The KeyError for an unknown key, with a hint on how to find the right one."""
        hint = ""
        if KEY_SEPARATOR in key:
            path = key.rpartition(KEY_SEPARATOR)[0]
            if path in self._arrays:
                hint = f" (array {path!r} has chunk grid {self._arrays[path].grid_shape})"
        return KeyError(f"no block {key!r} in store {self._label}{hint}; {_HOW_TO_LIST}")

    def _where(self, name: str) -> str:
        """Where kvstore key ``name`` lives, for error messages."""
        return _location(self._label, name)

    def _load_runtime_info(self, key: str) -> BlockInfo:
        """Reads a listed runtime block's header (one ranged read) and remembers its info."""
        name = _runtime_name(key)
        where = self._where(name)
        try:
            deadline = Deadline(self._timeout)
            what = f"reading the header of {where}"
            head = self._kv.read(name, byte_range=slice(0, _RUNTIME_MIN_HEADER))
            res = _result(head, deadline, what)
            if res.state != "value":
                raise StoreError(
                    f"runtime block {key!r} in store {self._label} is listed but its file "
                    f"{where} is missing; another process may have deleted it"
                )
            data = res.value
            header, size = _parse_runtime_header(data, key, self._label, where)
            if not header:
                data = _result(self._kv.read(name, byte_range=slice(0, size)), deadline, what).value
                header, size = _parse_runtime_header(data, key, self._label, where)
        except StoreError:
            raise
        except Exception as err:
            raise _translate(err, key, self._label, where) from err
        shape, dtype = header["shape"], header["dtype"]
        info = BlockInfo(
            key=key,
            shape=shape,
            dtype=dtype,
            nbytes=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
        )
        with self._lock:
            if self._runtime.get(key, info) is None:
                self._runtime[key] = info
            return self._runtime.get(key) or info


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
    arrays, where, tree_paths, fast = {}, {}, {}, {}
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
) -> TensorStoreStore:
    """Opens an L3 store: a cacheflow zarr3 store or an orbax checkpoint, read in place.

    Args:
      spec_or_path: a local directory; a URL (``file:///abs/dir``, ``memory://name/``,
        ``s3://bucket/prefix``, ``gs://bucket/prefix``); or a TensorStore kvstore spec dict such
        as ``{"driver": "file", "path": "/data/store"}``. An orbax checkpoint may be given as its
        item directory or as a ``CheckpointManager`` step directory holding one item.
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

    Returns:
      The opened store.

    Raises:
      FileNotFoundError: a local path does not exist (and ``create`` is False).
      StoreError: the location is neither a cacheflow store nor an orbax checkpoint, or cannot
        be read.
      StoreTimeoutError: the store did not answer within ``timeout`` (a `StoreError`).
      ValueError: an unsupported URL or spec, or a bad ``timeout`` / ``retries``.

    >>> store = open_store("memory://demo/", create=True)
    >>> store.keys()
    ()
    """
    if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
        raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0, or None")
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
    if local is not None:
        _remove_stale_temporaries(str(local / _RUNTIME_PREFIX))
    runtime = [
        urllib.parse.unquote(k[len(_RUNTIME_PREFIX) : -len(_RUNTIME_SUFFIX)])
        for k in keys
        if k.startswith(_RUNTIME_PREFIX) and k.endswith(_RUNTIME_SUFFIX)
    ]
    data_keys = [k for k in keys if not k.startswith(_RUNTIME_PREFIX)]
    items = sorted(
        {k.split("/")[0] for k in data_keys if k.count("/") == 1 and k.endswith(ORBAX_MARKERS)}
    )
    has_zarr = any(k == "zarr.json" or k.endswith("/zarr.json") for k in data_keys)
    if any(m in data_keys for m in ORBAX_MARKERS):
        parts = _open_orbax(kv, kv_spec, label, "", data_keys, context=context, deadline=deadline)
    elif len(items) == 1 and not has_zarr:
        parts = _open_orbax(
            kv, kv_spec, label, items[0] + "/", data_keys, context=context, deadline=deadline
        )
    elif len(items) > 1 and not has_zarr:
        raise StoreError(
            f"{label} is an orbax step directory with {len(items)} items {items}; open one item "
            f"directory, e.g. {label.rstrip('/')}/{items[0]}"
        )
    elif has_zarr:
        parts = _open_cacheflow(kv, kv_spec, label, data_keys, context=context, deadline=deadline)
    elif data_keys:
        raise StoreError(
            f"{label} is neither a cacheflow store (no zarr.json arrays) nor an orbax "
            f"checkpoint (no _METADATA or manifest.ocdbt); it holds {len(data_keys)} other files, "
            f"e.g. {data_keys[:3]}. {_HOW_TO_CREATE}"
        )
    elif not runtime and not create:
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
    return TensorStoreStore(
        label=label,
        kvstore=kv,
        kvstore_spec=kv_spec,
        runtime_keys=runtime,
        context=context,
        timeout=timeout,
        **parts,
    )


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
