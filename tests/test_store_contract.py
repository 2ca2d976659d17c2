"""The `Store` contract: one behavioural suite run over every store (as cachetools'
``CacheTestMixin`` or orbax's ``CheckpointerTestBase`` are).

The fixture `case` is parametrized over each implementation of `cacheflow_jax.Store`:

* ``zarr3-file``, ``zarr3-memory``, ``zarr3-s3``: stores `write_store` wrote, on TensorStore's
  file and memory drivers and on a real S3 server (``moto_server`` on loopback: `s3_server`);
* ``orbax``: a real orbax checkpoint (``StandardCheckpointer``) opened in place, with the chunk
  manifest ``cacheflow verify`` records (orbax keeps no checksums of its own) and its runtime
  blocks in a separate directory (a checkpoint is never written);
* ``metadata``: replay's `TraceStore`, which knows each block's size from a trace and holds no
  bytes.

What is checked is what the `Store` protocol's docstrings promise (and `TensorStoreStore`'s, the
store `open_store` returns). What a store cannot do is declared on its case (`StoreCase.lacks`);
the tests of that capability skip with the case's reason instead of passing without checking.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from _bits import random_bits, same_bits

import cacheflow_jax as cfj
from cacheflow_jax.replay.engine import TraceStore
from cacheflow_jax.store.locations import CONTEXT
from cacheflow_jax.store.runtime_format import next_version, runtime_name
from cacheflow_jax.store.verify import verify_checkpoint
from cacheflow_jax.store.write import chunk_shape_for
from cacheflow_jax.trace.reader import Trace

# Capabilities a case may lack (`StoreCase.lacks`: capability -> why).
BYTES = "bytes"  # read() yields the block's bytes
RUNTIME = "runtime"  # write() stores runtime blocks that read() and a reopened store serve
DAMAGE = "damage"  # the stored bytes can be damaged by the test (a file, an object)




_RNG = np.random.default_rng(26)
# A cacheflow store's tree: chunk_bytes=12 cuts params/w into 7 chunks of (1, 3) and params/b
# into 3 (the last one clipped at the array's edge); a scalar, a bool array (read by
# TensorStore, not the fast path) and a list in the tree.
ZARR_TREE = {
    "params": {
        "w": random_bits(_RNG, (7, 3), np.float32),
        "b": random_bits(_RNG, (13,), ml_dtypes.bfloat16),
    },
    "step": np.int32(7),
    "mask": random_bits(_RNG, (9,), np.bool_),
    "layers": [{"k": random_bits(_RNG, (5, 2), np.int8)}],
}
ZARR_ARRAYS = {
    "params/w": ZARR_TREE["params"]["w"],
    "params/b": ZARR_TREE["params"]["b"],
    "step": np.asarray(ZARR_TREE["step"]),
    "mask": ZARR_TREE["mask"],
    "layers/0/k": ZARR_TREE["layers"][0]["k"],
}
ZARR_CHUNK_BYTES = 12
# An orbax checkpoint's tree: one chunk per leaf; params/w (8 KiB of random bits) fills the
# largest OCDBT data file by far, so damaging that file damages params/w alone.
ORBAX_TREE = {
    "params": {
        "w": random_bits(_RNG, (64, 32), np.float32),
        "b": random_bits(_RNG, (13,), ml_dtypes.bfloat16),
    },
    "step": np.int32(7),
    "mask": random_bits(_RNG, (9,), np.bool_),
}
ORBAX_ARRAYS = {
    "params/w": ORBAX_TREE["params"]["w"],
    "params/b": ORBAX_TREE["params"]["b"],
    "step": np.asarray(ORBAX_TREE["step"]),
    "mask": ORBAX_TREE["mask"],
}
# Runtime blocks every case with runtime writes holds before its test starts.
SEED_BLOCKS = {
    "kv:seed": random_bits(_RNG, (2, 4), ml_dtypes.bfloat16),
    "kv/with/slash %41": random_bits(_RNG, (5,), np.int8),
}


def _kv(spec: dict[str, Any]) -> ts.KvStore:
    """The kvstore at ``spec``, in the context the stores open in (memory:// is shared there)."""
    return ts.KvStore.open(dict(spec), context=CONTEXT).result()


def _snapshot(spec: dict[str, Any]) -> dict[str, bytes]:
    """Every key under ``spec`` and its bytes."""
    kv = _kv(spec)
    return {k.decode(): kv.read(k).result().value for k in kv.list().result()}


def _mangle(spec: dict[str, Any], name: str, how: str) -> None:
    """Damages the value ``name`` under ``spec``: ``torn`` keeps its first half (a write cut off),
    ``flip`` flips one bit in its middle (decayed bytes)."""
    kv = _kv(spec)
    found = kv.read(name).result()
    assert found.state == "value", f"{name} is not under {spec}: the test damages nothing"
    data = bytearray(found.value)
    if how == "torn":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x10
    kv.write(name, bytes(data)).result()


# ------------------------------------------------------------------------------------- cases


class StoreCase:
    """One implementation under test: how to make it, what it holds, what it cannot do."""

    name = ""
    lacks: dict[str, str] = {}  # capability -> why this store has none
    runtime_in_store = True  # runtime blocks live under the store's own location
    arrays: dict[str, np.ndarray] = {}  # array path -> the array written

    def __init__(self, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        self.tmp_path = tmp_path
        self.request = request
        self.runtime: dict[str, np.ndarray] = {}  # runtime blocks written so far, in order
        self.store = self.make()

    def make(self) -> Any:
        raise NotImplementedError

    def reopen(self) -> Any:
        """The same location opened afresh (what another process would see)."""
        raise NotImplementedError

    def expected_keys(self) -> list[str]:
        """`Store.keys` as documented: every chunk of every array in `arrays` order, then the
        runtime blocks in the order they were first written."""
        chunks = [
            cfj.block_key(path, index)
            for path, info in self.store.arrays().items()
            for index in np.ndindex(*info.grid_shape)
        ]
        return chunks + list(self.runtime)

    def seed(self, store: Any) -> None:
        """Writes `SEED_BLOCKS` and waits until they are durable."""
        for key, value in SEED_BLOCKS.items():
            assert store.write(key, value).result() == "written"
            self.runtime[key] = value

    # Damage: (the key whose block it damages, the kvstore spec, the name under it).
    def chunk_location(self) -> tuple[str, dict[str, Any], str]:
        raise NotImplementedError

    def runtime_location(self, key: str) -> tuple[dict[str, Any], str]:
        raise NotImplementedError

    def chunk_spec(self) -> dict[str, Any]:
        """The kvstore spec of the location holding the store's chunks."""
        return self.store.kvstore_spec


class ZarrCase(StoreCase):
    """A store `write_store` wrote at `url` (`options`: what open_store needs to reach it)."""

    arrays = ZARR_ARRAYS
    damaged = "params/w@1,0"

    def make(self) -> Any:
        self.url, self.options = self.location()
        written = cfj.write_store(ZARR_TREE, self.url, chunk_bytes=ZARR_CHUNK_BYTES, **self.options)
        assert written.keys()  # the write is complete
        store = self.reopen()
        self.seed(store)
        return store

    def location(self) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def reopen(self) -> Any:
        return cfj.open_store(self.url, **self.options)

    def chunk_location(self) -> tuple[str, dict[str, Any], str]:
        # The zarr3 default chunk key encoding: <array>/c/<i>/<j>.
        path, index = cfj.parse_key(self.damaged)
        return self.damaged, self.chunk_spec(), f"{path}/c/" + "/".join(map(str, index))

    def runtime_location(self, key: str) -> tuple[dict[str, Any], str]:
        return self.chunk_spec(), runtime_name(key)


class ZarrFile(ZarrCase):
    name = "zarr3-file"

    def location(self) -> tuple[str, dict[str, Any]]:
        return str(self.tmp_path / "store"), {}


class ZarrMemory(ZarrCase):
    name = "zarr3-memory"

    def location(self) -> tuple[str, dict[str, Any]]:
        return f"memory://contract-{uuid.uuid4().hex}/", {}


class ZarrS3(ZarrCase):
    name = "zarr3-s3"

    def location(self) -> tuple[str, dict[str, Any]]:
        s3 = self.request.getfixturevalue("s3_server")
        url = f"s3://{s3.bucket}/contract/{uuid.uuid4().hex}"
        return url, {"s3_endpoint": s3.endpoint, "s3_region": s3.region}


class Orbax(StoreCase):
    """A checkpoint saved by orbax, opened in place; runtime blocks go to ``runtime/``."""

    name = "orbax"
    arrays = ORBAX_ARRAYS
    runtime_in_store = False
    damaged = "params/w@0,0"

    def make(self) -> Any:
        self.path = self.tmp_path / "ckpt"
        self.runtime_dir = self.tmp_path / "runtime"
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(self.path, ORBAX_TREE)
        checkpointer.wait_until_finished()
        # Orbax keeps no checksums: `cacheflow verify` records the CRC-32C of every chunk.
        assert verify_checkpoint(self.path)["status"] == "recorded"
        store = self.reopen()
        assert store.source == "orbax" and store.manifest is not None
        self.seed(store)
        return store

    def reopen(self) -> Any:
        return cfj.open_store(self.path, runtime=self.runtime_dir)

    def chunk_location(self) -> tuple[str, dict[str, Any], str]:
        files = [p for p in self.path.rglob("d/*") if p.is_file()]
        largest = max(files, key=lambda p: p.stat().st_size)
        assert largest.stat().st_size > ORBAX_ARRAYS["params/w"].nbytes // 2
        return self.damaged, self.chunk_spec(), largest.relative_to(self.path).as_posix()

    def runtime_location(self, key: str) -> tuple[dict[str, Any], str]:
        return {"driver": "file", "path": f"{self.runtime_dir}/"}, runtime_name(key)


# A trace with a key seen twice at two sizes: its block is the larger (`Trace.sizes`).
TRACE = Trace(
    "contract.log",
    t=[0.0, 1.0, 2.0, 3.0, 4.0],
    keys=["kv:a", "w@0", "kv:a", "kv:b", "kv:c"],
    nbytes=[10, 64, 12, 1, 4096],
    kinds=["kv", "weight", "kv", "kv", "kv"],
    reqs=[None] * 5,
)
TRACE_SIZES = {"kv:a": 12, "w@0": 64, "kv:b": 1, "kv:c": 4096}


class Metadata(StoreCase):
    """Replay's store: sizes from a trace, no bytes."""

    name = "metadata"
    _why = "TraceStore holds no bytes: it knows block sizes from a trace (replay)"
    lacks = {
        BYTES: _why + "; read() yields a marker, not the block",
        RUNTIME: _why + "; write() is a no-op",
        DAMAGE: _why + "; there is nothing stored to damage",
    }

    def make(self) -> Any:
        return TraceStore(TRACE)

    def reopen(self) -> Any:
        return TraceStore(TRACE)

    def expected_keys(self) -> list[str]:
        return list(TRACE_SIZES)


CASES = {c.name: c for c in (ZarrFile, ZarrMemory, ZarrS3, Orbax, Metadata)}


@pytest.fixture(
    params=[
        pytest.param(name, marks=pytest.mark.s3 if name == "zarr3-s3" else ()) for name in CASES
    ]
)
def case(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StoreCase]:
    # A checkpoint's default runtime location is under the user's cache folder: keep it here.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    yield CASES[request.param](tmp_path, request)


def need(case: StoreCase, *capabilities: str) -> None:
    """Skips the test, with the case's reason, if the store lacks one of ``capabilities``."""
    for capability in capabilities:
        if capability in case.lacks:
            pytest.skip(f"{case.name}: no {capability}: {case.lacks[capability]}")


def _block_of(case: StoreCase, key: str) -> np.ndarray:
    """The block ``key`` as written: its slice of the source array, or the runtime block."""
    if key in case.runtime:
        return np.asarray(case.runtime[key])
    info = case.store.info(key)
    return case.arrays[info.array][tuple(slice(o, o + n) for o, n in zip(info.origin, info.shape))]


def _tensorstore_block(store: Any, key: str) -> np.ndarray:
    """The block as TensorStore's own driver reads it from the stored array."""
    info = store.info(key)
    where = tuple(slice(o, o + n) for o, n in zip(info.origin, info.shape))
    return store.handle(info.array)[where].read().result()


# ------------------------------------------------------------------------- what it lists


def test_is_a_store(case: StoreCase) -> None:
    store = case.store
    assert isinstance(store, cfj.Store)
    assert isinstance(store.spec, str) and store.spec


def test_arrays_are_what_was_written(case: StoreCase) -> None:
    arrays = case.store.arrays()
    assert set(arrays) == set(case.arrays)
    for path, src in case.arrays.items():
        info = arrays[path]
        assert (info.path, info.shape, info.dtype) == (path, src.shape, src.dtype)
        assert all(c >= 1 for c in info.chunk_shape) and len(info.chunk_shape) == src.ndim
        if isinstance(case, ZarrCase):  # write_store's chunks: chunk_shape_for(chunk_bytes)
            assert info.chunk_shape == chunk_shape_for(src.shape, src.itemsize, ZARR_CHUNK_BYTES)
        assert info.nbytes == src.nbytes


def test_keys_holds_and_info_agree(case: StoreCase) -> None:
    store = case.store
    keys = list(store.keys())
    assert keys == case.expected_keys()
    assert len(set(keys)) == len(keys)
    for key in keys:
        assert store.holds(key), key
        info = store.info(key)
        assert info.key == key
        assert info.nbytes == math.prod(info.shape) * np.dtype(info.dtype).itemsize
        if info.runtime:
            assert (info.array, info.index, info.origin) == ("", (), ())
        else:
            assert (info.array, info.index) == cfj.parse_key(key)
    if isinstance(case, Metadata):
        assert {k: store.info(k).nbytes for k in keys} == TRACE_SIZES
    for key, value in case.runtime.items():
        info = store.info(key)
        assert info.runtime and (info.shape, info.dtype) == (value.shape, value.dtype)


def test_blocks_tile_each_array_exactly_once(case: StoreCase) -> None:
    store = case.store
    if not case.arrays:
        assert not [k for k in store.keys() if not store.info(k).runtime]
    for path, src in case.arrays.items():
        info = store.arrays()[path]
        covered = np.zeros(src.shape, np.int32)
        for index in np.ndindex(*info.grid_shape):
            block = store.info(cfj.block_key(path, index))
            assert block.index == index and block.dtype == src.dtype
            assert block.origin == tuple(i * c for i, c in zip(index, info.chunk_shape))
            # Clipped at the array's edge.
            assert block.shape == tuple(
                min(c, n - o) for c, n, o in zip(info.chunk_shape, src.shape, block.origin)
            )
            covered[tuple(slice(o, o + n) for o, n in zip(block.origin, block.shape))] += 1
        assert (covered == 1).all(), f"the blocks of {path} do not tile it exactly once"


def same_listing(store: Any, case: StoreCase) -> bool:
    """Whether a reopened store lists `expected_keys`: the chunks in the same order, then the
    runtime blocks (in the order the listing found them, not necessarily the order written)."""
    keys, expected = list(store.keys()), case.expected_keys()
    n = len(expected) - len(case.runtime)
    return keys[:n] == expected[:n] and sorted(keys[n:]) == sorted(expected[n:])


def test_a_reopened_store_lists_the_same(case: StoreCase) -> None:
    again = case.reopen()
    assert same_listing(again, case)
    assert dict(again.arrays()) == dict(case.store.arrays())
    for key in again.keys():
        assert again.info(key) == case.store.info(key)


# ---------------------------------------------------------------------------------- reads


def test_read_is_a_future(case: StoreCase) -> None:
    store = case.store
    for key in store.keys():
        future = store.read(key)
        future.result(timeout=30)
        assert future.done()


def test_read_returns_exactly_the_written_bytes(case: StoreCase) -> None:
    need(case, BYTES)
    store = case.store
    for key in store.keys():
        info = store.info(key)
        value = store.read(key).result(timeout=30)
        assert isinstance(value, np.ndarray), key
        assert (value.shape, value.dtype) == (info.shape, info.dtype), key
        assert same_bits(value, _block_of(case, key)), key
        if not info.runtime:
            assert same_bits(value, _tensorstore_block(store, key)), key


def test_read_many_answers_in_the_order_asked(case: StoreCase) -> None:
    need(case, BYTES)
    store = case.store
    keys = list(store.keys())
    order = [keys[i] for i in np.random.default_rng(1).permutation(len(keys))]
    order += order[:3]  # a key asked twice gets two answers
    futures = store.read_many(order)
    assert len(futures) == len(order)
    for key, future in zip(order, futures, strict=True):
        assert same_bits(future.result(timeout=30), _block_of(case, key)), key


def _unknown_keys(case: StoreCase) -> list[str]:
    keys = ["nope", "kv:never-written"]
    for path, info in case.store.arrays().items():
        keys.append(cfj.block_key(path, info.grid_shape or (0,)))  # past the grid
        keys.append(f"{path}x@0")
    return keys


def test_an_unknown_key_is_a_key_error_naming_key_and_store(case: StoreCase) -> None:
    store = case.store
    for key in _unknown_keys(case):
        assert not store.holds(key)
        assert key not in store.keys()
        with pytest.raises(KeyError) as err:
            store.info(key)
        assert repr(key) in str(err.value) and store.spec in str(err.value)


def test_read_of_an_unknown_key_raises_at_once(case: StoreCase) -> None:
    need(case, BYTES)
    store = case.store
    known = store.keys()[0]
    for key in _unknown_keys(case):
        with pytest.raises(KeyError) as err:
            store.read(key)
        assert repr(key) in str(err.value) and store.spec in str(err.value)
        with pytest.raises(KeyError, match=re.escape(repr(key))):
            store.read_many([known, key])


# ------------------------------------------------------------------------- runtime blocks


def test_a_written_block_is_seen_at_once_and_after_reopening(case: StoreCase) -> None:
    need(case, RUNTIME)
    store = case.store
    value = random_bits(np.random.default_rng(2), (3, 5), np.float32)
    future = store.write("kv:new", value)
    # Visible as soon as write returns, before the write is durable.
    assert store.holds("kv:new") and list(store.keys())[-1] == "kv:new"
    info = store.info("kv:new")
    assert info.runtime and (info.shape, info.dtype, info.nbytes) == (
        value.shape, value.dtype, value.nbytes,
    )  # fmt: skip
    assert same_bits(store.read("kv:new").result(timeout=30), value)
    assert future.result(timeout=30) == "written"
    case.runtime["kv:new"] = value
    again = case.reopen()
    assert same_listing(again, case)
    assert again.info("kv:new") == info
    assert same_bits(again.read("kv:new").result(timeout=30), value)


def test_write_copies_the_value_before_returning(case: StoreCase) -> None:
    need(case, RUNTIME)
    buffer = np.arange(6, dtype=np.int32)
    future = case.store.write("kv:buffer", buffer)
    buffer[:] = -1  # the caller reuses its buffer at once
    assert future.result(timeout=30) == "written"
    for store in (case.store, case.reopen()):
        assert same_bits(store.read("kv:buffer").result(timeout=30), np.arange(6, dtype=np.int32))


def test_a_rewrite_replaces_the_block(case: StoreCase) -> None:
    need(case, RUNTIME)
    store = case.store
    assert store.write("kv:seed", np.zeros((7,), np.uint8)).result(timeout=30) == "written"
    for s in (store, case.reopen()):
        assert s.info("kv:seed").shape == (7,)
        assert same_bits(s.read("kv:seed").result(timeout=30), np.zeros((7,), np.uint8))
        assert list(s.keys()).count("kv:seed") == 1


def test_the_newer_version_wins_whatever_order_the_writes_land_in(case: StoreCase) -> None:
    need(case, RUNTIME)
    store = case.store
    older, newer = next_version(), next_version()
    new = random_bits(np.random.default_rng(3), (4,), np.float32)
    assert store.write("kv:v", new, version=newer).result(timeout=30) == "written"
    # A write-back still in flight from before must not replace the newer block.
    assert store.write("kv:v", np.zeros(9, np.int8), version=older).result(timeout=30) == (
        "superseded"
    )
    for s in (store, case.reopen()):
        assert (s.info("kv:v").shape, s.info("kv:v").dtype) == (new.shape, new.dtype)
        assert same_bits(s.read("kv:v").result(timeout=30), new)
    # A later version of the same writer replaces it.
    assert store.write("kv:v", np.ones(2, np.int8), version=next_version()).result() == "written"
    assert same_bits(case.reopen().read("kv:v").result(timeout=30), np.ones(2, np.int8))


def test_a_pytree_block_round_trips(case: StoreCase) -> None:
    need(case, RUNTIME)
    rng = np.random.default_rng(4)
    tree = {"k": random_bits(rng, (2, 3), ml_dtypes.bfloat16), "v": [random_bits(rng, (5,), np.int8)]}
    assert case.store.write("kv:tree", tree).result(timeout=30) == "written"
    for store in (case.store, case.reopen()):
        info = store.info("kv:tree")
        nbytes = tree["k"].nbytes + tree["v"][0].nbytes
        assert info.runtime and (info.shape, info.dtype) == ((nbytes,), np.uint8)
        assert info.nbytes == nbytes
        assert info.leaves == ((tree["k"].shape, tree["k"].dtype), (tree["v"][0].shape, np.int8))
        got = store.read("kv:tree").result(timeout=30)
        assert set(got) == {"k", "v"} and len(got["v"]) == 1
        assert same_bits(got["k"], tree["k"]) and same_bits(got["v"][0], tree["v"][0])


def test_chunks_are_read_only(case: StoreCase) -> None:
    need(case, RUNTIME)
    store = case.store
    for key in [k for k in store.keys() if not store.info(k).runtime]:
        with pytest.raises(ValueError, match="read-only"):
            store.write(key, np.zeros(store.info(key).shape, store.info(key).dtype))
        assert not store.info(key).runtime
    need(case, BYTES)
    for key in store.keys():
        assert same_bits(store.read(key).result(timeout=30), _block_of(case, key))


# Writes `TensorStoreStore.write` documents as refused: (key, value, error).
REFUSED_WRITES = [
    ("", np.ones(2), ValueError),  # the empty key
    (7, np.ones(2), TypeError),  # not a str
    ("kv:" + "x" * 300, np.ones(2), ValueError),  # too long for a file name
    ("kv:text", np.array(["a", "b"]), ValueError),  # not a numeric array
    ("kv:object", np.array([object()]), ValueError),
]


def test_a_refused_write_changes_nothing(case: StoreCase) -> None:
    need(case, RUNTIME)
    store = case.store
    before = list(store.keys())
    for key, value, error in REFUSED_WRITES:
        with pytest.raises(error):
            store.write(key, value)
        assert list(store.keys()) == before, key
    assert same_listing(case.reopen(), case)


def test_runtime_writes_never_change_the_stored_chunks(case: StoreCase) -> None:
    need(case, RUNTIME, DAMAGE)
    before = _snapshot(case.chunk_spec())
    for i in range(3):
        assert case.store.write(f"kv:{i}", np.full(4, i, np.int16)).result(timeout=30) == "written"
    after = _snapshot(case.chunk_spec())
    if case.runtime_in_store:
        # New files only, all under _runtime/; every other file as it was.
        added = set(after) - set(before)
        assert len(added) == 3 and all(k.startswith("_runtime/") for k in added)
        assert {k: v for k, v in after.items() if k not in added} == before
    else:
        assert after == before  # a checkpoint is never written


# ---------------------------------------------------------------------------------- damage


@pytest.mark.parametrize("how", ["torn", "flip"])
def test_a_damaged_chunk_is_a_corrupt_block_error_never_wrong_bytes(
    case: StoreCase, how: str
) -> None:
    need(case, BYTES, DAMAGE)
    key, spec, name = case.chunk_location()
    _mangle(spec, name, how)
    store = case.reopen()
    keys = list(store.keys())
    for k, future in zip(keys, store.read_many(keys), strict=True):
        if k != key:
            assert same_bits(future.result(timeout=30), _block_of(case, k)), k
            continue
        with pytest.raises(cfj.CorruptBlockError) as err:
            future.result(timeout=30)
        assert repr(key) in str(err.value) and store.spec in str(err.value)
        assert isinstance(err.value, cfj.StoreError)
    with pytest.raises(cfj.CorruptBlockError):  # again: a damaged block is never cached as good
        store.read(key).result(timeout=30)


@pytest.mark.parametrize("how", ["torn", "flip"])
def test_a_damaged_runtime_block_is_a_corrupt_block_error(case: StoreCase, how: str) -> None:
    need(case, BYTES, RUNTIME, DAMAGE)
    value = np.arange(100, dtype=np.int32)
    assert case.store.write("kv:damaged", value).result(timeout=30) == "written"
    _mangle(*case.runtime_location("kv:damaged"), how)
    store = case.reopen()
    with pytest.raises(cfj.CorruptBlockError) as err:
        store.info("kv:damaged")  # its header is read lazily, on the first info() or read
        store.read("kv:damaged").result(timeout=30)
    assert "'kv:damaged'" in str(err.value)
    for key in case.runtime:  # the other runtime blocks are intact
        assert same_bits(store.read(key).result(timeout=30), case.runtime[key])
