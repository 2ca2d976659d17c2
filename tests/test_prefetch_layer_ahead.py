"""Layer-ahead prefetch: reuse-gap admission in the planner, and L2 -> L1 promotion by the worker."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import cacheflow_jax as cfj
from cacheflow_jax._planner import REFUSED, Planner
from cacheflow_jax._policy import get_policy

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


def _loop_planner(loop: int, resident: int) -> Planner:
    """A planner over LRU after two rounds of a loop of ``loop`` keys, the last ``resident`` in L1."""
    planner = Planner(get_policy("lru"), 2, has_host=False, tracking=True)
    for rnd in range(2):
        for i in range(loop):
            key = _key(i)
            planner.access(key, float(rnd * loop + i))
            if rnd == 0:
                if i >= resident:
                    planner.remove(0, _key(i - resident))
                planner.insert(0, key, float(i), KIB)
    return planner


def test_a_victim_due_later_than_the_guess_makes_room() -> None:
    # A loop of 8 keys, the last 4 in L1. LRU's victim (key 4) was accessed 3 accesses ago, but
    # its reuse gap (8) says it is due in 5. A guess ranked 4th is expected within 4 accesses:
    # by recency alone the victim would stay; by its gap it is needed after the guess, so it
    # makes room. Ranked 5th or later, the guess is needed no sooner than the victim: refused.
    planner = _loop_planner(8, 4)
    assert planner.victim(0, _key(0), prefetch=True, min_age=4.0) == _key(4)
    assert planner.victim(0, _key(0), prefetch=True, min_age=5.0) is REFUSED
    assert planner.victim(0, _key(0), prefetch=True, min_age=6.0) is REFUSED


def test_a_victim_without_a_gap_keeps_the_recency_rule() -> None:
    planner = Planner(get_policy("lru"), 2, has_host=False, tracking=True)
    for i in range(4):
        planner.access(_key(i), float(i))
        planner.insert(0, _key(i), float(i), KIB)
    # Key 0 was accessed once, 3 accesses ago: a guess expected within 3 may not displace it.
    assert planner.victim(0, _key(9), prefetch=True, min_age=3.0) is REFUSED
    assert planner.victim(0, _key(9), prefetch=True, min_age=2.0) == _key(0)


def test_an_overdue_victim_makes_room() -> None:
    planner = _loop_planner(8, 4)
    for i in range(8, 14):  # the loop breaks off: keys 4..7 are not accessed again
        planner.access(_key(i), float(16 + i))
    # Key 4's gap (8) has passed without an access: the estimate failed, it is not kept.
    planner.remove(0, _key(5))
    planner.remove(0, _key(6))
    planner.remove(0, _key(7))
    assert planner.victim(0, _key(0), prefetch=True, min_age=8.0) == _key(4)


def test_reuse_gaps_survive_tier_moves_and_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    planner = Planner(get_policy("lru"), 2, has_host=True, tracking=True)
    planner.access("a", 0.0)
    planner.insert(0, "a", 0.0, KIB)
    _, seen = planner.remove(0, "a")
    planner.insert(1, "a", 1.0, KIB, seen=seen)  # demoted
    planner.access("b", 2.0)
    planner.access("a", 3.0)
    assert planner.gap["a"] == 2
    _, seen = planner.remove(1, "a")  # it leaves the cache; its gap is known when it returns
    planner.access("b", 4.0)
    planner.access("a", 5.0)
    assert planner.gap["a"] == 2
    monkeypatch.setattr("cacheflow_jax._planner.GAP_KEYS", 16)
    for i in range(100):  # keys accessed twice, then dropped
        key = f"k{i}"
        planner.access(key, 6.0 + i)
        planner.insert(1, key, 6.0 + i, KIB)
        planner.access(key, 6.0 + i)
        planner.remove(1, key)
    assert len(planner.left) <= 17 and len(planner.gap) <= 17


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
        _wait_for(lambda: cache._pf_worker.idle and not cache._pf_worker.feed)
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


def test_a_promotion_refused_by_admission_leaves_the_block_in_l2(tmp_path: Path) -> None:
    store, data = _store(tmp_path)
    guess = _Proposes([])
    cache = cfj.TieredCache(store, device_bytes=4 * KIB, host_bytes=8 * KIB, policy="lru",
                            prefetcher=guess, prefetch=cfj.PrefetchSettings(k=8))  # fmt: skip
    with cfj.serving(cache) as s:
        for i in range(8):
            s.get(_key(i))  # L1: 4..7, each accessed once (no reuse gap), L2: 0..3
        _wait_for(lambda: cache._pf_worker.idle and not cache._pf_worker.feed)
        # Ranked 8th, key 1 is expected 8 accesses from now; every L1 block was accessed
        # within the last 4, so none may leave for it.
        guess.keys = [_key(i) for i in (4, 5, 6, 7, 0, 2, 3, 1)]
        s.get(_key(7))
        _wait_for(lambda: cache._pf_worker.idle and not cache._pf_worker.feed)
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
        _wait_for(lambda: cache._pf_worker.idle and not cache._pf_worker.feed)
        assert cache.stats()["prefetch"]["promoted"] == 0
