"""Tests for the ``cacheflow`` command line (in-process through ``main``, once as a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from cacheflow_jax.cli import main, parse_size

SMALL_DEMO = [
    "--layers", "2",
    "--experts", "4",
    "--expert-mb", "0.0625",
    "--d-model", "64",
    "--warmup", "2",
    "--no-progress",
]  # fmt: skip


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def orbax_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CheckpointManager step directory of a small tree."""
    root = tmp_path_factory.mktemp("ckpt")
    tree = {"layers": {"0": {"w": jnp.ones((8, 4), jnp.bfloat16)}}, "step": jnp.int32(1)}
    with ocp.CheckpointManager(root) as manager:
        manager.save(0, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    return root / "0"


def test_inspect_store_table(capsys: pytest.CaptureFixture[str], store_dir: Path) -> None:
    code, out, _ = _run(capsys, "inspect", str(store_dir))
    assert code == 0
    assert "emb" in out and "layers/0/w" in out and "(10, 8)" in out and "int8" in out
    assert "1 runtime blocks" in out


def test_inspect_store_json(capsys: pytest.CaptureFixture[str], store_dir: Path) -> None:
    code, out, _ = _run(capsys, "inspect", str(store_dir), "--json")
    assert code == 0
    report = json.loads(out)
    arrays = {a["path"]: a for a in report["arrays"]}
    assert arrays["emb"]["chunk_shape"] == [2, 8] and arrays["emb"]["blocks"] == 5
    assert arrays["layers/0/w"]["dtype"] == "int8"
    assert report["array_blocks"] == 6 and report["runtime_blocks"] == 1 and report["blocks"] == 7
    assert report["source"] == "cacheflow"


def test_inspect_orbax_checkpoint_json(capsys: pytest.CaptureFixture[str], orbax_dir: Path) -> None:
    code, out, _ = _run(capsys, "inspect", "--json", str(orbax_dir))
    assert code == 0
    report = json.loads(out)
    assert report["source"] == "orbax"
    arrays = {a["path"]: a for a in report["arrays"]}
    assert arrays["layers/0/w"]["shape"] == [8, 4]
    assert arrays["layers/0/w"]["dtype"] == "bfloat16"
    assert arrays["step"]["shape"] == [] and arrays["step"]["blocks"] == 1


def test_inspect_missing_path_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nothing-here"
    code, out, err = _run(capsys, "inspect", str(missing))
    assert code == 2 and out == ""
    assert str(missing) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_inspect_a_directory_that_is_not_a_store(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    code, _, err = _run(capsys, "inspect", str(tmp_path))
    assert code == 2 and str(tmp_path) in err and len(err.strip().splitlines()) == 1


DEMO_ROWS = ["baseline", "cacheflow", "cacheflow+markov", "cacheflow+mlp", "all-resident"]


def test_demo_end_to_end_small(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    log, plot = tmp_path / "access.jsonl", tmp_path / "cdf.png"
    argv = ["demo", "--workdir", str(tmp_path / "w"), "--requests", "12", "--record", "60"]
    code, out, err = _run(capsys, *argv, *SMALL_DEMO, "--access-log", str(log), "--plot",
                          str(plot), "--json")  # fmt: skip
    assert code == 0, err
    rows = json.loads(out)
    assert [r["name"] for r in rows] == DEMO_ROWS
    for row in rows:
        for k in ("l1_hit_ratio", "host_hit_ratio", "l3_share", "prefetch_accuracy",
                  "prefetch_coverage", "p50_ms", "p95_ms", "p95_ratio_to_baseline",
                  "p95_ratio_to_resident", "mean_ms"):  # fmt: skip
            assert isinstance(row[k], float), k
        assert row["p50_ms"] > 0 and row["p95_ms"] >= row["p50_ms"] and row["steps"] == 12
    by = {r["name"]: r for r in rows}
    assert by["baseline"]["p95_ratio_to_baseline"] == 1.0
    assert by["all-resident"]["p95_ratio_to_resident"] == 1.0
    assert by["baseline"]["l1_hit_ratio"] == 0.0 and by["baseline"]["l3_share"] == 1.0
    assert by["all-resident"]["l1_hit_ratio"] == 1.0 and by["all-resident"]["l3_share"] == 0.0
    for name in ("cacheflow", "cacheflow+markov", "cacheflow+mlp"):
        row = by[name]
        assert 0.0 <= row["l1_hit_ratio"] <= 1.0 and 0.0 <= row["l3_share"] <= 1.0
        shares = row["l1_hit_ratio"] + row["host_hit_ratio"] + row["l3_share"]
        assert shares == pytest.approx(1.0, abs=1e-3)
    assert not by["cacheflow"]["prefetch"]["enabled"]
    for name in ("cacheflow+markov", "cacheflow+mlp"):  # both predictors ran (<= once a layer)
        pf = by[name]["prefetch"]
        assert pf["enabled"] and 1 <= pf["predictions"] <= (12 + 2) * 2
    assert "built" in err and "training the MLP predictor" in err and "trained in" in err
    # 14 steps are two turns of each row (SEGMENT 10): interleaved rows still serve the same
    # outputs and routes bitwise, each from its own copy of the checkpoint's files.
    assert "outputs differ" not in err
    copies = {p.name for p in next((tmp_path / "w").glob("*/rows")).iterdir()}
    assert copies == set(DEMO_ROWS[:-1])
    assert f"latency CDF saved to {plot}" in err and plot.stat().st_size > 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 14 * 2 * 2  # (12 + 2 warm-up) steps x 2 layers x top-2 experts
    assert {"t", "key", "nbytes", "kind"} <= set(records[0])
    first = records[0]["key"]
    assert first.startswith("layers/0/experts/") and first.endswith("/w@0,0,0")

    # A second run reuses the checkpoint and the trained predictor, and prints the table.
    trained = next((tmp_path / "w").glob("*/mlp/checkpoint"))
    code, out, err = _run(capsys, "demo", "--workdir", str(tmp_path / "w"), "--requests", "3",
                          "--record", "20", "--predictor", str(trained), *SMALL_DEMO)  # fmt: skip
    assert code == 0, err
    assert "reusing" in err and "training" not in err
    lines = out.splitlines()
    assert lines[0].startswith("JAX backend cpu, device ") and "a step = 64 bytes" in lines[0]
    assert lines[1].split() == ["name", "L1", "hit", "to", "L3", "pf", "acc", "pf", "cov",
                                "p50", "ms", "p95", "ms", "p95/base", "p95/resident"]  # fmt: skip
    assert [line.split()[0] for line in lines[3:8]] == DEMO_ROWS
    # A legend says what each short column title means (issue 30).
    legend = lines[8]
    for title in ("L1 hit:", "to L3:", "pf acc:", "pf cov:", "p95/base, p95/resident:"):
        assert title in legend, title
    assert lines[9].startswith("latency CDF: ") and lines[9].endswith("latency_cdf.png")
    # It says where it writes and how much, and how to choose the place.
    said = next(line for line in err.splitlines() if "writes under" in line)
    assert str(tmp_path / "w") in said and "--workdir" in said and "iB in all" in said


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--device-bytes", "12XB"], "'12XB' is not a size"),
        (["demo", "--requests", "0"], "--requests"),
        (["demo", "--requests", "ten"], "--requests"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1


def test_demo_workdir_that_is_a_file_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    code, _, err = _run(capsys, "demo", "--workdir", str(afile), *SMALL_DEMO)
    assert code == 2 and str(afile) in err and "Traceback" not in err


def test_demo_budget_below_one_block_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["demo", "--workdir", str(tmp_path), "--device-bytes", "1KiB", *SMALL_DEMO]
    code, _, err = _run(capsys, *argv)
    assert (
        code == 2 and "--device-bytes 1024 is smaller" in err and len(err.strip().splitlines()) == 1
    )


def test_help_for_each_command(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["inspect", "--help"], ["demo", "--help"]):
        code, out, _ = _run(capsys, *argv)
        assert code == 0 and "usage: cacheflow" in out
    assert "--expert-mb" not in _run(capsys, "demo", "--help")[1]


def test_module_runs_as_a_script() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cacheflow_jax.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "inspect" in proc.stdout and "demo" in proc.stdout


def test_parse_size() -> None:
    assert parse_size("64MiB") == 64 * 2**20
    assert parse_size("1.5k") == 1536
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("7") == 7
