"""Runtime blocks (KV blocks and other blocks put at run time): their file format and names.

Keys without ``@`` are runtime blocks. Each is one small self-describing file under ``_runtime/``
in the store's root (see ``_RUNTIME_FORMAT``), found again on open by listing that prefix.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import secrets
import struct
import urllib.parse
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

from cacheflow_jax.core.blocks import HOW_TO_REPAIR, CorruptBlockError
from cacheflow_jax.core.pytree import flatten, is_tree, unflatten

if TYPE_CHECKING:  # numpy is imported where used: replay imports this module without it
    import numpy as np

RUNTIME_PREFIX = "_runtime/"
RUNTIME_SUFFIX = ".block"

_RUNTIME_FORMAT = """\
A runtime block file (``_runtime/<percent-encoded key>.block``) is:
  bytes 0-7   magic b"CFJBLK1\\n"
  bytes 8-11  header length H (uint32, little endian; H >= 256, a multiple of 64)
  bytes 12-H  JSON {"dtype": name, "shape": [...], "crc32": zlib.crc32(payload),
              "writer": id, "seq": n}, space padded ("writer" and "seq" are optional)
  bytes H-    payload: the array's bytes, C order, little endian
A pytree block (`_pytree`) has "dtype": "uint8" and "shape": [payload bytes], plus "tree" (its
structure) and "leaves" ([[dtype, shape], ...]); its payload is the leaves' bytes one after
another, in the structure's order.
The fixed minimum header lets a header be read with one ranged read; the CRC makes a damaged file
an error instead of wrong data. ``writer`` (a process's random id) and ``seq`` (that process's
write order, see `next_version`) let a store refuse to publish an older write of the same writer
over a newer one (compare-and-publish); a block of another writer is replaced. Each file is
written with a single kvstore write, which is atomic on the file driver (write to a temporary
file, then rename) and on object stores, so a crash never leaves a half-written block that reads
as valid.
A block of a shared store (``open_store(..., shared=True)``) has no "writer" and "seq": it is
published once and never replaced, so its order does not matter. It has "time" instead (Unix
seconds when it was published), the order in which `cacheflow_jax.store.shared.trim_runtime`
removes blocks.
"""
_RUNTIME_MAGIC = b"CFJBLK1\n"
RUNTIME_MIN_HEADER = 256


@functools.lru_cache(maxsize=256)
def numeric(dtype: np.dtype) -> bool:
    """True for dtypes TensorStore stores: bool, ints, floats (incl. bfloat16), complex."""
    import numpy as np  # (bfloat16's kind is "V" too: only numpy's own void type is refused)

    if dtype.kind in "OUSM" or dtype.names is not None or dtype.type is np.void:
        return False
    try:
        import tensorstore as ts  # here: replay imports this module without TensorStore

        ts.dtype(dtype)
    except (TypeError, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=1 << 16)  # every L3 read and write of a block names its file
def runtime_name(key: str) -> str:
    """The kvstore key (relative to the store root) of runtime block ``key``."""
    return RUNTIME_PREFIX + urllib.parse.quote(key, safe="-_~") + RUNTIME_SUFFIX


# What a write's future gives: the block was published, or a later write of the same writer was
# already there (compare-and-publish refused this older one; nothing was written).
WRITTEN, SUPERSEDED = "written", "superseded"


class Version(NamedTuple):
    """The order of one runtime-block write: its writer (a process) and that writer's count."""

    writer: str
    seq: int


def _new_writer() -> None:
    global _WRITER, _SEQ
    _WRITER = secrets.token_hex(8)
    _SEQ = itertools.count(1)


_WRITER = ""
_SEQ = itertools.count(1)
_new_writer()
os.register_at_fork(after_in_child=_new_writer)  # a forked child is another writer


def writer() -> str:
    """This process's writer id (see `Version`)."""
    return _WRITER


def next_version() -> Version:
    """A new version, later than every version this process made before (thread-safe)."""
    return Version(_WRITER, next(_SEQ))


def supersedes(stored: dict, version: Version) -> bool:
    """Whether a stored block's header (`parse_runtime_header`) is a later write of the same
    writer than ``version``: publishing ``version`` over it would lose an update."""
    return stored.get("writer") == version.writer and stored.get("seq", 0) > version.seq


def _little(value: np.ndarray) -> bytes:
    import numpy as np

    if value.dtype.byteorder == ">":
        value = value.astype(value.dtype.newbyteorder("<"))
    return np.ascontiguousarray(value).tobytes()


def encode_runtime(
    value: Any, version: Version | None = None, *, published: float | None = None
) -> bytes:
    """Serializes one runtime block, an array or a pytree of arrays (see ``_RUNTIME_FORMAT``).

    Args:
      value: the block.
      version: its writer and order (a store that is not shared), or None.
      published: the Unix time of its publication (a shared store), or None.
    """
    if is_tree(value):
        leaves, structure = flatten(value, "")
        arrays = [leaf for _, leaf in leaves]
        payload = b"".join(_little(a) for a in arrays)
        fields: dict[str, Any] = {
            "dtype": "uint8", "shape": [len(payload)], "crc32": zlib.crc32(payload),
            "tree": structure, "leaves": [[a.dtype.name, list(a.shape)] for a in arrays],
        }  # fmt: skip
    else:
        payload = _little(value)
        fields = {
            "dtype": value.dtype.name,
            "shape": list(value.shape),
            "crc32": zlib.crc32(payload),
        }
    if version is not None:
        fields.update(writer=version.writer, seq=version.seq)
    if published is not None:
        fields["time"] = round(published, 3)
    header = json.dumps(fields).encode()
    size = max(RUNTIME_MIN_HEADER, -(-(12 + len(header) + 1) // 64) * 64)
    head = _RUNTIME_MAGIC + struct.pack("<I", size) + header
    return head + b" " * (size - len(head)) + payload


def parse_runtime_header(data: bytes, key: str, store: str, where: str) -> tuple[dict, int]:
    """Returns a runtime block file's header dict and header length."""
    if len(data) < 12 or data[:8] != _RUNTIME_MAGIC:
        raise CorruptBlockError(
            f"runtime block {key!r} in store {store} ({where}) does not start with the block "
            f"magic {_RUNTIME_MAGIC!r}. {HOW_TO_REPAIR}."
        )
    (size,) = struct.unpack("<I", data[8:12])
    if len(data) < size:
        return {}, size
    import numpy as np

    try:
        header = json.loads(data[12:size])
        header["shape"] = tuple(int(s) for s in header["shape"])
        header["dtype"] = np.dtype(header["dtype"])
        if "leaves" in header:
            header["leaves"] = tuple(
                (tuple(int(n) for n in shape), np.dtype(dtype)) for dtype, shape in header["leaves"]
            )
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptBlockError(
            f"runtime block {key!r} in store {store} ({where}) has a bad header: {err}. "
            f"{HOW_TO_REPAIR}."
        ) from None
    return header, size


def decode_runtime(data: bytes, key: str, store: str, where: str) -> Any:
    """Parses and checks one runtime block file: an array, or a pytree of arrays."""
    import numpy as np

    header, size = parse_runtime_header(data, key, store, where)
    payload = data[size:]
    dtype, shape = header.get("dtype"), header.get("shape")
    expected = None if dtype is None else math.prod(shape) * dtype.itemsize
    if expected != len(payload) or zlib.crc32(payload) != header.get("crc32"):
        raise CorruptBlockError(
            f"runtime block {key!r} in store {store} is corrupt ({where}): size or CRC32 "
            f"mismatch. {HOW_TO_REPAIR}."
        )
    if "tree" not in header:
        return np.frombuffer(payload, dtype=dtype).reshape(shape).copy()
    sizes = [math.prod(sh) * dt.itemsize for sh, dt in header["leaves"]]  # Python ints: exact
    if sum(sizes) != len(payload):
        raise CorruptBlockError(
            f"runtime block {key!r} in store {store} is corrupt ({where}): its leaves have "
            f"{sum(sizes)} bytes, its payload {len(payload)}. {HOW_TO_REPAIR}."
        )
    leaves, offset = [], 0
    for (leaf_shape, leaf_dtype), n in zip(header["leaves"], sizes):
        leaves.append(
            np.frombuffer(payload, leaf_dtype, n // max(1, leaf_dtype.itemsize), offset)
            .reshape(leaf_shape).copy()
        )  # fmt: skip
        offset += n
    try:
        return unflatten(header["tree"], leaves)
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise CorruptBlockError(
            f"runtime block {key!r} in store {store} ({where}) has a bad tree in its header: "
            f"{err}. {HOW_TO_REPAIR}."
        ) from None


# Header fields that say who wrote a block and when, not what it holds.
_ORDER_FIELDS = ("writer", "seq", "time")


def same_value(a: bytes, b: bytes) -> bool:
    """Whether two runtime block files hold the same value: the same dtype, shape, structure
    and payload bytes, whoever wrote them and when. A damaged file holds no value."""
    try:
        head_a, size_a = parse_runtime_header(a, "", "", "")
        head_b, size_b = parse_runtime_header(b, "", "", "")
    except CorruptBlockError:
        return False
    if not head_a or not head_b:
        return False

    def what(header: dict) -> dict:
        return {k: v for k, v in header.items() if k not in _ORDER_FIELDS}

    return what(head_a) == what(head_b) and a[size_a:] == b[size_b:]


def damaged(data: bytes) -> bool:
    """Whether a runtime block file fails its own checks (magic, header, size, CRC)."""
    try:
        decode_runtime(data, "", "", "")
    except CorruptBlockError:
        return True
    return False


# A runtime block's file name is its percent-encoded key plus ``.block``; file systems allow 255
# bytes per name, so longer keys are refused at ``put`` instead of failing at every write-back.
MAX_RUNTIME_NAME = 240


def check_runtime_key(key: object, store: str = "") -> str:
    """Checks that ``key`` can name a runtime block; returns it.

    Raises:
      TypeError: ``key`` is not a str.
      ValueError: ``key`` is empty, contains ``@`` (chunk keys are read-only), is not valid
        UTF-8 (a lone surrogate), or is longer than a file name allows once percent-encoded.
    """
    where = f" in store {store}" if store else ""
    if not isinstance(key, str):
        raise TypeError(f"block keys are str; got {type(key).__name__} {key!r}")
    if not key:
        raise ValueError(f"cannot store a runtime block{where} under the empty key ''")
    if "@" in key:
        raise ValueError(
            f"cannot put {key!r}{where}: keys with '@' name chunks of stored arrays, which are "
            "read-only; use a key without it for runtime blocks"
        )
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as err:
        raise ValueError(
            f"runtime block key {key!r} is not valid UTF-8 ({err.reason} at position "
            f"{err.start}); use a key of printable characters"
        ) from None
    if 3 * size <= MAX_RUNTIME_NAME:  # percent-encoding makes at most 3 characters of a byte
        return key
    name = urllib.parse.quote(key, safe="-_~")
    if len(name) > MAX_RUNTIME_NAME:
        raise ValueError(
            f"runtime block key {key[:40]!r}... is too long: {len(name)} bytes once "
            f"percent-encoded, more than {MAX_RUNTIME_NAME}; use a shorter key, e.g. a hash "
            "of the prefix"
        )
    return key


# Temporary files of atomic writes are ``.<writer's pid>-<n>.partial`` beside the blocks: the
# suffix keeps listings from mistaking one for a block, the pid lets a later open remove the
# ones whose writer died.
_TMP_SUFFIX = ".partial"


def atomic_write_file(path: str, data: bytes, *, sync_dir: bool = True) -> None:
    """Writes ``data`` to ``path`` so that a crash leaves the old file or the new one, whole.

    The bytes go to a temporary file beside it, which is synced and then renamed over ``path``;
    the directory is synced too, so the rename itself survives a power loss. ``sync_dir=False``
    leaves that to the caller (`sync_directory`, once for several files of one directory): the
    rename is durable only after it.

    Raises:
      OSError: the write failed (for example a full disk); the temporary file is removed.
    """
    parent = os.path.dirname(path)
    tmp = _temporary(parent, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        sync_directory(parent)


def publish_file(path: str, data: bytes) -> bool:
    """Creates ``path`` holding ``data`` only if no file is there (create-if-absent), atomically.

    The bytes go to a synced temporary file beside it, which is then hard-linked to ``path``:
    the link either creates the whole file or fails because one exists, so a reader never sees
    part of it and two writers never both succeed.

    Returns:
      True if this call created the file; False if a file was there already (left unchanged).

    Raises:
      OSError: the write failed (for example a full disk); the temporary file is removed.
    """
    parent = os.path.dirname(path)
    tmp = _temporary(parent, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    sync_directory(parent)
    return True


_TMP_SEQ = itertools.count()  # temporary files' names: unique in the process (its pid is in them)
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def _temporary(parent: str, data: bytes) -> str:
    """A synced temporary file in ``parent`` (made if missing) holding ``data``; its path.

    Its name is ``.<pid>-<n>.partial`` (`remove_stale_temporaries` reads the pid), created
    exclusively as ``tempfile.mkstemp`` does, without its random names, and ``parent`` is made
    only when the create finds it missing (not checked on every write).
    """
    made = False
    while True:
        tmp = os.path.join(parent, f".{os.getpid()}-{next(_TMP_SEQ)}{_TMP_SUFFIX}")
        try:
            fd = os.open(tmp, _TMP_FLAGS, 0o600)
            break
        except FileExistsError:  # left by a dead process that had this pid: take the next
            continue
        except FileNotFoundError:
            if made:
                raise
            os.makedirs(parent, exist_ok=True)
            made = True
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def sync_directory(parent: str) -> None:
    """Syncs a directory, so that a rename or link in it survives a power loss."""
    dir_fd = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_stale_temporaries(runtime_dir: str) -> int:
    """Removes temporary files left by writers that died (their pid is gone); returns how many."""
    try:
        names = os.listdir(runtime_dir)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if not (name.startswith(".") and name.endswith(_TMP_SUFFIX)):
            continue
        pid = name[1:].partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(runtime_dir, name))
                removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
