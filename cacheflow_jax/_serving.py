"""``serving(cache)``: the context manager a JAX serving loop uses.

>>> import cacheflow_jax as cfj, numpy as np
>>> store = cfj.write_store({"w": np.ones((4, 4), np.float32)}, "memory://doc-serving/")
>>> cache = cfj.TieredCache(store, device_bytes=1 << 20, host_bytes=1 << 20)
>>> with cfj.serving(cache) as s:
...     w = s.get("w@0,0")
>>> float(w.sum()), s.stats()["requests"]
(16.0, 1)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import jax

from cacheflow_jax._access_log import AccessLogWriter
from cacheflow_jax._cache import TieredCache


class ServingSession:
    """What ``serving()`` yields: ``get``, ``get_many``, ``put`` and ``stats`` over one cache.

    Without an access log, ``get`` is the cache's own ``get`` (no extra call on the hit path).
    """

    def __init__(self, cache: TieredCache, log: AccessLogWriter | None) -> None:
        self.cache = cache
        self._log = log
        self.metrics_url: str | None = None  # set by serving(metrics_port=...)
        if log is None:
            self.get = cache.get  # type: ignore[method-assign]
            self.get_many = cache.get_many  # type: ignore[method-assign]

    def get(self, key: str, req: str | None = None) -> jax.Array:
        """Returns block ``key`` on the device (see `TieredCache.get`) and logs the access."""
        self._log.record(key, req)
        return self.cache.get(key)

    def get_many(self, keys: Iterable[str], req: str | None = None) -> list[jax.Array]:
        """Returns several blocks, reading all misses from L3 in parallel."""
        keys = list(keys)
        self._log.record_many(keys, req)
        return self.cache.get_many(keys)

    def put(self, key: str, array: Any, *, kind: str = "kv", req: str | None = None) -> None:
        """Stores a runtime block (e.g. a KV block); written back to L3 when it leaves."""
        self.cache.put(key, array, kind=kind)
        if self._log is not None:
            self._log.record(key, req)

    def stats(self) -> dict:
        """The cache's counters, shaped like ``cacheflow replay --json``."""
        return self.cache.stats()


@contextlib.contextmanager
def serving(
    cache: TieredCache,
    *,
    access_log: str | os.PathLike | None = None,
    metrics_port: int | None = None,
) -> Iterator[ServingSession]:
    """Serves blocks from ``cache`` for the duration of a ``with`` block.

    On exit, even when the body raises, pending write-backs are finished (dirty runtime blocks
    reach L3) and the access log is flushed and closed.

    Args:
      cache: the `TieredCache` to serve from.
      access_log: optional path of an access log v1 file (JSON Lines) to record every access.
      metrics_port: if given, serve the cache's counters in Prometheus text format at
        ``http://127.0.0.1:<port>/metrics`` while the session lasts (0: any free port; the
        session's ``metrics_url`` says which). See `cacheflow_jax.metrics`.

    Yields:
      A `ServingSession`.
    """
    log = None
    if access_log is not None:

        def describe(key: str) -> tuple[int, str]:
            return cache.info(key).nbytes, cache.kind(key)

        log = AccessLogWriter(access_log, describe=describe)
    metrics = None
    if metrics_port is not None:
        from cacheflow_jax.metrics import serve as serve_metrics

        try:
            metrics = serve_metrics(cache, port=metrics_port)
        except BaseException:
            if log is not None:
                log.close()
            raise
    session = ServingSession(cache, log)
    session.metrics_url = metrics.url if metrics is not None else None
    try:
        yield session
    finally:
        try:
            cache.flush()
        finally:
            if metrics is not None:
                metrics.close()
            if log is not None:
                log.close()
