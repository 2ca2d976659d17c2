"""The run's outputs under ``cfg.out``: checked before any work (`check_paths`), then written
(`write_outputs`): ``checkpoint/`` (orbax), ``metrics.json`` and ``loss.png``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import predictor
from predictor import MLPPredictor
from training.config import TrainConfig
from training.selection import SELECTION_RULE

OUTPUTS = ("checkpoint", "metrics.json", "loss.png")


def check_paths(cfg: TrainConfig) -> None:
    """Checks, before any work, that the logs can be read and the outputs written.

    Nothing is created. ``cfg.out`` must be a directory or not exist yet (with a writable
    directory above it), and the outputs in it must not be of the wrong kind (a ``checkpoint``
    file, a ``metrics.json`` directory).

    Raises:
      FileNotFoundError: a log does not exist.
      ValueError: a log is a directory, or an output cannot be written (the message says why).
    """
    for path in (*cfg.logs, *cfg.eval_logs):
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"access log {path} is a directory; give a log file")
        if not p.exists():
            raise FileNotFoundError(f"access log {path} does not exist")
    out = cfg.out
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory (it is created if missing)")
    if out.is_dir():
        for name in OUTPUTS:
            target = out / name
            if target.exists() and target.is_dir() != (name == "checkpoint"):
                kind = "a directory" if target.is_dir() else "a file"
                raise ValueError(
                    f"--out {out}: {target} is {kind} and would be replaced by the "
                    f"{'checkpoint directory' if name == 'checkpoint' else name}; move it away "
                    "or give another --out"
                )
        parent = out
    else:
        parent = out.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise ValueError(f"--out {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: cannot write in {parent} (permission denied)")


def plot_losses(history: dict[str, Any], path: Path) -> None:
    """Writes the training and eval loss curves as a PNG (matplotlib, Agg backend)."""
    import matplotlib.pyplot as plt

    fig = loss_figure(history)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def loss_figure(history: dict[str, Any]) -> Any:
    """The training and eval loss curves on a log scale, as a matplotlib figure.

    Args:
      history: `fit`'s loss history.

    Returns:
      The figure (the caller saves and closes it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    losses = np.asarray(history["train_loss"])
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.6, alpha=0.5, label="train (per step)")
    if len(losses) >= 20:
        k = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, len(losses) + 1), smooth, lw=1.5, label=f"train (mean of {k})")
    ev = [(s, v) for s, v in history["eval_loss"] if not math.isnan(v)]
    if ev:
        steps, values = zip(*([(0, history["initial_eval_loss"])] + ev))
        ax.plot(steps, values, "o-", label="held-out tail")
    ax.set_xlabel("step")
    # The loss falls by an order of magnitude in the first few hundred steps; on a linear axis
    # the rest of the run, where the useful differences are, would be squashed flat.
    ax.set_yscale("log")
    ax.set_ylabel("masked BCE (log scale)")
    ax.set_title("predictor MLP loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    return fig


def write_outputs(
    cfg: TrainConfig,
    mlp: MLPPredictor,
    metrics: dict[str, Any],
    history: dict[str, Any],
    *,
    log: Callable[[str], None],
) -> None:
    """Writes ``checkpoint/``, ``loss.png`` and ``metrics.json`` under ``cfg.out`` (created).

    Adds ``"checkpoint"`` and ``"outputs"`` to ``metrics`` before writing it; the checkpoint's
    extra metadata holds the evaluation, the logs and the selected serving settings.

    Args:
      cfg: the settings (``out``, ``logs``).
      mlp: the served predictor, with the selected settings.
      metrics: `training.train.run`'s metrics (``"eval"``, ``"selected"``, ``"validation"``).
      history: `training.optim.fit`'s loss history.
      log: receives one line naming what was written.
    """
    cfg.out.mkdir(parents=True, exist_ok=True)
    ckpt = predictor.save(
        cfg.out / "checkpoint",
        mlp,
        extra={
            "eval": metrics["eval"],
            "logs": list(cfg.logs),
            "selected": metrics["selected"],
            "selection_rule": SELECTION_RULE,
            "validation_slices": metrics["validation"]["slices"],
        },
    )
    metrics["checkpoint"] = str(ckpt)
    metrics["outputs"] = [str(ckpt), str(cfg.out / "metrics.json"), str(cfg.out / "loss.png")]
    plot_losses(history, cfg.out / "loss.png")
    (cfg.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    log(f"train: wrote {', '.join(metrics['outputs'])}")
