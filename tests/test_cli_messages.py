"""The command line's rough edges of issue 30, each checked as a user meets it: help text, error
lines that speak to a CLI user, ``inspect``'s sizes of runtime blocks, and ``verify`` manifests
that a ``CheckpointManager`` with ``max_to_keep`` leaves behind. Real stores and checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

import cacheflow_jax as cfj
from cacheflow_jax.cli import main


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _runtime_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@pytest.mark.parametrize("command", ["replay", "stats", "inspect", "verify", "demo"])
def test_help_shows_percentages_as_typed(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, _ = _cli(capsys, command, "--help")
    assert code == 0 and "usage: cacheflow" in out
    assert "%%" not in out
    if command == "replay":
        assert "(5%)" in " ".join(out.split())


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_missing_or_empty_location_is_said_to_a_cli_user(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    (tmp_path / "empty").mkdir()
    for path, what in ((tmp_path / "nothing", "does not exist"), (tmp_path / "empty", "empty")):
        code, out, err = _cli(capsys, command, str(path))
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
        assert err.startswith(f"cacheflow {command}: error: ") and str(path) in err and what in err
        assert "create=True" not in err and "pass create" not in err


def test_a_directory_given_as_a_log_reads_as_english(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = _cli(capsys, "stats", str(tmp_path))
    assert code == 2 and "access log" in err and "is a directory; give a file" in err
    assert "a access" not in err


def _checkpoint_with_runtime_blocks(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    with ocp.CheckpointManager(root) as manager:
        manager.save(1, args=ocp.args.StandardSave({"w": np.ones((16, 16), np.float32)}))
        manager.wait_until_finished()
    cache = cfj.TieredCache(cfj.open_store(root), device_bytes=1 << 20, host_bytes=1 << 20)
    with cfj.serving(cache) as s:
        for i in range(5):
            s.put(f"kv:{i}", np.full(8, i, np.float32))  # 32 bytes each, written back on exit
    return root


def test_inspect_counts_the_bytes_of_runtime_blocks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root = _checkpoint_with_runtime_blocks(tmp_path)
    code, out, _ = _cli(capsys, "inspect", str(root))
    assert code == 0
    assert "1 array blocks (1.0 KiB), 5 runtime blocks (160 B)" in out, out
    code, out, _ = _cli(capsys, "inspect", str(root), "--json")
    report = json.loads(out)
    assert report["runtime_nbytes"] == 160 and report["nbytes"] == 1024


def test_manifests_of_steps_orbax_deleted_are_reported_and_removed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    options = ocp.CheckpointManagerOptions(max_to_keep=1)
    with ocp.CheckpointManager(root, options=options) as manager:
        manager.save(1, args=ocp.args.StandardSave({"w": np.ones((8, 8), np.float32)}))
        manager.wait_until_finished()
    assert _cli(capsys, "verify", str(root))[0] == 0
    assert (root / "1.cacheflow-manifest.json").is_file()
    with ocp.CheckpointManager(root, options=options) as manager:
        manager.save(2, args=ocp.args.StandardSave({"w": np.zeros((8, 8), np.float32)}))
        manager.wait_until_finished()
    assert not (root / "1").exists()  # orbax deleted step 1, and knows nothing of its manifest
    code, out, _ = _cli(capsys, "inspect", str(root))
    assert code == 0
    assert "no chunk manifest for step 2 (the newest)" in out and "cacheflow verify" in out
    assert "manifests of deleted steps" in out and "1.cacheflow-manifest.json" in out
    code, out, _ = _cli(capsys, "verify", str(root))
    assert code == 0 and "recorded" in out
    assert "removed 1 manifest(s)" in out and "1.cacheflow-manifest.json" in out
    assert sorted(p.name for p in root.glob("*.cacheflow-manifest.json")) == [
        "2.cacheflow-manifest.json"
    ]
    code, out, _ = _cli(capsys, "inspect", str(root))
    assert "chunk manifest (checked on every read)" in out and "deleted steps" not in out
