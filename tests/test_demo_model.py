"""The demo's byte-level MoE: routing per step from each layer's input, the text, the steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cacheflow_jax.cli.demo import DemoError, demo_text, text_steps
from cacheflow_jax.cli.demo_model import (
    MoEConfig,
    MoEStack,
    build,
    embed,
    expert_mlp,
    experts_layer,
    route,
)


def test_route_takes_the_top_k_of_the_summed_router_probability() -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, 8), jnp.float32)
    router = jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)
    h, selected, gates = route(x, scale, router, top_k=3)
    hx = np.asarray(x) / np.sqrt((np.asarray(x) ** 2).mean(-1, keepdims=True) + 1e-6)
    hx = hx * np.asarray(scale)
    logits = hx @ np.asarray(router)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    load = (p / p.sum(-1, keepdims=True)).sum(0)
    assert selected.dtype == jnp.int32 and selected.shape == (3,)
    assert selected.tolist() == np.argsort(-load, kind="stable")[:3].tolist()
    np.testing.assert_allclose(np.asarray(h), hx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gates).sum(-1), 1.0, rtol=1e-5)
    assert gates.shape == (16, 3)


def test_ties_go_to_the_lower_expert_and_the_count_is_fixed() -> None:
    x = jnp.ones((4, 8), jnp.float32)
    router = jnp.zeros((8, 5), jnp.float32)  # every expert equally likely
    _, selected, _ = route(x, jnp.ones(8), router, top_k=2)
    assert selected.tolist() == [0, 1]


def test_experts_layer_matches_the_modules() -> None:
    config = MoEConfig(layers=1, experts=3, d_model=8, d_ff=4)
    model = MoEStack(config, rngs=nnx.Rngs(0))
    tokens = jnp.asarray([1, 200, 7, 7, 65], jnp.int32)
    x = embed(model.embed.embedding[...], tokens)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(model.embed(tokens)))
    layer = model.layers[0]
    h, selected, gates = route(x, layer.norm.scale[...], layer.router[...], top_k=2)
    ws = tuple(layer.experts[int(e)].w[...] for e in selected)
    out = experts_layer(x, h, gates, ws)
    want = x + sum(gates[:, j : j + 1] * layer.experts[int(e)](h) for j, e in enumerate(selected))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    # An expert is one leaf holding both matrices: one cache block per expert.
    w = layer.experts[0].w[...]
    assert w.shape == (2, 8, 4)
    np.testing.assert_allclose(
        np.asarray(expert_mlp(h, w)),
        np.asarray(jax.nn.gelu(h @ w[0]) @ w[1].T),
        rtol=1e-6,
    )


def test_build_saves_one_leaf_per_expert() -> None:
    weights = build(MoEConfig(layers=2, experts=3, d_model=8, d_ff=4), seed=0)
    assert weights["embed"]["embedding"].shape == (256, 8)
    experts = weights["layers"][1]["experts"]
    assert len(experts) == 3 and set(experts[2]) == {"w"}


def test_text_steps_are_consecutive_windows_that_wrap() -> None:
    text = demo_text()
    assert len(text) > 100_000 and b"def" in text  # Python's help topics
    steps = text_steps(text, start=10, end=10 + 100, steps=4, tokens=32)
    assert steps.shape == (4, 32) and steps.dtype == np.int32
    flat = steps.ravel()
    part = np.frombuffer(text[10:106], np.uint8)  # 3 whole windows fit in 100 bytes
    np.testing.assert_array_equal(flat[:96], part)
    np.testing.assert_array_equal(flat[96:], part[:32])  # the 4th wraps to the start
    with pytest.raises(DemoError, match="--tokens 200"):
        text_steps(text, start=0, end=100, steps=1, tokens=200)
