"""Tests for `training`: example building, overfitting a tiny log, the run's outputs, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import predictor
from cacheflow_jax.trace.reader import read_trace
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


def test_a_position_without_candidates_is_an_all_masked_example() -> None:
    # The first access of a stream whose keys have no 1-d index proposes no candidate at all
    # (no successor, no frontier): its example is empty, not an error.
    keys = ["e@0,0", "f@0,0", "e@0,0"]
    accesses = [predictor.Access(k, float(i), 1, "weight") for i, k in enumerate(keys)]
    cfg = predictor.FeatureConfig(lookahead=2, max_candidates=8)
    ex = train.build_examples(accesses, cfg, {"a": np.array([0, 1])})["a"]
    assert ex.mask[0].sum() == 0 and ex.y[0].sum() == 0
    assert ex.mask[1].sum() >= 1


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
    sel = metrics["selected"]
    assert sel["source"] == "validation"
    assert sel["min_score"] in cfg.min_score_grid and sel["hedge"] in cfg.hedge_grid
    assert (loaded.min_score, loaded.hedge) == (sel["min_score"], sel["hedge"])
    assert predictor.read_meta(out / "checkpoint")["extra"]["selected"] == sel
    val = metrics["validation"]
    assert len(val["grid"]) == len(cfg.min_score_grid) * len(cfg.hedge_grid)
    assert train.select(val["grid"], val["precision_floor"]) == val["mlp"]
    (v0, v1), start = val["slices"][str(log)], metrics["logs"][str(log)]["start"]
    assert 0 < v0 < v1 == start
    again = train.evaluate_checkpoint(out / "checkpoint", [str(log)], timing_calls=10)
    assert again["eval"] == metrics["eval"]  # the saved model predicts what was evaluated


def _tail_changed(src: Path, dst: Path, eval_fraction: float) -> Path:
    """``src`` with new keys in its eval tail (same length, times and sizes)."""
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    start = train.split_point(np.array([r["t"] for r in rows]), eval_fraction)
    for i, r in enumerate(rows[start:]):
        r["key"] = f"layers/{i % 3}/experts/{(i * 7) % 11}/w@0,0" if i % 2 else f"other/{i}"
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dst


def test_selection_never_reads_the_eval_tail(tmp_path: Path) -> None:
    log = _write_log(tmp_path / "a.jsonl")
    changed = _tail_changed(log, tmp_path / "b.jsonl", 0.3)
    runs = []
    for i, path in enumerate((log, changed)):
        cfg = train.config(
            [str(path)], tmp_path / f"out{i}", epochs=2, progress=False, timing_calls=10
        )
        runs.append(train.run(cfg))
    a, b = runs
    assert a["logs"][str(log)]["start"] == b["logs"][str(changed)]["start"]
    assert a["eval"] != b["eval"]  # the tail did change what is evaluated
    assert a["selected"] == b["selected"]
    for part in ("grid", "baselines", "precision_floor", "mlp"):
        assert a["validation"][part] == b["validation"][part]


def test_validation_labels_stop_at_the_eval_tail() -> None:
    keys = ["a", "b", "c", "a", "b", "c", "x", "y"]
    accesses = [predictor.Access(k, float(i), 1, "kv") for i, k in enumerate(keys)]
    cfg = predictor.FeatureConfig(lookahead=3, max_candidates=8)
    pos = {"cut": np.array([4]), "full": np.array([4])}
    ex = train.build_examples(accesses, cfg, pos, ends={"cut": 6}, keep_keys=("cut",))
    assert ex["cut"].keys is not None and ex["full"].keys is None
    cands = ex["cut"].keys[0]
    cut = dict(zip(cands, ex["cut"].y[0, : len(cands), 0].tolist()))
    full = dict(zip(cands, ex["full"].y[0, : len(cands), 0].tolist()))
    assert cut["c"] == 1.0  # key[5], before the cut
    assert all(cut[k] == 0.0 for k in cands if k != "c")
    assert full == {k: float(k in {"c", "x", "y"}) for k in cands}


def test_select_rule() -> None:
    rows = [
        {"min_score": m, "hedge": h, "precision": p, "recall": r}
        for m, h, p, r in [
            (0.9, 0, 0.99, 0.90),
            (0.8, 1, 0.97, 0.95),
            (0.5, 1, 0.96, 0.95),
            (0.7, 2, 0.97, 0.95),
            (0.5, 3, 0.90, 0.99),
        ]
    ]
    best = train.select(rows, 0.96)  # most recall above the floor; ties: precision, min_score
    assert (best["min_score"], best["hedge"]) == (0.8, 1)
    assert train.select(rows, 0.995)["min_score"] == 0.9  # none feasible: most precise
    assert train.select(rows, 0.0)["hedge"] == 3


def test_flags_override_the_selection(tmp_path: Path) -> None:
    log = _write_log(tmp_path / "a.jsonl", 20)
    cfg = train.config(
        [str(log)],
        tmp_path / "o",
        epochs=1,
        progress=False,
        timing_calls=10,
        min_score=0.65,
        hedge=1,
    )
    metrics = train.run(cfg)
    assert metrics["selected"] == {"min_score": 0.65, "hedge": 1, "source": "flags"}
    assert [(r["min_score"], r["hedge"]) for r in metrics["validation"]["grid"]] == [(0.65, 1)]
    loaded = predictor.load(tmp_path / "o" / "checkpoint")
    assert (loaded.min_score, loaded.hedge) == (0.65, 1)


def _cacheflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cacheflow_jax.cli", *args], capture_output=True, text=True
    )


def test_cli_train_json_and_user_errors(tmp_path: Path) -> None:
    log = _write_log(tmp_path / "a.jsonl", 15)
    done = _cacheflow(
        "train",
        str(log),
        "--out",
        str(tmp_path / "o"),
        "--epochs",
        "1",
        "--json",
        "--no-progress",
        "--top-k",
        "2",
        "--lookahead",
        "4",
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out["eval"]["mlp"]) == {"precision", "recall"}
    assert {"train_seconds", "predict_us"} <= set(out)
    assert set(out["selected"]) == {"min_score", "hedge", "source"}
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
    with pytest.raises(ValueError, match="val_fraction"):
        train.config(["x"], tmp_path, val_fraction=1.0)
    with pytest.raises(ValueError, match="--min-score"):
        train.config(["x"], tmp_path, min_score_grid=[0.5, 1.5])
    with pytest.raises(ValueError, match="--hedge"):
        train.config(["x"], tmp_path, hedge=-1)
