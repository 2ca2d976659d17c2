"""The demo's predictors: a given MLP checkpoint, or one trained on the warm-up's access log, and
the warm-up's history that every prefetching row's predictor starts from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cacheflow_jax.cli.demo_settings import DemoError

if TYPE_CHECKING:  # the library imports `predictor` only through the Predictor protocol
    import predictor

# `python -m training.main` settings for the MLP trained on the warm-up log: a window of two
# layers' experts (what the layer-ahead prefetcher needs); about 10 s on 2 cores.
TRAIN_ARGS = ("--epochs", "12", "--history", "4", "--lookahead", "4", "--eval-fraction", "0.2")


def load_checkpoint(path: Path, log: Callable[[str], None]) -> predictor.Predictor | None:
    """Loads an MLP predictor checkpoint; a damaged one warns once and gives None.

    Raises:
      predictor.CheckpointError: ``path`` is missing or not a checkpoint (pointing at
        ``path/checkpoint`` when ``path`` is a training output directory).
    """
    from predictor import CheckpointError, CorruptCheckpointError
    from predictor import load as load_predictor

    try:
        return load_predictor(path)
    except CorruptCheckpointError as err:
        # A damaged checkpoint must not stop serving: serve without it, and say so once.
        log(f"warning: {err}; serving cacheflow+mlp without the predictor (no prefetch)")
        return None
    except CheckpointError as err:
        inner = Path(path) / "checkpoint"
        if not (inner / "meta").is_dir():
            raise
        raise CheckpointError(f"{err} (did you mean --predictor {inner}?)") from err


def train_mlp(log_path: Path, out: Path, *, k: int, log: Callable[[str], None]) -> Path:
    """Trains the MLP predictor on ``log_path`` with ``python -m training.main`` (a subprocess).

    Returns:
      The checkpoint directory (``out/checkpoint``).

    Raises:
      DemoError: the training failed (the message has its last error line).
    """
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "training.main", str(log_path), "--out", str(out),
           *TRAIN_ARGS, "--top-k", str(k), "--json", "--no-progress"]  # fmt: skip
    log(f"demo: training the MLP predictor: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    # training/ sits beside cacheflow_jax/ in the checkout and in the installed wheel alike.
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DemoError(
            f"training the MLP predictor on {log_path} failed (exit {proc.returncode}): {last}; "
            "pass a trained checkpoint with --predictor instead"
        )
    metrics = json.loads(proc.stdout)
    ev = metrics["eval"]
    log(
        f"demo: trained in {time.perf_counter() - t0:.1f} s; held-out precision/recall: mlp "
        f"{ev['mlp']['precision']:.3f}/{ev['mlp']['recall']:.3f}, markov "
        f"{ev['markov']['precision']:.3f}/{ev['markov']['recall']:.3f}"
    )
    return out / "checkpoint"


def read_log(path: Path) -> list[dict]:
    """The records of an access log v1 file written by `serving` (JSON Lines)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def primed(p: predictor.Predictor, records: Sequence[dict], *, k: int) -> predictor.Predictor:
    """``p`` after a reset and observing ``records``: it starts with the warm-up's history.

    One ``predict(k)`` follows (it changes no state): the MLP's jit compilation happens here,
    not in the prefetch worker during the first served steps.
    """
    p.reset()
    for record in records:
        p.observe(record)
    p.predict(k)
    return p
