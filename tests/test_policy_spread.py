"""bench.policy_spread: the miss-ratio curve at unit steps around a point (issue 29's measure)."""

from __future__ import annotations

from pathlib import Path

from bench import policy_spread

TRACES = Path(__file__).resolve().parent.parent / "data" / "traces"


def test_spread_rise_and_roughness_of_curves_at_unit_steps() -> None:
    trace = str(TRACES / "lirs_backf.txt.gz")
    found = policy_spread.run([trace], ["5%", "20%"], workers=1, policies=["lfu", "lru"],
                              peers=["ARC"])  # fmt: skip
    points = found[trace]["points"]
    assert found[trace]["step"] == 1  # a unit-size trace: one step is one block
    for point in points.values():
        caps = point["capacities"]
        assert caps == list(range(caps[0], caps[0] + 9))
        # LRU has the inclusion property: one more block never costs a hit.
        lru = point["miss_ratio"]["lru"]
        assert all(b <= a for a, b in zip(lru, lru[1:]))
    table = policy_spread.rows(found)
    assert len(table) == 2
    for row in table:
        for name in ("lfu", "lru", "lcs:ARC"):
            assert row["rise"][name] <= row["spread"][name] + 1e-12
            assert -1e-12 <= row["roughness"][name] <= row["spread"][name] + 1e-12
        assert row["rise"]["lru"] == 0.0
    s = policy_spread.summary(table)
    assert s["points"] == 2 and 0 <= s["points_met"] <= 2
    assert "roughness" in policy_spread.format_summary(s)


def test_curves_helpers() -> None:
    assert policy_spread.spread([0.5, 0.4, 0.45]) == 0.5 - 0.4
    assert abs(policy_spread.rise([0.5, 0.4, 0.45]) - 0.05) < 1e-12
    assert abs(policy_spread.roughness([0.5, 0.4, 0.45]) - 0.05) < 1e-12
    assert policy_spread.roughness([0.5, 0.45, 0.4]) == 0.0  # steep but monotone
    assert policy_spread.spread([0.5, None]) is None
