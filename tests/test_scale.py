"""Beyond one process (issue 28): a shared runtime store on a real S3 server (moto on loopback),
real serving processes, and a real ``jax.distributed`` job of 2 CPU processes.

The multi-process cases run ``bench._scale_worker`` (the processes of ``python -m bench.scale``)
at a small size; ``CACHEFLOW_SCALE_FULL=1`` runs them at the issue's size (1,000 keys, 20
kills), as the benchmark does.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import cacheflow_jax as cfj
from bench import scale
from bench._scale_worker import block_value, same_block
from cacheflow_jax.store.runtime_format import encode_runtime, publish_file, same_value
from cacheflow_jax.store.shared import trim_runtime

FULL = os.environ.get("CACHEFLOW_SCALE_FULL") == "1"
MiB = 2**20


def _url(s3: Any, name: str) -> str:
    return f"s3://{s3.bucket}/{name}-{uuid.uuid4().hex[:8]}"


def _kw(s3: Any) -> dict[str, Any]:
    return {"s3_endpoint": s3.endpoint, "s3_region": s3.region}


def _cache(store: Any) -> cfj.TieredCache:
    return cfj.TieredCache(store, device_bytes=MiB, host_bytes=MiB, l3_timeout=30)


def _bits(x: Any) -> bytes:
    return np.asarray(x).tobytes()


# -------------------------------------------------------------------------- the file format


def test_same_value_ignores_who_published_and_when() -> None:
    x = np.arange(6, dtype=np.float32)
    a = encode_runtime(x, published=1.0)
    b = encode_runtime(x, published=2.0)
    assert a != b and same_value(a, b)
    assert not same_value(a, encode_runtime(x + 1, published=1.0))
    assert not same_value(a, encode_runtime(x.reshape(2, 3), published=1.0))
    assert not same_value(a, a[:-1])  # a torn copy holds no value


def test_publish_file_creates_once_and_leaves_no_temporaries(tmp_path: Path) -> None:
    path = str(tmp_path / "_runtime" / "k.block")
    assert publish_file(path, b"first")
    assert not publish_file(path, b"second")
    assert Path(path).read_bytes() == b"first"
    assert [p.name for p in (tmp_path / "_runtime").iterdir()] == ["k.block"]


# ------------------------------------------------------------------- discovery and conflicts


@pytest.mark.s3
@pytest.mark.parametrize("many_writers", [True, False], ids=["immutable", "default"])
def test_discover_a_block_put_after_the_reader_opened(s3_server: Any, many_writers: bool) -> None:
    """B opened before A's put gets A's bytes with no reopen (a store that is not shared too)."""
    url = _url(s3_server, "discover")
    a = _cache(cfj.open_store(url, create=True, shared=many_writers, **_kw(s3_server)))
    b = _cache(cfj.open_store(url, create=True, shared=many_writers, **_kw(s3_server)))
    keys = cfj.prefix_keys(list(range(64)), block_tokens=16, salt="test-model")
    blocks = [block_value(k, 2048) for k in keys]
    for key, block in zip(keys[:3], blocks):
        a.put(key, block)
    a.flush()
    assert b.cached_prefix(keys) == 3
    assert b.locate(keys[1]) == "store" and b.locate(keys[3]) is None
    assert not b.contains(keys[0])  # found in L3, not resident
    got, missing = b.get_found(keys)
    assert missing == keys[3:]
    assert all(same_block(got[k], v) for k, v in zip(keys[:3], blocks))
    assert same_block(b.get(keys[2]), blocks[2])
    assert b.contains(keys[2])


@pytest.mark.s3
def test_a_lookup_that_missed_is_asked_again_after_lookup_ttl(s3_server: Any) -> None:
    url = _url(s3_server, "ttl")
    a = cfj.open_store(url, create=True, shared=True, **_kw(s3_server))
    b = _cache(cfj.open_store(url, create=True, shared=True, lookup_ttl=0.2, **_kw(s3_server)))
    assert b.locate("kv:late") is None
    a.write("kv:late", np.ones(4, np.int32)).result()
    assert b.locate("kv:late") is None  # remembered: no request to the store
    time.sleep(0.25)  # lookup_ttl passes
    assert b.locate("kv:late") == "store"
    assert _bits(b.get("kv:late")) == _bits(np.ones(4, np.int32))


@pytest.mark.s3
def test_different_bytes_under_one_key_conflict_and_the_caches_agree(s3_server: Any) -> None:
    url = _url(s3_server, "conflict")
    a = _cache(cfj.open_store(url, create=True, shared=True, **_kw(s3_server)))
    b = _cache(cfj.open_store(url, create=True, shared=True, **_kw(s3_server)))
    first, other = np.arange(1024, dtype=np.float32), np.zeros(3000, np.float32)
    a.put("kv:x", first)
    b.put("kv:x", other)  # B's value has another shape and size too
    b.put("kv:same", first)
    a.put("kv:same", first)
    a.flush()
    with pytest.raises(cfj.ConflictError, match=r"'kv:x'.*already holds other bytes.*salt"):
        b.flush()
    b.flush()  # raised once
    assert b.stats()["writebacks"]["conflicts"] == 1
    for cache in (a, b):  # both serve the published block, with its size in the budgets
        assert _bits(cache.get("kv:x")) == _bits(first)
        assert cache.info("kv:x").nbytes == first.nbytes
        assert _bits(cache.get("kv:same")) == _bits(first)
        cache.check_budgets()
    assert a.stats()["writebacks"]["conflicts"] == 0


def test_conflict_in_a_shared_local_store(tmp_path: Path) -> None:
    a = _cache(cfj.open_store(tmp_path, create=True, shared=True))
    b = _cache(cfj.open_store(tmp_path, create=True, shared=True))
    a.put("kv:y", {"k": np.ones(8, np.int8)})
    a.flush()
    b.put("kv:y", {"k": np.full(8, 2, np.int8)})
    with pytest.raises(cfj.ConflictError, match="kv:y"):
        b.flush()
    assert _bits(b.get("kv:y")["k"]) == _bits(np.ones(8, np.int8))
    assert sorted(p.name for p in (tmp_path / "_runtime").iterdir()) == ["kv%3Ay.block"]


def test_a_block_replaced_with_another_shape_is_refused_not_served(tmp_path: Path) -> None:
    """Stores that are not shared: a block another writer replaced since its header was read is
    an error, never a block of another size than the budgets counted."""
    a = cfj.open_store(tmp_path, create=True)
    a.write("kv:z", np.ones(1024, np.float32)).result()
    b = _cache(cfj.open_store(tmp_path))
    assert b.info("kv:z").nbytes == 4096
    a.write("kv:z", np.ones(3000, np.float32)).result()
    with pytest.raises(cfj.StoreError, match=r"'kv:z'.*replaced.*\(3000,\)"):
        b.get("kv:z")
    assert b.stats()["tiers"]["device"]["used"] == 0
    assert b.get("kv:z").shape == (3000,)  # the header is read again
    b.check_budgets()


# ----------------------------------------------------------------- overwrite, republish, bound


@pytest.mark.s3
def test_overwrite_on_s3_keeps_the_runtime_blocks(s3_server: Any) -> None:
    url = _url(s3_server, "overwrite")
    cfj.write_store({"w": np.zeros((4, 4), np.float32)}, url, **_kw(s3_server))
    reader = _cache(cfj.open_store(url, shared=True, **_kw(s3_server)))
    reader.put("kv:keep", np.arange(8, dtype=np.int32))
    reader.flush()
    cfj.write_store({"w": np.ones((4, 4), np.float32)}, url, overwrite=True, **_kw(s3_server))
    assert _bits(reader.get("kv:keep")) == _bits(np.arange(8, dtype=np.int32))
    again = cfj.open_store(url, **_kw(s3_server))
    assert "kv:keep" in again.keys()
    assert _bits(again.read("w@0,0").result()) == _bits(np.ones((4, 4), np.float32))


def test_overwrite_of_a_local_store_keeps_the_runtime_blocks(tmp_path: Path) -> None:
    store = cfj.write_store({"w": np.zeros(4, np.float32)}, tmp_path / "s")
    store.write("kv:keep", np.arange(3, dtype=np.int8)).result()
    cfj.write_store({"w": np.ones(4, np.float32)}, tmp_path / "s", overwrite=True)
    again = cfj.open_store(tmp_path / "s")
    assert _bits(again.read("kv:keep").result()) == _bits(np.arange(3, dtype=np.int8))
    assert [p.name for p in tmp_path.iterdir()] == ["s"]


@pytest.mark.s3
def test_republish_weights_to_a_new_prefix_while_a_reader_serves(s3_server: Any) -> None:
    """v2 goes to a new versioned prefix and a pointer moves; a reader of v1 keeps serving with
    no error, and v1 and the shared runtime blocks stay."""
    import boto3

    base, kw = _url(s3_server, "model"), _kw(s3_server)
    bucket, _, prefix = base[len("s3://") :].partition("/")
    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name=s3_server.region)
    v1 = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
    cfj.write_store(v1, f"{base}/v1", chunk_bytes=64, **kw)
    client.put_object(Bucket=bucket, Key=f"{prefix}/LATEST", Body=b"v1")
    runtime = f"{base}/kv"
    reader = _cache(cfj.open_store(f"{base}/v1", runtime=runtime, shared=True, **kw))
    reader.put("kv:r", np.ones(5, np.int16))
    reader.flush()
    errors, served, stop = [], [0], threading.Event()

    def serve() -> None:
        keys = list(reader.store.keys())
        while not stop.is_set():
            for key in keys:
                try:
                    reader.evict(key)
                    reader.get(key)
                    served[0] += 1
                except Exception as err:  # any error fails the test below
                    errors.append(repr(err))

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        cfj.write_store({"w": -v1["w"]}, f"{base}/v2", chunk_bytes=64, **kw)
        client.put_object(Bucket=bucket, Key=f"{prefix}/LATEST", Body=b"v2")
    finally:
        stop.set()
        thread.join()
    assert errors == [] and served[0] > 0
    latest = client.get_object(Bucket=bucket, Key=f"{prefix}/LATEST")["Body"].read().decode()
    new = cfj.open_store(f"{base}/{latest}", runtime=runtime, shared=True, **kw)
    assert _bits(new.read("w@0,0").result()) == _bits(-v1["w"][:2])
    assert _bits(new.read("kv:r").result()) == _bits(np.ones(5, np.int16))
    old = cfj.open_store(f"{base}/v1", **kw)
    assert _bits(old.read("w@0,0").result()) == _bits(v1["w"][:2])


@pytest.mark.s3
def test_trim_runtime_removes_the_oldest_blocks_down_to_max_bytes(s3_server: Any) -> None:
    url, kw = _url(s3_server, "trim"), _kw(s3_server)
    store = cfj.open_store(url, create=True, shared=True, **kw)
    reader = _cache(cfj.open_store(url, create=True, shared=True, **kw))
    for i in range(6):
        store.write(f"kv:{i}", np.full(1000, i, np.uint8)).result()
    assert reader.cached_prefix([f"kv:{i}" for i in range(6)]) == 6  # found before the trim
    size = trim_runtime(store, max_bytes=0, dry_run=True)["bytes"] // 6
    report = trim_runtime(store, max_bytes=3 * size)
    assert report == {"blocks": 6, "bytes": 6 * size, "removed": 3, "removed_bytes": 3 * size,
                      "damaged": 0}  # fmt: skip
    assert trim_runtime(store, max_bytes=3 * size)["removed"] == 0
    # A block removed under a reader that had found it is a KeyError naming it (as for a key
    # that vanished between the lookup and the read), never zeros; then it is a miss.
    for _ in range(4):
        try:
            got, missing = reader.get_found([f"kv:{i}" for i in range(6)])
            break
        except KeyError as err:
            assert "is no longer in shared store" in str(err)
    assert missing == ["kv:0", "kv:1", "kv:2"]
    assert all(_bits(got[f"kv:{i}"]) == _bits(np.full(1000, i, np.uint8)) for i in (3, 4, 5))
    with pytest.raises(ValueError, match="shared=True"):
        trim_runtime(cfj.open_store(url, **kw), max_bytes=0)


# ---------------------------------------------------------------------------- many processes


@pytest.mark.s3
@pytest.mark.slow
def test_processes_share_kv_blocks_through_s3(s3_server: Any, tmp_path: Path) -> None:
    """2 serving processes: each reads the other's blocks bitwise without reopening; both put
    the same keys concurrently (0 wrong, 0 lost, 0 conflicts); one key published 2 x ``race``
    times while read gives no torn read and one object."""
    import boto3

    own, same, race = (200, 1000, 200) if FULL else (30, 150, 60)
    url = _url(s3_server, "kv")
    results = scale.run_kv(
        2, url, tmp_path, endpoint=s3_server.endpoint, own=own, same=same, race=race
    )
    s = scale.summarize_kv(results)
    assert s["found_from_others"] == s["expected_from_others"] == 2 * own, results
    assert (s["wrong_bytes"], s["lost"], s["errors"], s["conflicts"]) == (0, 0, 0, 0), results
    assert (s["race_torn_reads"], s["race_errors"]) == (0, 0), results
    bucket, _, prefix = url[len("s3://") :].partition("/")
    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name=s3_server.region)
    names = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for o in page.get("Contents", [])
    ]
    assert len(names) == 2 * own + same + 1  # one object per key, nothing else


@pytest.mark.s3
@pytest.mark.slow
def test_a_sigkilled_writer_leaves_no_torn_block(s3_server: Any, tmp_path: Path) -> None:
    kills = 20 if FULL else 4
    result = scale.run_kills(
        _url(s3_server, "kills"), tmp_path, endpoint=s3_server.endpoint, kills=kills
    )
    assert result["blocks_checked"] > 0, result
    assert (result["torn_blocks"], result["wrong_blocks"]) == (0, 0), result
    assert result["kills_during_a_write"] >= kills // 2, result


@pytest.mark.slow
def test_multihost_restore_reads_only_the_addressable_shards(tmp_path: Path) -> None:
    """2 ``jax.distributed`` CPU processes: ``materialize`` equals orbax's restore shard by shard,
    each process reads about half the checkpoint (<= 1.05x orbax's own bytes), a jitted sum of
    orbax's and cacheflow's arrays runs, and the cache's L1 device is the process's own."""
    results = scale.run_restore(2, 256 if FULL else 128, tmp_path)
    s = scale.summarize_restore(results)
    assert s["outputs_equal_orbax"] and s["jit_ok"] and s["l1_local"], results
    assert s["read_share_max"] <= 0.6, results
    assert s["vs_orbax_max"] <= 1.05, results
    assert len({r["l1_device"] for r in results}) == 2, results


def test_materialize_with_a_sharding_puts_leaves_there(tmp_path: Path) -> None:
    """One process: a target sharding and ``sharding=`` both give arrays with that sharding."""
    import orbax.checkpoint as ocp

    w = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"w": w, "b": w[0]})
    checkpointer.wait_until_finished()
    mesh = jax.make_mesh((1,), ("x",), devices=jax.local_devices()[:1])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding),
              "b": jax.ShapeDtypeStruct((8,), w.dtype)}  # fmt: skip
    tree = cfj.restore_lazy(tmp_path / "ckpt", target=target, device_bytes=MiB, host_bytes=0)
    assert tree["w"].sharding == sharding and tree["b"].target_sharding is None
    out = cfj.materialize(tree)
    assert out["w"].sharding == sharding and _bits(out["w"]) == _bits(w)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    given = cfj.materialize(tree, sharding={"w": None, "b": replicated})
    assert given["b"].sharding == replicated and given["w"].sharding == sharding
    assert _bits(given["b"]) == _bits(w[0])
    with pytest.raises(ValueError, match="structure"):
        cfj.materialize(tree, sharding=[sharding, sharding, sharding])
    with pytest.raises(TypeError, match="jax.sharding.Sharding"):
        cfj.materialize(tree, sharding={"w": "x", "b": None})
