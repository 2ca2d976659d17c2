"""`lfu`'s batched ``hits`` leaves the state exactly as ``access`` of each key would.

The cache applies its buffered L1 hits with ``Policy.hits`` when a policy has it; the result must
be the same to the bit, or the live cache and replay would drift apart. The batches here mix
hits with keys that are no longer resident (they go through ``access``), over one and two tiers,
with and without a TTL, through the cold start, the shadows' jumps and the half-life's changes.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheflow_jax.policies import lfu, lru


def _drive(policy, ops, *, use_hits: bool, tiers: int, capacity: int):
    """Runs ``ops`` (a list of key batches) through a small cache of ``capacity`` blocks per tier
    and returns the policy's state. Misses go through ``access`` and room is made with
    ``victim``/``remove``/``insert``; each batch's hits go through ``hits`` or ``access``."""
    state = policy.init(tiers)
    where: dict = {}  # key -> tier
    now = 0.0
    for batch in ops:
        now += 1.0
        hits = [k for k in batch if k in where]
        if use_hits:
            policy.hits(state, hits, now)
        else:
            for k in hits:
                policy.access(state, k, now)
        for k in batch:
            if k in where:
                continue
            policy.access(state, k, now)
            for tier in range(tiers):
                held = [x for x, t in where.items() if t == tier]
                if len(held) < capacity:
                    break
                gone = policy.victim(state, tier)
                if gone is None or where.get(gone) != tier:
                    break
                del where[gone]
                policy.remove(state, tier, gone)
            else:
                continue
            policy.insert(state, 0, k, now, 64 + (hash(k) % 3) * 32)
            where[k] = 0
    return state


def _snapshot(state) -> dict:
    out = {}
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if field.name == "sims":
            value = None if value is None else (
                value.shift, value.live, value.budget,
                [(s.setting, s.hits, dict(s.sizes)) for s in value.shadows],
            )
        elif isinstance(value, dict):
            value = list(value.items())  # the order matters (LRU lists)
        out[field.name] = value
    return out


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    keys=st.integers(4, 200),
    capacity=st.integers(2, 80),
    tiers=st.sampled_from([1, 2]),
    ttl=st.sampled_from([None, 5.0]),
)
def test_hits_equal_accesses(seed: int, keys: int, capacity: int, tiers: int, ttl) -> None:
    rng = random.Random(seed)
    hot = max(2, keys // 4)
    ops = [
        [f"k{rng.randrange(hot) if rng.random() < 0.7 else rng.randrange(keys)}"
         for _ in range(rng.randrange(1, 70))]
        for _ in range(60)
    ]  # fmt: skip
    policy = lfu(ttl=ttl)
    a = _drive(policy, ops, use_hits=False, tiers=tiers, capacity=capacity)
    b = _drive(policy, ops, use_hits=True, tiers=tiers, capacity=capacity)
    assert _snapshot(a) == _snapshot(b)


def test_hits_of_a_large_cycle_equal_accesses() -> None:
    """The benchmark's pattern: every key resident, hit in the same order each round (each a
    probation hit that pushes protected's oldest back), sampled by the shadows."""
    policy = lfu()
    keys = [f"blocks@{i},0" for i in range(1024)]
    order = keys[:]
    random.Random(1).shuffle(order)
    states = []
    for use_hits in (False, True):
        state = policy.init(1)
        for k in keys:
            policy.access(state, k, 0.0)
            policy.insert(state, 0, k, 0.0, 1024)
        for _ in range(3):
            for i in range(0, len(order), 64):
                if use_hits:
                    policy.hits(state, order[i:i + 64], 1.0)
                else:
                    for k in order[i:i + 64]:
                        policy.access(state, k, 1.0)
        states.append(_snapshot(state))
    assert states[0]["sims"] is not None and states[0]["sims"][0] > 0  # the shadows sample
    assert states[0] == states[1]


@pytest.mark.parametrize("make", [lru])
def test_policies_without_hits_leave_it_none(make) -> None:
    assert make().hits is None
    assert lfu().hits is not None
