"""Layer-ahead prefetch: the worker promotes L2 guesses to L1 (MoE offloading's step)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import cacheflow_jax as cfj

ROW = 256  # float32 elements per block: 1 KiB blocks
KIB = 1024


def _store(tmp_path: Path, rows: int = 32) -> tuple[cfj.TensorStoreStore, np.ndarray]:
    data = np.random.default_rng(0).standard_normal((rows, ROW)).astype(np.float32)
    return cfj.write_store({"w": data}, tmp_path / "s", chunk_bytes=ROW * 4), data


def _key(i: int) -> str:
    return f"w@{i},0"


class _Proposes:
    """A predictor that proposes fixed keys after every access."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def observe(self, access) -> None:
        pass

    def predict(self, k: int) -> list[tuple[str, float]]:
        return [(key, 0.9) for key in self.keys][:k]

    def reset(self) -> None:
        pass


def _wait_for(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.005)


def test_the_worker_promotes_an_l2_guess_to_l1(tmp_path: Path) -> None:
    store, data = _store(tmp_path)
    guess = _Proposes([])
    cache = cfj.TieredCache(store, device_bytes=4 * KIB, host_bytes=8 * KIB, policy="lru",
                            prefetcher=guess, prefetch=cfj.PrefetchSettings(k=2))  # fmt: skip
    with cfj.serving(cache) as s:
        for i in range(8):
            s.get(_key(i))  # L1: 4..7, L2: 0..3
        for i in range(3):
            s.get(_key(i))  # a loop: 0..2 come back up (reuse gap 8), 4..6 go down
        _wait_for(cache.prefetch_settled)
        assert cache.tier_of(_key(4)) == "host"
        issued = cache.stats()["prefetch"]["issued"]
        guess.keys = [_key(4)]  # what the loop wants after 3
        s.get(_key(3))  # an L2 hit; the worker then promotes 4 (LRU's victim 0 is due later)
        _wait_for(lambda: cache.tier_of(_key(4)) == "device")
        pf = cache.stats()["prefetch"]
        assert pf["promoted"] == 1 and pf["promoted_bytes"] == KIB
        assert pf["issued"] == issued  # nothing was read from L3 for it
        assert cache.tier_of(_key(0)) == "host"  # L1's victim went down, as on any promotion
        before = cache.stats()["hits"]["device"]
        assert np.array_equal(np.asarray(s.get(_key(4))), data[4:5])
        assert cache.stats()["hits"]["device"] == before + 1
        cache.check_budgets()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_promotion_swaps_two_blocks_and_pushes_nothing_out(tmp_path: Path, policy: str) -> None:
    """With L1 and L2 full, a promotion takes its block out of L2 before L1's victim comes down:
    the victim takes the promoted block's room, and every block stays in the cache."""
    store, data = _store(tmp_path)
    guess = _Proposes([])
    cache = cfj.TieredCache(store, device_bytes=4 * KIB, host_bytes=4 * KIB, policy=policy,
                            prefetcher=guess, prefetch=cfj.PrefetchSettings(k=2))  # fmt: skip
    with cfj.serving(cache) as s:
        for i in range(8):
            s.get(_key(i))
        for i in range(4):
            s.get(_key(i))  # a loop: 0..3 back up to L1, 4..7 down to L2; both tiers full
        _wait_for(cache.prefetch_settled)
        assert [cache.tier_of(_key(i)) for i in range(8)] == ["device"] * 4 + ["host"] * 4
        guess.keys = [_key(4)]  # what the loop wants after 3
        s.get(_key(3))  # an L1 hit; the worker then promotes 4
        _wait_for(lambda: cache.tier_of(_key(4)) == "device")
        _wait_for(cache.prefetch_settled)
        assert cache.stats()["prefetch"]["promoted"] == 1
        tiers = [cache.tier_of(_key(i)) for i in range(8)]
        assert tiers.count("device") == 4 and tiers.count("host") == 4, tiers
        misses = cache.stats()["misses"]
        for i in range(8):
            assert np.array_equal(np.asarray(s.get(_key(i))), data[i : i + 1])
        assert cache.stats()["misses"] == misses  # nothing had left for L3
        cache.check_budgets()


def test_a_promotion_refused_by_admission_leaves_the_block_in_l2(tmp_path: Path) -> None:
    store, data = _store(tmp_path)
    guess = _Proposes([])
    cache = cfj.TieredCache(store, device_bytes=4 * KIB, host_bytes=8 * KIB, policy="lru",
                            prefetcher=guess, prefetch=cfj.PrefetchSettings(k=8))  # fmt: skip
    with cfj.serving(cache) as s:
        for i in range(8):
            s.get(_key(i))  # L1: 4..7, each accessed once (no reuse gap), L2: 0..3
        _wait_for(cache.prefetch_settled)
        # Ranked 8th, key 1 is expected 8 accesses from now; every L1 block was accessed
        # within the last 4, so none may leave for it.
        guess.keys = [_key(i) for i in (4, 5, 6, 7, 0, 2, 3, 1)]
        s.get(_key(7))
        _wait_for(cache.prefetch_settled)
        time.sleep(0.05)
        assert cache.tier_of(_key(1)) == "host" and cache.stats()["prefetch"]["promoted"] == 0
        assert np.array_equal(np.asarray(s.get(_key(1))), data[1:2])
        cache.check_budgets()


def test_promote_false_never_moves_l2_blocks(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    cache = cfj.TieredCache(store, device_bytes=4 * KIB, host_bytes=8 * KIB, policy="lru",
                            prefetcher=_Proposes([_key(1)]),
                            prefetch=cfj.PrefetchSettings(k=2, promote=False))  # fmt: skip
    with cfj.serving(cache) as s:
        for _ in range(3):
            for i in range(8):
                s.get(_key(i))
        _wait_for(cache.prefetch_settled)
        assert cache.stats()["prefetch"]["promoted"] == 0
