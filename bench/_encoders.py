"""The encoders of `bench.embedding_model` and `bench.multimodal`: Flax NNX, pre-norm blocks.

* `TextEncoder`: a token table (the rows a cache serves), sinusoidal positions, ``layers``
  blocks of multi-head attention and a 4x MLP, mean-pooled: a sentence-embedding model.
* `VisionEncoder`: a patch embedding (a linear map of 8x8x3 pixels), ``layers`` of the same
  blocks, mean-pooled (a small ViT), and a projection of each patch onto the decoder's vocabulary
  that turns an image into tokens (as early-fusion models such as Chameleon do).

Sized by what a row cache trades: the encoder's FLOPs per token against the bytes of the row
it looks up. A real sentence-embedding model, all-MiniLM-L6-v2 (6 layers of width 384, MLP
1536, a 30,522-row float32 table: 10.6M parameters besides the table), spends about 13,900
FLOPs per byte of row; `TextConfig()` is within 4x of it (`flops_per_row_byte`).

Every way of a benchmark calls the same jitted functions on the same inputs (the rows come as
an argument, however a way found them), so the outputs are bitwise equal across ways; the
benchmarks check it. The weights travel as a flat list of leaves (``nnx.split`` once, as
`bench._decoder` does), so a way that serves weights from a cache passes its arrays straight in.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MINILM = {"d_model": 384, "layers": 6, "mlp": 1536, "params": 10.6e6, "itemsize": 4}


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The text encoder's size (``rows`` is set by the vocabulary)."""

    rows: int = 4224
    d_model: int = 256
    layers: int = 3
    heads: int = 4

    def block_params(self) -> int:
        return self.layers * 12 * self.d_model**2

    def flops_per_row_byte(self) -> float:
        """FLOPs per token (2 per weight outside the table) / bytes of one row (float32)."""
        return 2.0 * self.block_params() / (4 * self.d_model)


def minilm_flops_per_row_byte() -> float:
    m = MINILM
    return 2.0 * m["params"] / (m["d_model"] * m["itemsize"])


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision encoder's size: ``patches`` patches of ``patch``x``patch``x3 pixels."""

    d_model: int = 256
    layers: int = 4
    heads: int = 4
    patch: int = 8
    patches: int = 16
    vocab: int = 512  # the decoder's vocabulary: an image becomes ``patches`` tokens

    @property
    def patch_dim(self) -> int:
        return self.patch * self.patch * 3


class EncoderBlock(nnx.Module):
    """Pre-norm multi-head self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.normal(1.0 / math.sqrt(d))
        self.heads = heads
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, kernel_init=init, rngs=rngs)
        self.o = nnx.Linear(d, d, use_bias=False, kernel_init=init, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, kernel_init=nnx.initializers.normal(0.5 / math.sqrt(4 * d)),
                               rngs=rngs)  # fmt: skip

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.heads
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, d // h) for a in (q, k, v))
        att = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // h), axis=-1)
        x = x + self.o(jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


def positions(t: int, d: int) -> jax.Array:
    """Sinusoidal position codes, ``(t, d)``."""
    freq = jnp.exp(-math.log(10000.0) * jnp.arange(0, d, 2) / d)
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq
    return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


class TextEncoder(nnx.Module):
    """Token rows, positions, blocks, mean pooling: one vector per sequence."""

    def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(cfg.rows, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([EncoderBlock(cfg.d_model, cfg.heads, rngs=rngs)
                                for _ in range(cfg.layers)])  # fmt: skip
        self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)

    def encode_rows(self, rows: jax.Array) -> jax.Array:
        """``rows`` ``(B, T, d)`` (the sequences' token rows) -> ``(B, d)``."""
        x = rows + positions(rows.shape[1], rows.shape[2])[None]
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x).mean(axis=1)


class VisionEncoder(nnx.Module):
    """Patch embedding, blocks, mean pooling, and each patch's token (argmax of a projection)."""

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs) -> None:
        self.patch = nnx.Linear(cfg.patch_dim, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([EncoderBlock(cfg.d_model, cfg.heads, rngs=rngs)
                                for _ in range(cfg.layers)])  # fmt: skip
        self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.to_tokens = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, patches: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``patches`` ``(P, patch_dim)`` -> (image vector ``(d,)``, tokens ``(P,)`` int32)."""
        x = self.patch(patches)[None] + positions(patches.shape[0], self.norm.num_features)[None]
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)[0]
        return x.mean(axis=0), jnp.argmax(self.to_tokens(x), axis=-1).astype(jnp.int32)


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, list[str], list[np.ndarray], object]:
    """The model's graph, its leaves' paths (``"blocks/0/qkv/kernel"``), values and treedef."""
    graphdef, state = nnx.split(model)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = ["/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
             for path, _ in flat]  # fmt: skip
    return graphdef, names, [np.asarray(v) for _, v in flat], treedef


def _encode_text(graphdef, treedef, leaves, rows):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    return model.encode_rows(rows)


def _encode_image(graphdef, treedef, leaves, patches):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    return model(patches)


class TextModel:
    """A `TextEncoder`'s jitted calls; its table is served apart (``table`` is a copy of it).

    Args:
      cfg: the size.
      seed: the weights' seed (every way uses the same weights).
    """

    def __init__(self, cfg: TextConfig, *, seed: int = 0) -> None:
        self.cfg = cfg
        graphdef, names, values, treedef = split_params(TextEncoder(cfg, rngs=nnx.Rngs(seed)))
        i = names.index("embed/embedding")
        self.table = values[i]
        # The table's leaf is a placeholder: every way passes its rows (or its table) in.
        leaves = list(values)
        leaves[i] = np.zeros((1, cfg.d_model), np.float32)
        self.leaves = jax.device_put(leaves, jax.devices()[0])
        self.encode = jax.jit(functools.partial(_encode_text, graphdef, treedef))

    def __call__(self, rows: jax.Array) -> jax.Array:
        """The sequences' vectors from their rows ``(B, T, d)``."""
        return self.encode(self.leaves, rows)


class VisionModel:
    """A `VisionEncoder`'s jitted call over leaves given per call (a way serves them).

    Attributes:
      names: the weights' paths, as stored (``vision/<name>``).
      values: their values (host numpy), in the order the call takes them.
    """

    def __init__(self, cfg: VisionConfig, *, seed: int = 1) -> None:
        self.cfg = cfg
        graphdef, names, values, treedef = split_params(VisionEncoder(cfg, rngs=nnx.Rngs(seed)))
        self.names = [f"vision/{n}" for n in names]
        self.values = values
        self.apply = jax.jit(functools.partial(_encode_image, graphdef, treedef))

    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values)


def help_text_ids() -> tuple[np.ndarray, int]:
    """The tokens of Python's help text (what `cacheflow demo` serves) as row ids.

    Tokens are words and single punctuation marks; a token's row is its rank by first
    appearance in the text (a vocabulary built by reading the text once, neither sorted by
    frequency nor shuffled).

    Returns:
      ``(ids, vocabulary size)``: int32 ids, one per token of the text.
    """
    from pydoc_data.topics import topics

    text = "\n".join(topics[name] for name in sorted(topics))
    vocab: dict[str, int] = {}
    ids = [vocab.setdefault(tok, len(vocab)) for tok in re.findall(r"\w+|[^\w\s]", text)]
    return np.asarray(ids, np.int32), len(vocab)


def text_batches(
    ids: np.ndarray, *, count: int, batch: int, seq: int, seed: int
) -> list[np.ndarray]:
    """``count`` batches of ``batch`` sequences of ``seq`` tokens at random offsets of ``ids``."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(ids) - seq, size=(count, batch))
    return [ids[s[:, None] + np.arange(seq)[None]] for s in starts]
