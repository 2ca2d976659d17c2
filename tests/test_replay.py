"""Trace readers, replay, Belady, and agreement with libCacheSim."""

from __future__ import annotations

import gzip
import json
import os

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import cacheflow_jax as cfj
from bench.policies import shared_traces_dir
from cacheflow_jax.cache.tiered import TieredCache
from cacheflow_jax.policies.belady import belady, next_uses
from cacheflow_jax.replay.engine import TraceStore, replay
from cacheflow_jax.tiers.memory import MetadataTier
from cacheflow_jax.trace.reader import Trace, TraceFormatError, parse_size, read_trace, write_log

TRACES = shared_traces_dir()
MOONCAKE = os.path.join(TRACES, "mooncake_synthetic_trace.jsonl")
CLOUDPHYSICS = os.path.join(TRACES, "cloudPhysicsIO.csv.gz")


def _trace(keys, sizes=None) -> Trace:
    n = len(keys)
    return Trace(
        "mem",
        np.arange(n, dtype=np.float64),
        list(keys),
        np.asarray(sizes if sizes is not None else [1] * n, np.int64),
        ["other"] * n,
        [None] * n,
    )


# ------------------------------------------------------------------------------- readers


def test_log_jsonl_and_csv_read_the_same(tmp_path):
    rows = [
        {"t": 0.5, "key": "params/w@0,1", "nbytes": 64, "kind": "weight", "req": "r1"},
        {"t": 0.5, "key": "kv:9", "nbytes": 16, "kind": "kv"},
        {"t": 2.0, "key": "emb@3", "nbytes": 8, "kind": "embedding", "req": "r2"},
    ]
    jl = tmp_path / "a.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cs = tmp_path / "a.csv"
    cs.write_text(
        't,key,nbytes,kind,req\n0.5,"params/w@0,1",64,weight,r1\n0.5,kv:9,16,kv,\n'
        "2.0,emb@3,8,embedding,r2\n"
    )
    for path in (jl, cs):
        trace = read_trace(path)
        assert list(trace.records()) == rows
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(jl.read_bytes()))
    assert list(read_trace(gz).records()) == rows
    out = tmp_path / "round.jsonl"
    write_log(read_trace(cs), out)
    assert list(read_trace(out).records()) == rows


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        (
            '{"t": 1, "key": "a", "nbytes": 1, "kind": "kv"}\n{"t": 0, "key": "a", "nbytes": 1, '
            '"kind": "kv"}\n',
            2,
            "back in time",
        ),
        ('{"t": 1, "key": "a", "nbytes": 0, "kind": "kv"}\n', 1, "nbytes"),
        ('{"t": 1, "key": "a", "nbytes": 1, "kind": "blob"}\n', 1, "kind"),
        ('{"t": 1, "key": "a", "nbytes": 1, "kind": "kv"}\n{oops\n', 2, "not JSON"),
        ('{"t": 1, "nbytes": 1, "kind": "kv"}\n', 1, "missing field 'key'"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, text, line, what):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=rf"bad.jsonl:{line}: .*{what}"):
        read_trace(path, format="log")


def test_mooncake_converter_and_unit_sizes(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 1500, "hash_ids": [1]}\n')
    trace = read_trace(path)
    assert trace.keys == ["kv:1", "kv:2", "kv:1"]
    assert trace.t.tolist() == [0.0, 0.0, 1.5]
    assert trace.nbytes.tolist() == [1, 1, 1] and trace.kinds == ["kv"] * 3
    assert read_trace(path, block_bytes=4096).nbytes.tolist() == [4096] * 3


def test_libcachesim_csv_with_column_spec(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("1,10,r,512,77\n1,11,r,1024,78\n1,12,r,512,77\n")
    trace = read_trace(path, format="libcachesim-csv", csv_spec="time=2,key=5,size=4,header=false")
    assert trace.keys == ["77", "78", "77"] and trace.nbytes.tolist() == [512, 1024, 512]
    assert trace.distinct_bytes() == 1536


def test_txt_and_empty_and_unknown_format(tmp_path):
    path = tmp_path / "k.txt"
    path.write_text("a\nb\na\n\n")  # an empty last line (as in lirs_gli) is no access
    trace = read_trace(path)
    assert trace.keys == ["a", "b", "a"] and trace.timed is False
    path.write_text("a\n\nb\n")
    with pytest.raises(TraceFormatError, match=r"k.txt:2: empty line"):
        read_trace(path)
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no accesses"):
        read_trace(empty, format="log")
    with pytest.raises(ValueError, match="unknown trace format 'parquet'"):
        read_trace(path, format="parquet")


def test_parse_size():
    assert parse_size("5%", total=1000, largest=1, setting="s") == 50
    assert parse_size("2KiB", total=0, largest=1, setting="s") == 2048
    assert parse_size("1.5MiB", total=0, largest=1, setting="s") == 1572864
    assert parse_size("4096", total=0, largest=512, setting="s") == 4096
    with pytest.raises(ValueError, match="--device-bytes='5' has no unit.*512 bytes"):
        parse_size("5", total=10**6, largest=512, setting="--device-bytes")
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots", total=1, largest=1, setting="s")


def test_shared_traces_read():
    trace = read_trace(MOONCAKE)
    assert len(trace) == 121_877 and len(set(trace.keys)) == 43_924
    cp = read_trace(CLOUDPHYSICS)
    assert len(cp) == 113_872 and cp.nbytes.min() > 0


# -------------------------------------------------------------------------------- replay


def _live(trace: Trace, policy, device: int, host: int) -> TieredCache:
    """The threaded `get` path over metadata tiers, with the trace's clock."""
    clock = [0.0]
    cache = TieredCache(
        TraceStore(trace),
        device_bytes=device,
        host_bytes=host,
        policy=policy,
        clock=lambda: clock[0],
        tiers=[
            MetadataTier(device, name="device", setting="device_bytes"),
            MetadataTier(host, name="host", setting="host_bytes"),
        ],
        read_buffer=1,
    )
    for t, key in zip(trace.t.tolist(), trace.keys):
        clock[0] = t
        cache.get(key)
    return cache


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfu-plain", "belady"])
@pytest.mark.parametrize(("device", "host"), [(40, 0), (30, 90)])
def test_replay_fast_path_equals_live_get_path(policy, device, host):
    trace = read_trace(MOONCAKE, limit=4000)
    fast = replay(trace, device_bytes=device, host_bytes=host, policy=policy)
    pol = belady(trace) if policy == "belady" else policy
    live = _live(trace, pol, device, host).stats()
    for field in ("requests", "hits", "misses", "byte_miss_ratio", "tiers"):
        assert fast[field] == live[field], field


def _replay_cache(trace: Trace, policy, device: int) -> TieredCache:
    return TieredCache(
        TraceStore(trace), device_bytes=device, host_bytes=0, policy=policy, clock=lambda: 0.0,
        tiers=[MetadataTier(device, name="device", setting="device_bytes"),
               MetadataTier(0, name="host", setting="host_bytes")],
        read_buffer=1,
    )  # fmt: skip


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady"])
@pytest.mark.parametrize(("path", "share"), [(MOONCAKE, 0.05), (CLOUDPHYSICS, 0.0015)])
def test_one_tier_replay_loop_equals_the_general_loop_step_by_step(policy, path, share):
    """Replay's one-tier loop (`access_many_sync`) against the loop for every case, on a timed
    trace (the TTL's sweeps run), with sizes that vary (cloudPhysics: a block larger than L1 is
    never cached): the same residents, counters and policy state after every 50 accesses."""
    trace = read_trace(path, limit=6000)
    store = TraceStore(trace)
    sizes, times = store.sizes_of(trace.keys), trace.t.tolist()
    budget = max(int(trace.distinct_bytes() * share), 1)
    # A TTL short enough to expire blocks within the 6,000 accesses' span of time.
    ttl = max((times[-1] - times[0]) / 20, 1e-3)

    def make():
        if policy == "belady":
            return belady(trace)
        return cfj.get_policy(policy) if policy == "lru" else cfj.lfu(ttl=ttl)

    one, general = _replay_cache(trace, make(), budget), _replay_cache(trace, make(), budget)
    assert budget < max(sizes) or path == MOONCAKE
    for lo in range(0, len(trace.keys), 50):
        part = slice(lo, lo + 50)
        one.access_many_sync(trace.keys[part], times[part], sizes[part])  # the one-tier loop
        general.access_many_sync(trace.keys[part], times[part], sizes[part], general=True)
        assert one.tiers[0].entries.keys() == general.tiers[0].entries.keys(), lo
        assert one.tiers[0].used == general.tiers[0].used <= budget
    a, b = one.stats(), general.stats()
    for field in ("requests", "hits", "misses", "byte_miss_ratio", "tiers", "policy"):
        assert a[field] == b[field], field
    assert a["misses"] > 0 and a["hits"]["device"] > 0


def test_one_tier_replay_loop_expires_blocks_during_a_run_of_hits():
    """Ten blocks, then one of them hit for 100 s: the others pass the TTL while only hits
    happen, and leave then, in both loops alike."""
    keys = [f"k{i}" for i in range(10)] + ["k0"] * 200
    t = np.arange(len(keys), dtype=np.float64) / 2
    trace = Trace("hits", t, keys, np.ones(len(keys), np.int64), ["kv"] * len(keys),
                  [None] * len(keys))  # fmt: skip
    one, general = _replay_cache(trace, cfj.lfu(ttl=20.0), 10), _replay_cache(
        trace, cfj.lfu(ttl=20.0), 10
    )
    times, sizes = t.tolist(), [1] * len(keys)
    for i in range(len(keys)):
        one.access_many_sync(keys[i : i + 1], times[i : i + 1], sizes[i : i + 1])
        general.access_many_sync(keys[i : i + 1], times[i : i + 1], sizes[i : i + 1], general=True)
        assert one.tiers[0].entries.keys() == general.tiers[0].entries.keys(), i
    assert list(one.tiers[0].entries) == ["k0"]  # the other nine expired, with no miss after them


@pytest.mark.parametrize("batch", [2, 3])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_live_get_many_batches_promote_as_replay_does(policy, batch):
    """`get_many` of a few keys at a time (a serving loop's layer) over two tiers that hold
    every block between them (no L3 read after the first touches): its L1 hits first, then each
    L2 block promoted before the next key's access, so the blocks end in the same tiers as
    replay of the accesses one by one in that order. (Before, a batch's
    promotions waited behind its later accesses and `lfu` took them for blocks that had left:
    the demo's log missed 101 times in batches of 2 where replay missed 74.)"""
    rng = np.random.default_rng(7)
    n = 60
    keys = [f"e{int(i)}" for i in rng.zipf(1.3, 6000) % n]
    t = np.arange(len(keys), dtype=np.float64)
    trace = Trace("batches", t, keys, np.ones(len(keys), np.int64), ["weight"] * len(keys),
                  [None] * len(keys))  # fmt: skip
    device, host = 10, n - 10  # L1 + L2 hold every block: after the first touches, no L3 read
    clock = [0.0]

    def cache(clock_fn):
        return TieredCache(
            TraceStore(trace), device_bytes=device, host_bytes=host, policy=policy,
            clock=clock_fn,
            tiers=[MetadataTier(device, name="device", setting="device_bytes"),
                   MetadataTier(host, name="host", setting="host_bytes")],
            read_buffer=1,
        )  # fmt: skip

    live, ref = cache(lambda: clock[0]), cache(lambda: 0.0)
    first = list(dict.fromkeys(keys))  # every block once, one by one, in both
    for key in first:
        live.get(key)
        ref.access_many_sync([key], [0.0])
    assert len(first) == n
    for lo in range(0, len(keys), batch):
        part = list(dict.fromkeys(keys[lo : lo + batch]))  # a batch names a block once
        clock[0] = float(lo)
        live.get_many(part)
        # `get_many` takes its L1 hits first (the hit path), then the rest in order.
        order = [k for k in part if k in ref.tiers[0].entries] + [k for k in part if k not in ref.tiers[0].entries]
        ref.access_many_sync(order, [float(lo)] * len(order))
        assert live.tiers[0].entries.keys() == ref.tiers[0].entries.keys(), lo
        assert live.tiers[1].entries.keys() == ref.tiers[1].entries.keys(), lo
        if policy == "lfu":  # and the policy saw the same: every block in the same segment
            live.stats()  # the hit path's buffered hits reach the policy
            for segment in ("window", "probation", "protected", "ghosts"):
                assert list(getattr(live.planner.state, segment)) == list(
                    getattr(ref.planner.state, segment)
                ), (lo, segment)
    a, b = live.stats(), ref.stats()
    assert a["hits"]["host"] > 1000 and a["misses"] == n, a
    for field in ("requests", "hits", "misses", "tiers"):
        assert a[field] == b[field], field


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.10, 0.20])
def test_lru_equals_libcachesim_lru(fraction):
    import libcachesim as lcs  # in the test extra: a missing peer is a failure, not a skip

    trace = read_trace(MOONCAKE, limit=30_000)
    size = int(len(set(trace.keys)) * fraction)
    ours = replay(trace, device_bytes=size, host_bytes=0, policy="lru")
    peer = lcs.LRU(cache_size=size)
    misses = sum(
        not peer.get(lcs.Request(obj_id=int(k[3:]), obj_size=1, clock_time=i))
        for i, k in enumerate(trace.keys)
    )
    assert ours["misses"] == misses


def test_lru_equals_libcachesim_lru_with_byte_sizes():
    # cloudPhysicsIO: sizes vary between accesses to one key; both sides use the key's size in
    # replay (its largest), as bench.policies does for every peer.
    import libcachesim as lcs

    trace = read_trace(CLOUDPHYSICS, limit=20_000)
    sizes = trace.sizes()
    budget = int(trace.distinct_bytes() * 0.05)
    ours = replay(trace, device_bytes=budget, host_bytes=0, policy="lru")
    peer = lcs.LRU(cache_size=budget)
    ids: dict = {}
    misses = sum(
        not peer.get(
            lcs.Request(obj_id=ids.setdefault(k, len(ids)), obj_size=sizes[k], clock_time=i)
        )
        for i, k in enumerate(trace.keys)
    )
    assert ours["misses"] == misses


def test_two_tiers_lru_equal_one_tier_of_the_sum():
    trace = read_trace(MOONCAKE, limit=20_000)
    one = replay(trace, device_bytes=500, host_bytes=0, policy="lru")
    two = replay(trace, device_bytes=100, host_bytes=400, policy="lru")
    assert two["misses"] == one["misses"]
    assert two["hits"]["host"] > 0


def test_next_uses():
    assert next_uses(["a", "b", "a", "c", "b"]).tolist() == [2, 4, 5, 5, 5]


@settings(max_examples=40, deadline=None)
@given(
    keys=st.lists(st.integers(0, 12), min_size=1, max_size=120),
    capacity=st.integers(1, 6),
)
def test_belady_is_never_worse_than_any_policy(keys, capacity):
    trace = _trace([f"k{k}" for k in keys])
    opt = replay(trace, device_bytes=capacity, host_bytes=0, policy="belady")["misses"]
    for policy in ("lru", "lfu", "lfu-plain", cfj.lfu(half_life=3.0)):
        assert opt <= replay(trace, device_bytes=capacity, host_bytes=0, policy=policy)["misses"]


def test_belady_matches_the_shared_reference_figures():
    trace = read_trace(MOONCAKE)
    n = len(set(trace.keys))
    for fraction, want in ((0.01, 0.815), (0.10, 0.494)):
        got = replay(trace, device_bytes=int(n * fraction), host_bytes=0, policy="belady")
        assert abs(got["miss_ratio"] - want) < 0.001


def test_replay_bad_budgets_and_objects_larger_than_the_cache():
    trace = _trace(["a", "b", "a"], sizes=[100, 10, 100])
    with pytest.raises(cfj.BudgetError, match="device_bytes=0 cannot hold"):
        replay(trace, device_bytes=0, host_bytes=0)
    with pytest.raises(cfj.BudgetError, match="host_bytes=-1 is negative"):
        replay(trace, device_bytes=100, host_bytes=-1)
    # A block larger than every tier is never cached, as in libCacheSim: each access misses.
    small = replay(trace, device_bytes=50, host_bytes=0)
    assert small["misses"] == 3 and small["tiers"]["device"]["blocks"] == 1


def test_a_trace_without_timestamps_expires_nothing_by_ttl(tmp_path):
    """The clock defect: counting accesses as seconds expired blocks after ``ttl`` accesses.

    Two hot blocks come back every 12 accesses, between scans of one-hit blocks. Under a clock
    of access indices a TTL of 10 "seconds" expires them between their uses.
    """
    keys = []
    for i in range(40):
        keys += ["h0", "h1", *(f"s{i}_{j}" for j in range(10))]
    path = tmp_path / "scan.txt"
    path.write_text("\n".join(keys) + "\n")
    untimed = read_trace(path)
    timed = _trace(keys)  # the same accesses, one second apart
    runs = {}
    for clock, trace in (("none", untimed), ("trace", timed)):
        for ttl in (10.0, None):
            stats = replay(trace, device_bytes=6, host_bytes=0, policy=cfj.lfu(ttl=ttl))
            assert stats["clock"] == clock
            assert stats["ttl_applied"] is (clock == "trace" and ttl is not None)
            runs[clock, ttl] = stats["misses"]
    assert runs["none", 10.0] == runs["none", None] == runs["trace", None]
    assert runs["trace", 10.0] > runs["trace", None]  # with a real clock the TTL does apply


