"""The Optax loop: masked binary cross-entropy, AdamW with warm-up and cosine decay, and `fit`
(the model split once, a pure step function jitted)."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import predictor
from predictor import ScoreMLP
from training.config import TrainConfig
from training.data import Examples


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
