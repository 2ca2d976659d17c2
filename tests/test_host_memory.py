"""L2 in the device's pinned_host memory (``host_memory="pinned"``, the default on a GPU).

JAX's CPU backend has a ``pinned_host`` memory kind too, so the pinned path runs here when it is
asked for: blocks that leave L1 land in L2 as ``jax.Array``s in that memory, come back to L1 in
device memory, committed, with the same bytes, and reach L3 intact when they are written back.
"""

from __future__ import annotations

import uuid

import jax
import numpy as np
import pytest
from _bits import random_bits, same_bits

import cacheflow_jax as cfj

BLOCK = 4096  # bytes per stored block


def _store(tmp_path, blocks: int = 6) -> tuple[cfj.TensorStoreStore, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    data = random_bits(rng, (blocks, BLOCK // 4), np.float32)
    store = cfj.write_store({"w": data}, str(tmp_path / f"s{uuid.uuid4().hex}"),
                            chunk_bytes=BLOCK)  # fmt: skip
    return store, {key: np.asarray(store.read(key).result(timeout=30)) for key in store.keys()}


def _memory_kind(value) -> str | None:
    return value.sharding.memory_kind if isinstance(value, jax.Array) else None


@pytest.mark.parametrize("layout", ["arrays", "slab"])
def test_blocks_leaving_l1_live_in_pinned_host_memory_and_come_back_exact(tmp_path, layout):
    store, expected = _store(tmp_path)
    cache = cfj.TieredCache(store, device_bytes=2 * BLOCK, host_bytes=4 * BLOCK, read_buffer=1,
                            host_memory="pinned", device_layout=layout)  # fmt: skip
    host = cache.tiers[1]
    assert host.pinned is not None
    keys = list(expected)
    for _ in range(3):  # each pass demotes L1's blocks to L2 and promotes them back
        for key in keys:
            value = cache.get(key)
            assert _memory_kind(value) == "device" and value.committed
            assert same_bits(value, expected[key]), key
    demoted = [k for k in host.entries if isinstance(host.entries[k], jax.Array)]
    assert demoted, "no block came down from L1"
    assert all(_memory_kind(host.entries[k]) == "pinned_host" for k in demoted)
    for key in list(host.entries):  # promoted from pinned L2: device memory, exact bytes
        assert cache.tier_of(key) == "host"
        value = cache.get(key)
        assert _memory_kind(value) == "device" and same_bits(value, expected[key])
        assert cache.tier_of(key) == "device"
    cache.check_budgets()
    cache.close()


def test_a_runtime_block_written_back_from_pinned_l2_reaches_l3_intact(tmp_path):
    store, _ = _store(tmp_path)
    cache = cfj.TieredCache(store, device_bytes=2 * BLOCK, host_bytes=2 * BLOCK, read_buffer=1,
                            host_memory="pinned")  # fmt: skip
    rng = np.random.default_rng(1)
    puts = {f"kv/{i}": random_bits(rng, (BLOCK // 2,), np.uint16) for i in range(6)}
    for key, value in puts.items():  # L1 holds two: the rest go down to L2, then to L3
        cache.put(key, jax.device_put(value))
    assert any(_memory_kind(v) == "pinned_host" for v in cache.tiers[1].entries.values())
    cache.flush(timeout=30)
    for key, value in puts.items():
        assert same_bits(cache.get(key), value), key
    for key, value in puts.items():  # L3's copy, read by the store itself
        assert same_bits(cache.store.read(key).result(timeout=30), value), key
    cache.close()


def test_pytree_blocks_come_down_to_pinned_memory_leaf_by_leaf(tmp_path):
    """A KV block (a dict of arrays) demoted to pinned L2 has every leaf in pinned_host memory,
    none left on the device, and comes back exact."""
    store, _ = _store(tmp_path)
    cache = cfj.TieredCache(store, device_bytes=2 * BLOCK, host_bytes=8 * BLOCK, read_buffer=1,
                            host_memory="pinned")  # fmt: skip
    rng = np.random.default_rng(2)
    puts = {f"kv/{i}": {"k": random_bits(rng, (BLOCK // 4,), np.uint16),
                        "v": random_bits(rng, (BLOCK // 4,), np.uint16)} for i in range(4)}  # fmt: skip
    for key, block in puts.items():
        cache.put(key, jax.device_put(block), writeback=False)
    host = cache.tiers[1].entries
    assert host, "no block came down from L1"
    for key, block in host.items():
        assert sorted(block) == ["k", "v"]
        assert all(_memory_kind(leaf) == "pinned_host" for leaf in block.values()), key
    for key, block in puts.items():
        got = cache.get(key)
        assert all(_memory_kind(got[name]) == "device" for name in ("k", "v")), key
        assert same_bits(got["k"], block["k"]) and same_bits(got["v"], block["v"]), key
    cache.close()


def _l2_in_host_memory(cache) -> bool:
    """Every leaf in L2 is numpy or a pinned_host array: none holds device memory."""
    for block in cache.tiers[1].entries.values():
        for leaf in jax.tree.leaves(block):
            if isinstance(leaf, jax.Array) and _memory_kind(leaf) != "pinned_host":
                return False
    return True


@pytest.mark.parametrize("layout", ["arrays", "slab"])
def test_a_promotion_l1_has_no_room_for_stays_in_pinned_memory(tmp_path, layout):
    """A block promoted while pins hold all of L1 stays in L2, in pinned_host memory (not the
    device copy handed to the caller); L2 never holds device memory."""
    store, expected = _store(tmp_path, blocks=8)
    cache = cfj.TieredCache(store, device_bytes=2 * BLOCK, host_bytes=6 * BLOCK, read_buffer=1,
                            host_memory="pinned", device_layout=layout)  # fmt: skip
    keys = list(expected)
    hot, cold = keys[:2], keys[2:]
    for key in cold + hot:  # the cold blocks end in L2, the hot ones in L1
        cache.get(key)
    assert all(cache.tier_of(k) == "host" for k in cold)
    with cache.pinned(hot):  # L1 is all pinned: a promotion finds no room there
        for key in cold:
            value = cache.get(key)
            assert _memory_kind(value) == "device" and same_bits(value, expected[key])
            assert cache.tier_of(key) == "host", key
            assert _l2_in_host_memory(cache), key
    for key in keys:  # and everything comes back exact afterwards
        assert same_bits(cache.get(key), expected[key])
        assert _l2_in_host_memory(cache), key
    cache.check_budgets()
    cache.close()


def test_host_memory_setting(tmp_path):
    store, _ = _store(tmp_path)
    auto = cfj.TieredCache(store, device_bytes=2 * BLOCK, host_bytes=2 * BLOCK)
    # On JAX's CPU backend device memory is host memory: auto keeps L1's arrays as they are.
    assert (auto.tiers[1].pinned is None) == (jax.devices()[0].platform == "cpu")
    paged = cfj.TieredCache(store, device_bytes=2 * BLOCK, host_bytes=2 * BLOCK,
                            host_memory="pageable")  # fmt: skip
    assert paged.tiers[1].pinned is None
    with pytest.raises(ValueError, match="host_memory='paged' must be one of"):
        cfj.TieredCache(store, device_bytes=2 * BLOCK, host_bytes=2 * BLOCK, host_memory="paged")


def test_pinned_on_a_device_without_pinned_memory_names_the_setting(tmp_path, monkeypatch):
    import cacheflow_jax.cache.assembly as assembly

    store, _ = _store(tmp_path)
    monkeypatch.setattr(assembly, "has_pinned_host", lambda device: False)
    with pytest.raises(ValueError, match="host_memory='pinned': device .* has no pinned_host"):
        cfj.TieredCache(store, device_bytes=2 * BLOCK, host_bytes=2 * BLOCK, host_memory="pinned")
