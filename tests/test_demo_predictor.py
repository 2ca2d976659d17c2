"""``cacheflow demo --predictor DIR``: serving ``cacheflow+mlp`` with a given checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import DEMO_ROWS, SMALL_DEMO, _run  # the same small demo and CLI runner

import predictor


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained MLP predictor saved as `cacheflow train` saves one: serving needs no training."""
    out = tmp_path_factory.mktemp("train-out")
    return predictor.save(out / "checkpoint", predictor.mlp(seed=0, hidden=8, hedge=1))


def test_demo_serves_the_mlp_row_with_the_given_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, checkpoint: Path
) -> None:
    argv = ["demo", "--workdir", str(tmp_path / "w"), "--requests", "8", "--record", "10"]
    code, out, err = _run(capsys, *argv, *SMALL_DEMO, "--predictor", str(checkpoint), "--json")
    assert code == 0, err
    assert "training" not in err  # nothing trained: the checkpoint was given
    rows = json.loads(out)
    assert [r["name"] for r in rows] == DEMO_ROWS
    pf = {r["name"]: r for r in rows}["cacheflow+mlp"]["prefetch"]
    # The worker asked the MLP after each round of get_many batches (at most one per layer).
    assert pf["enabled"] and pf["disabled_reason"] is None
    assert 1 <= pf["predictions"] <= (8 + 2) * 2 and pf["predict_us"] > 0


def test_demo_missing_predictor_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "no-checkpoint"
    argv = ["demo", "--workdir", str(tmp_path / "w"), "--predictor", str(missing), *SMALL_DEMO]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert str(missing) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "w").exists()  # checked before building the model


def test_demo_training_output_dir_points_at_its_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, checkpoint: Path
) -> None:
    code, _, err = _run(capsys, "demo", "--workdir", str(tmp_path), "--predictor",
                        str(checkpoint.parent), *SMALL_DEMO)  # fmt: skip
    assert code == 2 and f"did you mean --predictor {checkpoint}?" in err


def test_demo_corrupted_predictor_warns_once_and_runs_without_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "ckpt"
    (bad / "meta").mkdir(parents=True)
    (bad / "meta" / "metadata").write_text("{not json")
    code, out, err = _run(capsys, "demo", "--workdir", str(tmp_path / "w"), "--predictor",
                          str(bad), "--requests", "4", "--record", "10", *SMALL_DEMO, "--json")  # fmt: skip
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "without the predictor" in warnings[0]
    assert "Traceback" not in err and "training" not in err
    rows = {r["name"]: r for r in json.loads(out)}
    assert list(rows) == DEMO_ROWS
    assert not rows["cacheflow+mlp"]["prefetch"]["enabled"]  # served without prefetch
    assert rows["cacheflow+markov"]["prefetch"]["enabled"]
