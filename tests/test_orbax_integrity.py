"""Integrity of orbax checkpoints, which carry no checksums: `cacheflow verify` manifests, damaged
chunks, CheckpointManager roots and steps (real orbax checkpoints, real files)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest

import cacheflow_jax as cfj
from cacheflow_jax.cli import main
from cacheflow_jax.orbax import materialize, restore_lazy
from cacheflow_jax.store.verify import verify_checkpoint

RNG = np.random.default_rng(7)
TREE = {
    "embed": RNG.standard_normal((1024, 32)).astype(np.float32),  # 128 KiB, one chunk
    "w": RNG.standard_normal((16, 16)).astype(np.float32),
}


@pytest.fixture(autouse=True)
def _runtime_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def _save(root: Path, steps: tuple[int, ...] = (1,)) -> Path:
    with ocp.CheckpointManager(root) as manager:
        for step in steps:
            manager.save(step, args=ocp.args.StandardSave(TREE))
        manager.wait_until_finished()
    return root


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _data_file(step_dir: Path) -> Path:
    """The OCDBT data file holding the large chunk (the largest one)."""
    files = [p for p in step_dir.rglob("d/*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _cache(path: Path, **kw: Any) -> cfj.TieredCache:
    nbytes = TREE["embed"].nbytes
    return cfj.TieredCache(
        cfj.open_store(path, **kw), device_bytes=nbytes // 8, host_bytes=nbytes // 4,
        block_bytes=nbytes // 64,
    )  # fmt: skip


def test_verify_records_a_manifest_beside_the_checkpoint_and_then_checks_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _save(tmp_path / "ckpt")
    before = _digests(root)
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert "recorded the CRC-32C of every chunk" in out
    manifest = root / "1.cacheflow-manifest.json"  # beside step 1, not inside it
    assert manifest.is_file()
    assert _digests(root) == {**before, manifest.name: _digests(root)[manifest.name]}
    assert {k for k in _digests(root) if k.startswith("1/")} == set(before)
    doc = json.loads(manifest.read_text())
    assert doc["covers"] == "block" and set(doc["arrays"]) == {"embed", "w"}
    assert main(["verify", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ok"
    store = cfj.open_store(root)
    assert store.manifest == str(manifest)
    # Every way of naming the checkpoint finds the same manifest.
    assert cfj.open_store(root / "1").manifest == str(manifest)
    assert cfj.open_store(root / "1" / "default").manifest == str(manifest)
    assert main(["inspect", str(root)]) == 0
    assert str(manifest) in capsys.readouterr().out


def test_with_a_manifest_flipped_bytes_raise_corrupt_block_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _save(tmp_path / "ckpt")
    assert verify_checkpoint(root)["status"] == "recorded"
    data_file = _data_file(root / "1")
    data = bytearray(data_file.read_bytes())
    data[len(data) // 2] ^= 0x04
    data_file.write_bytes(bytes(data))
    nbytes = TREE["embed"].nbytes
    tree = restore_lazy(
        root, device_bytes=nbytes // 8, host_bytes=1 << 20, block_bytes=nbytes // 64
    )
    with pytest.raises(cfj.CorruptBlockError, match=r"'embed@\d+,0'") as err:
        materialize(tree["embed"])
    assert "embed" in str(err.value) and str(root / "1") in str(err.value)
    with pytest.raises(cfj.CorruptBlockError, match=r"embed@3,0"):
        _cache(root).get("embed@3,0")
    np.testing.assert_array_equal(np.asarray(materialize(tree["w"])), TREE["w"])  # intact leaf
    assert main(["verify", str(root)]) == 1
    assert "embed" in capsys.readouterr().out


def test_without_a_manifest_a_truncated_chunk_raises_corrupt_block(tmp_path: Path) -> None:
    root = _save(tmp_path / "ckpt")
    data_file = _data_file(root / "1")
    data = data_file.read_bytes()
    data_file.write_bytes(data[: len(data) // 2])
    assert cfj.open_store(root).manifest is None
    with pytest.raises(cfj.CorruptBlockError, match=r"embed@5,0") as err:
        _cache(root).get("embed@5,0")
    assert "OUT_OF_RANGE" in str(err.value) or "truncated" in str(err.value)
    with pytest.raises(cfj.CorruptBlockError, match="'embed@0,0'"):
        cfj.open_store(root).read("embed@0,0").result()
    report = verify_checkpoint(root)  # nothing is recorded for a damaged checkpoint
    assert report["status"] == "corrupt" and not (root / "1.cacheflow-manifest.json").exists()


def test_without_a_manifest_an_undecodable_chunk_raises_corrupt_block(tmp_path: Path) -> None:
    root = _save(tmp_path / "ckpt")
    data_file = _data_file(root / "1")
    data = bytearray(data_file.read_bytes())
    data[0] ^= 0xFF  # the zstd frame's magic number
    data_file.write_bytes(bytes(data))
    with pytest.raises(cfj.CorruptBlockError, match=r"'embed@\d+,0'.*ZSTD"):
        materialize(restore_lazy(root, device_bytes=1 << 20, host_bytes=1 << 20)["embed"])


def test_a_manifest_of_another_save_is_refused_until_verified_again(tmp_path: Path) -> None:
    item = tmp_path / "plain"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(item, TREE)
    checkpointer.wait_until_finished()
    assert verify_checkpoint(item)["manifest"] == str(tmp_path / "plain.cacheflow-manifest.json")
    checkpointer.save(item, {"embed": TREE["embed"] + 1, "w": TREE["w"]}, force=True)
    checkpointer.wait_until_finished()
    with pytest.raises(cfj.StoreError, match="verify .* --update"):
        cfj.open_store(item)
    assert verify_checkpoint(item, update=True)["status"] == "recorded"
    got = materialize(restore_lazy(item, device_bytes=1 << 20, host_bytes=1 << 20))
    np.testing.assert_array_equal(np.asarray(got["embed"]), TREE["embed"] + 1)


def test_a_manager_root_opens_its_latest_step_and_inspect_lists_the_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _save(tmp_path / "ckpt", steps=(10, 20, 30))
    assert ocp.CheckpointManager(root).latest_step() == 30
    store = cfj.open_store(root)
    assert (store.step, store.steps) == (30, (10, 20, 30))
    assert store.spec.endswith("/30")
    assert cfj.open_store(root, step=10).step == 10
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "steps: 10, 20, 30" in out and "embed" in out
    assert main(["inspect", str(root), "--step", "20", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["step"], report["steps"], len(report["arrays"])) == (20, [10, 20, 30], 2)
    assert main(["inspect", str(root), "--step", "5"]) == 2
    assert "no step 5" in capsys.readouterr().err


def test_an_empty_result_is_never_silent(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(cfj.StoreError, match="empty"):
        restore_lazy(tmp_path / "empty", device_bytes=1 << 20, host_bytes=1 << 20)
    root = _save(tmp_path / "ckpt")
    shutil.rmtree(root / "1")  # a manager root whose steps are gone
    (root / "notes").mkdir()
    (root / "notes" / "a.txt").write_text("x")
    with pytest.raises(cfj.StoreError, match="neither"):
        restore_lazy(root, device_bytes=1 << 20, host_bytes=1 << 20)
    with pytest.raises(ValueError, match="not a CheckpointManager root"):
        cfj.open_store(_save(tmp_path / "other") / "1", step=1)


def test_runtime_blocks_go_where_runtime_says(tmp_path: Path) -> None:
    root = _save(tmp_path / "ckpt")
    before = _digests(root)
    store = cfj.open_store(root, runtime=tmp_path / "kv")
    assert store.runtime_spec == str(tmp_path / "kv")
    store.write("kv:a", np.arange(8, dtype=np.int32)).result()
    assert (tmp_path / "kv" / "_runtime" / "kv%3Aa.block").is_file()
    assert _digests(root) == before
    again = cfj.open_store(root, runtime=tmp_path / "kv")
    np.testing.assert_array_equal(again.read("kv:a").result(), np.arange(8, dtype=np.int32))
    # Without runtime=, the default location is a different one: the block is not there.
    assert "kv:a" not in cfj.open_store(root).keys()
