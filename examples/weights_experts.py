"""Weights: mixture-of-experts layers served from an orbax checkpoint, with layer-ahead prefetch.

Run: python examples/weights_experts.py

A stack of MoE layers is saved with orbax; the device budget holds a quarter of the experts. The
serving loop fetches one layer's routed experts with one ``get_many``; a Markov prefetcher (the
cache's worker thread) sees each layer's batch and loads the experts it expects the next layer to
route to while the current layer computes. Everything lives in a temporary folder that is
removed at the end.
"""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import cacheflow_jax as cfj
import predictor

LAYERS, EXPERTS, D = 6, 8, 256


@jax.jit
def expert_layer(x, w_a, w_b):
    return x + jnp.tanh(x @ w_a) @ w_b


def main(workdir: str) -> None:
    rng = np.random.default_rng(0)
    params = {
        "layers": [
            {"experts": [{"w": rng.standard_normal((D, D)).astype(np.float32) / 16}
                         for _ in range(EXPERTS)]}
            for _ in range(LAYERS)
        ]
    }  # fmt: skip
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(f"{workdir}/ckpt", params)
    ckpt.wait_until_finished()

    expert_bytes = D * D * 4
    tree = cfj.orbax.restore_lazy(
        f"{workdir}/ckpt",
        device_bytes=LAYERS * EXPERTS * expert_bytes // 4,
        host_bytes=LAYERS * EXPERTS * expert_bytes // 4,
        prefetcher=predictor.markov(),
    )
    cache = tree["layers"][0]["experts"][0]["w"].cache
    # Routing with locality: each request follows one of a few expert paths through the stack.
    paths = rng.integers(0, EXPERTS, size=(4, LAYERS, 2))
    x = jnp.ones((8, D), jnp.float32)
    with cfj.serving(cache) as s:
        for _ in range(60):
            path = paths[rng.choice(4, p=[0.5, 0.3, 0.15, 0.05])]
            for layer, (a, b) in enumerate(path):
                experts = tree["layers"][layer]["experts"]
                w_a, w_b = s.get_many(experts[int(e)]["w"].keys[0] for e in (a, b))
                x = expert_layer(x, w_a, w_b)
        x.block_until_ready()
        stats = s.stats()
    pf = stats["prefetch"]
    print(f"L1 hits {stats['hits']['device']}, L2 hits {stats['hits']['host']}, "
          f"misses {stats['misses']}; prefetch issued {pf['issued']}, used {pf['used']}, "
          f"accuracy {pf['accuracy']:.2f}, coverage {pf['coverage']:.2f}")  # fmt: skip


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="cacheflow-example-") as tmp:
        main(tmp)
