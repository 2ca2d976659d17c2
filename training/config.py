"""The training settings: `TrainConfig`, made and checked by `config` (the one place settings
are made, as the ``get_config`` of a Flax example)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from predictor import FeatureConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """All settings of a training run; make one with `config`.

    Attributes:
      logs: access logs to train on (any format `read_trace` reads); their tails are evaluated.
      out: output directory (checkpoint/, metrics.json, loss.png).
      eval_logs: logs only evaluated on (cross-trace), never trained on.
      history: H, keys of context whose successors are candidates.
      lookahead: W, the prediction window (labels and metrics).
      top_k: keys each predictor proposes per position in the evaluation.
      epochs: passes over the training examples.
      eval_fraction: the held-out tail of each log, by time, in (0, 1).
      val_fraction: the validation slice, the last part (by time) of what precedes the eval tail,
        in (0, 1); the model is fit on the rest, the serving settings are chosen on it.
      seed: seeds the example sampling, the initialisation and the batch order.
      learning_rate: AdamW peak learning rate.
      weight_decay: AdamW weight decay.
      warmup_fraction: share of the steps with a linear warm-up (then cosine decay).
      batch_size: positions per step (each with up to ``max_candidates`` candidates).
      hidden: width of the MLP's hidden layers.
      max_candidates: candidates scored per position.
      max_train_positions: training positions sampled per log (all when fewer).
      max_eval_examples: held-out positions sampled per log for the eval loss curve.
      min_score: the served predictor's lowest probability of a confident proposal; None (the
        default) chooses it from ``min_score_grid`` on the validation slice (`select`).
      hedge: successor candidates the served predictor adds below ``min_score`` (see
        `predictor.MLPPredictor`); None (the default) chooses it from ``hedge_grid``.
      min_score_grid: the ``min_score`` values tried on the validation slice.
      hedge_grid: the ``hedge`` values tried on the validation slice.
      timing_calls: ``predict`` calls timed for ``predict_us`` (after 100 warm-up calls).
      progress: show progress bars on stderr.
    """

    logs: tuple[str, ...]
    out: Path
    eval_logs: tuple[str, ...] = ()
    history: int = 4
    lookahead: int = 8
    top_k: int = 4
    epochs: int = 8
    eval_fraction: float = 0.3
    val_fraction: float = 0.15
    seed: int = 0
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    warmup_fraction: float = 0.05
    batch_size: int = 256
    hidden: int = 64
    max_candidates: int = 48
    max_train_positions: int = 100_000
    max_eval_examples: int = 8_000
    min_score: float | None = None
    hedge: int | None = None
    min_score_grid: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
    hedge_grid: tuple[int, ...] = (0, 1, 2, 3)
    timing_calls: int = 2_000
    progress: bool = True

    def feature_config(self) -> FeatureConfig:
        """The feature settings these training settings imply."""
        return FeatureConfig(
            history=self.history,
            lookahead=self.lookahead,
            max_candidates=self.max_candidates,
            chain_depth=self.lookahead,
        )


def config(logs: Sequence[str], out: str | Path, **overrides: Any) -> TrainConfig:
    """The training settings: defaults, then ``overrides``; the one place settings are made.

    Args:
      logs: access logs to train on.
      out: the output directory.
      **overrides: any other `TrainConfig` field.

    Returns:
      The checked settings.

    Raises:
      ValueError: no logs, an unknown setting, or a value out of range (the message names it).
    """
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(overrides) - names
    if unknown:
        raise ValueError(f"unknown training settings {sorted(unknown)}; known: {sorted(names)}")
    if not logs:
        raise ValueError("give at least one access log to train on")
    cfg = TrainConfig(
        logs=tuple(str(p) for p in logs),
        out=Path(out).expanduser().resolve(),
        **{k: _tupled(k, v) for k, v in overrides.items()},
    )
    for name in (
        "history",
        "lookahead",
        "top_k",
        "epochs",
        "batch_size",
        "hidden",
        "max_candidates",
        "max_train_positions",
        "max_eval_examples",
        "timing_calls",
    ):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if not 0.0 < cfg.eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {cfg.eval_fraction}")
    if not 0.0 <= cfg.warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {cfg.warmup_fraction}")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {cfg.val_fraction}")
    if not cfg.min_score_grid or not cfg.hedge_grid:
        raise ValueError("min_score_grid and hedge_grid must not be empty")
    for m in (*cfg.min_score_grid, *(() if cfg.min_score is None else (cfg.min_score,))):
        if not 0.0 <= m <= 1.0:
            raise ValueError(f"--min-score {m} must be in [0, 1]")
    for h in (*cfg.hedge_grid, *(() if cfg.hedge is None else (cfg.hedge,))):
        if h < 0:
            raise ValueError(f"--hedge {h} must be >= 0")
    if not cfg.learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {cfg.learning_rate}")
    cfg.feature_config()  # checks the feature settings too
    return cfg


def _tupled(name: str, value: Any) -> Any:
    if name == "eval_logs":
        return tuple(map(str, value))
    if name in ("min_score_grid", "hedge_grid"):
        return tuple(value)
    return value
