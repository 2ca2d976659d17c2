"""Tests for the L3 store (cacheflow_jax.store.tensorstore_store): real TensorStore drivers, a real S3 server."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cacheflow_jax.core.blocks import CorruptBlockError, Store, StoreError, block_key
from cacheflow_jax.store.open import open_store
from cacheflow_jax.store.tensorstore_store import TensorStoreStore
from cacheflow_jax.store.write import chunk_shape_for, write_store

DTYPES = [
    np.dtype(np.bool_),
    np.dtype(np.int8),
    np.dtype(np.uint8),
    np.dtype(np.int32),
    np.dtype(np.int64),
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.complex64),
]
_names = itertools.count()


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Random bits of ``dtype`` (NaN payloads and -0.0 included), valid bools for bool."""
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    n = int(np.prod(shape, dtype=np.int64))
    return rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Shape, dtype and every byte equal."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def assert_store_matches(store: TensorStoreStore, arrays: dict[str, np.ndarray]) -> None:
    """Every block of every array reads back bitwise equal to its slice of the source."""
    assert set(store.arrays()) == set(arrays)
    for path, src in arrays.items():
        info = store.arrays()[path]
        assert info.shape == src.shape and info.dtype == src.dtype
        keys = [block_key(path, idx) for idx in np.ndindex(*info.grid_shape)]
        futures = store.read_many(keys)
        covered = np.zeros(src.shape, dtype=np.int32)
        for key, fut in zip(keys, futures, strict=True):
            b = store.info(key)
            sl = tuple(slice(o, o + s) for o, s in zip(b.origin, b.shape, strict=True))
            value = fut.result()
            assert same_bits(value, src[sl]), key
            assert b.nbytes == value.nbytes and b.array == path and not b.runtime
            covered[sl] += 1
        assert (covered == 1).all(), f"blocks of {path} do not tile the array exactly once"


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (5, 3), (4, 0), (3, 5, 7)], ids=str)
def test_round_trip_bitwise(tmp_path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    arrays = {"params/w": random_array(rng, shape, dtype), "b": random_array(rng, (3,), dtype)}
    tree = {"params": {"w": arrays["params/w"]}, "b": arrays["b"]}
    store = write_store(tree, tmp_path / "s", chunk_bytes=3 * dtype.itemsize + 1)
    assert isinstance(store, Store)
    assert_store_matches(store, arrays)
    assert_store_matches(open_store(tmp_path / "s"), arrays)


@settings(max_examples=25, deadline=None)
@given(
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9),
    dtype=st.sampled_from(DTYPES),
    chunk_bytes=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_property(
    shape: tuple[int, ...], dtype: np.dtype, chunk_bytes: int, seed: int
) -> None:
    src = random_array(np.random.default_rng(seed), shape, dtype)
    url = f"memory://prop{next(_names)}/"
    write_store({"x": [src]}, url, chunk_bytes=chunk_bytes)
    store = open_store(url)
    assert_store_matches(store, {"x/0": src})
    keys = store.keys()
    for key in keys:
        assert store.info(key).nbytes <= max(chunk_bytes, dtype.itemsize)


def test_chunk_shape_for() -> None:
    assert chunk_shape_for((10, 4, 8), 4, 256) == (2, 4, 8)
    assert chunk_shape_for((10, 4, 8), 4, 4 * 320) == (10, 4, 8)
    assert chunk_shape_for((10, 4, 8), 4, 4 * 20) == (1, 2, 8)
    assert chunk_shape_for((3, 100), 1, 10) == (1, 10)
    assert chunk_shape_for((), 8, 1) == ()
    assert chunk_shape_for((0, 5), 4, 8) == (1, 2)
    assert chunk_shape_for((7,), 8, 1) == (1,)


def test_jax_arrays_lists_and_tree(tmp_path: Path) -> None:
    tree = {
        "params": {"w": jax.numpy.arange(6, dtype=jax.numpy.bfloat16).reshape(2, 3)},
        "layers": [np.ones(2, np.int8), {"k": np.zeros((2, 2), np.float32)}],
        "nnx": {0: np.float32(3.0)},
    }
    store = write_store(tree, tmp_path / "s")
    assert sorted(store.arrays()) == ["layers/0", "layers/1/k", "nnx/0", "params/w"]
    skeleton = store.tree()
    assert skeleton == {
        "params": {"w": "params/w"},
        "layers": ["layers/0", {"k": "layers/1/k"}],
        "nnx": {0: "nnx/0"},
    }
    assert jax.tree.structure(skeleton) == jax.tree.structure(tree)
    assert store.tree_paths()["layers/1/k"] == (
        jax.tree_util.DictKey("layers"),
        jax.tree_util.SequenceKey(1),
        jax.tree_util.DictKey("k"),
    )
    rebuilt = jax.tree.map(lambda p: store.handle(p).read().result(), open_store(store.spec).tree())
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), tree, rebuilt)


# --------------------------------------------------------------------------------------------
# Locations


def test_memory_url_shared_between_write_and_open() -> None:
    src = np.arange(10, dtype=np.int32)
    write_store({"a": src}, "memory://shared-test/", chunk_bytes=16)
    store = open_store("memory://shared-test/")
    assert store.spec == "memory://shared-test/"
    assert_store_matches(store, {"a": src})


def test_file_url_and_spec_dict(tmp_path: Path) -> None:
    src = np.arange(24, dtype=np.float32).reshape(4, 6)
    write_store({"a": src}, f"file://{tmp_path}/s", chunk_bytes=40)
    assert_store_matches(open_store(f"file://{tmp_path}/s"), {"a": src})
    assert_store_matches(open_store({"driver": "file", "path": str(tmp_path / "s")}), {"a": src})
    assert_store_matches(open_store(str(tmp_path / "s")), {"a": src})


def test_write_refuses_to_overwrite(tmp_path: Path) -> None:
    write_store({"a": np.ones(3)}, tmp_path / "s")
    with pytest.raises(FileExistsError, match="overwrite=True") as exc:
        write_store({"a": np.zeros(3)}, tmp_path / "s")
    assert str(tmp_path / "s") in str(exc.value)
    store = write_store({"b": np.zeros(3)}, tmp_path / "s", overwrite=True)
    assert list(store.arrays()) == ["b"]


@pytest.mark.parametrize("chunk_bytes", [0, -4])
def test_chunk_bytes_must_be_positive(tmp_path: Path, chunk_bytes: int) -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        write_store({"a": np.ones(3)}, tmp_path / "s", chunk_bytes=chunk_bytes)
    assert not (tmp_path / "s").exists()


def test_chunk_bytes_for_sizes_chunks_per_array_and_folder(tmp_path: Path) -> None:
    table = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    tree = {"text": {"embed": table},
            "vision": {"w": np.ones((32, 32), np.float32), "b": {"c": np.ones(100, np.int32)}}}
    store = write_store(tree, tmp_path / "s", chunk_bytes=256,
                        chunk_bytes_for={"vision/": 1 << 20, "vision/b/c": 128})  # fmt: skip
    arrays = store.arrays()
    assert arrays["text/embed"].grid_shape == (16, 1)  # the default: 256-byte chunks of rows
    assert arrays["vision/w"].grid_shape == (1, 1)  # the folder's 1 MiB: one block
    assert arrays["vision/b/c"].grid_shape == (4,)  # the longest entry wins
    assert np.array_equal(store.read(block_key("text/embed", (1, 0))).result(), table[4:8])
    assert store.read(block_key("vision/w", (0, 0))).result().shape == (32, 32)


@pytest.mark.parametrize("entry, why", [
    ({"visio/": 4096}, "no array path or folder"),
    ({"vision": 4096}, "no array path or folder"),  # a folder needs its '/'
    ({"text/embed": 0}, "positive number of bytes"),
])  # fmt: skip
def test_chunk_bytes_for_errors_name_the_entry(tmp_path: Path, entry: dict, why: str) -> None:
    tree = {"text": {"embed": np.ones((4, 4), np.float32)}, "vision": {"w": np.ones(4, np.float32)}}
    with pytest.raises(ValueError, match=why) as err:
        write_store(tree, tmp_path / "s", chunk_bytes_for=entry)
    assert repr(next(iter(entry))) in str(err.value)
    assert not (tmp_path / "s").exists()  # nothing was written


def test_gcs_and_s3_specs_are_built() -> None:
    from cacheflow_jax.store.locations import resolve as _resolve

    kv, label, local = _resolve("gs://bkt/some/prefix", None, None)
    assert kv == {"driver": "gcs", "bucket": "bkt", "path": "some/prefix/"} and local is None
    kv, _, _ = _resolve("s3://bkt/p", "http://127.0.0.1:9", "eu-west-1")
    assert kv == {
        "driver": "s3",
        "bucket": "bkt",
        "path": "p/",
        "endpoint": "http://127.0.0.1:9",
        "aws_region": "eu-west-1",
    }
    with pytest.raises(ValueError, match="unsupported store URL"):
        _resolve("ftp://x/y", None, None)


@pytest.mark.s3
def test_s3_round_trip(s3_server: Any) -> None:
    rng = np.random.default_rng(1)
    arrays = {
        "params/w": random_array(rng, (9, 5), np.dtype(ml_dtypes.bfloat16)),
        "params/b": random_array(rng, (5,), np.dtype(np.int8)),
    }
    tree = {"params": {"w": arrays["params/w"], "b": arrays["params/b"]}}
    url = f"s3://{s3_server.bucket}/stores/one"
    kw = {"s3_endpoint": s3_server.endpoint, "s3_region": s3_server.region}
    write_store(tree, url, chunk_bytes=20, **kw)
    store = open_store(url, **kw)
    assert_store_matches(store, arrays)
    store.write("kv:s3", arrays["params/b"]).result()
    again = open_store(url, **kw)
    assert same_bits(again.read("kv:s3").result(), arrays["params/b"])


# --------------------------------------------------------------------------------------------
# Orbax checkpoints, read in place


def _check_against_orbax(store: TensorStoreStore, restored: Any) -> None:
    assert store.source == "orbax"
    assert jax.tree.structure(store.tree()) == jax.tree.structure(restored)
    flat = {
        "/".join(str(jax.tree_util.keystr((k,), simple=True)) for k in kp): np.asarray(leaf)
        for kp, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]
    }
    for path, kp in store.tree_paths().items():
        leaf = restored
        for k in kp:
            leaf = leaf[k.key if isinstance(k, jax.tree_util.DictKey) else k.idx]
        assert same_bits(np.asarray(leaf), flat[path])
    assert_store_matches(store, flat)


def test_orbax_standard_checkpointer(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tree = {
        "layers": [
            {"w": random_array(rng, (3, 4), np.dtype(np.float32))},
            {"w": random_array(rng, (5,), np.dtype(ml_dtypes.bfloat16))},
        ],
        "emb": random_array(rng, (6, 2), np.dtype(np.int8)),
        "step": np.int32(7),
    }
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", tree)
    ckptr.wait_until_finished()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    store = open_store(tmp_path / "ckpt")
    restored = ocp.StandardCheckpointer().restore(tmp_path / "ckpt")
    assert store.tree() == {
        "layers": [{"w": "layers/0/w"}, {"w": "layers/1/w"}],
        "emb": "emb",
        "step": "step",
    }
    _check_against_orbax(store, restored)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


class _Model(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)])
        self.head = nnx.Linear(2, 5, rngs=rngs)


def test_orbax_checkpoint_manager_nnx(tmp_path: Path) -> None:
    state = nnx.to_pure_dict(nnx.state(_Model(rngs=nnx.Rngs(0))))
    with ocp.CheckpointManager(tmp_path / "mgr") as mgr:
        mgr.save(5, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
        restored = mgr.restore(5, args=ocp.args.StandardRestore())
    for where in (tmp_path / "mgr" / "5", tmp_path / "mgr" / "5" / "default"):
        store = open_store(where)
        assert set(store.tree()["layers"]) == {"0", "1"}
        assert store.tree()["layers"]["0"]["kernel"] == "layers/0/kernel"
        assert "head/bias" in store.arrays()
        _check_against_orbax(store, restored)


# --------------------------------------------------------------------------------------------
# Runtime blocks


def test_runtime_blocks_write_read_reopen(tmp_path: Path) -> None:
    write_store({"a": np.ones(4, np.float32)}, tmp_path / "s")
    store = open_store(tmp_path / "s")
    rng = np.random.default_rng(3)
    blocks = {
        "kv:abc123": random_array(rng, (2, 8), np.dtype(ml_dtypes.bfloat16)),
        "kv/with/slashes %41?": random_array(rng, (3,), np.dtype(np.int8)),
        "scalar": np.float64(2.5),
        "..": random_array(rng, (4, 4, 4), np.dtype(np.float32)),
    }
    futures = [store.write(k, v) for k, v in blocks.items()]
    for k, v in blocks.items():  # visible at once, even before the writes finish
        assert store.info(k).shape == np.shape(v) and store.info(k).runtime
        assert same_bits(store.read(k).result(), np.asarray(v))
    for f in futures:
        assert f.result() == "written"
    assert list(store.keys()) == ["a@0", *blocks]
    reopened = open_store(tmp_path / "s")
    assert set(reopened.keys()) == {"a@0", *blocks}
    for k, v, fut in zip(blocks, blocks.values(), reopened.read_many(list(blocks)), strict=True):
        info = reopened.info(k)
        assert (info.shape, info.dtype, info.nbytes) == (np.shape(v), v.dtype, np.asarray(v).nbytes)
        assert same_bits(fut.result(), np.asarray(v))
    # Overwriting replaces the block; chunk keys are read-only.
    reopened.write("kv:abc123", np.zeros(3, np.uint8)).result()
    assert same_bits(open_store(tmp_path / "s").read("kv:abc123").result(), np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        reopened.write("a@0", np.zeros(4, np.float32))
    # Only block files are left: no temporary file of the atomic writes.
    left = [p for p in (tmp_path / "s" / "_runtime").rglob("*") if p.is_file()]
    assert left and all(p.name.endswith(".block") for p in left), left


def test_runtime_only_store_needs_create() -> None:
    with pytest.raises(StoreError, match="empty"):
        open_store("memory://runtime-only/")
    store = open_store("memory://runtime-only/", create=True)
    assert store.keys() == ()
    store.write("kv:1", np.arange(3)).result()
    assert same_bits(open_store("memory://runtime-only/").read("kv:1").result(), np.arange(3))


def test_corrupt_runtime_block(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s", create=True)
    store.write("kv:x", np.arange(100, dtype=np.int32)).result()
    (path,) = (tmp_path / "s" / "_runtime").iterdir()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match="kv:x") as exc:
        open_store(tmp_path / "s").read("kv:x").result()
    assert path.name in str(exc.value)


# --------------------------------------------------------------------------------------------
# Errors


def test_unknown_key_error_text(tmp_path: Path) -> None:
    store = write_store({"w": np.ones((4, 4))}, tmp_path / "s", chunk_bytes=64)
    for key in ("nope", "w@9,9", "kv:missing"):
        with pytest.raises(KeyError) as exc:
            store.read(key)
        msg = exc.value.args[0]
        assert repr(key) in msg and store.spec in msg and "cacheflow inspect" in msg
        with pytest.raises(KeyError):
            store.info(key)
        with pytest.raises(KeyError):
            store.read_many(["w@0,0", key])
    with pytest.raises(KeyError, match="chunk grid"):
        store.info("w@9,9")


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "store"
    with pytest.raises(FileNotFoundError, match="write_store") as exc:
        open_store(missing)
    assert str(missing) in str(exc.value)
    assert not (tmp_path / "nowhere").exists()
    open_store(missing, create=True)
    assert missing.is_dir()


def test_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("hello")
    with pytest.raises(StoreError, match="is neither a cacheflow store") as exc:
        open_store(tmp_path / "d")
    assert str(tmp_path / "d") in str(exc.value)
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["notes.txt"]
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreError, match="is a file"):
        open_store(tmp_path / "f")


def test_interrupted_write_is_refused(tmp_path: Path) -> None:
    write_store({"w": np.ones(3)}, tmp_path / "s")
    root = tmp_path / "s" / "zarr.json"
    meta = json.loads(root.read_text())
    meta["attributes"]["cacheflow"]["complete"] = False
    root.write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="overwrite=True"):
        open_store(tmp_path / "s")


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_corrupt_chunk_names_key_and_file(tmp_path: Path) -> None:
    src = np.arange(64, dtype=np.float32).reshape(8, 8)
    store = write_store({"params": {"w": src}}, tmp_path / "s", chunk_bytes=64)
    assert store.info("params/w@1,0").shape == (2, 8)
    chunk = tmp_path / "s" / "params" / "w" / "c" / "1" / "0"
    before = _snapshot(tmp_path / "s")
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x01
    chunk.write_bytes(bytes(data))

    fresh = open_store(tmp_path / "s")
    with pytest.raises(CorruptBlockError) as exc:
        fresh.read("params/w@1,0").result()
    msg = str(exc.value)
    assert "'params/w@1,0'" in msg and str(chunk) in msg and "re-write the store" in msg
    assert isinstance(exc.value, OSError)
    for key in ("params/w@0,0", "params/w@2,0", "params/w@3,0"):
        b = fresh.info(key)
        assert same_bits(fresh.read(key).result(), src[b.origin[0] : b.origin[0] + 2])
    after = _snapshot(tmp_path / "s")
    assert after.keys() == before.keys()
    assert [k for k in before if before[k] != after[k]] == [
        os.path.join("params", "w", "c", "1", "0")
    ]


# --------------------------------------------------------------------------------------------
# The fast chunk path: zarr3 chunk files (bytes + crc32c) read and checked by cacheflow itself

FAST_DTYPES = [
    np.dtype(np.int8),
    np.dtype(np.uint8),
    np.dtype(np.int16),
    np.dtype(np.uint32),
    np.dtype(np.int64),
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(np.complex64),
    np.dtype(np.complex128),
]


def _ts_block(store: TensorStoreStore, key: str) -> np.ndarray:
    """The block as TensorStore's zarr3 driver reads it (the reference for the fast path)."""
    info = store.info(key)
    sl = tuple(slice(o, o + n) for o, n in zip(info.origin, info.shape, strict=True))
    return store.handle(info.array)[sl].read().result()


def _is_fast(store: TensorStoreStore, key: str) -> bool:
    from cacheflow_jax.store.futures import FastChunkFuture as _FastChunkFuture

    return isinstance(store.read(key), _FastChunkFuture)


@pytest.mark.parametrize("chunk_items", [2, 6])
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (5, 3), (3, 5, 7), (4, 0)], ids=str)
def test_fast_path_bitwise_equal_to_tensorstore(
    tmp_path: Path, dtype: np.dtype, shape: tuple[int, ...], chunk_items: int
) -> None:
    rng = np.random.default_rng(11)
    src = random_array(rng, shape, dtype)
    # Small chunks: odd sizes leave edge chunks in the last dimension (2 items per chunk) or in
    # a leading one ((5, 3) in chunks of (2, 3)); zarr3 stores edge chunks at full chunk shape.
    store = write_store({"a": src}, tmp_path / "s", chunk_bytes=chunk_items * dtype.itemsize)
    keys = list(store.keys())
    for key, fut in zip(keys, store.read_many(keys), strict=True):
        assert _is_fast(store, key)
        value = fut.result()
        assert same_bits(value, _ts_block(store, key)), key
        b = store.info(key)
        assert same_bits(value, src[tuple(slice(o, o + n) for o, n in zip(b.origin, b.shape))])
        assert value.shape == b.shape and value.nbytes == b.nbytes
    chunk_shape = store.arrays()["a"].chunk_shape
    edge = [k for k in keys if store.info(k).shape != chunk_shape]
    assert bool(edge) == any(n % c for n, c in zip(shape, chunk_shape))
    for key in edge:  # an edge block is its own array, not a view of the whole chunk
        assert store.read(key).result().base is None
    assert_store_matches(store, {"a": src})


def test_fast_path_blocks_go_to_the_device(tmp_path: Path) -> None:
    src = random_array(np.random.default_rng(12), (4, 6), np.dtype(ml_dtypes.bfloat16))
    store = write_store({"a": src}, tmp_path / "s", chunk_bytes=2 * 6 * 2)
    for key in store.keys():
        value = store.read(key).result()
        assert not value.flags.writeable  # a view of the checked file buffer
        on_device = jax.device_put(value)
        assert same_bits(np.asarray(on_device), _ts_block(store, key))


def _make_zarr3(root: Path, name: str, src: np.ndarray, chunks: list[int], **meta: Any) -> None:
    """A zarr3 array ``name`` under a plain zarr3 group at ``root``, written by TensorStore."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(root / name) + "/"},
        "create": True,
        "metadata": {
            "shape": list(src.shape),
            "data_type": src.dtype.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
            **meta,
        },
    }
    ts.open(spec).result().write(src).result()


CRC = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


@pytest.mark.parametrize(
    ("encoding", "chunk_file"),
    [
        ({"name": "default"}, "c/1/0"),
        ({"name": "default", "configuration": {"separator": "."}}, "c.1.0"),
        ({"name": "v2"}, "1.0"),
        ({"name": "v2", "configuration": {"separator": "/"}}, "1/0"),
    ],
    ids=["default", "default-dot", "v2", "v2-slash"],
)
def test_fast_path_chunk_key_encodings(
    tmp_path: Path, encoding: dict[str, Any], chunk_file: str
) -> None:
    src = np.arange(5 * 3, dtype=np.int32).reshape(5, 3)
    _make_zarr3(tmp_path / "s", "w", src, [2, 3], codecs=CRC, chunk_key_encoding=encoding)
    assert (tmp_path / "s" / "w" / chunk_file).is_file()
    store = open_store(tmp_path / "s")
    for key in store.keys():
        assert _is_fast(store, key)
        assert same_bits(store.read(key).result(), _ts_block(store, key))
    assert_store_matches(store, {"w": src})
    # Damage the chunk of block w@1,0: the error names the file under its encoding.
    path = tmp_path / "s" / "w" / chunk_file
    data = bytearray(path.read_bytes())
    data[0] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError) as exc:
        open_store(tmp_path / "s").read("w@1,0").result()
    assert "'w@1,0'" in str(exc.value) and str(path) in str(exc.value)


@pytest.mark.parametrize(
    "meta",
    [
        {"codecs": [{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}]},
        {"codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]},
        {
            "codecs": [
                {"name": "transpose", "configuration": {"order": [1, 0]}},
                *CRC,
            ]
        },
        {"codecs": [CRC[0], {"name": "zstd", "configuration": {"level": 1}}, CRC[1]]},
    ],
    ids=["big-endian", "no-crc", "transpose", "zstd"],
)
def test_other_codecs_read_by_tensorstore(tmp_path: Path, meta: dict[str, Any]) -> None:
    src = random_array(np.random.default_rng(13), (5, 3), np.dtype(np.float32))
    _make_zarr3(tmp_path / "s", "w", src, [2, 2], **meta)
    store = open_store(tmp_path / "s")
    assert not any(_is_fast(store, k) for k in store.keys())
    assert_store_matches(store, {"w": src})


def test_no_fast_path_for_bool_or_other_kvstores(tmp_path: Path) -> None:
    flags = np.array([True, False, True])
    store = write_store({"f": flags, "x": np.arange(3.0)}, tmp_path / "s", chunk_bytes=2)
    assert not _is_fast(store, "f@0") and _is_fast(store, "x@0")
    mem = write_store({"x": np.arange(3.0)}, "memory://no-fast-path/", chunk_bytes=8)
    assert not any(_is_fast(mem, k) for k in mem.keys())
    assert_store_matches(store, {"f": flags, "x": np.arange(3.0)})


def test_fast_path_missing_chunk_foreign_store_reads_fill_value(tmp_path: Path) -> None:
    # A zarr3 hierarchy not written by write_store follows zarr's rule: no chunk file, fill value.
    src = np.arange(12, dtype=np.int16).reshape(4, 3)
    _make_zarr3(tmp_path / "s", "w", src, [2, 2], codecs=CRC, fill_value=7)
    (tmp_path / "s" / "w" / "c" / "1" / "1").unlink()  # block w@1,1: rows 2-3, column 2
    store = open_store(tmp_path / "s")
    fut = store.read("w@1,1")
    called: list[object] = []
    fut.add_done_callback(called.append)
    value = fut.result(timeout=30)
    assert fut.done() and called == [fut]
    assert (value == 7).all() and value.shape == store.info("w@1,1").shape
    assert same_bits(value, _ts_block(store, "w@1,1"))
    others = [k for k in store.keys() if k != "w@1,1"]
    for k, f in zip(others, store.read_many(others), strict=True):
        assert same_bits(f.result(), _ts_block(store, k))


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "tensorstore"])
def test_missing_chunk_of_a_written_store_is_an_error(tmp_path: Path, fast: bool) -> None:
    # write_store writes every chunk, so a missing one is lost data: an error naming the key and
    # the file, never the fill value (issue 9).
    src = {"x": np.ones((4, 3), np.float32), "f": np.array([True, False, True, True])}
    store = write_store(src, tmp_path / "t", chunk_bytes=12)
    key, chunk = ("x@2,0", "x/c/2/0") if fast else ("f@0", "f/c/0")
    assert _is_fast(store, key) == fast
    (tmp_path / "t" / chunk).unlink()
    store = open_store(tmp_path / "t")
    with pytest.raises(StoreError, match="missing its chunk") as exc:
        store.read(key).result(timeout=30)
    assert repr(key) in str(exc.value) and str(tmp_path / "t" / chunk) in str(exc.value)
    others = [k for k in store.keys() if k != key]
    for k, f in zip(others, store.read_many(others), strict=True):
        assert same_bits(f.result(), _ts_block(store, k))


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "crc"])
def test_fast_path_corruption_names_key_and_file(tmp_path: Path, damage: str) -> None:
    src = random_array(np.random.default_rng(14), (6, 5), np.dtype(ml_dtypes.bfloat16))
    write_store({"p": {"w": src}}, tmp_path / "s", chunk_bytes=2 * 5 * 2)
    chunk = tmp_path / "s" / "p" / "w" / "c" / "2" / "0"
    data = bytearray(chunk.read_bytes())
    if damage == "flip":
        data[3] ^= 0x80
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "extend":
        data += b"\0"
    else:
        data[-1] ^= 0x01
    chunk.write_bytes(bytes(data))
    fresh = open_store(tmp_path / "s")
    futures = fresh.read_many(list(fresh.keys()))
    for key, fut in zip(fresh.keys(), futures, strict=True):
        if key != "p/w@2,0":
            assert same_bits(fut.result(), _ts_block(fresh, key))
            continue
        with pytest.raises(CorruptBlockError) as exc:
            fut.result()
        msg = str(exc.value)
        assert "'p/w@2,0'" in msg and str(chunk) in msg and "re-write the store" in msg
        assert "DATA_LOSS" in msg and ("crc32c" in msg or "bytes" in msg)
        if damage != "extend":  # TensorStore 0.1.86 reads a chunk file with a byte appended
            with pytest.raises(ValueError, match="DATA_LOSS"):  # TensorStore rejects it too
                _ts_block(fresh, key)


def test_crc32c_is_the_c_implementation() -> None:
    import google_crc32c

    from cacheflow_jax.store.fastread import CRC32C as _CRC32C

    assert google_crc32c.implementation == "c" and _CRC32C is not None
