"""Where a store keeps its runtime blocks (KV blocks): a writable area, apart from its chunks.

A store's runtime blocks live under ``_runtime/`` of a writable location (file format:
``runtime_format``). For a store written by ``write_store`` that is the store itself. An orbax
checkpoint is read-only: its runtime blocks go to a separate location, by default
``$XDG_CACHE_HOME/cacheflow_jax/runtime/<checkpoint name>-<digest of its location>/``
(``~/.cache`` when ``XDG_CACHE_HOME`` is unset), or wherever ``open_store(runtime=...)`` says,
so that serving a checkpoint never changes a byte of it. `open_area` opens the area of a store.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from cacheflow_jax.core.blocks import BlockInfo, CorruptBlockError, StoreError
from cacheflow_jax.core.pytree import block_info, leaves_of, tree_map
from cacheflow_jax.store.futures import (
    Deadline,
    ReadyFuture,
    RuntimeReadFuture,
    StoreFuture,
    WriteFuture,
    thread_pool,
    translate_error,
    wait_for,
)
from cacheflow_jax.store.locations import list_keys, location, open_kvstore, resolve
from cacheflow_jax.store.runtime_format import (
    RUNTIME_MIN_HEADER,
    RUNTIME_PREFIX,
    RUNTIME_SUFFIX,
    SUPERSEDED,
    WRITTEN,
    Version,
    atomic_write_file,
    check_runtime_key,
    encode_runtime,
    numeric,
    parse_runtime_header,
    remove_stale_temporaries,
    runtime_name,
    supersedes,
    writer,
)

# Write-backs run on their own threads (a write and its read-back block one thread each).
_WRITE_THREADS = 8

# A local block's compare-and-publish (read the header, write, rename) runs under one of these,
# picked by the file's path, so that two writes of one file in this process never interleave
# (writes of different files rarely share a stripe).
_PUBLISH_LOCKS = tuple(threading.Lock() for _ in range(64))
# The seq of the last version this process published at each local path (under its stripe's
# lock): a file this process wrote last needs no header read to be compared. Another process's
# write since is another writer's block, which the compare replaces anyway.
_PUBLISHED: dict[str, int] = {}

# How many times a conditional write on an object store is retried when another writer changed
# the object between the read of its header and the write (each retry reads the header again).
_PUBLISH_RETRIES = 16


def default_runtime_dir(label: str) -> Path:
    """The default runtime location of a read-only store (an orbax checkpoint) at ``label``.

    ``$XDG_CACHE_HOME/cacheflow_jax/runtime/<name>-<digest>/`` (``~/.cache`` without
    ``XDG_CACHE_HOME``): ``name`` is the location's last part (with its parent's for a step
    directory, whose name is a number), the digest (12 hex digits of the SHA-256 of the whole
    location) keeps two checkpoints of one name apart.

    >>> default_runtime_dir("/data/ckpt/5").name.startswith("ckpt-5-")
    True
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    parts = label.rstrip("/").split("/")
    last = parts[-1]
    if last.isdigit() and len(parts) > 1:
        last = f"{parts[-2]}-{last}"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", last) or "store"
    digest = hashlib.sha256(label.rstrip("/").encode()).hexdigest()[:12]
    return Path(base) / "cacheflow_jax" / "runtime" / f"{name}-{digest}"


class RuntimeArea:
    """The runtime blocks of one store: their table, reads, and atomic, checked writes.

    Thread-safe: the table is updated under a lock; reads of blocks whose write is still in
    flight are answered from memory.
    """

    def __init__(
        self,
        *,
        kvstore: ts.KvStore,
        label: str,
        root: str | None,
        keys: Iterable[str],
        timeout: float | None,
        read_only: bool = False,
    ) -> None:
        """Use `open_area` instead of calling this.

        Args:
          kvstore: the location's kvstore (runtime blocks are under ``_runtime/`` in it).
          label: the location, as named in error messages.
          root: the local directory of a file location (written directly, atomically), else None.
          keys: the runtime keys found there on open (headers are read lazily).
          timeout: the deadline of each blocking call (header reads, write-backs).
          read_only: refuse writes.
        """
        self.kv = kvstore
        self.label = label
        self.root = root
        self._timeout = timeout
        self._read_only = read_only
        self.lock = threading.Lock()
        # key -> BlockInfo, or None until its header is read (blocks found by listing on open).
        self.table: dict[str, BlockInfo | None] = dict.fromkeys(keys)
        # key -> (write future, value) for writes still in flight; reads are answered from value.
        self.pending: dict[str, tuple[Any, np.ndarray]] = {}
        self.version = 0  # bumped when a key is added (for the store's keys() cache)

    def __contains__(self, key: str) -> bool:
        return key in self.table

    def keys(self) -> tuple[str, ...]:
        """The runtime keys, in the order they were found or first written."""
        with self.lock:
            return tuple(self.table)

    def info(self, key: str) -> BlockInfo | None:
        """The block's metadata, or None if there is no such runtime block.

        Raises:
          CorruptBlockError: the block's header is damaged.
        """
        with self.lock:
            if key not in self.table:
                return None
            info = self.table[key]
        return info if info is not None else self._load_info(key)

    def read(self, key: str) -> StoreFuture:
        """Starts reading a runtime block known to the table."""
        with self.lock:
            pending = self.pending.get(key)
        if pending is not None:
            return ReadyFuture(pending[1], copy=True)
        name = runtime_name(key)
        return RuntimeReadFuture(self.kv.read(name), key, self.label, self.where(name))

    def write(
        self, key: str, value: np.ndarray | jax.Array, *, version: Version | None = None
    ) -> WriteFuture:
        """Starts writing a runtime block; see `TensorStoreStore.write`."""
        check_runtime_key(key, self.label)
        if self._read_only:
            raise ValueError(f"cannot write runtime block {key!r}: store {self.label} is read-only")
        arr = tree_map(lambda leaf: np.array(leaf, copy=True, order="C"), value)
        for leaf in leaves_of(arr):
            if not numeric(leaf.dtype):
                raise ValueError(
                    f"cannot write block {key!r}: dtype {leaf.dtype} is not a numeric array dtype"
                )
        info = block_info(key, arr)
        name = runtime_name(key)
        data = encode_runtime(arr, version)
        with self.lock:
            future = thread_pool("write", _WRITE_THREADS).submit(
                self._write_sync, key, name, data, version
            )
            if key not in self.table:
                self.version += 1
            self.table[key] = info
            self.pending[key] = (future, arr)

        def _done(f: Any) -> None:
            with self.lock:
                if self.pending.get(key, (None,))[0] is f:
                    del self.pending[key]
                    if f.exception() is not None or f.result() == SUPERSEDED:
                        # What the store holds is not this value: read its header again.
                        self.table[key] = None

        future.add_done_callback(_done)
        return WriteFuture(future, key, self.label, self.where(name))

    def where(self, name: str) -> str:
        """Where kvstore key ``name`` lives, for error messages."""
        return location(self.label, name)

    def _write_sync(self, key: str, name: str, data: bytes, version: Version | None) -> str:
        """Publishes one runtime block file atomically and reads it back (on a writer thread).

        With a ``version``, the block is published only if the store does not hold a later
        write of the same writer (compare-and-publish): on local disk under a lock of this
        process, on other kvstores by a write conditional on the generation whose header was
        read.

        Returns:
          `WRITTEN`, or `SUPERSEDED` when a later version was there (nothing was written).
        """
        deadline = Deadline(self._timeout)
        what = f"writing {self.where(name)}"
        if self.root is not None:
            path = os.path.join(self.root, name)
            with _PUBLISH_LOCKS[hash(path) % len(_PUBLISH_LOCKS)]:
                if version is not None:
                    ours = _PUBLISHED.get(path)
                    if ours is not None and version.writer == writer():
                        if ours > version.seq:
                            return SUPERSEDED
                    elif self._stored_supersedes(key, name, version, path):
                        return SUPERSEDED
                atomic_write_file(path, data)
                with open(path, "rb") as f:
                    back = f.read()
                if back == data and version is not None and version.writer == writer():
                    _PUBLISHED[path] = version.seq
        else:
            for _ in range(_PUBLISH_RETRIES):
                generation = b""  # unconditional
                if version is not None:
                    generation, head = self._read_head(name, deadline)
                    if head is not None and self._header_supersedes(key, name, head, version):
                        return SUPERSEDED
                stamp = wait_for(self.kv.write(name, data, if_equal=generation), deadline, what)
                if generation == b"" or stamp.generation != b"":
                    break  # an empty generation back: the object changed since its header
            else:
                raise StoreError(
                    f"writing runtime block {key!r} to store {self.label} ({self.where(name)}): "
                    f"the store refused its conditional write {_PUBLISH_RETRIES} times: "
                    "another writer keeps rewriting the object, or its bucket is missing. The "
                    "block stays in memory and is retried"
                )
            res = wait_for(self.kv.read(name), deadline, f"reading back {self.where(name)}")
            back = res.value if res.state == "value" else None
        if back != data:
            got = "nothing" if back is None else f"{len(back)} different bytes"
            raise StoreError(
                f"{what}: the store acknowledged the write but reading it back gave {got} "
                f"(expected {len(data)} bytes); the block stays in memory and is retried"
            )
        return WRITTEN

    def _stored_supersedes(self, key: str, name: str, version: Version, path: str) -> bool:
        """Whether the local file at ``path`` holds a later write of ``version``'s writer."""
        try:
            with open(path, "rb") as f:
                head = f.read(RUNTIME_MIN_HEADER)
                if len(head) >= 12:
                    size = int.from_bytes(head[8:12], "little")
                    if size > len(head):
                        head += f.read(size - len(head))
        except FileNotFoundError:
            return False
        return self._header_supersedes(key, name, head, version)

    def _read_head(self, name: str, deadline: Deadline) -> tuple[bytes, bytes | None]:
        """The generation of kvstore key ``name`` and its block header (None: no such key)."""
        what = f"reading the header of {self.where(name)}"
        try:
            head = wait_for(
                self.kv.read(name, byte_range=slice(0, RUNTIME_MIN_HEADER)), deadline, what
            )
        except ValueError:  # OUT_OF_RANGE: shorter than any header (damaged); read what is there
            head = wait_for(self.kv.read(name), deadline, what)
        if head.state != "value":
            return head.stamp.generation, None
        data = head.value
        if len(data) >= 12 and int.from_bytes(data[8:12], "little") > len(data):
            size = int.from_bytes(data[8:12], "little")
            head = wait_for(self.kv.read(name, byte_range=slice(0, size)), deadline, what)
            if head.state != "value":
                return head.stamp.generation, None
            data = head.value
        return head.stamp.generation, data

    def _header_supersedes(self, key: str, name: str, head: bytes, version: Version) -> bool:
        try:
            header, _ = parse_runtime_header(head, key, self.label, self.where(name))
        except CorruptBlockError:
            return False  # a damaged block is replaced
        return supersedes(header, version)

    def _load_info(self, key: str) -> BlockInfo:
        """Reads a listed runtime block's header (one ranged read) and remembers its info."""
        name = runtime_name(key)
        where = self.where(name)
        try:
            deadline = Deadline(self._timeout)
            what = f"reading the header of {where}"
            head = self.kv.read(name, byte_range=slice(0, RUNTIME_MIN_HEADER))
            res = wait_for(head, deadline, what)
            if res.state != "value":
                raise StoreError(
                    f"runtime block {key!r} in store {self.label} is listed but its file "
                    f"{where} is missing; another process may have deleted it"
                )
            data = res.value
            header, size = parse_runtime_header(data, key, self.label, where)
            if not header:
                data = wait_for(self.kv.read(name, byte_range=slice(0, size)), deadline, what).value
                header, size = parse_runtime_header(data, key, self.label, where)
        except StoreError:
            raise
        except Exception as err:
            raise translate_error(err, key, self.label, where) from err
        shape, dtype = header["shape"], header["dtype"]
        info = BlockInfo(
            key=key,
            shape=shape,
            dtype=dtype,
            nbytes=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
            leaves=header.get("leaves", ()),
        )
        with self.lock:
            if self.table.get(key, info) is None:
                self.table[key] = info
            return self.table.get(key) or info


def runtime_keys(keys: Iterable[str]) -> list[str]:
    """The runtime block keys among a location's kvstore keys (from their file names)."""
    return [
        urllib.parse.unquote(k[len(RUNTIME_PREFIX) : -len(RUNTIME_SUFFIX)])
        for k in keys
        if k.startswith(RUNTIME_PREFIX) and k.endswith(RUNTIME_SUFFIX)
    ]


def clean_local(root: str) -> None:
    """Removes temporary files of dead writers under a local runtime location."""
    remove_stale_temporaries(os.path.join(root, RUNTIME_PREFIX))


def open_area(
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
    rt_spec, rt_label, rt_local = resolve(runtime, s3_endpoint, s3_region)
    rt_kv = open_kvstore(rt_spec, rt_label, context=context, deadline=deadline)
    # A runtime location that does not exist yet lists nothing; it is made by the first write.
    keys = runtime_keys(list_keys(rt_kv, rt_label, deadline))
    root = str(rt_local) if rt_local is not None else None
    if root is not None:
        clean_local(root)
    return RuntimeArea(kvstore=rt_kv, label=rt_label, root=root, keys=keys, timeout=timeout)
