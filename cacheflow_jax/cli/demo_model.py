"""The demo's model: a byte-level stack of mixture-of-experts MLP blocks in Flax NNX.

Tokens are the bytes of a text; a byte embedding turns them into the residual stream. Each layer
is ``x + sum_j gate_j * expert_j(rms_norm(x))`` over the ``top_k`` experts its router picks for
the step; an expert is a two-matrix GELU MLP.

Routing is per step, from the layer's own input: the router's softmax over experts is summed over
the step's tokens and the ``top_k`` experts with the largest sums serve every token of the step
(gated by each token's softmax over those ``top_k``). A fixed number of experts per layer and step
keeps the steps comparable; since layer ``l + 1`` routes on layer ``l``'s output, its experts are
known only after layer ``l`` ran, which is what a layer-ahead prefetcher has to guess.

Each expert's two matrices are one checkpoint leaf, ``w`` of shape ``(2, d_model, d_ff)``
(``w[0]`` is the input matrix, ``w[1]`` the transposed output matrix, as fused expert weights
are stored), so an expert is one chunk in orbax's layout and one cache block:
``layers/3/experts/5/w@0,0,0``. Serving fetches only the routed experts' blocks; the dense
weights (embedding, norms, routers) are small and stay on the device, as MoE offloading systems
keep them.

The serving step does not call the module: as in Flax's examples, the hot loop runs jitted pure
functions (`embed`, `route`, `experts_layer`) on the arrays fetched for the step.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

VOCAB = 256  # byte-level tokens


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
        """Bytes of one expert (both matrices): one cache block."""
        return 2 * self.d_model * self.d_ff * np.dtype(jnp.dtype(self.dtype)).itemsize

    @property
    def dense_bytes(self) -> int:
        """Bytes of the weights that are not experts (embedding, norms, routers)."""
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        per_layer = self.d_model * self.experts * itemsize + self.d_model * 4
        return VOCAB * self.d_model * itemsize + self.layers * per_layer

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights."""
        return self.layers * self.experts * self.expert_bytes + self.dense_bytes

    def name(self) -> str:
        """A directory name that identifies this configuration."""
        return f"bytemoe-L{self.layers}-E{self.experts}-d{self.d_model}-f{self.d_ff}-{self.dtype}"


class Expert(nnx.Module):
    """One expert: ``gelu(x @ w[0]) @ w[1].T``, both matrices in one leaf ``w``."""

    def __init__(self, d_model: int, d_ff: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        w_in = _normal(rngs, (d_model, d_ff), dtype, d_model)
        w_out_t = _normal(rngs, (d_model, d_ff), dtype, d_ff)
        self.w = nnx.Param(jnp.stack([w_in, w_out_t]))

    def __call__(self, x: jax.Array) -> jax.Array:
        return expert_mlp(x, self.w[...])


class MoELayer(nnx.Module):
    """RMS norm, a router over ``experts`` experts, and the experts."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs) -> None:
        dtype = jnp.dtype(config.dtype)
        self.norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        # Scaled as a trained router's logits are: a few units apart, so a token's softmax
        # prefers a few experts without being one-hot.
        self.router = nnx.Param(
            _normal(rngs, (config.d_model, config.experts), dtype, config.d_model) * 4.0
        )
        self.experts = nnx.List(
            [
                Expert(config.d_model, config.d_ff, dtype=dtype, rngs=rngs)
                for _ in range(config.experts)
            ]
        )


class MoEStack(nnx.Module):
    """A byte embedding and ``layers`` MoE blocks; see the module note."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, config.d_model, rngs=rngs)
        self.layers = nnx.List([MoELayer(config, rngs=rngs) for _ in range(config.layers)])


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, fan_in: int) -> jax.Array:
    """Normal weights scaled by ``1/sqrt(fan_in)``."""
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


def expert_mlp(x: jax.Array, w: jax.Array) -> jax.Array:
    """One expert's MLP in float32; ``w`` is the fused ``(2, d_model, d_ff)`` leaf."""
    w = w.astype(jnp.float32)
    return jax.nn.gelu(x @ w[0]) @ w[1].T


@jax.jit
def embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """The residual stream of byte ``tokens`` (``(tokens,)`` int32): ``(tokens, d_model)`` f32."""
    return jnp.take(table, tokens, axis=0).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames="top_k")
def route(
    x: jax.Array, norm_scale: jax.Array, router: jax.Array, *, top_k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Routes one step through one layer.

    Args:
      x: the layer's input, ``(tokens, d_model)`` float32.
      norm_scale: the RMS norm's scale, ``(d_model,)``.
      router: ``(d_model, experts)``.
      top_k: experts served this step.

    Returns:
      ``(h, selected, gates)``: the normed input; the ``top_k`` experts with the largest router
      probability summed over the step's tokens, largest first (``(top_k,)`` int32, ties to the
      lower id); each token's softmax over those experts' logits, ``(tokens, top_k)``.
    """
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * norm_scale
    logits = h @ router.astype(jnp.float32)
    load = jax.nn.softmax(logits, axis=-1).sum(axis=0)
    _, selected = jax.lax.top_k(load, top_k)
    gates = jax.nn.softmax(jnp.take(logits, selected, axis=-1), axis=-1)
    return h, selected.astype(jnp.int32), gates


@jax.jit
def experts_layer(
    x: jax.Array, h: jax.Array, gates: jax.Array, experts: tuple[jax.Array, ...]
) -> jax.Array:
    """The layer's output: ``x`` plus the routed experts' MLPs of ``h``, gated.

    Args:
      x: the layer's input, ``(tokens, d_model)``.
      h, gates: from `route`.
      experts: the routed experts' ``w`` leaves, in `route`'s order.

    Returns:
      The block's output, shaped like ``x``.
    """
    y = sum(gates[:, j : j + 1] * expert_mlp(h, w) for j, w in enumerate(experts))
    return x + y


def build(config: MoEConfig, *, seed: int) -> dict:
    """Builds the model and returns its weights as the pure dict orbax saves."""
    model = MoEStack(config, rngs=nnx.Rngs(seed))
    return nnx.to_pure_dict(nnx.state(model))
