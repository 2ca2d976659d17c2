"""Keys for KV-cache blocks: a hash chain over a request's token blocks.

The scheme is vLLM's automatic prefix caching (and LMCache's chunk hashing): the prompt is cut
into blocks of ``block_tokens`` tokens, and block ``i``'s key is a hash of block ``i - 1``'s key
and block ``i``'s own tokens. A key therefore names the whole prefix up to the end of its block:
two requests that share their first ``n`` blocks of tokens share their first ``n`` keys, and
nothing else, so KV blocks are content-addressed (the same key always holds the same bytes for
one model). Only full blocks get a key; a partial last block is recomputed.

Mix the model's identity into ``salt`` (its name, its config's hash, the KV dtype): KV blocks of
two models must never share keys. vLLM adds per-request extras (LoRA id, multimodal hashes) the
same way.

>>> from cacheflow_jax.kv import prefix_keys
>>> a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], block_tokens=4, salt="tiny-llm")
>>> b = prefix_keys([1, 2, 3, 4, 5, 6, 7, 0], block_tokens=4, salt="tiny-llm")
>>> len(a), a[0] == b[0], a[1] == b[1]
(2, True, False)

With a cache, the blocks a request can skip are ``cache.cached_prefix(keys)``; see
docs/kv_cache.md for the whole loop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

__all__ = ["prefix_keys"]


def prefix_keys(
    tokens: Sequence[int] | Any,
    *,
    block_tokens: int = 16,
    salt: str = "",
    namespace: str = "kv",
) -> list[str]:
    """The keys of a token sequence's full blocks, each hashing its whole prefix.

    Args:
      tokens: token ids (a list, or a 1-d numpy or JAX integer array).
      block_tokens: tokens per KV block (vLLM's default is 16).
      salt: what else the KV depends on: the model's name or config hash, at least.
      namespace: the keys' prefix (keys are ``f"{namespace}:{digest}"``).

    Returns:
      ``len(tokens) // block_tokens`` keys; key ``i`` covers tokens ``[0, (i + 1) * block_tokens)``.

    Raises:
      ValueError: ``block_tokens`` < 1, or ``tokens`` is not 1-d.
    """
    import numpy as np

    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens={block_tokens!r} must be an int >= 1")
    ids = np.asarray(tokens)
    if ids.ndim != 1:
        raise ValueError(f"tokens must be 1-d token ids; got shape {ids.shape}")
    if ids.size and ids.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integer token ids; got dtype {ids.dtype}")
    ids = ids.astype("<i8", copy=False)
    digest = hashlib.sha256(f"cacheflow-kv\0{salt}\0{block_tokens}".encode()).digest()
    keys = []
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        digest = hashlib.sha256(digest + ids[start : start + block_tokens].tobytes()).digest()
        keys.append(f"{namespace}:{digest.hex()[:32]}")
    return keys
