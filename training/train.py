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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import predictor
from cacheflow_jax.trace.reader import Trace, read_trace, split_point
from predictor import FeatureConfig, FeatureState, Metrics, MLPPredictor, ScoreMLP

BASELINE_NAMES = ("last_successor", "markov", "stride")


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


# --------------------------------------------------------------------------------------------
# data


def accesses_of(trace: Trace) -> list[predictor.Access]:
    """The trace's accesses as `predictor.Access` records."""
    return [
        predictor.Access(k, t, n, kind, req)
        for k, t, n, kind, req in zip(
            trace.keys, trace.t.tolist(), trace.nbytes.tolist(), trace.kinds, trace.reqs
        )
    ]


@dataclasses.dataclass
class Examples:
    """Candidate features and labels at sampled positions."""

    x: np.ndarray  # float32 [P, C, F]
    y: np.ndarray  # float32 [P, C, 2]: accessed within the window; accessed next
    mask: np.ndarray  # float32 [P, C], 1 for a real candidate
    keys: list[list[str]] | None = None  # the candidate keys per position, when asked for

    def __len__(self) -> int:
        return len(self.x)


def build_examples(
    accesses: Sequence[predictor.Access],
    feature_config: FeatureConfig,
    positions: dict[str, np.ndarray],
    *,
    ends: Mapping[str, int] | None = None,
    keep_keys: Collection[str] = (),
    progress: Callable[[int], None] | None = None,
) -> dict[str, Examples]:
    """Walks the stream once and records examples at each named set of positions.

    Args:
      accesses: the stream.
      feature_config: the feature settings.
      positions: name -> sorted positions at which to record (after observing that access).
      ends: name -> a stream position; the labels of those positions see only the accesses
        before it (the window is cut there). Default: the end of the stream.
      keep_keys: names whose `Examples` also keep the candidate keys (``Examples.keys``).
      progress: called with the number of accesses walked, now and then.

    Returns:
      name -> the `Examples` at those positions; a candidate's labels are whether its key is
      accessed within the next ``feature_config.lookahead`` accesses, and whether it is the next.
    """
    c, f = feature_config.max_candidates, predictor.NUM_FEATURES
    w = feature_config.lookahead
    out = {
        name: Examples(
            np.zeros((len(p), c, f), np.float32),
            np.zeros((len(p), c, 2), np.float32),
            np.zeros((len(p), c), np.float32),
            [] if name in keep_keys else None,
        )
        for name, p in positions.items()
    }
    ends = ends or {}
    wanted: dict[int, list[tuple[str, int]]] = {}
    for name, pos in positions.items():
        for row, i in enumerate(pos.tolist()):
            wanted.setdefault(i, []).append((name, row))
    keys = [a.key for a in accesses]
    state = FeatureState(feature_config)
    last = max(wanted, default=-1)
    for i, access in enumerate(accesses[: last + 1]):
        state.observe(access)
        if progress is not None and i % 4096 == 4095:
            progress(4096)
        for name, row in wanted.get(i, ()):
            ex = out[name]
            cands = state.features_into(ex.x[row])
            end = min(i + 1 + w, ends.get(name, len(keys)))
            window = set(keys[i + 1 : end])
            nxt = keys[i + 1] if i + 1 < end else None
            if ex.keys is not None:
                ex.keys.append(cands)
            if cands:  # none at a stream's first access when its key has no 1-d index
                ex.y[row, : len(cands)] = [(key in window, key == nxt) for key in cands]
                ex.mask[row, : len(cands)] = 1.0
    if progress is not None:
        # The walk stops at the last recorded position; the rest of the stream is done too.
        progress(len(accesses) - (last + 1) // 4096 * 4096)
    return out


def _sample(lo: int, hi: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if hi <= lo:
        return np.zeros(0, np.int64)
    if hi - lo <= n:
        return np.arange(lo, hi)
    return np.sort(rng.choice(np.arange(lo, hi), size=n, replace=False))


# --------------------------------------------------------------------------------------------
# optimisation


def masked_bce(model: ScoreMLP, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean binary cross-entropy of both logits (window, next) over the real candidates."""
    losses = optax.sigmoid_binary_cross_entropy(model(x), y).sum(-1)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_optimizer(cfg: TrainConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW with a linear warm-up to ``learning_rate`` and a cosine decay to 1% of it."""
    warmup = max(1, int(cfg.warmup_fraction * total_steps))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.learning_rate * 0.01,
    )
    return optax.adamw(schedule, weight_decay=cfg.weight_decay)


def fit(
    cfg: TrainConfig, train: Examples, held_out: Examples | None
) -> tuple[ScoreMLP, dict[str, Any]]:
    """Trains a `ScoreMLP` on ``train``; returns it and the loss history.

    Args:
      cfg: the settings (epochs, batch size, optimiser, seed, width).
      train: the training examples (at least one).
      held_out: examples for the per-epoch eval loss, or None.

    Returns:
      ``(model, history)`` with history ``{"steps", "train_loss": [per step], "eval_loss":
      [(step, loss) per epoch], "initial_eval_loss"}``.

    Raises:
      ValueError: no training examples.
    """
    if len(train) == 0:
        raise ValueError(
            "no training examples: the logs' heads are shorter than the lookahead window; give "
            "longer logs or a smaller --eval-fraction/--lookahead"
        )
    model = ScoreMLP(predictor.NUM_FEATURES, hidden=cfg.hidden, rngs=nnx.Rngs(cfg.seed))
    graphdef, params = nnx.split(model)
    bs = min(cfg.batch_size, len(train))
    per_epoch = max(1, len(train) // bs)
    total = per_epoch * cfg.epochs
    tx = make_optimizer(cfg, total)
    opt_state = tx.init(params)

    def loss_fn(params: nnx.State, x: jax.Array, y: jax.Array, m: jax.Array) -> jax.Array:
        return masked_bce(nnx.merge(graphdef, params), x, y, m)

    @jax.jit
    def step(params, opt_state, x, y, m):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, m)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(loss_fn)

    def held_out_loss(params: nnx.State) -> float:
        if held_out is None or len(held_out) == 0:
            return float("nan")
        return float(eval_loss(params, held_out.x, held_out.y, held_out.mask))

    rng = np.random.default_rng([cfg.seed, 1])
    history: dict[str, Any] = {
        "steps": total,
        "train_loss": [],
        "eval_loss": [],
        "initial_eval_loss": held_out_loss(params),
    }
    bar = tqdm(
        total=total,
        desc="train",
        unit="step",
        file=sys.stderr,
        disable=not cfg.progress,
        mininterval=0.5,
    )
    with bar:
        for epoch in range(cfg.epochs):
            order = rng.permutation(len(train))
            for b in range(per_epoch):
                idx = np.sort(order[b * bs : (b + 1) * bs])
                params, opt_state, loss = step(
                    params, opt_state, train.x[idx], train.y[idx], train.mask[idx]
                )
                history["train_loss"].append(float(loss))
                bar.update(1)
            ev = held_out_loss(params)
            history["eval_loss"].append(((epoch + 1) * per_epoch, ev))
            bar.set_postfix(loss=f"{history['train_loss'][-1]:.4f}", eval=f"{ev:.4f}")
    return nnx.merge(graphdef, params), history


# --------------------------------------------------------------------------------------------
# evaluation


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
            out[name] = predictor.prediction_metrics(
                keys, preds, start=start, lookahead=lookahead
            )
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


# --------------------------------------------------------------------------------------------
# choosing the serving settings on the validation slice

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


# --------------------------------------------------------------------------------------------
# the run


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


def _read(path: str) -> list[predictor.Access]:
    return accesses_of(read_trace(path))


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
    fcfg = cfg.feature_config()
    rng = np.random.default_rng([cfg.seed, 0])
    streams, splits, val_starts, train_sets, held_sets, val_sets = [], [], [], [], [], []
    for path in cfg.logs:
        accesses = _read(path)
        t = np.array([a.t for a in accesses])
        start = split_point(t, cfg.eval_fraction)
        val_start = split_point(t[:start], cfg.val_fraction) if start > 1 else start
        streams.append(accesses)
        splits.append(start)
        val_starts.append(val_start)
        positions = {
            "train": _sample(0, val_start - cfg.lookahead, cfg.max_train_positions, rng),
            "held_out": _sample(start, len(accesses) - cfg.lookahead, cfg.max_eval_examples, rng),
            "val": np.arange(val_start, start),
        }
        log(
            f"train: {path}: {len(accesses)} accesses, fitting on [0, {val_start}), validating "
            f"on [{val_start}, {start}), evaluating [{start}, {len(accesses)}); "
            f"{len(positions['train'])} training positions"
        )
        with tqdm(
            total=len(accesses),
            desc="examples",
            unit="acc",
            file=sys.stderr,
            disable=not cfg.progress,
            mininterval=0.5,
        ) as bar:
            ex = build_examples(
                accesses,
                fcfg,
                positions,
                ends={"val": start},
                keep_keys=("val",),
                progress=bar.update,
            )
        train_sets.append(ex["train"])
        held_sets.append(ex["held_out"])
        val_sets.append(ex["val"])
    train = _concat(train_sets)
    held_out = _concat(held_sets)
    log(
        f"train: fitting the MLP on {len(train)} positions ({cfg.epochs} epochs); the first "
        "step compiles"
    )
    model, history = fit(cfg, train, held_out)
    log(
        "train: choosing min_score and hedge on the validation slices "
        f"({sum(s - v for v, s in zip(val_starts, splits))} positions)"
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
        for accesses, ex, val_start, start in zip(streams, val_sets, val_starts, splits)
    ]
    del val_sets
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
        "slices": {p: [v, s] for p, v, s in zip(cfg.logs, val_starts, splits)},
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
    mlp = MLPPredictor(model, fcfg, min_score=selected["min_score"], hedge=selected["hedge"])
    train_seconds = time.perf_counter() - t_start

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

    log("train: evaluating the MLP and the baselines on the held-out tails")

    per_log, results = {}, []
    for path, accesses, start in zip(cfg.logs, streams, splits):
        r = evaluate_tail(accesses, start)
        results.append(r)
        per_log[path] = {"accesses": len(accesses), "start": start, **r}
    cross = {}
    for path in cfg.eval_logs:
        accesses = _read(path)
        start = split_point(np.array([a.t for a in accesses]), cfg.eval_fraction)
        r = evaluate_tail(accesses, start)
        cross[path] = {"accesses": len(accesses), "start": start, **r}
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
        "train": {
            "examples": len(train),
            "held_out_examples": len(held_out),
            "validation_positions": sum(s - v for v, s in zip(val_starts, splits)),
            "mean_candidates": float(train.mask.sum(1).mean()),
            "positive_rate": float(
                (train.y[..., 0] * train.mask).sum() / max(train.mask.sum(), 1.0)
            ),
            "steps": history["steps"],
            "final_train_loss": float(np.mean(history["train_loss"][-20:])),
            "initial_eval_loss": history["initial_eval_loss"],
            "eval_loss": history["eval_loss"],
        },
        "config": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()
        },
        "total_seconds": time.perf_counter() - t_start,
    }
    cfg.out.mkdir(parents=True, exist_ok=True)
    ckpt = predictor.save(
        cfg.out / "checkpoint",
        mlp,
        extra={
            "eval": metrics["eval"],
            "logs": list(cfg.logs),
            "selected": selected,
            "selection_rule": SELECTION_RULE,
            "validation_slices": validation["slices"],
        },
    )
    metrics["checkpoint"] = str(ckpt)
    metrics["outputs"] = [str(ckpt), str(cfg.out / "metrics.json"), str(cfg.out / "loss.png")]
    plot_losses(history, cfg.out / "loss.png")
    (cfg.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    log(f"train: wrote {', '.join(metrics['outputs'])}")
    return metrics


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
        accesses = _read(path)
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


def _concat(parts: Sequence[Examples]) -> Examples:
    return Examples(
        np.concatenate([p.x for p in parts]),
        np.concatenate([p.y for p in parts]),
        np.concatenate([p.mask for p in parts]),
    )
