"""``session.lookup(table, ids)``: embedding rows from the device, counters on the device."""

from __future__ import annotations

import gc

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cacheflow_jax as cfj
import pallas_kernels as pk

_urls = iter(range(10**9))


def _url() -> str:
    return f"memory://test-embedding-{next(_urls)}/"


def _zipf_ids(rng, n: int, num_rows: int, shape=None) -> np.ndarray:
    """Zipf-distributed row ids over a random permutation of the rows (hot rows scattered)."""
    perm = rng.permutation(num_rows)
    ids = perm[(rng.zipf(1.1, n) - 1) % num_rows].astype(np.int32)
    return ids if shape is None else ids.reshape(shape)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(["slab", "arrays"]),
    dtype=st.sampled_from([np.float32, jnp.bfloat16, np.int8, np.uint8]),
    row_shape=st.sampled_from([(16,), (6,), (3, 5)]),
    chunk_rows=st.sampled_from([7, 64]),
    split_columns=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_lookup_equals_take_on_the_full_table(
    layout, dtype, row_shape, chunk_rows, split_columns, seed
):
    """Random tables 8x (or more) the L1 budget, Zipf ids in batches of 64, all layouts.

    Chunks hold ``chunk_rows`` rows, and with ``split_columns`` a row is cut across chunks, so
    missing rows are assembled from several blocks. Every lookup, before and after promotions,
    must equal ``jnp.take``.
    """
    rng = np.random.default_rng(seed)
    num_rows = 1500
    raw = rng.integers(
        0, 256, size=num_rows * int(np.prod(row_shape)) * np.dtype(dtype).itemsize, dtype=np.uint8
    )
    table = raw.view(np.dtype(dtype)).reshape((num_rows, *row_shape))
    if np.issubdtype(np.dtype(dtype), np.floating) or np.dtype(dtype) == jnp.bfloat16:
        table[np.isnan(table.astype(np.float32))] = 0.5  # NaN != NaN would hide a mismatch
    row_bytes = table[0].nbytes
    chunk_bytes = chunk_rows * row_bytes // (2 if split_columns else 1)
    store = cfj.write_store({"emb": table}, _url(), chunk_bytes=max(chunk_bytes, 1))
    device_bytes = table.nbytes // 8
    cache = cfj.TieredCache(
        store, device_bytes=device_bytes, host_bytes=table.nbytes // 2, device_layout=layout
    )
    full = jnp.asarray(table)
    with cfj.serving(cache, embedding_bytes=device_bytes // 2, promote_every=4) as s:
        for step in range(14):
            shape = (8, 8) if step % 5 == 4 else (64,)
            ids = jnp.asarray(_zipf_ids(np.random.default_rng(seed + step), 64, num_rows, shape))
            got = s.lookup("emb", ids)
            want = jnp.take(full, ids, axis=0)
            assert got.shape == want.shape and got.dtype == want.dtype
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), step
            cache.check_budgets()
        stats = s.stats()["embedding"]["emb"]
    assert stats["promotions"] == 3 and stats["rows_device"] > 0 and stats["layout"] == layout
    assert cache.stats()["tiers"]["device"]["used"] == 0  # the rows' room was given back


@pytest.mark.parametrize("layout", ["slab", "arrays"])
def test_hot_rows_come_from_the_device_after_a_promotion(layout):
    rng = np.random.default_rng(1)
    table = rng.standard_normal((4096, 32)).astype(np.float32)
    store = cfj.write_store({"emb": table}, _url(), chunk_bytes=64 * 128)
    cache = cfj.TieredCache(
        store, device_bytes=table.nbytes // 8, host_bytes=table.nbytes, device_layout=layout
    )
    hot = rng.choice(4096, 100, replace=False).astype(np.int32)
    with cfj.serving(cache, promote_every=2) as s:
        for part in (hot[:64], hot[36:]):  # every hot row once, then a promotion
            s.lookup("emb", jnp.asarray(part))
        before = s.stats()["embedding"]["emb"]
        ids = jnp.asarray(rng.choice(hot, 64))
        assert np.array_equal(np.asarray(s.lookup("emb", ids)), table[np.asarray(ids)])
        after = s.stats()["embedding"]["emb"]
    assert after["rows_device"] - before["rows_device"] == 64  # all from the device
    assert after["rows_fetched"] == before["rows_fetched"]
    assert after["resident"] == 100 and after["capacity"] >= 100


def test_counters_live_on_the_device_and_match_the_reference():
    rng = np.random.default_rng(2)
    table = rng.standard_normal((1000, 8)).astype(np.float32)
    store = cfj.write_store({"emb": table}, _url(), chunk_bytes=32 * 32)
    cache = cfj.TieredCache(
        store, device_bytes=8 * 1024, host_bytes=64 * 1024, device_layout="slab"
    )
    batches = [_zipf_ids(rng, 64, 1000) for _ in range(10)]
    with cfj.serving(cache, promote_every=4, row_half_life=8.0) as s:
        for ids in batches:
            s.lookup("emb", jnp.asarray(ids))
        rows = s._rows["emb"]
        counters = rows.counters
        assert isinstance(counters, jax.Array) and counters.shape[0] % 256 == 0
        want = jnp.zeros(counters.shape, jnp.float32)
        for ids in batches:
            want = pk.lfu_update_reference(want, jnp.asarray(ids), decay=0.5 ** (1 / 8))
        assert np.asarray(counters).tobytes() == np.asarray(want).tobytes()
        assert s.stats()["embedding"]["emb"]["promotions"] == 2  # lookups 4 and 8, not 10


def test_rows_share_the_l1_budget_and_slab_rows_allocate_nothing():
    rng = np.random.default_rng(3)
    table = rng.standard_normal((2048, 16)).astype(np.float32)  # 128 KiB: 8x L1
    weights = rng.standard_normal((8, 256)).astype(np.float32)
    store = cfj.write_store({"emb": table, "w": weights}, _url(), chunk_bytes=1024)
    cache = cfj.TieredCache(
        store, device_bytes=16 * 1024, host_bytes=256 * 1024, device_layout="slab"
    )
    tier = cache.tiers[0]
    for i in range(8):
        cache.get(f"w@{i},0")
    assert cache.stats()["tiers"]["device"]["blocks"] == 8
    with cfj.serving(cache, embedding_bytes=12 * 1024, promote_every=1) as s:
        s.lookup("emb", jnp.arange(64, dtype=jnp.int32))
        # 12 KiB of L1 went to the rows: blocks were demoted to make room.
        assert tier.used <= tier.budget and cache.stats()["tiers"]["device"]["blocks"] <= 4
        gc.collect()
        base = len(jax.live_arrays())
        pointer = tier.slab.array.unsafe_buffer_pointer()
        for step in range(20):
            out = s.lookup("emb", jnp.asarray(_zipf_ids(rng, 64, 2048)))
            del out
            cache.get(f"w@{step % 8},0")
            cache.check_budgets()
        gc.collect()
        assert len(jax.live_arrays()) == base  # the slab and the counters; rows allocate nothing
        assert tier.slab.array.unsafe_buffer_pointer() == pointer  # rows packed in place
        assert s.stats()["embedding"]["emb"]["rows_promoted"] > 0
    assert tier.used <= 4 * 1024 and len(tier.slab.free) * tier.line_bytes + tier.used == 16384


def test_bad_lookups_are_named():
    store = cfj.write_store({"emb": np.zeros((100, 4), np.float32)}, _url(), chunk_bytes=64)
    cache = cfj.TieredCache(store, device_bytes=1024, host_bytes=0, device_layout="slab")
    with cfj.serving(cache) as s:
        with pytest.raises(KeyError, match="no array 'emb2'.*one of \\['emb'\\]"):
            s.lookup("emb2", jnp.array([1]))
        with pytest.raises(IndexError, match="row id 100 is outside table 'emb' of 100 rows"):
            s.lookup("emb", jnp.array([3, 100]))
        with pytest.raises(ValueError, match="ids must be integers"):
            s.lookup("emb", jnp.array([1.0]))
    with (
        cfj.serving(cache, embedding_bytes=8) as s,
        pytest.raises(cfj.BudgetError, match="embedding_bytes=8 holds no row of 'emb'"),
    ):
        s.lookup("emb", jnp.array([1]))


@pytest.mark.parametrize("layout", ["slab", "arrays"])
def test_get_host_many_reads_l3_once_and_keeps_blocks_where_they_are(layout):
    data = np.random.default_rng(4).standard_normal((8, 64)).astype(np.float32)
    store = cfj.write_store({"w": data}, _url(), chunk_bytes=256)
    cache = cfj.TieredCache(store, device_bytes=2 * 256, host_bytes=8 * 256,
                            device_layout=layout)
    cache.get("w@0,0")  # in L1
    keys = [f"w@{i},0" for i in (0, 3, 5, 3)]
    for round_ in range(2):
        got = cache.get_host_many(keys)
        for key, value in zip(keys, got):
            assert isinstance(value, np.ndarray)
            assert value.tobytes() == data[int(key[2])][None].tobytes()
        stats = cache.stats()
        # Round 1: w@0 from L1, w@3 and w@5 read from L3 once each (w@3 twice in the batch).
        assert stats["misses"] == 3 and stats["hits"]["host"] == 2 * round_
    assert cache.tier_of("w@0,0") == "device"
    assert cache.tier_of("w@3,0") == "host" and cache.tier_of("w@5,0") == "host"
    cache.check_budgets()


@pytest.mark.parametrize("ttl", [86400.0, None])
def test_get_host_many_gives_runs_of_hits_to_the_policy_as_one_access_at_a_time(monkeypatch, ttl):
    """`get_host_many` hands a batch's accesses of resident blocks to the policy in runs
    (`Mover.account_hits`), each before the next miss; the policy's state, every block's tier
    and the counts after every batch are those of accounting each access alone."""
    from cacheflow_jax.cache.mover import Mover

    data = np.random.default_rng(5).standard_normal((64, 16)).astype(np.float32)
    url = _url()
    cfj.write_store({"w": data}, url, chunk_bytes=64)  # a row per block: 64 blocks
    clock = [0.0]

    def make():
        return cfj.TieredCache(cfj.open_store(url), device_bytes=6 * 64, host_bytes=18 * 64,
                               policy=cfj.lfu(ttl=ttl), clock=lambda: clock[0])  # fmt: skip

    batched, alone = make(), make()
    for cache in (batched, alone):
        cache.get_many([f"w@{i},0" for i in range(4)])  # L1 hits too (get_host_many keeps tiers)
    rng = np.random.default_rng(6)
    keys = [f"w@{int(i) % 64},0" for i in rng.zipf(1.2, 8 * 150)]
    for start in range(0, len(keys), 8):
        batch = keys[start : start + 8]
        clock[0] += 1.0
        got = batched.get_host_many(batch)
        with monkeypatch.context() as m:
            m.setattr(Mover, "hits_in_batch", lambda self, now: False)  # `account` per access
            want = alone.get_host_many(batch)
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
        a, b = batched.stats(), alone.stats()
        for field in ("hits", "misses", "tiers", "policy"):
            assert a[field] == b[field], (start, field)
        assert [batched.tier_of(f"w@{i},0") for i in range(64)] == [
            alone.tier_of(f"w@{i},0") for i in range(64)
        ], start
    stats = batched.stats()
    assert stats["hits"]["device"] > 0 and stats["hits"]["host"] > 0 and stats["misses"] > 0
