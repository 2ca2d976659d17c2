"""How `bench.embedding_model` and `bench.multimodal` serve stored arrays: rows and weights.

Each way serves the text encoder's token rows (``text``: the batch's pooled vectors) and the
vision encoder's weights (``vision``: an image's vector and tokens) from one store written by
`write_store` (zarr3 on local disk):

| way | rows and weights | bytes held |
|---|---|---|
| `tensorstore` | read from the store on demand: TensorStore, ``cache_pool`` 0 (the baseline) | none |
| `tensorstore-pool` | the same reads through TensorStore's own ``cache_pool`` (an LRU of decoded chunks) | ``pool_bytes`` of host memory |
| `host-offload` | JAX's own host offloading: the arrays in ``pinned_host`` memory; inside the jitted step the weights move to the device and the rows are gathered on the host (``compute_on("device_host")``) and moved | every array, in host memory |
| `cacheflow` | a `TieredCache` over the store: weights as blocks, rows by ``session.lookup`` (the rows' device room reserved out of L1) | L1 + L2 |
| `all-resident` | every array on the device (the limit) | every array, on the device |

Every way calls the same jitted encoder on the same inputs (`bench._encoders`), so outputs are
bitwise equal; the benchmarks check it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench._encoders import TextModel, VisionModel

TEXT_TABLE = "text/embed"


def _sharding(kind: str) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def _take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]`` as one gather whose only constants are static (runs on host memory)."""
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                          start_index_map=(0,))  # fmt: skip
    flat = jax.lax.gather(table, ids.reshape(-1, 1), dims, (1, table.shape[1]),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)  # fmt: skip
    return flat.reshape((*ids.shape, table.shape[1]))


_take_resident = jax.jit(_take_rows)


def _on_host(f):
    """``f`` computed on the host (``"device_host"``), its result in host memory. jax 0.10 spells
    it ``compute_on("device_host")(f)``; jax 0.11 made ``compute_on`` a transform that names
    the result's memory (``out_memory_spaces``), as 0.10's ``compute_on2`` does."""
    import inspect

    from jax.experimental import compute_on as co

    if "out_memory_spaces" in inspect.signature(co.compute_on).parameters:
        return co.compute_on(f, compute_type="device_host",
                             out_memory_spaces=jax.memory.Space.Host)  # fmt: skip
    return co.compute_on("device_host")(f)


class TableWay:
    """The interface: ``text`` and ``vision``; ``close`` and ``stats`` for the report."""

    name = "?"

    def text(self, model: TextModel, ids: np.ndarray) -> jax.Array:
        raise NotImplementedError

    def vision(self, model: VisionModel, patches: np.ndarray) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class TensorStoreReads(TableWay):
    """Rows and weights read from the store on each request (with a ``cache_pool`` if given).

    Args:
      root: the store's directory.
      pool_bytes: TensorStore's ``cache_pool`` ``total_bytes_limit`` (0: no cache).
      vision: the vision weights' paths to open (none: a text-only benchmark).
    """

    def __init__(self, root: Path, *, pool_bytes: int = 0, vision: list[str] = ()) -> None:
        import tensorstore as ts

        self.name = "tensorstore-pool" if pool_bytes else "tensorstore"
        context = ts.Context({"cache_pool": {"total_bytes_limit": int(pool_bytes)}})

        def handle(path: str) -> Any:
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / path)}}
            return ts.open(spec, context=context, read=True).result()

        self.table = handle(TEXT_TABLE)
        self.weights = [handle(p) for p in vision]
        self.device = jax.devices()[0]

    def text(self, model: TextModel, ids: np.ndarray) -> jax.Array:
        rows, inverse = np.unique(ids, return_inverse=True)
        got = self.table[rows].read().result()
        return model(jax.device_put(got[inverse.reshape(ids.shape)], self.device))

    def vision(self, model: VisionModel, patches: np.ndarray) -> tuple[jax.Array, jax.Array]:
        futures = [h.read() for h in self.weights]  # all issued, then awaited
        leaves = jax.device_put([f.result() for f in futures], self.device)
        return model.apply(leaves, patches)


class HostOffload(TableWay):
    """The arrays in ``pinned_host`` memory, moved (weights) or gathered on the host (rows)
    inside the jitted step."""

    name = "host-offload"

    def __init__(self, table: np.ndarray, text: TextModel, vision: VisionModel | None) -> None:
        host, device = _sharding("pinned_host"), _sharding("device")
        self.table = jax.device_put(table, host)
        gather = _on_host(jax.jit(_take_rows))

        def step_text(leaves: list, table: jax.Array, ids: jax.Array) -> jax.Array:
            rows = gather(table, jax.device_put(ids, host))
            return text.encode(leaves, jax.device_put(rows, device))

        self._text = jax.jit(step_text)
        self.weights: list[jax.Array] = []
        if vision is not None:
            self.weights = jax.device_put(vision.values, host)

            def step_vision(leaves: list, patches: jax.Array) -> tuple[jax.Array, jax.Array]:
                return vision.apply(jax.device_put(leaves, device), patches)

            self._vision = jax.jit(step_vision)

    def text(self, model: TextModel, ids: np.ndarray) -> jax.Array:
        return self._text(model.leaves, self.table, ids)

    def vision(self, model: VisionModel, patches: np.ndarray) -> tuple[jax.Array, jax.Array]:
        return self._vision(self.weights, patches)


class Resident(TableWay):
    """Every array on the device: the limit."""

    name = "all-resident"

    def __init__(self, table: np.ndarray, vision: VisionModel | None) -> None:
        device = jax.devices()[0]
        self.table = jax.device_put(table, device)
        self.weights = jax.device_put(vision.values, device) if vision is not None else []

    def text(self, model: TextModel, ids: np.ndarray) -> jax.Array:
        # The gather is its own jitted call: fused into the encoder's first layer, XLA may
        # round differently (seen at width 32), and the vectors must equal the other ways'.
        return model(_take_resident(self.table, ids))

    def vision(self, model: VisionModel, patches: np.ndarray) -> tuple[jax.Array, jax.Array]:
        return model.apply(self.weights, patches)


@functools.partial(jax.jit, static_argnames=("grids",))
def _assemble(blocks: list, *, grids: tuple) -> list:
    """Whole arrays from their blocks (row-major over each array's block grid); run jitted
    (`_assemble_jit`): one dispatch per image, not one per concatenation (about 14 ms an image
    eagerly on 2 cores). Concatenation is exact: the arrays are bitwise the stored ones."""
    out, i = [], 0
    for grid in grids:
        n = int(np.prod(grid)) if grid else 1
        parts = blocks[i : i + n]
        i += n
        for axis in reversed(range(len(grid))):  # join the last axis first
            step = grid[axis]
            parts = [jnp.concatenate(parts[j : j + step], axis=axis)
                     for j in range(0, len(parts), step)]  # fmt: skip
        out.append(parts[0])
    return out


_assemble_jit = jax.jit(_assemble, static_argnames="grids")


def assemble(blocks: list, *, grids: tuple) -> list:
    """`_assemble_jit`, except that arrays stored as one block each are the blocks themselves
    (a jitted call would copy them)."""
    if all(int(np.prod(grid)) == 1 for grid in grids):
        return list(blocks)
    return _assemble_jit(blocks, grids=grids)


class CacheflowTable(TableWay):
    """Weights as blocks of a `TieredCache` and rows by ``session.lookup`` on the same cache.

    Args:
      cache: the cache (its store holds ``text/embed`` and the vision weights).
      embedding_bytes: L1 bytes reserved for the table's hot rows.
      vision: the vision weights' paths (as stored).
      promote_every: lookups between two promotions of hot rows (`cacheflow_jax.serving`).
      weights_cache: another cache for the weights (a budget split per kind); default ``cache``.
    """

    name = "cacheflow"

    def __init__(self, cache: Any, *, embedding_bytes: int, vision: list[str] = (),
                 promote_every: int = 16, weights_cache: Any = None) -> None:  # fmt: skip
        import cacheflow_jax as cfj

        self.cache = cache
        self.weights_cache = cache if weights_cache is None else weights_cache
        self.session = cfj.ServingSession(cache, None, embedding_bytes=embedding_bytes,
                                          promote_every=promote_every)  # fmt: skip
        arrays = self.weights_cache.store.arrays()
        self.keys: list[str] = []
        grids = []
        for path in vision:
            grid = tuple(arrays[path].grid_shape)
            grids.append(grid)
            self.keys += [cfj.block_key(path, idx) for idx in np.ndindex(*grid)]
        self.grids = tuple(grids)

    def text(self, model: TextModel, ids: np.ndarray) -> jax.Array:
        return model(self.session.lookup(TEXT_TABLE, ids))

    def vision(self, model: VisionModel, patches: np.ndarray) -> tuple[jax.Array, jax.Array]:
        blocks = self.weights_cache.get_many(self.keys)
        return model.apply(assemble(blocks, grids=self.grids), patches)

    def stats(self) -> dict[str, Any]:
        s = self.session.stats()
        rows = s.get("embedding", {}).get(TEXT_TABLE, {})
        w = self.weights_cache.stats()
        return {"rows_from_device": rows.get("device_hit_ratio", 0.0),
                "l1_hits": s["hits"]["device"], "l2_hits": s["hits"]["host"],
                "l3_reads": s["misses"], "weight_cache_hits": dict(w["hits"]),
                "weight_cache_misses": w["misses"]}  # fmt: skip

    def close(self) -> None:
        self.session.close()
