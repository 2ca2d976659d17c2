"""`TieredCache`: blocks in device memory (L1), host memory (L2) and a TensorStore store (L3).

A facade, as Caffeine's `BoundedLocalCache` or orbax's `Checkpointer` is: each method says
which helper does the work.

* `cacheflow_jax.cache.mover.Mover`: the lock, the tiers, blocks in transit, room and expiry
  (its design note is the cache's);
* `cacheflow_jax.cache.demand.Demand`: gets that miss L1, batched gets, host reads;
* `cacheflow_jax.cache.runtime.RuntimeBlocks`: puts, evictions, lookups and pins;
* `cacheflow_jax.cache.staging.Staging`: L3 -> L2 reads ahead of a queued request;
* `cacheflow_jax.cache.writeback.WriteBack`: runtime blocks not yet durable and their writes;
* `cacheflow_jax.cache.prefetch_driver.PrefetchDriver`: a predictor's loads;
* `cacheflow_jax.cache.replay_moves.SyncMoves`: replay's moves, without data;
* `cacheflow_jax.cache.counters.Counters`: what `stats()` reports;
* `cacheflow_jax.cache.assembly`: how these are built from a `CacheConfig`.

The hit path is the one thing done here: a dict lookup plus an append to a read buffer, with no
lock, no I/O and no logging.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from cacheflow_jax.cache.assembly import assemble, tensorstore_store
from cacheflow_jax.cache.config import CacheConfig
from cacheflow_jax.cache.counters import stats_of
from cacheflow_jax.cache.mover import DEVICE
from cacheflow_jax.cache.runtime import KINDS
from cacheflow_jax.core.blocks import DEFAULT_TIMEOUT, BlockInfo, Store
from cacheflow_jax.planning.planner import Planner
from cacheflow_jax.policies import Policy
from cacheflow_jax.prefetch.scheduler import PrefetchSettings
from cacheflow_jax.tiers.memory import AbstractTier

if TYPE_CHECKING:
    import jax
    import numpy as np

    from predictor import Predictor

__all__ = ["KINDS", "TieredCache", "kind_of"]


def kind_of(info: BlockInfo) -> str:
    """The access-log kind of a block: runtime blocks are ``kv``, embeddings by name, else weight."""
    if info.runtime:
        return "kv"
    return "embedding" if "embed" in info.array.lower() else "weight"


class TieredCache:
    """A byte-budgeted cache of blocks over an L3 `Store`, with L1 on a JAX device and L2 on host.

    Args:
      store: the L3 store (see `cacheflow_jax.open_store`).
      tiers: advanced: replace the L1/L2 tier objects (replay uses metadata-only tiers).
      device_bytes, host_bytes, ...: the settings, each documented in `CacheConfig` (kept as
        ``cache.config``): ``device_bytes`` and ``host_bytes`` (the budgets), ``policy``,
        ``prefetcher`` and ``prefetch``, ``clock``, ``device``, ``read_buffer``,
        ``l3_timeout``, ``writeback_bytes``, ``device_layout``, ``line_bytes``,
        ``block_bytes``, ``host_memory``.

    Raises:
      BudgetError: a budget is negative, not an integer, or too small for the store's blocks.
      ValueError: an unknown ``device_layout`` or ``host_memory``, or ``l3_timeout`` not a
        positive number.

    >>> import cacheflow_jax as cfj, numpy as np
    >>> store = cfj.write_store({"w": np.arange(8.0)}, "memory://doc-cache/", chunk_bytes=32)
    >>> cache = cfj.TieredCache(store, device_bytes=64, host_bytes=64)
    >>> cache.get("w@1").tolist()
    [4.0, 5.0, 6.0, 7.0]
    """

    def __init__(
        self,
        store: Store,
        *,
        device_bytes: int,
        host_bytes: int,
        policy: str | Policy = "lfu",
        prefetcher: Predictor | str | os.PathLike | None = None,
        prefetch: PrefetchSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        device: jax.Device | None = None,
        tiers: Sequence[AbstractTier] | None = None,
        read_buffer: int = 64,
        l3_timeout: float | None = DEFAULT_TIMEOUT,
        writeback_bytes: int | None = None,
        device_layout: str = "arrays",
        line_bytes: int | None = None,
        block_bytes: int | None = None,
        host_memory: str = "auto",
    ) -> None:
        self.config = CacheConfig(
            device_bytes=device_bytes, host_bytes=host_bytes, policy=policy,
            prefetcher=prefetcher, prefetch=prefetch, clock=clock, device=device,
            read_buffer=read_buffer, l3_timeout=l3_timeout, writeback_bytes=writeback_bytes,
            device_layout=device_layout, line_bytes=line_bytes, block_bytes=block_bytes,
            host_memory=host_memory,
        )  # fmt: skip
        parts = assemble(store, self.config, tiers, self._describe)
        self.store, self.policy, self.prefetcher = parts.store, parts.policy, parts.prefetcher
        self._counters, self._wb, self._mover = parts.counters, parts.writeback, parts.mover
        self._demand, self._runtime, self._staging = parts.demand, parts.runtime, parts.staging
        self._driver, self._sync = parts.driver, parts.sync
        # The hit path's names, and whether gets go through the prefetch driver.
        mover = parts.mover
        self._l1, self._reads, self._read_buffer = mover.l1, mover.reads, mover.read_buffer
        self._hooked = False
        self.start_prefetch()

    # ------------------------------------------------------------------------------ hit path

    def get(self, key: str, req: str | None = None) -> jax.Array:
        """Returns the block ``key`` as a device array, loading it through L2/L3 on a miss.

        ``req`` (a request id) is for the access log of a `serving` session; the cache ignores it.

        Raises:
          KeyError: no block ``key`` in the store or among runtime blocks.
          CorruptBlockError: the stored chunk failed its checksum.
        """
        if self._hooked:
            return self._driver.get(key)
        value = self._l1.get(key)
        if value is not None:
            reads = self._reads
            reads.append(key)
            if len(reads) >= self._read_buffer:
                self._mover.apply_hits()
            return value
        return self._demand.get_slow(key)

    def get_many(self, keys: Iterable[str], req: str | None = None) -> list[jax.Array]:
        """Returns several blocks; all the L3 reads among them are issued at once. The policy
        sees the L1 hits, then the L3 blocks, then the rest in order (`Demand.get_many`).

        Raises:
          KeyError: a key names no block (before anything moves).
          DtypeError: JAX would narrow a block's dtype on the device (before anything moves).
        """
        if self._hooked:
            return self._driver.get_many(keys)
        return self._demand.get_many(keys)

    def get_host_many(self, keys: Iterable[str]) -> list[np.ndarray]:
        """Returns blocks as host arrays, promoting nothing to L1 (for `serving`'s ``lookup``,
        which keeps its own device copy of hot rows); L3 blocks go to L2 if admitted.

        Raises:
          KeyError: no block for one of ``keys`` (before anything is read).
        """
        return self._demand.get_host_many(keys)

    def get_found(self, keys: Iterable[str]) -> tuple[dict[str, jax.Array], list[str]]:
        """`get_many` of the blocks that exist: ``(blocks, missing)``, a dict of the found keys'
        blocks (in order) and the keys with no block anywhere, instead of a `KeyError`.

        Raises:
          StoreError: as `get_many`.
        """
        keys = list(dict.fromkeys(keys))
        where = {k: self.locate(k) for k in keys}
        found = [k for k in keys if where[k] is not None]
        missing = [k for k in keys if where[k] is None]
        return dict(zip(found, self.get_many(found))), missing

    def get_many_async(self, keys: Iterable[str]) -> Future:
        """Starts `get_many` on a background thread; returns its `concurrent.futures.Future`."""
        from cacheflow_jax.store.futures import thread_pool

        return thread_pool("get", 4).submit(self.get_many, list(keys))

    def prefetch(self, keys: Iterable[str]) -> Future:
        """Starts reading the blocks of ``keys`` that only L3 holds into L2, in the background
        (a queued request's blocks: `cacheflow_jax.cache.staging`); a `Future` of how many
        went in. Nothing goes into L1; resident, moving and unknown keys are skipped, and when
        every key is resident or moving as it is called, no job starts (the future is done, 0)."""
        from cacheflow_jax.store.futures import thread_pool

        keys = list(keys)
        if not self._staging.has_work(keys):
            done: Future = Future()
            done.set_result(0)
            return done
        # One thread: stagings are Python (decode, installs under the lock), and a second
        # thread's only gain is the interpreter, taken from the serving thread (a get_many of
        # resident blocks beside stagings: 24-26 us a block with one, 25-33 with two).
        return thread_pool("stage", 1).submit(self._staging.stage, keys)

    # ------------------------------------------------------------------------- runtime blocks

    def put(self, key: str, value: Any, *, kind: str = "kv", writeback: bool = True) -> None:
        """Stores a runtime block (an array, or a pytree of arrays such as per-layer K and V) in
        L1; it returns once the block is there and counted (docs/kv_cache.md).

        The block is written back to L3 in the background when it leaves the cache and on
        `flush`; a put waits only while ``writeback_bytes`` is full (a stall in ``stats()``).
        Everything is checked first: a refused put changes nothing.

        Args:
          key: the block's key (no ``@``).
          value: the block; `get` returns the same structure, bitwise, from every tier.
          kind: its access-log kind.
          writeback: False for a block that need not be durable: dropped, not written, when it
            leaves (ignored when L3 holds an earlier version: L3 never serves older bytes).

        Raises:
          TypeError: a key that is not a str, a value that is not numeric arrays, or a pytree
            with ``device_layout="slab"``.
          ValueError: a key that cannot name a runtime block, an unknown ``kind``, or a pinned key.
          DtypeError: JAX would narrow the dtype (64-bit with ``jax_enable_x64`` off).
          BudgetError: larger than ``device_bytes``, ``writeback_bytes`` or the unpinned room.
          StoreError: the write-back budget stayed full for ``l3_timeout`` (L3 is failing).
        """
        self._runtime.put(key, value, kind=kind, writeback=writeback)

    def put_many(self, items: Iterable[tuple[str, Any]] | Mapping[str, Any], *, kind: str = "kv",
                 writeback: bool = True, wait: bool = True) -> Future | None:  # fmt: skip
        """`put` of each block in order, as an engine stores the KV blocks of one step: the
        same decisions and the same result. Where L1's victims move down without copies (JAX's
        CPU backend), the blocks that need no wait go in under one hold of the cache's lock
        (docs/kv_cache.md).

        With ``wait=False`` the call returns once every block is checked and claimed, and
        their installs (room in L1, victims moved down) run in order on a background thread,
        as a serving engine's KV connector saves a step's KV while the next step runs. From
        the return on, `cached_prefix` counts the blocks and a `get` of one waits for it if
        it is not in yet; no older value of a key is served. ``flush`` and ``close`` wait for
        the installs first.

        Args:
          items: ``(key, block)`` pairs, or a dict of blocks by key.
          kind, writeback: as for `put`, for every block.
          wait: False to return before the blocks are installed (see above).

        Returns:
          None, or with ``wait=False`` a `concurrent.futures.Future` of the installs: its
          ``result()`` raises the first error of a block that could not go in (the readers
          waiting for that block get it too; as after a failed `put`, a block that must be
          durable is kept for its write-back).

        Raises:
          TypeError, ValueError, DtypeError, BudgetError, StoreError: as `put`. Every block
            is checked before any goes in; an error past the checks (the pinned blocks leave no
            room, L3 keeps failing) leaves the blocks before it put.
        """
        if not wait:
            return self._runtime.put_many_later(items, kind=kind, writeback=writeback)
        self._runtime.put_many(items, kind=kind, writeback=writeback)
        return None

    def evict(self, key: str) -> bool:
        """Evicts ``key`` from L1 and L2 (writing a runtime block back); returns if it was there.

        Raises:
          ValueError: ``key`` is pinned.
        """
        return self._runtime.evict(key)

    @contextlib.contextmanager
    def pinned(self, keys: Iterable[str]) -> Iterator[list[jax.Array]]:
        """Loads ``keys`` into L1 and keeps them there until the ``with`` block ends.

        For the KV blocks a running request still reads: a pinned block is never evicted or
        expired, and a put that would need its room is refused (`BudgetError`, naming the
        pinned bytes). Pins nest; each key is released once per ``pinned`` that took it.

        >>> import cacheflow_jax as cfj, numpy as np
        >>> cache = cfj.TieredCache(cfj.open_store("memory://doc-pins/", create=True),
        ...                         device_bytes=1 << 10, host_bytes=0)
        >>> cache.put("kv:a", np.ones(4, np.float32))
        >>> with cache.pinned(["kv:a"]) as (a,):
        ...     float(a.sum()), cache.stats()["tiers"]["device"]["pinned_bytes"]
        (4.0, 16)

        Raises:
          KeyError: a key names no block.
          BudgetError: the blocks cannot all stay in L1 beside the blocks pinned already.
        """
        keys = list(keys)
        values = self._runtime.pin(keys)
        try:
            yield values
        finally:
            self._runtime.unpin(keys)

    # ------------------------------------------------------------------------ where blocks are

    def contains(self, key: str | Iterable[str]) -> bool | list[bool]:
        """True if ``key`` is resident in L1 or L2 (for a list of keys, a list of answers).

        A block only in L3 is not resident: `locate` says where a block is, and
        `cached_prefix` how many leading blocks of a request any tier holds.
        """
        if isinstance(key, str):
            return self.tier_of(key) is not None
        return [self.tier_of(k) is not None for k in key]

    def tier_of(self, key: str) -> str | None:
        """``"device"``, ``"host"`` or None (only in L3, or in transit)."""
        for tier in self._mover.tiers:
            if key in tier.entries:
                return tier.name
        return None

    def locate(self, key: str) -> str | None:
        """Where ``key`` is, without reading it: ``"device"``, ``"host"`` (L2, or in host memory
        waiting for its write-back), ``"moving"`` (between tiers), ``"store"`` (L3 only), or
        None (no such block)."""
        return self._runtime.locate(key)

    def cached_prefix(self, keys: Iterable[str]) -> int:
        """How many leading ``keys`` the cache holds in any tier (L1, L2, in transit or L3).

        For a request's chain of prefix keys (`cacheflow_jax.kv.prefix_keys`): its first
        ``cached_prefix(keys)`` blocks need no prefill. Nothing is read, and the policy does not
        count it as an access.
        """
        return self._runtime.cached_prefix(keys)

    def info(self, key: str) -> BlockInfo:
        """The block's metadata (shape, dtype, nbytes). Raises ``KeyError`` naming the key."""
        return self._mover.info(key)

    def kind(self, key: str) -> str:
        """The access-log kind of a block (``weight``, ``embedding``, ``kv`` or ``other``)."""
        kind = self._mover.kinds.get(key)
        return kind if kind is not None else kind_of(self.info(key))

    def _describe(self, key: str) -> tuple[int, str]:
        """A key's size and kind, for the predictor's features."""
        return self.info(key).nbytes, self.kind(key)

    # ------------------------------------------------------------------------------ write-back

    def flush(self, *, timeout: float | None = None) -> None:
        """Writes the newest version of every dirty runtime block to L3 and waits until each is
        durable (within ``timeout``, by default ``l3_timeout``); blocks stay resident, now clean.
        A failing write is retried once; then its error is raised and the block stays in memory.

        Raises:
          StoreError: a write-back failed twice (the block stays in memory).
          TimeoutError: write-backs were still pending after ``timeout``.
        """
        timeout = self.config.l3_timeout if timeout is None else timeout
        self._runtime.wait_later(timeout)  # `put_many(wait=False)`'s blocks go in first
        with self._mover.lock:
            self._mover.drain()
        self._wb.flush(timeout)

    def wait_until_finished(self, *, timeout: float | None = None) -> None:
        """Waits for the background puts and the write-backs in flight; raises the first
        write-back error (the data stays in memory)."""
        self._runtime.wait_later(timeout)
        self._wb.wait_until_finished(timeout)

    def check_for_errors(self) -> None:
        """Raises the first recorded write-back error, once."""
        self._wb.check_for_errors()

    # --------------------------------------------------------- L1 room for `lookup`, replay

    def reserve_device(self, nbytes: int) -> AbstractTier:
        """Reserves ``nbytes`` of L1 for data the caller keeps on the device (`serving`'s hot
        embedding rows), evicting blocks as the policy says, until `release_device`; returns the
        L1 tier (a `SlabTier` hands out lines for them).

        Raises:
          BudgetError: ``nbytes`` cannot fit in L1 even with every block evicted.
        """
        return self._demand.reserve_device(nbytes)

    def release_device(self, nbytes: int) -> None:
        """Returns bytes reserved with `reserve_device`."""
        self._demand.release_device(nbytes)

    def access_sync(self, key: str, now: float | None = None) -> None:
        """Records one access and moves blocks as `get` would, synchronously and without data:
        replay's step over metadata-only tiers (`cacheflow_jax.cache.replay_moves`), at ``now``
        (by default the cache's clock)."""
        self._sync.access_many((key,), (self.config.clock() if now is None else now,))

    def access_many_sync(
        self,
        keys: Sequence[str],
        times: Sequence[float],
        sizes: Sequence[int] | None = None,
        *,
        general: bool = False,
    ) -> None:
        """`access_sync` for each of ``keys`` at its time in ``times`` (replay's loop); ``sizes``:
        each block's bytes if known (else looked up in the store first).

        Raises:
          KeyError: a key is neither in the store nor among runtime blocks (nothing was counted).
        """
        self._sync.access_many(keys, times, sizes)

    # ------------------------------------------------------------------------------ prefetch

    def start_prefetch(self) -> None:
        """Starts the prefetch worker if this cache prefetches (`serving` calls it on entry)."""
        if self._driver is not None:
            self._driver.start()
            self._hooked = self._driver.wraps_gets

    def stop_prefetch(self) -> None:
        """Stops the prefetch worker: no thread is left and no load lands after this returns
        (a waiting access reads its block itself). `serving` calls it on exit."""
        if self._driver is not None:
            self._driver.stop()
            self._hooked = self._driver.wraps_gets

    def pause_prefetch(self, paused: bool) -> None:
        """While paused, accesses still teach the predictor, but no prefetch is issued."""
        if self._driver is not None:
            self._driver.pause(paused)

    def prefetch_settled(self) -> bool:
        """True when no prefetch work is pending: the worker sleeps with nothing fed or
        arrived, and no prefetch load is in flight (always True without a prefetcher)."""
        return self._driver is None or self._driver.settled()

    # ------------------------------------------------------------------------------- control

    @property
    def tiers(self) -> tuple[AbstractTier, ...]:
        """The tier objects, L1 first (read-only views for inspection: sizes, entries)."""
        return tuple(self._mover.tiers)

    @property
    def device(self) -> Any:
        """L1's JAX device."""
        return self._mover.tiers[DEVICE].device

    @property
    def planner(self) -> Planner:
        """The planner over the policy's state (for inspection)."""
        return self._mover.planner

    def moving(self) -> int:
        """How many blocks are in transit between tiers right now."""
        return len(self._mover.inflight)

    def reset_counters(self) -> None:
        """Zeroes the hit, miss, prefetch and write-back counters (the contents stay)."""
        with self._mover.lock:
            self._mover.drain()
            self._counters.reset()
            self._wb.reset_counts()

    def close(self) -> None:
        """Stops prefetching and writes every dirty block back (`flush`)."""
        self.stop_prefetch()
        self.flush()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict:
        """Counters in the shape of ``cacheflow replay --json``, plus ``tiers``, ``bytes``,
        ``l3`` and ``writebacks``: docs/design.md's "Replay JSON and `stats()`" lists each."""
        read_stats = self.store.read_stats() if tensorstore_store(self.store) else None
        return stats_of(self._counters, self._mover, self._wb, self._driver, read_stats)

    def check_budgets(self) -> None:
        """Raises AssertionError if any tier holds more bytes than its budget (for tests)."""
        with self._mover.lock:
            for tier in self._mover.tiers:
                resident = sum(self.info(k).nbytes for k in tier.entries)
                if not (0 <= resident <= tier.used <= tier.budget):
                    raise AssertionError(
                        f"{tier.name}: resident={resident} used={tier.used} budget={tier.budget}"
                    )

