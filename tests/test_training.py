"""Tests for `training`: example building, overfitting a tiny log, the run's outputs, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import predictor
from cacheflow_jax._trace import read_trace
from training import train


def _write_log(path: Path, n_steps: int = 40) -> Path:
    """A tiny serving-like access log v1: per step, 3 layers of (norm, two routed experts)."""
    rng = np.random.default_rng(0)
    rows = []
    for step in range(n_steps):
        for layer in range(3):
            t = step + layer / 10
            rows.append(
                {
                    "t": t,
                    "key": f"layers/{layer}/norm@0",
                    "nbytes": 64,
                    "kind": "weight",
                    "req": f"r{step}",
                }
            )
            for e in sorted(rng.choice(4, size=2, replace=False, p=[0.6, 0.2, 0.1, 0.1])):
                rows.append(
                    {
                        "t": t,
                        "key": f"layers/{layer}/experts/{e}/w@0,0",
                        "nbytes": 4096,
                        "kind": "weight",
                        "req": f"r{step}",
                    }
                )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_split_point_cuts_between_timestamps() -> None:
    t = np.array([0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 3.0])
    assert train.split_point(t, 0.5) == 5  # 4 would split timestamp 1.0
    assert train.split_point(np.zeros(10), 0.3) == 7  # one timestamp: plain count


def test_examples_label_candidates_within_the_window() -> None:
    keys = ["kv:0", "kv:1", "kv:2", "kv:0", "kv:1", "kv:2", "kv:0"]
    accesses = [predictor.Access(k, float(i), 1, "kv") for i, k in enumerate(keys)]
    cfg = predictor.FeatureConfig(lookahead=2, max_candidates=8)
    ex = train.build_examples(accesses, cfg, {"a": np.array([4])})["a"]
    state = predictor.FeatureState(cfg)
    for a in accesses[:5]:
        state.observe(a)
    cands = state.features_into(np.zeros((8, predictor.NUM_FEATURES), np.float32))
    labels = dict(zip(cands, ex.y[0, : len(cands)].tolist()))
    assert labels["kv:2"] == [1.0, 1.0]  # the next access
    assert labels["kv:0"] == [1.0, 0.0]  # within 2, not next
    assert ex.mask[0].sum() == len(cands)


def test_training_overfits_a_tiny_log(tmp_path: Path) -> None:
    # A deterministic log (a cycle of 12 blocks): every label follows from the features.
    path = tmp_path / "cycle.jsonl"
    path.write_text(
        "".join(
            json.dumps({"t": i / 12, "key": f"w{(i % 12) * 7}", "nbytes": 8, "kind": "weight"})
            + "\n"
            for i in range(240)
        )
    )
    accesses = train.accesses_of(read_trace(path))
    cfg = train.config(
        [str(path)],
        tmp_path / "out",
        epochs=40,
        batch_size=32,
        hidden=32,
        learning_rate=1e-2,
        progress=False,
    )
    ex = train.build_examples(
        accesses, cfg.feature_config(), {"all": np.arange(24, len(accesses) - 8)}
    )["all"]
    _, history = train.fit(cfg, ex, ex)
    assert history["initial_eval_loss"] > 0.5
    assert history["eval_loss"][-1][1] < 0.05


def test_run_writes_checkpoint_metrics_and_plot(tmp_path: Path) -> None:
    log = _write_log(tmp_path / "a.jsonl")
    other = _write_log(tmp_path / "b.jsonl", 15)
    cfg = train.config(
        [str(log)],
        tmp_path / "out",
        eval_logs=[str(other)],
        epochs=2,
        progress=False,
        timing_calls=50,
    )
    metrics = train.run(cfg)
    assert set(metrics["eval"]) == {"mlp", "last_successor", "markov", "stride"}
    for row in [*metrics["eval"].values(), *metrics["cross_eval"][str(other)].values()]:
        assert 0.0 <= row["precision"] <= 1.0 and 0.0 <= row["recall"] <= 1.0
    assert metrics["train_seconds"] > 0 and metrics["predict_us"] > 0
    out = tmp_path / "out"
    assert json.loads((out / "metrics.json").read_text())["eval"] == metrics["eval"]
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    loaded = predictor.load(out / "checkpoint")
    assert loaded.hedge == cfg.hedge and loaded.min_score == cfg.min_score
    again = train.evaluate_checkpoint(out / "checkpoint", [str(log)], timing_calls=10)
    assert again["eval"] == metrics["eval"]  # the saved model predicts what was evaluated


def _cacheflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cacheflow_jax.cli", *args], capture_output=True, text=True
    )


def test_cli_train_json_and_user_errors(tmp_path: Path) -> None:
    log = _write_log(tmp_path / "a.jsonl", 15)
    done = _cacheflow("train", str(log), "--out", str(tmp_path / "o"), "--epochs", "1", "--json",
                      "--no-progress", "--top-k", "2", "--lookahead", "4")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out["eval"]["mlp"]) == {"precision", "recall"}
    assert {"train_seconds", "predict_us"} <= set(out)
    missing = _cacheflow("train", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    bad = _cacheflow("train", str(log), "--out", str(tmp_path / "o"), "--eval-fraction", "1.5")
    assert bad.returncode == 2 and "--eval-fraction" in bad.stderr
    assert "Traceback" not in missing.stderr + bad.stderr


def test_config_rejects_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown training settings"):
        train.config(["x"], tmp_path, nope=1)
    with pytest.raises(ValueError, match="at least one access log"):
        train.config([], tmp_path)
    with pytest.raises(ValueError, match="--lookahead"):
        train.config(["x"], tmp_path, lookahead=0)
