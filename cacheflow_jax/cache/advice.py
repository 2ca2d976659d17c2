"""Advice where a user would go wrong without a word: the checks behind the library's warnings.

Each check reads sizes and counters only and returns the sentences to report (empty or None
when all is well); `replay` and `serving` log them through `cacheflow_jax.core.log.logger`:

* a budget smaller than a block: the block can never be held there (replay; a live cache
  refuses such a budget with a `BudgetError` instead);
* a streamed working set larger than L1: blocks are read again and again, yet L1 serves almost
  none of them, the pattern of a model streamed layer by layer through an L1 smaller than one
  pass (each block is evicted before its next use, whatever the policy);
* a prefetcher that can issue nothing: no block fits where a prefetch would land, the in-flight
  bound is below every block, or a run ended with nothing issued.

The thresholds are module constants; a check never runs on a hit path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# A streamed working set: at least this many requests, at least this share of them re-reads of
# a block requested before, and at most this share served from L1.
STREAM_MIN_REQUESTS = 64
STREAM_MIN_REUSE = 0.5
STREAM_MAX_L1_HITS = 0.01

# A prefetcher that issued nothing is worth a word only where L1 missed this share of requests.
PREFETCH_MIN_MISSES = 0.1

# Where to read what to do about it.
STREAM_DOC = "docs/integration.md, 'Budgets for a model streamed layer by layer'"


def trace_budget_advice(
    sizes: Mapping[str, int],
    keys: Sequence[str],
    *,
    device_bytes: int,
    host_bytes: int,
    prefetch: bool,
    names: tuple[str, str] = ("device_bytes", "host_bytes"),
    unit: str = "bytes",
) -> list[str]:
    """What a replay's budgets cannot do: blocks larger than L1 (and L2), a prefetch with no room.

    Args:
      sizes: each key's size in bytes (a trace's largest ``nbytes`` of the key).
      keys: the accesses, in order (counted only when a block does not fit L1).
      device_bytes: the L1 budget.
      host_bytes: the L2 budget (0: no L2).
      prefetch: whether a prefetcher is set.
      names: how the two budgets are named to the user (the CLI's ``--device-bytes 5%``).
      unit: what sizes count (``blocks`` on a unit-size trace).

    Returns:
      One sentence per problem, empty when the budgets hold every block.
    """
    if not sizes:
        return []
    device, host = names
    largest_key = max(sizes, key=sizes.__getitem__)
    largest, smallest = sizes[largest_key], min(sizes.values())
    out = []
    if largest > device_bytes:
        too_big = {k for k, n in sizes.items() if n > device_bytes}
        accesses = sum(1 for k in keys if k in too_big)
        where = "L1" if host_bytes >= largest else "L1 or L2" if host_bytes else "L1 (no L2)"
        out.append(
            f"L1 ({device}: {device_bytes} {unit}) is smaller than {len(too_big)} of the "
            f"{len(sizes)} distinct blocks (the largest, {largest_key!r}, has {largest} "
            f"{unit}): they are never held in {where}, so {accesses} of the {len(keys)} "
            f"accesses cannot be L1 hits; give {device} at least {largest} {unit} to hold "
            "every block"
        )
    if prefetch and smallest > device_bytes and smallest > host_bytes:
        out.append(
            f"the prefetcher can issue nothing: no block fits L1 ({device}: {device_bytes} "
            f"{unit}) or L2 ({host}: {host_bytes} {unit}); the smallest has {smallest} {unit}"
        )
    return out


def stream_advice(
    stats: Mapping[str, Any],
    *,
    reused: int,
    working_bytes: int | None,
    device_bytes: int,
    names: tuple[str, str] = ("device_bytes", "host_bytes"),
    unit: str = "bytes",
) -> str | None:
    """The warning for a streamed working set larger than L1, or None.

    Args:
      stats: the cache's counters (`TieredCache.stats`).
      reused: how many of the requests re-read a block requested before (a lower bound will
        do).
      working_bytes: the bytes of the distinct blocks requested, where known.
      device_bytes: the L1 budget.
      names: how the two budgets are named to the user.
      unit: what sizes count (``blocks`` on a unit-size trace).

    Returns:
      The warning, or None when L1 serves its share or the stream does not re-read blocks.
    """
    requests = int(stats["requests"])
    if requests < STREAM_MIN_REQUESTS or reused < STREAM_MIN_REUSE * requests:
        return None
    l1 = int(stats["hits"]["device"])
    if l1 > STREAM_MAX_L1_HITS * requests:
        return None
    device, host = names
    size = f" ({working_bytes} {unit} of distinct blocks)" if working_bytes else ""
    need = f"at least {working_bytes} {unit}" if working_bytes else "what one pass reads"
    return (
        f"{l1} of {requests} requests were served from L1 although {reused} re-read a block "
        f"requested before: the blocks read in turn{size} do not fit L1 ({device}: "
        f"{device_bytes} {unit}), so each is evicted before it is read again. Give {device} "
        f"{need}, "
        f"or keep them in L2 ({host}) and prefetch the next blocks while one computes "
        f"(prefetcher=predictor.markov(), prefetch=PrefetchSettings(k=<blocks per step>)); "
        f"see {STREAM_DOC}"
    )


def prefetch_advice(stats: Mapping[str, Any], *, keys_known: bool | None = None) -> str | None:
    """The warning for a prefetcher that issued nothing over a run, or None.

    Args:
      stats: the cache's counters, after a run with a prefetcher.
      keys_known: replay's ``keys_known`` (None live): without it a key can be prefetched only
        after its first access.

    Returns:
      The warning, or None when something was issued, the run was too short to tell, L1 served
      nearly every request (nothing to prefetch), or prefetching was turned off (which was
      reported when it happened).
    """
    prefetch = stats["prefetch"]
    requests = int(stats["requests"])
    if prefetch["issued"] or prefetch.get("promoted") or requests < STREAM_MIN_REQUESTS:
        return None
    if requests - int(stats["hits"]["device"]) < PREFETCH_MIN_MISSES * requests:
        return None  # L1 served (nearly) everything: there was nothing to prefetch
    if not prefetch.get("enabled", True):
        return None
    why = [
        "its guesses were already resident, scored below min_score, or did not fit the room "
        "prefetch admission leaves"
    ]
    if keys_known is not None and stats["hits"]["host"]:
        why.append(
            "its guesses were in L2: replay does not move a guess from L2 up to L1 (the live "
            "worker does, PrefetchSettings(promote=True)); replay with no L2 (--host-bytes 0) "
            "to see what loading guesses from L3 gives"
        )
    if keys_known is False:
        why.append(
            "a key can be prefetched only after its first access (--keys-known / "
            "PrefetchSettings(keys_known=True) says every key is in L3 from the start, as "
            "weights are)"
        )
    return f"the prefetcher issued nothing over {requests} requests: " + "; or ".join(why)


def inflight_advice(inflight_bytes: int | None, smallest: int | None, spec: str) -> str | None:
    """The warning for an in-flight bound below every block (nothing can ever be issued)."""
    if inflight_bytes is None or smallest is None or inflight_bytes >= smallest:
        return None
    return (
        f"the prefetcher can issue nothing: PrefetchSettings(inflight_bytes={inflight_bytes}) "
        f"is below every block of {spec} (the smallest has {smallest} bytes); raise it to at "
        f"least {smallest}, or leave it None"
    )


def session_advice(cache: Any) -> list[str]:
    """What a live session's counters say went wrong (see the module docstring).

    Args:
      cache: the session's `TieredCache`.

    Returns:
      The warnings, possibly none.
    """
    stats = cache.stats()
    out = []
    store = cache.store
    arrays = store.arrays()
    blocks = sum(_blocks(a) for a in arrays.values())
    # Every L2 hit re-reads a block; so does every L3 read beyond one per stored block.
    reused = int(stats["hits"]["host"]) + max(0, int(stats["l3"]["reads"]) - blocks)
    budget = int(stats["tiers"]["device"]["budget"])
    text = stream_advice(stats, reused=reused, working_bytes=None, device_bytes=budget)
    if text is not None:
        out.append(text)
    if cache.prefetcher is not None:
        text = prefetch_advice(stats)
        if text is not None:
            out.append(text)
    return out


def smallest_block(store: Any) -> int | None:
    """The size in bytes of the smallest block of ``store``'s arrays (None without arrays):
    each array's last block, clipped at every far edge, is its smallest."""
    best = None
    for a in store.arrays().values():
        n = a.dtype.itemsize
        for size, block in zip(a.shape, a.chunk_shape):
            n *= size - (-(-size // block) - 1) * block if block else 1
        if n and (best is None or n < best):
            best = n
    return best


def _blocks(array: Any) -> int:
    n = 1
    for g in array.grid_shape:
        n *= g
    return n
