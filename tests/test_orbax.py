"""Tests for cacheflow_jax.orbax: lazy restore of real orbax checkpoints of a Flax NNX model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import cacheflow_jax as cfj
from cacheflow_jax.cache.tiered import TieredCache
from cacheflow_jax.core.blocks import block_key
from cacheflow_jax.orbax import LazyArray, materialize, restore_lazy
from cacheflow_jax.store.open import open_store
from cacheflow_jax.store.write import write_store

MiB = 2**20
BIG_CHUNK_BYTES = 1024  # orbax splits the "big" leaf into chunks of at most this many bytes


class Block(nnx.Module):
    """A layer with bfloat16, int8 and 0-d leaves."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(jax.random.normal(rngs.params(), (64, 48), jnp.bfloat16))
        self.q = nnx.Param(jax.random.randint(rngs.params(), (16, 8), -128, 127, jnp.int8))
        self.scale = nnx.Param(jnp.float32(1.5))


class Model(nnx.Module):
    """A list of layers (keys '0', '1' after orbax), a Linear, a big multi-chunk leaf, a counter."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([Block(rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(48, 8, rngs=rngs)
        self.big = nnx.Param(jax.random.normal(rngs.params(), (32, 64), jnp.float32))
        self.count = nnx.Variable(jnp.int32(7))


def _bits(x: Any) -> np.ndarray:
    """The bytes of an array (0-d included), for bitwise comparison."""
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CheckpointManager checkpoint of `Model` at step 3; the "big" leaf has many chunks."""
    root = tmp_path_factory.mktemp("ckpt")
    state = nnx.to_pure_dict(nnx.state(Model(rngs=nnx.Rngs(0))))
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(), state)
    save_args["big"] = ocp.SaveArgs(chunk_byte_size=BIG_CHUNK_BYTES)
    with ocp.CheckpointManager(root) as manager:
        manager.save(3, args=ocp.args.StandardSave(state, save_args=save_args))
        manager.wait_until_finished()
    return {"step": root / "3", "item": root / "3" / "default"}


@pytest.fixture(scope="module")
def reference(checkpoint: dict[str, Path]) -> Any:
    """What orbax itself restores."""
    return ocp.StandardCheckpointer().restore(checkpoint["item"])


def _lazy(path: Path) -> Any:
    return restore_lazy(path, device_bytes=MiB, host_bytes=MiB)


@pytest.mark.parametrize("which", ["step", "item"])
def test_tree_is_shaped_like_orbax_restore(
    checkpoint: dict[str, Path], reference: Any, which: str
) -> None:
    tree = _lazy(checkpoint[which])
    assert jax.tree.structure(tree) == jax.tree.structure(reference)
    assert set(tree["layers"]) == {"0", "1"}
    for leaf, ref in zip(jax.tree.leaves(tree), jax.tree.leaves(reference), strict=True):
        assert isinstance(leaf, LazyArray)
        assert (leaf.shape, leaf.dtype, leaf.ndim, leaf.size, leaf.nbytes) == (
            ref.shape,
            ref.dtype,
            ref.ndim,
            ref.size,
            ref.nbytes,
        )
    w = tree["layers"]["0"]["w"]
    assert w.dtype == jnp.bfloat16 and tree["layers"]["1"]["q"].dtype == np.int8
    assert tree["count"].shape == ()
    assert w.keys == (block_key("layers/0/w", (0, 0)),)
    assert len(tree["big"].keys) == math.prod(tree["big"].grid_shape) > 1


@pytest.mark.parametrize("which", ["step", "item"])
def test_materialize_is_bitwise_equal_to_orbax_restore(
    checkpoint: dict[str, Path], reference: Any, which: str
) -> None:
    out = materialize(_lazy(checkpoint[which]))
    assert jax.tree.structure(out) == jax.tree.structure(reference)
    for got, ref in zip(jax.tree.leaves(out), jax.tree.leaves(reference), strict=True):
        assert isinstance(got, jax.Array)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        np.testing.assert_array_equal(_bits(got), _bits(ref))


def test_materialize_in_small_batches_and_a_single_leaf(
    checkpoint: dict[str, Path], reference: Any
) -> None:
    tree = _lazy(checkpoint["step"])
    out = materialize(tree, batch_bytes=1)  # one get_many per leaf
    for got, ref in zip(jax.tree.leaves(out), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(ref))
    np.testing.assert_array_equal(_bits(materialize(tree["big"])), _bits(reference["big"]))


def test_np_and_jnp_asarray_of_one_leaf(checkpoint: dict[str, Path], reference: Any) -> None:
    tree = _lazy(checkpoint["item"])
    w = np.asarray(tree["layers"]["1"]["w"])
    assert isinstance(w, np.ndarray) and w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(w), _bits(reference["layers"]["1"]["w"]))
    assert np.asarray(tree["count"]).item() == 7
    assert np.asarray(tree["big"], dtype=np.float64).dtype == np.float64
    big = jnp.asarray(tree["big"])  # through __jax_array__
    np.testing.assert_array_equal(_bits(big), _bits(reference["big"]))
    with pytest.raises(ValueError, match="copy=False"):
        np.asarray(tree["big"], copy=False)


class _ReadSpy:
    """Records every block key the store is asked to read."""

    def __init__(self, store: Any) -> None:
        self.keys: list[str] = []
        self._read = store.read

    def __call__(self, key: str) -> Any:
        self.keys.append(key)
        return self._read(key)


def _expected_chunks(index: tuple, shape: tuple[int, ...], chunk: tuple[int, ...]) -> set:
    """The chunk grid indices holding the elements that ``np.ones(shape)[index]`` selects."""
    positions = np.indices(shape).reshape(len(shape), -1).T
    picked = np.zeros(shape, bool)
    picked[index] = True
    return {tuple(int(p) // c for p, c in zip(pos, chunk)) for pos in positions[picked.ravel()]}


@pytest.mark.parametrize(
    "index",
    [
        (slice(3, 5), slice(10, 20)),
        (7,),
        (slice(None), 63),
        (..., slice(0, 1)),
        (slice(30, 12, -9), slice(None, None, 40)),
        (-1, -1),
    ],
)
def test_slice_reads_only_the_chunks_it_touches(
    checkpoint: dict[str, Path], reference: Any, monkeypatch: pytest.MonkeyPatch, index: tuple
) -> None:
    store = open_store(checkpoint["step"])
    spy = _ReadSpy(store)
    monkeypatch.setattr(store, "read", spy)  # read_many goes through read too
    cache = TieredCache(store, device_bytes=MiB, host_bytes=MiB)
    big = restore_lazy(checkpoint["step"], cache=cache)["big"]
    assert big.grid_shape != (1, 1)
    got = big[index]
    ref = np.asarray(reference["big"])[index]
    assert got.shape == ref.shape
    np.testing.assert_array_equal(_bits(got), _bits(ref))
    want = {block_key("big", idx) for idx in _expected_chunks(index, big.shape, big.chunk_shape)}
    assert set(spy.keys) == want and len(spy.keys) == len(want)
    assert cache.stats()["requests"] == len(want) < len(big.keys)


def test_empty_slice_reads_nothing(checkpoint: dict[str, Path]) -> None:
    big = _lazy(checkpoint["item"])["big"]
    out = big[4:4, 1:3]
    assert out.shape == (0, 2) and out.dtype == big.dtype
    assert big.cache.stats()["requests"] == 0


def test_block_is_the_stored_chunk(checkpoint: dict[str, Path], reference: Any) -> None:
    big = _lazy(checkpoint["item"])["big"]
    idx = tuple(g - 1 for g in big.grid_shape)
    origin = [i * c for i, c in zip(idx, big.chunk_shape)]
    sl = tuple(slice(o, o + c) for o, c in zip(origin, big.chunk_shape))
    np.testing.assert_array_equal(np.asarray(big.block(idx)), np.asarray(reference["big"])[sl])
    with pytest.raises(IndexError, match="block grid"):
        big.block(big.grid_shape)


def test_bad_indices_are_clear_errors(checkpoint: dict[str, Path]) -> None:
    big = _lazy(checkpoint["item"])["big"]
    with pytest.raises(IndexError, match="out of bounds for axis 0 with size 32"):
        big[32]
    with pytest.raises(IndexError, match="too many indices"):
        big[0, 0, 0]
    with pytest.raises(TypeError, match="basic indexing only"):
        big[np.array([0, 1])]
    with pytest.raises(TypeError, match="basic indexing only"):
        big[None]


def test_missing_path_is_a_clear_error(tmp_path: Path, checkpoint: dict[str, Path]) -> None:
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        restore_lazy(missing, device_bytes=MiB, host_bytes=MiB)
    cache = TieredCache(open_store(checkpoint["item"]), device_bytes=MiB, host_bytes=MiB)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        restore_lazy(missing, cache=cache)


def test_a_missing_budget_takes_its_default(checkpoint: dict[str, Path]) -> None:
    tree = restore_lazy(checkpoint["item"], device_bytes=MiB)
    tiers = tree["head"]["kernel"].cache.stats()["tiers"]
    assert tiers["device"]["budget"] == MiB
    assert tiers["host"]["budget"] == cfj.orbax.default_budgets()[1]
    cache = TieredCache(open_store(checkpoint["item"]), device_bytes=MiB, host_bytes=MiB)
    with pytest.raises(ValueError, match="not both"):
        restore_lazy(checkpoint["item"], cache=cache, device_bytes=MiB)


def test_a_cache_over_the_manager_root_serves_its_step(checkpoint: dict[str, Path]) -> None:
    root = checkpoint["step"].parent
    cache = TieredCache(open_store(root), device_bytes=MiB, host_bytes=MiB)
    assert cache.store.step == 3
    for path in (root, checkpoint["step"], checkpoint["item"]):
        assert restore_lazy(path, cache=cache)["head"]["kernel"].cache is cache
    assert restore_lazy(root, cache=cache, step=3)["head"]["kernel"].cache is cache
    with pytest.raises(ValueError, match="step 3"):
        restore_lazy(root, cache=cache, step=4)


def test_a_cache_over_the_step_dir_serves_the_item_dir(checkpoint: dict[str, Path]) -> None:
    cache = TieredCache(open_store(checkpoint["step"]), device_bytes=MiB, host_bytes=MiB)
    tree = restore_lazy(checkpoint["item"], cache=cache)
    assert tree["head"]["kernel"].cache is cache


def test_a_cache_over_another_store_is_refused(tmp_path: Path, checkpoint: dict[str, Path]) -> None:
    other = write_store({"w": np.ones((4, 4), np.float32)}, tmp_path / "other")
    cache = TieredCache(other, device_bytes=MiB, host_bytes=MiB)
    with pytest.raises(ValueError, match="not this checkpoint"):
        restore_lazy(checkpoint["step"], cache=cache)


def test_scalars_none_and_empty_nodes_come_back_like_orbax(tmp_path: Path) -> None:
    tree = {
        "f": 1.5,
        "i": 3,
        "np": np.arange(6, dtype=np.int32).reshape(2, 3),
        "none": None,
        "empty": {},
        "pair": (jnp.zeros(2), jnp.ones(3, jnp.bfloat16)),
    }
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "item", tree)
        checkpointer.wait_until_finished()
    ref = ocp.StandardCheckpointer().restore(tmp_path / "item")
    lazy = restore_lazy(tmp_path / "item", device_bytes=MiB, host_bytes=MiB)
    assert jax.tree.structure(lazy) == jax.tree.structure(ref)
    assert lazy["f"] == ref["f"] == 1.5 and isinstance(lazy["f"], float)
    assert lazy["i"] == ref["i"] == 3 and isinstance(lazy["i"], int)
    assert lazy["none"] is None and lazy["empty"] == {}
    assert isinstance(lazy["pair"], list)
    out = materialize(lazy)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_restore_lazy_of_a_cacheflow_store_gives_the_written_tree(tmp_path: Path) -> None:
    tree = {"layers": [{"w": np.arange(12.0, dtype=np.float32).reshape(3, 4)}]}
    write_store(tree, tmp_path / "store", chunk_bytes=16)
    lazy = restore_lazy(tmp_path / "store", device_bytes=MiB, host_bytes=MiB)
    leaf = lazy["layers"][0]["w"]
    assert leaf.grid_shape == (3, 1)
    np.testing.assert_array_equal(np.asarray(leaf[1:, 2]), tree["layers"][0]["w"][1:, 2])
    np.testing.assert_array_equal(
        np.asarray(materialize(lazy)["layers"][0]["w"]), tree["layers"][0]["w"]
    )


def test_a_cache_over_a_url_store_matches_its_url_and_spec() -> None:
    url = "memory://test-orbax-url/store/"
    write_store({"w": np.arange(4.0, dtype=np.float32)}, url, overwrite=True)
    cache = TieredCache(open_store(url), device_bytes=MiB, host_bytes=MiB)
    for same in (url, url.rstrip("/"), {"driver": "memory", "path": "test-orbax-url/store"}):
        assert restore_lazy(same, cache=cache)["w"].cache is cache
    for other in ("memory://test-orbax-url/other/", {"driver": "memory", "path": "elsewhere"}):
        with pytest.raises(ValueError, match="not this checkpoint"):
            restore_lazy(other, cache=cache)
