"""The data pipeline: an access log -> `predictor.Access` records -> the `Examples` of its fit
part, its validation slice and its eval tail (`read_examples`)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np
from tqdm import tqdm

import predictor
from cacheflow_jax.trace.reader import Trace, read_trace, split_point
from predictor import FeatureConfig, FeatureState
from training.config import TrainConfig


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


def sample_positions(lo: int, hi: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``n`` positions in ``[lo, hi)``, sorted: all of them when fewer, else a sample."""
    if hi <= lo:
        return np.zeros(0, np.int64)
    if hi - lo <= n:
        return np.arange(lo, hi)
    return np.sort(rng.choice(np.arange(lo, hi), size=n, replace=False))


def concat_examples(parts: Sequence[Examples]) -> Examples:
    """The examples of ``parts`` one after another (without their candidate keys)."""
    return Examples(
        np.concatenate([p.x for p in parts]),
        np.concatenate([p.y for p in parts]),
        np.concatenate([p.mask for p in parts]),
    )


def read_accesses(path: str) -> list[predictor.Access]:
    """The accesses of the log at ``path`` (any format `read_trace` reads)."""
    return accesses_of(read_trace(path))


@dataclasses.dataclass
class Dataset:
    """The training logs, each split by time, and the examples of their parts (`read_examples`).

    Log ``i`` is fit on ``[0, val_starts[i])``, validated on ``[val_starts[i], splits[i])`` and
    evaluated on ``[splits[i], len(streams[i]))``.
    """

    streams: list[list[predictor.Access]]  # each log's accesses
    splits: list[int]  # each log's first eval-tail position
    val_starts: list[int]  # each log's first validation position
    train: Examples  # sampled positions of the fit parts, all logs
    held_out: Examples  # sampled positions of the eval tails, all logs (the eval loss curve)
    val: list[Examples]  # each log's validation positions, with their candidate keys

    @property
    def validation_positions(self) -> int:
        """The positions of all the validation slices."""
        return sum(s - v for v, s in zip(self.val_starts, self.splits))


def read_examples(cfg: TrainConfig, *, log: Callable[[str], None]) -> Dataset:
    """Reads and splits each of ``cfg.logs`` and records its training, held-out and validation
    examples (one `build_examples` walk per log).

    Args:
      cfg: the settings (logs, fractions, lookahead, sample sizes, seed, progress).
      log: receives one line per log.

    Returns:
      The `Dataset`.

    Raises:
      FileNotFoundError: a log does not exist.
      ValueError: a log is malformed.
    """
    fcfg = cfg.feature_config()
    rng = np.random.default_rng([cfg.seed, 0])
    streams, splits, val_starts, train_sets, held_sets, val_sets = [], [], [], [], [], []
    for path in cfg.logs:
        accesses = read_accesses(path)
        t = np.array([a.t for a in accesses])
        start = split_point(t, cfg.eval_fraction)
        val_start = split_point(t[:start], cfg.val_fraction) if start > 1 else start
        streams.append(accesses)
        splits.append(start)
        val_starts.append(val_start)
        positions = {
            "train": sample_positions(0, val_start - cfg.lookahead, cfg.max_train_positions, rng),
            "held_out": sample_positions(
                start, len(accesses) - cfg.lookahead, cfg.max_eval_examples, rng
            ),
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
    return Dataset(
        streams=streams,
        splits=splits,
        val_starts=val_starts,
        train=concat_examples(train_sets),
        held_out=concat_examples(held_sets),
        val=val_sets,
    )
