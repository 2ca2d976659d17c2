"""`TieredCache`: blocks in device memory (L1), host memory (L2) and a TensorStore store (L3).

Design note.

* Tiers are exclusive: a block lives in at most one of L1 and L2, so their budgets add up and a
  two-tier cache behaves like one cache of the summed size. An access promotes a block to L1; L1's
  victim is demoted to L2 and L2's victim leaves the cache (read-only chunks are dropped, runtime
  blocks are written back to L3 first).
* Storage never decides and policy never stores: tiers count bytes, the `Policy` picks victims and
  admits newcomers against a ghost history.
* Budgets are hard. Room is reserved under the lock before any transfer starts and released only
  after a block has left, so ``used <= budget`` holds at every moment for every tier, whatever the
  threads do. Transfers (L3 reads, host<->device copies, write-backs) happen outside the lock.
* A block in transit (being loaded, promoted or demoted) is registered in ``_inflight``; a second
  request for it waits on that transfer instead of issuing its own, so concurrent misses on one key
  make one read, and a runtime block being written back is never read from L3 too early.
* The hit path is a dict lookup plus an append to a read buffer: no lock, no I/O, no logging.
  As in Caffeine, buffered accesses are applied to the policy in batches under the lock, on the
  next miss or when the buffer fills.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import numbers
import os
import sys
import threading
import time
from _thread import allocate_lock as _allocate_lock
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from cacheflow_jax.core.blocks import (
    DEFAULT_TIMEOUT,
    BlockInfo,
    BudgetError,
    Store,
    StoreError,
    StoreTimeoutError,
)
from cacheflow_jax.cache.pins import Pins
from cacheflow_jax.planning.planner import REFUSED, Planner
from cacheflow_jax.prefetch.scheduler import (
    PrefetchScheduler,
    PrefetchSettings,
    PrefetchWorker,
    load_prefetcher,
    new_counters,
)
from cacheflow_jax.core.pytree import TREES, block_info, flatten, is_tree, tree_map
from cacheflow_jax.store.runtime_format import _numeric, check_runtime_key
from cacheflow_jax.tiers.memory import (
    PRESENT,
    AbstractTier,
    HostTier,
    MetadataTier,
    check_device_dtype,
)
from cacheflow_jax.cache.writeback import WriteBack
from cacheflow_jax.policies import Policy, get_policy

if TYPE_CHECKING:
    from predictor import Predictor

if TYPE_CHECKING:  # JAX loads with the device tier and numpy where used: replay needs neither
    import jax
    import numpy as np

DEVICE, HOST = 0, 1

KINDS = ("weight", "embedding", "kv", "other")


class _Transit:
    """A block moving between tiers; waiters block in ``wait`` outside the cache lock.

    A raw lock held from creation until ``finish`` is the cheapest one-shot event in CPython
    (``threading.Event`` builds a Condition), and transits are made on every miss.
    """

    __slots__ = ("_gate", "value", "error", "prefetch", "demanded", "rank")

    def __init__(self, prefetch: bool = False) -> None:
        self._gate = _allocate_lock()
        self._gate.acquire()
        self.value: Any = None  # the device array when the transit was a load
        self.error: BaseException | None = None
        self.prefetch = prefetch  # a prefetch load: nobody asked for the block yet
        self.demanded = False  # a demand access came while the prefetch was loading (late)
        self.rank = 1  # a prefetch: the guess's place in the predictor's proposals

    def finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error
        self._gate.release()

    def wait(self) -> None:
        with self._gate:
            pass


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
      ValueError: an unknown ``device_layout``.

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
        if block_bytes is not None or _tensorstore_store(store):
            from cacheflow_jax.store.tensorstore_store import fit_blocks

            store = fit_blocks(store, device_bytes, block_bytes)
        if tiers is None:
            from cacheflow_jax.tiers.slab import make_device_tier  # JAX comes with the device tier

            tiers = [
                make_device_tier(device_layout, device_bytes, store=store, line_bytes=line_bytes,
                                 device=device),
                HostTier(host_bytes),
            ]
        self._tiers = list(tiers)
        largest = _largest_block(store)
        for tier, setting in zip(self._tiers, ("device_bytes", "host_bytes")):
            if tier.budget == 0 and setting == "host_bytes":
                continue
            if tier.budget < largest:
                raise BudgetError(
                    f"{setting}={tier.budget} is smaller than the largest block of "
                    f"{store.spec} ({largest} bytes); raise {setting} to at least {largest}"
                    + (" or set it to 0 to disable L2" if setting == "host_bytes" else "")
                    + ", or rewrite the store with smaller chunks (write_store(chunk_bytes=...))"
                )
        if l3_timeout is not None and not (
            isinstance(l3_timeout, int | float) and not isinstance(l3_timeout, bool) and l3_timeout > 0
        ):
            raise ValueError(f"l3_timeout={l3_timeout!r} must be a number of seconds > 0, or None")
        if writeback_bytes is None:
            writeback_bytes = 2 * sum(t.budget for t in self._tiers)
        if isinstance(writeback_bytes, bool) or not isinstance(writeback_bytes, numbers.Integral):
            raise BudgetError(f"writeback_bytes={writeback_bytes!r} must be an integer number of bytes")
        if writeback_bytes < 0:
            raise BudgetError(f"writeback_bytes={writeback_bytes} is negative; give a byte budget >= 0")
        self._l3_timeout = l3_timeout
        self._check_dtypes = not isinstance(self._tiers[DEVICE], MetadataTier)
        self.store = store
        if _tensorstore_store(store):
            store.add_sibling_listener(self._take_siblings)
        self.policy = get_policy(policy)
        if prefetch is not None and not isinstance(prefetch, PrefetchSettings):
            raise TypeError(f"prefetch={prefetch!r} must be a PrefetchSettings or None")
        settings = prefetch or PrefetchSettings()
        if isinstance(prefetcher, str | os.PathLike):
            prefetcher = load_prefetcher(prefetcher)
        self.prefetcher = prefetcher
        self._clock = clock
        has_host = len(self._tiers) > HOST and self._tiers[HOST].budget > 0
        self._planner = Planner(
            self.policy,
            len(self._tiers),
            has_host=has_host,
            tracking=prefetcher is not None,
            adaptive=settings.adaptive,
            prior_return=settings.min_score,
        )
        self._pstate = self._planner.state
        # The planner's `access` (True on a prefetched block's first use); without prefetch, the
        # policy's own access over its state (it returns None: never a prefetch's use).
        self._plan_access: Callable[[str, float], Any] = (
            self._planner.access
            if self._planner.tracking
            else functools.partial(self.policy.access, self._planner.state)
        )
        ttl = self._planner.describe().get("ttl")
        self._has_ttl = ttl is not None
        # TTL checks run at most every ttl/64 seconds: a block leaves within ttl * 65/64.
        self._expire_every = ttl / 64 if ttl else math.inf
        self._next_expire = -math.inf
        self._store_info = store.info
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified whenever tier bytes are released
        self._room_waiters = 0
        self._l1 = self._tiers[DEVICE].entries  # the hit path reads this dict without the lock
        # L2 if it can hold blocks (replay's `access_sync` reads it on every access), else None.
        self._host = (
            self._tiers[HOST] if len(self._tiers) > HOST and self._tiers[HOST].budget > 0 else None
        )
        self._reads: collections.deque[str] = collections.deque()
        self._read_buffer = max(1, int(read_buffer))
        self._inflight: dict[str, _Transit] = {}
        self._planner.watch_transit(self._inflight)  # a key on its way between tiers is not gone
        self._runtime: dict[str, BlockInfo] = {}  # runtime blocks put into this cache
        self._kinds: dict[str, str] = {}  # runtime block key -> access-log kind given to put
        # Runtime blocks not yet durable in L3 and their writes (`WriteBack`); a dirty block
        # that left L1/L2 is parked there (``_unwritten``, served to readers from it) until its
        # write is durable, so no reader can see L3 before the write lands.
        self._wb = WriteBack(
            store, self._lock, budget=int(writeback_bytes), resident=self._resident,
            to_host=_to_host,
        )  # fmt: skip
        self._unwritten = self._wb.parked
        self._volatile: set[str] = set()  # runtime blocks put with writeback=False
        self._pins = Pins()  # blocks pinned in L1 by running requests (`pinned`)
        self._n = {"device": 0, "host": 0, "miss": 0, "bytes": 0, "miss_bytes": 0, "host_bytes": 0}
        # L3 reads finish on store threads: their counters have their own lock, never held
        # across a wait, so a finishing read never waits for the cache lock.
        self._l3_lock = threading.Lock()
        self._l3 = {"reads": 0, "read_bytes": 0, "read_seconds": 0.0}
        self._pf = new_counters()
        self._pf_scheduler: PrefetchScheduler | None = None
        self._pf_worker: PrefetchWorker | None = None
        self._pf_replay: _ReplayPrefetch | None = None
        self._pf_inflight = 0  # bytes of prefetch loads issued and not installed
        self._pf_limit = 0
        self._pf_reads = ReadGate()  # the live worker's L3 reads earn their rate
        self._pf_promote = False  # the live worker moves L2 guesses up to L1
        if prefetcher is not None:
            self._setup_prefetch(prefetcher, settings, largest)

    # ------------------------------------------------------------------------------ hit path

    def get(self, key: str, req: str | None = None) -> jax.Array:
        """Returns the block ``key`` as a device array, loading it through L2/L3 on a miss.

        ``req`` (a request id) is for the access log of a `serving` session; the cache ignores it.

        Raises:
          KeyError: no block ``key`` in the store or among runtime blocks.
          CorruptBlockError: the stored chunk failed its checksum.
        """
        value = self._l1.get(key)
        if value is not None:
            reads = self._reads
            reads.append(key)
            if len(reads) >= self._read_buffer:
                self._apply_hits()
            return value
        return self._get_slow(key)

    def _apply_hits(self) -> None:
        """Applies the buffered hits to the policy (a full read buffer, off the common path)."""
        with self._lock:
            self._drain()
        if self._unwritten:
            self._wb.start()  # dirty blocks the TTL just expired

    def get_many(self, keys: Iterable[str], req: str | None = None) -> list[jax.Array]:
        """Returns several blocks; all the L3 reads among them are issued at once.

        The policy sees the L1 hits first (the hit path), then the blocks only L3 holds (their
        reads start at once), then the rest in the order of ``keys``: a block in L2 is promoted
        before the next key's access, as `get` of each key in turn would do.

        Raises:
          KeyError: a key names no block (before anything moves).
          DtypeError: JAX would narrow a block's dtype on the device (before anything moves).
        """
        keys = list(keys)
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"block keys are str; got {type(key).__name__} {key!r} in get_many")
        out: dict[str, Any] = {}
        for key in keys:
            value = self._l1.get(key)
            if value is not None and key not in out:
                self._reads.append(key)
                out[key] = value
        pending = list(dict.fromkeys(k for k in keys if k not in out))
        for key in pending:  # bad keys fail before anything moves or waits on this call
            info = self.info(key)
            if self._check_dtypes:
                check_device_dtype(info.dtype, key)
        while pending:
            owned, waits, in_tiers = [], [], []
            first_error: BaseException | None = None
            deadline = self._deadline()
            # First the blocks only L3 holds: claimed at once and their reads issued, so that
            # they run while the blocks in L2 are promoted below.
            try:
                with self._lock:
                    self._drain()
                    host = self._tiers[HOST].entries if len(self._tiers) > HOST else {}
                    for key in pending:
                        if (key in self._l1 or key in self._inflight or key in host
                                or key in self._unwritten):
                            in_tiers.append(key)
                        else:
                            _, info, src = self._begin(key)
                            owned.append((key, info, src))
                claimed = [k for k, _, _ in owned]
                futures = dict(zip(claimed, self._read_many(claimed)))
            except BaseException as e:  # release the loads claimed so far: none may hang
                self._abandon(owned, e)
                raise
            # Then the rest in order. A block in L2 is promoted before the next key's access, so
            # the policy sees each access followed by its own moves, as in `get` and replay (a
            # promotion left pending behind later accesses would be judged as a block that had
            # left the cache).
            late = []
            for key in in_tiers:
                try:
                    with self._lock:
                        self._drain()
                        step = self._begin(key)
                except BaseException as e:
                    self._abandon(owned + late, e)
                    raise
                if step[0] == "hit":
                    out[key] = step[1]
                elif step[0] == "wait":
                    waits.append((key, step[1]))
                elif step[2] is not None:
                    try:
                        out[key] = self._finish(key, step[1], step[2], None, deadline)
                    except BaseException as e:  # finish the other loads before raising
                        first_error = first_error or e
                else:  # it left L2 while the blocks before it moved: read it too
                    late.append((key, step[1], None))
            if late:
                try:
                    moved = [k for k, _, _ in late]
                    futures.update(zip(moved, self._read_many(moved)))
                except BaseException as e:
                    self._abandon(owned + late, e)
                    raise
                owned += late
            for key, info, src in owned:
                try:
                    out[key] = self._finish(key, info, src, futures.get(key), deadline)
                except BaseException as e:  # finish the other loads before raising
                    first_error = first_error or e
            if first_error is not None:
                raise first_error
            pending = []
            for key, transit in waits:
                transit.wait()
                if transit.error is not None:
                    raise transit.error
                if transit.value is not None:
                    out[key] = transit.value
                else:
                    pending.append(key)
        return [out[k] for k in keys]

    # ------------------------------------------------------------ embedding rows (`lookup`)

    def get_host_many(self, keys: Iterable[str]) -> list[np.ndarray]:
        """Returns blocks as host arrays without promoting them to L1.

        For callers that keep their own device copy of what is hot (`serving`'s ``lookup`` of
        embedding rows). Hits in L1 or L2 count as such and stay where they are; the rest are
        read from L3 in one batch and kept in L2 when the policy admits them.

        Raises:
          KeyError: no block for one of ``keys`` (before anything is read).
        """
        keys = list(keys)
        infos = {key: self.info(key) for key in keys}
        out: dict[str, Any] = {}
        pending = list(infos)
        while pending:
            owned, waits = [], []
            with self._lock:
                self._drain()
                now = self._clock()
                host = self._tiers[HOST].entries if len(self._tiers) > HOST else {}
                for key in pending:
                    transit = self._inflight.get(key)
                    if transit is not None:
                        waits.append((key, transit))
                        continue
                    nbytes = infos[key].nbytes
                    value = self._l1.get(key)
                    if value is not None:
                        self._account(key, "device", now, nbytes)
                    elif key in host or key in self._unwritten:
                        self._account(key, "host", now, nbytes)
                        value = host[key] if key in host else self._unwritten[key]
                    else:
                        self._account(key, "miss", now, nbytes)
                        self._inflight[key] = _Transit()
                        owned.append(key)
                        continue
                    out[key] = value
            first_error: BaseException | None = None
            deadline = self._deadline()
            for key, future in zip(owned, self._read_many(owned)):
                transit = self._inflight[key]
                try:
                    value = self._read_result(key, future, deadline)
                    host_value = self._load_host(key, infos[key].nbytes, value)
                    with self._lock:
                        if host_value is not None:
                            self._tiers[HOST].put_reserved(key, host_value, infos[key].nbytes)
                            self._planner.insert(HOST, key, self._clock(), infos[key].nbytes)
                        del self._inflight[key]
                        self._notify_room()
                    out[key] = value
                    transit.finish()
                except BaseException as e:  # finish the other reads before raising
                    with self._lock:
                        self._inflight.pop(key, None)
                    transit.finish(error=e)
                    first_error = first_error or e
            if first_error is not None:
                raise first_error
            pending = []
            for key, transit in waits:
                transit.wait()
                if transit.error is not None:
                    raise transit.error
                pending.append(key)  # look again: it is now in a tier (or back in L3)
        return [_to_host(out[key]) for key in keys]

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
        if not self._make_room(DEVICE, nbytes, None):
            tier = self._tiers[DEVICE]
            raise BudgetError(
                f"cannot reserve {nbytes} bytes of L1 (device_bytes={tier.budget}, "
                f"{tier.used} in use by blocks in transit or other reservations); ask for "
                "less or raise device_bytes"
            )
        return self._tiers[DEVICE]

    def release_device(self, nbytes: int) -> None:
        """Returns bytes reserved with `reserve_device`."""
        with self._lock:
            self._tiers[DEVICE].release(nbytes)
            self._notify_room()

    def _take_siblings(self, siblings: Mapping[str, np.ndarray]) -> list[str]:
        """Keeps sub-blocks read along with a requested one in L2's free room (a prefetch).

        The store calls this when it read a whole chunk for one sub-block (see
        `TensorStoreStore.add_sibling_listener`). A sibling only takes room nobody holds: it
        never displaces a resident block, and blocks resident or in transit are skipped.

        Returns:
          The keys kept.
        """
        if len(self._tiers) <= HOST or isinstance(self._tiers[HOST], MetadataTier):
            return []
        host = self._tiers[HOST]
        taken = []
        with self._lock:
            for key, view in siblings.items():
                if key in self._inflight or key in self._l1 or key in host.entries:
                    continue
                if not host.reserve(view.nbytes):
                    break
                self._inflight[key] = _Transit()
                taken.append((key, view, self._inflight[key]))
        kept = []
        import numpy as np

        for key, view, transit in taken:
            try:
                value = np.array(view)  # a copy: the view holds the whole chunk's buffer
            except MemoryError:  # a prefetch is optional: give its room back
                value = None
            with self._lock:
                if value is not None:
                    host.put_reserved(key, value, view.nbytes)
                    # A guess like any prefetch: unused, it is the first to leave.
                    self._planner.insert(HOST, key, self._clock(), view.nbytes, prefetched=True)
                    kept.append(key)
                else:
                    host.release(view.nbytes)
                del self._inflight[key]
                self._notify_room()
            transit.finish()
        return kept

    # --------------------------------------------------------------------- replay (one thread)

    def access_sync(self, key: str, now: float | None = None) -> None:
        """Records one access and moves blocks as `get` would, synchronously and without data.

        For replay over metadata-only tiers (`MetadataTier`) in a single thread: it makes the same
        calls on the same policy and tiers, in the same order, as `get` with ``read_buffer=1`` (a
        test checks that both give identical counters and residency), without the transit and
        locking machinery that concurrent data movement needs. Not for runtime blocks.

        Args:
          key: the block accessed.
          now: the access time (replay passes the trace's); by default the cache's clock.
        """
        self.access_many_sync((key,), (self._clock() if now is None else now,))

    def access_many_sync(
        self, keys: Sequence[str], times: Sequence[float], sizes: Sequence[int] | None = None
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
        if sizes is None:
            sizes = [self.info(key).nbytes for key in keys]
        if self._pf_replay is None and self._host is None and not self._planner.tracking:
            self._access_many_l1(keys, times, sizes)
        else:
            self._access_many_tiers(keys, times, sizes)

    def _access_many_tiers(
        self, keys: Sequence[str], times: Sequence[float], sizes: Sequence[int]
    ) -> None:
        """`access_many_sync` in general: L1 and L2, with or without prefetch."""
        prefetch = self._pf_replay
        plan_access, planner, install = self._plan_access, self._planner, self._install_sync
        l1, host = self._l1, self._host
        has_ttl = self._has_ttl
        # The counters, kept in locals over the loop (the hits of each tier, the misses, and
        # their bytes) and added to the cache's at the end.
        device = in_host = miss = total = host_bytes = miss_bytes = 0
        try:
            for key, now, nbytes in zip(keys, times, sizes):
                if prefetch is not None:
                    prefetch.before(key, now)
                total += nbytes
                if key in l1:
                    device += 1
                    if plan_access(key, now):
                        self._pf_count_use(nbytes, late=False)
                    if has_ttl and now >= self._next_expire:
                        self._expire(now)
                else:
                    if host is not None and key in host.entries:
                        in_host += 1
                        host_bytes += nbytes
                        if plan_access(key, now):
                            self._pf_count_use(nbytes, late=False)
                        if has_ttl and now >= self._next_expire:
                            self._expire(now)
                        planner.remove(HOST, key)
                        host.pop(key)
                        host.used -= nbytes
                    else:
                        miss += 1
                        miss_bytes += nbytes
                        plan_access(key, now)
                        if has_ttl and now >= self._next_expire:
                            self._expire(now)
                    install(key, nbytes, now)
                if prefetch is not None:
                    prefetch.after(key, now)
        finally:
            self._add_counts(device, in_host, miss, total, host_bytes, miss_bytes)

    def _access_many_l1(
        self, keys: Sequence[str], times: Sequence[float], sizes: Sequence[int]
    ) -> None:
        """`access_many_sync` with one tier and no prefetch (a policy replay): the same decisions
        in the same order, with L1's bookkeeping in locals and the policy's functions called
        straight (`Planner.direct`): replay's loop went from 0.64x to 0.71x the accesses per
        second of libCacheSim's LRU loop (`bench.replay_speed`). ``tests/test_replay.py`` checks
        that both loops leave the same counters and residency."""
        tier = self._tiers[DEVICE]
        entries, tier_sizes, budget = tier.entries, tier.sizes, tier.budget
        plan_access = self._plan_access
        victim, admit, remove, insert = self._planner.direct()
        state = self._pstate
        has_ttl = self._has_ttl
        device = miss = total = miss_bytes = 0
        try:
            for key, now, nbytes in zip(keys, times, sizes):
                total += nbytes
                if key in entries:
                    device += 1
                    plan_access(key, now)
                    if has_ttl and now >= self._next_expire:
                        self._expire(now)
                    continue
                miss += 1
                miss_bytes += nbytes
                plan_access(key, now)
                if has_ttl and now >= self._next_expire:
                    self._expire(now)
                if nbytes > budget:
                    continue  # larger than L1: never cached (as `_room_sync` refuses it)
                used = tier.used
                while used + nbytes > budget:
                    out = victim(DEVICE)
                    if out is None or (admit is not None and not admit(state, key, out)):
                        break
                    remove(DEVICE, out)
                    del entries[out]
                    used -= tier_sizes.pop(out, None) or self.info(out).nbytes
                else:
                    entries[key] = PRESENT
                    tier_sizes[key] = nbytes
                    used += nbytes
                    insert(DEVICE, key, now, nbytes)
                tier.used = used
        finally:
            self._add_counts(device, 0, miss, total, 0, miss_bytes)

    def _add_counts(
        self, device: int, host: int, miss: int, total: int, host_bytes: int, miss_bytes: int
    ) -> None:
        """Adds a replay loop's counters, kept in locals over the loop, to the cache's."""
        n = self._n
        n["device"] += device
        n["host"] += host
        n["miss"] += miss
        n["bytes"] += total
        n["host_bytes"] += host_bytes
        n["miss_bytes"] += miss_bytes

    def _install_sync(
        self, key: str, nbytes: int, now: float, prefetched: bool = False, rank: int = 1
    ) -> bool:
        """Replay: puts ``key`` in L1, else L2, as the planner admits; True if it went in."""
        l1, host, planner = self._tiers[DEVICE], self._host, self._planner
        if l1.used + nbytes <= l1.budget or self._room_sync(
            DEVICE, nbytes, key, now, prefetched, rank
        ):
            l1.used += nbytes
            l1.put_reserved(key, PRESENT, nbytes)
            planner.insert(DEVICE, key, now, nbytes, prefetched=prefetched, rank=rank)
            return True
        if host is not None and (
            host.used + nbytes <= host.budget
            or self._room_sync(HOST, nbytes, key, now, prefetched, rank)
        ):
            host.used += nbytes
            host.put_reserved(key, PRESENT, nbytes)
            planner.insert(HOST, key, now, nbytes, prefetched=prefetched, rank=rank)
            return True
        return False

    def _room_sync(
        self,
        tier_index: int,
        nbytes: int,
        key: str,
        now: float,
        prefetch: bool = False,
        rank: int = 1,
    ) -> bool:
        """`_make_room` and `_evict_one` for `access_sync`: the same decisions, no transfers.

        Evicts until ``nbytes`` fit in the tier and returns True, or returns False if the planner
        does not admit ``key``; the caller adds ``nbytes`` to the tier's ``used``.
        """
        tier = self._tiers[tier_index]
        if nbytes > tier.budget:
            return False
        planner = self._planner
        entries, sizes = tier.entries, tier.sizes
        host = self._host if tier_index == DEVICE else None  # victims of L1 go down to L2
        while tier.used + nbytes > tier.budget:
            victim = planner.victim(tier_index, key, prefetch=prefetch, rank=rank)
            if victim is None or victim is REFUSED:
                return False
            was_unused = planner.remove(tier_index, victim)
            del entries[victim]
            # Replay puts each block with its size (`_install_sync`); the store knows the rest.
            size = sizes.pop(victim, None) or self.info(victim).nbytes
            if was_unused:
                self._pf_count("wasted", size)
            elif host is not None and (
                host.used + size <= host.budget or self._room_sync(HOST, size, victim, now)
            ):
                host.used += size
                host.put_reserved(victim, PRESENT, size)
                planner.insert(HOST, victim, now, size)
            tier.used -= size
        return True

    # ----------------------------------------------------------------------------- miss path

    def _get_slow(self, key: str) -> jax.Array:
        if not isinstance(key, str):
            raise TypeError(f"block keys are str; got {type(key).__name__} {key!r}")
        while True:
            with self._lock:
                self._drain()
                step = self._begin(key)
            if step[0] == "hit":
                return step[1]
            if step[0] == "own":
                deadline = self._deadline()
                try:
                    future = self._read(key) if step[2] is None else None
                except BaseException as e:
                    self._abandon([(key, step[1], step[2])], e)
                    raise
                return self._finish(key, step[1], step[2], future, deadline)
            transit = step[1]
            transit.wait()
            if transit.error is not None:
                raise transit.error
            if transit.value is not None:
                return transit.value
            # The transit was a demotion or write-back: look again.

    def _begin(self, key: str) -> tuple:
        """Under the lock: classify one request as a hit, a wait on a transit, or a load we own.

        Returns ``("hit", value)``, ``("wait", transit)`` or ``("own", info, host_value_or_None)``.
        """
        now = self._clock()
        value = self._l1.get(key)
        if value is not None:
            self._account(key, "device", now, self.info(key).nbytes)
            return ("hit", value)
        transit = self._inflight.get(key)
        if transit is not None:
            if transit.prefetch and not transit.demanded:
                # A prefetch still loading: the access waits for it (a late prefetch, and a
                # demand miss as far as the counters go).
                transit.demanded = True
                nbytes = self.info(key).nbytes
                self._account(key, "miss", now, nbytes)
                self._pf_count_use(nbytes, late=True)
            return ("wait", transit)
        info = self.info(key)
        if self._check_dtypes:
            check_device_dtype(info.dtype, key)  # before anything changes
            if info.leaves and not self._tiers[DEVICE].holds_trees:
                raise TypeError(
                    f"block {key!r} is a pytree block; device_layout='slab' holds arrays only: "
                    "use device_layout='arrays'"
                )
        host = self._tiers[HOST] if len(self._tiers) > HOST else None
        if host is not None and key in host.entries:
            self._account(key, "host", now, info.nbytes)
            # The block leaves L2 now; its bytes are released so that L1's victim can take them.
            self._planner.remove(HOST, key)
            value = host.pop(key)
            host.release(info.nbytes)
        elif key in self._unwritten:
            self._account(key, "host", now, info.nbytes)
            value = self._unwritten[key]
        else:
            self._account(key, "miss", now, info.nbytes)
            value = None
        self._inflight[key] = _Transit()
        return ("own", info, value)

    def _account(self, key: str, where: str, now: float, nbytes: int) -> None:
        n = self._n
        n[where] += 1
        n["bytes"] += nbytes
        if where == "miss":
            n["miss_bytes"] += nbytes
        elif where == "host":
            n["host_bytes"] += nbytes
        if key in self._pins:
            return  # out of the policy's view while pinned
        if self._plan_access(key, now):
            self._pf_count_use(nbytes, late=False)
        if self._has_ttl:
            self._expire(now)

    def _deadline(self) -> float | None:
        """The monotonic time by which reads issued now must finish (None: no deadline)."""
        return None if self._l3_timeout is None else time.monotonic() + self._l3_timeout

    def _read_result(self, key: str, future: Any, deadline: float | None) -> Any:
        """Waits for an L3 read until ``deadline``; past it, `StoreTimeoutError` names the key."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return future.result(timeout=left)
        except TimeoutError as err:
            if isinstance(err, StoreError):
                raise
            raise StoreTimeoutError(
                f"reading block {key!r} from store {self.store.spec} did not finish within "
                f"l3_timeout={self._l3_timeout} s; the store may be unreachable or stopped. "
                "Blocks in L1/L2 are still served; check the store, or raise l3_timeout"
            ) from None

    def _abandon(self, owned: list[tuple[str, BlockInfo, Any]], error: BaseException) -> None:
        """Releases loads that were claimed in ``_begin`` but never started (a read failed)."""
        with self._lock:
            transits = []
            for key, _, source in owned:
                transit = self._inflight.pop(key, None)
                if source is not None:
                    self._leave(key, source, replace=False)  # never lose a runtime block
                if transit is not None:
                    transits.append(transit)
        for transit in transits:
            transit.finish(error=error)

    def _finish(
        self, key: str, info: BlockInfo, source: Any, future: Any, deadline: float | None = None
    ) -> Any:
        """Outside the lock: make room, finish the read, install in L1 (or L2), wake waiters."""
        transit = self._inflight[key]
        host_value = None
        try:
            in_l1 = self._make_room(DEVICE, info.nbytes, key)
            try:
                raw = self._read_result(key, future, deadline) if source is None else source
                value = self._tiers[DEVICE].load(raw, owned=True)
            except BaseException:
                if in_l1:
                    with self._lock:
                        self._tiers[DEVICE].release(info.nbytes)
                        self._notify_room()
                raise
            if not in_l1:
                host_value = self._load_host(key, info.nbytes, value)
            with self._lock:
                if in_l1:
                    self._tiers[DEVICE].put_reserved(key, value, info.nbytes)
                    self._planner.insert(DEVICE, key, self._clock(), info.nbytes)
                elif host_value is not None:
                    self._tiers[HOST].put_reserved(key, host_value, info.nbytes)
                    self._planner.insert(HOST, key, self._clock(), info.nbytes)
                if in_l1 or host_value is not None:
                    self._unwritten.pop(key, None)
                else:
                    self._leave(key, value, replace=False)  # never lose a runtime block
                del self._inflight[key]
                self._notify_room()
        except BaseException as e:
            with self._lock:
                self._inflight.pop(key, None)
                if source is not None:
                    self._leave(key, source, replace=False)  # never lose a runtime block
            transit.finish(error=e)
            raise
        transit.finish(value=value)
        self._wb.start()
        return value

    def _load_host(
        self, key: str, nbytes: int, value: Any, *, prefetch: bool = False, rank: int = 1
    ) -> Any:
        """Reserves room in L2 if the planner admits ``key`` and copies the value to host.

        Returns the host value (the caller installs it under the lock) or None if not admitted.
        """
        if len(self._tiers) <= HOST or not self._make_room(
            HOST, nbytes, key, prefetch=prefetch, rank=rank
        ):
            return None
        try:
            return self._tiers[HOST].load(value, owned=True)
        except BaseException:
            with self._lock:
                self._tiers[HOST].release(nbytes)
                self._notify_room()
            raise

    def _make_room(
        self,
        tier_index: int,
        nbytes: int,
        key: str | None,
        *,
        prefetch: bool = False,
        rank: int = 1,
    ) -> bool:
        """Reserves ``nbytes`` in a tier, evicting (demoting) victims as the planner says.

        Returns False when the newcomer ``key`` is not admitted (or nothing can be evicted);
        ``key=None`` skips admission (explicit puts). A ``prefetch`` newcomer never waits for
        room and displaces only what the planner lets a prefetch displace.
        """
        tier = self._tiers[tier_index]
        if nbytes > tier.budget:
            return False
        planner = self._planner
        while True:
            with self._lock:
                if tier.reserve(nbytes):
                    return True
                if planner.tracking:
                    self._drain()  # a buffered hit on an unused prefetch makes it used first
                victim = planner.victim(tier_index, key, prefetch=prefetch, rank=rank)
                if victim is None:
                    if prefetch or not self._inflight:
                        return False
                    if tier_index == DEVICE and self._pins.bytes + nbytes > tier.budget:
                        return False  # pins hold the room: no transfer will give it back
                    # Every byte is reserved by transfers in flight: wait (without the lock)
                    # until one of them releases room.
                    self._room_waiters += 1
                    try:
                        self._room.wait(0.01)
                    finally:
                        self._room_waiters -= 1
                    continue
                if victim is REFUSED:
                    return False
                was_unused = planner.remove(tier_index, victim)
                value = tier.pop(victim)
                if was_unused:
                    self._pf_count("wasted", self.info(victim).nbytes)
                self._inflight[victim] = _Transit()
                destination = planner.destination(tier_index, was_unused)
            self._evict_one(tier_index, victim, value, destination)

    def _evict_one(
        self, tier_index: int, key: str, value: Any, destination: int | None
    ) -> None:
        """Moves one victim down a tier (or out), then releases its room above."""
        nbytes = self.info(key).nbytes
        host_value = None
        try:
            if destination == HOST:
                host_value = self._load_host(key, nbytes, value)
        finally:
            with self._lock:
                if host_value is not None:
                    self._tiers[HOST].put_reserved(key, host_value, nbytes)
                    self._planner.insert(HOST, key, self._clock(), nbytes)
                else:
                    self._leave(key, value)  # written back later; readers are served from it
                self._tiers[tier_index].release(nbytes)
                transit = self._inflight.pop(key)
                self._notify_room()
            transit.finish()

    def _notify_room(self) -> None:
        """Under the lock: wakes threads waiting for room (cheap when there are none)."""
        if self._room_waiters:
            self._room.notify_all()

    def _resident(self, key: str) -> Any:
        """Under the lock: the value of ``key`` in L1 or L2, or None."""
        for tier in self._tiers:
            value = tier.entries.get(key)
            if value is not None:
                return value
        return None

    def _read(self, key: str) -> Any:
        return self._time_reads([key], [self.store.read(key)])[0]

    def _read_many(self, keys: list[str]) -> list[Any]:
        return self._time_reads(keys, self.store.read_many(keys)) if keys else []

    def _time_reads(self, keys: list[str], futures: list[Any]) -> list[Any]:
        """Wraps a batch of L3 reads so that their count, bytes and time are recorded.

        The time is from issuing the batch until the last of its reads was collected. Reads
        issued together overlap, so this is the batch's wall time, not the sum of its reads'
        times, and bytes / seconds is the bandwidth L3 gave.
        """
        batch = _ReadBatch(self, sum(self.info(k).nbytes for k in keys), len(futures))
        return [_TimedRead(f, batch) for f in futures]

    # -------------------------------------------------------------------------- bookkeeping

    def _drain(self) -> None:
        """Under the lock: applies buffered hits to the policy."""
        reads = self._reads
        count = len(reads)  # hits buffered after this snapshot wait for the next drain
        if not count:
            return
        now = self._clock()
        planner, popleft = self._planner, reads.popleft
        size_of = self._tiers[DEVICE].sizes.get
        nbytes = 0
        if self._pins:
            # Hits on pinned blocks are counted, but the policy does not see them (`_pins`).
            pins, access = self._pins, planner.access
            for _ in range(count):
                key = popleft()
                size = size_of(key) or self.info(key).nbytes
                nbytes += size
                if key not in pins and access(key, now):
                    self._pf_count_use(size, late=False)
        elif planner.unused_blocks or planner.foreseen_blocks():
            # Some prefetched blocks wait for their first use, or were foreseen (they leave
            # first unless hit again): the planner checks each hit.
            access = planner.access
            for _ in range(count):
                key = popleft()
                # The block was in L1 when hit; if it left since, look its size up in the store.
                size = size_of(key) or self.info(key).nbytes
                nbytes += size
                if access(key, now):
                    self._pf_count_use(size, late=False)
        else:
            # `Planner.access` without a guess to look for: the policy's access, and the count.
            policy_access, state = self.policy.access, planner.state
            for _ in range(count):
                key = popleft()
                nbytes += size_of(key) or self.info(key).nbytes
                policy_access(state, key, now)
            if planner.tracking:
                planner.count += count
        n = self._n
        n["device"] += count
        n["bytes"] += nbytes
        if self._has_ttl:
            self._expire(now)

    def _expire(self, now: float) -> None:
        """Under the lock: evicts residents past the policy's TTL (dirty ones go to L3)."""
        if now < self._next_expire:
            return
        self._next_expire = now + self._expire_every
        for tier_index, tier in enumerate(self._tiers):
            for key in self._planner.expired(tier_index, now):
                if self._planner.remove(tier_index, key):
                    self._pf_count("wasted", self.info(key).nbytes)
                value = tier.pop(key)
                tier.release(self.info(key).nbytes)
                self._leave(key, value)  # the write starts after the lock is released

    def kind(self, key: str) -> str:
        """The access-log kind of a block (``weight``, ``embedding``, ``kv`` or ``other``)."""
        kind = self._kinds.get(key)
        return kind if kind is not None else kind_of(self.info(key))

    def info(self, key: str) -> BlockInfo:
        """The block's metadata (shape, dtype, nbytes). Raises ``KeyError`` naming the key."""
        info = self._runtime.get(key)
        if info is not None:
            return info
        return self.store.info(key)

    # ------------------------------------------------------------------------- runtime blocks

    def put(self, key: str, value: Any, *, kind: str = "kv", writeback: bool = True) -> None:
        """Stores a runtime block (for example a KV block keyed by prefix hash) in L1.

        The block is an array, or a pytree of arrays (a ``dict``/``list``/``tuple`` tree, for
        example per-layer K and V; see `cacheflow_jax.core.pytree`): one key, one budget entry and
        one file in L3, and `get` returns the same structure, bitwise, from every tier.

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
        check_runtime_key(key, self.store.spec)
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} for {key!r} must be one of {KINDS}")
        value = _as_block(key, value)
        info = block_info(key, value)
        nbytes = info.nbytes
        device = self._tiers[DEVICE]
        if nbytes > device.budget:
            raise BudgetError(
                f"runtime block {key!r} has {nbytes} bytes, more than "
                f"device_bytes={device.budget}; split it or raise device_bytes"
            )
        if writeback and nbytes > self._wb.budget:
            raise BudgetError(
                f"runtime block {key!r} has {nbytes} bytes, more than "
                f"writeback_bytes={self._wb.budget}; split it or raise writeback_bytes"
            )
        if info.leaves and not device.holds_trees:
            raise TypeError(
                f"cannot put pytree block {key!r}: device_layout='slab' holds arrays only; "
                "use device_layout='arrays' or put each leaf under its own key"
            )
        value = device.load(value)
        deadline = self._deadline()
        stalled = None  # when the put started waiting for write-back room
        wb = self._wb
        while True:
            with self._lock:
                self._drain()
                self._pins.check_put(key, nbytes, device.budget)
                transit = self._inflight.get(key)
                durable = writeback or wb.is_dirty(key) or self.store.holds(key)
                if durable and nbytes > wb.budget:
                    raise BudgetError(
                        f"runtime block {key!r} must be written back (L3 holds an earlier "
                        f"version) and has {nbytes} bytes, more than writeback_bytes="
                        f"{wb.budget}; raise writeback_bytes"
                    )
                if transit is None and (not durable or nbytes <= wb.room(key)):
                    self._discard(key)
                    self._runtime[key] = info
                    self._kinds[key] = kind
                    if durable:
                        wb.record_put(key, nbytes)
                        self._volatile.discard(key)
                    else:
                        self._volatile.add(key)
                    self._inflight[key] = transit = _Transit()
                    self._planner.access(key, self._clock())
                    if stalled is not None:
                        wb.count_stall(time.perf_counter() - stalled)
                    break
            if transit is not None:
                transit.wait()
                continue
            if stalled is None:
                stalled = time.perf_counter()
            wb.wait_for_room(key, nbytes, deadline, self._l3_timeout)
        try:
            if not self._make_room(DEVICE, nbytes, None):
                raise self._pins.no_room(key, nbytes, device.budget)
            with self._lock:
                device.put_reserved(key, value, nbytes)
                self._planner.insert(DEVICE, key, self._clock(), nbytes)
                del self._inflight[key]
                self._notify_room()
        except BaseException as e:
            with self._lock:
                self._leave(key, value)
                self._inflight.pop(key, None)
            transit.finish(error=e)
            raise
        transit.finish(value=value)
        wb.start()

    def _leave(self, key: str, value: Any, *, replace: bool = True) -> None:
        """Under the lock: a runtime block left L1/L2 (or could not go in) with ``value``.

        A dirty block is parked for its write-back; a block put with ``writeback=False`` is
        dropped and forgotten (a later `get` raises `KeyError`, as for a key never put).
        """
        if key in self._volatile:
            self._volatile.discard(key)
            self._runtime.pop(key, None)
            self._kinds.pop(key, None)
        else:
            self._wb.park(key, value, replace=replace)

    def _discard(self, key: str) -> None:
        """Under the lock: forgets the cached copy of ``key`` (superseded by a new put)."""
        for tier_index, tier in enumerate(self._tiers):
            if key in tier.entries:
                self._planner.remove(tier_index, key)
                tier.pop(key)
                tier.release(self.info(key).nbytes)
        self._unwritten.pop(key, None)

    # ------------------------------------------------------------------------------ control

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
        for tier in self._tiers:
            if key in tier.entries:
                return tier.name
        return None

    def evict(self, key: str) -> bool:
        """Evicts ``key`` from L1 and L2 (writing a runtime block back); returns if it was there.

        Raises:
          ValueError: ``key`` is pinned.
        """
        with self._lock:
            self._drain()
            if key in self._pins:
                raise ValueError(
                    f"cannot evict {key!r}: it is pinned by a running request (cache.pinned); "
                    "it leaves when the request releases it"
                )
            for tier_index, tier in enumerate(self._tiers):
                if key in tier.entries:
                    if self._planner.remove(tier_index, key):
                        self._pf_count("wasted", self.info(key).nbytes)
                    value = tier.pop(key)
                    tier.release(self.info(key).nbytes)
                    self._leave(key, value)
                    break
            else:
                return False
        self._wb.start()
        return True

    # --------------------------------------------------------------- KV: lookup and pins

    def cached_prefix(self, keys: Iterable[str]) -> int:
        """How many leading ``keys`` the cache holds in any tier (L1, L2, in transit or L3).

        For a request's chain of prefix keys (`cacheflow_jax.kv.prefix_keys`): its first
        ``cached_prefix(keys)`` blocks need no prefill. Nothing is read, and the policy does not
        count it as an access.
        """
        n = 0
        for key in keys:
            if self.locate(key) is None:
                break
            n += 1
        return n

    def locate(self, key: str) -> str | None:
        """Where ``key`` is, without reading it: ``"device"``, ``"host"`` (L2, or in host memory
        waiting for its write-back), ``"moving"`` (between tiers), ``"store"`` (L3 only), or
        None (no such block)."""
        for tier in self._tiers:
            if key in tier.entries:
                return tier.name
        if key in self._unwritten:
            return "host"
        if key in self._inflight:
            return "moving"
        if key in self._runtime or self.store.holds(key):
            return "store"
        return None

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
        found = [k for k in keys if self.locate(k) is not None]
        missing = [k for k in keys if self.locate(k) is None]
        return dict(zip(found, self.get_many(found))), missing

    def get_many_async(self, keys: Iterable[str]) -> Future:
        """Starts `get_many` on a background thread; returns its `concurrent.futures.Future`.

        Lets a serving loop overlap the L3 reads of queued requests' blocks with the current
        step (``future.result()`` gives the list of blocks, or raises as `get_many` does).
        """
        from cacheflow_jax.store.futures import thread_pool

        keys = list(keys)
        return thread_pool("get", 4).submit(self.get_many, keys)

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
        values = self._pin(keys)
        try:
            yield values
        finally:
            self._unpin(keys)

    def _pin(self, keys: list[str]) -> list[jax.Array]:
        device, pins = self._tiers[DEVICE], self._pins
        held: dict[str, Any] = {}
        try:
            for _ in range(3):  # a block evicted between its get and its pin is got again
                todo = [k for k in dict.fromkeys(keys) if k not in held]
                if not todo:
                    break
                self.get_many(todo)
                with self._lock:
                    self._drain()
                    for key in todo:
                        value = self._l1.get(key)
                        if value is None:
                            continue
                        nbytes = device.sizes.get(key)
                        if pins.add(key, self.info(key).nbytes if nbytes is None else nbytes):
                            self._planner.remove(DEVICE, key)
                        held[key] = value
            left = [k for k in keys if k not in held]
            if left:
                with self._lock:
                    raise pins.no_room(left[0], self.info(left[0]).nbytes, device.budget)
        except BaseException:
            self._unpin(list(held))
            raise
        return [held[k] for k in keys]

    def _unpin(self, keys: list[str]) -> None:
        with self._lock:
            now = self._clock()
            for key in dict.fromkeys(keys):
                nbytes = self._pins.remove(key)
                if nbytes is not None and key in self._l1:
                    self._planner.insert(DEVICE, key, now, nbytes)
            self._notify_room()

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
        with self._lock:
            self._drain()
        self._wb.flush(self._l3_timeout if timeout is None else timeout)

    def wait_until_finished(self, *, timeout: float | None = None) -> None:
        """Waits for the write-backs in flight; raises the first error (the data stays in memory)."""
        self._wb.wait_until_finished(timeout)

    def check_for_errors(self) -> None:
        """Raises the first recorded write-back error, once."""
        self._wb.check_for_errors()

    # ------------------------------------------------------------------------------ prefetch

    def _setup_prefetch(self, predictor: Predictor, settings: PrefetchSettings, largest: int) -> None:
        """Builds the scheduler; starts the live worker, or the replay/synchronous driver."""
        self._pf_limit = settings.inflight_bytes or max(largest, self._tiers[DEVICE].budget // 4)
        replay = isinstance(self._tiers[DEVICE], MetadataTier)
        seen: set[str] | None = None if settings.keys_known or not replay else set()

        def fetchable(key: str) -> bool:
            if seen is not None:
                return key in seen
            try:
                self.info(key)
            except (KeyError, TypeError):
                return False
            return True

        def describe(key: str) -> tuple[int, str]:
            info = self.info(key)
            return info.nbytes, self._kinds.get(key) or kind_of(info)

        self._pf_scheduler = PrefetchScheduler(
            predictor,
            settings,
            describe=describe,
            fetchable=fetchable,
            admission=self._planner.admission,
        )
        if replay or settings.synchronous:
            self._pf_replay = _ReplayPrefetch(self, settings, seen, data=not replay)
            if not replay:
                self.get = self._get_synchronous  # type: ignore[method-assign]
                self.get_many = self._get_many_synchronous  # type: ignore[method-assign]
        else:
            self._pf_promote = settings.promote
            self.start_prefetch()

    def start_prefetch(self) -> None:
        """Starts the background prefetch worker (if this cache prefetches and it is stopped).

        `serving` calls it on entry; the constructor already did for a new cache.
        """
        if self._pf_scheduler is None or self._pf_replay is not None:
            return
        if self._pf_worker is not None and self._pf_worker.alive:
            return
        self._pf_worker = worker = PrefetchWorker(self, self._pf_scheduler)
        # `get` with the feed: `TieredCache.get`'s hit path over local names, plus one append
        # (the hit path is the cost that matters; bench.hit_cost measures it).
        l1_get, reads, read_buffer = self._l1.get, self._reads, self._read_buffer
        apply_hits, get_slow, feed = self._apply_hits, self._get_slow, worker.feed.append

        def get(key: str, req: str | None = None) -> jax.Array:
            value = l1_get(key)
            if value is not None:
                reads.append(key)
                if len(reads) >= read_buffer:
                    apply_hits()
            else:
                value = get_slow(key)
            feed(key)
            if worker.idle:
                worker.poke()
            return value

        get.__doc__ = TieredCache.get.__doc__
        self.get = get  # type: ignore[method-assign]
        self.get_many = self._get_many_feeding  # type: ignore[method-assign]

    def stop_prefetch(self) -> None:
        """Stops the prefetch worker: no thread is left and no load lands after this returns.

        Loads still in flight are abandoned (a waiting access reads the block itself). `serving`
        calls it on exit; `start_prefetch` starts again.
        """
        worker = self._pf_worker
        if worker is None:
            return
        self.__dict__.pop("get", None)
        self.__dict__.pop("get_many", None)
        self._pf_worker = None
        worker.stop()

    def pause_prefetch(self, paused: bool) -> None:
        """While paused, accesses still teach the predictor, but no prefetch is issued."""
        if self._pf_replay is not None:
            self._pf_replay.paused = paused
        elif self._pf_worker is not None:
            self._pf_worker.paused = paused

    def reset_counters(self) -> None:
        """Zeroes the hit, miss, prefetch and write-back counters (the contents stay)."""
        with self._lock:
            self._drain()
            for name in self._n:
                self._n[name] = 0
            for name in self._pf:
                self._pf[name] = 0
            self._wb.reset_counts()

    def close(self) -> None:
        """Stops prefetching and writes every dirty block back (`flush`)."""
        self.stop_prefetch()
        self.flush()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get_many_feeding(self, keys: Iterable[str], req: str | None = None) -> list[jax.Array]:
        """`get_many` with a prefetch worker: the batch goes to the feed as one item."""
        keys = list(keys)
        values = TieredCache.get_many(self, keys)
        worker = self._pf_worker
        if worker is not None:
            worker.feed.append(tuple(keys))
            if worker.idle:
                worker.poke()
        return values

    def _get_synchronous(self, key: str, req: str | None = None) -> jax.Array:
        """`get` with ``PrefetchSettings(synchronous=True)``: prefetches as replay does."""
        replay = self._pf_replay
        assert replay is not None
        now = self._clock()
        replay.before(key, now)
        value = TieredCache.get(self, key)
        replay.after(key, now)
        return value

    def _get_many_synchronous(self, keys: Iterable[str], req: str | None = None) -> list[jax.Array]:
        """`get_many` with synchronous prefetch: one access at a time, in order."""
        return [self._get_synchronous(key) for key in keys]

    def _pf_count(self, name: str, nbytes: int) -> None:
        pf = self._pf
        pf[name] += 1
        pf[name + "_bytes"] += nbytes
        if name in _READ_OUTCOMES:
            self._pf_reads.outcome(name == "timely")

    def _pf_count_use(self, nbytes: int, *, late: bool) -> None:
        """Under the lock: a prefetched block was asked for (timely: resident; late: loading)."""
        self._pf_count("used", nbytes)
        self._pf_count("late" if late else "timely", nbytes)

    def _pf_fresh(self, key: str) -> bool:
        """Under the lock: ``key`` is not resident, moving or waiting for a write-back."""
        host = self._host
        return not (
            key in self._l1
            or (host is not None and key in host.entries)
            or key in self._inflight
            or key in self._unwritten
        )

    def _prefetch_issue(
        self, key: str, worker: PrefetchWorker, rank: int, *, promote: bool = True
    ) -> str:
        """Starts one prefetch load (worker thread); ``rank``: see `Planner.victim`.

        A key resident in L2 is promoted to L1 instead (`_prefetch_promote`), when the settings
        allow it; with ``promote=False`` it is left for the caller to promote later.

        Returns ``"issued"``, ``"skip"`` (resident, moving, unknown, or unusable), ``"full"``
        (the in-flight bytes are at their bound) or ``"promote"`` (in L2, ``promote=False``).
        """
        with self._lock:
            if not self._pf_fresh(key):
                host = self._host
                if not (
                    self._pf_promote
                    and host is not None
                    and key in host.entries
                    and key not in self._inflight
                ):
                    return "skip"
                if not promote:
                    return "promote"
                in_host = host.sizes.get(key) or self.info(key).nbytes
            else:
                in_host = 0
        if in_host:
            return self._prefetch_promote(key, in_host, rank)
        with self._lock:
            if not self._pf_fresh(key):
                return "skip"
            try:
                info = self.info(key)
            except KeyError:
                return "skip"
            if self._check_dtypes and _narrowed(info.dtype):
                return "skip"  # a demand get raises DtypeError for it; a prefetch must not
            if self._pf_inflight + info.nbytes > self._pf_limit:
                return "full"
            if not self._pf_reads.allows():
                return "skip"
            self._inflight[key] = transit = _Transit(prefetch=True)
            transit.rank = rank
            self._pf_inflight += info.nbytes
            self._pf_count("issued", info.nbytes)
        try:
            future = self._read(key)
        except Exception:
            self._prefetch_fail(key, info.nbytes, None)
            return "skip"
        future.add_done_callback(lambda f: worker.arrive(key, f))
        return "issued"

    def _prefetch_promote(self, key: str, nbytes: int, rank: int) -> str:
        """Moves an L2 block the predictor expects soon up to L1 (worker thread).

        The layer-ahead step of MoE offloading: the host copy goes to the device before the
        access. As on a demand L2 hit, the block leaves L2 first, so that L1's victim, demoted,
        takes its room there: a promotion swaps two blocks and pushes nothing out of the cache.
        L1 takes it only with prefetch admission (`Planner.victim`); refused, it goes back to
        L2 and nothing else moves. It keeps its policy state and last access, as a demotion
        does, so a promotion that is not used is demoted again in its turn instead of leaving
        the cache. Counted in ``promoted`` (not in ``issued``: no L3 read).

        Returns:
          ``"issued"`` if it moved, else ``"skip"``.
        """
        with self._lock:
            host = self._host
            if host is None or key not in host.entries or key in self._inflight or key in self._l1:
                return "skip"  # it moved meanwhile
            self._planner.remove(HOST, key, moving=True)
            raw = host.pop(key)
            host.release(nbytes)
            self._inflight[key] = transit = _Transit()
            self._notify_room()
        value = None
        try:
            if self._make_room(DEVICE, nbytes, key, prefetch=True, rank=rank):
                try:
                    value = self._tiers[DEVICE].load(raw, owned=True)
                finally:
                    if value is None:
                        with self._lock:
                            self._tiers[DEVICE].release(nbytes)
        finally:
            back = value is None and self._make_room(HOST, nbytes, None)
            with self._lock:
                if value is not None:
                    self._tiers[DEVICE].put_reserved(key, value, nbytes)
                    self._planner.insert(DEVICE, key, self._clock(), nbytes)
                    self._pf_count("promoted", nbytes)
                elif back:  # refused by L1 (or the copy failed): it stays in L2
                    host.put_reserved(key, raw, nbytes)
                    self._planner.insert(HOST, key, self._clock(), nbytes)
                else:
                    self._leave(key, raw)  # never lose a runtime block
                del self._inflight[key]
                self._notify_room()
            transit.finish()  # an access that waited looks again and finds it where it is
        return "issued" if value is not None else "skip"

    def _prefetch_fail(self, key: str, nbytes: int, error: BaseException | None) -> None:
        """A prefetch load failed or was abandoned: forget it; a waiting access gets the error
        (or, with none, reads the block itself)."""
        with self._lock:
            transit = self._inflight.get(key)
            if transit is None or not transit.prefetch:
                return
            del self._inflight[key]
            self._pf_inflight -= nbytes
            self._pf_count("dropped", nbytes)
            demanded = transit.demanded
            self._notify_room()
        transit.finish(error=error if demanded else None)

    def _prefetch_install(self, key: str, future: Any) -> None:
        """Installs an arrived prefetch (worker thread): L3 -> host buffer -> device.

        A block nobody asked for yet goes in with prefetch admission (L1, else L2, else it is
        dropped); one an access is waiting for is installed as a demand load and handed over.
        """
        transit = self._inflight.get(key)
        if transit is None or not transit.prefetch:
            return  # abandoned
        nbytes = self.info(key).nbytes
        try:
            raw = future.result(timeout=0)
        except BaseException as err:
            self._prefetch_fail(key, nbytes, err)
            return
        demanded = transit.demanded
        value = host_value = None
        try:
            in_l1 = self._make_room(
                DEVICE, nbytes, key, prefetch=not transit.demanded, rank=transit.rank
            )
            if in_l1 or transit.demanded:
                try:
                    value = self._tiers[DEVICE].load(raw, owned=True)
                except BaseException:
                    if in_l1:
                        with self._lock:
                            self._tiers[DEVICE].release(nbytes)
                    raise
            if not in_l1:
                host_value = self._load_host(
                    key, nbytes, raw, prefetch=not transit.demanded, rank=transit.rank
                )
            with self._lock:
                demanded = transit.demanded  # an access may have come meanwhile
                now = self._clock()
                guess = {"prefetched": not demanded, "rank": transit.rank}
                if in_l1:
                    self._tiers[DEVICE].put_reserved(key, value, nbytes)
                    self._planner.insert(DEVICE, key, now, nbytes, **guess)
                elif host_value is not None:
                    self._tiers[HOST].put_reserved(key, host_value, nbytes)
                    self._planner.insert(HOST, key, now, nbytes, **guess)
                else:
                    self._pf_count("dropped", nbytes)
                del self._inflight[key]
                self._pf_inflight -= nbytes
                self._notify_room()
        except BaseException as err:
            with self._lock:
                if self._inflight.get(key) is transit:
                    del self._inflight[key]
                    self._pf_inflight -= nbytes
                    self._pf_count("dropped", nbytes)
                self._notify_room()
            transit.finish(error=err if transit.demanded else None)
            return
        if demanded and value is None:
            value = self._tiers[DEVICE].load(raw, owned=True)
        transit.finish(value=value if demanded else None)

    def _prefetch_abandon(self, worker: PrefetchWorker) -> None:
        """The worker stopped: drops its loads still in flight (worker thread, last)."""
        with self._lock:
            mine = [(k, self.info(k).nbytes) for k, t in self._inflight.items() if t.prefetch]
        for key, nbytes in mine:
            self._prefetch_fail(key, nbytes, None)

    # -------------------------------------------------------------------------------- stats

    def stats(self) -> dict:
        """Counters in the shape of ``cacheflow replay --json`` (see docs/design.md).

        Besides the replay fields: ``tiers`` (per tier ``used``, ``budget`` and ``blocks``),
        ``bytes`` (bytes requested, and served from the device, from the host, and from L3),
        ``l3`` (L3 reads, their bytes, and the seconds from issuing each batch of reads until
        its last one ended) and ``writebacks`` (runtime blocks written to L3: ``count`` and
        ``bytes``; ``superseded``: writes the store refused because a later version was there;
        ``stalls`` and ``stall_seconds``: puts that waited for write-back room, and how long;
        ``dirty_bytes``: bytes not yet durable).
        """
        with self._lock:
            self._drain()
            n = dict(self._n)
            pf = dict(self._pf)
            with self._l3_lock:
                l3: dict[str, Any] = dict(self._l3)
            tiers = {t.name: {"used": t.used, "budget": t.budget, "blocks": len(t.entries)}
                     for t in self._tiers}  # fmt: skip
            tiers[self._tiers[DEVICE].name]["pinned_bytes"] = self._pins.bytes
            tiers[self._tiers[DEVICE].name]["pinned_blocks"] = len(self._pins.counts)
            policy = self._planner.describe()
            adm = self._planner.admission
            admission = adm.describe() if adm is not None else None
            writebacks = dict(self._wb.counts, dirty_bytes=self._wb.dirty_bytes)
            foresight = self._planner.foresight
            if admission is not None and foresight is not None:
                admission["foresight"] = foresight.describe()
        if _tensorstore_store(self.store):
            l3.update(self.store.read_stats())  # bytes read vs served (read amplification)
        requests = n["device"] + n["host"] + n["miss"]
        scheduler = self._pf_scheduler
        prefetch: dict[str, Any] = dict(pf)
        prefetch["accuracy"] = _ratio(pf["used"], pf["issued"])
        prefetch["coverage"] = _ratio(pf["timely"], pf["timely"] + n["miss"])
        prefetch["enabled"] = scheduler is not None and scheduler.disabled is None
        if scheduler is not None:
            prefetch["disabled_reason"] = scheduler.disabled
            prefetch["predictions"] = scheduler.predictions
            prefetch["predict_us"] = _ratio(scheduler.predict_seconds * 1e6, scheduler.predictions)
            gate = self._pf_reads
            prefetch["read_gate"] = {
                "open": gate.good >= gate.bad, "timely": round(gate.good, 1),
                "other": round(gate.bad, 1), "held_back": gate.shut,
            }  # fmt: skip
        if admission is not None:
            prefetch["admission"] = admission
        return {
            "requests": requests,
            "hits": {"device": n["device"], "host": n["host"]},
            "misses": n["miss"],
            "device_miss_ratio": _ratio(requests - n["device"], requests),
            "miss_ratio": _ratio(n["miss"], requests),
            "byte_miss_ratio": _ratio(n["miss_bytes"], n["bytes"]),
            "prefetch": prefetch,
            "policy": policy,
            "tiers": tiers,
            "bytes": {
                "requested": n["bytes"],
                "device": n["bytes"] - n["host_bytes"] - n["miss_bytes"],
                "host": n["host_bytes"],
                "miss": n["miss_bytes"],
            },
            "l3": l3,
            "writebacks": writebacks,
        }

    def check_budgets(self) -> None:
        """Raises AssertionError if any tier holds more bytes than its budget (for tests)."""
        with self._lock:
            for tier in self._tiers:
                resident = sum(self.info(k).nbytes for k in tier.entries)
                if not (0 <= resident <= tier.used <= tier.budget):
                    raise AssertionError(
                        f"{tier.name}: resident={resident} used={tier.used} budget={tier.budget}"
                    )


class _ReadBatch:
    """L3 reads issued together; records them in the cache's counters when the last is collected."""

    __slots__ = ("_cache", "_nbytes", "_left", "_count", "_start")

    def __init__(self, cache: TieredCache, nbytes: int, count: int) -> None:
        self._cache = cache
        self._nbytes = nbytes
        self._left = self._count = count
        self._start = time.perf_counter()

    def collected(self) -> None:
        cache = self._cache
        with cache._l3_lock:
            self._left -= 1
            if self._left:
                return
            l3 = cache._l3
            l3["reads"] += self._count
            l3["read_bytes"] += self._nbytes
            l3["read_seconds"] += time.perf_counter() - self._start


class _TimedRead:
    """A store's read future whose first ``result()`` (value or error) counts for its batch."""

    __slots__ = ("_future", "_batch")

    def __init__(self, future: Any, batch: _ReadBatch) -> None:
        self._future = future
        self._batch: _ReadBatch | None = batch

    def result(self, timeout: float | None = None) -> Any:
        try:
            value = self._future.result(timeout)
        except TimeoutError:
            raise  # still pending: not collected yet
        except BaseException:
            self._collected()
            raise
        self._collected()
        return value

    def _collected(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.collected()

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        self._future.add_done_callback(lambda _: fn(self))


class _ReplayPrefetch:
    """Prefetch driven access by access, as replay does (and the live cache when synchronous).

    After access ``i`` the scheduler observes it and proposes keys; each fetchable one that is not
    resident or pending is issued (within the in-flight byte bound) and lands just before access
    ``i + lead``, through the planner's prefetch admission. An access to a key still pending is a
    late prefetch: it counts as a demand miss and the pending load is dropped. With ``data``
    (the live cache) the loads really read L3 and land in the tiers with their bytes.
    """

    def __init__(
        self, cache: TieredCache, settings: PrefetchSettings, seen: set[str] | None, *, data: bool
    ) -> None:
        self.cache = cache
        self.lead = settings.lead
        self.seen = seen
        self.data = data
        self.index = 0  # the index of the next access
        self.pending: dict[str, tuple[int, int]] = {}  # key -> (nbytes, rank), not landed
        self.due: dict[int, list[str]] = {}  # access index -> keys that land just before it
        self.futures: dict[str, Any] = {}  # live: key -> read future
        self.paused = False  # accesses teach the predictor, but nothing is issued

    def before(self, key: str, now: float) -> None:
        """Lands the loads due before this access; counts a late one for ``key``."""
        cache = self.cache
        due = self.due.pop(self.index, None)
        if due:
            for k in due:
                issued = self.pending.pop(k, None)
                if issued is None:
                    continue  # an access already took it (late)
                nbytes, rank = issued
                cache._pf_inflight -= nbytes
                if self.data:
                    self._land_live(k, rank)
                elif not cache._install_sync(k, nbytes, now, prefetched=True, rank=rank):
                    cache._pf_count("dropped", nbytes)
        issued = self.pending.pop(key, None)
        if issued is not None:
            nbytes = issued[0]
            cache._pf_inflight -= nbytes
            cache._pf_count_use(nbytes, late=True)  # the access below counts as the miss
            if self.data:
                self._drop_live(key)

    def after(self, key: str, now: float) -> None:
        """Gives the access to the scheduler and issues the loads it proposes."""
        cache = self.cache
        scheduler = cache._pf_scheduler
        assert scheduler is not None
        self.index += 1
        if self.seen is not None:
            self.seen.add(key)
        scheduler.observe(key, now)
        if self.paused:
            return
        land = self.index + self.lead - 1
        candidates = scheduler.candidates()
        cache._planner.ranking = {k: rank + 1 for rank, (k, _) in enumerate(candidates)}
        for rank, (k, _) in enumerate(candidates):
            if k in self.pending or not cache._pf_fresh(k):
                continue
            nbytes = cache.info(k).nbytes
            if cache._pf_inflight + nbytes > cache._pf_limit:
                break
            self.pending[k] = (nbytes, rank + 1)
            self.due.setdefault(land, []).append(k)
            cache._pf_inflight += nbytes
            cache._pf_count("issued", nbytes)
            if self.data:
                self.futures[k] = cache._read(k)

    def _land_live(self, key: str, rank: int) -> None:
        cache = self.cache
        future = self.futures.pop(key)
        with cache._lock:
            cache._inflight[key] = transit = _Transit(prefetch=True)
            transit.rank = rank
            cache._pf_inflight += cache.info(key).nbytes
        future.result(timeout=cache._l3_timeout)  # the read finishes before the next access
        cache._prefetch_install(key, future)

    def _drop_live(self, key: str) -> None:
        self.futures.pop(key, None)


def _error_of(future: Any) -> BaseException | None:
    try:
        future.result()
    except BaseException as e:
        return e
    return None


def _as_block(key: str, value: Any) -> Any:
    """``value`` as a block the device holds exactly: a numeric numpy or JAX array, or a pytree
    of them (`_pytree`), else an error naming the key (and the leaf's path in a tree)."""
    if not is_tree(value):
        return _as_array(key, value)
    leaves, _ = flatten(value, key)
    for path, leaf in leaves:
        if not _has_dtype(leaf):
            raise TypeError(
                f"cannot put {key!r}: the leaf at {path} is a {type(leaf).__name__}; the leaves "
                "of a pytree block are numpy or JAX arrays"
            )
        _as_array(f"{key}{path}", leaf)
    return value


def _has_dtype(leaf: Any) -> bool:
    import jax
    import numpy as np

    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def _as_array(key: str, array: Any) -> Any:
    """``array`` as a numeric numpy or JAX array that the device holds exactly, else an error."""
    import jax
    import numpy as np

    if not isinstance(array, jax.Array | np.ndarray):
        try:
            typed = isinstance(array, np.generic)  # a numpy scalar has a dtype of its own
            array = np.asarray(array)
            if not typed and array.dtype.kind in "biufc":
                # Python numbers and lists have no dtype of their own; like jnp.asarray, give
                # them JAX's default one (int32/float32 while jax_enable_x64 is off).
                array = array.astype(jax.dtypes.canonicalize_dtype(array.dtype), copy=False)
        except Exception as err:
            raise TypeError(
                f"cannot put {key!r}: a {type(array).__name__} is not an array ({err}); put a "
                "numpy or JAX array"
            ) from None
    dtype = np.dtype(array.dtype)
    if not _numeric(dtype):
        raise TypeError(
            f"cannot put {key!r}: dtype {dtype} is not a numeric array dtype; put a numpy or JAX "
            "array of numbers"
        )
    check_device_dtype(dtype, key)
    return array


def _tensorstore_store(store: Any) -> bool:
    """Whether ``store`` is a `TensorStoreStore` (without importing TensorStore to find out:
    if the store module was never imported, no such store exists)."""
    module = sys.modules.get("cacheflow_jax.store.tensorstore_store")
    return module is not None and isinstance(store, module.TensorStoreStore)


def _narrowed(dtype: Any) -> bool:
    """Whether JAX would narrow ``dtype`` on the way to the device (64-bit, x64 off)."""
    import jax
    import numpy as np

    return np.dtype(dtype) != jax.dtypes.canonicalize_dtype(dtype)


def _to_host(value: Any) -> np.ndarray:
    """A block (an array, or a pytree of arrays) as numpy arrays on the host."""
    if type(value) in TREES:
        return tree_map(_leaf_to_host, value)
    return _leaf_to_host(value)


def _leaf_to_host(value: Any) -> np.ndarray:
    import jax
    import numpy as np

    return np.asarray(jax.device_get(value)) if isinstance(value, jax.Array) else np.asarray(value)


_READ_OUTCOMES = frozenset(("timely", "late", "wasted", "dropped"))


class ReadGate:
    """Whether the live worker may start another L3 prefetch read: while its recent loads were
    used in time at least as often as they came late, went unused or were dropped.

    A timely load saves a demand read; the others cost a read of the store and the cores that
    the demand reads and the model need (replay counts no such cost, and has no gate). Counts
    are halved past `HALF` outcomes, so the gate follows a stream that changes; while it is shut,
    one read in `EXPLORE` goes ahead so that the rate is still measured.
    """

    PRIOR = 2.0  # timely loads assumed at first: a cold cache reads
    HALF = 256.0
    EXPLORE = 16

    __slots__ = ("good", "bad", "shut")

    def __init__(self) -> None:
        self.good, self.bad, self.shut = self.PRIOR, 0.0, 0

    def outcome(self, timely: bool) -> None:
        if timely:
            self.good += 1.0
        else:
            self.bad += 1.0
        if self.good + self.bad > self.HALF:
            self.good, self.bad = self.good / 2, self.bad / 2

    def allows(self) -> bool:
        if self.good >= self.bad:
            return True
        self.shut += 1
        return self.shut % self.EXPLORE == 0


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _largest_block(store: Store) -> int:
    largest = 0
    for array in store.arrays().values():
        chunk = [min(c, s) for c, s in zip(array.chunk_shape, array.shape)]
        largest = max(largest, math.prod(chunk) * array.dtype.itemsize)
    return largest
