"""Blocks, keys and the L3 store protocol.

A block is the unit that moves between tiers: one chunk of one stored array, or one runtime block
(a KV block keyed by prefix hash). Chunks of stored arrays are keyed ``"<array path>@<i,j,...>"``;
runtime blocks may use any string without ``@``. Every block's shape, dtype and nbytes are known
before it is read, so budgets can be checked before any I/O.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # this module stays free of JAX and numpy: replay imports it without either
    import jax
    import numpy as np

    # An entry of a stored pytree's key path: a dict key or a list index.
    KeyKind = jax.tree_util.DictKey | jax.tree_util.SequenceKey

KEY_SEPARATOR = "@"

# L3 operations have deadlines (see TieredCache(l3_timeout=) and open_store(timeout=)), and object
# stores retry failed requests a bounded number of times (see `_locations.store_context`).
DEFAULT_TIMEOUT = 60.0  # seconds for one L3 operation (an open, a block read, a write-back)
DEFAULT_RETRIES = 3  # retries of one failed object-store request, 0.1 s to 2 s apart

HOW_TO_REPAIR = (
    "The stored bytes are damaged; re-write the store from its source "
    "(write_store(tree, path, overwrite=True)) or restore the file from a backup"
)


class BudgetError(ValueError):
    """A byte budget is invalid (negative, or too small for a block that must fit)."""


class StoreError(OSError):
    """The L3 store could not be opened, read or written."""


class CorruptBlockError(StoreError):
    """A stored chunk failed its checksum; the message names the key and the file."""


class StoreTimeoutError(StoreError, TimeoutError):
    """An L3 operation did not finish within its deadline (the store may be unreachable)."""


class ConflictError(StoreError):
    """A shared store already holds other bytes under a runtime block's key.

    Runtime blocks of a store opened with ``open_store(..., shared=True)`` are immutable: a key
    names one value for every process (a KV block's key hashes its prefix, so its bytes follow
    from the key). The first value published under a key stays; a write-back of different bytes
    is refused with this error, and the writer's cache drops its own copy, so that every cache
    serves the published bytes. It usually means two processes computed different values for
    one key: put what the value depends on (the model, its version, the KV dtype) into the
    key's salt (`cacheflow_jax.kv.prefix_keys`).
    """


class DtypeError(TypeError):
    """A block's dtype cannot be held exactly where it must go (JAX would change it silently)."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip


def parse_bytes(text: str) -> tuple[int, bool]:
    """Parses ``1048576``, ``64MiB``, ``1.5G`` or ``500MB`` (K/M/G/T alone are binary).

    A fraction of a unit is rounded down to whole bytes (``0.3k`` is 307), but a plain number
    (or one in ``B``) must be whole: ``1.5`` is an error, not 1 byte.

    Returns:
      ``(bytes, unitless)``: the size, and whether it was a plain number.

    Raises:
      ValueError: ``text`` is not a non-negative size, or is a fraction of a byte.

    >>> parse_bytes("64MiB"), parse_bytes("1.5k"), parse_bytes("10")
    ((67108864, False), (1536, False), (10, True))
    """
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size; use bytes or a number with a unit, e.g. 64MiB, 1.5GiB, 500MB"
        )
    if _UNITS[unit] == 1 and float(m.group(1)) != int(float(m.group(1))):
        raise ValueError(f"{text!r} is not a whole number of bytes; give e.g. 2 or 1.5KiB")
    return int(float(m.group(1)) * _UNITS[unit]), not m.group(2)


def block_key(array_path: str, index: Sequence[int]) -> str:
    """Returns the key of chunk ``index`` of the array at ``array_path``.

    >>> block_key("params/layers_3/mlp/kernel", (0, 2))
    'params/layers_3/mlp/kernel@0,2'
    """
    return f"{array_path}{KEY_SEPARATOR}{','.join(str(int(i)) for i in index)}"


def parse_key(key: str) -> tuple[str, tuple[int, ...]]:
    """Splits a chunk key into its array path and chunk index.

    Raises:
      KeyError: ``key`` is not of the form ``"<array path>@<i,j,...>"``.

    >>> parse_key("params/w@1,0")
    ('params/w', (1, 0))
    """
    path, sep, idx = key.rpartition(KEY_SEPARATOR)
    if not sep or not path:
        raise KeyError(f"{key!r} is not a chunk key of the form '<array path>@<i,j,...>'")
    try:
        index = tuple(int(i) for i in idx.split(",")) if idx else ()
    except ValueError:
        raise KeyError(
            f"{key!r} has a bad chunk index {idx!r}: expected comma-separated integers"
        ) from None
    return path, index


@dataclasses.dataclass(frozen=True, slots=True)
class BlockInfo:
    """What is known about a block before it is read."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    array: str = ""  # array path; "" for runtime blocks
    index: tuple[int, ...] = ()  # chunk grid index; () for runtime blocks
    origin: tuple[int, ...] = ()  # element offset of the chunk in its array
    # A pytree block (runtime only): each leaf's (shape, dtype) in order; shape is then
    # (nbytes,) and dtype uint8, the block's bytes. () for an array.
    leaves: tuple[tuple[tuple[int, ...], np.dtype], ...] = ()

    @property
    def runtime(self) -> bool:
        """True for blocks written at run time (write-back on eviction)."""
        return not self.array


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayInfo:
    """One stored array: its path, shape, dtype and block shape.

    ``chunk_shape`` is the shape of one block, the unit keys name. It is the stored chunk's
    shape unless the store serves large chunks as sub-blocks (``block_bytes``); then
    ``stored_chunk_shape`` is the chunk as stored and each block is a run of its leading rows.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    stored_chunk_shape: tuple[int, ...] | None = None  # None: the same as chunk_shape

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """The number of blocks along each dimension."""
        return tuple(-(-s // c) if c else 1 for s, c in zip(self.shape, self.chunk_shape))

    @property
    def stored_chunks(self) -> tuple[int, ...]:
        """The shape of one chunk as stored (``chunk_shape`` unless blocks are sub-blocks)."""
        return self.chunk_shape if self.stored_chunk_shape is None else self.stored_chunk_shape

    @property
    def nbytes(self) -> int:
        return math.prod(int(d) for d in self.shape) * self.dtype.itemsize


class ReadFuture(Protocol):
    """A pending read: TensorStore's futures satisfy this."""

    def result(self, timeout: float | None = None) -> Any: ...

    def done(self) -> bool: ...


@runtime_checkable
class Store(Protocol):
    """The L3 store as the cache sees it. Storage only: it never decides what to keep.

    All reads and writes are asynchronous and return futures; a store never blocks the caller on
    I/O except in ``result()``.
    """

    @property
    def spec(self) -> str:
        """A short human-readable description (path or URL) used in error messages."""
        ...

    def arrays(self) -> Mapping[str, ArrayInfo]:
        """The stored arrays by path."""
        ...

    def info(self, key: str) -> BlockInfo:
        """The block's metadata. Raises ``KeyError`` naming the key and the store."""
        ...

    def holds(self, key: str) -> bool:
        """Whether the store has a block under ``key`` (no I/O: what it listed or wrote)."""
        ...

    def keys(self) -> Sequence[str]:
        """Every block key the store holds (chunks of stored arrays, then runtime blocks)."""
        ...

    def read(self, key: str) -> ReadFuture:
        """Starts reading one block; the future yields a numpy array of ``info(key).shape``."""
        ...

    def read_many(self, keys: Sequence[str]) -> list[ReadFuture]:
        """Starts reading many blocks at once (issued in parallel)."""
        ...

    def write(self, key: str, value: np.ndarray, *, version: Any = None) -> ReadFuture:
        """Starts writing a runtime block (``key`` without ``@``); the future completes when durable.

        ``version`` (a `cacheflow_jax.store.runtime_format.Version`, or None) orders the writes of one
        writer: a store that keeps versions refuses an older one over a newer one and its future
        returns ``"superseded"``.
        """
        ...
