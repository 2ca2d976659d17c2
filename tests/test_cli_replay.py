"""``cacheflow replay``: output shape, curves and bad input (exit status 2)."""

from __future__ import annotations

import json
import os

import pytest

from cacheflow_jax.cli import main

TRACES = os.path.join(os.path.dirname(__file__), "..", "data", "traces")
MOONCAKE = os.path.join(TRACES, "mooncake_synthetic_trace.jsonl")


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "small.jsonl"
    with open(MOONCAKE) as src, open(path, "w") as dst:
        for _ in range(300):
            dst.write(src.readline())
    return str(path)


def test_replay_json_has_the_design_fields(small_trace, capsys):
    rc = main(["replay", small_trace, "--device-bytes", "5%", "--host-bytes", "10%", "--json",
               "--no-progress"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for field in ("requests", "misses", "device_miss_ratio", "miss_ratio", "byte_miss_ratio",
                  "policy"):
        assert field in out
    assert set(out["hits"]) == {"device", "host"}
    assert {"issued", "used", "timely", "late", "wasted", "accuracy", "coverage"} <= set(out["prefetch"])
    assert out["requests"] == out["hits"]["device"] + out["hits"]["host"] + out["misses"]
    assert out["hits"]["host"] > 0


def test_replay_curve_table_and_json(small_trace, capsys):
    assert main(["replay", small_trace, "--sizes", "1%,10%", "--policy", "lru",
                 "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "miss ratio" in table and " 1%" in table and "10%" in table
    assert main(["replay", small_trace, "--sizes", "1%,10%", "--json", "--no-progress"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [r["size"] for r in runs] == ["1%", "10%"]
    assert runs[0]["miss_ratio"] >= runs[1]["miss_ratio"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "parquet", "--device-bytes", "1%"], "invalid choice: 'parquet'"),
        (["--device-bytes", "5", "--block-bytes", "4096"], "has no unit"),
        (["--device-bytes", "lots"], "not a size"),
        ([], "give --device-bytes"),
    ],
)
def test_replay_bad_input_exits_2(small_trace, capsys, args, message):
    assert main(["replay", small_trace, "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_replay_empty_trace_exits_2(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["replay", str(empty), "--format", "log", "--device-bytes", "10"]) == 2
    assert "holds no accesses" in capsys.readouterr().err


def test_replay_malformed_line_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "key": "a", "nbytes": 1, "kind": "kv"}\n{"t": 1, "key": 3}\n')
    assert main(["replay", str(bad), "--format", "log", "--device-bytes", "10"]) == 2
    assert "bad.jsonl:2:" in capsys.readouterr().err


def test_bench_runs_every_benchmark_in_bench() -> None:
    # `cacheflow bench NAME` knows every module of bench/ (prefetchers was missing once).
    from pathlib import Path

    from cacheflow_jax.cli import BENCHMARKS

    bench = Path(__file__).resolve().parent.parent / "bench"
    modules = {p.stem for p in bench.glob("*.py") if not p.stem.startswith("_")}
    assert modules == set(BENCHMARKS)


def test_bench_lists_and_rejects(capsys):
    assert main(["bench", "--help"]) == 0
    assert "metadata_memory" in capsys.readouterr().out
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


# ------------------------------------------------------------------------------- prefetch


def test_replay_with_prefetchers_compares_them_in_one_table(small_trace, capsys, tmp_path):
    import predictor

    ckpt = predictor.save(tmp_path / "ckpt", predictor.mlp(seed=0, hidden=8, hedge=1))
    argv = ["replay", small_trace, "--device-bytes", "5%", "--no-progress",
            "--prefetch", f"none,last-successor,markov,stride,mlp:{ckpt}", "--warmup", "50%"]
    assert main([*argv, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [r["prefetcher"] for r in runs] == [
        "none", "last-successor", "markov", "stride", f"mlp:{ckpt}"]
    assert all(r["lead"] == 1 and not r["keys_known"] and r["warmup"] > 0 for r in runs)
    assert runs[0]["prefetch"]["issued"] == 0
    assert runs[1]["prefetch"]["issued"] > 0 and runs[1]["prefetch"]["used"] > 0
    # every run replays the same accesses after the same warm-up
    assert len({r["requests"] for r in runs}) == 1
    assert runs[1]["device_miss_ratio"] < runs[0]["device_miss_ratio"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "prefetch" in table and "accuracy" in table and "coverage" in table
    assert "last-successor" in table and "stride" in table


def test_replay_lead_makes_prefetches_late(small_trace, capsys):
    base = ["replay", small_trace, "--device-bytes", "5%", "--no-progress", "--json",
            "--prefetch", "last-successor"]
    assert main([*base, "--lead", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*base, "--lead", "3"]) == 0
    three = json.loads(capsys.readouterr().out)
    # The last successor is needed at the very next access: issued 3 accesses ahead of its use,
    # it never lands in time.
    assert one["prefetch"]["timely"] > 0 and three["prefetch"]["timely"] == 0
    assert three["prefetch"]["late"] > 0 and three["device_miss_ratio"] > one["device_miss_ratio"]
    assert main([*base, "--keys-known"]) == 0
    assert json.loads(capsys.readouterr().out)["keys_known"] is True


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--prefetch", "oracle"], "'oracle' is not a predictor"),
        (["--prefetch", ","], "lists no predictor"),
        (["--prefetch", "mlp:/nonexistent/ckpt"], "/nonexistent/ckpt"),
        (["--warmup", "100%"], "--warmup '100%'"),
        (["--warmup", "-3"], "--warmup '-3'"),
        (["--warmup", "lots"], "--warmup 'lots'"),
        (["--lead", "0"], "--lead"),
    ],
)
def test_replay_prefetch_bad_input_is_one_line_exit_2(small_trace, capsys, flags, words):
    rc = main(["replay", small_trace, "--device-bytes", "5%", "--no-progress", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err
    assert len([x for x in err.splitlines() if x.strip()]) == 1


def test_a_replay_process_never_imports_numpy(tmp_path):
    """`cacheflow replay` with the default policy runs without numpy (its import is a tenth of a
    replay's process time: bench.replay_speed): a fresh interpreter replays a small trace and
    checks what it imported."""
    import subprocess
    import sys

    path = tmp_path / "t.jsonl"
    path.write_text("".join(
        json.dumps({"t": i * 0.5, "key": f"k{i % 7}", "nbytes": 4 + i % 3, "kind": "kv"}) + "\n"
        for i in range(200)
    ))  # fmt: skip
    code = (
        "import sys, json, io, contextlib\n"
        "from cacheflow_jax.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    rc = main(['replay', {str(path)!r}, '--device-bytes', '30%', '--json', "
        "'--no-progress'])\n"
        "stats = json.loads(out.getvalue())\n"
        "print(rc, stats['requests'], stats['misses'] > 0, 'numpy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)  # fmt: skip
    assert done.stdout.split() == ["0", "200", "True", "False"], done.stdout + done.stderr
