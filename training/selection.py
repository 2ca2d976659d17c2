"""Choosing the serving settings ``min_score`` and ``hedge`` on the validation slice: the model
scores each slice once (`validation_slice`), every grid setting is applied to the stored scores
(`validation_grid`), and `select` applies `SELECTION_RULE`."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

import predictor
from predictor import Metrics, ScoreMLP
from training.config import TrainConfig
from training.data import Dataset, Examples
from training.evaluation import BASELINE_NAMES, pooled_counts

SELECTION_RULE = (
    "on the validation slice (the last val_fraction of the accesses before the eval tail, the "
    "model fit on the accesses before it): among the grid settings (min_score, hedge) whose "
    "pooled precision is at least last_successor's there, the one with the most recall (ties: "
    "more precision, then the higher min_score, then the smaller hedge); if none is that "
    "precise, the most precise setting (ties: more recall, higher min_score, smaller hedge)"
)


@dataclasses.dataclass
class Validation:
    """One log's validation slice, scored by the model: everything `select` needs.

    Built only from the accesses before the eval tail (``keys`` ends there), so nothing chosen
    from it depends on the eval tail.
    """

    keys: list[str]  # the stream's keys up to the eval tail (exclusive)
    start: int  # the first validation position; positions start..len(keys)-1 are validated
    scores: np.ndarray  # float32 [P, C, 2], `predictor.score_candidates` of each candidate
    successor: np.ndarray  # bool [P, C], `predictor.successor_mask`
    keep: np.ndarray  # int [P], `predictor.last_successor_index` (-1: none)
    candidates: list[list[str]]  # the candidate keys at each position
    baselines: dict[str, Metrics]  # each baseline's metrics on the slice


def score_examples(model: ScoreMLP, x: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """`predictor.score_candidates` of ``x`` (``[P, C, F]``) in fixed-size jitted chunks."""
    graphdef, state = nnx.split(model)
    score = jax.jit(functools.partial(predictor.score_candidates, graphdef, state))
    out = np.zeros((*x.shape[:2], 2), np.float32)
    for lo in range(0, len(x), chunk):
        part = x[lo : lo + chunk]
        padded = np.zeros((chunk, *x.shape[1:]), np.float32)
        padded[: len(part)] = part
        out[lo : lo + len(part)] = np.asarray(score(padded))[: len(part)]
    return out


def validation_slice(
    model: ScoreMLP,
    accesses: Sequence[predictor.Access],
    examples: Examples,
    *,
    start: int,
    end: int,
    top_k: int,
    lookahead: int,
) -> Validation:
    """Scores the validation examples and runs the baselines on positions ``start..end-1``.

    Args:
      model: the trained model.
      accesses: the stream; only ``accesses[:end]`` is read.
      examples: the features and candidate keys at every position ``start..end-1``
        (`build_examples` with ``keep_keys``).
      start: the first validation position.
      end: the first position of the eval tail.
      top_k: keys asked for per position.
      lookahead: W of the metrics.

    Returns:
      The `Validation` slice.
    """
    head = accesses[:end]
    keys = [a.key for a in head]
    baselines = {}
    for name in BASELINE_NAMES:
        preds = predictor.run_predictor(predictor.BASELINES[name](), head, start=start, top_k=top_k)
        baselines[name] = predictor.prediction_metrics(
            keys, preds, start=start, lookahead=lookahead
        )
    return Validation(
        keys=keys,
        start=start,
        scores=score_examples(model, examples.x),
        successor=predictor.successor_mask(examples.x),
        keep=predictor.last_successor_index(examples.x),
        candidates=list(examples.keys or []),
        baselines=baselines,
    )


def validation_grid(
    slices: Sequence[Validation],
    *,
    min_scores: Sequence[float],
    hedges: Sequence[int],
    top_k: int,
    lookahead: int,
) -> list[dict[str, Any]]:
    """The MLP's pooled metrics on the validation slices for every ``(min_score, hedge)``.

    Applies `predictor.choose` (the serving rule of `MLPPredictor.predict`) to the stored scores,
    so the model runs once per position, not once per setting.

    Returns:
      One row per setting: ``{"min_score", "hedge", "precision", "recall", "predictions",
      "correct", "seen_accesses", "predicted_accesses"}``.
    """
    rows = []
    for min_score in min_scores:
        for hedge in hedges:
            results = []
            for v in slices:
                preds = []
                for p, cands in enumerate(v.candidates):
                    n = len(cands)
                    chosen = predictor.choose(
                        v.scores[p, :n],
                        v.successor[p, :n],
                        top_k,
                        min_score,
                        hedge,
                        keep=int(v.keep[p]),
                    )
                    preds.append([cands[i] for i in chosen])
                results.append(
                    predictor.prediction_metrics(v.keys, preds, start=v.start, lookahead=lookahead)
                )
            rows.append({"min_score": min_score, "hedge": hedge, **pooled_counts(results)})
    return rows


def select(rows: Sequence[dict[str, Any]], precision_floor: float) -> dict[str, Any]:
    """The grid row `SELECTION_RULE` picks.

    Args:
      rows: `validation_grid` rows.
      precision_floor: last_successor's pooled precision on the validation slices.

    Returns:
      The chosen row.

    >>> rows = [{"min_score": 0.9, "hedge": 0, "precision": 0.99, "recall": 0.90},
    ...         {"min_score": 0.5, "hedge": 3, "precision": 0.80, "recall": 0.99},
    ...         {"min_score": 0.7, "hedge": 1, "precision": 0.95, "recall": 0.95}]
    >>> select(rows, 0.94)["min_score"], select(rows, 0.999)["min_score"]
    (0.7, 0.9)
    """
    if not rows:
        raise ValueError("no grid rows to select from")
    feasible = [r for r in rows if r["precision"] >= precision_floor]
    if feasible:
        return max(
            feasible, key=lambda r: (r["recall"], r["precision"], r["min_score"], -r["hedge"])
        )
    return max(rows, key=lambda r: (r["precision"], r["recall"], r["min_score"], -r["hedge"]))


def choose_settings(
    cfg: TrainConfig, model: ScoreMLP, data: Dataset, *, log: Callable[[str], None]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Chooses ``min_score`` and ``hedge`` on the validation slices of ``data`` (`select`).

    Settings given in ``cfg`` (``min_score``, ``hedge``) are kept; the others are chosen from
    ``cfg``'s grids. ``data.val`` is emptied once scored (its features are not needed again).

    Args:
      cfg: the settings (grids, top_k, lookahead, logs).
      model: the trained model.
      data: the logs and their validation examples.
      log: receives one-line progress messages.

    Returns:
      ``(selected, validation)``: ``{"min_score", "hedge", "source": "validation" | "flags"}``
      and ``{"rule", "slices", "precision_floor", "baselines", "mlp", "grid", "seconds"}``.
    """
    log(
        "train: choosing min_score and hedge on the validation slices "
        f"({data.validation_positions} positions)"
    )

    t_select = time.perf_counter()
    slices = [
        validation_slice(
            model,
            accesses,
            ex,
            start=val_start,
            end=start,
            top_k=cfg.top_k,
            lookahead=cfg.lookahead,
        )
        for accesses, ex, val_start, start in zip(
            data.streams, data.val, data.val_starts, data.splits
        )
    ]
    data.val.clear()
    grid = validation_grid(
        slices,
        min_scores=cfg.min_score_grid if cfg.min_score is None else (cfg.min_score,),
        hedges=cfg.hedge_grid if cfg.hedge is None else (cfg.hedge,),
        top_k=cfg.top_k,
        lookahead=cfg.lookahead,
    )
    val_baselines = {
        name: pooled_counts([v.baselines[name] for v in slices]) for name in BASELINE_NAMES
    }
    floor = val_baselines["last_successor"]["precision"]
    chosen = select(grid, floor)
    selected = {
        "min_score": chosen["min_score"],
        "hedge": chosen["hedge"],
        "source": "flags" if cfg.min_score is not None and cfg.hedge is not None else "validation",
    }
    del slices
    validation = {
        "rule": SELECTION_RULE,
        "slices": {p: [v, s] for p, v, s in zip(cfg.logs, data.val_starts, data.splits)},
        "precision_floor": floor,
        "baselines": val_baselines,
        "mlp": chosen,
        "grid": grid,
        "seconds": time.perf_counter() - t_select,
    }
    log(
        f"train: selected min_score {selected['min_score']} hedge {selected['hedge']} "
        f"({selected['source']}): validation precision {chosen['precision']:.4f} recall "
        f"{chosen['recall']:.4f}; last_successor {floor:.4f} / "
        f"{val_baselines['last_successor']['recall']:.4f}"
    )
    return selected, validation
