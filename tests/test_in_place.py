"""Moves made under the lock without waiting (`cacheflow_jax.cache.in_place`, `Mover.in_place`):
the same decisions as the general path, the same objects, and no runtime block lost. On JAX's CPU
backend they copy nothing (``host_memory="auto"``); with L2 in pinned_host memory
(``"pinned"``, the default on a GPU, forced here) they are copies issued without waiting."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cacheflow_jax as cfj
import cacheflow_jax.cache.mover as mover_module

KIB = 1 << 10


def _kv(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {"k": rng.standard_normal((2, 16, 8)).astype(np.float32),
            "v": rng.standard_normal((2, 16, 8)).astype(np.float32)}  # fmt: skip


def _drive(
    root: Path, seed: int, host_memory: str
) -> tuple[list[str | None], dict[str, Any], list[bytes]]:
    """Puts 60 pytree blocks (2 KiB each) into a small L1/L2 and reads them in a skewed order
    through `get` and `get_many`; where every block ended up, the counters, and what was read."""
    cache = cfj.TieredCache(cfj.open_store(root, create=True), device_bytes=8 * 2 * KIB,
                            host_bytes=16 * 2 * KIB, host_memory=host_memory)  # fmt: skip
    keys = [f"kv:{i}" for i in range(60)]
    for i, key in enumerate(keys):
        cache.put(key, _kv(i))
    cache.flush()  # every block durable: no write-back timing in what follows
    rng = np.random.default_rng(seed)
    read = []
    for step in range(300):
        picks = [keys[int(j)] for j in rng.zipf(1.3, size=6) % 60]
        if step % 10 == 5:  # a batch of blocks mostly only L3 holds: read and moved together
            picks = [keys[int(j)] for j in rng.integers(0, 60, size=8)]
        got = cache.get_many(picks) if step % 2 else [cache.get(k) for k in picks]
        read += [np.asarray(b["k"]).tobytes() + np.asarray(b["v"]).tobytes() for b in got]
        for key, block in zip(picks, got):
            want = _kv(int(key.split(":")[1]))
            assert np.asarray(block["k"]).tobytes() == want["k"].tobytes(), key
    cache.check_budgets()
    stats = cache.stats()
    where = [cache.locate(k) for k in keys]
    cache.close()
    return where, {"hits": stats["hits"], "misses": stats["misses"]}, read


@pytest.mark.parametrize("host_memory", ["auto", "pinned"])
def test_in_place_promotions_decide_as_the_general_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_memory: str
) -> None:
    import cacheflow_jax.cache.demand as demand_module

    batched = []
    real = demand_module.finish_in_place

    def spy(mover: Any, owned: list, *args: Any) -> list:
        rest = real(mover, owned, *args)
        batched.append(len(owned) - len(rest))
        return rest

    monkeypatch.setattr(demand_module, "finish_in_place", spy)
    fast = _drive(tmp_path / "fast", seed=3, host_memory=host_memory)
    assert fast[1]["hits"]["host"] > 100  # the promotions under test happened
    assert sum(batched) > 50 and max(batched) >= 3  # so did batches of L3 reads moved at once
    # No L1 tier counts as one whose victims move without copies: the general path throughout.
    monkeypatch.setattr(mover_module, "DeviceTier", type("NoTier", (), {}))
    slow = _drive(tmp_path / "slow", seed=3, host_memory=host_memory)
    assert fast == slow


def test_an_in_place_promotion_returns_the_demoted_arrays(tmp_path: Path) -> None:
    cache = cfj.TieredCache(cfj.open_store(tmp_path / "s", create=True), device_bytes=2 * KIB,
                            host_bytes=8 * KIB, policy="lru")  # fmt: skip
    cache.put("a", _kv(0))
    first = cache.get("a")
    cache.put("b", _kv(1))  # L1 holds one block: "a" goes down to L2
    assert cache.locate("a") == "host"
    again = cache.get("a")
    assert cache.locate("a") == "device" and cache.locate("b") == "host"
    assert again["k"] is first["k"] and again["v"] is first["v"]  # no copy either way
    assert again["k"].committed and again["k"].sharding == first["k"].sharding
    assert cache.stats()["hits"]["host"] == 1


def test_runtime_blocks_pushed_out_by_in_place_promotions_stay_durable(tmp_path: Path) -> None:
    root = tmp_path / "s"
    cache = cfj.TieredCache(cfj.open_store(root, create=True), device_bytes=4 * 2 * KIB,
                            host_bytes=4 * 2 * KIB, policy="lru")  # fmt: skip
    for i in range(40):
        cache.put(f"kv:{i}", _kv(i))
        if i >= 8:
            cache.get_many([f"kv:{i - 8}", f"kv:{i - 4}"])  # promotions push blocks out of L2
    cache.close()
    with cfj.TieredCache(cfj.open_store(root), device_bytes=4 * 2 * KIB, host_bytes=0) as again:
        for i in range(40):
            got = again.get(f"kv:{i}")
            assert np.asarray(got["v"]).tobytes() == _kv(i)["v"].tobytes(), i


@pytest.mark.parametrize("host_memory", ["auto", "pinned"])
def test_concurrent_in_place_promotions_keep_budgets_and_bytes(
    tmp_path: Path, host_memory: str
) -> None:
    cache = cfj.TieredCache(cfj.open_store(tmp_path / "s", create=True), device_bytes=3 * 2 * KIB,
                            host_bytes=5 * 2 * KIB, host_memory=host_memory)  # fmt: skip
    for i in range(30):
        cache.put(f"kv:{i}", _kv(i))
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                picks = [f"kv:{int(j)}" for j in rng.integers(0, 30, size=3)]
                for key, block in zip(picks, cache.get_many(picks)):
                    want = _kv(int(key.split(":")[1]))["k"].tobytes()
                    assert np.asarray(block["k"]).tobytes() == want, key
                cache.check_budgets()
        except BaseException as e:  # reported below
            errors.append(e)

    def stager() -> None:  # batches staged into L2 (in holds of the lock) while others read
        rng = np.random.default_rng(99)
        try:
            for _ in range(100):
                cache.prefetch([f"kv:{int(j)}" for j in rng.integers(0, 30, size=6)]).result()
                cache.check_budgets()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    threads.append(threading.Thread(target=stager))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert not errors, errors[0]
    cache.check_budgets()
    stats = cache.stats()
    assert stats["hits"]["host"] > 0  # L2 hits were promoted while others read
    assert stats["misses"] > 50 and stats["prefetch"]["staged"] > 0  # and L3 blocks came up
    cache.close()


def _stage(root: Path, seed: int, host_memory: str) -> tuple[list[str | None], dict[str, Any]]:
    """Puts 80 blocks, then stages batches of 10 from L3 into an L2 of 6 between skewed reads;
    where every block ended up and the counters."""
    cache = cfj.TieredCache(cfj.open_store(root, create=True), device_bytes=6 * 2 * KIB,
                            host_bytes=6 * 2 * KIB, host_memory=host_memory)  # fmt: skip
    keys = [f"kv:{i}" for i in range(80)]
    for i, key in enumerate(keys):
        cache.put(key, _kv(i))
    cache.flush()
    rng = np.random.default_rng(seed)
    for _ in range(40):
        start = int(rng.integers(0, 70))
        cache.prefetch(keys[start : start + 10]).result()
        staged = [keys[start + int(j)] for j in rng.integers(0, 10, size=3)]
        got = cache.get_many(staged + [keys[int(j)] for j in rng.zipf(1.3, size=5) % 80])
        assert all(b["k"].shape == (2, 16, 8) for b in got)
    cache.check_budgets()
    stats = cache.stats()
    where = [cache.locate(k) for k in keys]
    cache.close()
    return where, {"hits": stats["hits"], "misses": stats["misses"],
                   "staged": stats["prefetch"]["staged"]}  # fmt: skip


@pytest.mark.parametrize("host_memory", ["auto", "pinned"])
def test_in_place_staging_decides_as_the_general_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_memory: str
) -> None:
    fast = _stage(tmp_path / "fast", seed=5, host_memory=host_memory)
    assert fast[1]["staged"] > 50  # blocks went into L2 in batches
    monkeypatch.setattr(mover_module, "DeviceTier", type("NoTier", (), {}))
    slow = _stage(tmp_path / "slow", seed=5, host_memory=host_memory)
    assert fast == slow


def test_only_arrays_on_l1s_own_placement_move_in_place() -> None:
    """`can_move_in_place`'s quick accept (a dict of arrays on L1's sharding, committed) takes
    what the full check takes and nothing else: an uncommitted leaf, a numpy leaf or a nested
    block goes through the full check, which refuses the first two."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    from cacheflow_jax.cache.in_place import can_move_in_place
    from cacheflow_jax.tiers.memory import DeviceTier

    tier = DeviceTier(64 * KIB)
    mover = SimpleNamespace(in_place=True, pinned_moves=False, tiers=[tier])  # what it reads
    first = {"k": tier.load(np.ones(4, np.float32))}  # a dtype's first leaf: the public call's
    assert can_move_in_place(mover, first)
    placed = {"k": tier.load(np.ones(4, np.float32)), "v": tier.load(np.zeros(4, np.float32))}
    assert all(leaf.sharding is tier.sharding for leaf in placed.values())  # the quick accept
    assert can_move_in_place(mover, placed)
    assert can_move_in_place(mover, {"layer": placed})  # nested: the full check says yes
    assert not can_move_in_place(mover, {"k": placed["k"], "v": jnp.zeros(4)})  # uncommitted
    assert not can_move_in_place(mover, {"k": placed["k"], "v": np.zeros(4, np.float32)})
    assert not can_move_in_place(SimpleNamespace(in_place=False, tiers=[tier]), placed)
    # With L2 in pinned_host memory: L1's arrays and L2's pinned copies of them both move.
    from cacheflow_jax.tiers.memory import HostTier

    host = HostTier(64 * KIB, pinned=tier.device)
    pinned = SimpleNamespace(in_place=True, pinned_moves=True, tiers=[tier, host])
    down = host.load(placed, owned=True)
    assert all(leaf.sharding.memory_kind == "pinned_host" for leaf in down.values())
    assert can_move_in_place(pinned, placed) and can_move_in_place(pinned, down)
    assert not can_move_in_place(pinned, {"k": down["k"], "v": np.zeros(4, np.float32)})
    assert not can_move_in_place(pinned, {"k": down["k"], "v": jnp.zeros(4)})


@pytest.mark.parametrize(("chars", "fits"), [(80, True), (81, False)])
def test_a_key_fits_a_file_name_once_percent_encoded(tmp_path: Path, chars: int,
                                                      fits: bool) -> None:  # fmt: skip
    """Every ':' becomes 3 characters: 80 of them make a 240-character name (the limit)."""
    from cacheflow_jax.store.runtime_format import check_runtime_key

    key = ":" * chars
    if fits:
        assert check_runtime_key(key) == key
    else:
        with pytest.raises(ValueError, match="too long"):
            check_runtime_key(key)
