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
* `cacheflow_jax.cache.counters.Counters`: what `stats()` reports.

The hit path is the one thing done here: a dict lookup plus an append to a read buffer, with no
lock, no I/O and no logging.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from cacheflow_jax.cache.config import CacheConfig
from cacheflow_jax.cache.counters import Counters, stats_of
from cacheflow_jax.cache.demand import Demand, to_host
from cacheflow_jax.cache.mover import DEVICE, HOST, Mover
from cacheflow_jax.cache.pins import Pins
from cacheflow_jax.cache.prefetch_driver import PrefetchDriver
from cacheflow_jax.cache.replay_moves import SyncMoves
from cacheflow_jax.cache.runtime import KINDS, RuntimeBlocks
from cacheflow_jax.cache.staging import Staging
from cacheflow_jax.cache.writeback import WriteBack
from cacheflow_jax.core.blocks import DEFAULT_TIMEOUT, BlockInfo, BudgetError, Store
from cacheflow_jax.planning.planner import Planner
from cacheflow_jax.policies import Policy, get_policy
from cacheflow_jax.prefetch.scheduler import PrefetchSettings, load_prefetcher
from cacheflow_jax.tiers.memory import AbstractTier, HostTier

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
      device_bytes: L1 budget in bytes; at least the largest block of the store.
      host_bytes: L2 budget in bytes; 0 disables L2, otherwise at least the largest block.
      policy: a policy name (``"lfu"``, ``"lru"``, ``"lfu-plain"``) or a `Policy`.
      prefetcher: a `predictor.Predictor` (``observe`` / ``predict`` / ``reset``) that drives
        asynchronous L3 -> L2 -> L1 loads of the blocks it expects next; or the path of a
        predictor checkpoint (``cacheflow train ... --out OUT`` writes ``OUT/checkpoint``), loaded
        here: a damaged one (`predictor.CorruptCheckpointError`) warns once and the cache runs
        without prefetch, a path that is no checkpoint raises `predictor.CheckpointError`;
        None: no prefetch. See `cacheflow_jax.prefetch.scheduler` and ``prefetch``.
      prefetch: how to prefetch (a `PrefetchSettings`); the defaults when None.
      clock: seconds, monotonic; injected for tests and replay.
      device: the L1 device; the default device if omitted.
      tiers: advanced: replace the L1/L2 tier objects (replay uses metadata-only tiers).
      read_buffer: how many buffered hits trigger a policy update (1 applies each at once).
      l3_timeout: seconds an L3 read may take before the miss raises `StoreTimeoutError` (a
        `StoreError` naming the key and the store); also the longest `put` waits for room in
        the write-back budget and the default deadline of `flush`. None waits forever. Hits in
        L1 and L2 never wait on L3.
      writeback_bytes: the most bytes of runtime blocks not yet durable in L3 that the cache
        holds at once, resident in L1/L2 or waiting to be written back; a `put` beyond it first
        starts write-backs and waits for them (up to ``l3_timeout``), then raises `StoreError`.
        Default: twice ``device_bytes + host_bytes``.
      device_layout: ``"arrays"`` (one ``jax.Array`` per L1 block, the default) or ``"slab"``
        (one preallocated slab of fixed-size lines filled and read by the Pallas kernels; see
        `cacheflow_jax.tiers.slab`).
      line_bytes: the slab's line size (``device_layout="slab"`` only); by default the largest
        power of two dividing the store's chunk sizes, within 4-64 KiB (see
        `cacheflow_jax.tiers.slab.default_line_bytes`).
      block_bytes: the largest block (a `TensorStoreStore` only): a stored chunk larger than
        this is served as sub-blocks along its leading axis, and ``cache.store`` is then a view
        of the store with those blocks (`TensorStoreStore.with_block_bytes`). Default:
        ``device_bytes // 8`` for stores whose chunks their writer did not choose for caching
        (orbax checkpoints, other zarr3 stores); a store from ``write_store`` keeps its
        ``chunk_bytes`` blocks.

    Raises:
      BudgetError: a budget is negative, not an integer, or too small for the store's blocks.
      ValueError: an unknown ``device_layout``, or ``l3_timeout`` not a positive number.

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
    ) -> None:
        config = self.config = CacheConfig(
            device_bytes=device_bytes, host_bytes=host_bytes, policy=policy,
            prefetcher=prefetcher, prefetch=prefetch, clock=clock, device=device,
            read_buffer=read_buffer, l3_timeout=l3_timeout, writeback_bytes=writeback_bytes,
            device_layout=device_layout, line_bytes=line_bytes, block_bytes=block_bytes,
        )  # fmt: skip
        if block_bytes is not None or _tensorstore_store(store):
            from cacheflow_jax.store.tensorstore_store import fit_blocks

            store = fit_blocks(store, device_bytes, block_bytes)
        self.store = store
        asked = None if tiers is not None else (config.device_bytes, config.host_bytes)
        tiers = _make_tiers(config, store) if tiers is None else list(tiers)
        largest = _check_budgets(tiers, store, asked)
        self.policy = get_policy(config.policy)
        settings = config.prefetch_settings
        if isinstance(prefetcher, str | os.PathLike):
            prefetcher = load_prefetcher(prefetcher)
        self.prefetcher = prefetcher
        planner = Planner(self.policy, len(tiers), has_host=len(tiers) > HOST and
                          tiers[HOST].budget > 0, tracking=prefetcher is not None,
                          adaptive=settings.adaptive, prior_return=settings.min_score)  # fmt: skip
        lock = threading.Lock()
        self._counters = counters = Counters()
        self._wb = WriteBack(
            store, lock, budget=config.writeback_budget(sum(t.budget for t in tiers)),
            resident=lambda key: mover.resident(key), to_host=to_host,
        )  # fmt: skip
        self._mover = mover = Mover(store, tiers, planner, counters, self._wb, Pins(), lock=lock,
                                    clock=clock, l3_timeout=l3_timeout,
                                    read_buffer=read_buffer)  # fmt: skip
        self._demand = Demand(mover)
        self._runtime = RuntimeBlocks(mover, self._demand)
        self._staging = Staging(mover)
        if _tensorstore_store(store):
            store.add_sibling_listener(self._demand.take_siblings)
        self._driver = self._sync = None
        if prefetcher is not None:
            self._driver = PrefetchDriver(mover, self._demand, prefetcher, settings, largest,
                                          describe=self._describe)  # fmt: skip
        replay = self._driver.replay if self._driver is not None else None
        self._sync = SyncMoves(mover, replay if replay is not None and not replay.data else None)
        if replay is not None:
            replay.moves = self._sync
        # The hit path's names, and whether gets go through the prefetch driver.
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
        """Returns several blocks; all the L3 reads among them are issued at once.

        The policy sees the L1 hits first (the hit path), then the blocks only L3 holds (their
        reads start at once), then the rest in the order of ``keys``: a block in L2 is promoted
        before the next key's access, as `get` of each key in turn would do.

        Raises:
          KeyError: a key names no block (before anything moves).
          DtypeError: JAX would narrow a block's dtype on the device (before anything moves).
        """
        if self._hooked:
            return self._driver.get_many(keys)
        return self._demand.get_many(keys)

    def get_host_many(self, keys: Iterable[str]) -> list[np.ndarray]:
        """Returns blocks as host arrays without promoting them to L1.

        For callers that keep their own device copy of what is hot (`serving`'s ``lookup`` of
        embedding rows). Hits in L1 or L2 count as such and stay where they are; the rest are
        read from L3 in one batch and kept in L2 when the policy admits them.

        Raises:
          KeyError: no block for one of ``keys`` (before anything is read).
        """
        return self._demand.get_host_many(keys)

    def get_found(self, keys: Iterable[str]) -> tuple[dict[str, jax.Array], list[str]]:
        """`get_many` of the blocks that exist; the others are returned instead of raised.

        Returns:
          ``(blocks, missing)``: a dict of the found keys' blocks (in the order of ``keys``)
          and the list of keys with no block anywhere (neither put nor in L3).

        Raises:
          StoreError: as `get_many` (a read failed or timed out); KeyError only for a key that
            vanished between the lookup and the read.
        """
        keys = list(dict.fromkeys(keys))
        where = {k: self.locate(k) for k in keys}
        found = [k for k in keys if where[k] is not None]
        missing = [k for k in keys if where[k] is None]
        return dict(zip(found, self.get_many(found))), missing

    def get_many_async(self, keys: Iterable[str]) -> Future:
        """Starts `get_many` on a background thread; returns its `concurrent.futures.Future`.

        Lets a serving loop overlap the L3 reads of queued requests' blocks with the current
        step (``future.result()`` gives the list of blocks, or raises as `get_many` does).
        """
        from cacheflow_jax.store.futures import thread_pool

        return thread_pool("get", 4).submit(self.get_many, list(keys))

    def prefetch(self, keys: Iterable[str]) -> Future:
        """Starts reading the blocks of ``keys`` that only L3 holds into L2, in the background
        (a queued request's blocks: `cacheflow_jax.cache.staging`); a `Future` of how many
        went in. Nothing goes into L1; resident, moving and unknown keys are skipped."""
        from cacheflow_jax.store.futures import thread_pool

        return thread_pool("stage", 2).submit(self._staging.stage, list(keys))

    # ------------------------------------------------------------------------- runtime blocks

    def put(self, key: str, value: Any, *, kind: str = "kv", writeback: bool = True) -> None:
        """Stores a runtime block (for example a KV block keyed by prefix hash) in L1.

        The block is an array, or a pytree of arrays (a ``dict``/``list``/``tuple`` tree, for
        example per-layer K and V; see `cacheflow_jax.core.pytree`): one key, one budget entry
        and one file in L3, and `get` returns the same structure, bitwise, from every tier.

        The put returns once the block is in L1 and counted. It is written back to L3 in the
        background when it leaves the cache and on `flush`; only when ``writeback_bytes`` is
        full does a put wait for a write-back to finish (counted in ``stats()["writebacks"]``
        as a stall). Everything is checked before anything is stored, so a refused put changes
        nothing.

        Args:
          key: the block's key (no ``@``).
          value: the block.
          kind: its access-log kind.
          writeback: False for a block that need not be durable (a prefix cache's cold KV can
            be recomputed): it is dropped, not written, when it leaves the cache, and it does
            not count against ``writeback_bytes``. Ignored (the block is written back) when L3
            already holds an earlier version of the key, so that L3 never serves older bytes.

        Raises:
          TypeError: ``key`` is not a str, ``value`` is not a numeric array or a pytree of
            them, or a pytree block with ``device_layout="slab"``.
          ValueError: ``key`` cannot name a runtime block (empty, contains ``'@'``, not valid
            UTF-8, too long for a file name), ``kind`` is unknown, or the key is pinned.
          DtypeError: the array's dtype would be narrowed on the device (64-bit with
            ``jax_enable_x64`` off).
          BudgetError: the block is larger than ``device_bytes`` or ``writeback_bytes``, or
            than the room that pinned blocks leave in L1.
          StoreError: the write-back budget stayed full for ``l3_timeout`` (L3 is failing).
        """
        self._runtime.put(key, value, kind=kind, writeback=writeback)

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
        """Writes the latest version of every dirty runtime block to L3 and waits until each is
        durable (a block put again meanwhile is written again: its newest bytes land last).

        Resident blocks stay resident (now clean). A write that fails is retried once within
        the same call; if it fails again, its error is raised, and the block stays in memory
        for the next flush.

        Args:
          timeout: seconds to wait; by default the cache's ``l3_timeout``.

        Raises:
          StoreError: a write-back failed twice (the block stays in memory).
          TimeoutError: write-backs were still pending after ``timeout``.
        """
        with self._mover.lock:
            self._mover.drain()
        self._wb.flush(self.config.l3_timeout if timeout is None else timeout)

    def wait_until_finished(self, *, timeout: float | None = None) -> None:
        """Waits for the write-backs in flight; raises the first error (the data stays in memory)."""
        self._wb.wait_until_finished(timeout)

    def check_for_errors(self) -> None:
        """Raises the first recorded write-back error, once."""
        self._wb.check_for_errors()

    # --------------------------------------------------------- L1 room for `lookup`, replay

    def reserve_device(self, nbytes: int) -> AbstractTier:
        """Reserves ``nbytes`` of L1 for data the caller keeps on the device itself.

        Blocks are evicted (demoted) as the policy says until the bytes fit; they stay counted
        in L1's ``used`` until `release_device`. For `serving`'s ``lookup``, whose hot embedding
        rows share L1's budget with blocks.

        Returns:
          The L1 tier (a `SlabTier` then hands out lines for the reserved bytes).

        Raises:
          BudgetError: ``nbytes`` cannot fit in L1 even with every block evicted.
        """
        return self._demand.reserve_device(nbytes)

    def release_device(self, nbytes: int) -> None:
        """Returns bytes reserved with `reserve_device`."""
        self._demand.release_device(nbytes)

    def access_sync(self, key: str, now: float | None = None) -> None:
        """Records one access and moves blocks as `get` would, synchronously and without data.

        For replay over metadata-only tiers (`MetadataTier`) in a single thread: it makes the
        same calls on the same policy and tiers, in the same order, as `get` with
        ``read_buffer=1`` (`cacheflow_jax.cache.replay_moves`). Not for runtime blocks.

        Args:
          key: the block accessed.
          now: the access time (replay passes the trace's); by default the cache's clock.
        """
        self._sync.access_many((key,), (self.config.clock() if now is None else now,))

    def access_many_sync(
        self,
        keys: Sequence[str],
        times: Sequence[float],
        sizes: Sequence[int] | None = None,
        *,
        general: bool = False,
    ) -> None:
        """`access_sync` for each of ``keys`` in turn, at its time in ``times``: replay's loop.

        Args:
          keys: the blocks accessed, in order.
          times: each access's time.
          sizes: each block's size in bytes (replay knows them from its trace); None: looked up
            in the store before the first access.

        Raises:
          KeyError: a key is neither in the store nor among runtime blocks (nothing was counted).
        """
        self._sync.access_many(keys, times, sizes)

    # ------------------------------------------------------------------------------ prefetch

    def start_prefetch(self) -> None:
        """Starts the background prefetch worker (if this cache prefetches and it is stopped).

        `serving` calls it on entry; the constructor already did for a new cache.
        """
        if self._driver is not None:
            self._driver.start()
            self._hooked = self._driver.wraps_gets

    def stop_prefetch(self) -> None:
        """Stops the prefetch worker: no thread is left and no load lands after this returns.

        Loads still in flight are abandoned (a waiting access reads the block itself). `serving`
        calls it on exit; `start_prefetch` starts again.
        """
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
        read_stats = self.store.read_stats() if _tensorstore_store(self.store) else None
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


def _make_tiers(config: CacheConfig, store: Store) -> list[AbstractTier]:
    from cacheflow_jax.tiers.slab import make_device_tier  # JAX comes with the device tier

    return [
        make_device_tier(config.device_layout, config.device_bytes, store=store,
                         line_bytes=config.line_bytes, device=config.device),
        HostTier(config.host_bytes),
    ]  # fmt: skip


def _check_budgets(
    tiers: Sequence[AbstractTier], store: Store, asked: Sequence[int] | None = None
) -> int:
    """Checks that each tier holds the store's largest block; returns that block's size.
    ``asked``: the budgets as given (a slab rounds L1's down to whole lines)."""
    largest = 0
    for array in store.arrays().values():
        chunk = [min(c, s) for c, s in zip(array.chunk_shape, array.shape)]
        largest = max(largest, math.prod(chunk) * array.dtype.itemsize)
    for i, (tier, setting) in enumerate(zip(tiers, ("device_bytes", "host_bytes"))):
        if tier.budget == 0 and setting == "host_bytes":
            continue
        if tier.budget < largest:
            given = tier.budget if asked is None else asked[i]
            lines = "" if given == tier.budget else f" (whole lines: {tier.budget} bytes)"
            raise BudgetError(
                f"{setting}={given}{lines} is smaller than the largest block of "
                f"{store.spec} ({largest} bytes); raise {setting} to at least {largest}"
                + (" or set it to 0 to disable L2" if setting == "host_bytes" else "")
                + ", or rewrite the store with smaller chunks (write_store(chunk_bytes=...))"
            )
    return largest


def _tensorstore_store(store: Any) -> bool:
    """Whether ``store`` is a `TensorStoreStore` (without importing TensorStore to find out:
    if the store module was never imported, no such store exists)."""
    module = sys.modules.get("cacheflow_jax.store.tensorstore_store")
    return module is not None and isinstance(store, module.TensorStoreStore)

