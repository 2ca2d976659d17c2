"""A KV prefix cache for a JAX engine: reuse the KV of shared prompt prefixes across requests.

Run: python examples/kv_prefix_cache.py

The loop a JAX serving engine can copy (docs/kv_cache.md explains each step):

1. key the prompt's full 16-token blocks by a hash chain (`cacheflow_jax.kv.prefix_keys`);
2. ask the cache how many leading blocks it holds (`cached_prefix`), without reading them;
3. pin those blocks while the request reads them (`pinned`) and compute only the rest;
4. store the new blocks, each a pytree of per-layer K and V under its key, in one
   `put_many(..., wait=False)` (as an engine's KV connector saves a step's KV: installed on a
   background thread while the engine goes on, counted by `cached_prefix` at once; written
   back to L3 in the background when they leave L1/L2).

The model here is a toy: one attention layer per "layer", computed block by block so that a
cached block's KV is bitwise the one a recompute would give; the script checks that.
"""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import cacheflow_jax as cfj
from cacheflow_jax.kv import prefix_keys

BLOCK, LAYERS, DIM, VOCAB = 16, 2, 32, 256


def init(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "embed": jax.random.normal(k[0], (VOCAB, DIM)) * 0.1,
        "wk": jax.random.normal(k[1], (LAYERS, DIM, DIM)) / DIM**0.5,
        "wv": jax.random.normal(k[2], (LAYERS, DIM, DIM)) / DIM**0.5,
        "wq": jax.random.normal(k[3], (LAYERS, DIM, DIM)) / DIM**0.5,
    }


@jax.jit
def prefill_block(params: dict, tokens: jax.Array, past_k: jax.Array, past_v: jax.Array,
                  n_past: jax.Array) -> tuple[dict, jax.Array]:  # fmt: skip
    """One block of 16 tokens over a past padded to a fixed length: its KV, and the hidden state."""
    x = params["embed"][tokens]
    mask = jnp.concatenate(
        [jnp.broadcast_to(jnp.arange(past_k.shape[1]) < n_past, (BLOCK, past_k.shape[1])),
         jnp.tril(jnp.ones((BLOCK, BLOCK), bool))], axis=1)  # fmt: skip
    ks, vs = [], []
    for layer in range(LAYERS):
        k, v, q = x @ params["wk"][layer], x @ params["wv"][layer], x @ params["wq"][layer]
        keys = jnp.concatenate([past_k[layer], k])
        values = jnp.concatenate([past_v[layer], v])
        att = jax.nn.softmax(jnp.where(mask, q @ keys.T / DIM**0.5, -1e30), axis=-1)
        x = x + att @ values
        ks.append(k)
        vs.append(v)
    return {"k": jnp.stack(ks), "v": jnp.stack(vs)}, x[-1]


MAX_PAST = 8 * BLOCK  # prompts of up to 8 blocks here


def serve(params: dict, tokens: np.ndarray, s: cfj.ServingSession | None) -> tuple[jax.Array, int]:
    """Prefills one prompt; returns the last hidden state and how many blocks it computed."""
    keys = prefix_keys(tokens, block_tokens=BLOCK, salt="toy-model-v1")
    past_k = np.zeros((LAYERS, MAX_PAST, DIM), np.float32)
    past_v = np.zeros_like(past_k)
    # At least the last block is computed: its hidden state gives the first token.
    held = s.cached_prefix(keys) if s is not None else 0
    cached = min(held, len(keys) - 1)
    computed, new = 0, []
    if s is not None and cached:
        with s.pinned(keys[:cached]) as blocks:  # in L1 until this request has read them
            for i, block in enumerate(blocks):
                past_k[:, i * BLOCK : (i + 1) * BLOCK] = np.asarray(block["k"])
                past_v[:, i * BLOCK : (i + 1) * BLOCK] = np.asarray(block["v"])
    for i in range(cached, len(keys)):
        kv, hidden = prefill_block(params, jnp.asarray(tokens[i * BLOCK : (i + 1) * BLOCK]),
                                   jnp.asarray(past_k), jnp.asarray(past_v), i * BLOCK)  # fmt: skip
        past_k[:, i * BLOCK : (i + 1) * BLOCK] = np.asarray(kv["k"])
        past_v[:, i * BLOCK : (i + 1) * BLOCK] = np.asarray(kv["v"])
        computed += 1
        if i >= held:  # (the last block may be held already: it is recomputed, not stored)
            new.append((keys[i], kv))  # one key, one pytree block
    if s is not None:
        # The request's new blocks in one call, installed in the background: the next request's
        # cached_prefix counts them at once, and a get of one waits until it is in.
        s.put_many(new, wait=False)
    return hidden, computed


def main(workdir: str) -> None:
    params = init()
    rng = np.random.default_rng(0)
    system = rng.integers(0, VOCAB, 4 * BLOCK)  # a shared system prompt of 4 blocks
    prompts = [np.concatenate([system, rng.integers(0, VOCAB, BLOCK * int(rng.integers(1, 4)))])
               for _ in range(5)]  # fmt: skip
    block_bytes = 2 * LAYERS * BLOCK * DIM * 4
    cache = cfj.TieredCache(cfj.open_store(f"{workdir}/kv", create=True),
                            device_bytes=6 * block_bytes, host_bytes=12 * block_bytes)  # fmt: skip
    computed = total = 0
    with cfj.serving(cache) as s:
        for step in range(20):
            tokens = prompts[step % len(prompts)]
            hidden, n = serve(params, tokens, s)
            reference, _ = serve(params, tokens, None)  # recompute, to check the cached path
            assert np.array_equal(np.asarray(hidden), np.asarray(reference)), step
            computed += n
            total += len(tokens) // BLOCK
    stats = cache.stats()  # after the session: its exit wrote every dirty block back
    print(f"{computed} of {total} prompt blocks computed, {total - computed} reused from the "
          f"cache (outputs bitwise equal to recomputing); hits L1 {stats['hits']['device']}, "
          f"L2 {stats['hits']['host']}, L3 {stats['misses']}; "
          f"{stats['writebacks']['count']} blocks written back")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="cacheflow-example-") as tmp:
        main(tmp)
