"""Embedding rows: ``session.lookup(table, ids)`` serves rows of a stored table from the device.

Design note.

* A table is a stored array whose first axis is rows. Its hot rows live on the device in a fixed
  number of slots, sized by a byte budget that is reserved out of L1 (blocks are evicted to make
  room), so rows and blocks together never exceed ``device_bytes``.
* With ``device_layout="slab"`` the slots are lines taken from L1's slab: each line is cut into
  equal units of at least one row, rows are written with `pallas_kernels.pack_lines` and a lookup
  is one `pallas_kernels.gather_lines` over the slab (viewed as units; no copy). With
  ``"arrays"`` each resident row is its own device array (``jax.device_put`` per row) and a
  lookup stacks them: the baseline that the slab is measured against (``bench.embedding``).
* Every lookup adds its ids to per-row counters kept on the device (`pallas_kernels.lfu_update`,
  aged by ``0.5 ** (1 / half_life)`` per lookup); the counters never travel per lookup. Every
  ``period`` lookups the host reads all counters in one transfer and makes the most counted rows
  resident (residents win ties, so equal counts do not churn); rows that must come in are
  fetched from L2/L3 in one batch and packed in one call per power-of-two group.
* A lookup copies its ids to the host once (a batch of 64 int32 ids is 256 bytes) to find the
  rows that are not resident; those are fetched from L2/L3 in one batch (whole chunks, kept in L2
  when the policy admits them) and placed into the gathered output on the device.
* One table's lookups are meant for one serving thread; other threads may use the cache
  meanwhile (writes to the shared slab happen under the slab's lock).
* A lookup runs outside ``jax.jit``: which rows are resident is decided on the host from the
  ids' values, and the rows' storage (the slab) is replaced by every promotion, so it cannot be
  a constant of a compiled step. A serving step is split there: ``rows = s.lookup(table, ids)``,
  then ``step(params, rows)`` under ``jit``. Called with traced ids (or under a trace at all),
  a lookup raises `TracedLookupError` before it changes anything, so the session keeps working.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cacheflow_jax.core.blocks import BudgetError, block_key
from cacheflow_jax.tiers.slab import SlabTier
from pallas_kernels import gather_lines, lfu_update, pack_lines

# Counters are padded to a multiple of this, so the lfu_update kernel gets full blocks.
COUNTER_BLOCK = 256

TRACED_LOOKUP = (
    "session.lookup({table!r}) was called under a JAX transformation (jax.jit, vmap, grad, a "
    "scan body): {what}. A lookup decides on the host, from the ids' values, which rows come "
    "from the device and which are fetched from L2/L3, so it cannot run inside a traced "
    "function. Split the step there: call rows = s.lookup({table!r}, ids) outside the jitted "
    'function and pass the rows in, as in step(params, rows) (docs/kernels.md, "Lookups and '
    'jax.jit"). Nothing was changed: later lookups outside the trace work.'
)


class TracedLookupError(TypeError):
    """`ServingSession.lookup` was called inside ``jax.jit`` (or another transformation).

    The message says how to split the step; the session is left as it was.
    """


def check_not_traced(table: str, ids: Any) -> None:
    """Raises `TracedLookupError` if ``ids`` is a tracer (a lookup under ``jit``/``vmap``).

    Args:
      table: the table's path, named in the message.
      ids: the ids given to ``lookup``.

    Raises:
      TracedLookupError: ``ids`` is a ``jax.core.Tracer``.
    """
    if isinstance(ids, jax.core.Tracer):
        what = f"its ids are traced ({ids.aval.str_short()}): their values are not known"
        raise TracedLookupError(TRACED_LOOKUP.format(table=table, what=what))


def _bucket(n: int) -> int:
    """The padded size of a batch of ``n`` missing rows: 0 or a power of two (few compiles)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def _rows_from_words(words, row_shape: tuple[int, ...], dtype: np.dtype):
    """``(n, w)`` words (each row's bytes, zero-padded) as ``(n, *row_shape)`` of ``dtype``."""
    n = words.shape[0]
    raw = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(n, -1)
    count = math.prod(row_shape)
    if dtype == np.bool_:
        return raw[:, :count].astype(jnp.bool_).reshape((n, *row_shape))
    raw = raw[:, : count * dtype.itemsize]
    if dtype.itemsize > 1:
        raw = raw.reshape(n, count, dtype.itemsize)
    return jax.lax.bitcast_convert_type(raw, dtype).reshape((n, *row_shape))


def _rows_to_words(rows, row_words: int, word: np.dtype):
    """``(n, *row_shape)`` rows as ``(n, row_words)`` words, each row zero-padded."""
    n = rows.shape[0]
    flat = rows.reshape(n, -1)
    if flat.dtype == jnp.bool_:
        flat = flat.astype(jnp.uint8)
    raw = jax.lax.bitcast_convert_type(flat, jnp.uint8).reshape(n, -1)
    raw = jnp.pad(raw, ((0, 0), (0, row_words * word.itemsize - raw.shape[1])))
    if word.itemsize == 1:
        return raw
    return jax.lax.bitcast_convert_type(raw.reshape(n, row_words, word.itemsize), word)


@functools.partial(
    jax.jit, static_argnames=("unit_words", "row_shape", "dtype", "implementation", "lead")
)
def _gather_rows(slab, units, miss_pos, miss_rows, *, unit_words, row_shape, dtype, implementation,
                 lead):  # fmt: skip
    """The rows at ``units`` (``(n, k)`` unit indices of the slab), misses filled in, shaped
    ``lead + row_shape`` (``lead``: the ids' shape)."""
    n, k = units.shape
    view = slab.reshape(-1, unit_words)  # the slab as units: a bitcast, not a copy
    words = gather_lines(view, units.reshape(-1), implementation=implementation)
    rows = _rows_from_words(words.reshape(n, k * unit_words), row_shape, dtype)
    return rows.at[miss_pos].set(miss_rows, mode="drop").reshape(*lead, *row_shape)


@functools.partial(jax.jit, static_argnames=("unit_words", "implementation"), donate_argnums=(0,))
def _pack_rows(slab, rows, units, *, unit_words, implementation):
    """Writes ``rows`` into the slab's ``units`` (``(n, k)``), in place."""
    n, k = units.shape
    words = _rows_to_words(rows, k * unit_words, np.dtype(slab.dtype))
    view = pack_lines(
        slab.reshape(-1, unit_words),
        words.reshape(n * k, unit_words),
        units.reshape(-1),
        implementation=implementation,
    )
    return view.reshape(slab.shape)


@functools.partial(jax.jit, static_argnames=("lead",))
def _stack_rows(rows, miss_pos, miss_rows, *, lead):
    """The arrays layout's lookup: one array per resident row, stacked, misses filled in,
    shaped ``lead`` (the ids' shape) + the row's shape."""
    out = jnp.stack(rows).at[miss_pos].set(miss_rows, mode="drop")
    return out.reshape(*lead, *out.shape[1:])


class EmbeddingRows:
    """The device-resident hot rows of one stored table, and its device-side row counters.

    Made by `ServingSession.lookup`; see the module docstring for the design.

    Args:
      cache: the `TieredCache` whose store holds the table and whose L1 lends the room.
      table: the stored array's path (its first axis is rows).
      device_bytes: L1 bytes for this table's rows (rounded down to whole lines in a slab).
      period: lookups between two promotion decisions.
      half_life: the counters' half-life, in lookups.

    Raises:
      KeyError: no array ``table`` in the store.
      BudgetError: ``device_bytes`` holds no row, or does not fit in L1.
    """

    def __init__(
        self, cache: Any, table: str, *, device_bytes: int, period: int, half_life: float
    ) -> None:
        arrays = cache.store.arrays()
        if table not in arrays:
            raise KeyError(
                f"no array {table!r} in store {cache.store.spec}; lookup takes a stored "
                f"array's path, one of {sorted(arrays)[:8]}"
            )
        info = arrays[table]
        if len(info.shape) < 1:
            raise ValueError(f"lookup: {table!r} is a scalar; it needs a first axis of rows")
        if period < 1 or half_life <= 0:
            raise ValueError(f"lookup: period={period} must be >= 1, half_life={half_life} > 0")
        self.table, self._cache = table, cache
        self.num_rows = int(info.shape[0])
        self.row_shape = tuple(int(s) for s in info.shape[1:])
        self.dtype = np.dtype(info.dtype)
        self.row_bytes = math.prod(self.row_shape) * self.dtype.itemsize
        self._chunk_rows = int(info.chunk_shape[0])
        self._rest = [
            (idx, tuple(i * c for i, c in zip(idx, info.chunk_shape[1:])))
            for idx in itertools.product(*(range(g) for g in info.grid_shape[1:]))
        ]
        self.period = int(period)
        self.decay = 0.5 ** (1.0 / half_life)
        tier = cache.tiers[0]
        self._tier = tier
        self.layout = "slab" if isinstance(tier, SlabTier) else "arrays"
        if self.layout == "slab":
            self._plan_units(tier, device_bytes)
        else:
            self.capacity = min(self.num_rows, device_bytes // max(self.row_bytes, 1))
            self._reserved = self.capacity * self.row_bytes
        if self.capacity < 1:
            raise BudgetError(
                f"embedding_bytes={device_bytes} holds no row of {table!r} ({self.row_bytes} "
                "bytes per row"
                + (f", {tier.line_bytes}-byte lines" if self.layout == "slab" else "")
                + "); raise embedding_bytes"
            )
        padded = -(-self.num_rows // COUNTER_BLOCK) * COUNTER_BLOCK
        self.counters = jax.device_put(np.zeros(padded, np.float32), tier.device)
        if isinstance(self.counters, jax.core.Tracer):  # concrete ids, but under a trace
            raise TracedLookupError(
                TRACED_LOOKUP.format(table=table, what="its first lookup ran inside a trace")
            )
        cache.reserve_device(self._reserved)
        self._arrays: list[jax.Array | None] = []
        if self.layout == "slab":
            with tier.slab.lock:
                lines = tier.slab.take(self._reserved // tier.line_bytes)
            self._lines = lines
            units = (
                lines[:, None] * self._units_per_line + np.arange(self._units_per_line)[None, :]
            ).reshape(-1)
            self._units = units[: self.capacity * self._k].reshape(self.capacity, self._k)
            self._units = self._units.astype(np.int32)
        else:
            self._arrays = [None] * self.capacity
            self._blank = jax.device_put(np.zeros(self.row_shape, self.dtype), tier.device)
        self._slot_of = np.full(self.num_rows, -1, np.int64)  # row -> slot (host mirror)
        self._row_at = np.full(self.capacity, -1, np.int64)  # slot -> row
        self._lookups = 0
        self._n = {
            "lookups": 0,
            "rows": 0,
            "rows_device": 0,
            "rows_fetched": 0,
            "promotions": 0,
            "rows_promoted": 0,
        }
        self._closed = False

    def _plan_units(self, tier: SlabTier, device_bytes: int) -> None:
        """Cuts the slab's lines into units that hold a row (or a row spans whole lines)."""
        word = tier.slab.word.itemsize
        line_words = tier.slab.line_words
        row_words = -(-self.row_bytes // word)
        if row_words <= line_words:
            # The smallest divisor of a line that holds a row: lines split evenly into units.
            unit_words = next(
                d for d in range(max(row_words, 1), line_words + 1) if line_words % d == 0
            )
            self._k = 1
        else:
            unit_words = line_words
            self._k = -(-row_words // line_words)
        self._unit_words = unit_words
        self._units_per_line = line_words // unit_words
        lines = device_bytes // tier.line_bytes
        self.capacity = min(self.num_rows, lines * self._units_per_line // self._k)
        used_units = self.capacity * self._k
        self._reserved = -(-used_units // self._units_per_line) * tier.line_bytes

    # -------------------------------------------------------------------------------- lookup

    def lookup(self, ids: Any) -> jax.Array:
        """The rows ``table[ids]`` as a device array of shape ``ids.shape + row_shape``.

        Raises:
          IndexError: an id outside ``[0, num_rows)``, named with the table.
          ValueError: ``ids`` are not integers.
          TracedLookupError: called under ``jax.jit`` or another transformation; nothing is
            changed.
        """
        if self._closed:
            raise RuntimeError(f"lookup of {self.table!r} after its serving session ended")
        check_not_traced(self.table, ids)
        on_device = isinstance(ids, jax.Array)
        # Ids on the host stay there until the counters' update takes them (no eager transfer
        # and dtype conversion of their own: each is a dispatch); device ids come down once.
        try:
            host = np.asarray(ids)  # the one device-to-host copy of a lookup of device ids
        except jax.errors.TracerArrayConversionError:  # traced values inside a list or tuple
            what = "its ids hold traced values: their values are not known"
            raise TracedLookupError(TRACED_LOOKUP.format(table=self.table, what=what)) from None
        if not np.issubdtype(host.dtype, np.integer):
            raise ValueError(f"lookup of {self.table!r}: ids must be integers, not {host.dtype}")
        shape = host.shape
        flat = host.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_rows):
            bad = flat[(flat < 0) | (flat >= self.num_rows)][0]
            raise IndexError(
                f"row id {int(bad)} is outside table {self.table!r} of {self.num_rows} rows"
            )
        # In range, so int32 holds them (as jnp.asarray would make them with x64 off).
        counters = lfu_update(self.counters, ids if on_device else flat.astype(np.int32),
                              decay=self.decay)  # fmt: skip
        if isinstance(counters, jax.core.Tracer):  # concrete ids, but under a trace
            what = "the ids are values, but the lookup ran inside a traced function"
            raise TracedLookupError(TRACED_LOOKUP.format(table=self.table, what=what))
        self.counters = counters
        slots = self._slot_of[flat]
        miss = np.nonzero(slots < 0)[0]
        size = _bucket(miss.size)
        miss_pos = np.full(size, flat.size, np.int32)  # padding lands out of range: dropped
        miss_pos[: miss.size] = miss
        miss_rows = np.zeros((size, *self.row_shape), self.dtype)
        if miss.size:
            wanted, inverse = np.unique(flat[miss], return_inverse=True)
            miss_rows[: miss.size] = self._fetch(wanted)[inverse]
        if self.layout == "slab":
            units = self._units[np.where(slots < 0, 0, slots)]
            slab = self._tier.slab
            with slab.lock:
                out = _gather_rows(
                    slab.array,
                    units,
                    miss_pos,
                    miss_rows,
                    unit_words=self._unit_words,
                    row_shape=self.row_shape,
                    dtype=self.dtype,
                    implementation=slab.implementation,
                    lead=shape,
                )
        else:
            rows = tuple(self._blank if s < 0 else self._arrays[s] for s in slots)
            out = _stack_rows(rows, miss_pos, miss_rows, lead=shape)
        n = self._n
        n["lookups"] += 1
        n["rows"] += flat.size
        n["rows_fetched"] += miss.size
        n["rows_device"] += flat.size - miss.size
        self._lookups += 1
        if self._lookups % self.period == 0:
            self.promote()
        return out

    def _fetch(self, rows: np.ndarray) -> np.ndarray:
        """Rows (sorted, distinct) read from L2/L3 in one batch of whole chunks."""
        chunk_of = rows // self._chunk_rows
        chunks, starts = np.unique(chunk_of, return_index=True)  # sorted rows: chunks in runs
        keys = [block_key(self.table, (int(c), *idx)) for c in chunks for idx, _ in self._rest]
        values = iter(self._cache.get_host_many(keys))
        out = np.empty((rows.size, *self.row_shape), self.dtype)
        for c, lo, hi in zip(chunks, starts, [*starts[1:], rows.size]):
            local = rows[lo:hi] - int(c) * self._chunk_rows
            for _, origin in self._rest:
                value = np.asarray(next(values))
                region = tuple(slice(o, o + s) for o, s in zip(origin, value.shape[1:]))
                out[(slice(lo, hi), *region)] = value[local]
        return out

    # ----------------------------------------------------------------------------- promotion

    def promote(self) -> None:
        """Reads the counters (one transfer) and makes the most counted rows resident."""
        counts = np.asarray(self.counters)[: self.num_rows]
        resident = self._slot_of >= 0
        # Doubled counts plus one for residents: a resident wins a tie against a newcomer.
        score = counts.astype(np.float64) * 2 + resident
        if self.num_rows > self.capacity:
            top = np.argpartition(-score, self.capacity - 1)[: self.capacity]
        else:
            top = np.arange(self.num_rows)
        top = top[counts[top] > 0]
        want = np.zeros(self.num_rows, bool)
        want[top] = True
        leaving = np.nonzero(resident & ~want)[0]
        coming = np.nonzero(want & ~resident)[0]
        n = self._n
        n["promotions"] += 1
        if not coming.size:
            return
        self._row_at[self._slot_of[leaving]] = -1
        self._slot_of[leaving] = -1
        free = np.nonzero(self._row_at < 0)[0][: coming.size]
        rows = self._fetch(coming)
        self._store(rows, free)
        self._slot_of[coming] = free
        self._row_at[free] = coming
        n["rows_promoted"] += coming.size

    def _store(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Writes rows into slots: packed in groups of power-of-two sizes, or one array each."""
        if self.layout == "arrays":
            for row, slot in zip(rows, slots):
                self._arrays[slot] = jax.device_put(row, self._tier.device)
            return
        slab, start = self._tier.slab, 0
        while start < slots.size:
            size = 1 << ((slots.size - start).bit_length() - 1)
            part = slice(start, start + size)
            with slab.lock:
                slab.array = _pack_rows(
                    slab.array,
                    rows[part],
                    self._units[slots[part]],
                    unit_words=self._unit_words,
                    implementation=slab.implementation,
                )
            start += size

    # ---------------------------------------------------------------------------- bookkeeping

    def stats(self) -> dict:
        """Lookup counters: rows served from the device, rows fetched from L2/L3, promotions."""
        n = dict(self._n)
        n["device_hit_ratio"] = n["rows_device"] / n["rows"] if n["rows"] else 0.0
        n.update(
            capacity=self.capacity, layout=self.layout, resident=int((self._row_at >= 0).sum())
        )
        return n

    def close(self) -> None:
        """Frees the rows' device room (slab lines back to the free list; arrays dropped)."""
        if self._closed:
            return
        self._closed = True
        if self.layout == "slab":
            with self._tier.slab.lock:
                self._tier.slab.give(self._lines)
        self._arrays = []
        self._cache.release_device(self._reserved)
