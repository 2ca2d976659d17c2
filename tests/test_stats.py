"""``cacheflow stats``: LRU stack distances and the miss-ratio curve, against replay's LRU."""

from __future__ import annotations

from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from cacheflow_jax.replay.engine import replay
from cacheflow_jax.trace.reader import Trace, read_trace
from cacheflow_jax.trace.stats import stack_distances, trace_stats

TRACES = Path(__file__).resolve().parent.parent / "data" / "traces"
SHARED = {
    "mooncake": TRACES / "mooncake_synthetic_trace.jsonl",
    "cloudphysics": TRACES / "cloudPhysicsIO.csv.gz",
}


def _brute_force(ids: list[int], sizes: list[int]) -> tuple[list[float], list[float]]:
    """Stack distances by walking an explicit LRU stack (Mattson's definition)."""
    stack: list[int] = []
    keys, nbytes = [], []
    for x in ids:
        if x in stack:
            depth = stack.index(x)
            keys.append(depth + 1.0)
            nbytes.append(float(sum(sizes[y] for y in stack[: depth + 1])))
            stack.pop(depth)
        else:
            keys.append(np.inf)
            nbytes.append(np.inf)
        stack.insert(0, x)
    return keys, nbytes


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 11), min_size=1, max_size=200),
    st.lists(st.integers(1, 1000), min_size=12, max_size=12),
)
def test_stack_distances_match_an_explicit_lru_stack(ids: list[int], sizes: list[int]) -> None:
    keys, nbytes = stack_distances(np.array(ids), np.array(sizes))
    want_keys, want_bytes = _brute_force(ids, sizes)
    assert keys.tolist() == want_keys and nbytes.tolist() == want_bytes


def _trace(keys: list[str], sizes: list[int]) -> Trace:
    n = len(keys)
    return Trace("mem", np.arange(n, dtype=np.float64), keys, np.asarray(sizes, np.int64),
                 ["kv"] * n, [None] * n)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.sampled_from([1, 3, 8])), min_size=5,
                max_size=300))  # fmt: skip
def test_curve_equals_lru_replay_with_variable_sizes(accesses: list[tuple[int, int]]) -> None:
    # One size per key (replay gives every key its largest size).
    size_of = {k: s for k, s in accesses}
    keys = [f"k{k}" for k, _ in accesses]
    trace = _trace(keys, [size_of[k] for k, _ in accesses])
    largest = max(size_of.values())
    total = trace.distinct_bytes()
    sizes = sorted({largest, (largest + total) // 2, total})
    report = trace_stats(trace, sizes=[str(s) for s in sizes])
    for row in report["lru"]:
        got = replay(trace, device_bytes=row["cache_bytes"], host_bytes=0, policy="lru")
        assert row["miss_ratio"] == pytest.approx(got["miss_ratio"], abs=1e-12)
        assert row["byte_miss_ratio"] == pytest.approx(got["byte_miss_ratio"], abs=1e-12)


@pytest.mark.parametrize("name", sorted(SHARED))
def test_curve_matches_lru_replay_on_the_shared_traces(name: str) -> None:
    trace = read_trace(SHARED[name])
    report = trace_stats(trace, sizes=["1%", "5%", "10%", "20%"])
    assert report["method"].startswith("exact")
    for row in report["lru"]:
        got = replay(trace, device_bytes=row["cache_bytes"], host_bytes=0, policy="lru")
        assert abs(row["miss_ratio"] - got["miss_ratio"]) <= 0.001, (name, row, got)
        assert abs(row["byte_miss_ratio"] - got["byte_miss_ratio"]) <= 0.001, (name, row, got)


def test_summary_counts_keys_and_bytes_by_kind() -> None:
    keys = ["a", "b", "a", "c", "c", "c"]
    trace = Trace("mem", np.arange(6.0), keys, np.array([4, 8, 4, 2, 2, 2]),
                  ["weight", "kv", "weight", "kv", "kv", "kv"], [None] * 6)  # fmt: skip
    report = trace_stats(trace, sizes=["100%"])
    assert report["accesses"] == 6 and report["distinct_keys"] == 3
    assert report["distinct_bytes"] == 14 and not report["unit_size"]
    assert report["by_kind"] == {
        "weight": {"accesses": 2, "distinct_keys": 1, "distinct_bytes": 4},
        "kv": {"accesses": 4, "distinct_keys": 2, "distinct_bytes": 10},
    }
    # a (2 keys: b, a), c, c: depths 2, 1, 1; three first accesses.
    assert report["reuse"]["first_accesses"] == 3
    hist = {(r["lo"], r["hi"]): r["accesses"] for r in report["reuse"]["histogram"]}
    assert hist == {(1, 2): 2, (2, 4): 1}
    assert report["lru"][0]["miss_ratio"] == pytest.approx(3 / 6)  # only first accesses miss


def test_sampling_is_exact_at_rate_one_and_close_below_it() -> None:
    trace = read_trace(SHARED["mooncake"])
    exact = trace_stats(trace)
    assert trace_stats(trace, sample=1.0)["lru"] == exact["lru"]
    sampled = trace_stats(trace, sample=0.5)
    assert "SHARDS" in sampled["method"] and "estimate" in sampled["method"]
    for a, b in zip(sampled["lru"], exact["lru"]):
        assert abs(a["miss_ratio"] - b["miss_ratio"]) <= 0.02
    with pytest.raises(ValueError, match="--sample"):
        trace_stats(trace, sample=0.0)
