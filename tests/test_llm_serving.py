"""`bench.llm_serving` at a small size: every way serves, the tokens agree, the JSON holds the
figures the issue asks for. (The default size is the benchmark's, not a test's.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import llm_serving


@pytest.mark.slow
def test_llm_serving_small_run_has_equal_tokens_and_every_figure(tmp_path: Path) -> None:
    code = llm_serving.main([
        "--requests", "12", "--warm", "24", "--runs", "1", "--warmup", "0", "--chunk", "8",
        "--max-blocks", "8", "--json", "--out", str(tmp_path),
    ])  # fmt: skip
    assert code == 0
    doc = json.loads((tmp_path / "llm_serving.json").read_text())
    assert doc["results"]["tokens_equal"] is True
    summary = doc["results"]["summary"]
    assert list(summary) == list(llm_serving.WAYS)
    for way, row in summary.items():
        for field in ("ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms", "computed_share"):
            assert row[field] >= 0, (way, field)
    assert summary["recompute"]["computed_share"] == 1.0
    # Every cached way computes at least one block per request (the first token needs one), and
    # all-resident computes the fewest.
    least = summary["all-resident"]["computed_share"]
    assert all(summary[w]["computed_share"] >= least for w in summary)
    run = doc["results"]["runs"][0]
    assert run["cacheflow"]["writebacks"]["stalls"] >= 0
    assert {"device", "host", "store"} >= set(run["cacheflow"]["hits"])
    labels = {v["label"] for v in doc["targets"]}
    assert "cacheflow / recompute (TTFT p95)" in labels
    assert doc["settings"]["model_flops_per_kv_byte"] * 4 >= doc["settings"]["llama_1b_flops_per_kv_byte"]
    # The warm-up's blocks were kept for the next run, which reads them instead of computing.
    assert list(tmp_path.glob("llm_serving_warmup_*.npz"))
