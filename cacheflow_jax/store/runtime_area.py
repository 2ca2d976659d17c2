"""Where a store keeps its runtime blocks (KV blocks): a writable area, apart from its chunks.

A store's runtime blocks live under ``_runtime/`` of a writable location (file format:
``runtime_format``). For a store written by ``write_store`` that is the store itself. An orbax
checkpoint is read-only: its runtime blocks go to a separate location, by default
``$XDG_CACHE_HOME/cacheflow_jax/runtime/<checkpoint name>-<digest of its location>/``
(``~/.cache`` when ``XDG_CACHE_HOME`` is unset), or wherever ``open_store(runtime=...)`` says,
so that serving a checkpoint never changes a byte of it. `open_area` opens the area of a store.

A runtime key the area does not know yet (another process may have written it since the store
was opened) is looked up in the store when asked for (`RuntimeArea.info`: one ranged read of
its header); a lookup that finds nothing is remembered for ``lookup_ttl`` seconds, so a prefix
lookup does not ask the store again for the same missing key at every step.

An area opened with ``shared=True`` is written by many processes at once (docs/scale.md):

* its blocks are immutable: a key is published once, with a create-if-absent write (on local
  disk a hard link of a complete temporary file; on S3 a PUT with ``If-None-Match: *``), so a
  reader sees the whole block or none, and two writers of one key never both succeed;
* a writer that finds its key published already compares values: the same value (another
  process put the same content-addressed block) is a success, another value a `ConflictError`;
* a block that vanished (`cacheflow_jax.store.shared.trim_runtime`, an object-store lifecycle
  rule) is a `KeyError` for its reader, like a key never written, not a damaged store.
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from cacheflow_jax.core.blocks import (
    KEY_SEPARATOR,
    BlockInfo,
    ConflictError,
    CorruptBlockError,
    StoreError,
)
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
    write_error,
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
    damaged,
    encode_runtime,
    numeric,
    parse_runtime_header,
    publish_file,
    remove_stale_temporaries,
    runtime_name,
    same_value,
    supersedes,
    sync_directory,
    writer,
)

# Write-backs run on their own threads (a write and its read-back block one thread each). On
# an object store a thread mostly waits for the server, so many overlap its round trips; on
# local disk a thread runs Python between its system calls, and each such thread takes the
# interpreter from the serving thread: with 8 of them a put of a 2 KiB KV block took 290-383 us
# of wall time while write-backs ran, against 128-136 us with 1 or 2 (docs/kv_cache.md), so
# local writes get 2.
_WRITE_THREADS = 8
_LOCAL_WRITE_THREADS = 2
# `RuntimeArea.write_many` on local disk: blocks per job, whose directory is synced once.
_GROUP = 8

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

# Lookups of unknown keys that found nothing are remembered (key -> when) for lookup_ttl seconds;
# at most this many, the oldest forgotten first, so memory stays bounded.
_MAX_MISSES = 65536
DEFAULT_LOOKUP_TTL = 1.0


def no_value_generation() -> bytes:
    """TensorStore's storage generation of a key that holds no value: a write conditional on it
    is a create-if-absent."""
    global _NO_VALUE
    if _NO_VALUE is None:
        kv = ts.KvStore.open({"driver": "memory"}).result()
        _NO_VALUE = kv.read("absent").result().stamp.generation
    return _NO_VALUE


_NO_VALUE: bytes | None = None


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
        shared: bool = False,
        lookup_ttl: float = DEFAULT_LOOKUP_TTL,
    ) -> None:
        """Use `open_area` instead of calling this.

        Args:
          kvstore: the location's kvstore (runtime blocks are under ``_runtime/`` in it).
          label: the location, as named in error messages.
          root: the local directory of a file location (written directly, atomically), else None.
          keys: the runtime keys found there on open (headers are read lazily).
          timeout: the deadline of each blocking call (header reads, write-backs).
          read_only: refuse writes.
          shared: many processes write the area: blocks are published once and immutable.
          lookup_ttl: seconds a lookup of an unknown key that found nothing is remembered.
        """
        self.kv = kvstore
        self.label = label
        self.root = root
        self._timeout = timeout
        self._read_only = read_only
        self.shared = shared
        self._lookup_ttl = lookup_ttl
        self._misses: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.lock = threading.Lock()
        # key -> BlockInfo, or None until its header is read (blocks found by listing on open).
        self.table: dict[str, BlockInfo | None] = dict.fromkeys(keys)
        # key -> (write future, value) for writes still in flight; reads are answered from value.
        self.pending: dict[str, tuple[Any, np.ndarray]] = {}
        self.version = 0  # bumped when a key is added (for the store's keys() cache)

    def __contains__(self, key: str) -> bool:
        return key in self.table

    @property
    def timeout(self) -> float | None:
        """The deadline of each blocking call, in seconds (None: none)."""
        return self._timeout

    def keys(self) -> tuple[str, ...]:
        """The runtime keys, in the order they were found or first written."""
        with self.lock:
            return tuple(self.table)

    def info(self, key: str) -> BlockInfo | None:
        """The block's metadata, or None if there is no such runtime block.

        A key the area does not know is looked up in the store (see the module docstring).

        Raises:
          CorruptBlockError: the block's header is damaged.
          StoreError: the store could not be asked (StoreTimeoutError past the deadline).
        """
        with self.lock:
            known = key in self.table
            info = self.table.get(key)
        if not known:
            return self._discover(key)
        return info if info is not None else self._load_info(key)

    def read(self, key: str) -> StoreFuture:
        """Starts reading a runtime block known to the table.

        Its ``result()`` checks the block against the table's metadata: a block replaced by
        another of a different shape or dtype since its header was read is a `StoreError`
        (the table reads the header again next time), never a block of an unexpected size. In a
        shared area, a block that vanished is a `KeyError` and leaves the table.
        """
        with self.lock:
            pending = self.pending.get(key)
            expect = self.table.get(key)
        if pending is not None:
            return ReadyFuture(pending[1], copy=True)
        name = runtime_name(key)
        return RuntimeReadFuture(
            self.kv.read(name), key, self.label, self.where(name),
            expect=expect, changed=self._changed, gone=self._gone if self.shared else None,
        )  # fmt: skip

    def forget(self, key: str) -> None:
        """Drops ``key`` from the table (its block was removed from the store)."""
        with self.lock:
            if key in self.table:
                del self.table[key]
                self.version += 1

    def _gone(self, key: str) -> KeyError:
        """A shared block that vanished: the table forgets it; the error its reader gets."""
        self.forget(key)
        return KeyError(
            f"runtime block {key!r} is no longer in shared store {self.label}: it was removed "
            "(trim_runtime or a lifecycle rule) after it was found; compute it again and put it"
        )

    def _changed(self, key: str, got: BlockInfo, expected: BlockInfo) -> StoreError:
        """A block whose stored shape or dtype is not the table's: the header is read again
        next time; the error its reader gets."""
        with self.lock:
            if key in self.table and key not in self.pending:
                self.table[key] = None
        return StoreError(
            f"runtime block {key!r} in store {self.label} was replaced by another process since "
            f"its header was read (now {got.shape} {got.dtype}, was {expected.shape} "
            f"{expected.dtype}); nothing was served. A store written by several processes "
            "should be opened with open_store(..., shared=True), whose blocks are immutable"
        )

    def _discover(self, key: str) -> BlockInfo | None:
        """Looks up a key the table does not know in the store (another process may have
        written it); remembers what it found, and for ``lookup_ttl`` that it found nothing."""
        if not key or KEY_SEPARATOR in key:
            return None
        now = time.monotonic()
        with self.lock:
            missed = self._misses.get(key)
            if missed is not None and now - missed < self._lookup_ttl:
                return None
        try:
            check_runtime_key(key, self.label)
        except (TypeError, ValueError):
            return None
        name = runtime_name(key)
        head = self._probe(name)
        if head is None:
            with self.lock:
                self._misses[key] = now
                self._misses.move_to_end(key)
                while len(self._misses) > _MAX_MISSES:
                    self._misses.popitem(last=False)
            return None
        header, _ = parse_runtime_header(head, key, self.label, self.where(name))
        info = _info_of(key, header)
        with self.lock:
            self._misses.pop(key, None)
            if key not in self.table:
                self.table[key] = info
                self.version += 1
            return self.table[key] or info

    def _probe(self, name: str) -> bytes | None:
        """The header bytes of kvstore key ``name``, or None if there is no such block."""
        if self.root is None:
            return self._read_head(name, Deadline(self._timeout))[1]
        try:
            with open(os.path.join(self.root, name), "rb") as f:
                return _local_head(f)
        except FileNotFoundError:
            return None

    def write(
        self, key: str, value: np.ndarray | jax.Array, *, version: Version | None = None
    ) -> WriteFuture:
        """Starts writing a runtime block; see `TensorStoreStore.write`."""
        name, data, arr, info = self._prepare(key, value, version)
        with self.lock:
            future = self._pool().submit(self._write_sync, key, name, data, version)
            self._register(key, info, future, arr)

        def _done(f: Any) -> None:
            with self.lock:
                self._settle(key, f, f.exception() is not None or f.result() == SUPERSEDED)

        future.add_done_callback(_done)
        return WriteFuture(future, key, self.label, self.where(name))

    def write_many(self, items: Sequence[tuple[str, Any, Version | None]]) -> Future:
        """Starts writing several runtime blocks ``(key, value, version)``, as `write` of each
        would, with one future for all of them.

        Its result is one outcome per item, in order: `WRITTEN`, `SUPERSEDED`, or the exception
        that item's `write` would have raised (at once, or from its future's ``result()``). On
        local disk the blocks go to the writer threads in groups, and each group's directory is
        synced once, after its renames and before any of them counts as written; elsewhere each
        block is its own job, as in `write`. Reads see every block from the moment this returns.
        A key should appear once: two writes of one key in one call race, as two `write` calls
        do (with versions, the newer one is what the store keeps).
        """
        outcomes: list[Any] = [None] * len(items)
        jobs = []
        for i, (key, value, version) in enumerate(items):
            try:
                name, data, arr, info = self._prepare(key, value, version)
            except Exception as err:  # what `write` raises at once
                outcomes[i] = err
                continue
            jobs.append((i, key, name, data, version, arr, info))
        batch: Future = Future()
        if not jobs:
            batch.set_result(outcomes)
            return batch
        size = _GROUP if self.root is not None and not self.shared else 1
        groups = [jobs[g : g + size] for g in range(0, len(jobs), size)]
        left = [len(groups)]

        def run(group: list) -> None:
            for i, key, name, data, version, _, _ in group:
                try:
                    outcomes[i] = self._write_sync(key, name, data, version, sync_dir=False)
                except BaseException as err:
                    outcomes[i] = write_error(err, key, self.label, self.where(name))
            if size > 1 and any(outcomes[i] == WRITTEN for i, *_ in group):
                try:  # (every runtime block file is in one directory)
                    sync_directory(os.path.dirname(os.path.join(self.root, group[0][2])))
                except Exception as err:  # the renames may not survive a power loss: not written
                    for i, key, name, *_ in group:
                        if outcomes[i] == WRITTEN:
                            outcomes[i] = write_error(err, key, self.label, self.where(name))
            with self.lock:
                for i, key, *_ in group:
                    self._settle(key, batch, outcomes[i] != WRITTEN)
                left[0] -= 1
                last = not left[0]
            if last:
                batch.set_result(outcomes)

        with self.lock:
            for _, key, _, _, _, arr, info in jobs:
                self._register(key, info, batch, arr)
            pool = self._pool()
            for group in groups:
                pool.submit(run, group)
        return batch

    def _pool(self) -> Any:
        """The writer threads of this area's writes (see `_LOCAL_WRITE_THREADS`)."""
        if self.root is not None:
            return thread_pool("write-local", _LOCAL_WRITE_THREADS)
        return thread_pool("write", _WRITE_THREADS)

    def _prepare(
        self, key: str, value: Any, version: Version | None
    ) -> tuple[str, bytes, Any, BlockInfo]:
        """Checks and encodes a block to write: its file name, bytes, host copy and metadata.

        Raises:
          TypeError, ValueError: as `TensorStoreStore.write` says.
        """
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
        if self.shared:
            data = encode_runtime(arr, published=time.time())
        else:
            data = encode_runtime(arr, version)
        return name, data, arr, info

    def _register(self, key: str, info: BlockInfo, future: Any, arr: Any) -> None:
        """Under the lock: a write of ``key`` started; reads are answered from ``arr`` until it
        ends (`_settle`)."""
        self._misses.pop(key, None)
        if key not in self.table:
            self.version += 1
        self.table[key] = info
        self.pending[key] = (future, arr)

    def _settle(self, key: str, future: Any, unknown: bool) -> None:
        """Under the lock: the write of ``key`` under ``future`` ended; ``unknown``: it failed or
        was superseded, so what the store holds is not its value (the header is read again)."""
        if self.pending.get(key, (None,))[0] is future:
            del self.pending[key]
            if unknown:
                self.table[key] = None

    def where(self, name: str) -> str:
        """Where kvstore key ``name`` lives, for error messages."""
        return location(self.label, name)

    def _write_sync(
        self, key: str, name: str, data: bytes, version: Version | None, *, sync_dir: bool = True
    ) -> str:
        """Publishes one runtime block file atomically and reads it back (on a writer thread).

        With a ``version``, the block is published only if the store does not hold a later
        write of the same writer (compare-and-publish): on local disk under a lock of this
        process, on other kvstores by a write conditional on the generation whose header was
        read. ``sync_dir=False`` (local disk): the caller syncs the directory after the rename.

        Returns:
          `WRITTEN`, or `SUPERSEDED` when a later version was there (nothing was written).
        """
        deadline = Deadline(self._timeout)
        what = f"writing {self.where(name)}"
        if self.shared:
            return self._publish_once(key, name, data, deadline)
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
                atomic_write_file(path, data, sync_dir=sync_dir)
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
                f"(expected {len(data)} bytes); the block stays in memory and is retried. If "
                "another process writes this key too, open the store with "
                "open_store(..., shared=True): its blocks are published once"
            )
        return WRITTEN

    def _stored_supersedes(self, key: str, name: str, version: Version, path: str) -> bool:
        """Whether the local file at ``path`` holds a later write of ``version``'s writer."""
        try:
            with open(path, "rb") as f:
                head = _local_head(f)
        except FileNotFoundError:
            return False
        return self._header_supersedes(key, name, head, version)

    def _publish_once(self, key: str, name: str, data: bytes, deadline: Deadline) -> str:
        """Publishes a block of a shared area (see the module docstring); returns `WRITTEN`
        once the store holds its value, published by this call or by another writer.

        Raises:
          ConflictError: the store holds another value under ``key``.
          StoreError: the write or its read-back failed.
        """
        where = self.where(name)
        for _ in range(_PUBLISH_RETRIES):
            if self.root is not None:
                path = os.path.join(self.root, name)
                created = publish_file(path, data)
                try:
                    with open(path, "rb") as f:
                        stored, generation = f.read(), b""
                except FileNotFoundError:
                    continue  # removed meanwhile (trimmed): publish again
            else:
                created = self._create(name, data, deadline)
                res = wait_for(self.kv.read(name), deadline, f"reading back {where}")
                if res.state != "value":
                    continue
                stored, generation = res.value, res.stamp.generation
            if stored == data or same_value(stored, data):
                return WRITTEN
            if not damaged(stored):
                raise ConflictError(
                    f"runtime block {key!r} in shared store {self.label} ({where}) already "
                    "holds other bytes"
                    + (" (another writer replaced ours)" if created else "")
                    + ": blocks of a shared store are immutable, so this write-back is refused "
                    "and the cache serves the published block instead of its own. Two "
                    "processes computed different values for one key: put what the value "
                    "depends on into the key (the salt of prefix_keys)"
                )
            self._replace_damaged(name, data, generation, deadline)
        raise StoreError(
            f"publishing runtime block {key!r} to shared store {self.label} ({where}): the "
            f"object kept changing under {_PUBLISH_RETRIES} tries; the block stays in memory "
            "and is retried"
        )

    def _create(self, name: str, data: bytes, deadline: Deadline) -> bool:
        """Writes kvstore key ``name`` only if it holds nothing; whether this write created it."""
        stamp = wait_for(
            self.kv.write(name, data, if_equal=no_value_generation()),
            deadline,
            f"writing {self.where(name)}",
        )
        return stamp.generation != b""

    def _replace_damaged(self, name: str, data: bytes, generation: bytes, deadline: Deadline) -> None:
        """Replaces a damaged block (it failed its checks: nobody serves it) with ``data``."""
        if self.root is not None:
            atomic_write_file(os.path.join(self.root, name), data)
            return
        wait_for(
            self.kv.write(name, data, if_equal=generation),
            deadline,
            f"replacing the damaged {self.where(name)}",
        )

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

    def _load_info(self, key: str) -> BlockInfo | None:
        """Reads a listed runtime block's header (one ranged read) and remembers its info
        (None: a shared block that was removed)."""
        name = runtime_name(key)
        where = self.where(name)
        try:
            deadline = Deadline(self._timeout)
            what = f"reading the header of {where}"
            head = self.kv.read(name, byte_range=slice(0, RUNTIME_MIN_HEADER))
            res = wait_for(head, deadline, what)
            if res.state != "value":
                if self.shared:  # removed from the shared store: as if never written
                    self.forget(key)
                    return None
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
        info = _info_of(key, header)
        with self.lock:
            if self.table.get(key, info) is None:
                self.table[key] = info
            return self.table.get(key) or info


def _info_of(key: str, header: dict) -> BlockInfo:
    """A runtime block's `BlockInfo` from its parsed header."""
    shape, dtype = header["shape"], header["dtype"]
    return BlockInfo(
        key=key,
        shape=shape,
        dtype=dtype,
        nbytes=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
        leaves=header.get("leaves", ()),
    )


def _local_head(f: Any) -> bytes:
    """The header bytes of an open local block file (all of it if shorter than a header)."""
    head = f.read(RUNTIME_MIN_HEADER)
    if len(head) >= 12:
        size = int.from_bytes(head[8:12], "little")
        if size > len(head):
            head += f.read(size - len(head))
    return head


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
    shared: bool = False,
    lookup_ttl: float = DEFAULT_LOOKUP_TTL,
) -> RuntimeArea:
    """The runtime area of a store: ``runtime`` if given, else its own location (``own``), else
    (a read-only checkpoint) the default one in the user's cache folder. A ``shared`` area on
    S3 writes with S3's own conditional requests (``If-None-Match``), which the server checks
    atomically, instead of a read then a write."""
    timeout = deadline.seconds
    settings = dict(timeout=timeout, shared=shared, lookup_ttl=lookup_ttl)
    if runtime is None and own is not None:
        kv, where, root, keys = own
        if root is not None:
            clean_local(root)
        if shared:
            kv = _conditional(kv.spec().to_json(), where, context, deadline) or kv
        return RuntimeArea(kvstore=kv, label=where, root=root, keys=keys, **settings)
    if runtime is None:
        runtime = default_runtime_dir(label)
    rt_spec, rt_label, rt_local = resolve(runtime, s3_endpoint, s3_region)
    rt_kv = (shared and _conditional(rt_spec, rt_label, context, deadline)) or open_kvstore(
        rt_spec, rt_label, context=context, deadline=deadline
    )
    # A runtime location that does not exist yet lists nothing; it is made by the first write.
    keys = runtime_keys(list_keys(rt_kv, rt_label, deadline))
    root = str(rt_local) if rt_local is not None else None
    if root is not None:
        clean_local(root)
    return RuntimeArea(kvstore=rt_kv, label=rt_label, root=root, keys=keys, **settings)


def _conditional(
    spec: dict[str, Any], label: str, context: ts.Context, deadline: Deadline
) -> ts.KvStore | None:
    """The S3 kvstore ``spec`` with conditional writes sent as S3 conditional requests (None
    for other drivers, or where the spec chose already)."""
    if spec.get("driver") != "s3" or "use_conditional_write" in spec:
        return None
    return open_kvstore(
        {**spec, "use_conditional_write": True}, label, context=context, deadline=deadline
    )
