"""The L3 store: TensorStore arrays (zarr3 stores and orbax checkpoints) read block by block.

Design note. A block is one chunk of one stored array, so a block read is exactly one chunk read
in TensorStore: no read amplification, and the chunk's own checksum covers the whole block. The
store is opened once: it lists the arrays, opens every array handle concurrently and builds a
``key -> (BlockInfo, handle, slices)`` table, so ``info`` is a dict lookup and ``read`` is one
indexing of an open handle plus ``.read()``. Nothing is cached here: L2 is the host cache, so
TensorStore's ``cache_pool`` is set to 0 bytes (see ``_CONTEXT_SPEC``).

Fast path. For chunks of zarr3 arrays on local disk whose codecs are exactly ``bytes`` (little
endian) + ``crc32c`` -- every array ``write_store`` writes -- TensorStore's decode (checksum, then
a copy into a fresh array, limited by ``data_copy_concurrency``) cost more than the disk read.
Such a chunk file is read by a reader thread with ``preadv`` straight into a 64-byte aligned
buffer, checked with google_crc32c over the whole file (payload + stored CRC gives a constant
residue) and returned as a view of that buffer: one copy, the kernel's. zarr3 stores edge chunks
at full chunk shape, so an edge block is the clipped slice (copied, so that it does not pin the
whole chunk). A chunk file that does not exist (the fill value) is read by TensorStore. Other
kvstores are not worth it: ``ts.KvStore.ReadResult.value`` copies the bytes twice, which measured
slower than TensorStore's own decode.

Three kinds of location are understood by :func:`open_store`:

* a cacheflow store: zarr3 arrays under a root (written by :func:`write_store`, or any zarr3
  hierarchy); the array path is the array's directory relative to the root, ``/``-separated;
* an orbax checkpoint (an item directory holding ``_METADATA`` / ``manifest.ocdbt``, or a
  ``CheckpointManager`` step directory holding exactly one item), read in place through the
  ``ocdbt`` kvstore; the array path is the orbax tree path joined with ``/`` (``layers/0/w``);
* runtime blocks (keys without ``@``, e.g. KV blocks) written with :meth:`TensorStoreStore.write`
  into ``_runtime/`` under the root, one small self-describing file per block (see
  ``_RUNTIME_FORMAT``). They are found again on open by listing that prefix; their headers are
  read lazily, on the first ``info`` of each.

:meth:`TensorStoreStore.tree` returns the stored pytree's skeleton (nested dicts and lists whose
leaves are array paths), shaped like ``ocp.StandardCheckpointer().restore(path)`` for orbax
checkpoints and like the tree given to :func:`write_store` for cacheflow stores.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time
import types
import urllib.parse
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16, float8_*, int4 with numpy by name)
import numpy as np
import tensorstore as ts

try:
    import google_crc32c
except ImportError:  # a declared dependency; without it every chunk is read by TensorStore
    google_crc32c = None

from cacheflow_jax._blocks import (
    KEY_SEPARATOR,
    ArrayInfo,
    BlockInfo,
    CorruptBlockError,
    StoreError,
    block_key,
)

__all__ = ["TensorStoreStore", "open_store", "write_store"]

# One context for every store in the process.
# * cache_pool 0: the cache's L2 tier is the host cache; a TensorStore chunk cache would hold a
#   second copy of the same bytes outside any budget and make "cold" L3 reads warm.
# * cache_pool#ocdbt: orbax checkpoints are read through the ocdbt kvstore, whose manifest and
#   b-tree nodes would otherwise be re-read for every chunk; these nodes are small metadata, not
#   block data, so a bounded cache for them does not duplicate L2.
# * data_copy_concurrency: decoding (checksum, copy out) is CPU work; one thread per core.
# * file_io_concurrency: block reads are many small independent reads issued at once by the
#   prefetcher; SSDs need a deep queue to reach their bandwidth, and blocked threads are cheap.
# * memory://: the memory kvstore lives in this context, so write_store and open_store in one
#   process see the same data.
_CONTEXT_SPEC: dict[str, Any] = {
    "cache_pool": {"total_bytes_limit": 0},
    "cache_pool#ocdbt": {"total_bytes_limit": 64 * 2**20},
    "data_copy_concurrency": {"limit": max(2, os.cpu_count() or 2)},
    "file_io_concurrency": {"limit": max(32, 8 * (os.cpu_count() or 2))},
}
_CONTEXT = ts.Context(_CONTEXT_SPEC)

_CODECS: list[dict[str, Any]] = [
    {"name": "bytes", "configuration": {"endian": "little"}},
    {"name": "crc32c"},
]
_RUNTIME_PREFIX = "_runtime/"
_RUNTIME_SUFFIX = ".block"
_ORBAX_MARKERS = ("_METADATA", "manifest.ocdbt")
_ATTR = "cacheflow"

# The fast chunk path (see TensorStoreStore.read): zarr3 chunks whose codecs are exactly
# bytes (little endian) + crc32c are read as raw chunk files with the kvstore and checked here.
# google_crc32c's C implementation runs at several GB/s and releases the GIL for bytes objects
# of 1 MiB and more; its pure-Python fallback would be far slower than TensorStore, so only the
# C one is used.
_CRC32C: Callable[[bytes], int] | None = (
    google_crc32c.value
    if google_crc32c is not None and getattr(google_crc32c, "implementation", "") == "c"
    else None
)
# CRC-32C of (data + its own CRC-32C, little endian) is this constant for every data, so a chunk
# file is checked with one pass over the whole bytes object (no copy of the payload).
_CRC32C_RESIDUE = 0x48674BC7
# zarr3 data types whose ``bytes`` codec layout is numpy's little-endian layout of the same
# dtype. bool is left to TensorStore (a stored byte other than 0/1 must not become a bool), and
# so are packed sub-byte types (int4, ...).
_FAST_DTYPES = frozenset(
    {
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
        "bfloat16",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e4m3b11fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    }
)

_RUNTIME_FORMAT = """\
A runtime block file (``_runtime/<percent-encoded key>.block``) is:
  bytes 0-7   magic b"CFJBLK1\\n"
  bytes 8-11  header length H (uint32, little endian; H >= 256, a multiple of 64)
  bytes 12-H  JSON {"dtype": name, "shape": [...], "crc32": zlib.crc32(payload)}, space padded
  bytes H-    payload: the array's bytes, C order, little endian
The fixed minimum header lets a header be read with one ranged read; the CRC makes a damaged file
an error instead of wrong data. Each file is written with a single kvstore write, which is atomic
on the file driver (write to a temporary file, then rename) and on object stores, so a crash
never leaves a half-written block that reads as valid.
"""
_RUNTIME_MAGIC = b"CFJBLK1\n"
_RUNTIME_MIN_HEADER = 256

_HOW_TO_CREATE = (
    "Create a store with cacheflow_jax.write_store(tree, path) or `cacheflow demo`, or point at "
    "an orbax checkpoint directory"
)
_HOW_TO_LIST = "list the store's keys with store.keys() or `cacheflow inspect <store>`"
_HOW_TO_REPAIR = (
    "The stored bytes are damaged; re-write the store from its source "
    "(write_store(tree, path, overwrite=True)) or restore the file from a backup"
)

KeyKind = jax.tree_util.DictKey | jax.tree_util.SequenceKey


# --------------------------------------------------------------------------------------------
# Futures


def _translate(err: BaseException, key: str, store: str, where: str) -> BaseException:
    """Maps a TensorStore error for block ``key`` to a cacheflow error."""
    msg = str(err)
    if "DATA_LOSS" in msg:
        return CorruptBlockError(
            f"block {key!r} in store {store} is corrupt ({where}): {msg}. {_HOW_TO_REPAIR}."
        )
    return StoreError(f"reading block {key!r} from store {store} ({where}) failed: {msg}")


class _ChunkFuture:
    """A pending chunk read; ``result()`` returns the block's numpy array."""

    __slots__ = ("_future", "_key", "_store", "_where")

    def __init__(self, future: ts.Future, key: str, store: str, where: str) -> None:
        self._future = future
        self._key = key
        self._store = store
        self._where = where

    def result(self, timeout: float | None = None) -> np.ndarray:
        """Waits for the read and returns the block.

        Raises:
          CorruptBlockError: the chunk failed its checksum.
          StoreError: any other read error.
          TimeoutError: ``timeout`` passed first.
        """
        try:
            return self._future.result(timeout=timeout)
        except (TimeoutError, StoreError):
            raise
        except Exception as err:  # TensorStore raises ValueError carrying an absl status
            raise _translate(err, self._key, self._store, self._where) from err

    def done(self) -> bool:
        """True once the read finished (successfully or not)."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[[_ChunkFuture], object]) -> None:
        """Calls ``fn(self)`` when the read finishes (on a TensorStore thread)."""
        self._future.add_done_callback(lambda _: fn(self))


class _FastChunkFuture:
    """A pending fast-path chunk read (see :meth:`TensorStoreStore.read`).

    The chunk file is read and checked on a thread of ``_file_pool()``; ``result()`` returns the
    block. A chunk without a file (never written: the zarr fill value) is read through
    TensorStore by ``result()``, which fills it exactly as the TensorStore path does.
    """

    __slots__ = ("_future", "_store", "_entry")

    def __init__(self, future: Future, store: TensorStoreStore, entry: _Entry) -> None:
        self._future = future
        self._store = store
        self._entry = entry

    def result(self, timeout: float | None = None) -> np.ndarray:
        """Waits for the read and returns the block.

        Raises:
          CorruptBlockError: the chunk file failed its CRC32C or has the wrong size.
          StoreError: any other read error.
          TimeoutError: ``timeout`` passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        value = self._future.result(timeout=timeout)  # TimeoutError, or the reader's error
        if value is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self._store._read_ts(self._entry).result(timeout=left)
        return value

    def done(self) -> bool:
        """True once the chunk file was read (a missing file is then filled in ``result()``)."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[[_FastChunkFuture], object]) -> None:
        """Calls ``fn(self)`` when the read finishes (on a reader thread)."""
        self._future.add_done_callback(lambda _: fn(self))


_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool)
_POOL_LOCK = threading.Lock()


def _file_pool() -> ThreadPoolExecutor:
    """The reader threads of the fast path: as many as TensorStore's file_io_concurrency.

    Made on first use, and again in a forked child (whose copy of the pool has no threads).
    """
    global _POOL
    pool = _POOL
    if pool is None or pool[0] != os.getpid():
        with _POOL_LOCK:
            pool = _POOL
            if pool is None or pool[0] != os.getpid():
                executor = ThreadPoolExecutor(
                    _CONTEXT_SPEC["file_io_concurrency"]["limit"],
                    thread_name_prefix="cacheflow-read",
                )
                pool = _POOL = (os.getpid(), executor)
    return pool[1]


def _read_chunk_file(entry: _Entry, store: str) -> np.ndarray | None:
    """Reads and checks one chunk file (on a reader thread); None if the file does not exist.

    The file is read with ``preadv`` straight into a fresh 64-byte aligned buffer (the only
    copy; XLA's CPU client can then use the block without copying it again), its CRC32C is
    checked over the whole file, and the block is a view of the buffer.
    """
    fast = entry.fast
    path = entry.fast_key
    assert fast is not None and path is not None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as err:
        raise StoreError(
            f"reading block {entry.info.key!r} from store {store} ({entry.where}) failed: {err}"
        ) from err
    try:
        size = os.fstat(fd).st_size
        expected = fast.nbytes + 4
        if size != expected:
            raise _corrupt(
                entry,
                store,
                f"the chunk file holds {size} bytes, expected {expected} "
                f"({fast.count} x {fast.dtype} and a 4-byte crc32c)",
            )
        raw = np.empty(size + 64, np.uint8)
        start = -raw.ctypes.data % 64
        buf = raw[start : start + size]
        view = memoryview(buf)
        got = 0
        while got < size:
            n = os.preadv(fd, [view[got:]], got)
            if n == 0:
                raise _corrupt(entry, store, f"the chunk file ended after {got} of {size} bytes")
            got += n
        view.release()
    except OSError as err:
        if isinstance(err, StoreError):
            raise
        raise StoreError(
            f"reading block {entry.info.key!r} from store {store} ({entry.where}) failed: {err}"
        ) from err
    finally:
        os.close(fd)
    buf.flags.writeable = False  # google_crc32c takes read-only buffers only
    if _CRC32C(buf) != _CRC32C_RESIDUE:
        stored = int.from_bytes(buf[-4:].tobytes(), "little")
        raise _corrupt(
            entry,
            store,
            f"crc32c digest mismatch, stored digest is 0x{stored:08x} but computed digest is "
            f"0x{_CRC32C(buf[:-4]):08x}",
        )
    arr = buf[: fast.nbytes].view(fast.dtype).reshape(fast.chunk_shape)
    # An edge chunk is stored at full chunk shape; copy out the block so that the cache does
    # not keep the whole chunk's bytes alive for a smaller block.
    return arr if entry.clip is None else arr[entry.clip].copy()


def _corrupt(entry: _Entry, store: str, why: str) -> CorruptBlockError:
    """The error for a damaged chunk file, worded as for TensorStore's own checks."""
    return CorruptBlockError(
        f"block {entry.info.key!r} in store {store} is corrupt ({entry.where}): DATA_LOSS: "
        f"{why}. {_HOW_TO_REPAIR}."
    )


class _FastArray:
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


class _RuntimeReadFuture:
    """A pending runtime-block read; decodes and checks the block file on ``result()``."""

    __slots__ = ("_future", "_key", "_store", "_where")

    def __init__(self, future: ts.Future, key: str, store: str, where: str) -> None:
        self._future = future
        self._key = key
        self._store = store
        self._where = where

    def result(self, timeout: float | None = None) -> np.ndarray:
        """Waits for the read and returns the block.

        Raises:
          CorruptBlockError: the block file is truncated or failed its CRC.
          StoreError: the file vanished or could not be read.
          TimeoutError: ``timeout`` passed first.
        """
        try:
            res = self._future.result(timeout=timeout)
        except TimeoutError:
            raise
        except Exception as err:
            raise _translate(err, self._key, self._store, self._where) from err
        if res.state != "value":
            raise StoreError(
                f"runtime block {self._key!r} in store {self._store} is listed but its file "
                f"{self._where} is missing; another process may have deleted it"
            )
        return _decode_runtime(res.value, self._key, self._store, self._where)

    def done(self) -> bool:
        """True once the read finished."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[[_RuntimeReadFuture], object]) -> None:
        """Calls ``fn(self)`` when the read finishes (on a TensorStore thread)."""
        self._future.add_done_callback(lambda _: fn(self))


class _ReadyFuture:
    """A read answered from a write still in flight: the bytes being written, copied."""

    __slots__ = ("_value",)

    def __init__(self, value: np.ndarray) -> None:
        self._value = value

    def result(self, timeout: float | None = None) -> np.ndarray:
        """Returns a copy of the value being written."""
        return self._value.copy()

    def done(self) -> bool:
        """Always True."""
        return True

    def add_done_callback(self, fn: Callable[[_ReadyFuture], object]) -> None:
        """Calls ``fn(self)`` now."""
        fn(self)


class _WriteFuture:
    """A pending runtime-block write; ``result()`` returns ``None`` once the block is durable."""

    __slots__ = ("_future", "_key", "_store", "_where")

    def __init__(self, future: ts.Future, key: str, store: str, where: str) -> None:
        self._future = future
        self._key = key
        self._store = store
        self._where = where

    def result(self, timeout: float | None = None) -> None:
        """Waits for the write.

        Raises:
          StoreError: the write failed.
          TimeoutError: ``timeout`` passed first.
        """
        try:
            self._future.result(timeout=timeout)
        except TimeoutError:
            raise
        except Exception as err:
            raise StoreError(
                f"writing runtime block {self._key!r} to store {self._store} ({self._where}) "
                f"failed: {err}"
            ) from err

    def done(self) -> bool:
        """True once the write finished."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[[_WriteFuture], object]) -> None:
        """Calls ``fn(self)`` when the write finishes (on a TensorStore thread)."""
        self._future.add_done_callback(lambda _: fn(self))


# --------------------------------------------------------------------------------------------
# Runtime block files


def _numeric(dtype: np.dtype) -> bool:
    """True for dtypes TensorStore stores: bool, ints, floats (incl. bfloat16), complex."""
    if dtype.kind in "OUSM" or dtype.names is not None or dtype.type is np.void:
        return False
    try:
        ts.dtype(dtype)
    except (TypeError, ValueError):
        return False
    return True


def _runtime_name(key: str) -> str:
    """The kvstore key (relative to the store root) of runtime block ``key``."""
    return _RUNTIME_PREFIX + urllib.parse.quote(key, safe="-_~") + _RUNTIME_SUFFIX


def _encode_runtime(value: np.ndarray) -> bytes:
    """Serializes one runtime block (see ``_RUNTIME_FORMAT``)."""
    if value.dtype.byteorder == ">":
        value = value.astype(value.dtype.newbyteorder("<"))
    payload = np.ascontiguousarray(value).tobytes()
    header = json.dumps(
        {"dtype": value.dtype.name, "shape": list(value.shape), "crc32": zlib.crc32(payload)}
    ).encode()
    size = max(_RUNTIME_MIN_HEADER, -(-(12 + len(header) + 1) // 64) * 64)
    head = _RUNTIME_MAGIC + struct.pack("<I", size) + header
    return head + b" " * (size - len(head)) + payload


def _parse_runtime_header(data: bytes, key: str, store: str, where: str) -> tuple[dict, int]:
    """Returns a runtime block file's header dict and header length."""
    if len(data) < 12 or data[:8] != _RUNTIME_MAGIC:
        raise CorruptBlockError(
            f"runtime block {key!r} in store {store} ({where}) does not start with the block "
            f"magic {_RUNTIME_MAGIC!r}. {_HOW_TO_REPAIR}."
        )
    (size,) = struct.unpack("<I", data[8:12])
    if len(data) < size:
        return {}, size
    try:
        header = json.loads(data[12:size])
        header["shape"] = tuple(int(s) for s in header["shape"])
        header["dtype"] = np.dtype(header["dtype"])
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptBlockError(
            f"runtime block {key!r} in store {store} ({where}) has a bad header: {err}. "
            f"{_HOW_TO_REPAIR}."
        ) from None
    return header, size


def _decode_runtime(data: bytes, key: str, store: str, where: str) -> np.ndarray:
    """Parses and checks one runtime block file."""
    header, size = _parse_runtime_header(data, key, store, where)
    payload = data[size:]
    dtype, shape = header.get("dtype"), header.get("shape")
    expected = None if dtype is None else int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if expected != len(payload) or zlib.crc32(payload) != header.get("crc32"):
        raise CorruptBlockError(
            f"runtime block {key!r} in store {store} is corrupt ({where}): size or CRC32 "
            f"mismatch. {_HOW_TO_REPAIR}."
        )
    return np.frombuffer(payload, dtype=dtype).reshape(shape).copy()


# --------------------------------------------------------------------------------------------
# Locations


def _join(kv: Mapping[str, Any], sub: str) -> dict[str, Any]:
    """The kvstore spec ``kv`` with ``sub`` appended to its path."""
    out = dict(kv)
    out["path"] = str(kv.get("path", "")) + sub
    return out


def _dir_spec(kv: Mapping[str, Any]) -> dict[str, Any]:
    """``kv`` with a path that ends in '/' (or is empty), so sub-paths join as directories."""
    out = dict(kv)
    path = str(out.get("path", ""))
    if path and not path.endswith("/"):
        out["path"] = path + "/"
    return out


def _s3_spec(bucket: str, prefix: str, endpoint: str | None, region: str | None) -> dict[str, Any]:
    """The kvstore spec of ``s3://bucket/prefix``, with endpoint/region from args or env."""
    endpoint = (
        endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint and not region:
        # S3-compatible servers (moto, MinIO) answer as us-east-1; without a region TensorStore
        # would try to discover it from the bucket, which these servers do not all support.
        region = "us-east-1"
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": prefix}
    if endpoint:
        spec["endpoint"] = endpoint
    if region:
        spec["aws_region"] = region
    return spec


def _resolve(
    spec_or_path: str | os.PathLike[str] | Mapping[str, Any],
    s3_endpoint: str | None,
    s3_region: str | None,
) -> tuple[dict[str, Any], str, Path | None]:
    """Turns a path, URL or kvstore spec into (kvstore spec, label, local directory or None)."""
    if isinstance(spec_or_path, Mapping):
        kv = dict(spec_or_path)
        if "kvstore" in kv and "driver" in kv and kv["driver"] in ("zarr3", "zarr"):
            kv = dict(kv["kvstore"])
        if "driver" not in kv:
            raise ValueError(
                f"kvstore spec {spec_or_path!r} has no 'driver'; pass e.g. "
                "{'driver': 'file', 'path': '/data/store'}"
            )
        kv = _dir_spec(kv)
        local = Path(kv["path"]) if kv["driver"] == "file" else None
        try:
            label = ts.KvStore.Spec(kv).url
        except Exception:  # not every driver has a URL form
            label = json.dumps(kv, sort_keys=True)
        return kv, label, local
    text = os.fspath(spec_or_path)
    scheme, sep, rest = text.partition("://")
    if not sep:
        local = Path(text).expanduser().absolute()
        return {"driver": "file", "path": str(local) + "/"}, str(local), local
    if scheme == "file":
        local = Path(urllib.parse.unquote(rest)).absolute()
        return {"driver": "file", "path": str(local) + "/"}, str(local), local
    if scheme == "memory":
        return _dir_spec({"driver": "memory", "path": rest}), text, None
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"{text!r} names no bucket; expected {scheme}://bucket/prefix")
        prefix = prefix.strip("/")
        prefix = prefix + "/" if prefix else ""
        if scheme == "s3":
            return _s3_spec(bucket, prefix, s3_endpoint, s3_region), text, None
        return {"driver": "gcs", "bucket": bucket, "path": prefix}, text, None
    raise ValueError(
        f"unsupported store URL {text!r}: expected a local path, file://, memory://, s3:// or "
        "gs:// URL, or a TensorStore kvstore spec dict"
    )


def _wait_all(futures: Iterable[ts.Future], what: str) -> list[Any]:
    """Waits for every future (all issued already) and raises StoreError on the first error."""
    out = []
    for f in futures:
        try:
            out.append(f.result())
        except Exception as err:
            raise StoreError(f"{what}: {err}") from err
    return out


# --------------------------------------------------------------------------------------------
# The store


class _Entry:
    """One chunk block: its info, the open array handle and its index expression; for the fast
    path also its chunk file's kvstore key, the array's chunk layout and the edge clipping."""

    __slots__ = ("info", "handle", "index", "where", "view", "fast", "fast_key", "clip")

    def __init__(self, info: BlockInfo, handle: ts.TensorStore, index: tuple, where: str) -> None:
        self.info = info
        self.handle = handle
        self.index = index
        self.where = where
        self.view: ts.TensorStore | None = None  # handle[index], made on first read
        self.fast: _FastArray | None = None
        self.fast_key: str | None = None  # the chunk file's absolute path
        self.clip: tuple[slice, ...] | None = None  # the block within its chunk, if smaller


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
    ) -> None:
        """Builds the block table; use :func:`open_store` instead of calling this.

        ``fast_arrays`` names the arrays whose chunk files are read directly (see :meth:`read`).
        """
        self._label = label
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
        fast_arrays = (fast_arrays or {}) if root is not None else {}
        for path, arr in self._arrays.items():
            handle = self._handles[path]
            fast = fast_arrays.get(path)
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
        self._pending: dict[str, tuple[ts.Future, np.ndarray]] = {}
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

    def read(self, key: str) -> _ChunkFuture | _FastChunkFuture | _RuntimeReadFuture | _ReadyFuture:
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
                return _FastChunkFuture(future, self, entry)
            return self._read_ts(entry)
        with self._lock:
            if key not in self._runtime:
                raise self._missing(key)
            pending = self._pending.get(key)
        if pending is not None:
            return _ReadyFuture(pending[1])
        name = _runtime_name(key)
        return _RuntimeReadFuture(self._kv.read(name), key, self._label, self._where(name))

    def read_many(
        self, keys: Sequence[str]
    ) -> list[_ChunkFuture | _FastChunkFuture | _RuntimeReadFuture | _ReadyFuture]:
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

    def write(self, key: str, value: np.ndarray | jax.Array) -> _WriteFuture:
        """Starts writing a runtime block (for example a KV block) under ``_runtime/``.

        After this returns, ``info(key)``, ``read(key)`` and ``keys()`` see the block. The file
        is replaced atomically, so a crash leaves either the old block or the new one.

        Args:
          key: a non-empty key without ``@`` (chunk keys are read-only).
          value: the block; copied before this returns, so the caller may reuse the buffer.

        Returns:
          A future whose ``result()`` returns ``None`` once the block is durable.

        Raises:
          ValueError: ``key`` is empty or a chunk key, or ``value`` is not a numeric array.
        """
        if not key or KEY_SEPARATOR in key:
            raise ValueError(
                f"cannot write block {key!r} to store {self._label}: runtime block keys must be "
                f"non-empty and contain no {KEY_SEPARATOR!r} (chunks of stored arrays are "
                "read-only; re-write the store with write_store to change them)"
            )
        arr = np.array(value, copy=True, order="C")
        if not _numeric(arr.dtype):
            raise ValueError(
                f"cannot write block {key!r}: dtype {arr.dtype} is not a numeric array dtype"
            )
        info = BlockInfo(key=key, shape=arr.shape, dtype=arr.dtype, nbytes=arr.nbytes)
        name = _runtime_name(key)
        future = self._kv.write(name, _encode_runtime(arr))
        with self._lock:
            if key not in self._runtime:
                self._keys_cache = None
            self._runtime[key] = info
            self._pending[key] = (future, arr)

        def _done(f: ts.Future) -> None:
            with self._lock:
                if self._pending.get(key, (None,))[0] is f:
                    del self._pending[key]

        future.add_done_callback(_done)
        return _WriteFuture(future, key, self._label, self._where(name))

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

    def _read_ts(self, entry: _Entry) -> _ChunkFuture:
        """Reads a chunk block through TensorStore's array driver."""
        view = entry.view
        if view is None:
            # Indexing costs more than issuing the read; keep the view of blocks once read.
            view = entry.view = entry.handle[entry.index]
        return _ChunkFuture(view.read(), entry.info.key, self._label, entry.where)

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
            res = self._kv.read(name, byte_range=slice(0, _RUNTIME_MIN_HEADER)).result()
            if res.state != "value":
                raise StoreError(
                    f"runtime block {key!r} in store {self._label} is listed but its file "
                    f"{where} is missing; another process may have deleted it"
                )
            data = res.value
            header, size = _parse_runtime_header(data, key, self._label, where)
            if not header:
                data = self._kv.read(name, byte_range=slice(0, size)).result().value
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


def _location(label: str, name: str) -> str:
    """A readable location of kvstore key ``name`` under a store labelled ``label``."""
    return f"file {label.rstrip('/')}/{name}"


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


# --------------------------------------------------------------------------------------------
# Opening


def _list(kv: ts.KvStore, label: str) -> list[str]:
    try:
        return sorted(k.decode() for k in kv.list().result())
    except Exception as err:
        raise StoreError(f"cannot list store {label}: {err}") from err


def _open_kvstore(kv_spec: Mapping[str, Any], label: str) -> ts.KvStore:
    try:
        return ts.KvStore.open(dict(kv_spec), context=_CONTEXT).result()
    except Exception as err:
        raise StoreError(f"cannot open store {label} ({dict(kv_spec)}): {err}") from err


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


def _zarr3_chunk_name(encoding: Any) -> Callable[[tuple[int, ...]], str] | None:
    """The chunk key (under the array's directory) of a zarr3 chunk, from its grid index, for
    the array's ``chunk_key_encoding``; None for an encoding this does not know.

    ``default``: ``c/1/2`` (separator ``/`` unless configured; ``c`` for a 0-d array);
    ``v2``: ``1.2`` (separator ``.`` unless configured; ``0`` for a 0-d array).
    """
    if encoding is None:
        encoding = "default"
    if isinstance(encoding, str):
        encoding = {"name": encoding}
    if not isinstance(encoding, Mapping):
        return None
    name = encoding.get("name", "default")
    config = encoding.get("configuration") or {}
    if name == "default":
        sep = config.get("separator", "/")
        if sep not in ("/", "."):
            return None
        return lambda idx: "c" + "".join(f"{sep}{i}" for i in idx)
    if name == "v2":
        sep = config.get("separator", ".")
        if sep not in ("/", "."):
            return None
        return lambda idx: sep.join(map(str, idx)) or "0"
    return None


def _zarr3_chunk_where(label: str, path: str, encoding: Any) -> Callable[[tuple[int, ...]], str]:
    """Names the file of a zarr3 chunk from its grid index (for error messages)."""
    name = _zarr3_chunk_name(encoding) or _zarr3_chunk_name("default")
    assert name is not None
    return lambda idx: _location(label, f"{path}/{name(idx)}")


def _codec(entry: Any) -> tuple[str, Mapping[str, Any]] | None:
    """(name, configuration) of one zarr3 codec entry (an object, or a bare name)."""
    if isinstance(entry, str):
        return entry, {}
    if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
        config = entry.get("configuration") or {}
        return (entry["name"], config) if isinstance(config, Mapping) else None
    return None


def _fast_layout(meta: Mapping[str, Any], arr: ArrayInfo) -> _FastArray | None:
    """The fast-path layout of a zarr3 array, or None if its chunks must go via TensorStore.

    Fast: a regular chunk grid, codecs exactly ``bytes`` (little endian, or any endianness for
    1-byte types) then ``crc32c``, no storage transformers, a data type in ``_FAST_DTYPES``, a
    known chunk key encoding, a little-endian machine and google_crc32c's C implementation.
    """
    if _CRC32C is None or sys.byteorder != "little":
        return None
    if meta.get("zarr_format") != 3 or meta.get("storage_transformers"):
        return None
    data_type = meta.get("data_type")
    if data_type not in _FAST_DTYPES or np.dtype(data_type) != arr.dtype:
        return None
    grid = meta.get("chunk_grid") or {}
    if not isinstance(grid, Mapping) or grid.get("name") != "regular":
        return None
    chunk_shape = tuple(int(c) for c in (grid.get("configuration") or {}).get("chunk_shape", ()))
    if chunk_shape != tuple(arr.chunk_shape) or len(chunk_shape) != len(arr.shape):
        return None
    codecs = [_codec(c) for c in meta.get("codecs") or ()]
    if len(codecs) != 2 or codecs[0] is None or codecs[1] is None:
        return None
    (first, bytes_config), (second, crc_config) = codecs
    if first != "bytes" or second != "crc32c" or crc_config:
        return None
    if set(bytes_config) - {"endian"}:
        return None
    if arr.dtype.itemsize > 1 and bytes_config.get("endian") != "little":
        return None
    name = _zarr3_chunk_name(meta.get("chunk_key_encoding"))
    if name is None:
        return None
    return _FastArray(arr.dtype, chunk_shape, name)


def _orbax_chunk_where(item: str, leaf: str, use_ocdbt: bool) -> Callable[[tuple[int, ...]], str]:
    """Names where an orbax chunk lives (for error messages)."""

    def where(idx: tuple[int, ...]) -> str:
        chunk = ".".join(map(str, idx)) or "0"
        if use_ocdbt:
            # The chunk is a value inside OCDBT data files; name the leaf, chunk and folder.
            return f"orbax leaf {leaf!r} chunk {chunk} in the OCDBT data files under {item}/"
        return _location(item, f"{leaf}/{chunk}")

    return where


def _open_cacheflow(
    kv: ts.KvStore, kv_spec: Mapping[str, Any], label: str, keys: Sequence[str]
) -> dict[str, Any]:
    """Finds and opens the zarr3 arrays of a cacheflow store."""
    meta_keys = [
        k
        for k in keys
        if (k == "zarr.json" or k.endswith("/zarr.json")) and not k.startswith(_RUNTIME_PREFIX)
    ]
    metas = _wait_all([kv.read(k) for k in meta_keys], f"reading metadata of store {label}")
    found: dict[str, dict] = {}
    for k, res in zip(meta_keys, metas, strict=True):
        try:
            meta = json.loads(res.value)
        except ValueError as err:
            raise StoreError(f"{_location(label, k)} is not valid JSON: {err}") from None
        path = k[: -len("zarr.json")].rstrip("/")
        if meta.get("node_type") == "group" and path == "":
            attr = meta.get("attributes", {}).get(_ATTR, {})
            if attr.get("complete") is False:
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
    paths = sorted(found)
    futures = [
        ts.open(
            {"driver": "zarr3", "kvstore": _join(kv_spec, p + "/")},
            context=_CONTEXT,
            read=True,
        )
        for p in paths
    ]
    handles = dict(zip(paths, _wait_all(futures, f"opening arrays of store {label}"), strict=True))
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
    return {
        "arrays": arrays,
        "fast_arrays": fast,
        "handles": handles,
        "chunk_where": where,
        "tree_paths": tree_paths,
        "empty_nodes": {},
        "value_types": {},
        "source": "cacheflow",
    }


def _open_orbax(
    kv: ts.KvStore, kv_spec: Mapping[str, Any], label: str, item: str, keys: Sequence[str]
) -> dict[str, Any]:
    """Opens an orbax checkpoint item (at ``item``, '' or 'sub/') in place."""
    item_label = f"{label.rstrip('/')}/{item}".rstrip("/")
    item_spec = _join(kv_spec, item)
    metadata: dict[str, Any] = {}
    if item + "_METADATA" in keys:
        try:
            metadata = json.loads(kv.read(item + "_METADATA").result().value)
        except Exception as err:
            raise StoreError(f"cannot read orbax metadata {item_label}/_METADATA: {err}") from err
    use_ocdbt = metadata.get("use_ocdbt", item + "manifest.ocdbt" in keys)
    driver = "zarr3" if metadata.get("use_zarr3", False) else "zarr"
    if use_ocdbt:
        leaf_kv = {"driver": "ocdbt", "base": item_spec, "cache_pool": "cache_pool#ocdbt"}
        leaf_keys = _list(_open_kvstore(leaf_kv, item_label), item_label)
    else:
        leaf_kv = item_spec
        leaf_keys = [k[len(item) :] for k in keys if k.startswith(item)]
    marker = "/zarr.json" if driver == "zarr3" else "/.zarray"
    leaves = {k[: -len(marker)] for k in leaf_keys if k.endswith(marker)}
    tree_paths: dict[str, tuple[KeyKind, ...]] = {}
    empty_nodes: dict[tuple[KeyKind, ...], Any] = {}
    value_types: dict[str, str] = {}
    leaf_of: dict[str, str] = {}
    for entry in metadata.get("tree_metadata", {}).values():
        kp = tuple(
            jax.tree_util.SequenceKey(int(m["key"]))
            if m.get("key_type") == 1
            else jax.tree_util.DictKey(m["key"])
            for m in entry.get("key_metadata", ())
        )
        names = [str(m["key"]) for m in entry.get("key_metadata", ())]
        vmeta = entry.get("value_metadata", {})
        name = ".".join(names)
        if name in leaves and not vmeta.get("skip_deserialize", False):
            path = "/".join(names) or name
            tree_paths[path], leaf_of[path] = kp, name
            value_types[path] = str(vmeta.get("value_type", ""))
        else:
            empty_nodes[kp] = {"Dict": {}, "List": [], "Tuple": []}.get(vmeta.get("value_type"))
    for name in sorted(leaves - set(leaf_of.values())):
        # A leaf without metadata (an older checkpoint): name its path from the leaf name.
        path = name.replace(".", "/")
        tree_paths[path] = tuple(jax.tree_util.DictKey(p) for p in path.split("/"))
        leaf_of[path] = name
    paths = sorted(tree_paths)
    futures = [
        ts.open(
            {"driver": driver, "kvstore": _join(leaf_kv, leaf_of[p] + "/")},
            context=_CONTEXT,
            read=True,
        )
        for p in paths
    ]
    handles = dict(
        zip(paths, _wait_all(futures, f"opening arrays of checkpoint {item_label}"), strict=True)
    )
    arrays = {
        p: ArrayInfo(
            path=p,
            shape=tuple(h.shape),
            dtype=np.dtype(h.dtype.numpy_dtype),
            chunk_shape=tuple(h.chunk_layout.read_chunk.shape or ()),
        )
        for p, h in handles.items()
    }
    where = {p: _orbax_chunk_where(item_label, leaf_of[p], use_ocdbt) for p in paths}
    return {
        "arrays": arrays,
        "handles": handles,
        "chunk_where": where,
        "tree_paths": tree_paths,
        "empty_nodes": empty_nodes,
        "value_types": value_types,
        "source": "orbax",
    }


def open_store(
    spec_or_path: str | os.PathLike[str] | Mapping[str, Any],
    *,
    s3_endpoint: str | None = None,
    s3_region: str | None = None,
    create: bool = False,
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

    Returns:
      The opened store.

    Raises:
      FileNotFoundError: a local path does not exist (and ``create`` is False).
      StoreError: the location is neither a cacheflow store nor an orbax checkpoint, or cannot
        be read.
      ValueError: an unsupported URL or spec.

    >>> store = open_store("memory://demo/", create=True)
    >>> store.keys()
    ()
    """
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
    kv = _open_kvstore(kv_spec, label)
    keys = _list(kv, label)
    runtime = [
        urllib.parse.unquote(k[len(_RUNTIME_PREFIX) : -len(_RUNTIME_SUFFIX)])
        for k in keys
        if k.startswith(_RUNTIME_PREFIX) and k.endswith(_RUNTIME_SUFFIX)
    ]
    data_keys = [k for k in keys if not k.startswith(_RUNTIME_PREFIX)]
    items = sorted(
        {k.split("/")[0] for k in data_keys if k.count("/") == 1 and k.endswith(_ORBAX_MARKERS)}
    )
    has_zarr = any(k == "zarr.json" or k.endswith("/zarr.json") for k in data_keys)
    if any(m in data_keys for m in _ORBAX_MARKERS):
        parts = _open_orbax(kv, kv_spec, label, "", data_keys)
    elif len(items) == 1 and not has_zarr:
        parts = _open_orbax(kv, kv_spec, label, items[0] + "/", data_keys)
    elif len(items) > 1 and not has_zarr:
        raise StoreError(
            f"{label} is an orbax step directory with {len(items)} items {items}; open one item "
            f"directory, e.g. {label.rstrip('/')}/{items[0]}"
        )
    elif has_zarr:
        parts = _open_cacheflow(kv, kv_spec, label, data_keys)
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
        label=label, kvstore=kv, kvstore_spec=kv_spec, runtime_keys=runtime, **parts
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
    concurrently. A root group marks the store incomplete until every chunk is written, so an
    interrupted write is refused on open instead of serving zero-filled chunks.

    Args:
      tree: nested dicts/lists/tuples of numpy or JAX arrays (or numbers).
      path: where to write: as for :func:`open_store`.
      chunk_bytes: the largest chunk (= block) in bytes; see :func:`chunk_shape_for`.
      overwrite: replace an existing non-empty store at ``path``.
      s3_endpoint: as for :func:`open_store`.
      s3_region: as for :func:`open_store`.

    Returns:
      The written store, opened.

    Raises:
      ValueError: ``chunk_bytes`` <= 0, a leaf is not a numeric array, or two leaves map to
        the same array path.
      FileExistsError: ``path`` holds data and ``overwrite`` is False.
      StoreError: a write failed.

    >>> store = write_store({"w": np.ones((4, 4), np.float32)}, "memory://doc/", overwrite=True)
    >>> store.keys()
    ('w@0,0',)
    """
    if not isinstance(chunk_bytes, int | np.integer) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
    kv_spec, label, local = _resolve(path, s3_endpoint, s3_region)
    leaves: dict[str, tuple[np.ndarray, list[list]]] = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [_kp_part(k) for k in kp]
        names = [str(k) for _, k in parts]
        name = "/".join(names) if names else "array"
        if any(not n or "/" in n or KEY_SEPARATOR in n for n in names) or name in ("_runtime",):
            raise ValueError(
                f"cannot name leaf {jax.tree_util.keystr(kp)!r} as an array path: keys must be "
                f"non-empty and contain no '/' or {KEY_SEPARATOR!r}, and '_runtime' is reserved"
            )
        if name in leaves:
            raise ValueError(f"two leaves map to the same array path {name!r}; rename one")
        arr = np.asarray(leaf)
        if not _numeric(arr.dtype):
            raise ValueError(f"leaf {name!r} has dtype {arr.dtype}; only numeric arrays are stored")
        leaves[name] = (arr, [list(p) for p in parts])
    if local is not None:
        local.mkdir(parents=True, exist_ok=True)
    kv = _open_kvstore(kv_spec, label)
    if _list(kv, label):
        if not overwrite:
            raise FileExistsError(
                f"{label} already holds data; pass overwrite=True to replace it, or choose "
                "another path"
            )
        _wait_all([kv.delete_range(ts.KvStore.KeyRange())], f"clearing {label}")

    def group(complete: bool) -> bytes:
        meta = {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {_ATTR: {"complete": complete, "arrays": sorted(leaves)}},
        }
        return json.dumps(meta).encode()

    _wait_all([kv.write("zarr.json", group(False))], f"writing {label}/zarr.json")
    opens = []
    for name, (arr, parts) in leaves.items():
        spec = {
            "driver": "zarr3",
            "kvstore": _join(kv_spec, name + "/"),
            "create": True,
            # Every chunk gets a file (also all-zero ones), so every block has a checksum.
            "store_data_equal_to_fill_value": True,
            "metadata": {
                "shape": list(arr.shape),
                "data_type": arr.dtype.name,
                "chunk_grid": {
                    "name": "regular",
                    "configuration": {
                        "chunk_shape": list(
                            chunk_shape_for(arr.shape, arr.dtype.itemsize, chunk_bytes)
                        )
                    },
                },
                "codecs": _CODECS,
                "attributes": {_ATTR: {"tree_path": parts}},
            },
        }
        opens.append(ts.open(spec, context=_CONTEXT))
    handles = _wait_all(opens, f"creating arrays in {label}")
    writes = [h.write(arr) for h, (arr, _) in zip(handles, leaves.values(), strict=True)]
    _wait_all(writes, f"writing arrays to {label}")
    _wait_all([kv.write("zarr.json", group(True))], f"writing {label}/zarr.json")
    return open_store(path, s3_endpoint=s3_endpoint, s3_region=s3_region)
