"""Embedding rows: look rows up by id from a table 8x larger than the device budget.

Run: python examples/embedding_rows.py

``session.lookup(table, ids)`` returns ``jnp.take(table, ids, axis=0)``: hot rows come from the
device, the others from host memory or the store in one batch; row counters are updated on the
device by the ``lfu_update`` kernel, and the hottest rows are promoted periodically.
"""

import tempfile

import jax.numpy as jnp
import numpy as np

import cacheflow_jax as cfj


def main(workdir: str) -> None:
    rng = np.random.default_rng(0)
    vocab, dim = 8192, 64
    table = rng.standard_normal((vocab, dim)).astype(np.float32)  # 2 MiB
    store = cfj.write_store({"embed": table}, f"{workdir}/emb", chunk_bytes=16 << 10)
    cache = cfj.TieredCache(store, device_bytes=256 << 10, host_bytes=512 << 10)
    with cfj.serving(cache) as s:
        for _ in range(50):
            ids = jnp.asarray(np.minimum(rng.zipf(1.2, size=64) - 1, vocab - 1), jnp.int32)
            rows = s.lookup("embed", ids)
            assert np.array_equal(np.asarray(rows), table[np.asarray(ids)])
        stats = s.stats()
    print(f"rows served exactly; embedding counters: {stats['embedding']['embed']}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="cacheflow-example-") as tmp:
        main(tmp)
