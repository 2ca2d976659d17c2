"""The demo's model: a stack of mixture-of-experts MLP blocks in Flax NNX.

Each layer is ``x + sum_j gate_j * expert_j(rms_norm(x))`` over the ``top_k`` experts a request is
routed to; an expert is a two-matrix GELU MLP. Experts are separate modules (an ``nnx.List``), so
each expert matrix is its own checkpoint leaf and, as orbax writes one chunk per leaf, one cache
block: ``layers/3/experts/5/w_in@0,0``. Serving fetches only the routed experts' blocks.

The serving step does not call the module: as in Flax's examples, the hot loop runs one jitted
pure function (`moe_layer`) on the arrays fetched for the step.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The demo model's size.

    Attributes:
      layers: number of MoE blocks.
      experts: experts per block.
      d_model: width of the residual stream.
      d_ff: hidden width of one expert.
      dtype: weight dtype name (``"float32"`` or ``"bfloat16"``).
    """

    layers: int = 8
    experts: int = 8
    d_model: int = 512
    d_ff: int = 512
    dtype: str = "float32"

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (both matrices)."""
        return 2 * self.d_model * self.d_ff * np.dtype(jnp.dtype(self.dtype)).itemsize

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights (experts, routers and norms)."""
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        per_layer = self.experts * self.expert_bytes + self.d_model * self.experts * itemsize
        return self.layers * (per_layer + self.d_model * 4)

    def name(self) -> str:
        """A directory name that identifies this configuration."""
        return f"moe-L{self.layers}-E{self.experts}-d{self.d_model}-f{self.d_ff}-{self.dtype}"


class Expert(nnx.Module):
    """One expert: ``gelu(x @ w_in) @ w_out``."""

    def __init__(self, d_model: int, d_ff: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.w_in = nnx.Param(_normal(rngs, (d_model, d_ff), dtype, d_model))
        self.w_out = nnx.Param(_normal(rngs, (d_ff, d_model), dtype, d_ff))

    def __call__(self, x: jax.Array) -> jax.Array:
        return expert_mlp(x, self.w_in[...], self.w_out[...])


class MoELayer(nnx.Module):
    """RMS norm, a router over ``experts`` experts, and the experts."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs) -> None:
        dtype = jnp.dtype(config.dtype)
        self.norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        self.router = nnx.Param(_normal(rngs, (config.d_model, config.experts), dtype, 1))
        self.experts = nnx.List(
            [
                Expert(config.d_model, config.d_ff, dtype=dtype, rngs=rngs)
                for _ in range(config.experts)
            ]
        )


class MoEStack(nnx.Module):
    """``layers`` MoE blocks; see the module note."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([MoELayer(config, rngs=rngs) for _ in range(config.layers)])


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, fan_in: int) -> jax.Array:
    """Normal weights scaled by ``1/sqrt(fan_in)``."""
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


def expert_mlp(x: jax.Array, w_in: jax.Array, w_out: jax.Array) -> jax.Array:
    """One expert's MLP in float32."""
    h = jax.nn.gelu(x @ w_in.astype(jnp.float32))
    return h @ w_out.astype(jnp.float32)


@jax.jit
def moe_layer(
    x: jax.Array,
    norm_scale: jax.Array,
    router: jax.Array,
    selected: jax.Array,
    w_in: tuple[jax.Array, ...],
    w_out: tuple[jax.Array, ...],
) -> jax.Array:
    """One MoE block over the routed experts' weights.

    Args:
      x: activations, ``(tokens, d_model)`` float32.
      norm_scale: the RMS norm's scale, ``(d_model,)``.
      router: ``(d_model, experts)``.
      selected: the routed expert ids, ``(top_k,)`` int32.
      w_in: the routed experts' ``w_in``, each ``(d_model, d_ff)``.
      w_out: the routed experts' ``w_out``, each ``(d_ff, d_model)``.

    Returns:
      The block's output, shaped like ``x``.
    """
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * norm_scale
    logits = h @ router.astype(jnp.float32)
    gates = jax.nn.softmax(jnp.take(logits, selected, axis=-1), axis=-1)
    y = sum(gates[:, j : j + 1] * expert_mlp(h, a, b) for j, (a, b) in enumerate(zip(w_in, w_out)))
    return x + y


def build(config: MoEConfig, *, seed: int) -> dict:
    """Builds the model and returns its weights as the pure dict orbax saves."""
    model = MoEStack(config, rngs=nnx.Rngs(seed))
    return nnx.to_pure_dict(nnx.state(model))
