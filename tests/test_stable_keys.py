"""A key names the same block at every budget (issue 30): orbax checkpoints saved by a
CheckpointManager, served through caches of three different budgets, `cacheflow inspect --keys`,
an access log recorded at one budget and served at another."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest

import cacheflow_jax as cfj
from cacheflow_jax.cli import main
from cacheflow_jax.orbax import materialize, restore_lazy

rng = np.random.default_rng(30)
# A list-shaped tree: the table (5,120,000 bytes, one stored chunk) is larger than the default
# 4 MiB block, the layers fit one block each.
TREE = {
    "embed": rng.standard_normal((5000, 256)).astype(np.float32),
    "layers": [{"w": rng.standard_normal((128, 256)).astype(np.float32)} for _ in range(3)],
}
BUDGETS = (5 << 20, 64 << 20, 1 << 30)  # the old default cut 1/8 of each: 640 KiB, 8 MiB, 128 MiB


@pytest.fixture(autouse=True)
def _runtime_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stable-keys") / "ckpt"
    with ocp.CheckpointManager(path) as manager:
        manager.save(1, args=ocp.args.StandardSave(TREE))
        manager.wait_until_finished()
    return path


def _digest(value: Any) -> tuple[tuple[int, ...], str]:
    array = np.ascontiguousarray(np.asarray(value))
    return array.shape, hashlib.sha256(array.tobytes()).hexdigest()


def test_the_same_key_returns_the_same_shape_and_bytes_under_three_budgets(root: Path) -> None:
    seen: dict[str, tuple[tuple[int, ...], str]] = {}
    for budget in BUDGETS:
        cache = cfj.TieredCache(cfj.open_store(root), device_bytes=budget, host_bytes=0)
        keys = [k for k in cache.store.keys() if "@" in k]
        got = dict(zip(keys, map(_digest, cache.get_many(keys)), strict=True))
        if not seen:
            seen = got
        assert got == seen, f"device_bytes={budget} serves other blocks under the same keys"
    assert seen["embed@0,0"][0] == (4096, 256) and seen["embed@1,0"][0] == (904, 256)
    np.testing.assert_array_equal(
        np.asarray(cfj.open_store(root).read("embed@1,0").result()), TREE["embed"][4096:]
    )


def test_restore_lazy_keys_and_block_bytes_do_not_follow_the_budget(root: Path) -> None:
    trees = [restore_lazy(root, device_bytes=b, host_bytes=b) for b in BUDGETS]
    assert {t["embed"].keys for t in trees} == {("embed@0,0", "embed@1,0")}
    for tree in trees:
        np.testing.assert_array_equal(np.asarray(materialize(tree["embed"])), TREE["embed"])
    # A chosen block size is one grid too, whatever the budget.
    grids = {
        cfj.TieredCache(cfj.open_store(root), device_bytes=b, host_bytes=0, block_bytes=1 << 20)
        .store.arrays()["embed"].chunk_shape
        for b in BUDGETS
    }  # fmt: skip
    assert grids == {(1024, 256)}


def test_inspect_lists_the_keys_every_cache_serves(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(root), "--keys"]) == 0
    listed = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    for budget in BUDGETS:
        cache = cfj.TieredCache(cfj.open_store(root), device_bytes=budget, host_bytes=0)
        assert listed == [k for k in cache.store.keys() if "@" in k]
    assert main(["inspect", str(root), "--block-bytes", "1MiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    embed = next(a for a in report["arrays"] if a["path"] == "embed")
    assert embed["chunk_shape"] == [1024, 256] and embed["stored_chunk_shape"] == [5000, 256]
    assert report["block_bytes"] == 1 << 20


def test_an_access_log_from_one_budget_is_served_and_replayed_at_another(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "access.jsonl"
    small = cfj.TieredCache(cfj.open_store(root), device_bytes=BUDGETS[0], host_bytes=0)
    with cfj.serving(small, access_log=log) as s:
        for _ in range(3):
            s.get_many(["embed@1,0", "layers/0/w@0,0", "layers/2/w@0,0"])
    records = [json.loads(line) for line in log.read_text().splitlines()]
    big = cfj.TieredCache(cfj.open_store(root), device_bytes=BUDGETS[-1], host_bytes=0)
    for record in records:
        assert big.info(record["key"]).nbytes == record["nbytes"]
        assert _digest(big.get(record["key"])) == _digest(small.get(record["key"]))
    assert main(["replay", str(log), "--device-bytes", "1GiB", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 9 and out["misses"] == 3


def test_a_budget_below_a_default_block_is_a_budget_error_naming_block_bytes(root: Path) -> None:
    with pytest.raises(cfj.BudgetError, match=r"'embed@0,0' \(4194304 bytes\)") as err:
        restore_lazy(root, device_bytes=1 << 20, host_bytes=1 << 20)
    assert "block_bytes=131072" in str(err.value) and "device_bytes=1048576" in str(err.value)
    tree = restore_lazy(root, device_bytes=1 << 20, host_bytes=1 << 20, block_bytes=128 << 10)
    assert tree["embed"].block_shape == (128, 256)
    np.testing.assert_array_equal(np.asarray(tree["embed"][4990:]), TREE["embed"][4990:])
