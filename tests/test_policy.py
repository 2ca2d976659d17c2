"""Unit tests of the policies in `cacheflow_jax._policy`, driven the way `TieredCache` drives them."""

from __future__ import annotations

import math
import random

import pytest

from cacheflow_jax._policy import (
    _GBYTES,
    _GWINDOW,
    _WINDOW,
    _share,
    get_policy,
    lfu,
    lfu_plain,
    lru,
)


def _drive(policy, keys, capacity, now=None):
    """Single tier, unit sizes, the call order of `TieredCache._room_sync`; returns misses."""
    state = policy.init(1)
    resident: set = set()
    misses = 0
    for i, key in enumerate(keys):
        t = float(i) if now is None else now(i)
        policy.access(state, key, t)
        for k in policy.expired(state, 0, t):
            policy.remove(state, 0, k)
            resident.discard(k)
        if key in resident:
            continue
        misses += 1
        admitted = True
        while len(resident) >= capacity:
            v = policy.victim(state, 0)
            assert v in resident
            if not policy.admit(state, key, v):
                admitted = False
                break
            policy.remove(state, 0, v)
            resident.discard(v)
        if admitted:
            policy.insert(state, 0, key, t)
            resident.add(key)
    return misses, state, resident


def _zipf_keys(n, seed=0):
    rng = random.Random(seed)
    return [f"k{int(rng.paretovariate(0.8)) % 200}" for _ in range(n)]


def test_window_one_is_exact_lru():
    keys = _zipf_keys(3000)
    for cap in (5, 20, 50):
        assert _drive(lfu(half_life=1e-3, window=1.0), keys, cap)[0] == _drive(lru(), keys, cap)[0]


def test_scan_does_not_flush_the_hot_set():
    hot = [f"h{i}" for i in range(8)]
    keys = hot * 20 + [f"s{i}" for i in range(500)]
    _, _, resident = _drive(lfu(), keys, 10)
    assert set(hot) <= resident


def test_loop_larger_than_the_cache_keeps_hits():
    # LRU gets no hits on a cyclic loop larger than the cache; the protected segment keeps some.
    loop = [f"k{i}" for i in range(120)] * 20
    assert _drive(lru(), loop, 100)[0] == len(loop)
    assert _drive(lfu(), loop, 100)[0] < 0.5 * len(loop)


def test_adaptive_half_life_stays_in_bounds_and_is_reported():
    keys = _zipf_keys(60000, seed=3)
    _, state, _ = _drive(lfu(half_life=None), keys, 30)
    info = lfu(half_life=None).describe(state)
    assert info["adaptive"] is True
    assert 2.0**8 <= info["half_life"] <= 2.0**20
    fixed = lfu(half_life=100.0)
    _, s2, _ = _drive(fixed, keys[:5000], 30)
    assert fixed.describe(s2)["half_life"] == 100.0 and fixed.describe(s2)["adaptive"] is False


def test_ttl_expires_idle_residents_from_both_segments():
    p = lfu(ttl=10.0)
    s = p.init(1)
    for key in ("a", "b", "c"):
        p.access(s, key, 0.0)
        p.insert(s, 0, key, 0.0)
    p.access(s, "a", 0.0)  # a window hit: "a" may be promoted to the protected segment
    p.access(s, "c", 12.0)
    assert sorted(p.expired(s, 0, 12.0)) == ["a", "b"]


def test_bookkeeping_is_released_with_the_ghosts():
    p = lfu(ghost_entries=16)
    keys = [f"k{i}" for i in range(1000)]
    _, state, resident = _drive(p, keys, 8)
    assert len(state.prio) <= 16 + len(resident)
    assert set(state.prio) == set(state.last)
    assert state.params[_GBYTES] == sum(g if g >= 0 else -g - 1 for g in state.ghosts.values())
    assert state.params[_GWINDOW] == sum(g for g in state.ghosts.values() if g > 0)


def test_names_and_validation():
    assert lfu().name == "lfu" and lfu_plain().name == "lfu-plain"
    assert get_policy("lfu").name == "lfu"
    for bad in ({"half_life": 0}, {"count_cap": 0.5}, {"window": 1.5}, {"ghost_entries": -1}):
        with pytest.raises(ValueError):
            lfu(**bad)
    assert lfu(half_life=math.inf).describe(lfu(half_life=math.inf).init(1))["half_life"] is None
    default = lfu().describe(lfu().init(1))
    assert default["adaptive"] is True  # the default half-life adapts online


def test_lfu_judges_batched_misses_like_single_ones(monkeypatch):
    """get_many accesses several missing keys before inserting them: same placement as one by one.

    Each key must be judged on its own priority before its access. The window share's adaptation
    is switched off here: it reacts to the ghosts that earlier inserts of the batch take away,
    so a batch may move the share by a step more or less than one-by-one accesses would.
    """
    import cacheflow_jax._policy as policy_module

    monkeypatch.setattr(policy_module, "_adapt_window", lambda state, key: None)

    def placement(batched: bool) -> list:
        policy = lfu(half_life=64.0)
        state = policy.init(1)
        rng = random.Random(3)
        for i in range(300):  # fill and churn a 40-entry tier so main and window both matter
            key = f"k{rng.randrange(120)}"
            policy.access(state, key, float(i))
            if key not in state.main[0] and key not in state.window[0]:
                while len(state.main[0]) + len(state.window[0]) >= 40:
                    policy.remove(state, 0, policy.victim(state, 0))
                policy.insert(state, 0, key, float(i))
        batch = ["k5", "k77", "k118", "k3"]
        misses = [k for k in batch if k not in state.main[0] and k not in state.window[0]]
        for _ in misses:
            policy.remove(state, 0, policy.victim(state, 0))
        if batched:
            for k in batch:
                policy.access(state, k, 400.0)
            for k in misses:
                policy.insert(state, 0, k, 400.0)
        else:
            for k in batch:
                policy.access(state, k, 400.0)
                if k in misses:
                    policy.insert(state, 0, k, 400.0)
        return [(k, k in state.main[0]) for k in misses]

    assert placement(batched=True) == placement(batched=False)


def _drive_sized(policy, keys, sizes, budget):
    """Single tier with byte sizes, the call order of `TieredCache._room_sync`."""
    state = policy.init(1)
    resident: dict = {}
    used = 0
    for i, key in enumerate(keys):
        t = float(i)
        policy.access(state, key, t)
        if key in resident:
            continue
        n = sizes[key]
        while used + n > budget:
            v = policy.victim(state, 0)
            policy.remove(state, 0, v)
            used -= resident.pop(v)
        policy.insert(state, 0, key, t, n)
        resident[key] = n
        used += n
        window_bytes, main_bytes = state.nbytes[0]
        assert window_bytes + main_bytes == used  # the policy's byte accounting is exact
        assert window_bytes == sum(resident[k] for k in state.window[0])
    return state, resident


def test_big_one_hit_newcomers_churn_the_window_not_the_hot_set():
    # 40 small hot keys fill main; then one-hit keys, small and 16x bigger, interleaved with the
    # hot ones: the newcomers displace each other in the window (sized in bytes), never a hot key.
    hot = [f"h{i}" for i in range(40)]
    sizes = dict.fromkeys(hot, 1)
    keys = hot * 5
    for i in range(300):
        sizes[f"s{i}"], sizes[f"b{i}"] = 1, 16
        keys += [f"s{i}", hot[i % 40], f"b{i}", hot[(i + 20) % 40]]
    state, resident = _drive_sized(lfu(half_life=1e6), keys, sizes, 64)
    assert set(hot) <= set(resident)


def test_window_adapts_to_ghost_hits_and_stays_in_bounds():
    policy = lfu(half_life=4096.0, window=0.01)
    # A loop of 24 keys through a 20-entry cache: the keys that cycle through the window leave
    # it and come back a few evictions later, so the window grows (ARC's B1 hits).
    keys = [f"k{i % 24}" for i in range(3000)]
    state, resident = _drive_sized(policy, keys, {f"k{i}": 1 for i in range(24)}, 20)
    d = policy.describe(state)
    assert d["window"] == 0.01 and 0.01 < d["window_now"] <= 0.9
    grown = d["window_now"]
    # Steps are ARC's: one entry's worth times max(1, |B2| / |B1|) on a B1 hit (a window ghost),
    # times max(1, |B1| / |B2|) on a B2 hit (a protected one); here the ghosts' bytes.
    b1 = sum(g for g in state.ghosts.values() if g > 0)
    b2 = sum(-g - 1 for g in state.ghosts.values() if g < 0)
    assert b2 > b1 > 0
    step = 1 / (len(resident) + 1)
    back = next(k for k, g in reversed(state.ghosts.items()) if g > 0)  # left the window last
    policy.access(state, back, 1.0)
    assert policy.describe(state)["window_now"] == pytest.approx(min(grown + step * b2 / b1, 0.9))
    grown = policy.describe(state)["window_now"]
    # A protected key evicted and missed right away (a B2 hit) shrinks it: B2 outnumbers B1 by
    # then, so by one entry's worth.
    protected = next(iter(state.main[0]))
    policy.remove(state, 0, protected)
    del resident[protected]
    policy.access(state, protected, 1.0)
    assert policy.describe(state)["window_now"] == pytest.approx(grown - 1 / (len(resident) + 1))


def test_a_window_ghost_back_soon_is_protected_and_one_back_late_is_not():
    def run(evict_first: int) -> tuple:
        policy = lfu(half_life=4096.0)
        # A loop of 24 keys through a 20-entry cache: k9 has just left from the window.
        keys = [f"k{i % 24}" for i in range(3000)]
        state, resident = _drive_sized(policy, keys, {f"k{i}": 1 for i in range(24)}, 20)
        assert state.ghosts["k9"] > 0  # a window ghost
        for _ in range(evict_first + 1):  # room for k9, and maybe more evictions before it
            policy.remove(state, 0, policy.victim(state, 0))
        age = state.params[17] - state.stamps["k9"]  # _EVICTED: bytes removed since it left
        policy.access(state, "k9", 3000.0)
        policy.insert(state, 0, "k9", 3000.0)
        return "k9" in state.main[0], age, state.nbytes[0][1]

    protected, age, main_bytes = run(0)
    assert protected and age <= main_bytes  # ARC's B1 hit: into the protected segment
    protected, age, main_bytes = run(16)
    assert not protected and age > main_bytes  # gone longer than B1 would remember: the window


def test_the_window_share_is_of_the_whole_cache_across_tiers():
    policy = lfu(window=0.01)
    state = policy.init(2)
    state.params[_WINDOW] = 0.3  # as adapted
    state.nbytes[0][:] = [2, 98]  # L1: window, protected bytes
    state.nbytes[1][:] = [100, 300]  # L2
    assert _share(state, 0) == 0.01  # L1 keeps the least share while L2 holds blocks
    # L2 holds the rest of the window, so that both tiers together have 30% in their windows.
    assert 2 + _share(state, 1) * 400 == pytest.approx(0.3 * 500)
    state.nbytes[0][:] = [200, 0]  # L1's window alone is over the share: L2 keeps none
    assert _share(state, 1) == 0.0
    state.nbytes[1][:] = [0, 0]  # nothing below L1: it has the adapted share itself
    assert _share(state, 0) == 0.3


def test_ghost_history_is_bounded_in_bytes():
    rng = random.Random(1)
    sizes = {f"k{i}": rng.choice([1, 4, 64]) for i in range(5000)}
    keys = [f"k{int(rng.paretovariate(0.6)) % 5000}" for _ in range(20000)]
    policy = lfu(history=1.0)
    state, resident = _drive_sized(policy, keys, sizes, 2000)
    ghost_bytes = sum(sizes[k] for k in state.ghosts if k not in resident)
    assert len(state.ghosts) <= 64 or ghost_bytes <= sum(resident.values()) + 64
    assert set(state.stamps) <= set(state.ghosts)
    # The running byte counts of all ghosts and of the window's (ARC's B1) match the ghosts.
    assert state.params[_GBYTES] == sum(g if g >= 0 else -g - 1 for g in state.ghosts.values())
    assert state.params[_GWINDOW] == sum(g for g in state.ghosts.values() if g > 0)
    with pytest.raises(ValueError, match="history"):
        lfu(history=0)
