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
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import jax

from cacheflow_jax.cache.advice import session_advice
from cacheflow_jax.cache.tiered import TieredCache
from cacheflow_jax.core.log import logger
from cacheflow_jax.session.embedding import EmbeddingRows
from cacheflow_jax.trace.writer import AccessLogWriter


class ServingSession:
    """What ``serving()`` yields: ``get``, ``get_many``, ``put``, ``lookup``, ``stats``, and for
    KV blocks ``cached_prefix``, ``get_found`` and ``pinned``.

    Without an access log, ``get`` is the cache's own ``get`` (no extra call on the hit path).
    """

    def __init__(
        self,
        cache: TieredCache,
        log: AccessLogWriter | None,
        *,
        embedding_bytes: int | None = None,
        promote_every: int = 16,
        row_half_life: float = 64.0,
    ) -> None:
        self.cache = cache
        self._log = log
        self.metrics_url: str | None = None  # set by serving(metrics_port=...)
        self._metrics: Any = None  # its /metrics server, stopped when the session ends
        self._rows: dict[str, EmbeddingRows] = {}
        self._row_settings = {"period": promote_every, "half_life": row_half_life}
        self._embedding_bytes = embedding_bytes
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

    def put(
        self,
        key: str,
        value: Any,
        *,
        kind: str = "kv",
        writeback: bool = True,
        req: str | None = None,
    ) -> None:
        """Stores a runtime block (an array or a pytree of arrays, e.g. a KV block); written
        back to L3 in the background when it leaves (see `TieredCache.put`)."""
        self.cache.put(key, value, kind=kind, writeback=writeback)
        if self._log is not None:
            self._log.record(key, req)

    def put_many(
        self,
        items: Iterable[tuple[str, Any]] | Mapping[str, Any],
        *,
        kind: str = "kv",
        writeback: bool = True,
        req: str | None = None,
        wait: bool = True,
    ) -> Future | None:
        """Stores several runtime blocks in order, as `put` does each (`TieredCache.put_many`):
        the KV blocks an engine step computed, for example. ``wait=False`` returns before they
        are installed, with a `concurrent.futures.Future` of the installs."""
        if isinstance(items, Mapping):
            items = items.items()
        items = list(items)
        future = self.cache.put_many(items, kind=kind, writeback=writeback, wait=wait)
        if self._log is not None:
            self._log.record_many([key for key, _ in items], req)
        return future

    def cached_prefix(self, keys: Iterable[str]) -> int:
        """How many leading ``keys`` any tier holds (`TieredCache.cached_prefix`)."""
        return self.cache.cached_prefix(keys)

    def get_found(
        self, keys: Iterable[str], req: str | None = None
    ) -> tuple[dict[str, Any], list[str]]:
        """The blocks that exist, and the keys that do not (`TieredCache.get_found`)."""
        found, missing = self.cache.get_found(keys)
        if self._log is not None and found:
            self._log.record_many(list(found), req)
        return found, missing

    def pinned(self, keys: Iterable[str]) -> contextlib.AbstractContextManager[list[Any]]:
        """Keeps ``keys`` in L1 while a request reads them (`TieredCache.pinned`)."""
        return self.cache.pinned(keys)

    def lookup(self, table: str, ids: Any) -> jax.Array:
        """Returns rows ``ids`` of the stored table ``table``, in order, as a device array.

        Equal to ``jnp.take(full_table, ids, axis=0)`` for ids in range. Hot rows come from the
        device (the L1 slab with ``device_layout="slab"``); the others are fetched from L2/L3 in
        one batch. Row counters live on the device and are updated from ``ids`` by
        `pallas_kernels.lfu_update`; every ``promote_every`` lookups the host reads them in one
        transfer and makes the most used rows resident. The first lookup of a table reserves
        ``embedding_bytes`` of L1 for its rows.

        Args:
          table: the path of a stored array whose first axis is rows.
          ids: integer row ids (a device array, or anything ``jnp.asarray`` takes), any shape.

        Returns:
          An array of shape ``ids.shape + table.shape[1:]`` and the table's dtype.

        Raises:
          KeyError: no stored array ``table``.
          IndexError: an id outside the table's rows.
          BudgetError: ``embedding_bytes`` holds no row or does not fit in L1.

        >>> import cacheflow_jax as cfj, numpy as np, jax.numpy as jnp
        >>> store = cfj.write_store({"emb": np.arange(12.0).reshape(6, 2)}, "memory://doc-rows/")
        >>> cache = cfj.TieredCache(store, device_bytes=1 << 10, host_bytes=1 << 10)
        >>> with cfj.serving(cache) as s:
        ...     s.lookup("emb", jnp.array([4, 0])).tolist()
        [[8.0, 9.0], [0.0, 1.0]]
        """
        rows = self._rows.get(table)
        if rows is None:
            budget = self._embedding_bytes
            if budget is None:
                budget = self.cache.tiers[0].budget // 2
            rows = EmbeddingRows(self.cache, table, device_bytes=budget, **self._row_settings)
            self._rows[table] = rows
        return rows.lookup(ids)

    def stats(self) -> dict:
        """The cache's counters, shaped like ``cacheflow replay --json``.

        After a `lookup`, ``"embedding"`` holds each table's row counters too.
        """
        stats = self.cache.stats()
        if self._rows:
            stats["embedding"] = {name: rows.stats() for name, rows in self._rows.items()}
        return stats

    def close(self) -> None:
        """Releases the device room of looked-up tables (`serving` calls it on exit)."""
        for rows in self._rows.values():
            rows.close()


@contextlib.contextmanager
def serving(
    cache: TieredCache,
    *,
    access_log: str | os.PathLike | None = None,
    embedding_bytes: int | None = None,
    promote_every: int = 16,
    row_half_life: float = 64.0,
    metrics_port: int | None = None,
) -> Iterator[ServingSession]:
    """Serves blocks from ``cache`` for the duration of a ``with`` block.

    On exit, even when the body raises, pending write-backs are finished (dirty runtime blocks
    reach L3) and the access log is flushed and closed. If the body raised, its exception is the
    one that propagates; an error while finishing is attached to it as a note. Otherwise the
    first such error is raised, and the counters of a session without lookups are checked: a
    warning is logged (logger ``cacheflow_jax``) where blocks were read again and again but L1
    served almost none of them (a streamed working set larger than L1), or where a prefetcher
    issued nothing (`cacheflow_jax.cache.advice`).

    Args:
      cache: the `TieredCache` to serve from.
      access_log: optional path of an access log v1 file (JSON Lines) to record every access
        (``lookup`` records the table's chunks it reads from L2/L3 through the cache's counters,
        not in the log).
      embedding_bytes: L1 bytes reserved for each looked-up table's hot rows (default: half of
        L1); taken from ``device_bytes``, so blocks and rows together stay within it.
      promote_every: lookups of a table between two promotion decisions.
      row_half_life: the half-life of the row counters, in lookups.
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
    session = ServingSession(cache, log, embedding_bytes=embedding_bytes,
                             promote_every=promote_every, row_half_life=row_half_life)
    session.metrics_url = metrics.url if metrics is not None else None
    session._metrics = metrics
    cache.start_prefetch()
    try:
        yield session
    except BaseException as body_error:
        for err in _finish(session, log):
            body_error.add_note(f"while leaving serving(): {type(err).__name__}: {err}")
        raise
    errors = _finish(session, log)
    # Lookups read their tables' chunks into L2 only, by design: a session with lookups is not
    # judged by its L1 hits.
    for text in [] if session._rows else session_advice(cache):
        logger.warning("serving(%s): %s", cache.store.spec, text)
    if errors:
        for err in errors[1:]:
            errors[0].add_note(f"also while leaving serving(): {type(err).__name__}: {err}")
        raise errors[0]


def _finish(session: ServingSession, log: AccessLogWriter | None) -> list[Exception]:
    """Releases the session's rows, flushes write-backs and closes the log, each always;
    returns their errors."""
    errors: list[Exception] = []
    try:
        session.cache.stop_prefetch()  # no prefetch thread outlives the session
        session.close()
    except Exception as err:
        errors.append(err)
    try:
        session.cache.flush()
    except Exception as err:
        errors.append(err)
    if log is not None:
        try:
            log.close()
        except Exception as err:
            errors.append(err)
    if session._metrics is not None:
        session._metrics.close()
    return errors
