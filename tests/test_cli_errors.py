"""Bad input on the command line: one line on stderr, exit status 2, nothing on disk changed.

Also the other ways a command can end early: Ctrl-C (130, one line) and a reader of stdout that
goes away (141, silent), and the version flag.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cacheflow_jax.cli import main
from cacheflow_jax.store.write import write_store

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "data" / "traces"
MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"
SMALL_DEMO = [
    "--layers", "2",
    "--experts", "4",
    "--expert-mb", "0.0625",
    "--d-model", "64",
    "--warmup", "2",
    "--requests", "3",
    "--no-progress",
]  # fmt: skip


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root`` with its size and modification time."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def _one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2, err
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A folder with a small unit-size trace (Mooncake, 300 requests) and a sized one."""
    with open(MOONCAKE) as src, open(tmp_path / "mooncake.jsonl", "w") as dst:
        for _ in range(300):
            dst.write(src.readline())
    rows = [
        {"t": i, "key": f"k{i % 7}", "nbytes": 1000 * (1 + i % 7), "kind": "kv"} for i in range(60)
    ]
    (tmp_path / "sized.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        # a directory as the trace
        (["replay", "{dir}", "--device-bytes", "1%"], "is a directory"),
        # --sizes that lists nothing, with and without --json
        (["replay", "{unit}", "--sizes", ","], "lists no sizes"),
        (["replay", "{unit}", "--sizes", ",", "--json"], "lists no sizes"),
        # percentages that are not finite
        (["replay", "{unit}", "--device-bytes", "inf%"], "not a finite percentage"),
        (["replay", "{unit}", "--device-bytes", "1e999%"], "not a finite percentage"),
        (["replay", "{unit}", "--device-bytes", "nan%"], "not a finite percentage"),
        # a fraction of a byte (or a block) is not rounded down silently
        (["replay", "{sized}", "--device-bytes", "7000.5"], "not a whole number of bytes"),
        (["replay", "{unit}", "--device-bytes", "1.5"], "not a whole number of blocks"),
        # byte units on a unit-size trace
        (["replay", "{unit}", "--device-bytes", "10MB"], "unit sizes"),
        (["replay", "{unit}", "--sizes", "1%,64KiB"], "unit sizes"),
        # a bad --sizes item is named as --sizes, not --device-bytes
        (["replay", "{unit}", "--sizes", "1%,abc"], "--sizes='abc'"),
        # --sizes and --device-bytes together: no silent override
        (["replay", "{unit}", "--sizes", "1%", "--device-bytes", "5%"], "not allowed with"),
        (["replay", "{unit}", "--sizes", "1%", "--compare", "lru,nope"], "unknown policy 'nope'"),
        (["replay", "{unit}", "--sizes", "1%", "--plot", "{dir}"], "is a directory"),
        (["replay", "{unit}", "--sizes", "1%", "--plot", "{dir}/curve.gif"], "unknown file type"),
        (["replay", "{unit}", "--sizes", "1%", "--plot", "{unit}/x/curve.png"], "is a file"),
        (["stats", "{dir}"], "is a directory"),
        (["stats", "{unit}", "--sizes", ","], "lists no sizes"),
        (["stats", "{unit}", "--sizes", "10MB"], "unit sizes"),
        (["stats", "{unit}", "--sample", "2"], "not a rate"),
        (["inspect", "{dir}/store", "--keys", "--json"], "not allowed with"),
        (["replay", "{unit}", "--device-bytes", "1%", "--host-bytes", "1GiB"], "unit sizes"),
        (["demo", "--workdir", "{dir}/w", "--device-bytes", "1.5"], "not a whole number"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(
    capsys: pytest.CaptureFixture[str], work: Path, argv: list[str], needle: str
) -> None:
    paths = {"dir": work, "unit": work / "mooncake.jsonl", "sized": work / "sized.jsonl"}
    argv = [a.format(**paths) for a in argv]
    if argv[0] == "replay":
        argv.append("--no-progress")
    before = _snapshot(work)
    line = _one_line_error(*_cli(capsys, *argv))
    assert needle in line, line
    assert _snapshot(work) == before


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ('{"t": 0, "key": "a", "nbytes": 100000000000000000000000, "kind": "kv"}', "256 TiB"),
        ('{"t": 0, "key": "a", "nbytes": 1e23, "kind": "kv"}', "must be an integer"),
    ],
)
def test_trace_with_huge_nbytes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, row: str, needle: str
) -> None:
    trace = tmp_path / "huge.jsonl"
    trace.write_text(row + "\n")
    line = _one_line_error(*_cli(capsys, "replay", str(trace), "--device-bytes", "10%"))
    assert needle in line and "huge.jsonl:1:" in line


def test_libcachesim_csv_with_huge_size(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "huge.csv"
    trace.write_text("0,1,1e23\n1,2,1e999\n")
    argv = ["replay", str(trace), "--format", "libcachesim-csv", "--csv-spec",
            "time=1,key=2,size=3", "--device-bytes", "10%"]  # fmt: skip
    line = _one_line_error(*_cli(capsys, *argv))
    assert "huge.csv:1:" in line and "256 TiB" in line


def test_demo_access_log_that_is_a_directory_fails_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["demo", "--workdir", str(tmp_path / "w"), "--access-log", str(tmp_path), *SMALL_DEMO]
    line = _one_line_error(*_cli(capsys, *argv))
    assert str(tmp_path) in line and "is a directory" in line
    assert not (tmp_path / "w").exists()  # no checkpoint was built


def test_demo_access_log_on_a_full_device(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("this system has no /dev/full")
    argv = ["demo", "--workdir", str(tmp_path / "w"), "--access-log", "/dev/full", *SMALL_DEMO]
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("cacheflow demo: error:")
    assert "/dev/full" in err.strip().splitlines()[-1]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import cacheflow_jax

    code, out, _ = _cli(capsys, "--version")
    assert code == 0 and out.strip() == f"cacheflow-jax {cacheflow_jax.__version__}"


# ------------------------------------------------------------------------------- subprocesses


def _cacheflow(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cacheflow_jax.cli", *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False, **kwargs,
    )  # fmt: skip


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    store = tmp_path / "store"
    write_store({"w": np.zeros((64, 4), np.float32)}, store, chunk_bytes=16)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cacheflow_jax.cli", "inspect", str(store), "--keys"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    proc.stdout.close()  # the reader is gone before the first line, as `| head -0` would be
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == ""


def test_train_usage_errors_are_one_line(tmp_path: Path) -> None:
    for argv in (["train"], ["train", "x.jsonl", "--out", str(tmp_path / "o"), "--epochs", "zz"]):
        done = _cacheflow(*argv)
        line = _one_line_error(done.returncode, done.stdout, done.stderr)
        assert line.startswith("cacheflow train: error:")


def test_train_help_reads_as_text() -> None:
    done = _cacheflow("train", "--help")
    assert done.returncode == 0 and "usage: cacheflow train" in done.stdout
    assert "``" not in done.stdout and "metrics.json" in done.stdout


def test_train_out_that_is_a_file_fails_before_any_work(tmp_path: Path) -> None:
    log = tmp_path / "a.jsonl"
    log.write_text("".join(json.dumps({"t": i, "key": f"k{i % 5}", "nbytes": 8, "kind": "kv"})
                           + "\n" for i in range(200)))  # fmt: skip
    afile = tmp_path / "out"
    afile.write_text("keep me")
    before = _snapshot(tmp_path)
    start = time.monotonic()
    done = _cacheflow("train", str(log), "--out", str(afile), "--no-progress")
    line = _one_line_error(done.returncode, done.stdout, done.stderr)
    assert "is a file" in line and str(afile) in line
    assert _snapshot(tmp_path) == before and afile.read_text() == "keep me"
    assert time.monotonic() - start < 120
    # A log that is a directory, and an output inside a directory that is a file.
    for argv in ([str(tmp_path), "--out", str(tmp_path / "o")],
                 [str(log), "--out", str(afile / "sub")]):  # fmt: skip
        done = _cacheflow("train", *argv, "--no-progress")
        _one_line_error(done.returncode, done.stdout, done.stderr)
        assert _snapshot(tmp_path) == before


def test_ctrl_c_in_train_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    log = tmp_path / "big.jsonl"
    with open(MOONCAKE) as src, open(log, "w") as dst:
        for _ in range(2500):
            dst.write(src.readline())
    out = tmp_path / "o"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cacheflow_jax.cli", "train", str(log), "--out", str(out),
         "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip
    lines = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if not line or line.startswith("train: "):
            break
    assert lines[-1].startswith("train: "), "".join(lines)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
    rest = proc.stderr.read()
    code = proc.wait(timeout=120)
    err = "".join(lines) + rest
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == "cacheflow train: interrupted"
    assert err.count("interrupted") == 1
    assert not out.exists()


class _InterruptedFinalizer:
    """Raises KeyboardInterrupt when collected, as Ctrl-C does when it lands in JAX's gc hook."""

    def __del__(self) -> None:
        raise KeyboardInterrupt


def _spin() -> None:
    deadline = time.monotonic() + 5  # Python code for the re-raised interrupt to land in
    while time.monotonic() < deadline:
        pass


def test_an_interrupt_inside_a_finalizer_still_stops_the_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cacheflow_jax.cli import interrupts_reach_main
    from training.main import unraisable_hook

    before = sys.unraisablehook
    with pytest.raises(KeyboardInterrupt), interrupts_reach_main():
        _InterruptedFinalizer()  # collected at once: the interrupt is "unraisable" there
        _spin()
    assert sys.unraisablehook is before
    previous = sys.unraisablehook
    sys.unraisablehook = unraisable_hook(previous)
    try:
        with pytest.raises(KeyboardInterrupt):
            _InterruptedFinalizer()
            _spin()
    finally:
        sys.unraisablehook = previous
    assert "Exception ignored" not in capsys.readouterr().err
