"""The LLM-serving benchmark's model: a small Flax NNX decoder with grouped-query attention.

Sized by what a KV cache trades: the prefill FLOPs a cached block saves against the bytes of KV
it moves. A decoder's prefill costs about ``2 * params`` FLOPs per token, and its KV is
``2 * layers * kv_dim * itemsize`` bytes per token, so the ratio is about
``6 * d_model**2 / kv_dim`` FLOPs per KV byte (attention, MLP of 4x width, bf16 KV):

| model | d_model | layers | kv_dim | FLOPs / token | KV bytes / token | FLOPs / KV byte |
|---|---|---|---|---|---|---|
| Llama 3.2 1B (16 layers, 8 KV heads x 64) | 2048 | 16 | 512 | 2.5e9 | 32,768 | 75,000 |
| this decoder (`DecoderConfig()`) | 256 | 2 | 16 | `flops_per_token()` | 128 | `flops_per_kv_byte()` |

(Llama 3.2 1B: 1.24B parameters, bf16 KV; its config in Meta's model card.) The default config is
within 4x of the 1B model's ratio (`bench.llm_serving` prints both), while a 16-token block's
prefill takes about a millisecond on two CPU cores.

Every way of the benchmark computes a prompt the same way, one 16-token block per call, with
the earlier blocks' KV as the past, padded to a power-of-two bucket that depends only on the
block's position: a block's KV is then bitwise the same whether it was computed now or earlier
by another request, and the generated tokens are equal across ways (the benchmark checks).
Decode runs in fixed-size batches of requests whose past falls in the same bucket, so a
request's tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

KV_DTYPE = jnp.bfloat16
LLAMA_1B = {"d_model": 2048, "layers": 16, "kv_dim": 512, "params": 1.24e9, "kv_itemsize": 2}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The decoder's size.

    Attributes:
      vocab: tokens.
      d_model: residual width.
      layers: transformer blocks.
      heads: query heads (``d_model // heads`` dims each).
      kv_heads: key/value heads (grouped-query attention).
      block_tokens: tokens per KV block (one prefill call).
      max_blocks: the longest prompt, in blocks.
      max_new: the most generated tokens per request.
    """

    vocab: int = 512
    d_model: int = 256
    layers: int = 2
    heads: int = 16
    kv_heads: int = 1
    block_tokens: int = 16
    max_blocks: int = 384  # the Mooncake trace's longest prompt has 374 blocks
    max_new: int = 16

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def max_context(self) -> int:
        return self.max_blocks * self.block_tokens + self.max_new

    def params(self) -> int:
        d, kv, f = self.d_model, self.kv_dim, 4 * self.d_model
        per_layer = 2 * d * d + 2 * d * kv + 2 * d * f
        return self.layers * per_layer + 2 * self.vocab * d

    def flops_per_token(self) -> float:
        """Prefill FLOPs per token, without attention over the past (2 per weight)."""
        return 2.0 * (self.params() - self.vocab * self.d_model)  # the embedding is a gather

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_dim * np.dtype(KV_DTYPE).itemsize

    def flops_per_kv_byte(self) -> float:
        return self.flops_per_token() / self.kv_bytes_per_token()

    def block_kv_bytes(self) -> int:
        return self.kv_bytes_per_token() * self.block_tokens


def llama_1b_flops_per_kv_byte() -> float:
    m = LLAMA_1B
    kv_bytes = 2 * m["layers"] * m["kv_dim"] * m["kv_itemsize"]
    return 2.0 * m["params"] / kv_bytes


class _Block(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs) -> None:
        d, kv = cfg.d_model, cfg.kv_dim
        init = nnx.initializers.normal(1.0 / math.sqrt(d))
        self.norm1 = nnx.RMSNorm(d, rngs=rngs)
        self.q = nnx.Linear(d, d, use_bias=False, kernel_init=init, rngs=rngs)
        self.k = nnx.Linear(d, kv, use_bias=False, kernel_init=init, rngs=rngs)
        self.v = nnx.Linear(d, kv, use_bias=False, kernel_init=init, rngs=rngs)
        self.o = nnx.Linear(d, d, use_bias=False, kernel_init=init, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, use_bias=False, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, use_bias=False,
                               kernel_init=nnx.initializers.normal(0.5 / math.sqrt(4 * d)),
                               rngs=rngs)  # fmt: skip


class Decoder(nnx.Module):
    """Token embedding with sinusoidal positions, ``layers`` GQA blocks, an output head."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([_Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)


def _positions(pos: jax.Array, d: int) -> jax.Array:
    freq = jnp.exp(-math.log(10000.0) * jnp.arange(0, d, 2) / d)
    angle = pos[..., None].astype(jnp.float32) * freq
    return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


def _layers(model: Decoder, x: jax.Array, pos: jax.Array, past_k: jax.Array, past_v: jax.Array,
            valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """Runs the blocks over ``x`` [B, T, d] at positions ``pos`` [B, T] attending to the past
    [B, L, P, kv] (``valid`` [B, P]: which past slots hold tokens) and causally to itself.

    Returns the output [B, T, d] and the new tokens' K and V [B, L, T, kv] in `KV_DTYPE`.
    """
    cfg = model.cfg
    b, t, _ = x.shape
    h, kvh, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    g, per = kvh, h // kvh
    causal = jnp.tril(jnp.ones((t, t), bool))
    mask = jnp.concatenate([jnp.broadcast_to(valid[:, None, :], (b, t, valid.shape[1])),
                            jnp.broadcast_to(causal, (b, t, t))], axis=-1)  # fmt: skip
    # Rows are (token, query head of the group): one matmul per KV head, [T * per, S].
    mask = jnp.repeat(mask, per, axis=1)[:, None]
    new_k, new_v = [], []
    for layer, blk in enumerate(model.blocks):
        y = blk.norm1(x)
        q = blk.q(y).reshape(b, t, g, per, hd).transpose(0, 2, 1, 3, 4).reshape(b, g, t * per, hd)
        k = blk.k(y).astype(KV_DTYPE)
        v = blk.v(y).astype(KV_DTYPE)
        new_k.append(k)
        new_v.append(v)
        keys = jnp.concatenate([past_k[:, layer], k], axis=1).astype(jnp.float32)
        values = jnp.concatenate([past_v[:, layer], v], axis=1).astype(jnp.float32)
        keys = keys.reshape(b, -1, g, hd).transpose(0, 2, 1, 3)  # [B, G, S, hd]
        values = values.reshape(b, -1, g, hd).transpose(0, 2, 1, 3)
        scores = jnp.einsum("bgxd,bgsd->bgxs", q, keys) / math.sqrt(hd)
        scores = jnp.where(mask, scores, -1e30)
        att = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bgxs,bgsd->bgxd", att, values)
        out = out.reshape(b, g, t, per, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, cfg.d_model)
        x = x + blk.o(out)
        x = x + blk.down(jax.nn.gelu(blk.up(blk.norm2(x))))
    return x, jnp.stack(new_k, axis=1), jnp.stack(new_v, axis=1)


def _prefill(graphdef, treedef, leaves, tokens, past_k, past_v, n_past):
    """One block: tokens [T], past [L, P, kv] with ``n_past`` valid slots.

    Jitted by `Engine` with ``graphdef`` and ``treedef`` bound: the weights come as a flat list
    of leaves, since dispatching an ``nnx.State`` flattens it in Python on every call (0.8 ms)
    and a static ``GraphDef`` argument is hashed on every call (0.4 ms).
    """
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    t = tokens.shape[0]
    pos = n_past + jnp.arange(t)
    x = model.embed(tokens)[None] + _positions(pos, model.cfg.d_model)[None]
    valid = (jnp.arange(past_k.shape[1]) < n_past)[None]
    x, k, v = _layers(model, x, pos[None], past_k[None], past_v[None], valid)
    logits = model.head(model.norm(x[0, -1]))
    return k[0], v[0], jnp.argmax(logits).astype(jnp.int32)


def _decode(graphdef, treedef, leaves, tokens, past_k, past_v, lengths):
    """One token for each of B requests: tokens [B], past [B, L, P, kv], lengths [B]."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    pos = lengths[:, None]
    x = model.embed(tokens)[:, None] + _positions(pos, model.cfg.d_model)
    valid = jnp.arange(past_k.shape[2])[None] < lengths[:, None]
    x, k, v = _layers(model, x, pos, past_k, past_v, valid)
    logits = model.head(model.norm(x[:, -1]))
    return k[:, :, 0], v[:, :, 0], jnp.argmax(logits, axis=-1).astype(jnp.int32)


def bucket(n_tokens: int, block_tokens: int) -> int:
    """The padded past length of a block that starts after ``n_tokens`` tokens."""
    return max(block_tokens, 1 << max(0, n_tokens - 1).bit_length())


class Engine:
    """The decoder's jitted calls, over host numpy KV (each way moves blocks its own way).

    Args:
      cfg: the decoder's size.
      seed: the weights' seed (every way uses the same weights).
      decode_batch: rows per decode call (fixed: padded with idle rows).
    """

    def __init__(self, cfg: DecoderConfig, *, seed: int = 0, decode_batch: int = 8) -> None:
        self.cfg = cfg
        self.decode_batch = decode_batch
        model = Decoder(cfg, rngs=nnx.Rngs(seed))
        self.graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        # Weights placed on the device explicitly, as a serving engine does (with a device or
        # a mesh): its outputs, the KV blocks, are then committed to that device.
        self.leaves = jax.device_put(leaves, jax.devices()[0])
        self._prefill = jax.jit(functools.partial(_prefill, self.graphdef, treedef))
        self._decode = jax.jit(functools.partial(_decode, self.graphdef, treedef))

    def prefill_block(self, tokens: np.ndarray, past_k: jax.Array, past_v: jax.Array,
                      n_past: int) -> tuple[jax.Array, jax.Array, int]:  # fmt: skip
        """One block's K, V ([L, T, kv] each, on the device) and the next token's id.

        ``past_k``/``past_v`` are [L, P, kv] with P = `bucket` (n_past) and ``n_past`` valid.
        """
        k, v, nxt = self._prefill(self.leaves, jnp.asarray(tokens), past_k, past_v,
                                  jnp.int32(n_past))  # fmt: skip
        return k, v, nxt

    def decode(self, tokens: np.ndarray, past_k: np.ndarray, past_v: np.ndarray,
               lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """One token for each row (``decode_batch`` rows; past [B, L, P, kv], P a `bucket`)."""
        k, v, nxt = self._decode(self.leaves, jnp.asarray(tokens), jnp.asarray(past_k),
                                 jnp.asarray(past_v), jnp.asarray(lengths))  # fmt: skip
        return np.asarray(k), np.asarray(v), np.asarray(nxt)

    def warm_up(self) -> None:
        """Compiles every bucket of the prefill and decode calls (outside any timing)."""
        cfg = self.cfg
        tokens = np.zeros(cfg.block_tokens, np.int32)
        b = self.decode_batch
        p = cfg.block_tokens
        while True:
            z = jnp.zeros((cfg.layers, p, cfg.kv_dim), KV_DTYPE)
            self.prefill_block(tokens, z, z, 0)[2].block_until_ready()
            zb = np.zeros((b, cfg.layers, p, cfg.kv_dim), KV_DTYPE)
            self.decode(np.zeros(b, np.int32), zb, zb, np.zeros(b, np.int32))
            if p >= cfg.max_context:
                break
            p *= 2
