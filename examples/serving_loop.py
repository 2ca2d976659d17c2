"""A serving loop over weights that do not fit the device budget.

Run: python examples/serving_loop.py

The store and the access log live in a temporary folder that is removed at the end.
"""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import cacheflow_jax as cfj


@jax.jit
def layer(x, w):
    return jnp.tanh(x @ w)


def main(workdir: str) -> None:
    rng = np.random.default_rng(0)
    # 8 layers of 1 MiB weights; the device budget holds 2 of them, the host 4.
    params = {
        f"layer{i}": {"w": rng.standard_normal((512, 512)).astype(np.float32)} for i in range(8)
    }
    store = cfj.write_store(params, f"{workdir}/weights", chunk_bytes=1 << 20)
    cache = cfj.TieredCache(store, device_bytes=2 << 20, host_bytes=4 << 20)

    x = jnp.ones((4, 512), jnp.float32)
    with cfj.serving(cache, access_log=f"{workdir}/access.jsonl") as s:
        for step in range(20):
            for i in (0, 1, 2, step % 8):  # three hot layers and a cold one
                x = layer(x, s.get(f"layer{i}/w@0,0", req=f"r{step}"))
        s.put("kv:prefix-abc", x)  # a runtime block: written back to L3 when it leaves
        print(s.stats()["hits"], s.stats()["miss_ratio"])


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="cacheflow-example-") as tmp:
        main(tmp)
