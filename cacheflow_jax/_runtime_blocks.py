"""Runtime blocks (KV blocks and other blocks put at run time): their file format and names.

Keys without ``@`` are runtime blocks. Each is one small self-describing file under ``_runtime/``
in the store's root (see ``_RUNTIME_FORMAT``), found again on open by listing that prefix.
"""

from __future__ import annotations

import json
import struct
import urllib.parse
import zlib

import numpy as np
import tensorstore as ts

from cacheflow_jax._blocks import HOW_TO_REPAIR, CorruptBlockError

_RUNTIME_PREFIX = "_runtime/"
_RUNTIME_SUFFIX = ".block"

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
            f"magic {_RUNTIME_MAGIC!r}. {HOW_TO_REPAIR}."
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
            f"{HOW_TO_REPAIR}."
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
            f"mismatch. {HOW_TO_REPAIR}."
        )
    return np.frombuffer(payload, dtype=dtype).reshape(shape).copy()
