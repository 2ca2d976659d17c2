"""The 10-second version of ``python -m bench.soak`` (issue 9): 8 threads, no wrong byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import run_soak


@pytest.mark.slow
def test_soak_8_threads_10_seconds(tmp_path: Path) -> None:
    result = run_soak(10.0, 8, seed=1, workdir=tmp_path)
    assert result["operations"] > 1000, result
    assert result["wrong_bytes"] == 0, result
    assert result["budget_violations"] == 0, result
    assert result["hangs"] == 0, result
    assert result["errors"] == 0, result
    assert result["lost_after_flush"] == 0, result
    assert result["lost_updates"] == 0 and result["reputs"] > 100, result
    assert result["rss_flat"], result
