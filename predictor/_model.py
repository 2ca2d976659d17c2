"""The learned predictor: a Flax NNX MLP that scores candidate keys from `FeatureState` features.

The model never sees a key, only the features of each candidate (`predictor._features`), so it
ranks keys it never saw in training. `MLPPredictor` serves it: the trained
parameters are copied to the host once and each call scores its candidates in NumPy
(`MLPPredictor.score`, equal to the pure JAX `score_candidates` that training uses), so a serving
call never queues behind the served model on the XLA client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from predictor._features import FEATURES, NUM_FEATURES, FeatureConfig, FeatureState
from predictor._protocol import Access


class ScoreMLP(nnx.Module):
    """Two hidden ReLU layers mapping candidate features ``[..., F]`` to two logits ``[..., 2]``.

    Logit 0: the candidate is accessed within the lookahead window (the score that is reported
    and thresholded). Logit 1: the candidate is the very next access (urgency, used in ranking).

    Args:
      num_features: F, the width of a candidate's feature vector.
      hidden: width of both hidden layers.
      rngs: the initialisation keys.
    """

    def __init__(self, num_features: int = NUM_FEATURES, *, hidden: int = 64, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(num_features, hidden, rngs=rngs)
        self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits ``[..., 2]``: (accessed within the window, accessed next)."""
        x = nnx.relu(self.hidden1(x))
        x = nnx.relu(self.hidden2(x))
        return self.out(x)


def score_candidates(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array) -> jax.Array:
    """Scores of the candidates ``x`` (``[..., C, F]``) under the split model; pure.

    Returns:
      ``[..., C, 2]``: the probability of an access within the window, and the ranking score
      ``p_window * (1 + p_next) / 2``, which puts the keys needed soonest first among keys
      equally likely to be needed (a key needed next has one chance left to be prefetched).
    """
    p = jax.nn.sigmoid(nnx.merge(graphdef, state)(x))
    p_window, p_next = p[..., 0], p[..., 1]
    return jnp.stack([p_window, p_window * (1.0 + p_next) * 0.5], axis=-1)


_CHAIN, _MARKOV_RANK = FEATURES.index("successor_chain"), FEATURES.index("markov_rank")


class MLPPredictor:
    """A `Predictor` that ranks the `FeatureState` candidates with a trained `ScoreMLP`.

    ``predict(k)`` proposes, by ranking score, the candidates whose probability of being accessed
    within the window is at least ``min_score`` (confident proposals), keeping one of the ``k``
    places for the current key's last successor (what `last_successor` proposes) whatever its
    probability; if that leaves room, it adds up to ``hedge`` of the best-ranked *successor*
    candidates (the last successor or a Markov successor of the current key) whatever their
    probability. The hedge is what the successor baselines always do; at a fork of the access
    stream (a key with many successors) no candidate is confident, and the hedge keeps the
    recall of the baselines at a small cost in precision. Keeping the last successor means the
    proposals always contain `last_successor`'s, so the recall is never below its recall.

    Args:
      model: the trained model (split once here; later changes to it are not seen).
      config: the feature settings the model was trained with.
      min_score: the lowest probability of a confident proposal.
      hedge: successor candidates proposed below ``min_score`` when there is room.
    """

    def __init__(
        self, model: ScoreMLP, config: FeatureConfig, *, min_score: float = 0.0, hedge: int = 0
    ):
        if not 0.0 <= min_score <= 1.0 or hedge < 0:
            raise ValueError(f"min_score={min_score} must be in [0, 1] and hedge={hedge} >= 0")
        self.config = config
        self.min_score = min_score
        self.hedge = hedge
        self.hidden = model.hidden1.out_features
        self._graphdef, self._state = nnx.split(model)
        # Serving scores on the host, in NumPy, with the trained parameters: the model is tiny
        # (C x F inputs, two hidden layers), and a jitted call would go to the same XLA client as
        # the model being served, where it waits behind the layer in flight (about 90 us of
        # dispatch when idle; 1 ms measured in the demo). `score_candidates` stays the reference
        # (training and evaluation use it; a test checks that both agree).
        self._layers = [
            (np.asarray(layer.kernel[...], np.float32), np.asarray(layer.bias[...], np.float32))
            for layer in (model.hidden1, model.hidden2, model.out)
        ]
        self._buf = np.zeros((config.max_candidates, NUM_FEATURES), np.float32)
        self.features = FeatureState(config)

    def model(self) -> ScoreMLP:
        """The served model, merged from its split state."""
        return nnx.merge(self._graphdef, self._state)

    def score(self, x: np.ndarray) -> np.ndarray:
        """`score_candidates` of candidate features ``x`` (``[C, F]``), computed on the host.

        Returns:
          ``[C, 2]`` float32: ``p_window`` and the ranking score.
        """
        (w1, b1), (w2, b2), (w3, b3) = self._layers
        # In place where NumPy allows: each call is a few microseconds of dispatch on arrays
        # this small, and predict runs on the prefetch worker for every batch served.
        h = x @ w1
        h += b1
        np.maximum(h, 0.0, out=h)
        h2 = h @ w2
        h2 += b2
        np.maximum(h2, 0.0, out=h2)
        p = h2 @ w3
        p += b3
        # the logistic function, as 0.5 (1 + tanh(z / 2)), without exp's overflow
        p *= 0.5
        np.tanh(p, out=p)
        p += 1.0
        p *= 0.5
        # [p_window, p_window * (1 + p_next) / 2]
        p[:, 1] += 1.0
        p[:, 1] *= p[:, 0]
        p[:, 1] *= 0.5
        return p

    def reset(self) -> None:
        """Forgets every observed access (the model is kept)."""
        self.features.reset()

    def observe(self, access: Access | Mapping[str, Any]) -> None:
        """Updates the stream statistics with one access."""
        self.features.observe(access)

    def predict(self, k: int) -> list[tuple[str, float]]:
        """Up to ``k`` candidates by model probability, best first (ties: source priority)."""
        buf = self._buf
        buf.fill(0.0)
        keys = self.features.features_into(buf)
        if not keys or k < 1:
            return []
        x = buf[: len(keys)]
        scores = self.score(x)
        chain = x[:, _CHAIN]
        last = np.flatnonzero(chain == 1.0)  # `last_successor_index`, for one access
        chosen = choose(
            scores,
            (chain == 1.0) | (x[:, _MARKOV_RANK] > 0),  # `successor_mask`
            k,
            self.min_score,
            self.hedge,
            keep=int(last[0]) if len(last) else -1,
        )
        return [(keys[i], float(scores[i, 0])) for i in chosen]


def successor_mask(features: np.ndarray) -> np.ndarray:
    """Which candidates (rows of ``features``, ``[..., C, F]``) are successors of the current key.

    A successor is the last successor (``successor_chain == 1``) or a Markov successor
    (``markov_rank > 0``) of the current key: the candidates ``hedge`` may add.
    """
    return (features[..., _CHAIN] == 1.0) | (features[..., _MARKOV_RANK] > 0)


def last_successor_index(features: np.ndarray) -> np.ndarray:
    """The row of the current key's last successor among candidates ``features`` (``[..., C, F]``).

    Returns:
      ``[...]`` ints: the candidate with ``successor_chain == 1``, or -1 where there is none (the
      current key was never followed by anything).
    """
    last = features[..., _CHAIN] == 1.0
    return np.where(last.any(-1), last.argmax(-1), -1)


def choose(
    scores: np.ndarray,
    successor: np.ndarray,
    k: int,
    min_score: float,
    hedge: int,
    *,
    keep: int = -1,
) -> list[int]:
    """The candidates `MLPPredictor.predict` proposes, best first; the serving rule, pure.

    Args:
      scores: ``[n, 2]`` from `score_candidates`: ``p_window`` and the ranking score.
      successor: ``[n]`` bools from `successor_mask`.
      k: at most this many.
      min_score: candidates with ``p_window >= min_score`` are proposed first, by ranking score.
      hedge: then, while room is left, up to this many of the best-ranked successor candidates.
      keep: a candidate proposed whatever its score (`last_successor_index`: the last successor,
        so the proposals contain `last_successor`'s); it takes the last of the ``k`` places if
        the confident candidates would fill them. -1: none.

    Returns:
      Indices into ``scores``, at most ``k``, distinct.

    >>> scores = np.array([[0.95, 0.9], [0.3, 0.2], [0.9, 0.8]])
    >>> choose(scores, np.array([False, True, False]), 2, 0.8, 0, keep=1)
    [0, 1]
    """
    if k < 1 or len(scores) == 0:
        return []
    order = np.argsort(-scores[:, 1], kind="stable").tolist()
    p_window = scores[:, 0].tolist()  # Python floats: indexing numpy per candidate is slower
    chosen = [i for i in order if p_window[i] >= min_score][:k]
    if 0 <= keep < len(scores) and keep not in chosen:
        chosen = chosen[: k - 1] + [keep]
    if hedge and len(chosen) < k:
        room = min(k - len(chosen), hedge)
        for i in order:
            if room == 0:
                break
            if successor[i] and i not in chosen:
                chosen.append(i)
                room -= 1
    return chosen


def mlp(
    model: ScoreMLP | None = None,
    config: FeatureConfig | None = None,
    *,
    min_score: float = 0.0,
    hedge: int = 0,
    seed: int = 0,
    hidden: int = 64,
) -> MLPPredictor:
    """An `MLPPredictor` (an untrained one when ``model`` is None; see `predictor.load`).

    Args:
      model: a trained `ScoreMLP`, or None for a freshly initialised one.
      config: feature settings (default `FeatureConfig()`).
      min_score: the lowest probability of a confident proposal.
      hedge: successor candidates proposed below ``min_score`` when there is room.
      seed: initialisation seed when ``model`` is None.
      hidden: hidden width when ``model`` is None.

    Returns:
      The predictor.

    Raises:
      ValueError: ``min_score`` outside [0, 1] or a negative ``hedge``.
    """
    if model is None:
        model = ScoreMLP(NUM_FEATURES, hidden=hidden, rngs=nnx.Rngs(seed))
    return MLPPredictor(model, config or FeatureConfig(), min_score=min_score, hedge=hedge)
