"""L1 as one preallocated slab of fixed-size lines (``TieredCache(device_layout="slab")``).

Design note.

* The slab is one device array of ``num_lines`` lines of ``line_bytes`` bytes, allocated once when
  the tier is made; its size is the tier's budget, so the budget is exact. Lines are words
  (uint32) when ``line_bytes`` is a multiple of 4, else bytes.
* A block takes ``ceil(nbytes / line_bytes)`` lines from a free list; they need not be
  contiguous. The indirection table maps a key to its lines, shape and dtype. Room is counted in
  whole lines: reserving ``nbytes`` takes ``ceil(nbytes / line_bytes) * line_bytes`` of the
  budget, so whenever the cache's reservation succeeds, enough lines are free.
* A put bitcasts the block to words and writes its lines with `pallas_kernels.pack_lines`, the
  slab donated (updated in place). A get gathers the lines with `pallas_kernels.gather_lines` and
  bitcasts and reshapes them into the block: that output, handed to the caller, is the only
  device allocation after start-up (the transfer of a miss is also the array returned to the
  caller, then packed).
* ``pop`` gathers the block (the cache demotes it to L2 from that copy) and frees its lines at
  once; later writes to those lines are ordered after the gather by JAX's buffer dependencies.
* The slab array is replaced on every write (donation), so every use of it, and of the
  indirection table, happens under one short lock: a hit never gathers lines that a concurrent
  put is rewriting. Only dispatches happen under it, never a wait.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cacheflow_jax.core.blocks import BudgetError
from cacheflow_jax.tiers.memory import AbstractTier, DeviceTier, to_device
from cacheflow_jax.tiers.placement import Placement
from pallas_kernels import gather_lines, pack_lines

DEVICE_LAYOUTS = ("arrays", "slab")

# Default line size bounds (see `default_line_bytes`).
MAX_DEFAULT_LINE_BYTES = 64 << 10
MIN_DEFAULT_LINE_BYTES = 4 << 10


def _pow2_part(n: int) -> int:
    return n & -n if n > 0 else 0


def default_line_bytes(block_sizes: Iterable[int]) -> int:
    """The line size a slab uses for blocks of ``block_sizes`` bytes (a store's full chunks).

    The largest power of two that divides every size, so that every full chunk is whole lines,
    raised to at least 4 KiB (a smaller block then leaves part of one line unused) and at most
    64 KiB; never more than the largest block's power-of-two part, so that the largest block is
    whole lines and fits whenever ``device_bytes`` is at least its size.

    >>> default_line_bytes([256]), default_line_bytes([1 << 20, 16 << 10, 2 << 10])
    (256, 4096)
    >>> default_line_bytes([3 << 20]), default_line_bytes([324, 100])
    (65536, 4)
    """
    sizes = [int(n) for n in block_sizes if n > 0]
    if not sizes:
        return 4
    common = min(_pow2_part(n) for n in sizes)
    line = min(max(common, MIN_DEFAULT_LINE_BYTES), MAX_DEFAULT_LINE_BYTES)
    return max(1, min(line, _pow2_part(max(sizes))))


def lines_for(nbytes: int, line_bytes: int) -> int:
    """How many lines a block of ``nbytes`` bytes takes."""
    return -(-int(nbytes) // line_bytes)


# ------------------------------------------------------------------------------- byte codec


def to_words(value: jax.Array, nlines: int, line_words: int, word: np.dtype) -> jax.Array:
    """A block as ``(nlines, line_words)`` words: its bytes, zero-padded to whole lines."""
    flat = value.reshape(-1)
    if flat.dtype == jnp.bool_:
        flat = flat.astype(jnp.uint8)
    elif jnp.issubdtype(flat.dtype, jnp.complexfloating):
        # bitcast refuses complex: its bytes are the (real, imag) pairs, in that order
        flat = jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1).reshape(-1)
    raw = jax.lax.bitcast_convert_type(flat, jnp.uint8).reshape(-1)
    size = nlines * line_words * word.itemsize
    raw = jnp.pad(raw, (0, size - raw.shape[0]))
    if word.itemsize == 1:
        return raw.reshape(nlines, line_words)
    return jax.lax.bitcast_convert_type(raw.reshape(nlines, line_words, word.itemsize), word)


def from_words(words: jax.Array, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
    """The inverse of `to_words`: the first bytes of ``words`` as an array of ``shape``/``dtype``."""
    raw = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
    count = math.prod(shape)
    if dtype == np.bool_:
        return raw[:count].astype(jnp.bool_).reshape(shape)
    if np.issubdtype(dtype, np.complexfloating):
        part = np.dtype(f"f{dtype.itemsize // 2}")
        pairs = from_words(words, (count, 2), part)
        return jax.lax.complex(pairs[:, 0], pairs[:, 1]).astype(dtype).reshape(shape)
    raw = raw[: count * dtype.itemsize]
    if dtype.itemsize > 1:
        raw = raw.reshape(count, dtype.itemsize)
    return jax.lax.bitcast_convert_type(raw, dtype).reshape(shape)


@functools.partial(jax.jit, static_argnames=("implementation",), donate_argnums=(0,))
def _write(slab, value, slots, *, implementation: str):
    words = to_words(value, slots.shape[0], slab.shape[1], np.dtype(slab.dtype))
    return pack_lines(slab, words, slots, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "implementation"))
def _read(slab, slots, *, shape, dtype, implementation: str):
    words = gather_lines(slab, slots, implementation=implementation)
    return from_words(words, shape, np.dtype(dtype))


# ------------------------------------------------------------------------------------ slab


class LineSlab:
    """One preallocated device array of fixed-size lines, and its free list.

    Every read or write of ``array`` and of ``free`` happens under ``lock`` (the array object is
    replaced on each write, its buffer donated).

    Args:
      num_lines: how many lines.
      line_bytes: bytes per line (> 0).
      device: the device holding the slab.
      implementation: for the Pallas ops (``"auto"``: Pallas on GPU, XLA elsewhere).
    """

    def __init__(
        self, num_lines: int, line_bytes: int, *, device: jax.Device, implementation: str = "auto"
    ) -> None:
        self.line_bytes = int(line_bytes)
        self.word = np.dtype(np.uint32 if line_bytes % 4 == 0 else np.uint8)
        self.line_words = self.line_bytes // self.word.itemsize
        self.num_lines = int(num_lines)
        self.device = device
        self.implementation = implementation
        self.lock = threading.Lock()
        self.array = jax.device_put(
            np.zeros((self.num_lines, self.line_words), self.word), device
        ).block_until_ready()
        # A stack: the lowest free line is taken first, which keeps reuse easy to follow.
        self.free: list[int] = list(range(self.num_lines - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        """The slab's size in bytes."""
        return self.num_lines * self.line_bytes

    def take(self, n: int) -> np.ndarray:
        """Under ``lock``: ``n`` free lines, removed from the free list.

        Raises:
          BudgetError: fewer than ``n`` lines are free (the caller's reservation was wrong).
        """
        if n > len(self.free):
            raise BudgetError(
                f"the slab has {len(self.free)} free lines of {self.line_bytes} bytes and "
                f"{n} were asked for; room must be reserved before lines are taken (a bug)"
            )
        taken = self.free[len(self.free) - n :]
        del self.free[len(self.free) - n :]
        return np.asarray(taken[::-1], np.int32)

    def give(self, lines: np.ndarray) -> None:
        """Under ``lock``: returns lines to the free list."""
        self.free.extend(int(i) for i in lines[::-1])

    def write(self, value: jax.Array, lines: np.ndarray) -> None:
        """Under ``lock``: writes a block's bytes into ``lines`` (in place)."""
        self.array = _write(self.array, value, lines, implementation=self.implementation)

    def read(self, lines: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
        """Under ``lock``: a new array holding the block stored in ``lines``."""
        return _read(
            self.array, lines, shape=shape, dtype=dtype, implementation=self.implementation
        )


class _Entry(NamedTuple):
    lines: np.ndarray  # int32 line indices, in block order
    shape: tuple[int, ...]
    dtype: np.dtype


class _SlabEntries(Mapping):
    """The tier's ``entries``: key -> the block, gathered from the slab on each lookup."""

    def __init__(self, tier: SlabTier) -> None:
        self._tier = tier

    def get(self, key: str, default: Any = None) -> Any:
        tier = self._tier
        with tier.slab.lock:
            entry = tier.table.get(key)
            if entry is None:
                return default
            return tier.slab.read(entry.lines, entry.shape, entry.dtype)

    def __getitem__(self, key: str) -> jax.Array:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self._tier.table

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._tier.table))

    def __len__(self) -> int:
        return len(self._tier.table)


class SlabTier(AbstractTier):
    """L1 as one preallocated slab of fixed-size lines, written and read by the Pallas ops.

    A drop-in for `DeviceTier` (same `AbstractTier` interface). ``budget`` is the slab's size:
    ``device_bytes`` rounded down to whole lines.

    Args:
      budget: ``device_bytes``.
      line_bytes: bytes per line; see `default_line_bytes`.
      device: the device; this process's first local device if omitted (`jax.local_devices()`:
        in a `jax.distributed` job, `jax.devices()[0]` is process 0's).
      implementation: ``"auto"`` (Pallas kernels on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Raises:
      BudgetError: a negative budget or a bad ``line_bytes``.
    """

    name = "device"
    holds_trees = False  # a line run holds one array

    def __init__(
        self,
        budget: int,
        *,
        line_bytes: int,
        device: jax.Device | None = None,
        implementation: str = "auto",
    ) -> None:
        super().__init__(budget, setting="device_bytes")
        if (
            isinstance(line_bytes, bool)
            or not isinstance(line_bytes, (int, np.integer))
            or (line_bytes <= 0)
        ):
            raise BudgetError(f"line_bytes={line_bytes!r} must be a positive integer")
        self.device = device if device is not None else jax.local_devices()[0]
        self.sharding = jax.sharding.SingleDeviceSharding(self.device)
        self.placement = Placement(self.device, self.sharding)
        self.host_memory = self.device.platform == "cpu"
        self.line_bytes = int(line_bytes)
        self.slab = LineSlab(
            self.budget // self.line_bytes,
            self.line_bytes,
            device=self.device,
            implementation=implementation,
        )
        self.budget = self.slab.nbytes
        self.table: dict[str, _Entry] = {}  # the indirection table
        self.entries = _SlabEntries(self)

    def room(self, nbytes: int) -> int:
        """The budget a block of ``nbytes`` takes: whole lines."""
        return lines_for(nbytes, self.line_bytes) * self.line_bytes

    def reserve(self, nbytes: int) -> bool:
        return super().reserve(self.room(nbytes))

    def release(self, nbytes: int) -> None:
        super().release(self.room(nbytes))

    def load(self, value: Any, *, owned: bool = False) -> jax.Array:
        """The block as a device array (the array a miss hands to the caller)."""
        return to_device(value, self.device, owned=owned, placement=self.placement)

    def put_reserved(self, key: str, value: Any, nbytes: int) -> None:
        if not (isinstance(value, jax.Array) and value.sharding.memory_kind in (None, "device")):
            value = self.load(value)  # from the host (numpy, or L2's pinned_host memory)
        shape, dtype = tuple(value.shape), np.dtype(value.dtype)
        with self.slab.lock:
            old = self.table.pop(key, None)
            if old is not None:
                self.slab.give(old.lines)
            lines = self.slab.take(lines_for(nbytes, self.line_bytes))
            try:
                if lines.size:
                    self.slab.write(value, lines)
            except BaseException:
                self.slab.give(lines)  # a failed write keeps no line
                self.sizes.pop(key, None)
                raise
            self.table[key] = _Entry(lines, shape, dtype)
        self.sizes[key] = nbytes

    def pop(self, key: str) -> jax.Array:
        """Removes a block and returns a copy of it; its lines are free for reuse at once."""
        with self.slab.lock:
            entry = self.table.pop(key)
            value = self.slab.read(entry.lines, entry.shape, entry.dtype)
            self.slab.give(entry.lines)
        self.sizes.pop(key, None)
        return value


def make_device_tier(
    layout: str,
    device_bytes: int,
    *,
    store: Any,
    line_bytes: int | None = None,
    device: jax.Device | None = None,
) -> AbstractTier:
    """The L1 tier for ``TieredCache(device_layout=...)``: `DeviceTier` or `SlabTier`.

    Without ``line_bytes`` a slab's lines follow the store's full chunk sizes
    (`default_line_bytes`).

    Raises:
      ValueError: an unknown layout, or ``line_bytes`` given for the arrays layout.
    """
    if layout not in DEVICE_LAYOUTS:
        raise ValueError(f"device_layout={layout!r} must be one of {DEVICE_LAYOUTS}")
    if layout == "arrays":
        if line_bytes is not None:
            raise ValueError(
                f"line_bytes={line_bytes} applies to device_layout='slab' only; drop it or "
                "set device_layout='slab'"
            )
        return DeviceTier(device_bytes, device=device)
    if line_bytes is None:
        line_bytes = default_line_bytes(
            math.prod(min(c, n) for c, n in zip(a.chunk_shape, a.shape)) * a.dtype.itemsize
            for a in store.arrays().values()
        )
    return SlabTier(device_bytes, line_bytes=line_bytes, device=device)
