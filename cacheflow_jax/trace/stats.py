"""``cacheflow stats``: what an access log says about caching it, in one pass.

For each access the *LRU stack distance* is computed: how many distinct keys (and how many bytes
of distinct keys) were accessed since the previous access to the same key, itself included. An LRU
cache of ``C`` bytes hits an access exactly when its byte distance is at most ``C`` (Mattson et
al., 1970: LRU is a stack algorithm, so one pass gives the miss ratio at every size). This holds
for variable sizes too, as `replay` runs LRU: its resident set is always the longest prefix of the
recency stack that fits the budget, each key counted at its largest size in the trace.

The distances come from an offline count, not a per-access tree walk in Python. The distance of
access ``i`` whose key was last accessed at ``p`` is the bytes accessed in ``(p, i)``, minus the
bytes of accesses ``j`` in ``(p, i)`` whose own previous access is also in ``(p, i)`` (those keys are
counted once, at their first access in the window), plus the key's own size. The subtracted term
counts reuse intervals nested inside ``(p, i)``: a two-dimensional dominance count, done here by a
divide and conquer over time in which every level is a handful of vectorized numpy sorts and
searches, O(n log^2 n) in all, with no Python loop over accesses.

For logs too big for that, ``sample`` switches to fixed-rate SHARDS (Waldspurger et al., FAST'15):
only keys whose hash falls under ``sample`` of the hash space are kept, and their distances are
divided by ``sample``. The result is then an estimate, and the report says so.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from cacheflow_jax.trace.reader import Trace, parse_size

DEFAULT_SIZES = ("1%", "5%", "10%", "20%")


def stack_distances(ids: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """LRU stack distances of an access sequence, in distinct keys and in bytes.

    Args:
      ids: int [n], the key of each access as a small integer (``0 <= id < len(sizes)``).
      sizes: int [k], each key's size in bytes.

    Returns:
      ``(keys, nbytes)``, float64 [n] each: the number of distinct keys, and their bytes,
      accessed since the previous access to the same key, that key included (1 and its own size
      for an immediate re-access); ``inf`` for a first access.

    >>> k, b = stack_distances(np.array([0, 1, 0, 0, 2, 1]), np.array([10, 20, 30]))
    >>> k.tolist(), b.tolist()
    ([inf, inf, 2.0, 1.0, inf, 3.0], [inf, inf, 30.0, 10.0, inf, 60.0])
    """
    ids = np.asarray(ids, np.int64)
    n = len(ids)
    w = np.asarray(sizes, np.float64)[ids]
    # prev[i]: the position of the previous access to ids[i], or -1.
    order = np.argsort(ids, kind="stable")
    prev = np.full(n, -1, np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    reuse = np.flatnonzero(prev >= 0)  # the accesses with a previous one (and the intervals)
    a = prev[reuse]  # interval starts
    cw = np.concatenate(([0.0], np.cumsum(w)))
    # Accesses strictly inside (p, i), in bytes and in count.
    inside_bytes = cw[reuse] - cw[a + 1]
    inside_count = (reuse - a - 1).astype(np.float64)
    nested_bytes = np.zeros(len(reuse))
    nested_count = np.zeros(len(reuse))
    # Count, for each query (p=a_q, i=b_q), the intervals (a_j, b_j) with a_j > p and b_j < i.
    # Every pair b_j < i first differs in some bit L of the time index: at that level b_j is in the
    # left half of a block of 2^(L+1) positions and i in the right half. Within each block the
    # left half's intervals are sorted by start; each right-half query finds its count with one
    # binary search, for all blocks at once by keying on (block, start).
    wb = w[reuse]
    span = np.int64(n + 1)
    for level in range(max(1, int(n - 1).bit_length())):
        half = (reuse >> level) & 1
        left = half == 0
        right = ~left
        if not left.any() or not right.any():
            continue
        pkey = (reuse[left] >> (level + 1)) * span + a[left]
        order = np.argsort(pkey, kind="stable")
        sorted_keys = pkey[order]
        cum_bytes = np.concatenate(([0.0], np.cumsum(wb[left][order])))
        block = reuse[right] >> (level + 1)
        lo = np.searchsorted(sorted_keys, block * span + a[right], side="right")
        hi = np.searchsorted(sorted_keys, (block + 1) * span, side="left")
        nested_bytes[right] += cum_bytes[hi] - cum_bytes[lo]
        nested_count[right] += hi - lo
    keys_out = np.full(n, math.inf)
    bytes_out = np.full(n, math.inf)
    keys_out[reuse] = inside_count - nested_count + 1.0
    bytes_out[reuse] = inside_bytes - nested_bytes + wb
    return keys_out, bytes_out


def _key_ids(keys: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    index: dict[str, int] = {}
    ids = np.fromiter((index.setdefault(k, len(index)) for k in keys), np.int64, len(keys))
    return ids, list(index)


def _sampled(names: list[str], rate: float) -> np.ndarray:
    """For each key, whether its hash falls under ``rate`` of the hash space (SHARDS' filter)."""
    threshold = int(rate * 2**32)
    return np.fromiter(
        (zlib.crc32(k.encode("utf-8", "surrogatepass")) < threshold for k in names),
        bool,
        len(names),
    )


def _histogram(distances: np.ndarray) -> list[dict[str, Any]]:
    """Reuse distances (finite ones) in power-of-two buckets ``[lo, hi)``."""
    finite = distances[np.isfinite(distances)]
    if not len(finite):
        return []
    top = int(math.ceil(math.log2(finite.max() + 1))) if finite.max() >= 1 else 1
    edges = [2**e for e in range(top + 1)]
    counts, _ = np.histogram(finite, bins=edges)
    return [
        {"lo": lo, "hi": hi, "accesses": int(c)}
        for lo, hi, c in zip(edges[:-1], edges[1:], counts.tolist())
    ]


def trace_stats(
    trace: Trace,
    *,
    sizes: Sequence[str] = DEFAULT_SIZES,
    sample: float | None = None,
) -> dict[str, Any]:
    """Summarises a trace: accesses, keys and bytes by kind, reuse distances, LRU's miss ratios.

    Args:
      trace: the accesses (see `cacheflow_jax.trace.reader.read_trace`).
      sizes: cache sizes for the miss-ratio curve, as `replay` takes them (``5%``, ``64MiB``, or
        a block count on a unit-size trace).
      sample: None for the exact curve, or a rate in (0, 1] for fixed-rate SHARDS sampling.

    Returns:
      ``{"trace", "accesses", "distinct_keys", "distinct_bytes", "unit_size", "by_kind": {kind:
      {"accesses", "distinct_keys", "distinct_bytes"}}, "reuse": {"unit", "first_accesses",
      "median", "histogram": [{"lo", "hi", "accesses"}]}, "lru": [{"size", "cache_bytes",
      "miss_ratio", "byte_miss_ratio"}], "method", "sample", "seconds"}``. Reuse distances count
      distinct keys (LRU stack depth); the curve's sizes are bytes (blocks on a unit-size trace).

    Raises:
      ValueError: a size that cannot be parsed, or a sample rate outside (0, 1].
    """
    if sample is not None and not (0.0 < sample <= 1.0):
        raise ValueError(f"--sample {sample} must be a rate in (0, 1], e.g. 0.01")
    start = time.perf_counter()
    ids, names = _key_ids(trace.keys)
    # Each key's size is its largest in the trace, as replay's store gives it.
    key_sizes = np.zeros(len(names), np.int64)
    np.maximum.at(key_sizes, ids, trace.nbytes)
    total = int(key_sizes.sum())
    largest = int(key_sizes.max())
    unit = largest == 1
    budgets = [
        parse_size(s, total=total, largest=largest, setting="--sizes", unit_size=unit)
        for s in sizes
    ]
    kind_names = sorted(set(trace.kinds))
    code = {k: i for i, k in enumerate(kind_names)}
    kinds = np.fromiter((code[k] for k in trace.kinds), np.int64, len(trace))
    # A key counts under the kind of its first access.
    firsts = np.unique(ids, return_index=True)[1]
    first_kind = kinds[firsts]
    n_kinds = len(kind_names)
    by_kind = {
        name: {"accesses": int(a), "distinct_keys": int(k), "distinct_bytes": int(b)}
        for name, a, k, b in zip(
            kind_names,
            np.bincount(kinds, minlength=n_kinds).tolist(),
            np.bincount(first_kind, minlength=n_kinds).tolist(),
            np.bincount(first_kind, weights=key_sizes[ids[firsts]], minlength=n_kinds).tolist(),
        )
    }
    sizes_arr = key_sizes.astype(np.float64)
    all_bytes = float(sizes_arr[ids].sum())
    if sample is not None and sample < 1.0:
        ids = ids[_sampled(names, sample)[ids]]
        scale = 1.0 / sample
        method = (
            f"fixed-rate SHARDS sampling (Waldspurger et al., FAST'15, with their count "
            f"adjustment): keys whose crc32 falls under {sample:g} of the hash space, "
            f"{len(ids)} of {len(trace)} accesses; distances scaled by 1/rate, so the curve is "
            "an estimate"
        )
    else:
        scale = 1.0
        method = "exact: Mattson's LRU stack distances in one pass (offline dominance count)"
    dist_keys, dist_bytes = (
        stack_distances(ids, sizes_arr) if len(ids) else (np.zeros(0), np.zeros(0))
    )
    dist_keys = dist_keys * scale
    dist_bytes = dist_bytes * scale
    weights = sizes_arr[ids] if len(ids) else np.zeros(0)
    ordered = np.argsort(dist_bytes, kind="stable")
    sorted_bytes = dist_bytes[ordered]
    miss_bytes_cum = np.cumsum(weights[ordered][::-1])[::-1]  # bytes of accesses from here on
    miss_bytes_cum = np.concatenate((miss_bytes_cum, [0.0]))
    # SHARDS' adjustment: the sampled accesses stand for ``sample`` of all accesses, and any
    # shortfall or excess of the sample is taken as hits, so misses are divided by the expected
    # sample size rather than by the drawn one (with no sampling both are the same).
    expected = len(trace) / scale
    expected_bytes = all_bytes / scale
    curve = []
    for text, budget in zip(sizes, budgets):
        hits = int(np.searchsorted(sorted_bytes, budget, side="right"))
        curve.append(
            {
                "size": text,
                "cache_bytes": budget,
                "miss_ratio": min(1.0, (len(ids) - hits) / expected),
                "byte_miss_ratio": min(1.0, float(miss_bytes_cum[hits]) / expected_bytes),
            }
        )
    finite = dist_keys[np.isfinite(dist_keys)]
    return {
        "trace": trace.path,
        "accesses": len(trace),
        "distinct_keys": len(names),
        "distinct_bytes": total,
        "unit_size": unit,
        "by_kind": by_kind,
        "reuse": {
            "unit": "distinct keys (LRU stack depth)",
            "first_accesses": int(round((len(dist_keys) - len(finite)) * scale)),
            "median": float(np.median(finite)) if len(finite) else None,
            "histogram": [
                {**row, "accesses": int(round(row["accesses"] * scale))}
                for row in _histogram(dist_keys)
            ],
        },
        "lru": curve,
        "method": method,
        "sample": sample,
        "seconds": time.perf_counter() - start,
    }
