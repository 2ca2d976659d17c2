"""Evaluation of the MLP and the baselines on a log's tail: precision and recall, pooled over
logs, and the MLP's ``predict`` time; `evaluate_checkpoint` for a saved predictor."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import predictor
from cacheflow_jax.trace.reader import split_point
from predictor import Metrics, MLPPredictor
from training.data import read_accesses

BASELINE_NAMES = ("last_successor", "markov", "stride")


def evaluate(
    mlp: MLPPredictor,
    accesses: Sequence[predictor.Access],
    *,
    start: int,
    top_k: int,
    lookahead: int,
    timing_calls: int = 0,
    progress: bool = False,
    label: str = "evaluate",
) -> dict[str, Any]:
    """Precision and recall of the MLP and the baselines on ``accesses[start:]``.

    Every predictor observes the whole stream from its beginning (the head warms up its
    statistics) and predicts at each position from ``start`` on; the MLP is reset first.

    Args:
      mlp: the learned predictor.
      accesses: the stream.
      start: the first evaluated position.
      top_k: keys asked for per position.
      lookahead: W of the metrics.
      timing_calls: also time this many MLP ``predict`` calls (after 100 warm-up calls).
      progress: show a progress bar (the MLP's pass, then one step per baseline) on stderr.
      label: the bar's label.

    Returns:
      ``{"mlp": Metrics, "last_successor": ..., "markov": ..., "stride": ..., "predict_us":
      median microseconds per MLP predict call (None when not timed)}``.
    """
    keys = [a.key for a in accesses]
    out: dict[str, Any] = {}
    mlp.reset()
    times: list[float] = []
    preds: list[list[str]] = []
    clock = time.perf_counter
    bar = tqdm(
        total=len(accesses) * (1 + len(BASELINE_NAMES)),
        desc=label,
        unit="acc",
        file=sys.stderr,
        disable=not progress,
        mininterval=0.5,
    )
    with bar:
        for i, access in enumerate(accesses):
            mlp.observe(access)
            if i >= start:
                t0 = clock()
                got = mlp.predict(top_k)
                times.append(clock() - t0)
                preds.append([key for key, _ in got])
            if i % 1024 == 1023:
                bar.update(1024)
        bar.update(len(accesses) - len(accesses) // 1024 * 1024)
        out["mlp"] = predictor.prediction_metrics(keys, preds, start=start, lookahead=lookahead)
        for name in BASELINE_NAMES:
            preds = predictor.run_predictor(
                predictor.BASELINES[name](), accesses, start=start, top_k=top_k
            )
            out[name] = predictor.prediction_metrics(keys, preds, start=start, lookahead=lookahead)
            bar.update(len(accesses))
    timed = times[100 : 100 + timing_calls] if timing_calls else []
    out["predict_us"] = statistics.median(timed) * 1e6 if timed else None
    return out


def pooled(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Precision and recall of each predictor over several logs' evaluations (pooled counts)."""
    out = {}
    for name in ("mlp", *BASELINE_NAMES):
        counts = pooled_counts([r[name] for r in results])
        out[name] = {"precision": counts["precision"], "recall": counts["recall"]}
    return out


def pooled_counts(results: Sequence[Metrics]) -> dict[str, Any]:
    """One predictor's `Metrics` over several logs, counts summed, precision/recall recomputed."""
    made = sum(r["predictions"] for r in results)
    correct = sum(r["correct"] for r in results)
    events = sum(r["seen_accesses"] for r in results)
    hits = sum(r["predicted_accesses"] for r in results)
    return {
        "precision": correct / made if made else 0.0,
        "recall": hits / events if events else 0.0,
        "predictions": made,
        "correct": correct,
        "seen_accesses": events,
        "predicted_accesses": hits,
    }


def evaluate_checkpoint(
    checkpoint: str | Path,
    logs: Sequence[str],
    *,
    top_k: int = 4,
    eval_fraction: float = 0.3,
    timing_calls: int = 2_000,
) -> dict[str, Any]:
    """Evaluates a saved predictor, unchanged, on the tails of ``logs`` (no training).

    Args:
      checkpoint: a directory written by `run` (``OUT/checkpoint``) or `predictor.save`.
      logs: access logs to evaluate on.
      top_k: keys asked for per position.
      eval_fraction: the evaluated tail of each log; the head only warms up the predictors.
      timing_calls: MLP ``predict`` calls timed.

    Returns:
      ``{"eval": pooled metrics, "predict_us", "logs": {path: details}}``.

    Raises:
      predictor.CheckpointError: the checkpoint is missing or unreadable.
    """
    mlp = predictor.load(checkpoint)
    results, per_log = [], {}
    for path in logs:
        accesses = read_accesses(path)
        start = split_point(np.array([a.t for a in accesses]), eval_fraction)
        r = evaluate(
            mlp,
            accesses,
            start=start,
            top_k=top_k,
            lookahead=mlp.config.lookahead,
            timing_calls=timing_calls,
        )
        results.append(r)
        per_log[path] = {"accesses": len(accesses), "start": start, **r}
    timed = [r["predict_us"] for r in results if r["predict_us"] is not None]
    return {
        "eval": pooled(results),
        "predict_us": statistics.median(timed) if timed else None,
        "logs": per_log,
    }
