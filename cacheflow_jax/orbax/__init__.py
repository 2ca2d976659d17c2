"""The orbax hook: open an orbax checkpoint lazily, block by block, through a `TieredCache`.

Design note. ``restore_lazy(path)`` reads no array data: it opens the checkpoint in place as an L3
store (see `cacheflow_jax.open_store`) and returns a pytree shaped exactly like
``ocp.StandardCheckpointer().restore(path)`` (same nested dicts and lists, same string keys such as
``'0'`` for the layers of a Flax NNX pure dict, same ``None`` and empty nodes), whose array leaves
are `LazyArray` handles. A `LazyArray` knows its shape, dtype and block keys; its data moves only
when asked for, and only through the cache:

* ``leaf.block(index)`` is one block (one stored chunk) on the device, as the cache holds it;
* ``leaf[3, :128]`` (ints, slices and ``...``) fetches only the blocks that intersect the
  selection, with one ``get_many``;
* ``np.asarray(leaf)`` / ``jnp.asarray(leaf)`` and `materialize` fetch all of a leaf's blocks.

Assembly happens on the device: the blocks are already device arrays (L1), so a leaf is built with
one ``jnp.concatenate`` per split axis (each a single device copy) and never goes
device -> host -> device. A leaf of a single chunk is the cached block itself (no copy; JAX arrays
are immutable, so sharing it with L1 is safe).

Leaves orbax stores as ``scalar`` (Python ints and floats) are restored eagerly as Python scalars,
exactly as orbax returns them; they are a few bytes each and not worth a cache slot.

A `LazyArray` is not a ``jax.Array``: JAX no longer converts such objects while tracing (its
``__jax_array__`` hook is not called during abstractification), so a leaf passed to ``jax.jit``
or a ``jnp`` function fails. A model runs on ``materialize(subtree)``: one ``get_many`` for a
layer's blocks, a pytree of ``jax.Array`` back, which ``nnx.merge`` (inside a jitted step) turns
into the layer. Arithmetic on a leaf raises a ``TypeError`` saying so.

Blocks can be smaller than the checkpoint's chunks: orbax writes one chunk per array by default,
and a cache serves a chunk larger than its block size as sub-blocks of leading rows (see
``cacheflow_jax.store.subblocks``); a leaf's ``block_shape`` and ``keys`` follow the cache's blocks,
its ``chunk_shape`` is the chunk as stored.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cacheflow_jax.cache.tiered import TieredCache
from cacheflow_jax.core.blocks import ArrayInfo, StoreError, block_key
from cacheflow_jax.orbax.indexing import (
    chunks_touched,
    cut_selection,
    join_blocks,
    normalize_index,
)
from cacheflow_jax.orbax.sharded import check_sharding, materialize_sharded
from cacheflow_jax.orbax.trees import (
    check_same_checkpoint,
    label,
    map_skeleton,
    restore_into,
)
from cacheflow_jax.policies import Policy
from cacheflow_jax.store.open import open_store
from cacheflow_jax.store.tensorstore_store import TensorStoreStore
from cacheflow_jax.store.verify import verify_checkpoint
from cacheflow_jax.tiers.budgets import default_budgets

__all__ = ["LazyArray", "default_budgets", "materialize", "restore_lazy", "verify_checkpoint"]

_NOT_AN_ARRAY = (
    "LazyArray {path!r} is a handle to checkpoint data, not a jax.Array, so {what} is not "
    "defined on it; call materialize(leaf) (or leaf.value()) for the whole array on the device, "
    "materialize(subtree) for a layer's arrays with one get_many, or leaf[...] for a slice"
)



class LazyArray:
    """One array of a lazily restored checkpoint; its blocks are read through a `TieredCache`.

    Built by `restore_lazy`; not constructed directly in normal use.

    Args:
      cache: the cache that serves the blocks (its store holds the array).
      info: the stored array's metadata (``cache.store.arrays()[path]``).
      sharding: where `materialize` puts the array (a target leaf's sharding in
        `restore_lazy`); None: the cache's L1 device.

    >>> tree = restore_lazy(step_dir, device_bytes=1 << 30, host_bytes=1 << 30)  # doctest: +SKIP
    >>> w = tree["layers"]["0"]["w"]  # doctest: +SKIP
    >>> w.shape, w.keys[:1], w[0, :4]  # doctest: +SKIP
    """

    __slots__ = ("_cache", "_info", "_keys", "_sharding")

    def __init__(
        self, cache: TieredCache, info: ArrayInfo, *, sharding: jax.sharding.Sharding | None = None
    ) -> None:
        self._cache = cache
        self._info = info
        self._sharding = None if sharding is None else check_sharding(sharding, info.shape, info.path)
        self._keys = tuple(block_key(info.path, idx) for idx in np.ndindex(*info.grid_shape))

    # ---- metadata (no I/O)

    @property
    def path(self) -> str:
        """The array path in the store (``"layers/0/w"``); block keys are ``path@i,j``."""
        return self._info.path

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""
        return self._info.shape

    @property
    def dtype(self) -> np.dtype:
        """The array's dtype, as stored."""
        return self._info.dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self._info.shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return math.prod(self._info.shape)

    @property
    def nbytes(self) -> int:
        """The array's size in bytes."""
        return self._info.nbytes

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._info.dtype.itemsize

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The shape of one block (blocks at the array's far edges may be smaller)."""
        return self._info.chunk_shape

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The shape of one chunk as stored (larger than `block_shape` for sub-blocks)."""
        return self._info.stored_chunks

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """The number of blocks along each dimension."""
        return self._info.grid_shape

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """Where `materialize` puts the array: the target's sharding it was restored with, else
        the cache's L1 device (a single device)."""
        if self._sharding is not None:
            return self._sharding
        return jax.sharding.SingleDeviceSharding(self._cache.device)

    @property
    def target_sharding(self) -> jax.sharding.Sharding | None:
        """The sharding of the target leaf it was restored into (None: none was given)."""
        return self._sharding

    def shape_dtype_struct(self) -> jax.ShapeDtypeStruct:
        """The array's ``jax.ShapeDtypeStruct`` (shape, dtype, sharding), e.g. for ``jax.eval_shape``."""
        return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=self.sharding)

    @property
    def keys(self) -> tuple[str, ...]:
        """The array's block keys, in C order of the block grid."""
        return self._keys

    @property
    def cache(self) -> TieredCache:
        """The cache the blocks are read through."""
        return self._cache

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"len() of unsized LazyArray {self.path!r} (a 0-d array)")
        return self.shape[0]

    def __repr__(self) -> str:
        # JAX quotes this in its error for a LazyArray passed to jit or a jnp function, so it
        # says what to call instead.
        return (
            f"LazyArray({self.path!r}, shape={self.shape}, dtype={self.dtype}, "
            f"blocks={len(self._keys)}; not a jax.Array: pass materialize(leaf) to JAX)"
        )

    # ---- data (through the cache)

    def block(self, index: int | Sequence[int]) -> jax.Array:
        """Returns one block of the array (a chunk as stored) on the device, via the cache.

        Args:
          index: the block's position in the block grid (``grid_shape``); an int for 1-d arrays,
            ``()`` for 0-d arrays.

        Returns:
          The block, shaped like the chunk (clipped at the array's edge).

        Raises:
          IndexError: ``index`` is outside the block grid.
        """
        idx = (index,) if isinstance(index, int | np.integer) else tuple(index)
        grid = self.grid_shape
        if len(idx) != len(grid) or any(not 0 <= int(i) < g for i, g in zip(idx, grid)):
            raise IndexError(
                f"block index {index!r} is outside the block grid {grid} of LazyArray {self.path!r}"
            )
        return self._cache.get(block_key(self.path, idx))

    def __getitem__(self, index: Any) -> jax.Array:
        """Returns ``array[index]`` reading only the blocks that intersect the selection.

        Args:
          index: basic indexing: ints, slices (any step) and at most one ``...``.

        Returns:
          The selection as a device array (a copy only where blocks had to be joined or cut).

        Raises:
          IndexError: an index is out of bounds, or there are too many indices.
          TypeError: advanced indexing (arrays, booleans, ``None``); see the message.
        """
        sel = normalize_index(index, self.shape, self.path)
        needed = [chunks_touched(s, c) for s, c in zip(sel, self.block_shape)]
        out_shape = tuple(len(s) for s in sel if isinstance(s, range))
        if any(not n for n in needed):
            return jnp.zeros(out_shape, self.dtype)
        grid_index = list(np.ndindex(*(len(n) for n in needed)))
        keys = [block_key(self.path, tuple(n[i] for n, i in zip(needed, g))) for g in grid_index]
        blocks = self._cache.get_many(keys)
        joined = join_blocks(dict(zip(grid_index, blocks)), tuple(len(n) for n in needed))
        return cut_selection(joined, sel, needed, self.block_shape, self.shape)

    def value(self) -> jax.Array:
        """Returns the whole array on the cache's device (all blocks with one ``get_many``;
        `materialize` applies the leaf's sharding)."""
        return _assemble(self, self._cache.get_many(self._keys))

    def assemble(self, blocks: Sequence[jax.Array]) -> jax.Array:
        """Joins blocks fetched for `keys` (in that order) into the whole array, on the device.

        For serving loops that fetch the blocks of several leaves with one ``get_many``.

        Args:
          blocks: one array per key of `keys`, as ``cache.get_many(leaf.keys)`` returns them.

        Returns:
          The array; for a single-block leaf, the block itself (no copy).

        Raises:
          ValueError: the number of blocks is not ``len(keys)``.
        """
        if len(blocks) != len(self._keys):
            raise ValueError(
                f"LazyArray {self.path!r} has {len(self._keys)} blocks, got {len(blocks)}"
            )
        return _assemble(self, blocks)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """Returns the whole array as numpy (``np.asarray(leaf)``), read through the cache.

        Raises:
          ValueError: ``copy=False``: the data is read from the cache, so it is always a copy.
        """
        if copy is False:
            raise ValueError(
                f"np.asarray(LazyArray {self.path!r}, copy=False) is impossible: the data is "
                "read through the cache into a new array; drop copy=False"
            )
        out = np.asarray(self.value())
        if dtype is not None and np.dtype(dtype) != out.dtype:
            out = out.astype(dtype)
        return out

    # ---- what a LazyArray is not

    def _not_an_array(self, what: str) -> TypeError:
        return TypeError(_NOT_AN_ARRAY.format(path=self.path, what=what))

    def __bool__(self) -> bool:
        raise self._not_an_array("truth value")

    def __iter__(self) -> Any:
        raise self._not_an_array("iteration")

    def astype(self, dtype: Any) -> Any:
        """Not defined: raises a ``TypeError`` saying to materialize first."""
        raise self._not_an_array("astype")


def _refuse(name: str) -> Any:
    """An operator of `LazyArray` that raises a TypeError naming what to call instead."""

    def op(self: LazyArray, *args: Any, **kwargs: Any) -> Any:
        raise self._not_an_array(f"the operator {name}")

    op.__name__ = name
    op.__doc__ = "Not defined: raises a ``TypeError`` saying to materialize first."
    return op


for _name in [
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__rmod__",
    "__pow__",
    "__rpow__",
    "__matmul__",
    "__rmatmul__",
    "__neg__",
    "__pos__",
    "__abs__",
    "__invert__",
    "__and__",
    "__rand__",
    "__or__",
    "__ror__",
    "__xor__",
    "__rxor__",
    "__lshift__",
    "__rlshift__",
    "__rshift__",
    "__rrshift__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__float__",
    "__int__",
    "__complex__",
    "__index__",
]:
    setattr(LazyArray, _name, _refuse(_name))
del _name


# --------------------------------------------------------------------------------------------
# restore_lazy / materialize


def _cache_for(
    path: Any,
    cache: TieredCache | None,
    *,
    device_bytes: int | None,
    host_bytes: int | None,
    policy: str | Policy,
    step: int | None,
    block_bytes: int | None,
    runtime: Any,
    prefetcher: Any,
    prefetch: Any,
) -> TieredCache:
    """`restore_lazy`'s cache: the one given (with no settings beside it), else a new one over
    ``open_store(path, step=step, runtime=runtime)``."""
    if cache is None:
        if device_bytes is None or host_bytes is None:
            default_device, default_host = default_budgets()
            device_bytes = default_device if device_bytes is None else device_bytes
            host_bytes = default_host if host_bytes is None else host_bytes
        store = open_store(path, step=step, runtime=runtime)
        cache = TieredCache(
            store,
            device_bytes=device_bytes,
            host_bytes=host_bytes,
            policy=policy,
            block_bytes=block_bytes,
            prefetcher=prefetcher,
            prefetch=prefetch,
        )
    else:
        if (
            device_bytes is not None
            or host_bytes is not None
            or block_bytes is not None
            or prefetcher is not None
            or prefetch is not None
        ):
            raise ValueError(
                f"restore_lazy({label(path)!r}): pass either cache= or device_bytes=/"
                "host_bytes=/block_bytes=/prefetcher=/prefetch=, not both (the settings of an "
                "existing cache are fixed)"
            )
    return cache


def restore_lazy(
    path: str | os.PathLike[str] | Mapping[str, Any],
    *,
    cache: TieredCache | None = None,
    device_bytes: int | None = None,
    host_bytes: int | None = None,
    policy: str | Policy = "lfu",
    step: int | None = None,
    target: Any = None,
    block_bytes: int | None = None,
    runtime: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    prefetcher: Any = None,
    prefetch: Any = None,
) -> Any:
    """Opens an orbax checkpoint lazily: a pytree like orbax's restore, with `LazyArray` leaves.

    Reads metadata only (and the few bytes of Python scalar leaves).

    Args:
      path: a ``CheckpointManager`` root (its latest step is opened, as orbax's
        ``latest_step``, or ``step``), a step directory holding one item (``<root>/<step>``), or
        an orbax item directory (holding ``_METADATA``), as a path, URL or kvstore spec
        (anything `cacheflow_jax.open_store` takes). A cacheflow store written by
        ``write_store`` works too and gives back the tree that was written.
      cache: the cache to read through; its store must be this checkpoint. If omitted, the
        checkpoint is opened with ``open_store(path, step=step, runtime=runtime)`` and a new
        `TieredCache` is built with ``device_bytes``, ``host_bytes``, ``policy`` and
        ``block_bytes``.
      device_bytes: L1 budget of the new cache (only without ``cache``). Default: half of the
        device memory JAX reports free, or 1 GiB where it reports nothing (the CPU); see
        `default_budgets`.
      host_bytes: L2 budget of the new cache (only without ``cache``). Default: a quarter of
        the host's RAM.
      policy: the new cache's policy, a name or a `Policy` (only without ``cache``).
      step: the step of a ``CheckpointManager`` root to open (default: the latest).
      target: an abstract tree to restore into, as orbax's ``StandardRestore(target)`` takes:
        its leaves (``jax.ShapeDtypeStruct``, arrays, or an ``nnx.State`` of them) are matched to
        the checkpoint's arrays by key path (a trailing ``value`` of an NNX variable is optional)
        and must have their shapes and dtypes; the result has the target's structure. A leaf's
        ``sharding`` (a ``jax.ShapeDtypeStruct(..., sharding=NamedSharding(mesh, spec))``) is
        kept: `materialize` returns a global array with it, and in a ``jax.distributed`` job
        each process reads only the blocks of its addressable shards (docs/scale.md).
      block_bytes: the block size (see `TieredCache`); default: the store's own blocks, at
        most 4 MiB for an orbax checkpoint whatever the budget (a key names the same data at
        every budget); a smaller value serves smaller sub-blocks, and keys follow it.
      runtime: where runtime blocks (``put``) go; the checkpoint is never written (see
        `cacheflow_jax.open_store`).
      prefetcher: a `predictor.Predictor` for the new cache to prefetch with, and ``prefetch``
        its `PrefetchSettings` (only without ``cache``; see `TieredCache`).
      prefetch: see ``prefetcher``.

    Returns:
      The restored pytree: the structure and keys of ``ocp.StandardCheckpointer().restore(path)``
      (orbax restores list items of an NNX pure dict as string keys ``'0'``, ``'1'``), or of
      ``target``; array leaves are `LazyArray` over the cache (reach it as ``leaf.cache``),
      ``scalar`` leaves are Python scalars, ``None`` and empty containers are kept.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      cacheflow_jax.StoreError: ``path`` is not a checkpoint, holds several items, has no
        ``step``, or holds no arrays at all.
      ValueError: ``cache`` is over another store, or budgets are given with a cache; ``target``
        does not match the checkpoint.
      cacheflow_jax.BudgetError: a budget is too small for the checkpoint's largest block.
      TypeError: the cache's store is not a `cacheflow_jax.TensorStoreStore`.

    >>> tree = restore_lazy("ckpt/")  # doctest: +SKIP
    >>> params = materialize(tree["layers"]["0"])  # doctest: +SKIP
    """
    given = cache is not None
    cache = _cache_for(path, cache, device_bytes=device_bytes, host_bytes=host_bytes,
                       policy=policy, step=step, block_bytes=block_bytes, runtime=runtime,
                       prefetcher=prefetcher, prefetch=prefetch)  # fmt: skip
    store = cache.store
    if not isinstance(store, TensorStoreStore):
        raise TypeError(
            f"the cache's store {store.spec} is a {type(store).__name__}, which cannot list a "
            "checkpoint's pytree; build the cache over cacheflow_jax.open_store(path)"
        )
    if given:
        if step is not None and store.step != step:
            raise ValueError(
                f"restore_lazy({label(path)!r}, step={step}, cache=...): the cache reads step "
                f"{store.step} ({store.spec}); build the cache over "
                f"open_store({label(path)!r}, step={step})"
            )
        check_same_checkpoint(path, store)
    arrays = store.arrays()
    if not arrays:
        raise StoreError(
            f"{store.spec} holds no arrays, so there is nothing to restore"
            + (f" (steps found: {list(store.steps)})" if store.steps else "")
            + "; check the path: pass a CheckpointManager root, a step directory or an item "
            "directory (`cacheflow inspect PATH` lists what a location holds)"
        )
    value_types = store.value_types()

    def leaf(array_path: str, want: Any = None) -> Any:
        info = arrays[array_path]
        if value_types.get(array_path) == "scalar":
            return store.read(block_key(array_path, (0,) * len(info.shape))).result().item()
        sharding = getattr(want, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            sharding = None
        return LazyArray(cache, info, sharding=sharding)

    if target is not None:
        return restore_into(target, store, leaf)
    return map_skeleton(store.tree(), leaf)


def materialize(
    tree: Any, *, batch_bytes: int | None = None, sharding: Any = None
) -> Any:
    """Reads every `LazyArray` leaf of ``tree`` through its cache into a device array.

    Each leaf's blocks are fetched with a single ``get_many`` (several small leaves share one,
    up to ``batch_bytes``), so all of a leaf's L3 reads are issued at once; the leaf is then
    assembled on the device (see the module note). Other leaves are returned as they are.

    A leaf with a sharding (``sharding=``, or the target's it was restored with) becomes a
    global ``jax.Array`` with that sharding, as orbax restores it: this process reads only the
    blocks of its addressable shards (`cacheflow_jax.orbax.sharded`), so each process of a
    ``jax.distributed`` job reads its share of the checkpoint, not all of it.

    Args:
      tree: a pytree, typically from `restore_lazy`; may also be a single `LazyArray`.
      batch_bytes: the most bytes one ``get_many`` asks for (a larger leaf gets its own call).
        Default: the cache's device budget, so a batch does not evict itself from L1.
      sharding: where to put the leaves: a ``jax.sharding.Sharding`` for every leaf, or a
        pytree of shardings (or None) with ``tree``'s structure, such as
        ``jax.tree.map(lambda x: x.sharding, target)``. Default: each leaf's own
        (`LazyArray.target_sharding`), else the cache's L1 device.

    Returns:
      The same pytree with every `LazyArray` replaced by a ``jax.Array`` bitwise equal to what
      orbax restores (with JAX's default 32-bit mode, 64-bit leaves are canonicalized to 32 bits,
      as ``jax.device_put`` does).

    Raises:
      TypeError: ``sharding`` is neither a sharding nor a tree of them.
      ValueError: ``sharding`` does not have ``tree``'s structure, or cannot hold a leaf.
    """
    leaves, treedef = jax.tree.flatten(tree)
    shardings = _shardings(tree, leaves, treedef, sharding)
    out = list(leaves)
    by_cache: dict[int, list[tuple[int, LazyArray]]] = {}
    sharded: dict[int, list[tuple[int, LazyArray, jax.sharding.Sharding]]] = {}
    for i, x in enumerate(leaves):
        if not isinstance(x, LazyArray):
            continue
        target = shardings[i] if shardings[i] is not None else x.target_sharding
        if target is None:
            by_cache.setdefault(id(x.cache), []).append((i, x))
        else:
            target = check_sharding(target, x.shape, x.path)
            sharded.setdefault(id(x.cache), []).append((i, x, target))
    for group in by_cache.values():
        cache = group[0][1].cache
        limit = _batch_limit(cache, batch_bytes)
        for batch in _batches(group, limit):
            keys = [k for _, x in batch for k in x.keys]
            blocks = iter(cache.get_many(keys))
            for i, x in batch:
                out[i] = _assemble(x, [next(blocks) for _ in x.keys])
    for items in sharded.values():
        cache = items[0][1].cache
        for i, value in materialize_sharded(items, cache, _batch_limit(cache, batch_bytes)).items():
            out[i] = value
    return jax.tree.unflatten(treedef, out)


# --------------------------------------------------------------------------------------------
# Internals


def _batch_limit(cache: TieredCache, batch_bytes: int | None) -> int:
    """``batch_bytes``, by default the cache's device budget."""
    if batch_bytes is not None:
        return batch_bytes
    return int(cache.stats()["tiers"].get("device", {}).get("budget", 0))


def _shardings(tree: Any, leaves: list[Any], treedef: Any, sharding: Any) -> list[Any]:
    """`materialize`'s ``sharding`` argument as one sharding (or None) per leaf of ``tree``."""
    if sharding is None:
        return [None] * len(leaves)
    if isinstance(sharding, jax.sharding.Sharding):
        return [sharding] * len(leaves)

    def is_leaf(x: Any) -> bool:
        return x is None or isinstance(x, jax.sharding.Sharding)

    flat, shape = jax.tree.flatten(sharding, is_leaf=is_leaf)
    if shape.num_leaves != treedef.num_leaves:
        try:  # the same structure, with None where a leaf needs no sharding
            flat = treedef.flatten_up_to(sharding)
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"sharding= must be a jax.sharding.Sharding or a tree with the structure of "
                f"the tree to materialize ({treedef}); got {shape}: {err}"
            ) from None
    for s in flat:
        if not is_leaf(s):
            raise TypeError(
                f"sharding= holds a {type(s).__name__}; its leaves must be "
                "jax.sharding.Sharding objects (or None)"
            )
    return list(flat)


def _batches(
    group: Sequence[tuple[int, LazyArray]], limit: int
) -> Iterable[list[tuple[int, LazyArray]]]:
    """Splits leaves into consecutive batches of at most ``limit`` bytes (at least one leaf)."""
    batch: list[tuple[int, LazyArray]] = []
    size = 0
    for item in group:
        nbytes = item[1].nbytes
        if batch and size + nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes
    if batch:
        yield batch


def _assemble(leaf: LazyArray, blocks: Sequence[jax.Array]) -> jax.Array:
    """Joins all of a leaf's blocks (C order of its grid) into the whole array on the device."""
    grid = leaf.grid_shape
    if len(blocks) == 1:
        return blocks[0]
    return join_blocks(dict(zip(np.ndindex(*grid), blocks)), grid)
