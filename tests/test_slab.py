"""The device slab (`SlabTier`, ``TieredCache(device_layout="slab")``): bytes, lines, memory."""

from __future__ import annotations

import gc

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cacheflow_jax as cfj
from cacheflow_jax.tiers.slab import SlabTier, default_line_bytes

_urls = iter(range(10**9))


def _url() -> str:
    return f"memory://test-slab-{next(_urls)}/"


def _bitwise(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _random(rng, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def _check_lines(tier: SlabTier) -> None:
    """Every line is either free or held by exactly one block, and held lines fit the blocks."""
    held = [int(i) for e in tier.table.values() for i in e.lines]
    assert len(held) == len(set(held)), "a line is held by two blocks"
    assert sorted(held + tier.slab.free) == list(range(tier.slab.num_lines))
    for key, entry in tier.table.items():
        assert len(entry.lines) == -(-tier.sizes[key] // tier.line_bytes)


DTYPES = [np.float32, jnp.bfloat16, np.float16, np.int8, np.uint8, np.int32, np.bool_]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    line_bytes=st.sampled_from([4, 12, 64, 5]),
    lines=st.integers(4, 24),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "put", "get", "evict"]),
            st.integers(0, 5),  # key
            st.sampled_from(DTYPES),
            st.lists(st.integers(1, 7), min_size=1, max_size=2),  # shape
        ),
        min_size=1,
        max_size=40,
    ),
    seed=st.integers(0, 2**16),
)
def test_slab_keeps_bytes_exactly_through_pack_gather_eviction_and_reuse(
    line_bytes, lines, ops, seed
):
    """Random puts (new versions of a key reuse lines), gets and evictions, with L2 behind L1.

    Every block read back, from L1 (gathered from the slab), from L2 (demoted from a gather) or
    from L3 (written back from a gather), equals what was put, bit for bit; line accounting
    stays consistent, and lines freed by evictions are reused.
    """
    rng = np.random.default_rng(seed)
    store = cfj.write_store({"w": np.zeros((2, 2), np.float32)}, _url(), chunk_bytes=16)
    budget = lines * line_bytes
    cache = cfj.TieredCache(
        store,
        device_bytes=budget,
        host_bytes=budget,
        device_layout="slab",
        line_bytes=line_bytes,
        read_buffer=1,
    )
    tier = cache.tiers[0]
    assert isinstance(tier, SlabTier) and tier.budget == budget
    truth: dict[str, np.ndarray] = {}
    taken = 0
    for op, k, dtype, shape in ops:
        key = f"kv:{k}"
        if op == "put":
            value = _random(rng, tuple(shape), dtype)
            if tier.room(value.nbytes) > budget:
                continue
            free = len(tier.slab.free)
            cache.put(key, value)
            taken += max(0, free - len(tier.slab.free))
            truth[key] = value
        elif op == "get" and key in truth:
            assert _bitwise(cache.get(key), truth[key]), key
        elif op == "evict":
            cache.evict(key)
        _check_lines(tier)
        cache.check_budgets()
        assert tier.used <= tier.budget == tier.slab.array.nbytes
    for key, value in truth.items():
        assert _bitwise(cache.get(key), value), key
        _check_lines(tier)
    cache.flush()


def test_lines_are_reused_after_eviction():
    store = cfj.write_store(
        {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}, _url(), chunk_bytes=32
    )
    cache = cfj.TieredCache(
        store, device_bytes=64, host_bytes=0, device_layout="slab", line_bytes=16
    )
    tier = cache.tiers[0]
    assert tier.slab.num_lines == 4
    first = cache.get("w@0,0")
    lines0 = tier.table["w@0,0"].lines.tolist()
    cache.get("w@1,0")
    cache.evict("w@0,0")
    cache.get("w@2,0")  # takes the two lines w@0,0 left
    assert sorted(tier.table["w@2,0"].lines.tolist()) == sorted(lines0)
    assert _bitwise(cache.get("w@2,0"), np.arange(16, 24, dtype=np.float32).reshape(1, 8))
    assert _bitwise(first, np.arange(8, dtype=np.float32).reshape(1, 8))  # the caller's copy


def _live_device_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if stats is None else stats.get("bytes_in_use")


@pytest.mark.parametrize("layout", ["arrays", "slab"])
def test_device_memory_stays_flat_over_10000_get_evict_cycles(layout):
    """10,000 cycles of a get (an L2 -> L1 promotion) and an eviction (an L1 -> L2 demotion).

    With the slab, the only live device buffer is the slab itself before, during and after the
    cycles (and its buffer never moves), with the L2 block where L2 keeps it as a jax.Array (the
    CPU backend): nothing is allocated per block beyond the arrays handed to the caller, which are
    dropped here. With the arrays layout, each resident block is its own
    buffer, which the count shows, so the count is not blind.
    """
    # Arrays other tests left alive (a traceback's frame, say) are not this cache's: hold them
    # (so their ids stay theirs) and count only the others.
    gc.collect()
    others = jax.live_arrays()
    other_ids = {id(a) for a in others}

    def live() -> list:
        return [a for a in jax.live_arrays() if id(a) not in other_ids]

    store = cfj.write_store(
        {"w": np.random.default_rng(0).random((4, 256), np.float32)}, _url(), chunk_bytes=1024
    )
    keys = [f"w@{i},0" for i in range(3)]
    cache = cfj.TieredCache(
        store, device_bytes=2 * 1024, host_bytes=8 * 1024, device_layout=layout, read_buffer=1
    )
    for i in range(30):  # compile and settle
        cache.get(keys[i % 3])
    gc.collect()
    base = len(live())
    base_bytes = _live_device_bytes()
    resident = cache.stats()["tiers"]["device"]["blocks"]
    assert resident == 2
    # L2 keeps a demoted block as a jax.Array on the CPU backend (host memory already) and on a
    # GPU (in pinned_host memory, `host_memory`): count it.
    in_l2 = sum(isinstance(v, jax.Array) for v in cache.tiers[1].entries.values())
    assert base == (1 if layout == "slab" else resident) + in_l2
    if layout == "slab":
        pointer = cache.tiers[0].slab.array.unsafe_buffer_pointer()
    peak = 0
    for i in range(10_000):
        value = cache.get(keys[i % 3])
        del value
        if i % 1000 == 0:
            peak = max(peak, len(live()))
    gc.collect()
    assert len(live()) == base
    stats = cache.stats()
    assert stats["hits"]["host"] > 5000  # the cycles really moved blocks between the tiers
    if layout == "slab":
        assert peak <= base + 1  # at most the array just handed out
        assert cache.tiers[0].slab.array.unsafe_buffer_pointer() == pointer
    if base_bytes is not None:
        assert _live_device_bytes() == base_bytes


def test_budget_is_the_slab_size():
    store = cfj.write_store({"w": np.zeros((4, 64), np.float32)}, _url(), chunk_bytes=256)
    cache = cfj.TieredCache(store, device_bytes=1000, host_bytes=0, device_layout="slab")
    tier = cache.tiers[0]
    assert tier.line_bytes == default_line_bytes([256]) == 256
    assert tier.budget == 768 == tier.slab.array.nbytes  # 1000 rounded down to whole lines
    for i in range(4):
        cache.get(f"w@{i},0")
    assert cache.stats()["tiers"]["device"] == {
        "used": 768, "budget": 768, "blocks": 3, "pinned_bytes": 0, "pinned_blocks": 0
    }


def test_bad_layout_settings_are_named():
    store = cfj.write_store({"w": np.zeros((4, 64), np.float32)}, _url(), chunk_bytes=256)
    with pytest.raises(ValueError, match="device_layout='tiles' must be one of"):
        cfj.TieredCache(store, device_bytes=1024, host_bytes=0, device_layout="tiles")
    with pytest.raises(ValueError, match="line_bytes=64 applies to device_layout='slab' only"):
        cfj.TieredCache(store, device_bytes=1024, host_bytes=0, line_bytes=64)
    with pytest.raises(cfj.BudgetError, match="line_bytes=0 must be a positive integer"):
        cfj.TieredCache(store, device_bytes=1024, host_bytes=0, device_layout="slab", line_bytes=0)
