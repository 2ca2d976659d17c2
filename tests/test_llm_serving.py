"""`bench.llm_serving` at a small size: every way serves, the tokens agree, the JSON holds the
figures the issue asks for. (The default size is the benchmark's, not a test's.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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


class _SlowYardstick(llm_serving.Way):
    """A way whose every store spends ``pause`` seconds measuring (counted as harness time)."""

    def __init__(self, pause: float) -> None:
        super().__init__()
        self.pause = pause

    def store(self, key: str, block: dict) -> None:
        import time

        start = time.perf_counter()
        time.sleep(self.pause)
        self.harness_seconds += time.perf_counter() - start


@pytest.mark.slow
def test_engine_clock_leaves_out_measurement_and_reuses_buffers() -> None:
    cfg = llm_serving.DecoderConfig(max_blocks=4)
    engine = llm_serving.Engine(cfg)
    engine.warm_up()
    rng = np.random.default_rng(0)
    ids = [[int(rng.integers(0, 50)) for _ in range(3)] for _ in range(6)]
    reqs = llm_serving.make_requests(ids, cfg, [2] * len(ids))
    stores = sum(len(r.keys) for r in reqs)
    plain = llm_serving.Server(engine, llm_serving.Way(), chunk=8).serve(llm_serving.fresh(reqs))
    server = llm_serving.Server(engine, _SlowYardstick(0.02), chunk=8)
    timed = llm_serving.fresh(reqs)
    busy = server.serve(timed)
    # Every store slept 20 ms (stores * 20 ms in all); none of it is engine time.
    assert busy < plain + 0.5 * stores * 0.02, (busy, plain, stores)
    # Finished requests gave their buffers back, and later requests took them again.
    assert all(r.buf_k is None for r in timed)
    assert 0 < len(server._free) < len(timed)
