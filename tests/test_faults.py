"""The fault suite (issue 9): faults injected for real, counted per fault.

Every test injects real faults (files deleted, truncated, swapped or bit-flipped; metadata edited;
a real S3 server killed or stopped; a writer process killed; a full file system; bad keys and
values) and checks the project's first promise: no wrong byte is ever served, and nothing reported
durable is lost. Each records its counts in ``_faults``; the run prints them as a table.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from _faults import record

import cacheflow_jax as cfj
from cacheflow_jax._blocks import StoreError

MiB = 1 << 20


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Shape, dtype and every byte equal."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """Arrays that take both read paths: fast (float32, int8, bfloat16) and TensorStore (bool)."""
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((12, 16)).astype(np.float32),
        "v": rng.standard_normal((12, 16)).astype(np.float32),
        "q": rng.integers(-128, 127, (10, 32), dtype=np.int8),
        "h": rng.standard_normal((9, 16)).astype(ml_dtypes.bfloat16),
        "mask": rng.integers(0, 2, (12, 40)).astype(bool),
    }


def _expected(store: cfj.TensorStoreStore, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every block key of ``store`` -> the bytes it must serve."""
    out = {}
    for key in store.keys():
        info = store.info(key)
        sel = tuple(slice(o, o + n) for o, n in zip(info.origin, info.shape, strict=True))
        out[key] = arrays[info.array][sel]
    return out


def _chunk_file(root: Path, key: str) -> Path:
    path, _, idx = key.rpartition("@")
    return root / path / "c" / Path(*idx.split(","))


def _serve_all(
    fault: str,
    cache: cfj.TieredCache,
    expected: dict[str, np.ndarray],
    damaged: set[str],
) -> None:
    """Gets every key through ``cache``; damaged keys must raise naming the key, others be exact.

    Records injected / detected / served wrong for ``fault`` and fails on any wrong byte.
    """
    detected = wrong = 0
    for key, want in expected.items():
        try:
            got = np.asarray(cache.get(key))
        except StoreError as err:
            assert key in damaged, f"{fault}: undamaged block {key!r} raised {err}"
            assert repr(key) in str(err), f"{fault}: error does not name {key!r}: {err}"
            detected += 1
            continue
        if not same_bits(got, want):
            wrong += 1
    record(fault, injected=len(damaged), detected=detected, served_wrong=wrong)
    assert wrong == 0, f"{fault}: {wrong} blocks served with wrong bytes"
    assert detected == len(damaged), f"{fault}: {len(damaged) - detected} faults not detected"


def _cache(store: cfj.TensorStoreStore) -> cfj.TieredCache:
    return cfj.TieredCache(store, device_bytes=MiB, host_bytes=MiB)


# --------------------------------------------------------------------------------------------
# Chunk files: deleted, truncated, bit-flipped, swapped


def _damage(kind: str, files: list[Path], rng: np.random.Generator) -> None:
    if kind == "deleted":
        for f in files:
            f.unlink()
    elif kind == "truncated":
        for f in files:
            data = f.read_bytes()
            f.write_bytes(data[: int(rng.integers(0, len(data)))])
    elif kind == "bit-flipped":
        for f in files:
            data = bytearray(f.read_bytes())
            data[int(rng.integers(0, len(data)))] ^= 1 << int(rng.integers(0, 8))
            f.write_bytes(bytes(data))
    elif kind == "swapped":
        a, b = files
        da, db = a.read_bytes(), b.read_bytes()
        a.write_bytes(db)
        b.write_bytes(da)
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["deleted", "truncated", "bit-flipped", "swapped"])
@pytest.mark.parametrize("array", ["w", "h", "mask"], ids=["float32-fast", "bf16-fast", "bool-ts"])
def test_damaged_chunk_files_are_never_served(tmp_path: Path, kind: str, array: str) -> None:
    arrays = _arrays(1)
    store = cfj.write_store(arrays, tmp_path / "s", chunk_bytes=128)
    keys = [k for k in store.keys() if store.info(k).array == array]
    rng = np.random.default_rng(hash((kind, array)) % 2**32)
    for trial in range(3):
        picked = list(rng.choice(len(keys), size=2, replace=False))
        damaged = {keys[i] for i in picked} if kind == "swapped" else {keys[picked[0]]}
        files = [_chunk_file(tmp_path / "s", k) for k in sorted(damaged)]
        if kind == "swapped" and files[0].read_bytes() == files[1].read_bytes():
            continue  # two equal chunks: swapping them changes nothing
        saved = {f: f.read_bytes() for f in files}
        _damage(kind, files, rng)
        _serve_all(
            f"chunk file {kind}",
            _cache(cfj.open_store(tmp_path / "s")),
            _expected(store, arrays),
            damaged,
        )
        for f, data in saved.items():
            f.write_bytes(data)
        del trial


def test_chunk_swapped_between_arrays(tmp_path: Path) -> None:
    # Two arrays with equal chunk sizes: a chunk file moved across is intact but in the wrong place.
    arrays = _arrays(2)
    store = cfj.write_store(arrays, tmp_path / "s", chunk_bytes=128)
    a, b = _chunk_file(tmp_path / "s", "w@1,0"), _chunk_file(tmp_path / "s", "v@3,0")
    _damage("swapped", [a, b], np.random.default_rng(0))
    _serve_all(
        "chunk file swapped across arrays",
        _cache(cfj.open_store(tmp_path / "s")),
        _expected(store, arrays),
        {"w@1,0", "v@3,0"},
    )


def test_missing_chunk_in_memory_store(tmp_path: Path) -> None:
    arrays = _arrays(3)
    store = cfj.write_store(arrays, "memory://faults-missing/", chunk_bytes=128, overwrite=True)
    damaged = {"w@2,0", "mask@1,0"}
    for key in damaged:
        path, _, idx = key.rpartition("@")
        name = f"{path}/c/{idx.replace(',', '/')}"
        store._kv.delete_range(ts.KvStore.KeyRange(name, name + "\0")).result()
    _serve_all(
        "chunk object deleted (memory://)",
        _cache(cfj.open_store("memory://faults-missing/")),
        _expected(store, arrays),
        damaged,
    )


def test_cache_keeps_no_bad_bytes_after_the_chunk_returns(tmp_path: Path) -> None:
    # The reported case: a deleted chunk served as zeros, and the zeros stayed cached in L1/L2.
    s = cfj.write_store({"w": np.ones((8, 256), np.float32)}, tmp_path / "m", chunk_bytes=1024)
    chunk = tmp_path / "m" / "w" / "c" / "1" / "0"
    saved = chunk.read_bytes()
    chunk.unlink()
    cache = cfj.TieredCache(cfj.open_store(tmp_path / "m"), device_bytes=MiB, host_bytes=0)
    with pytest.raises(StoreError, match=r"'w@1,0'.*missing its chunk") as exc:
        cache.get("w@1,0")
    assert str(chunk) in str(exc.value)
    assert cache.tier_of("w@1,0") is None
    chunk.write_bytes(saved)
    assert same_bits(np.asarray(cache.get("w@1,0")), np.ones((1, 256), np.float32))
    cache.check_budgets()
    del s


# --------------------------------------------------------------------------------------------
# Metadata edited


def _edit_json(path: Path, edit) -> None:
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


ARRAY_EDITS = {
    "data_type narrowed": lambda m: m.update(data_type="float16"),
    "data_type reinterpreted": lambda m: m.update(data_type="int32"),
    "shape grown": lambda m: m.update(shape=[m["shape"][0] + 4, m["shape"][1]]),
    "shape shrunk": lambda m: m.update(shape=[m["shape"][0] - 3, m["shape"][1]]),
    "chunk shape changed": lambda m: m["chunk_grid"]["configuration"].update(chunk_shape=[2, 8]),
    "checksum codec removed": lambda m: m.update(codecs=m["codecs"][:1]),
    "fill value changed": lambda m: m.update(fill_value=1.0),
}


@pytest.mark.parametrize("edit", sorted(ARRAY_EDITS))
def test_edited_array_metadata_is_refused(tmp_path: Path, edit: str) -> None:
    arrays = _arrays(4)
    cfj.write_store(arrays, tmp_path / "s", chunk_bytes=128)
    _edit_json(tmp_path / "s" / "w" / "zarr.json", ARRAY_EDITS[edit])
    with pytest.raises(StoreError, match="was changed after write_store") as exc:
        cfj.open_store(tmp_path / "s")
    assert str(tmp_path / "s" / "w" / "zarr.json") in str(exc.value)
    record("zarr.json edited (array)", injected=1, detected=1)


ROOT_EDITS = {
    "not JSON": None,
    "manifest record changed": lambda m: m["attributes"]["cacheflow"]["manifest"].update(crc32c=1),
    "array fingerprint changed": lambda m: m["attributes"]["cacheflow"]["arrays"]["w"].update(
        fingerprint="0"
    ),
    "array dropped from the record": lambda m: m["attributes"]["cacheflow"]["arrays"].update(
        gone={}
    ),
}


@pytest.mark.parametrize("edit", sorted(ROOT_EDITS))
def test_edited_root_metadata_or_manifest_is_refused(tmp_path: Path, edit: str) -> None:
    cfj.write_store(_arrays(5), tmp_path / "s", chunk_bytes=128)
    root = tmp_path / "s" / "zarr.json"
    if ROOT_EDITS[edit] is None:
        root.write_text(root.read_text()[:-7])
    else:
        _edit_json(root, ROOT_EDITS[edit])
    with pytest.raises(StoreError) as exc:
        cfj.open_store(tmp_path / "s")
    assert str(tmp_path / "s") in str(exc.value)
    record("zarr.json edited (root)", injected=1, detected=1)


@pytest.mark.parametrize("damage", ["deleted", "truncated", "edited"])
def test_damaged_chunk_manifest_is_refused(tmp_path: Path, damage: str) -> None:
    cfj.write_store(_arrays(6), tmp_path / "s", chunk_bytes=128)
    manifest = tmp_path / "s" / "cacheflow_manifest.json"
    if damage == "deleted":
        manifest.unlink()
    elif damage == "truncated":
        manifest.write_bytes(manifest.read_bytes()[:-10])
    else:
        doc = json.loads(manifest.read_text())
        doc["arrays"]["w"][0] ^= 1
        manifest.write_text(json.dumps(doc, separators=(",", ":")))
    with pytest.raises(StoreError, match="manifest") as exc:
        cfj.open_store(tmp_path / "s")
    assert str(manifest) in str(exc.value)
    record("chunk manifest damaged", injected=1, detected=1)


# --------------------------------------------------------------------------------------------
# write_store never destroys what it should not


def test_overwrite_refuses_a_directory_that_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a store written by write_store") as exc:
        cfj.write_store({"w": np.ones(4)}, tmp_path / "d", overwrite=True)
    assert str(tmp_path / "d") in str(exc.value)
    assert (tmp_path / "d" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["notes.txt"]
    record("write_store overwrite of a user directory", injected=1, detected=1)


def test_overwrite_with_a_bad_leaf_keeps_the_old_store(tmp_path: Path) -> None:
    old = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    cfj.write_store(old, tmp_path / "s", chunk_bytes=16)
    before = {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file()}
    for bad in ({"_runtime": {"x": np.ones(3)}}, {"a/b": np.ones(3)}, {"s": np.array(["x"])}):
        with pytest.raises(ValueError):
            cfj.write_store(bad, tmp_path / "s", overwrite=True)
        record("write_store overwrite with a bad leaf", injected=1, detected=1)
    after = {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file()}
    assert after == before
    store = cfj.open_store(tmp_path / "s")
    assert same_bits(np.asarray(_cache(store).get("w@0,0")), old["w"][:1])


def test_runtime_leaf_name_is_refused_not_dropped(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved for runtime blocks"):
        cfj.write_store({"_runtime": {"x": np.ones(3)}, "w": np.ones(2)}, tmp_path / "s")
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def test_overwrite_that_fails_midway_keeps_the_old_store(tmp_path: Path) -> None:
    # The new store is staged beside the old one; a failure while writing it (here a leaf whose
    # conversion raises after the others were written) leaves the old store whole.
    old = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    cfj.write_store(old, tmp_path / "s", chunk_bytes=16)

    class Exploding:
        shape, dtype, ndim = (3,), np.dtype(np.float64), 1

        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("the source went away")

    with pytest.raises(RuntimeError, match="went away"):
        cfj.write_store({"w": np.ones(8), "x": Exploding()}, tmp_path / "s", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    assert same_bits(np.asarray(_cache(cfj.open_store(tmp_path / "s")).get("w@0,0")), old["w"][:1])
    record("write_store overwrite failing midway", injected=1, detected=1)


# --------------------------------------------------------------------------------------------
# Orbax checkpoints


@pytest.fixture
def orbax_ckpt(tmp_path: Path) -> tuple[Path, dict]:
    tree = {
        "layers": [{"w": np.arange(32.0, dtype=np.float32).reshape(4, 8)}],
        "b": np.zeros(8, np.float32),
    }
    path = tmp_path / "ckpt"
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path, tree)
    ckpt.wait_until_finished()
    return path, tree


def test_orbax_deleted_manifest_is_an_error(orbax_ckpt: tuple[Path, dict]) -> None:
    path, _ = orbax_ckpt
    (path / "manifest.ocdbt").unlink()
    with pytest.raises(StoreError, match="manifest.ocdbt is missing") as exc:
        cfj.orbax.restore_lazy(path, device_bytes=MiB, host_bytes=MiB)
    assert str(path) in str(exc.value)
    record("orbax manifest.ocdbt deleted", injected=1, detected=1)


def test_orbax_leaf_missing_from_metadata_listing_is_an_error(
    orbax_ckpt: tuple[Path, dict],
) -> None:
    path, _ = orbax_ckpt
    meta = json.loads((path / "_METADATA").read_text())
    entry = next(iter(meta["tree_metadata"].values()))
    entry["key_metadata"] = [{"key": "ghost", "key_type": 2}]
    meta["tree_metadata"]["('ghost',)"] = entry
    (path / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="'ghost'"):
        cfj.open_store(path)
    record("orbax _METADATA lists a leaf that is not stored", injected=1, detected=1)


def test_orbax_reads_match_orbax_after_reopen(orbax_ckpt: tuple[Path, dict]) -> None:
    # The strict read mode (missing chunk = error) still restores a healthy checkpoint exactly,
    # including an all-zero leaf (orbax stores its chunk too).
    path, tree = orbax_ckpt
    lazy = cfj.orbax.restore_lazy(path, device_bytes=MiB, host_bytes=MiB)
    got = cfj.orbax.materialize(lazy)
    assert same_bits(np.asarray(got["b"]), tree["b"])
    assert same_bits(np.asarray(got["layers"][0]["w"]), tree["layers"][0]["w"])
