"""Warnings where a user would go wrong (issue 30): a budget smaller than a block, a streamed
working set larger than L1, a prefetcher that can issue nothing; and a file that is not a trace.

Each is checked where a user meets it: the library (logger ``cacheflow_jax``, caught with
``caplog``) and the command line (one ``cacheflow <command>: warning:`` line on stderr). Real
stores and real traces on disk; nothing is mocked.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

import cacheflow_jax as cfj
import predictor
from cacheflow_jax.cli import main
from cacheflow_jax.replay.engine import replay
from cacheflow_jax.trace.reader import TraceFormatError, read_trace

MiB = 1 << 20


def _log(path: Path, keys: list[str], nbytes: int = MiB) -> Path:
    with open(path, "w") as f:
        for i, key in enumerate(keys):
            f.write(json.dumps({"t": i * 0.01, "key": key, "nbytes": nbytes, "kind": "weight"}))
            f.write("\n")
    return path


def _passes(layers: int, passes: int) -> list[str]:
    """A model streamed layer by layer: every layer's block, in order, once per pass."""
    return [f"layers/{i}/w@0,0" for _ in range(passes) for i in range(layers)]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "cacheflow_jax" and r.levelno == logging.WARNING]  # fmt: skip


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------- a budget below a block


def test_replay_warns_when_l1_is_smaller_than_a_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trace = read_trace(_log(tmp_path / "a.jsonl", _passes(10, 3)))
    with caplog.at_level(logging.WARNING, logger="cacheflow_jax"):
        out = replay(trace, device_bytes=MiB // 2, host_bytes=0)
    assert out["hits"]["device"] == 0
    said = _warnings(caplog)
    assert any("smaller than 10 of the 10 distinct blocks" in w and "1048576" in w
               and "30 accesses cannot be L1 hits" in w for w in said), said  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cacheflow_jax"):
        replay(trace, device_bytes=16 * MiB, host_bytes=0)
    assert _warnings(caplog) == []  # a budget that holds everything: not a word


def test_cli_replay_5_percent_of_a_small_log_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: --device-bytes 5% of a small log was smaller than one block."""
    log = _log(tmp_path / "small.jsonl", _passes(10, 3))
    code, out, err = _cli(capsys, "replay", str(log), "--device-bytes", "5%", "--no-progress",
                          "--prefetch", "none,markov")  # fmt: skip
    assert code == 0 and "markov" in out
    lines = [line for line in err.splitlines() if line.startswith("cacheflow replay: warning:")]
    assert any("--device-bytes 5%" in line and "never held in L1" in line for line in lines)
    assert any("the prefetcher can issue nothing: no block fits L1" in line for line in lines)
    assert "Traceback" not in err


# ------------------------------------------------------------ a streamed working set > L1


def test_replay_warns_about_a_stream_larger_than_l1_and_not_about_one_that_fits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trace = read_trace(_log(tmp_path / "s.jsonl", _passes(8, 20)))
    with caplog.at_level(logging.WARNING, logger="cacheflow_jax"):
        out = replay(trace, device_bytes=4 * MiB, host_bytes=16 * MiB, policy="lru")
    assert out["hits"]["device"] == 0
    said = _warnings(caplog)
    assert len(said) == 1 and "0 of 160 requests were served from L1" in said[0]
    assert "8388608 bytes of distinct blocks" in said[0] and "device_bytes" in said[0]
    assert "integration.md" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cacheflow_jax"):
        out = replay(trace, device_bytes=8 * MiB, host_bytes=0)
    assert out["hits"]["device"] == 160 - 8 and _warnings(caplog) == []


def test_a_serving_session_warns_at_exit_when_l1_never_serves_a_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's case: a model streamed layer by layer, L1 smaller than one pass, 20 passes."""
    layers = [{"w": np.full((64, 1024), i, np.float32)} for i in range(8)]  # 256 KiB each
    store = cfj.write_store({"layers": layers}, tmp_path / "w", chunk_bytes=256 << 10)
    keys = _passes(8, 20)
    small = cfj.TieredCache(store, device_bytes=1 * MiB, host_bytes=4 * MiB)
    with caplog.at_level(logging.WARNING, logger="cacheflow_jax"), cfj.serving(small) as s:
        for key in keys:
            s.get(key)
    assert s.stats()["hits"]["device"] == 0
    said = _warnings(caplog)
    assert len(said) == 1 and "0 of 160 requests were served from L1" in said[0]
    assert "device_bytes" in said[0] and "prefetch" in said[0], said
    caplog.clear()
    fits = cfj.TieredCache(store, device_bytes=2 * MiB, host_bytes=0)
    with caplog.at_level(logging.WARNING, logger="cacheflow_jax"), cfj.serving(fits) as s:
        for key in keys:
            s.get(key)
    assert s.stats()["hits"]["device"] == 160 - 8 and _warnings(caplog) == []


# ---------------------------------------------------------- a prefetcher that issues nothing


def test_replay_warns_when_the_prefetcher_issued_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trace = read_trace(_log(tmp_path / "p.jsonl", _passes(8, 20)))
    settings = cfj.PrefetchSettings(keys_known=True)
    with caplog.at_level(logging.WARNING, logger="cacheflow_jax"):
        out = replay(trace, device_bytes=4 * MiB, host_bytes=16 * MiB,
                     prefetcher=predictor.markov(), prefetch=settings)  # fmt: skip
    assert out["prefetch"]["issued"] == 0
    said = [w for w in _warnings(caplog) if "issued nothing" in w]
    assert len(said) == 1 and "replay does not move a guess from L2 up to L1" in said[0]
    # The fix it names: with no L2, the guesses are loaded from L3, and nothing is said of them.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cacheflow_jax"):
        out = replay(trace, device_bytes=4 * MiB, host_bytes=0, prefetcher=predictor.markov(),
                     prefetch=settings)  # fmt: skip
    assert out["prefetch"]["issued"] > 0
    assert not [w for w in _warnings(caplog) if "prefetcher" in w]


def test_an_in_flight_bound_below_every_block_is_said_when_the_cache_is_built(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = cfj.write_store({"w": np.zeros((64, 64), np.float32)}, tmp_path / "w")
    with caplog.at_level(logging.WARNING, logger="cacheflow_jax"):
        cfj.TieredCache(store, device_bytes=MiB, host_bytes=0, prefetcher=predictor.markov(),
                        prefetch=cfj.PrefetchSettings(inflight_bytes=1000)).close()  # fmt: skip
    said = _warnings(caplog)
    assert len(said) == 1 and "inflight_bytes=1000" in said[0] and "16384" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cacheflow_jax"):
        cfj.TieredCache(store, device_bytes=MiB, host_bytes=0, prefetcher=predictor.markov(),
                        prefetch=cfj.PrefetchSettings(inflight_bytes=16384)).close()  # fmt: skip
    assert _warnings(caplog) == []


# --------------------------------------------------------------------- not a trace


@pytest.mark.parametrize("command", ["stats", "replay"])
def test_a_python_file_is_not_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    script = tmp_path / "make_ckpt.py"
    script.write_text('"""Makes a checkpoint."""\n\nimport numpy as np\nprint(np.ones(3))\n')
    extra = ["--device-bytes", "5"] if command == "replay" else []
    code, out, err = _cli(capsys, command, str(script), *extra)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"{script} is not a trace" in err and "--format" in err
    with pytest.raises(TraceFormatError, match="is not a trace"):
        read_trace(script)


def test_a_binary_file_is_not_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blob = tmp_path / "weights.bin"
    blob.write_bytes(bytes(range(256)) * 4)
    code, _, err = _cli(capsys, "stats", str(blob))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "is not a trace: it is not text" in err
    keys = tmp_path / "keys.txt"  # one key per line stays a trace, by its name
    keys.write_text("a\nb\na\n")
    assert read_trace(keys).keys == ["a", "b", "a"]
