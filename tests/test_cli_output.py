"""What the commands show: keys in ``inspect``, sizes, bars and plots in ``replay``, ``stats``,
``train``'s progress and outputs, and the example script's clean-up."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import predictor
from cacheflow_jax.cli import format_stats, main
from training import main as train_main
from training import train

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE = ROOT / "data" / "traces" / "mooncake_synthetic_trace.jsonl"


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def unit_trace(tmp_path: Path) -> Path:
    path = tmp_path / "mooncake.jsonl"
    with open(MOONCAKE) as src, open(path, "w") as dst:
        for _ in range(300):
            dst.write(src.readline())
    return path


# ------------------------------------------------------------------------------------ inspect


def test_inspect_table_shows_each_arrays_keys(
    capsys: pytest.CaptureFixture[str], store_dir: Path
) -> None:
    code, out, _ = _cli(capsys, "inspect", str(store_dir))
    assert code == 0
    assert "emb@0,0 .. emb@4,0" in out and "layers/0/w@0,0" in out
    assert "runtime blocks: kv-block-1 (12 B)" in out


def test_inspect_keys_lists_every_key_with_its_size(
    capsys: pytest.CaptureFixture[str], store_dir: Path
) -> None:
    code, out, _ = _cli(capsys, "inspect", str(store_dir), "--keys")
    assert code == 0
    rows = [line.split("\t") for line in out.splitlines()]
    assert rows[:2] == [["emb@0,0", "64"], ["emb@1,0", "64"]]
    assert ["layers/0/w@0,0", "16"] in rows and rows[-1] == ["kv-block-1", "12"]
    assert len(rows) == 7


def test_inspect_json_lists_keys_with_sizes(
    capsys: pytest.CaptureFixture[str], store_dir: Path
) -> None:
    import cacheflow_jax as cfj

    code, out, _ = _cli(capsys, "inspect", str(store_dir), "--json")
    assert code == 0
    report = json.loads(out)
    keys = {k["key"]: k for k in report["keys"]}
    store = cfj.open_store(str(store_dir))
    assert list(keys) == list(store.keys())
    for key, row in keys.items():
        info = store.info(key)
        assert (row["nbytes"], row["shape"], row["dtype"]) == (
            info.nbytes, list(info.shape), info.dtype.name,
        )  # fmt: skip
    assert keys["emb@4,0"]["shape"] == [2, 8] and keys["kv-block-1"]["nbytes"] == 12


# ------------------------------------------------------------------------------------- replay


def test_replay_table_counts_blocks_on_a_unit_size_trace(
    capsys: pytest.CaptureFixture[str], unit_trace: Path
) -> None:
    code, out, _ = _cli(capsys, "replay", str(unit_trace), "--sizes", "1%,50", "--no-progress")
    assert code == 0, out
    assert "distinct blocks (unit size" in out and "distinct bytes" not in out
    assert re.search(r"\b50 blocks\b", out)


def test_replay_table_shows_bytes_with_units(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rows = [{"t": i, "key": f"k{i % 9}", "nbytes": 3 << 20, "kind": "kv"} for i in range(40)]
    trace = tmp_path / "sized.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = _cli(capsys, "replay", str(trace), "--device-bytes", "9MiB", "--host-bytes",
                        "6MiB", "--no-progress")  # fmt: skip
    assert code == 0
    assert "9.0 MiB" in out and "6.0 MiB" in out and "(27.0 MiB)" in out
    assert "9437184" not in out


def test_replay_progress_bar_is_labelled_and_reaches_the_end(
    capsys: pytest.CaptureFixture[str], unit_trace: Path
) -> None:
    code, _, err = _cli(capsys, "replay", str(unit_trace), "--sizes", "1%,5%", "--policy", "lru")
    assert code == 0
    for size in ("1%", "5%"):
        finals = re.findall(rf"replay lru {size}: 100%\|[^|]*\| (\d+)/(\d+)", err)
        assert finals and finals[-1][0] == finals[-1][1], err


def test_replay_plot_and_compare(
    capsys: pytest.CaptureFixture[str], unit_trace: Path, tmp_path: Path
) -> None:
    plot = tmp_path / "plots" / "curve.png"
    argv = ["replay", str(unit_trace), "--sizes", "1%,5%,10%", "--compare", "lru,belady",
            "--plot", str(plot), "--json", "--no-progress"]  # fmt: skip
    code, out, err = _cli(capsys, *argv)
    assert code == 0, err
    runs = json.loads(out)
    assert [(r["policy"]["name"], r["size"]) for r in runs] == [
        (p, s) for p in ("lfu", "lru", "belady") for s in ("1%", "5%", "10%")
    ]
    by = {(r["policy"]["name"], r["size"]): r["miss_ratio"] for r in runs}
    for size in ("1%", "5%", "10%"):
        assert by[("belady", size)] <= by[("lru", size)]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {plot}" in err


def test_miss_ratio_curve_figure_has_a_line_per_policy(tmp_path: Path) -> None:
    import matplotlib.image

    from cacheflow_jax.cli import plot_miss_ratio_curve

    runs = [
        {"policy": {"name": name}, "device_bytes": d, "host_bytes": 0, "miss_ratio": m,
         "distinct_bytes": 100, "unit_size": True, "trace": "t.jsonl"}
        for name, pts in (("lru", [(1, 0.9), (10, 0.5)]), ("belady", [(1, 0.7), (10, 0.3)]))
        for d, m in pts
    ]  # fmt: skip
    path = tmp_path / "c.svg"
    plot_miss_ratio_curve(runs, path)
    svg = path.read_text()
    assert "lru" in svg and "belady" in svg and "100 distinct blocks" in svg
    png = tmp_path / "c.png"
    plot_miss_ratio_curve(runs, png)
    assert matplotlib.image.imread(png).shape[2] in (3, 4)


# -------------------------------------------------------------------------------------- stats


def test_stats_command_table_and_json(
    capsys: pytest.CaptureFixture[str], unit_trace: Path
) -> None:
    code, out, _ = _cli(capsys, "stats", str(unit_trace), "--sizes", "1%,10%")
    assert code == 0
    assert "LRU miss-ratio curve" in out and "reuse distance" in out and "kv" in out
    assert "exact: Mattson" in out
    code, out, _ = _cli(capsys, "stats", str(unit_trace), "--json")
    report = json.loads(out)
    assert report["accesses"] == sum(r["accesses"] for r in report["by_kind"].values())
    first = report["reuse"]["first_accesses"]
    assert first == report["distinct_keys"]
    assert first + sum(r["accesses"] for r in report["reuse"]["histogram"]) == report["accesses"]
    assert format_stats(report).count("\n") > 10


# -------------------------------------------------------------------------------------- train


def test_examples_bar_reaches_the_whole_stream() -> None:
    keys = [f"k{i % 7}" for i in range(9000)]
    accesses = [predictor.Access(k, float(i), 1, "kv") for i, k in enumerate(keys)]
    cfg = predictor.FeatureConfig(lookahead=2, max_candidates=8)
    reported: list[int] = []
    # The last recorded position is far from the end, as the eval tail's last window is.
    train.build_examples(accesses, cfg, {"a": np.array([10, 8800])}, progress=reported.append)
    assert sum(reported) == len(accesses)


def test_loss_plot_uses_a_log_scale() -> None:
    import matplotlib.pyplot as plt

    history = {
        "train_loss": list(np.geomspace(1.0, 0.01, 300)),
        "eval_loss": [(150, 0.1), (300, 0.02)],
        "initial_eval_loss": 0.9,
    }
    fig = train.loss_figure(history)
    try:
        assert fig.axes[0].get_yscale() == "log"
    finally:
        plt.close(fig)


def test_train_names_all_its_outputs() -> None:
    metrics = {
        "eval": {n: {"precision": 0.5, "recall": 0.5} for n in
                 ("mlp", "last_successor", "markov", "stride")},
        "train_seconds": 1.0,
        "predict_us": 3.0,
        "outputs": ["o/checkpoint", "o/metrics.json", "o/loss.png"],
    }  # fmt: skip
    assert train_main.format_metrics(metrics).endswith(
        "wrote o/checkpoint, o/metrics.json, o/loss.png"
    )


# ------------------------------------------------------------------------------------ example


def test_serving_loop_example_leaves_no_temp_folder(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "serving_loop.py")],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "TMPDIR": str(tmp)}, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "'device'" in done.stdout
    assert list(tmp.iterdir()) == []
