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
        if log is None:
            self.get = cache.get  # type: ignore[method-assign]
            self.get_many = cache.get_many  # type: ignore[method-assign]

    def get(self, key: str, req: str | None = None) -> jax.Array:
        """Returns block ``key`` on the device (see `TieredCache.get`) and logs the access.

        Only accesses that succeeded are logged: a bad key raises and leaves no record.
        """
        value = self.cache.get(key)
        self._log.record(key, req)
        return value

    def get_many(self, keys: Iterable[str], req: str | None = None) -> list[jax.Array]:
        """Returns several blocks, reading all misses from L3 in parallel."""
        keys = list(keys)
        values = self.cache.get_many(keys)
        self._log.record_many(keys, req)
        return values

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
    cache: TieredCache, *, access_log: str | os.PathLike | None = None
) -> Iterator[ServingSession]:
    """Serves blocks from ``cache`` for the duration of a ``with`` block.

    On exit, even when the body raises, pending write-backs are finished (dirty runtime blocks
    reach L3) and the access log is flushed and closed. If the body raised, its exception is the
    one that propagates; an error while finishing is attached to it as a note. Otherwise the
    first such error is raised.

    Args:
      cache: the `TieredCache` to serve from.
      access_log: optional path of an access log v1 file (JSON Lines) to record every access.

    Yields:
      A `ServingSession`.
    """
    log = None
    if access_log is not None:

        def describe(key: str) -> tuple[int, str]:
            return cache.info(key).nbytes, cache.kind(key)

        log = AccessLogWriter(access_log, describe=describe)
    session = ServingSession(cache, log)
    try:
        yield session
    except BaseException as body_error:
        for err in _finish(cache, log):
            body_error.add_note(f"while leaving serving(): {type(err).__name__}: {err}")
        raise
    errors = _finish(cache, log)
    if errors:
        for err in errors[1:]:
            errors[0].add_note(f"also while leaving serving(): {type(err).__name__}: {err}")
        raise errors[0]


def _finish(cache: TieredCache, log: AccessLogWriter | None) -> list[Exception]:
    """Flushes write-backs and closes the log, both always; returns their errors."""
    errors: list[Exception] = []
    try:
        cache.flush()
    except Exception as err:
        errors.append(err)
    if log is not None:
        try:
            log.close()
        except Exception as err:
            errors.append(err)
    return errors
