"""Prometheus metrics for a `TieredCache`: its `stats()` counters in Prometheus text format.

Nothing is counted twice and nothing runs on the hit path: a scrape calls ``cache.stats()`` (one
short hold of the cache lock) and turns its dict into metric families, so the numbers a scrape
shows are exactly the ones ``stats()`` returns at that moment.

>>> import cacheflow_jax as cfj, numpy as np
>>> from cacheflow_jax import metrics
>>> store = cfj.write_store({"w": np.ones((4, 4), np.float32)}, "memory://doc-metrics/")
>>> cache = cfj.TieredCache(store, device_bytes=1 << 20, host_bytes=1 << 20)
>>> _ = cache.get("w@0,0")
>>> "cacheflow_misses_total 1.0" in metrics.text(cache)
True

Three ways to use it: ``serving(cache, metrics_port=9100)`` serves ``/metrics`` for the
duration of the session; `serve` does the same for any cache; `CacheCollector` plugs into a
``prometheus_client`` registry that an application already exposes.

The metrics (names and units as Prometheus's conventions ask: base units, ``_total`` for
counters, a label for the tier; every sample also carries ``cache="<name>"`` when a name is
given):

================================== ======= =======================================================
name                               type    what
================================== ======= =======================================================
cacheflow_requests_total           counter blocks asked for (``get``, each key of ``get_many``)
cacheflow_hits_total{tier}         counter requests served from ``device`` (L1) or ``host`` (L2)
cacheflow_misses_total             counter requests that went to L3
cacheflow_requested_bytes_total    counter bytes of the blocks asked for
cacheflow_served_bytes_total{tier} counter those bytes by where they came from: ``device``,
                                           ``host``, ``l3``
cacheflow_l3_reads_total           counter blocks read from L3
cacheflow_l3_read_bytes_total      counter bytes read from L3
cacheflow_l3_read_seconds_total    counter seconds from issuing each batch of L3 reads until
                                           its last read ended; ``rate(read_bytes) /
                                           rate(read_seconds)`` is L3's read bandwidth
cacheflow_writebacks_total         counter runtime blocks written back to L3
cacheflow_writeback_bytes_total    counter their bytes
cacheflow_prefetch_<event>_total   counter each count in ``stats()["prefetch"]`` (issued, used,
                                           timely, late, wasted, dropped, predictions;
                                           ``<event>_bytes_total`` for byte counts)
cacheflow_prefetch_<name>_ratio    gauge   each ratio there (accuracy, coverage)
cacheflow_prefetch_<name>_seconds  gauge   each time there (predict_us: the mean predict() time)
cacheflow_tier_used_bytes{tier}    gauge   bytes resident (and reserved) in the tier
cacheflow_tier_budget_bytes{tier}  gauge   the tier's budget
cacheflow_tier_blocks{tier}        gauge   blocks resident in the tier
================================== ======= =======================================================

Prefetch metrics follow ``stats()["prefetch"]`` whatever it holds, so a counter added there
appears here without a change to this module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CacheCollector", "MetricsServer", "registry", "serve", "text"]

NAMESPACE = "cacheflow"


class CacheCollector(Collector):
    """A ``prometheus_client`` collector that reads a cache's `stats()` at each scrape.

    Args:
      cache: the `TieredCache` (anything with a ``stats() -> dict`` in its shape).
      name: if given, every sample carries the label ``cache="<name>"`` (several caches in one
        process).

    An application with its own registry adds the cache with
    ``registry.register(CacheCollector(cache))``.
    """

    def __init__(self, cache: Any, *, name: str | None = None) -> None:
        self._stats: Callable[[], Mapping[str, Any]] = cache.stats
        self._labels = {} if name is None else {"cache": name}

    def describe(self) -> list[Metric]:
        """Nothing up front: the families depend on what `stats()` holds (no scrape at register)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The metric families of one `stats()` snapshot."""
        s = self._stats()
        base = list(self._labels)
        const = list(self._labels.values())

        def counter(name: str, doc: str, value: float, unit: str = "") -> Metric:
            family = CounterMetricFamily(f"{NAMESPACE}_{name}", doc, labels=base, unit=unit)
            family.add_metric(const, value)
            return family

        yield counter(
            "requests", "Blocks asked for (get, and each key of get_many).", s["requests"]
        )
        hits = CounterMetricFamily(
            f"{NAMESPACE}_hits", "Requests served from a tier (device: L1, host: L2).",
            labels=[*base, "tier"],
        )  # fmt: skip
        for tier, value in s["hits"].items():
            hits.add_metric([*const, tier], value)
        yield hits
        yield counter("misses", "Requests that went to L3.", s["misses"])
        nbytes = s.get("bytes")
        if nbytes is not None:
            yield counter(
                "requested_bytes", "Bytes of the blocks asked for.", nbytes["requested"], "bytes"
            )
            served = CounterMetricFamily(
                f"{NAMESPACE}_served_bytes",
                "Bytes of the blocks asked for, by where they were served from.",
                labels=[*base, "tier"],
                unit="bytes",
            )
            for tier, key in (("device", "device"), ("host", "host"), ("l3", "miss")):
                served.add_metric([*const, tier], nbytes[key])
            yield served
        l3 = s.get("l3")
        if l3 is not None:
            yield counter("l3_reads", "Blocks read from L3.", l3["reads"])
            yield counter("l3_read_bytes", "Bytes read from L3.", l3["read_bytes"], "bytes")
            yield counter(
                "l3_read_seconds",
                "Seconds from issuing each batch of L3 reads until its last read ended.",
                l3["read_seconds"],
                "seconds",
            )
        wb = s.get("writebacks")
        if wb is not None:
            yield counter("writebacks", "Runtime blocks written back to L3.", wb["count"])
            yield counter(
                "writeback_bytes", "Bytes of runtime blocks written back to L3.", wb["bytes"],
                "bytes",
            )  # fmt: skip
        yield from self._prefetch(s.get("prefetch") or {}, base, const)
        tiers = s.get("tiers") or {}
        for field, suffix, unit, doc in (
            ("used", "used", "bytes", "Bytes resident (and reserved for blocks on their way in)."),
            ("budget", "budget", "bytes", "The tier's byte budget."),
            ("blocks", "blocks", "", "Blocks resident in the tier."),
        ):
            family = GaugeMetricFamily(
                f"{NAMESPACE}_tier_{suffix}", doc, labels=[*base, "tier"], unit=unit
            )
            for tier, row in tiers.items():
                family.add_metric([*const, tier], row[field])
            yield family

    @staticmethod
    def _prefetch(pf: Mapping[str, Any], base: list[str], const: list[str]) -> Iterator[Metric]:
        """``stats()["prefetch"]``, whatever it holds.

        Integers are counts (counters; ``<name>_bytes`` in bytes). Floats named ``<name>_us``,
        ``<name>_ms`` or ``<name>_seconds`` are times (gauges in seconds); other floats are
        ratios (gauges ``<name>_ratio``). Flags and texts (``enabled``, ``disabled_reason``) are
        not numbers and are left out.
        """
        for name, value in pf.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            doc = f"Prefetch: {name.replace('_', ' ')} (stats()['prefetch'][{name!r}])"
            if isinstance(value, int):
                family: Metric = CounterMetricFamily(
                    f"{NAMESPACE}_prefetch_{name}", doc + ".", labels=base
                )
            elif name.endswith(tuple(_TIME_UNITS)):
                stem, unit = name.rsplit("_", 1)
                family = GaugeMetricFamily(
                    f"{NAMESPACE}_prefetch_{stem}_seconds", doc + ", in seconds.", labels=base
                )
                value = value * _TIME_UNITS["_" + unit]
            else:
                family = GaugeMetricFamily(
                    f"{NAMESPACE}_prefetch_{name}_ratio", doc + ", in [0, 1].", labels=base
                )
            family.add_metric(const, value)
            yield family


_TIME_UNITS = {"_us": 1e-6, "_ms": 1e-3, "_seconds": 1.0}


def registry(cache: Any, *, name: str | None = None) -> CollectorRegistry:
    """A new ``prometheus_client`` registry holding only the cache's metrics.

    Args:
      cache: the `TieredCache`.
      name: the ``cache`` label's value, if any.

    Returns:
      The registry (pass it to ``prometheus_client.generate_latest`` or a server).
    """
    reg = CollectorRegistry(auto_describe=False)
    reg.register(CacheCollector(cache, name=name))
    return reg


def text(cache: Any, *, name: str | None = None) -> str:
    """The cache's metrics now, in the Prometheus text exposition format.

    Args:
      cache: the `TieredCache`.
      name: the ``cache`` label's value, if any.

    Returns:
      The text a ``/metrics`` endpoint would serve.
    """
    return generate_latest(registry(cache, name=name)).decode("utf-8")


class MetricsServer:
    """A running HTTP endpoint that serves a cache's metrics at ``/metrics``; `close` stops it.

    Made by `serve`; also a context manager.
    """

    def __init__(self, server: Any, thread: threading.Thread, addr: str) -> None:
        self._server = server
        self._thread = thread
        self.addr = addr
        self.port: int = server.server_address[1]  # the OS's choice when asked for port 0

    @property
    def url(self) -> str:
        """The scrape URL, ``http://<addr>:<port>/metrics``."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stops serving and frees the port. Safe to call twice."""
        if self._thread is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._thread = None

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    cache: Any, *, port: int = 0, addr: str = "127.0.0.1", name: str | None = None
) -> MetricsServer:
    """Serves the cache's metrics at ``http://addr:port/metrics`` from a background thread.

    Args:
      cache: the `TieredCache`.
      port: the TCP port; 0 lets the OS choose a free one (see `MetricsServer.port`).
      addr: the address to listen on; loopback by default, ``"0.0.0.0"`` for every interface.
      name: the ``cache`` label's value, if any.

    Returns:
      The running `MetricsServer`.

    Raises:
      OSError: the port is taken or the address cannot be bound (the message names them).
      ValueError: ``port`` is not in 0..65535.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics_port={port!r} must be a TCP port in 0..65535 (0: any free one)")
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry(cache, name=name))
    except OSError as err:
        raise OSError(
            err.errno, f"cannot serve metrics on {addr}:{port}: {err.strerror or err}"
        ) from err
    return MetricsServer(server, thread, addr)
