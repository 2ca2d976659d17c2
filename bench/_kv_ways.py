"""The ways `bench.llm_serving` keeps KV blocks: cacheflow, the peers' schemes, and the limits.

Each way answers three calls of the engine: ``lookup(keys)`` (how many leading blocks it holds,
without reading them), ``load(keys)`` (the blocks, on the device), ``store(key, block)`` (a block
just computed); ``queued(keys)`` tells it a request arrived (cacheflow starts bringing its blocks
up), ``end_step()`` that an engine iteration ends and ``idle(seconds)`` that the engine has
nothing to run until the next arrival (cacheflow's background work gets that time). Blocks are
pytrees ``{"k": [L, T, kv], "v": [L, T, kv]}`` of device arrays.

| way | what it is | budgets |
|---|---|---|
| `recompute` | no cache: every block is computed (the baseline) | - |
| `device-lru` | a device-memory prefix cache with LRU eviction, what vLLM's automatic prefix caching does | L1 |
| `host-lru` | device LRU over a host-memory LRU (blocks evicted from the device go to host memory, a hit there is copied back), what LMCache's CPU backend adds to vLLM | L1 + L2 |
| `cacheflow` | `TieredCache` (its default policy) with L3 on local disk; a queued request's blocks that only L3 holds are read into L2 while it waits (`TieredCache.prefetch`); a step's computed blocks are stored in one `put_many(wait=False)` at its end, installed while the next step runs | L1 + L2 + L3 |
| `all-resident` | every block ever computed stays on the device (the limit) | unbounded |
"""

from __future__ import annotations

import collections
import contextlib
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np


def block_bytes(block: dict[str, Any]) -> int:
    return int(block["k"].nbytes + block["v"].nbytes)


class Way:
    """A way with no cache (`recompute`); the others override the calls."""

    name = "recompute"

    def __init__(self) -> None:
        self.hits = collections.Counter()  # blocks served by tier, at load time
        self.put_seconds: list[float] = []
        self.device_put_seconds: list[float] = []  # a put's yardstick (cacheflow measures it)
        self.harness_seconds = 0.0  # spent measuring yardsticks: not the engine's time

    def take_harness_seconds(self) -> float:
        """The seconds spent measuring since the last call (the engine's clock leaves them out)."""
        seconds, self.harness_seconds = self.harness_seconds, 0.0
        return seconds

    def lookup(self, keys: list[str]) -> int:
        return 0

    def load(self, keys: list[str]) -> list[dict[str, Any]]:
        return []

    def store(self, key: str, block: dict[str, Any]) -> None:
        pass

    def queued(self, keys: list[str]) -> None:
        pass

    def end_step(self) -> None:
        """The engine's iteration ends (a way that stores a step's blocks at once does it here)."""

    def idle(self, seconds: float) -> None:
        """The engine has nothing to run for ``seconds`` of its clock, which jumps over them: a
        way with background work may take up to that much real time to get on with it, as its
        threads would in a real server's idle gap (a way without any returns at once)."""

    def ready(self, keys: list[str]) -> bool:
        """Whether a queued request's blocks are where its start can load them without waiting
        on a read already under way (vLLM's scheduler skips a request whose KV a connector is
        still loading: ``WAITING_FOR_REMOTE_KVS``)."""
        return True

    def settle(self) -> None:
        """After the warm-up: finish background work before the measured requests."""

    def stats(self) -> dict[str, Any]:
        return {"hits": dict(self.hits)}

    def close(self) -> None:
        pass


class AllResident(Way):
    """Every block stays on the device."""

    name = "all-resident"

    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict[str, dict[str, Any]] = {}

    def lookup(self, keys: list[str]) -> int:
        n = 0
        for key in keys:
            if key not in self.blocks:
                break
            n += 1
        return n

    def load(self, keys: list[str]) -> list[dict[str, Any]]:
        self.hits["device"] += len(keys)
        return [self.blocks[k] for k in keys]

    def store(self, key: str, block: dict[str, Any]) -> None:
        start = time.perf_counter()
        self.blocks[key] = block
        self.put_seconds.append(time.perf_counter() - start)


class _Lru:
    """A byte-budgeted LRU map."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.items: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def put(self, key: str, value: Any, nbytes: int) -> list[tuple[str, Any, int]]:
        """Inserts ``key``; returns the entries evicted for it (oldest first)."""
        out = []
        while self.items and self.used + nbytes > self.budget:
            old, (v, n) = self.items.popitem(last=False)
            self.used -= n
            out.append((old, v, n))
        if nbytes <= self.budget:
            self.items[key] = (value, nbytes)
            self.used += nbytes
        return out

    def pop(self, key: str) -> Any:
        value, nbytes = self.items.pop(key)
        self.used -= nbytes
        return value


class DeviceLru(Way):
    """vLLM's prefix cache: device blocks, LRU, evicted blocks are dropped."""

    name = "device-lru"

    def __init__(self, device_bytes: int) -> None:
        super().__init__()
        self.l1 = _Lru(device_bytes)

    def lookup(self, keys: list[str]) -> int:
        n = 0
        for key in keys:
            if key not in self.l1.items:
                break
            n += 1
        return n

    def load(self, keys: list[str]) -> list[dict[str, Any]]:
        self.hits["device"] += len(keys)
        out = []
        for key in keys:
            self.l1.items.move_to_end(key)
            out.append(self.l1.items[key][0])
        return out

    def store(self, key: str, block: dict[str, Any]) -> None:
        start = time.perf_counter()
        self.l1.put(key, block, block_bytes(block))
        self.put_seconds.append(time.perf_counter() - start)


class HostLru(DeviceLru):
    """LMCache's CPU backend under vLLM: device LRU, its evictions kept in a host LRU."""

    name = "host-lru"

    def __init__(self, device_bytes: int, host_bytes: int) -> None:
        super().__init__(device_bytes)
        self.l2 = _Lru(host_bytes)

    def lookup(self, keys: list[str]) -> int:
        n = 0
        for key in keys:
            if key not in self.l1.items and key not in self.l2.items:
                break
            n += 1
        return n

    def load(self, keys: list[str]) -> list[dict[str, Any]]:
        out = []
        for key in keys:
            if key in self.l1.items:
                self.hits["device"] += 1
                self.l1.items.move_to_end(key)
                out.append(self.l1.items[key][0])
                continue
            self.hits["host"] += 1
            host = self.l2.pop(key)
            block = jax.tree.map(jax.device_put, host)
            self._to_l1(key, block)
            out.append(block)
        return out

    def store(self, key: str, block: dict[str, Any]) -> None:
        start = time.perf_counter()
        self._to_l1(key, block)
        self.put_seconds.append(time.perf_counter() - start)

    def _to_l1(self, key: str, block: dict[str, Any]) -> None:
        for old, value, nbytes in self.l1.put(key, block, block_bytes(block)):
            self.l2.put(old, jax.tree.map(np.asarray, jax.device_get(value)), nbytes)


class Cacheflow(Way):
    """`TieredCache` over a local zarr3 store, with the queued requests' blocks brought up."""

    name = "cacheflow"

    def __init__(self, device_bytes: int, host_bytes: int, root: Path, *,
                 prefetch: bool = True, block_bytes: int | None = None,
                 host_memory: str = "auto") -> None:  # fmt: skip
        import cacheflow_jax as cfj

        super().__init__()
        self.cache = cfj.TieredCache(cfj.open_store(root, create=True), device_bytes=device_bytes,
                                     host_bytes=host_bytes, block_bytes=block_bytes,
                                     host_memory=host_memory)  # fmt: skip
        self.prefetch = prefetch
        self.device = jax.devices()[0]
        self._ahead: list[Any] = []
        # Stagings not yet seen done, in issue order (sequence number, future); a queued
        # request (by the id of its keys) waits for those issued up to its arrival: a block of
        # its prefix may be on its way up in another request's staging.
        self._pending: collections.deque[tuple[int, Any]] = collections.deque()
        self._issued = 0
        self._needs: dict[int, int] = {}
        self._step_blocks: list[tuple[str, dict[str, Any]]] = []  # stored at the step's end
        self._stored = 0

    def lookup(self, keys: list[str]) -> int:
        self.end_step()  # the blocks computed so far are found, as all-resident finds them
        return self.cache.cached_prefix(keys)

    def load(self, keys: list[str]) -> list[dict[str, Any]]:
        return self.cache.get_many(keys)  # the cache counts where each block came from

    def store(self, key: str, block: dict[str, Any]) -> None:
        # Stored with the step's other blocks in one `put_many` (`end_step`), as vLLM's KV
        # connector saves a step's KV at its end; a lookup before then stores them first.
        self._step_blocks.append((key, block))
        self._stored += 1
        if self._stored % 4 == 0:
            # The yardstick, in the same run and under the same write-back load: a
            # jax.device_put of the same block (from a host copy made outside the timing).
            begin = time.perf_counter()
            host = jax.tree.map(np.array, block)
            start = time.perf_counter()
            jax.block_until_ready(jax.device_put(host, self.device))
            end = time.perf_counter()
            self.device_put_seconds.append(end - start)
            self.harness_seconds += end - begin

    def end_step(self) -> None:
        blocks = self._step_blocks
        if not blocks:
            return
        start = time.perf_counter()
        # Installed on the cache's put thread while the next step runs, as vLLM's KV
        # connectors save a step's KV: the blocks are counted by lookups at once, and a load
        # of one waits for it (`put_many(wait=False)`).
        self.cache.put_many(blocks, wait=False)
        # Each block's share of the call (the put yardstick compares it with a device_put).
        self.put_seconds += [(time.perf_counter() - start) / len(blocks)] * len(blocks)
        self._step_blocks = []

    def idle(self, seconds: float) -> None:
        # The write-backs and stagings in flight get the gap, no more: what is left of them
        # runs on into the engine's next iterations, as it would in real time.
        deadline = time.perf_counter() + seconds
        for future in self._ahead:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                future.result(timeout=left)
        left = deadline - time.perf_counter()
        if left > 0:
            with contextlib.suppress(TimeoutError):
                self.cache.wait_until_finished(timeout=left)

    def queued(self, keys: list[str]) -> None:
        self.end_step()
        if not self.prefetch:
            return
        n = self.cache.cached_prefix(keys)
        if n:
            # The queued request's blocks that only L3 holds come up to L2 while it waits (as
            # SGLang's HiCache does); L1 stays with the running requests' blocks.
            self._ahead = [f for f in self._ahead if not f.done()]
            future = self.cache.prefetch(keys[:n])
            self._ahead.append(future)
            self._issued += 1
            self._pending.append((self._issued, future))
            self._needs[id(keys)] = self._issued

    def ready(self, keys: list[str]) -> bool:
        need = self._needs.get(id(keys))
        if need is None:
            return True
        pending = self._pending
        while pending and pending[0][1].done():
            pending.popleft()
        if pending and pending[0][0] <= need:
            return False
        del self._needs[id(keys)]
        return True

    def settle(self) -> None:
        self.end_step()
        for future in self._ahead:
            future.result()
        self._ahead = []
        self._pending.clear()
        self._needs.clear()
        self.cache.flush()
        self.cache.reset_counters()

    def stats(self) -> dict[str, Any]:
        s = self.cache.stats()
        # Counted by the cache since `settle`: a block that was on its way up (a prefetch still
        # reading it) counts where it was read from.
        hits = {"device": s["hits"]["device"], "host": s["hits"]["host"], "store": s["misses"]}
        return {"hits": hits, "writebacks": s["writebacks"],
                "cache_hits": s["hits"], "cache_misses": s["misses"]}  # fmt: skip

    def close(self) -> None:
        self.end_step()
        for future in self._ahead:
            future.result()
        self.cache.flush()
