"""Sharded leaves: each process of a ``jax.distributed`` job reads only its addressable shards.

Design note. A `LazyArray` restored with a target sharding (``restore_lazy(target=...)`` with
``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves), or given one to `materialize`,
becomes a global ``jax.Array`` the way orbax restores one: the sharding's
``addressable_devices_indices_map`` says which slice of the array each of this process's
devices holds; each distinct slice is read through the cache as a selection (only the blocks
that intersect it, see ``indexing``), joined and cut on the cache's device, put on the devices
that hold it, and the shards become one array with ``jax.make_array_from_single_device_arrays``.
No process reads another's shards, so N processes each read about 1/N of a checkpoint saved
with a mesh over them (plus the arrays every process holds whole, as with orbax).

The blocks of several slices are fetched with one ``get_many`` (up to ``batch_bytes``), so all of
their L3 reads are issued at once, as `materialize` does for whole leaves.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from cacheflow_jax.core.blocks import block_key
from cacheflow_jax.orbax.indexing import chunks_touched, cut_selection, join_blocks, normalize_index

if TYPE_CHECKING:
    from cacheflow_jax.cache.tiered import TieredCache


class _Piece:
    """One distinct slice of one leaf that this process holds: its blocks and its devices."""

    __slots__ = ("slot", "selection", "needed", "keys", "devices", "nbytes")

    def __init__(
        self, slot: int, selection: list[Any], needed: list[list[int]], keys: list[str], nbytes: int
    ) -> None:
        self.slot = slot
        self.selection = selection
        self.needed = needed
        self.keys = keys
        self.devices: list[jax.Device] = []
        self.nbytes = nbytes


def check_sharding(sharding: Any, shape: tuple[int, ...], path: str) -> jax.sharding.Sharding:
    """Checks that ``sharding`` is a ``jax.sharding.Sharding`` that can hold an array of
    ``shape``; returns it.

    Raises:
      TypeError: ``sharding`` is not a ``jax.sharding.Sharding``.
      ValueError: the sharding cannot shard an array of this shape (its mesh axes do not
        divide the dimensions they split, or its rank differs).
    """
    if not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(
            f"the sharding of LazyArray {path!r} must be a jax.sharding.Sharding (for example "
            f"NamedSharding(mesh, PartitionSpec(...))), got {type(sharding).__name__}"
        )
    try:
        sharding.shard_shape(shape)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"sharding {sharding} cannot hold LazyArray {path!r} of shape {shape}: {err}"
        ) from None
    return sharding


def materialize_sharded(
    items: Sequence[tuple[int, Any, jax.sharding.Sharding]],
    cache: TieredCache,
    batch_bytes: int,
) -> dict[int, jax.Array]:
    """Reads the addressable shards of sharded leaves through ``cache`` into global arrays.

    Args:
      items: ``(slot, leaf, sharding)`` for each leaf: ``slot`` names it in the result, ``leaf``
        is a `LazyArray` over ``cache``.
      cache: the cache every leaf reads through.
      batch_bytes: the most block bytes one ``get_many`` asks for (at least one slice each).

    Returns:
      ``{slot: jax.Array}``: each a global array with the leaf's shape, dtype and ``sharding``,
      whose addressable shards are bitwise the stored data.
    """
    pieces: list[_Piece] = []
    shards: dict[int, tuple[Any, jax.sharding.Sharding, dict[jax.Device, _Piece]]] = {}
    for slot, leaf, sharding in items:
        by_slice: dict[tuple, _Piece] = {}
        placed: dict[jax.Device, _Piece] = {}
        for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
            selection = normalize_index(tuple(index), leaf.shape, leaf.path)
            ident = tuple(
                (s.start, s.stop, s.step) if isinstance(s, range) else s for s in selection
            )
            piece = by_slice.get(ident)
            if piece is None:
                piece = by_slice[ident] = _plan(slot, leaf, selection)
                pieces.append(piece)
            piece.devices.append(device)
            placed[device] = piece
        shards[slot] = (leaf, sharding, placed)
    values: dict[int, jax.Array] = {}
    for batch in _batches(pieces, batch_bytes):
        blocks = iter(cache.get_many([k for p in batch for k in p.keys]))
        for piece in batch:
            values[id(piece)] = _cut(
                shards[piece.slot][0], piece, [next(blocks) for _ in piece.keys]
            )
    out = {}
    for slot, (leaf, sharding, placed) in shards.items():
        arrays = [jax.device_put(values[id(placed[d])], d) for d in sharding.addressable_devices]
        out[slot] = jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)
    return out


def _plan(slot: int, leaf: Any, selection: list[Any]) -> _Piece:
    """The blocks of ``leaf`` that a selection touches."""
    needed = [chunks_touched(s, c) for s, c in zip(selection, leaf.block_shape)]
    grid = list(np.ndindex(*(len(n) for n in needed)))
    if any(not n for n in needed):  # an empty slice: nothing to read
        grid = []
    keys = [block_key(leaf.path, tuple(n[i] for n, i in zip(needed, g))) for g in grid]
    block = math.prod(leaf.block_shape) * leaf.itemsize
    return _Piece(slot, selection, needed, keys, len(keys) * block)


def _cut(leaf: Any, piece: _Piece, blocks: list[jax.Array]) -> jax.Array:
    """The piece's slice, from its blocks (on the cache's device)."""
    shape = tuple(len(s) for s in piece.selection if isinstance(s, range))
    if not piece.keys:
        return jax.numpy.zeros(shape, leaf.dtype)
    grid = tuple(len(n) for n in piece.needed)
    joined = join_blocks(dict(zip(np.ndindex(*grid), blocks)), grid)
    return cut_selection(joined, piece.selection, piece.needed, leaf.block_shape, leaf.shape)


def _batches(pieces: Iterable[_Piece], limit: int) -> Iterable[list[_Piece]]:
    """Consecutive pieces in batches of at most ``limit`` block bytes (at least one each)."""
    batch: list[_Piece] = []
    size = 0
    for piece in pieces:
        if batch and size + piece.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(piece)
        size += piece.nbytes
    if batch:
        yield batch
