"""``cacheflow demo --predictor DIR``: the predictor's cost against the demo's steps, one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import SMALL_DEMO, _run  # the same small demo and CLI runner as the CLI tests

import predictor


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained MLP predictor saved as `cacheflow train` saves one: timing needs no training."""
    out = tmp_path_factory.mktemp("train-out")
    return predictor.save(out / "checkpoint", predictor.mlp(seed=0, hidden=8, hedge=1))


def test_demo_reports_predict_us_against_the_cacheflow_step(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, checkpoint: Path
) -> None:
    argv = ["demo", "--workdir", str(tmp_path / "w"), "--requests", "8", *SMALL_DEMO]
    code, out, err = _run(capsys, *argv, "--predictor", str(checkpoint), "--json")
    assert code == 0, err
    rows = json.loads(out)
    by = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows] == ["baseline", "cacheflow", "all-resident"]
    assert "predictor" not in by["baseline"] and "predictor" not in by["all-resident"]
    p = by["cacheflow"]["predictor"]
    assert p["checkpoint"] == str(checkpoint)
    assert p["predict_us"] > 0 and p["predict_p95_us"] >= p["predict_us"]
    assert p["calls"] == 8  # one per measured step
    assert p["k"] == 6 and p["accesses_per_step"] == 12  # 2 layers x (norm, router, 2 x 2 experts)
    assert p["step_p50_ms"] == by["cacheflow"]["p50_ms"]
    assert p["predict_share_of_step"] == pytest.approx(p["predict_us"] / (p["step_p50_ms"] * 1e3))
    assert p["observe_share_of_step"] == pytest.approx(
        p["observe_us_per_step"] / (p["step_p50_ms"] * 1e3)
    )

    # The table run prints one line with the same comparison.
    code, out, err = _run(capsys, *argv[:4], "3", *SMALL_DEMO, "--predictor", str(checkpoint))
    assert code == 0, err
    line = [x for x in out.splitlines() if x.startswith("predictor:")]
    assert len(line) == 1 and "predict(6) median" in line[0] and "cacheflow step p50" in line[0]


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
                          str(bad), "--requests", "4", *SMALL_DEMO, "--json")  # fmt: skip
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "without the predictor" in warnings[0]
    assert "Traceback" not in err
    assert all("predictor" not in row for row in json.loads(out))
