"""What the policy benchmarks share: the traces, our default policy's name and the libCacheSim
peers (`bench.policies`, `bench.policy_spread`)."""

from __future__ import annotations

import os

DEFAULT = "lfu"
OURS = [DEFAULT, "lru", "belady"]
PEERS = ["LRU", "ARC", "LIRS", "S3FIFO", "Sieve", "WTinyLFU", "LFU"]
# Smallest cache (objects, or bytes for sized traces) each libCacheSim peer accepts: below it
# the library aborts the process (S3-FIFO: a small queue of 10% rounds to 0; W-TinyLFU: an
# empty SLRU segment).
PEER_MIN_SIZE = {"S3FIFO": 10, "WTinyLFU": 5}
GAP_MIN = 0.001  # LRU - Belady below this: the gap-closed ratio would be noise


def shared_traces_dir() -> str:
    """The trace folder: ``$CACHEFLOW_TRACES``, else the project's own ``data/traces``.

    Raises:
      FileNotFoundError: neither exists (the message says where it looked).
    """
    env = os.environ.get("CACHEFLOW_TRACES")
    if env:
        return env
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "traces")
    if os.path.isdir(here):
        return here
    raise FileNotFoundError(
        f"no trace folder: {here} is missing (it ships with the project); set "
        "CACHEFLOW_TRACES=DIR or pass --traces"
    )


def shared_traces() -> list[str]:
    """Every shared trace with keys, sorted by name (the Azure files list no keys)."""
    folder = shared_traces_dir()
    names = [
        n for n in sorted(os.listdir(folder))
        if not n.startswith("AzureLLM") and not n.endswith(".md")
    ]
    return [os.path.join(folder, n) for n in names]


QUICK = ["lirs_backf.txt.gz", "lirs_cpp.txt.gz", "lirs_cs.txt.gz", "lirs_gli.txt.gz",
         "lirs_ps.txt.gz"]


def peer_miss_ratio(trace, name: str, size: int) -> float | None:
    """The request miss ratio of libCacheSim's ``name`` on ``trace`` with ``size`` bytes (None
    where the peer cannot run at that size, see PEER_MIN_SIZE)."""
    if size < PEER_MIN_SIZE.get(name, 0):
        return None
    import libcachesim as lcs

    cache = getattr(lcs, name)(cache_size=size)
    ids: dict[str, int] = {}
    sizes = trace.sizes()
    misses = 0
    get = cache.get
    request = lcs.Request
    for i, key in enumerate(trace.keys):
        obj = ids.setdefault(key, len(ids))
        if not get(request(obj_id=obj, obj_size=sizes[key], clock_time=i)):
            misses += 1
    return misses / len(trace.keys)


_TRACE = None


def cached_trace(path: str):
    """The trace at ``path``, read once per worker process (the last one read is kept)."""
    global _TRACE
    if _TRACE is None or _TRACE.path != path:
        from cacheflow_jax.trace.reader import read_trace

        _TRACE = read_trace(path)
    return _TRACE
