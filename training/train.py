"""Training the predictor MLP on access logs: logs -> examples -> Optax loop -> checkpoint.

Pipeline (`run`):

1. Read each log with `cacheflow_jax.trace.reader.read_trace` and split it by time: the last
   ``eval_fraction`` of its accesses (moved forward to the next timestamp, so one Mooncake
   request is never cut in two) is held out (the *eval tail*); the last ``val_fraction`` of the
   rest, cut the same way, is the *validation slice*; what precedes it is the *fit part*.
2. Walk each log once with a `predictor.FeatureState`; at sampled positions of the fit part (whose
   whole lookahead window lies in the fit part) record the candidates' features and labels (1 if
   the candidate is accessed within the next ``lookahead`` accesses); at every position of the
   validation slice record the candidates' features and keys.
3. Train a `predictor.ScoreMLP` on the fit part with masked binary cross-entropy, AdamW with
   linear warm-up and cosine decay, a fixed seed; the model is split once and a pure step
   function is jitted.
4. Choose the serving settings ``min_score`` and ``hedge`` on the validation slice (`select`):
   the most recall among the grid settings at least as precise as last_successor there. Nothing
   here reads the eval tail: the validation windows are cut at its start.
5. Evaluate the MLP and the baselines on every log's eval tail (and on ``eval_logs``, which are
   never trained on) with `predictor.prediction_metrics`; time the MLP's ``predict``.
6. Write ``checkpoint/`` (orbax), ``metrics.json`` and ``loss.png`` under ``out``.

Each step has its module: `training.config` (settings), `training.data` (1, 2),
`training.optim` (3), `training.selection` (4), `training.evaluation` (5), `training.outputs`
(6); this one runs them in turn and re-exports their public names (``training.train.config``,
``training.train.run``, ``training.train.select``, ... stay where they were).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cacheflow_jax.trace.reader import split_point
from predictor import MLPPredictor
from training.config import TrainConfig, config
from training.data import (
    Dataset,
    Examples,
    accesses_of,
    build_examples,
    read_accesses,
    read_examples,
)
from training.evaluation import (
    BASELINE_NAMES,
    evaluate,
    evaluate_checkpoint,
    pooled,
    pooled_counts,
)
from training.optim import fit, make_optimizer, masked_bce
from training.outputs import OUTPUTS, check_paths, loss_figure, plot_losses, write_outputs
from training.selection import (
    SELECTION_RULE,
    Validation,
    choose_settings,
    score_examples,
    select,
    validation_grid,
    validation_slice,
)

__all__ = [
    "BASELINE_NAMES",
    "OUTPUTS",
    "SELECTION_RULE",
    "Dataset",
    "Examples",
    "TrainConfig",
    "Validation",
    "accesses_of",
    "build_examples",
    "check_paths",
    "choose_settings",
    "config",
    "evaluate",
    "evaluate_checkpoint",
    "fit",
    "loss_figure",
    "make_optimizer",
    "masked_bce",
    "plot_losses",
    "pooled",
    "pooled_counts",
    "read_accesses",
    "read_examples",
    "run",
    "score_examples",
    "select",
    "split_point",
    "validation_grid",
    "validation_slice",
    "write_outputs",
]


def run(cfg: TrainConfig, *, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Reads the logs, trains, evaluates, and writes the checkpoint, metrics.json and loss.png.

    Args:
      cfg: the settings (see `config`).
      log: receives one-line progress messages.

    Returns:
      The metrics (also written to ``cfg.out / "metrics.json"``): ``{"eval": {"mlp":
      {"precision", "recall"}, "last_successor": ..., "markov": ..., "stride": ...},
      "selected": {"min_score", "hedge", "source": "validation" | "flags"}, "validation":
      {"rule", "slices", "precision_floor", "baselines", "grid"}, "train_seconds",
      "predict_us", "logs": {path: details}, "eval_logs": {path: details}, "train": {...},
      "checkpoint", "outputs": [checkpoint, metrics.json, loss.png], "config"}``.

    Raises:
      FileNotFoundError: a log does not exist.
      ValueError: a log is malformed or too short to train on, or the outputs cannot be
        written (checked before any work, see `check_paths`).
    """
    check_paths(cfg)
    t_start = time.perf_counter()
    data = read_examples(cfg, log=log)
    log(
        f"train: fitting the MLP on {len(data.train)} positions ({cfg.epochs} epochs); the first "
        "step compiles"
    )
    model, history = fit(cfg, data.train, data.held_out)
    selected, validation = choose_settings(cfg, model, data, log=log)
    mlp = MLPPredictor(
        model, cfg.feature_config(), min_score=selected["min_score"], hedge=selected["hedge"]
    )
    train_seconds = time.perf_counter() - t_start
    log("train: evaluating the MLP and the baselines on the held-out tails")
    per_log, cross = _evaluate_tails(cfg, mlp, data)
    results = list(per_log.values())
    timed = [r["predict_us"] for r in results if r["predict_us"] is not None]
    metrics = {
        "eval": pooled(results),
        "selected": selected,
        "validation": validation,
        "train_seconds": train_seconds,
        "predict_us": statistics.median(timed) if timed else None,
        "cross_eval": {p: pooled([r]) for p, r in cross.items()},
        "logs": per_log,
        "eval_logs": cross,
        "train": _train_summary(data, history),
        "config": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()
        },
        "total_seconds": time.perf_counter() - t_start,
    }
    write_outputs(cfg, mlp, metrics, history, log=log)
    return metrics


def _evaluate_tails(
    cfg: TrainConfig, mlp: MLPPredictor, data: Dataset
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """`evaluate` on the tail of each training log, then of each of ``cfg.eval_logs``.

    Returns:
      ``(per_log, cross)``: path -> ``{"accesses", "start", **evaluate(...)}``.
    """

    def evaluate_tail(accesses: list, start: int) -> dict:
        return evaluate(
            mlp,
            accesses,
            start=start,
            top_k=cfg.top_k,
            lookahead=cfg.lookahead,
            timing_calls=cfg.timing_calls,
            progress=cfg.progress,
        )

    per_log = {}
    for path, accesses, start in zip(cfg.logs, data.streams, data.splits):
        r = evaluate_tail(accesses, start)
        per_log[path] = {"accesses": len(accesses), "start": start, **r}
    cross = {}
    for path in cfg.eval_logs:
        accesses = read_accesses(path)
        start = split_point(np.array([a.t for a in accesses]), cfg.eval_fraction)
        r = evaluate_tail(accesses, start)
        cross[path] = {"accesses": len(accesses), "start": start, **r}
    return per_log, cross


def _train_summary(data: Dataset, history: dict[str, Any]) -> dict[str, Any]:
    """The ``"train"`` entry of the metrics: the examples and the loss history."""
    train = data.train
    return {
        "examples": len(train),
        "held_out_examples": len(data.held_out),
        "validation_positions": data.validation_positions,
        "mean_candidates": float(train.mask.sum(1).mean()),
        "positive_rate": float((train.y[..., 0] * train.mask).sum() / max(train.mask.sum(), 1.0)),
        "steps": history["steps"],
        "final_train_loss": float(np.mean(history["train_loss"][-20:])),
        "initial_eval_loss": history["initial_eval_loss"],
        "eval_loss": history["eval_loss"],
    }
