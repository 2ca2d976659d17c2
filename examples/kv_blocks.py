"""KV blocks: blocks written at run time, keyed by prefix hash, read back when a prefix repeats.

Run: python examples/kv_blocks.py

A serving loop puts each request's KV blocks under the hash of its prefix; a later request with
the same prefix gets them back instead of recomputing them. Blocks that leave the cache are
written back to the store (atomically, checked by reading them back) and read again on reuse.
The session records an access log, which ``cacheflow train`` can learn a predictor from.
"""

import hashlib
import tempfile

import numpy as np

import cacheflow_jax as cfj

BLOCK_TOKENS, HEADS, HEAD_DIM = 16, 4, 32


def prefix_key(tokens: list[int], end: int) -> str:
    return "kv:" + hashlib.sha256(np.asarray(tokens[:end], np.int32).tobytes()).hexdigest()[:24]


def main(workdir: str) -> None:
    rng = np.random.default_rng(0)
    store = cfj.open_store(f"{workdir}/kv", create=True)
    block_bytes = 2 * BLOCK_TOKENS * HEADS * HEAD_DIM * 4
    cache = cfj.TieredCache(store, device_bytes=8 * block_bytes, host_bytes=16 * block_bytes)
    prompts = [list(rng.integers(0, 1000, size=BLOCK_TOKENS * rng.integers(2, 6))) for _ in range(6)]
    reused = computed = 0
    with cfj.serving(cache, access_log=f"{workdir}/access.jsonl") as s:
        for _ in range(40):
            tokens = prompts[rng.integers(len(prompts))]
            for end in range(BLOCK_TOKENS, len(tokens) + 1, BLOCK_TOKENS):
                key = prefix_key(tokens, end)
                try:
                    kv = s.get(key)  # reuse: the block is in L1, L2 or the store
                    reused += 1
                except KeyError:
                    kv = rng.standard_normal((2, BLOCK_TOKENS, HEADS, HEAD_DIM)).astype(np.float32)
                    s.put(key, kv)  # computed once; written back when it leaves the cache
                    computed += 1
        stats = s.stats()
    print(f"{computed} blocks computed, {reused} reused; writebacks {stats['writebacks']}; "
          f"{len(cfj.open_store(f'{workdir}/kv').keys())} blocks in the store")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="cacheflow-example-") as tmp:
        main(tmp)
