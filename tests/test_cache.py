"""TieredCache: contract, properties, TTL, concurrency, runtime blocks and bad input."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import time

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cacheflow_jax as cfj

POLICIES = ["lfu", "lru", "lfu-plain"]


@pytest.fixture(autouse=True, params=["arrays", "slab"])
def device_layout(request, monkeypatch):
    """Runs every test of this file against both L1 layouts (`DeviceTier` and `SlabTier`)."""
    if request.param != "arrays":
        monkeypatch.setattr(
            cfj, "TieredCache", functools.partial(cfj.TieredCache, device_layout=request.param)
        )
    return request.param


class FakeClock:
    """A clock that moves only when told to (TTL tests)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


_store_counter = iter(range(10**9))


def _memory_url() -> str:
    return f"memory://test-cache-{next(_store_counter)}/"


def _blocks_store(n: int = 16, size: int = 64, *, path: str | None = None):
    """A store with one array of ``n`` chunks of ``size`` float32 values each."""
    rng = np.random.default_rng(n)
    data = rng.standard_normal((n, size)).astype(np.float32)
    store = cfj.write_store({"w": data}, path or _memory_url(), chunk_bytes=size * 4)
    return store, data


def _bitwise(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------- contract


@pytest.mark.parametrize("policy", POLICIES)
class TestContract:
    """The same expectations for every policy."""

    def test_get_returns_stored_bytes_and_counts(self, policy):
        store, data = _blocks_store()
        cache = cfj.TieredCache(store, device_bytes=4 * 256, host_bytes=8 * 256, policy=policy)
        for i in range(16):
            assert _bitwise(cache.get(f"w@{i},0"), data[i : i + 1])
        stats = cache.stats()
        assert stats["requests"] == 16 and stats["misses"] == 16
        assert stats["miss_ratio"] == 1.0 and stats["policy"]["name"] == policy
        cache.check_budgets()
        assert stats["tiers"]["device"]["blocks"] == 4 and stats["tiers"]["host"]["blocks"] == 8

    def test_hits_are_served_from_device_then_host(self, policy):
        store, data = _blocks_store()
        cache = cfj.TieredCache(store, device_bytes=2 * 256, host_bytes=2 * 256, policy=policy)
        cache.get("w@0,0")
        cache.get("w@0,0")
        assert cache.tier_of("w@0,0") == "device"
        for i in (1, 2):
            cache.get(f"w@{i},0")
            cache.get(f"w@{i},0")
        # Three hot blocks and L1 holds two: one went down to L2.
        assert {cache.tier_of(f"w@{i},0") for i in range(3)} == {"device", "host"}
        before = cache.stats()
        host_key = next(f"w@{i},0" for i in range(3) if cache.tier_of(f"w@{i},0") == "host")
        assert _bitwise(cache.get(host_key), data[int(host_key[2])][None])
        after = cache.stats()
        assert after["hits"]["host"] == before["hits"]["host"] + 1
        assert after["misses"] == before["misses"]
        assert cache.tier_of(host_key) == "device"

    def test_contains_and_evict(self, policy):
        store, _ = _blocks_store()
        cache = cfj.TieredCache(store, device_bytes=4 * 256, host_bytes=0, policy=policy)
        assert not cache.contains("w@0,0")
        cache.get("w@0,0")
        assert cache.contains("w@0,0")
        assert cache.evict("w@0,0") and not cache.contains("w@0,0")
        assert not cache.evict("w@0,0")
        assert cache.stats()["tiers"]["device"]["used"] == 0

    def test_get_many_matches_get(self, policy):
        store, data = _blocks_store()
        cache = cfj.TieredCache(store, device_bytes=8 * 256, host_bytes=4 * 256, policy=policy)
        keys = [f"w@{i},0" for i in (3, 1, 3, 7, 0, 9, 12, 1)]
        out = cache.get_many(keys)
        for key, value in zip(keys, out):
            assert _bitwise(value, data[int(key[2:].split(",")[0])][None])
        cache.check_budgets()

    def test_host_tier_disabled(self, policy):
        store, _ = _blocks_store()
        cache = cfj.TieredCache(store, device_bytes=3 * 256, host_bytes=0, policy=policy)
        for i in range(10):
            cache.get(f"w@{i},0")
        assert cache.stats()["hits"]["host"] == 0
        assert cache.stats()["tiers"]["host"]["blocks"] == 0


# --------------------------------------------------------------------------- properties

DTYPES = [np.float32, np.float16, jnp.bfloat16, np.int8, np.uint8, np.int32]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    chunk_bytes=st.sampled_from([4, 16, 64, 1000]),
    seed=st.integers(0, 2**16),
)
def test_get_round_trips_random_arrays_bitwise(dtype, shape, chunk_bytes, seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    array = raw.view(np.dtype(dtype)).reshape(shape)
    store = cfj.write_store({"x": array}, _memory_url(), chunk_bytes=chunk_bytes)
    largest = max(store.info(k).nbytes for k in store.keys())
    cache = cfj.TieredCache(store, device_bytes=2 * largest, host_bytes=largest)
    for _ in range(2):  # cold, then from L1/L2
        for key in store.keys():
            info = store.info(key)
            want = array[tuple(slice(o, o + s) for o, s in zip(info.origin, info.shape))]
            got = cache.get(key)
            assert _bitwise(got, want), key


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    device_blocks=st.integers(1, 5),
    host_blocks=st.integers(0, 5),
    ops=st.lists(
        st.tuples(st.sampled_from(["get", "get_many", "put", "evict"]), st.integers(0, 11)),
        max_size=60,
    ),
)
def test_budgets_hold_after_every_operation(policy, device_blocks, host_blocks, ops):
    store, data = _blocks_store(n=12, size=16)
    truth = {f"w@{i},0": data[i : i + 1] for i in range(12)}
    cache = cfj.TieredCache(
        store, device_bytes=device_blocks * 64, host_bytes=host_blocks * 64, policy=policy
    )
    for op, i in ops:
        key = f"w@{i},0"
        if op == "get":
            assert _bitwise(cache.get(key), truth[key])
        elif op == "get_many":
            keys = [key, f"w@{(i + 5) % 12},0", key]
            for k, v in zip(keys, cache.get_many(keys)):
                assert _bitwise(v, truth[k])
        elif op == "put":
            value = np.full((1, 16), i, np.float32)
            cache.put(f"kv:{i % 4}", value)
            truth[f"kv:{i % 4}"] = value
        else:
            cache.evict(key if i % 2 else f"kv:{i % 4}")
        cache.check_budgets()
    for key, value in truth.items():
        assert _bitwise(cache.get(key), value), key
        cache.check_budgets()


def test_ttl_expires_blocks_with_a_fake_clock():
    clock = FakeClock()
    store, _ = _blocks_store()
    cache = cfj.TieredCache(
        store,
        device_bytes=8 * 256,
        host_bytes=8 * 256,
        policy=cfj.lfu(ttl=10.0),
        clock=clock,
        read_buffer=1,
    )
    cache.get("w@0,0")
    cache.get("w@1,0")
    clock.tick(5.0)
    cache.get("w@1,0")  # refreshed
    assert cache.contains("w@0,0") and cache.contains("w@1,0")
    clock.tick(9.0)  # w@0 idle 14 s > ttl, w@1 idle 9 s
    cache.get("w@2,0")
    assert not cache.contains("w@0,0")
    assert cache.contains("w@1,0") and cache.contains("w@2,0")
    clock.tick(30.0)
    cache.get("w@3,0")
    assert not cache.contains("w@1,0") and not cache.contains("w@2,0")
    cache.check_budgets()
    assert cache.stats()["tiers"]["device"]["used"] == 256


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_ttl_writes_back_expired_runtime_blocks(policy, tmp_path):
    clock = FakeClock()
    store, _ = _blocks_store(path=str(tmp_path / "s"))
    make = cfj.lfu if policy == "lfu" else cfj.lru
    cache = cfj.TieredCache(
        store, device_bytes=1024, host_bytes=1024, policy=make(ttl=1.0), clock=clock
    )
    cache.put("kv:a", np.arange(4, dtype=np.int8))
    clock.tick(5.0)
    cache.get("w@0,0")
    assert not cache.contains("kv:a")
    cache.flush()
    reopened = cfj.open_store(str(tmp_path / "s"))
    assert _bitwise(reopened.read("kv:a").result(), np.arange(4, dtype=np.int8))


# ---------------------------------------------------------------------------- policies


def test_lfu_keeps_frequent_blocks_over_a_scan():
    store, _ = _blocks_store(n=64, size=16)
    cache = cfj.TieredCache(
        store, device_bytes=4 * 64, host_bytes=0, policy=cfj.lfu(half_life=1e6), read_buffer=1
    )
    hot = [f"w@{i},0" for i in range(3)]
    for _ in range(10):
        for key in hot:
            cache.get(key)
    for i in range(10, 60):  # a scan of one-hit blocks must not flush the hot set
        cache.get(f"w@{i},0")
    assert all(cache.tier_of(k) == "device" for k in hot)


def test_lru_evicts_least_recent():
    store, _ = _blocks_store(n=8, size=16)
    cache = cfj.TieredCache(store, device_bytes=3 * 64, host_bytes=0, policy="lru", read_buffer=1)
    for i in (0, 1, 2, 0, 3):
        cache.get(f"w@{i},0")
    assert not cache.contains("w@1,0")
    assert all(cache.contains(f"w@{i},0") for i in (0, 2, 3))


def test_lfu_with_short_half_life_and_no_window_behaves_like_lru():
    store, _ = _blocks_store(n=32, size=16)
    rng = np.random.default_rng(1)
    seq = [f"w@{int(i)},0" for i in rng.zipf(1.4, 400) % 32]
    results = {}
    for name, policy in [("lru", cfj.lru()), ("lfu", cfj.lfu(half_life=1e-3, window=1.0))]:
        cache = cfj.TieredCache(store, device_bytes=6 * 64, host_bytes=0, policy=policy,
                                read_buffer=1)
        for key in seq:
            cache.get(key)
        results[name] = cache.stats()["misses"]
    assert results["lru"] == results["lfu"]


def test_unknown_policy_names_the_choices():
    store, _ = _blocks_store()
    with pytest.raises(ValueError, match="unknown policy 'fifo'.*lfu"):
        cfj.TieredCache(store, device_bytes=1024, host_bytes=0, policy="fifo")


# ---------------------------------------------------------------------------- concurrency


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eight_threads_random_get_put(policy):
    store, data = _blocks_store(n=40, size=64)
    cache = cfj.TieredCache(store, device_bytes=4 * 256, host_bytes=6 * 256, policy=policy)
    truth = {f"w@{i},0": data[i : i + 1] for i in range(40)}
    errors: list = []
    stop = threading.Event()
    over_budget: list = []

    def watch():
        # Samples the budgets between the workers' steps. The pause matters: a pure-Python busy
        # loop holds the GIL for whole switch intervals, so every worker waiting on TensorStore
        # (which releases the GIL) waits 5 ms to get it back, and the test takes minutes.
        while not stop.is_set():
            for tier in cache.tiers:
                if tier.used > tier.budget:
                    over_budget.append((tier.name, tier.used))
            time.sleep(0.0002)

    def work(tid: int):
        rng = np.random.default_rng(tid)
        mine: dict[str, np.ndarray] = {}
        try:
            for _ in range(300):
                if rng.random() < 0.2:
                    key = f"kv:{tid}:{rng.integers(4)}"
                    value = rng.standard_normal((1, 64)).astype(np.float32)
                    cache.put(key, value)
                    mine[key] = value
                elif mine and rng.random() < 0.3:
                    key = list(mine)[rng.integers(len(mine))]
                    if not _bitwise(cache.get(key), mine[key]):
                        errors.append(key)
                else:
                    key = f"w@{rng.integers(40)},0"
                    if not _bitwise(cache.get(key), truth[key]):
                        errors.append(key)
            truth.update(mine)
        except Exception as e:  # reported below
            errors.append(repr(e))

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    watcher.join()
    assert not any(t.is_alive() for t in threads), "deadlock: a worker did not finish"
    assert errors == [] and over_budget == []
    cache.check_budgets()
    cache.flush()
    for key, value in truth.items():
        assert _bitwise(cache.get(key), value), key


# -------------------------------------------------------------------------- runtime blocks


def test_put_write_back_and_reopen(tmp_path):
    store, _ = _blocks_store(path=str(tmp_path / "s"))
    cache = cfj.TieredCache(store, device_bytes=2 * 256, host_bytes=0)
    kv = jnp.arange(64, dtype=jnp.bfloat16).reshape(1, 64)
    cache.put("kv:prefix-1", kv)
    assert _bitwise(cache.get("kv:prefix-1"), kv)
    for i in range(4):  # push it out: it must be written back, not dropped
        cache.get(f"w@{i},0")
        cache.get(f"w@{i},0")
    cache.evict("kv:prefix-1")
    cache.wait_until_finished()
    assert _bitwise(cache.get("kv:prefix-1"), kv)
    reopened = cfj.open_store(str(tmp_path / "s"))
    assert _bitwise(reopened.read("kv:prefix-1").result(), kv)


def test_a_put_array_changed_afterwards_does_not_change_the_cached_block(tmp_path):
    """The cache copies a caller's array (on the CPU backend it may alias only its own, aligned
    buffers): writing into the array after the put changes nothing cached, in L1, L2 or L3."""
    store, _ = _blocks_store(path=str(tmp_path / "s"))
    cache = cfj.TieredCache(store, device_bytes=2 * 256, host_bytes=2 * 256)
    buf = np.empty(64 + 16, np.float32)
    offset = (-buf.ctypes.data % 64) // 4  # a 64-byte aligned array, which the CPU could alias
    kv = buf[offset : offset + 64].reshape(1, 64)
    kv[:] = np.arange(64, dtype=np.float32)
    want = kv.copy()
    cache.put("kv:a", kv)
    kv[:] = -1.0
    assert _bitwise(cache.get("kv:a"), want)
    for i in range(8):  # until kv:a goes down to L2
        cache.get(f"w@{i % 2},0")
        if cache.tier_of("kv:a") == "host":
            break
    assert cache.tier_of("kv:a") == "host"
    kv[:] = -2.0
    assert _bitwise(cache.get("kv:a"), want)
    cache.flush()
    assert _bitwise(cfj.open_store(str(tmp_path / "s")).read("kv:a").result(), want)


def test_serving_flushes_on_error_and_logs(tmp_path):
    store, data = _blocks_store(path=str(tmp_path / "s"))
    cache = cfj.TieredCache(store, device_bytes=4 * 256, host_bytes=4 * 256)
    log = tmp_path / "logs" / "access.jsonl"
    with pytest.raises(RuntimeError, match="boom"), cfj.serving(cache, access_log=log) as s:
        for i in range(6):
            s.get(f"w@{i % 3},0", req=f"r{i}")
        s.get_many(["w@4,0", "w@5,0"])
        s.put("kv:x", np.ones((2, 2), np.float32))
        raise RuntimeError("boom")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 9
    assert [r["key"] for r in rows[:6]] == [f"w@{i % 3},0" for i in range(6)]
    assert rows[0] == {"t": rows[0]["t"], "key": "w@0,0", "nbytes": 256, "kind": "weight",
                       "req": "r0"}
    assert rows[-1]["kind"] == "kv" and rows[-1]["nbytes"] == 16
    ts = [r["t"] for r in rows]
    assert ts == sorted(ts)
    # The runtime block reached L3 on exit even though the body raised.
    reopened = cfj.open_store(str(tmp_path / "s"))
    assert _bitwise(reopened.read("kv:x").result(), np.ones((2, 2), np.float32))
    stats = s.stats()
    for field in ("requests", "misses", "device_miss_ratio", "miss_ratio", "byte_miss_ratio"):
        assert field in stats
    assert set(stats["hits"]) == {"device", "host"}
    assert {"issued", "used", "timely", "late", "wasted", "accuracy", "coverage"} <= set(stats["prefetch"])
    assert stats["prefetch"]["issued"] == 0 and not stats["prefetch"]["enabled"]
    assert stats["requests"] == 8


# ------------------------------------------------------------------------------ bad input


def _tree_digest(root) -> dict:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_bad_input_errors_change_nothing_on_disk(tmp_path):
    store, _ = _blocks_store(path=str(tmp_path / "s"))
    before = _tree_digest(tmp_path / "s")
    cache = cfj.TieredCache(store, device_bytes=4 * 256, host_bytes=0)
    with pytest.raises(KeyError, match="no block 'w@99,0'"):
        cache.get("w@99,0")
    with pytest.raises(KeyError, match="nope"):
        cache.get_many(["w@0,0", "nope"])
    with pytest.raises(cfj.BudgetError, match="device_bytes=-1 is negative"):
        cfj.TieredCache(store, device_bytes=-1, host_bytes=0)
    with pytest.raises(cfj.BudgetError, match=r"host_bytes=100 is smaller than the largest block"):
        cfj.TieredCache(store, device_bytes=1024, host_bytes=100)
    with pytest.raises(cfj.BudgetError, match="device_bytes=0"):
        cfj.TieredCache(store, device_bytes=0, host_bytes=1024)
    with pytest.raises(ValueError, match="read-only"):
        cache.put("w@0,0", np.zeros((1, 64), np.float32))
    with pytest.raises(cfj.BudgetError, match="kv:big"):
        cache.put("kv:big", np.zeros(1024, np.float32))
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        cfj.open_store(str(tmp_path / "no-such-dir"))
    assert _tree_digest(tmp_path / "s") == before
    assert not (tmp_path / "no-such-dir").exists()
    cache.check_budgets()


def test_corrupted_chunk_names_key_and_file(tmp_path):
    store, data = _blocks_store(path=str(tmp_path / "s"))
    cache = cfj.TieredCache(store, device_bytes=4 * 256, host_bytes=0)
    chunk = tmp_path / "s" / "w" / "c" / "3" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[5] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with pytest.raises(cfj.CorruptBlockError) as info:
        cache.get("w@3,0")
    assert "w@3,0" in str(info.value) and str(chunk.relative_to(tmp_path / "s")) in str(info.value)
    assert _bitwise(cache.get("w@2,0"), data[2:3])  # the others still read fine
    assert not cache.contains("w@3,0")
    cache.check_budgets()


@pytest.mark.s3
def test_s3_store_through_the_cache(s3_server, device_layout):
    """write_store to a real S3 server on loopback, then read every block back through the cache."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((12, 8)).astype(jnp.bfloat16)
    b = rng.integers(-128, 127, (30,), dtype=np.int8)
    url = f"s3://{s3_server.bucket}/cache-test-{device_layout}"
    kw = {"s3_endpoint": s3_server.endpoint, "s3_region": s3_server.region}
    cfj.write_store({"w": w, "b": b}, url, chunk_bytes=32, **kw)
    store = cfj.open_store(url, **kw)
    cache = cfj.TieredCache(store, device_bytes=64, host_bytes=64)
    with cfj.serving(cache) as s:
        s.put("kv:s3-block", np.arange(8, dtype=np.int8))
        chunks = [k for k in store.keys() if "@" in k]
        for _ in range(2):
            got = dict(zip(chunks, s.get_many(chunks)))
            for key, value in got.items():
                info = store.info(key)
                src = w if info.array == "w" else b
                want = src[tuple(slice(o, o + n) for o, n in zip(info.origin, info.shape))]
                assert _bitwise(value, want), key
    again = cfj.open_store(url, **kw)
    assert _bitwise(again.read("kv:s3-block").result(), np.arange(8, dtype=np.int8))


class _SlowCountingStore:
    """A real TensorStore store whose reads are counted and take at least 0.2 s to finish."""

    def __init__(self, store) -> None:
        self._store = store
        self.reads = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def read(self, key):
        with self._lock:
            self.reads += 1
        future = self._store.read(key)

        class _Slow:
            def result(self, timeout=None):
                threading.Event().wait(0.2)
                return future.result(timeout)

        return _Slow()

    def read_many(self, keys):
        return [self.read(k) for k in keys]


def test_concurrent_misses_on_one_key_make_one_read():
    store, data = _blocks_store()
    slow = _SlowCountingStore(store)
    cache = cfj.TieredCache(slow, device_bytes=4 * 256, host_bytes=0)
    barrier = threading.Barrier(6)
    results = []

    def work():
        barrier.wait()
        results.append(np.asarray(cache.get("w@5,0")))

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert slow.reads == 1
    assert len(results) == 6 and all(_bitwise(r, data[5:6]) for r in results)


def test_get_many_with_an_unknown_key_fails_before_anything_moves(tmp_path) -> None:
    """A bad key in a batch is a KeyError naming it, raised before any block of the batch is
    claimed: the good keys neither move nor hang a later `get` (a claimed read used to stay in
    flight forever)."""
    store, data = _blocks_store(4, path=f"file://{tmp_path}/s")
    keys = sorted(store.keys())
    cache = cfj.TieredCache(store, device_bytes=1024, host_bytes=1024)
    cache.get(keys[1])
    cache.evict(keys[1])
    with pytest.raises(KeyError, match="nope"):
        cache.get_many([keys[0], keys[1], "nope"])
    assert cache.tier_of(keys[0]) is None and cache.stats()["requests"] == 1
    got = []
    t = threading.Thread(target=lambda: got.append(cache.get(keys[0])), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "get waited on a read that get_many claimed and abandoned"
    np.testing.assert_array_equal(np.asarray(got[0]), data[0:1])


def test_get_many_starts_l3_reads_before_it_promotes_l2_blocks(tmp_path) -> None:
    """In a batch of L2 and L3 blocks, the L3 reads are issued first and run while the L2
    blocks are promoted one by one (in key order, each before the next key's access)."""
    store, data = _blocks_store(6, path=f"file://{tmp_path}/s")
    keys = sorted(store.keys())
    cache = cfj.TieredCache(store, device_bytes=2 * 256, host_bytes=4 * 256)
    for key in keys[:4]:
        cache.get(key)  # two end in L1, two in L2
    in_l2 = [k for k in keys[:4] if cache.tier_of(k) == "host"]
    assert len(in_l2) == 2
    events = []
    read_many, load = cache.store.read_many, cache.tiers[0].load
    load_many = cache.tiers[0].load_many  # L3 blocks read together move in one transfer
    cache.store.read_many = lambda ks: (events.append(("read", tuple(ks))), read_many(ks))[1]
    cache.tiers[0].load = lambda v, **kw: (events.append(("promote",)), load(v, **kw))[1]
    cache.tiers[0].load_many = lambda vs, **kw: (
        events.extend([("promote",)] * len(vs)), load_many(vs, **kw))[1]  # fmt: skip
    batch = [in_l2[0], keys[4], in_l2[1], keys[5]]
    got = cache.get_many(batch)
    assert events[0] == ("read", (keys[4], keys[5])), events
    assert events.count(("promote",)) >= 2
    for key, value in zip(batch, got):
        np.testing.assert_array_equal(np.asarray(value), data[keys.index(key) : keys.index(key) + 1])
