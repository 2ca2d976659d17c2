"""Basic indexing of a `LazyArray`: which blocks a selection touches, and how the blocks fetched
are joined on the device and the selection cut out of them (no device -> host round trip)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

UNSUPPORTED_INDEX = (
    "LazyArray {path!r} supports basic indexing only (ints, slices, '...'), got {index!r}; "
    "for other indexing, index the materialized array: np.asarray(leaf)[...] or "
    "materialize(leaf)[...]"
)


def join_blocks(cells: dict[tuple[int, ...], jax.Array], grid: tuple[int, ...]) -> jax.Array:
    """Concatenates a grid of device blocks: the last axis first, one concatenate per row."""
    for axis in reversed(range(len(grid))):
        if grid[axis] == 1:
            cells = {idx[:-1]: v for idx, v in cells.items()}
        else:
            rows: dict[tuple[int, ...], list[jax.Array]] = {}
            for idx in sorted(cells):
                rows.setdefault(idx[:-1], []).append(cells[idx])
            cells = {k: jnp.concatenate(v, axis=axis) for k, v in rows.items()}
    return cells[()]


def normalize_index(index: Any, shape: tuple[int, ...], path: str) -> list[int | range]:
    """Turns a basic index into one int or range of element positions per dimension."""
    items = index if isinstance(index, tuple) else (index,)
    ellipses = [i for i, x in enumerate(items) if x is Ellipsis]
    if len(ellipses) > 1:
        raise IndexError(f"an index can only have a single ellipsis ('...'), got {index!r}")
    if ellipses:
        at = ellipses[0]
        fill = len(shape) - (len(items) - 1)
        items = items[:at] + (slice(None),) * max(fill, 0) + items[at + 1 :]
    if len(items) > len(shape):
        raise IndexError(
            f"too many indices for LazyArray {path!r}: it is {len(shape)}-dimensional, but "
            f"{len(items)} were indexed"
        )
    items = items + (slice(None),) * (len(shape) - len(items))
    out: list[int | range] = []
    for axis, (item, n) in enumerate(zip(items, shape)):
        if isinstance(item, int | np.integer) and not isinstance(item, bool | np.bool_):
            j = int(item) + (n if item < 0 else 0)
            if not 0 <= j < n:
                raise IndexError(
                    f"index {item} is out of bounds for axis {axis} with size {n} of LazyArray "
                    f"{path!r}"
                )
            out.append(j)
        elif isinstance(item, slice):
            out.append(range(*item.indices(n)))
        else:
            raise TypeError(UNSUPPORTED_INDEX.format(path=path, index=index))
    return out


def chunks_touched(sel: int | range, chunk: int) -> list[int]:
    """The sorted chunk indices along one axis that hold selected elements."""
    if isinstance(sel, int):
        return [sel // chunk]
    if not sel:
        return []
    lo, hi = min(sel[0], sel[-1]), max(sel[0], sel[-1])
    if abs(sel.step) < chunk:
        # Consecutive picks are less than a chunk apart, so every chunk in between is touched.
        return list(range(lo // chunk, hi // chunk + 1))
    return sorted({p // chunk for p in sel})


def cut_selection(
    joined: jax.Array,
    sel: Sequence[int | range],
    needed: Sequence[list[int]],
    chunk_shape: tuple[int, ...],
    shape: tuple[int, ...],
) -> jax.Array:
    """Cuts the selection out of the joined blocks (the touched chunks, packed together)."""
    out = joined
    # Highest axis first, so that dropping an int-indexed axis does not renumber the rest.
    for axis in reversed(range(len(sel))):
        c, n, s = chunk_shape[axis], shape[axis], sel[axis]
        starts: dict[int, int] = {}
        pos = 0
        for k in needed[axis]:
            starts[k] = pos
            pos += min(c, n - k * c)

        def packed(p: int, c: int = c, starts: dict[int, int] = starts) -> int:
            return starts[p // c] + p % c

        if isinstance(s, int):
            out = jax.lax.index_in_dim(out, packed(s), axis=axis, keepdims=False)
        elif s.step == 1:
            lo, hi = packed(s[0]), packed(s[-1]) + 1
            if (lo, hi) != (0, out.shape[axis]):
                out = jax.lax.slice_in_dim(out, lo, hi, axis=axis)
        else:
            out = jnp.take(out, np.array([packed(p) for p in s], np.int32), axis=axis)
    return out
