"""The fast read path: zarr3 chunk files read whole, checked with CRC32C, returned without a copy.

For chunks of zarr3 arrays on local disk whose codecs are exactly ``bytes`` (little endian) +
``crc32c`` -- every array ``write_store`` writes -- TensorStore's decode (checksum, then a copy into
a fresh array, limited by ``data_copy_concurrency``) cost more than the disk read. Such a chunk file
is read by a reader thread with ``preadv`` straight into a 64-byte aligned buffer, checked with
google_crc32c over the whole file (payload + stored CRC gives a constant residue) and returned as a
view of that buffer: one copy, the kernel's. zarr3 stores edge chunks at full chunk shape, so an
edge block is the clipped slice (copied, so that it does not pin the whole chunk). A chunk file that
does not exist is handed back to TensorStore (see `FastChunkFuture`). Other kvstores are not worth
it: ``ts.KvStore.ReadResult.value`` copies the bytes twice, which measured slower than TensorStore's
own decode.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16, float8_*, int4 with numpy by name)
import numpy as np

try:
    import google_crc32c
except ImportError:  # a declared dependency; without it every chunk is read by TensorStore
    google_crc32c = None

from cacheflow_jax.core.blocks import HOW_TO_REPAIR, ArrayInfo, CorruptBlockError, StoreError
from cacheflow_jax.store.entry import Entry, FastArray
from cacheflow_jax.store.futures import thread_pool
from cacheflow_jax.store.locations import CONTEXT_SPEC, location

# The fast chunk path (see TensorStoreStore.read): zarr3 chunks whose codecs are exactly
# bytes (little endian) + crc32c are read as raw chunk files with the kvstore and checked here.
# google_crc32c's C implementation runs at several GB/s and releases the GIL for bytes objects
# of 1 MiB and more; its pure-Python fallback would be far slower than TensorStore, so only the
# C one is used.
CRC32C: Callable[[bytes], int] | None = (
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
FAST_DTYPES = frozenset(
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


def file_pool() -> ThreadPoolExecutor:
    """The reader threads of the fast path: as many as TensorStore's file_io_concurrency."""
    return thread_pool("read", CONTEXT_SPEC["file_io_concurrency"]["limit"])


def read_chunk_file(entry: Entry, store: str) -> np.ndarray | None:
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
    if CRC32C(buf) != _CRC32C_RESIDUE:
        stored = int.from_bytes(buf[-4:].tobytes(), "little")
        raise _corrupt(
            entry,
            store,
            f"crc32c digest mismatch, stored digest is 0x{stored:08x} but computed digest is "
            f"0x{CRC32C(buf[:-4]):08x}",
        )
    stored = int.from_bytes(buf[-4:].tobytes(), "little")
    if entry.crc is not None and stored != entry.crc:
        raise _corrupt(
            entry,
            store,
            f"the chunk file is intact but holds another chunk's bytes: its crc32c 0x{stored:08x} "
            f"differs from 0x{entry.crc:08x}, which the store's chunk manifest records for this "
            "chunk (a chunk file swapped, or replaced by an older copy)",
        )
    arr = buf[: fast.nbytes].view(fast.dtype).reshape(fast.chunk_shape)
    # An edge chunk is stored at full chunk shape; copy out the block so that the cache does
    # not keep the whole chunk's bytes alive for a smaller block.
    return arr if entry.clip is None else arr[entry.clip].copy()


def _corrupt(entry: Entry, store: str, why: str) -> CorruptBlockError:
    """The error for a damaged chunk file, worded as for TensorStore's own checks."""
    return CorruptBlockError(
        f"block {entry.info.key!r} in store {store} is corrupt ({entry.where}): DATA_LOSS: "
        f"{why}. {HOW_TO_REPAIR}."
    )


def zarr3_chunk_name(encoding: Any) -> Callable[[tuple[int, ...]], str] | None:
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


def zarr3_chunk_where(label: str, path: str, encoding: Any) -> Callable[[tuple[int, ...]], str]:
    """Names the file of a zarr3 chunk from its grid index (for error messages)."""
    name = zarr3_chunk_name(encoding) or zarr3_chunk_name("default")
    assert name is not None
    return lambda idx: location(label, f"{path}/{name(idx)}")


def zarr3_codec(entry: Any) -> tuple[str, Mapping[str, Any]] | None:
    """(name, configuration) of one zarr3 codec entry (an object, or a bare name)."""
    if isinstance(entry, str):
        return entry, {}
    if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
        config = entry.get("configuration") or {}
        return (entry["name"], config) if isinstance(config, Mapping) else None
    return None


def fast_layout(meta: Mapping[str, Any], arr: ArrayInfo) -> FastArray | None:
    """The fast-path layout of a zarr3 array, or None if its chunks must go via TensorStore.

    Fast: a regular chunk grid, codecs exactly ``bytes`` (little endian, or any endianness for
    1-byte types) then ``crc32c``, no storage transformers, a data type in ``FAST_DTYPES``, a
    known chunk key encoding, a little-endian machine and google_crc32c's C implementation.
    """
    if CRC32C is None or sys.byteorder != "little":
        return None
    if meta.get("zarr_format") != 3 or meta.get("storage_transformers"):
        return None
    data_type = meta.get("data_type")
    if data_type not in FAST_DTYPES or np.dtype(data_type) != arr.dtype:
        return None
    grid = meta.get("chunk_grid") or {}
    if not isinstance(grid, Mapping) or grid.get("name") != "regular":
        return None
    chunk_shape = tuple(int(c) for c in (grid.get("configuration") or {}).get("chunk_shape", ()))
    if chunk_shape != tuple(arr.chunk_shape) or len(chunk_shape) != len(arr.shape):
        return None
    codecs = [zarr3_codec(c) for c in meta.get("codecs") or ()]
    if len(codecs) != 2 or codecs[0] is None or codecs[1] is None:
        return None
    (first, bytes_config), (second, crc_config) = codecs
    if first != "bytes" or second != "crc32c" or crc_config:
        return None
    if set(bytes_config) - {"endian"}:
        return None
    if arr.dtype.itemsize > 1 and bytes_config.get("endian") != "little":
        return None
    name = zarr3_chunk_name(meta.get("chunk_key_encoding"))
    if name is None:
        return None
    return FastArray(arr.dtype, chunk_shape, name)
