"""The fault suite (issue 9): faults injected for real, counted per fault.

Every test injects real faults (files deleted, truncated, swapped or bit-flipped; metadata edited;
a real S3 server killed or stopped; a writer process killed; a full file system; bad keys and
values) and checks the project's first promise: no wrong byte is ever served, and nothing reported
durable is lost. Each records its counts in ``_faults``; the run prints them as a table.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from _faults import record

import cacheflow_jax as cfj
from cacheflow_jax.core.blocks import StoreError

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


# --------------------------------------------------------------------------------------------
# Bad keys and bad values at put and get


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def _runtime_cache(tmp_path: Path, **kw) -> cfj.TieredCache:
    store = cfj.open_store(tmp_path / "rt", create=True)
    return cfj.TieredCache(store, device_bytes=kw.pop("device_bytes", 64 << 10),
                           host_bytes=kw.pop("host_bytes", 64 << 10), **kw)  # fmt: skip


BAD_GET_KEYS = [123, None, b"w@0,0", ("w", 0), 1.5]


def test_get_with_a_key_that_is_not_a_str_names_its_type(tmp_path: Path) -> None:
    cache = _cache(cfj.write_store(_arrays(7), tmp_path / "s", chunk_bytes=128))
    for key in BAD_GET_KEYS:
        with pytest.raises(TypeError, match=f"block keys are str; got {type(key).__name__}"):
            cache.get(key)
        with pytest.raises(TypeError, match="block keys are str"):
            cache.get_many(["w@0,0", key])
    with pytest.raises(KeyError, match=r"'typo'.*cacheflow inspect"):
        cache.get("typo")
    record("bad key at get", injected=2 * len(BAD_GET_KEYS) + 1, detected=2 * len(BAD_GET_KEYS) + 1)
    cache.check_budgets()


BAD_PUT_KEYS = {
    "empty": ("", ValueError, "empty key"),
    "chunk key": ("w@0,0", ValueError, "read-only"),
    "300 characters": ("k" * 300, ValueError, "too long"),
    "lone surrogate": ("kv:\ud800", ValueError, "not valid UTF-8"),
    "not a str": (42, TypeError, "block keys are str"),
}
BAD_VALUES = {
    "str array": (np.array(["a", "b"]), TypeError, "not a numeric"),
    "object": (object(), TypeError, "not a numeric"),
    "int64 array": (np.array([2**40 + 7], np.int64), cfj.DtypeError, "int64.*narrow to int32"),
    "float64 array": (np.ones(3), cfj.DtypeError, "float64.*narrow to float32"),
    "uint64 array": (np.array([2**63], np.uint64), cfj.DtypeError, "uint64"),
    "complex128 array": (np.ones(2, np.complex128), cfj.DtypeError, "complex128"),
    "float64 scalar": (np.float64(2.0), cfj.DtypeError, "float64"),
}


def test_bad_keys_and_values_at_put_change_nothing(tmp_path: Path) -> None:
    cache = _runtime_cache(tmp_path)
    cache.put("kv:good", np.arange(4, dtype=np.int32))
    cache.flush()
    before = sorted(p.name for p in (tmp_path / "rt" / "_runtime").iterdir())
    for name, (key, error, match) in BAD_PUT_KEYS.items():
        with pytest.raises(error, match=match):
            cache.put(key, np.ones(3, np.float32))
        record("bad key at put", injected=1, detected=1)
        del name
    for name, (value, error, match) in BAD_VALUES.items():
        with pytest.raises(error, match=match):
            cache.put("kv:bad", value)
        record("bad value at put", injected=1, detected=1)
        del name
    cache.flush()  # nothing half-stored fails the flush
    assert sorted(p.name for p in (tmp_path / "rt" / "_runtime").iterdir()) == before
    assert cache.stats()["tiers"]["device"]["blocks"] == 1
    # Python numbers and lists have no dtype: they get JAX's default one, as with jnp.asarray.
    cache.put("kv:list", [1, 2, 3])
    assert np.asarray(cache.get("kv:list")).dtype == np.int32
    cache.check_budgets()


def test_64_bit_blocks_are_exact_or_refused_never_narrowed(tmp_path: Path) -> None:
    big = np.array([2**40 + 7, -(2**62)], np.int64)
    store = cfj.write_store({"i": big, "f": np.array([1 + 2**-40], np.float64)}, tmp_path / "s")
    cache = _cache(store)
    for key in ("i@0", "f@0"):
        with pytest.raises(cfj.DtypeError, match=f"'{key}'.*jax_enable_x64"):
            cache.get(key)
        assert cache.tier_of(key) is None
    record("64-bit block with x64 off", injected=2, detected=2)
    with jax.enable_x64(True):
        assert same_bits(np.asarray(cache.get("i@0")), big)
        c = _runtime_cache(tmp_path)
        c.put("kv:i", big)
        assert c.evict("kv:i")
        c.flush()
        assert same_bits(np.asarray(c.get("kv:i")), big)
    assert same_bits(cfj.open_store(tmp_path / "rt").read("kv:i").result(), big)  # L3 holds int64


# --------------------------------------------------------------------------------------------
# Write-backs: TTL, serving() errors


def test_ttl_expired_dirty_block_is_written_back_while_only_hits_happen(tmp_path: Path) -> None:
    clock = FakeClock()
    cache = _runtime_cache(tmp_path, policy=cfj.lru(ttl=10.0), clock=clock, read_buffer=4)
    cache.put("kv:hot", np.ones(4, np.float32))
    cache.put("kv:old", np.full(4, 7, np.float32))
    cache.flush()  # both durable; now make kv:old dirty again and let it expire
    cache.put("kv:old", np.full(4, 8, np.float32))
    for _ in range(5):
        clock.tick(3.0)
        for _ in range(8):
            cache.get("kv:hot")  # hits only (they keep kv:hot fresh), seen in batches of 4
    assert cache.tier_of("kv:old") is None  # expired
    cache.wait_until_finished(timeout=10)  # waits for writes in flight; starts none
    assert same_bits(
        cfj.open_store(tmp_path / "rt").read("kv:old").result(), np.full(4, 8, np.float32)
    )


def test_serving_keeps_the_bodys_exception_when_the_flush_fails(tmp_path: Path) -> None:
    cache = _runtime_cache(tmp_path, l3_timeout=5.0)
    runtime = tmp_path / "rt" / "_runtime"
    runtime.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(runtime)
    runtime.write_text("not a directory")  # every write-back now fails
    with pytest.raises(ValueError, match="the body's own error") as exc, cfj.serving(cache) as s:
        s.put("kv:x", np.ones(4, np.float32))
        raise ValueError("the body's own error")
    notes = "\n".join(getattr(exc.value, "__notes__", []))
    assert "while leaving serving()" in notes and "kv:x" in notes
    with pytest.raises(StoreError, match="kv:x"), cfj.serving(cache):
        pass  # no error in the body: the flush error is raised itself
    runtime.unlink()
    cache.flush()  # the block stayed in memory and is written now
    assert same_bits(cfj.open_store(tmp_path / "rt").read("kv:x").result(), np.ones(4, np.float32))
    record("write-back failing at session exit", injected=2, detected=2)


# --------------------------------------------------------------------------------------------
# The access log


def test_a_bad_key_does_not_stop_the_access_log(tmp_path: Path) -> None:
    store = cfj.write_store({"w": np.ones((4, 4), np.float32)}, tmp_path / "s", chunk_bytes=16)
    log = tmp_path / "access.jsonl"
    with cfj.serving(_cache(store), access_log=log) as s:
        with pytest.raises(KeyError, match="typo"):
            s.get("typo")
        for i in range(2000):
            s.get(f"w@{i % 4},0")
    lines = log.read_text().splitlines()
    assert len(lines) == 2000 and all(json.loads(x)["key"].startswith("w@") for x in lines)
    record("bad key in a logged session", injected=1, detected=1)


def test_access_log_skips_and_counts_records_it_cannot_describe(tmp_path: Path) -> None:
    from cacheflow_jax.trace.writer import AccessLogWriter

    def describe(key: str) -> tuple[int, str]:
        if key.startswith("gone"):
            raise KeyError(key)
        return 4, "kv"

    writer = AccessLogWriter(tmp_path / "a.jsonl", describe=describe)
    for i in range(1000):
        writer.record("gone:1" if i == 10 else f"kv:{i}")
    with pytest.warns(RuntimeWarning, match=r"1 records skipped.*'gone:1'"):
        writer.close()
    assert writer.records == 999 and writer.skipped == 1
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 999


def test_access_log_memory_is_bounded_and_drops_are_counted(tmp_path: Path) -> None:
    import threading

    from cacheflow_jax.trace.writer import AccessLogWriter

    gate = threading.Event()

    def slow_describe(key: str) -> tuple[int, str]:
        gate.wait()  # the writer is stuck until the test lets it go
        return 4, "kv"

    writer = AccessLogWriter(tmp_path / "a.jsonl", describe=slow_describe, max_pending=100)
    writer.record("kv:first")
    for i in range(10_000):
        writer.record(f"kv:{i}")
        writer.record_many([f"kv:m{i}"])
    assert len(writer._pending) <= 100
    gate.set()
    with pytest.warns(RuntimeWarning, match="dropped"):
        writer.close()
    assert writer.dropped >= 19_000 and writer.records + writer.dropped == 20_001
    record("access log writer stuck", injected=1, detected=1)


def test_access_log_on_a_full_device_reports_the_lost_records(tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("this machine has no /dev/full")
    store = cfj.write_store({"w": np.ones((4, 4), np.float32)}, tmp_path / "s", chunk_bytes=16)
    lost = r"could not write access log /dev/full: \d+ records lost"
    with (
        pytest.raises(OSError, match=lost),
        cfj.serving(_cache(store), access_log="/dev/full") as s,
    ):
        for _ in range(100):
            s.get("w@0,0")
    record("access log device full", injected=1, detected=1)


# --------------------------------------------------------------------------------------------
# A real S3 server (moto_server on loopback) stopped, killed, or losing its bucket


class _PrivateS3:
    """A moto_server of this test's own, so that it can be stopped and killed."""

    def __init__(self) -> None:
        import subprocess
        import tempfile

        from conftest import _S3_ENV, _free_port, _moto_server, _wait_for_port

        self._saved_env = {k: os.environ.get(k) for k in _S3_ENV}
        os.environ.update(_S3_ENV)
        self.port = _free_port()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [_moto_server(), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        _wait_for_port(self.proc, self.port, self._log)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.kw = {"s3_endpoint": self.endpoint, "s3_region": "us-east-1"}
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        self._log.close()
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def private_s3():
    server = _PrivateS3()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.s3
def test_s3_outage_fails_misses_within_the_deadline_while_hits_keep_serving(private_s3) -> None:
    import signal
    import time

    s3 = private_s3
    s3.client.create_bucket(Bucket="outage")
    arrays = _arrays(8)
    url = "s3://outage/store"
    store = cfj.write_store(arrays, url, chunk_bytes=512, **s3.kw)
    expected = _expected(store, arrays)
    deadline = 2.0
    cache = cfj.TieredCache(
        cfj.open_store(url, timeout=10, **s3.kw),
        device_bytes=MiB,
        host_bytes=MiB,
        l3_timeout=deadline,
    )
    keys = sorted(expected)
    warm, cold = keys[: len(keys) // 2], keys[len(keys) // 2 :]
    for key in warm:
        assert same_bits(np.asarray(cache.get(key)), expected[key])
    for mode, sig in (("stopped", signal.SIGSTOP), ("killed", signal.SIGKILL)):
        s3.signal(sig)
        misses = cold[:2] if mode == "stopped" else cold[2:4]
        for key in misses:
            t0 = time.monotonic()
            with pytest.raises(StoreError, match=rf"{key!r}.*{url}"):
                cache.get(key)
            elapsed = time.monotonic() - t0
            assert elapsed < 2 * deadline, f"{mode}: the miss took {elapsed:.1f} s"
            assert cache.tier_of(key) is None
        for key in warm:  # L1/L2 hits keep serving, exactly
            assert same_bits(np.asarray(cache.get(key)), expected[key])
        record(f"S3 server {mode} during misses", injected=len(misses), detected=len(misses))
        if mode == "stopped":
            s3.signal(signal.SIGCONT)
            for key in misses:  # the server is back: the same misses now succeed
                assert same_bits(np.asarray(cache.get(key)), expected[key])
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="outage"):
        cfj.open_store(url, timeout=deadline, **s3.kw)
    assert time.monotonic() - t0 < 2 * deadline
    record("S3 server dead at open", injected=1, detected=1)
    cache.check_budgets()


@pytest.mark.s3
def test_s3_open_of_a_stopped_server_fails_within_its_timeout(private_s3) -> None:
    import signal
    import time

    s3 = private_s3
    s3.client.create_bucket(Bucket="stopped-open")
    cfj.write_store({"w": np.ones(8, np.float32)}, "s3://stopped-open/s", **s3.kw)
    s3.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(cfj.StoreTimeoutError, match="no answer within 1.5 s"):
        cfj.open_store("s3://stopped-open/s", timeout=1.5, **s3.kw)
    assert time.monotonic() - t0 < 3.0
    s3.signal(signal.SIGCONT)
    record("S3 server stopped at open", injected=1, detected=1)


@pytest.mark.s3
def test_s3_missing_objects_and_bucket_are_errors_not_zeros(private_s3) -> None:
    s3 = private_s3
    s3.client.create_bucket(Bucket="vanishing")
    arrays = _arrays(9)
    url = "s3://vanishing/store"
    store = cfj.write_store(arrays, url, chunk_bytes=512, **s3.kw)
    expected = _expected(store, arrays)
    s3.client.delete_object(Bucket="vanishing", Key="store/w/c/1/0")
    s3.client.delete_object(Bucket="vanishing", Key="store/mask/c/0/0")
    cache = cfj.TieredCache(cfj.open_store(url, **s3.kw), device_bytes=MiB, host_bytes=MiB)
    _serve_all("chunk object deleted (S3)", cache, expected, {"w@1,0", "mask@0,0"})
    # The whole bucket gone: every miss is an error, none is served as the fill value.
    objects = s3.client.list_objects_v2(Bucket="vanishing").get("Contents", [])
    for obj in objects:
        s3.client.delete_object(Bucket="vanishing", Key=obj["Key"])
    s3.client.delete_bucket(Bucket="vanishing")
    misses = {k: v for k, v in expected.items() if cache.tier_of(k) is None}
    assert misses
    _serve_all("S3 bucket deleted", cache, misses, set(misses))


@pytest.mark.s3
def test_flush_does_not_raise_a_stale_error_after_a_successful_retry(private_s3) -> None:
    s3 = private_s3
    s3.client.create_bucket(Bucket="retry")
    url = "s3://retry/rt"
    cache = cfj.TieredCache(
        cfj.open_store(url, create=True, **s3.kw), device_bytes=MiB, host_bytes=0, l3_timeout=5
    )
    cache.put("kv:a", np.arange(16, dtype=np.int32))
    s3.client.delete_bucket(Bucket="retry")
    with pytest.raises(StoreError, match="kv:a"):
        cache.flush()
    s3.client.create_bucket(Bucket="retry")
    cache.flush()  # the retry succeeds: no stale NoSuchBucket from the first attempt
    cache.check_for_errors()
    assert same_bits(
        cfj.open_store(url, **s3.kw).read("kv:a").result(), np.arange(16, dtype=np.int32)
    )
    record("S3 bucket missing during write-back", injected=1, detected=1)


# --------------------------------------------------------------------------------------------
# A writer killed mid-write-back; a full file system

_WRITER = """
import sys
import numpy as np
import cacheflow_jax as cfj

store = cfj.open_store(sys.argv[1], create=True)
cache = cfj.TieredCache(store, device_bytes=1 << 20, host_bytes=1 << 20)
n, version, once = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "once"
while True:
    version += 1
    for i in range(n):
        # Blocks of 12 keys (up to 256 KiB each) in 2 MiB of L1+L2: puts evict, so write-backs
        # run all the time. Sizes change between versions, so a torn or reused file shows.
        size = 65536 - 8192 * (version % 7)
        block = np.full(size, version * 1000 + i, np.int32)
        # Every other key is a pytree block (per-layer K and V under one key, one file).
        cache.put(f"kv:{i}", block if i % 2 else {"k": [block[: size // 2]], "v": [block[size // 2 :]]})
    cache.flush()
    print(version, flush=True)  # every block of this version is durable now
    if once:
        break
"""


def _size(version: int) -> int:
    return 65536 - 8192 * (version % 7)


def _check_durable(root: Path, n: int, durable: int) -> tuple[int, int]:
    """Reopens the store; returns (blocks read back valid, blocks lost or damaged)."""
    store = cfj.open_store(root)
    ok = lost = 0
    for i in range(n):
        try:
            value = store.read(f"kv:{i}").result(timeout=30)
        except (StoreError, KeyError):
            lost += 1
            continue
        if i % 2 == 0:  # a pytree block: its two halves, whole and of one version
            if not isinstance(value, dict) or set(value) != {"k", "v"}:
                lost += 1
                continue
            value = np.concatenate([value["k"][0], value["v"][0]])
        version, rest = divmod(int(value[0]), 1000)
        whole = value.shape == (_size(version),) and (value == value[0]).all()
        if whole and rest == i and version >= durable:
            ok += 1
        else:
            lost += 1
    return ok, lost


def _writer(root: Path, n: int, start: int, mode: str):
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), str(n), str(start), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_sigkill_during_write_back_loses_no_durable_block(tmp_path: Path) -> None:
    # A writer process is killed (SIGKILL) at random moments while write-backs run, several
    # times over the same store; each later writer writes blocks of other sizes over whatever
    # the killed one left. Every block reported durable must read back whole after each kill,
    # and after a last clean run.
    import signal
    import time

    rng = np.random.default_rng(12)
    root, n, kills = tmp_path / "killed", 12, 6
    lost_total = 0
    for kill in range(kills):
        proc = _writer(root, n, 100 * kill, "loop")
        first = proc.stdout.readline()  # at least one whole version is durable
        assert first.strip(), f"the writer died before its first flush (kill {kill})"
        time.sleep(float(rng.uniform(0.0, 0.4)))
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read().split()
        proc.wait()
        durable = int(rest[-1]) if rest else int(first)
        ok, lost = _check_durable(root, n, durable)
        lost_total += lost
        assert lost == 0 and ok == n, f"kill {kill}: {lost} blocks lost after version {durable}"
    proc = _writer(root, n, 100 * kills + 1, "once")  # smaller blocks than the last run's
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.split()
    ok, lost = _check_durable(root, n, int(out.split()[-1]))
    lost_total += lost
    record("writer SIGKILLed during write-back", injected=kills, detected=kills, lost=lost_total)
    assert lost == 0 and ok == n, f"after the clean run: {lost} blocks lost or damaged"
    assert not [p for p in (root / "_runtime").iterdir() if p.name.endswith(".partial")]


def test_a_killed_writers_leftovers_never_tear_a_later_write(tmp_path: Path) -> None:
    # What a writer killed mid-write leaves behind: TensorStore's file kvstore leaves a
    # "<name>.__lock" file holding a partial block, and reused it untruncated, so a later, smaller
    # write "succeeded" and then failed its CRC; our own writes leave ".<pid>-*.partial" files.
    # Neither may tear a later write, and a dead writer's partial files are cleaned up on open.
    import subprocess
    import sys

    cache = _runtime_cache(tmp_path, device_bytes=1 << 20, host_bytes=0)
    cache.put("kv:0", np.full(10_000, 1, np.int32))
    cache.flush()
    runtime = tmp_path / "rt" / "_runtime"
    (runtime / "kv%3A0.block.__lock").write_bytes(os.urandom(200_000))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (runtime / f".{dead}-x1y2z3.partial").write_bytes(os.urandom(70_000))
    cache.put("kv:0", np.full(100, 2, np.int32))  # a smaller block over the leftovers
    cache.flush()
    reopened = cfj.open_store(tmp_path / "rt")
    assert same_bits(reopened.read("kv:0").result(), np.full(100, 2, np.int32))
    assert not (runtime / f".{dead}-x1y2z3.partial").exists()
    record("a killed writer's partial files", injected=2, detected=2)


def test_temporary_files_of_a_dead_process_with_our_pid_are_never_written_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A write-back's temporary file is ".<pid>-<n>.partial", n counting up in the process. A
    # dead process that had this pid may have left files of those names: each is skipped
    # (created exclusively), never written into, so no leftover bytes end up in a block.
    import itertools

    from cacheflow_jax.store import runtime_format

    cache = _runtime_cache(tmp_path, device_bytes=1 << 20, host_bytes=0)
    cache.put("kv:0", np.full(10, 1, np.int32))
    cache.flush()
    runtime = tmp_path / "rt" / "_runtime"
    monkeypatch.setattr(runtime_format, "_TMP_SEQ", itertools.count())
    junk = {n: os.urandom(70_000) for n in range(3)}
    for n, data in junk.items():
        (runtime / f".{os.getpid()}-{n}.partial").write_bytes(data)
    cache.put("kv:0", np.full(100, 2, np.int32))
    cache.flush()
    reopened = cfj.open_store(tmp_path / "rt")
    assert same_bits(reopened.read("kv:0").result(), np.full(100, 2, np.int32))
    assert all((runtime / f".{os.getpid()}-{n}.partial").read_bytes() == data
               for n, data in junk.items())  # fmt: skip


@contextlib.contextmanager
def _small_fs(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (skips where the machine cannot mount one)."""
    import subprocess

    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a {size} tmpfs here ({done.stderr.strip() or done.returncode}); the "
            "full-disk faults need one (run as root, or in a container allowed to mount)"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_bounds_the_write_back_backlog_and_loses_nothing(tmp_path: Path) -> None:
    import time

    with _small_fs(tmp_path / "fs", "1m") as fs:
        filler = fs / "filler"
        filler.write_bytes(b"\0" * (800 << 10))  # leaves about 200 KiB
        budget = 192 << 10
        cache = cfj.TieredCache(
            cfj.open_store(fs / "s", create=True),
            device_bytes=64 << 10,
            host_bytes=64 << 10,
            writeback_bytes=budget,
            l3_timeout=1.0,
        )
        values: dict[str, np.ndarray] = {}
        refused = None
        t0 = time.monotonic()
        for i in range(64):  # 64 x 16 KiB = 1 MiB of puts onto about 200 KiB of free disk
            value = np.full(4096, i, np.int32)
            try:
                cache.put(f"kv:{i}", value)
            except StoreError as err:
                refused = err
                break
            values[f"kv:{i}"] = value
            # Every block not yet durable (resident or waiting for its write) counts here.
            dirty = cache.stats()["writebacks"]["dirty_bytes"]
            assert dirty <= budget, f"backlog {dirty} > writeback_bytes {budget}"
        assert refused is not None and "writeback_bytes" in str(refused)
        assert "No space left" in str(refused) or "Errno 28" in str(refused)
        assert time.monotonic() - t0 < 30
        filler.unlink()  # space is back: everything acknowledged gets written
        cache.flush()
        store = cfj.open_store(fs / "s")
        lost = sum(not same_bits(store.read(k).result(), v) for k, v in values.items())
        record("disk full during write-back", injected=1, detected=1, lost=lost)
        assert lost == 0
        assert not [p for p in (fs / "s" / "_runtime").iterdir() if p.name.endswith(".partial")]


def test_full_disk_during_write_store_keeps_the_old_store(tmp_path: Path) -> None:
    with _small_fs(tmp_path / "fs", "512k") as fs:
        old = {"w": np.arange(64, dtype=np.float32)}
        cfj.write_store(old, fs / "s", chunk_bytes=64)
        with pytest.raises(StoreError):
            cfj.write_store({"w": np.ones((512, 512), np.float32)}, fs / "s", overwrite=True)
        assert sorted(p.name for p in fs.iterdir()) == ["s"]
        store = cfj.open_store(fs / "s")
        assert same_bits(np.asarray(_cache(store).get("w@1")), old["w"][16:32])
        record("disk full during write_store overwrite", injected=1, detected=1)
