"""`TieredCache.prefetch`: a queued request's blocks read from L3 into L2 ahead of its gets."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cacheflow_jax as cfj

KIB = 1 << 10


def _kv(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {"k": rng.standard_normal((2, 16, 8)).astype(np.float32),
            "v": rng.standard_normal((2, 16, 8)).astype(np.float32)}  # fmt: skip


def _written(root: Path, n: int) -> None:
    """``n`` durable blocks ``kv:i`` (2 KiB each) in a store at ``root``."""
    with cfj.TieredCache(cfj.open_store(root, create=True), device_bytes=8 * KIB,
                         host_bytes=0) as cache:  # fmt: skip
        for i in range(n):
            cache.put(f"kv:{i}", _kv(i))


def _reopened(root: Path, **kw: Any) -> cfj.TieredCache:
    kw.setdefault("device_bytes", 8 * KIB)
    kw.setdefault("host_bytes", 32 * KIB)
    return cfj.TieredCache(cfj.open_store(root), **kw)


def test_prefetch_reads_l3_blocks_into_l2_only(tmp_path: Path) -> None:
    _written(tmp_path / "s", 12)
    cache = _reopened(tmp_path / "s")
    cache.get("kv:0")  # in L1 before: left where it is
    keys = [f"kv:{i}" for i in range(6)] + ["no-such-block"]
    assert cache.prefetch(keys).result(timeout=30) == 5
    assert [cache.locate(f"kv:{i}") for i in range(7)] == (
        ["device"] + ["host"] * 5 + ["store"]
    )
    assert cache.stats()["prefetch"]["staged"] == 5
    assert cache.stats()["requests"] == 1  # staging is not an access
    misses = cache.stats()["misses"]
    for i in range(1, 6):
        got = cache.get(f"kv:{i}")
        assert all(np.asarray(got[n]).tobytes() == _kv(i)[n].tobytes() for n in ("k", "v"))
    stats = cache.stats()
    assert stats["misses"] == misses and stats["hits"]["host"] == 5
    cache.check_budgets()


def test_prefetch_of_blocks_already_up_starts_no_job(tmp_path: Path, monkeypatch) -> None:
    """Every key resident (a queued request whose prefix L1 and L2 hold): the future is done at
    once with 0 and no staging job runs; one L3-only key among them starts the job."""
    from cacheflow_jax.cache.staging import Staging

    _written(tmp_path / "s", 6)
    cache = _reopened(tmp_path / "s")
    cache.get_many(["kv:0", "kv:1"])
    ran = []
    stage = Staging.stage
    monkeypatch.setattr(Staging, "stage", lambda self, keys: ran.append(keys) or stage(self, keys))
    future = cache.prefetch(["kv:0", "kv:1"])
    assert future.done() and future.result() == 0 and ran == []
    assert cache.prefetch(["kv:0", "kv:1", "kv:2"]).result(timeout=30) == 1
    assert ran == [["kv:0", "kv:1", "kv:2"]] and cache.locate("kv:2") == "host"


def test_prefetch_with_no_l2_does_nothing(tmp_path: Path) -> None:
    _written(tmp_path / "s", 3)
    cache = _reopened(tmp_path / "s", host_bytes=0)
    assert cache.prefetch(["kv:0", "kv:1"]).result(timeout=30) == 0
    assert cache.locate("kv:0") == "store"


def test_prefetch_keeps_l2_within_its_budget(tmp_path: Path) -> None:
    _written(tmp_path / "s", 40)
    cache = _reopened(tmp_path / "s", host_bytes=10 * KIB)  # five blocks
    staged = cache.prefetch([f"kv:{i}" for i in range(40)]).result(timeout=30)
    assert 0 < staged <= 40
    assert cache.stats()["tiers"]["host"]["blocks"] <= 5
    cache.check_budgets()


def test_gets_during_prefetch_get_the_right_bytes(tmp_path: Path) -> None:
    _written(tmp_path / "s", 30)
    cache = _reopened(tmp_path / "s", device_bytes=8 * KIB, host_bytes=16 * KIB)
    keys = [f"kv:{i}" for i in range(30)]
    wrong: list[str] = []

    def reader() -> None:
        for key in keys[::-1]:
            got = cache.get(key)
            want = _kv(int(key.split(":")[1]))
            if np.asarray(got["k"]).tobytes() != want["k"].tobytes():
                wrong.append(key)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    futures = [cache.prefetch(keys) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for f in futures:
        f.result(timeout=60)
    assert not wrong
    cache.check_budgets()


def test_a_block_that_fails_its_read_is_not_staged_and_its_get_raises(tmp_path: Path) -> None:
    _written(tmp_path / "s", 3)
    files = sorted(p for p in (tmp_path / "s").rglob("*") if p.is_file() and "kv%3A1" in p.name)
    assert files, "the runtime block's file was not found"
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the payload
    files[0].write_bytes(bytes(data))
    os.sync()
    cache = _reopened(tmp_path / "s")
    assert cache.prefetch(["kv:0", "kv:1", "kv:2"]).result(timeout=30) == 2
    assert cache.locate("kv:1") == "store"
    with pytest.raises(cfj.CorruptBlockError):
        cache.get("kv:1")
