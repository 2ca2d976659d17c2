"""Prometheus metrics: a real HTTP endpoint scraped during a serving loop agrees with stats()."""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import cacheflow_jax as cfj
from cacheflow_jax import metrics

BLOCK = 1024  # bytes per block: 256 float32


def _store(tmp_path: Path):
    rng = np.random.default_rng(0)
    data = rng.standard_normal((32, 256)).astype(np.float32)
    return cfj.write_store({"w": data}, tmp_path / "store", chunk_bytes=BLOCK)


def _scrape(url: str) -> dict[str, float]:
    """``{sample name + labels: value}`` from a real HTTP GET of ``url``."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        body = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def _expected(stats: dict) -> dict[str, float]:
    """What the endpoint must show for one stats() snapshot."""
    out = {
        "cacheflow_requests_total{}": stats["requests"],
        "cacheflow_hits_total{tier=device}": stats["hits"]["device"],
        "cacheflow_hits_total{tier=host}": stats["hits"]["host"],
        "cacheflow_misses_total{}": stats["misses"],
        "cacheflow_requested_bytes_total{}": stats["bytes"]["requested"],
        "cacheflow_served_bytes_total{tier=device}": stats["bytes"]["device"],
        "cacheflow_served_bytes_total{tier=host}": stats["bytes"]["host"],
        "cacheflow_served_bytes_total{tier=l3}": stats["bytes"]["miss"],
        "cacheflow_l3_reads_total{}": stats["l3"]["reads"],
        "cacheflow_l3_read_bytes_total{}": stats["l3"]["read_bytes"],
        "cacheflow_l3_read_seconds_total{}": stats["l3"]["read_seconds"],
        "cacheflow_writebacks_total{}": stats["writebacks"]["count"],
        "cacheflow_writeback_bytes_total{}": stats["writebacks"]["bytes"],
        "cacheflow_prefetch_issued_total{}": stats["prefetch"]["issued"],
        "cacheflow_prefetch_used_total{}": stats["prefetch"]["used"],
        "cacheflow_prefetch_accuracy_ratio{}": stats["prefetch"]["accuracy"],
    }
    for tier, row in stats["tiers"].items():
        out[f"cacheflow_tier_used_bytes{{tier={tier}}}"] = row["used"]
        out[f"cacheflow_tier_budget_bytes{{tier={tier}}}"] = row["budget"]
        out[f"cacheflow_tier_blocks{{tier={tier}}}"] = row["blocks"]
    return out


def test_scrape_during_a_serving_loop_matches_stats(tmp_path: Path) -> None:
    store = _store(tmp_path)
    cache = cfj.TieredCache(store, device_bytes=6 * BLOCK, host_bytes=6 * BLOCK, policy="lru")
    stop = threading.Event()
    errors: list[BaseException] = []
    with cfj.serving(cache, metrics_port=0) as s:
        url = s.metrics_url
        assert url is not None and re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)

        def loop() -> None:
            rng = np.random.default_rng(1)
            try:
                step = 0
                while not stop.is_set():
                    s.get(f"w@{int(rng.zipf(1.3)) % 32},0")
                    if step % 10 == 0:  # runtime blocks: more than L1 + L2 hold, so some leave
                        s.put(f"kv:{step % 40}", np.full(256, step, np.float32))
                    step += 1
            except BaseException as e:  # surfaced by the main thread
                errors.append(e)

        worker = threading.Thread(target=loop)
        worker.start()
        try:
            seen = []
            for _ in range(5):  # scrapes while the loop runs: each is one consistent snapshot
                got = _scrape(url)
                assert got["cacheflow_requests_total{}"] == (
                    got["cacheflow_hits_total{tier=device}"]
                    + got["cacheflow_hits_total{tier=host}"]
                    + got["cacheflow_misses_total{}"]
                )
                assert got["cacheflow_tier_used_bytes{tier=device}"] <= 6 * BLOCK
                seen.append(got["cacheflow_requests_total{}"])
                threading.Event().wait(0.05)
            assert seen == sorted(seen) and seen[-1] > 0  # counters only grow
        finally:
            stop.set()
            worker.join(timeout=60)
        assert not errors, errors
        cache.flush()  # writes every dirty runtime block back: write-backs to count
        stats = s.stats()
        got = _scrape(url)
        expected = _expected(stats)
        assert {k: got.get(k) for k in expected} == pytest.approx(expected)
        assert stats["misses"] > 0 and stats["hits"]["device"] > 0
        assert stats["writebacks"]["count"] > 0
        assert stats["writebacks"]["bytes"] == stats["writebacks"]["count"] * BLOCK
        assert stats["l3"]["read_seconds"] > 0
        assert stats["l3"]["read_bytes"] == stats["l3"]["reads"] * BLOCK
    with pytest.raises(urllib.error.URLError):  # the endpoint closed with the session
        urllib.request.urlopen(url, timeout=5)


def test_names_follow_prometheus_conventions(tmp_path: Path) -> None:
    cache = cfj.TieredCache(_store(tmp_path), device_bytes=4 * BLOCK, host_bytes=0)
    cache.get("w@0,0")
    body = metrics.text(cache, name="weights")
    families = list(text_string_to_metric_families(body))
    assert families
    for family in families:
        assert re.fullmatch(r"cacheflow_[a-z0-9_]+", family.name), family.name
        assert family.documentation
        for sample in family.samples:
            assert sample.labels.get("cache") == "weights"
            if family.type == "counter":
                assert sample.name == family.name + "_total"
            if "bytes" in family.name:
                assert family.name.endswith("_bytes") or "_bytes_" in family.name
    types = {f.name: f.type for f in families}
    assert types["cacheflow_l3_read_seconds"] == "counter"
    assert types["cacheflow_tier_used_bytes"] == "gauge"


def test_prefetch_counters_follow_stats_whatever_they_hold(tmp_path: Path) -> None:
    cache = cfj.TieredCache(_store(tmp_path), device_bytes=4 * BLOCK, host_bytes=0)

    class WithMorePrefetch:
        """The cache's real stats(), with prefetch counters a later version adds."""

        def stats(self) -> dict:
            s = cache.stats()
            s["prefetch"].update(
                late=3, wasted=2, late_bytes=3 * BLOCK, timely=1, predict_us=250.0,
                enabled=True, disabled_reason=None,
            )  # fmt: skip
            return s

    body = metrics.text(WithMorePrefetch())
    got = {
        sample.name: sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }
    assert got["cacheflow_prefetch_late_total"] == 3
    assert got["cacheflow_prefetch_wasted_total"] == 2
    assert got["cacheflow_prefetch_timely_total"] == 1
    assert got["cacheflow_prefetch_late_bytes_total"] == 3 * BLOCK
    assert "cacheflow_prefetch_coverage_ratio" in got
    assert got["cacheflow_prefetch_predict_seconds"] == pytest.approx(250e-6)
    assert not any("enabled" in name or "reason" in name for name in got)


def test_serve_rejects_a_bad_port_and_a_taken_one(tmp_path: Path) -> None:
    cache = cfj.TieredCache(_store(tmp_path), device_bytes=4 * BLOCK, host_bytes=0)
    with pytest.raises(ValueError, match="metrics_port=70000"):
        metrics.serve(cache, port=70000)
    with metrics.serve(cache) as server:
        assert _scrape(server.url)["cacheflow_requests_total{}"] == 0
        with pytest.raises(OSError, match=f"127.0.0.1:{server.port}"):
            metrics.serve(cache, port=server.port)
