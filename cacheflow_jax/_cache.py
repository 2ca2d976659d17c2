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
import math
import threading
import time
from _thread import allocate_lock as _allocate_lock
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from cacheflow_jax._blocks import KEY_SEPARATOR, BlockInfo, BudgetError, Store
from cacheflow_jax.policies import Policy, admit_all, get_policy
from cacheflow_jax._tiers import PRESENT, AbstractTier, DeviceTier, HostTier

if TYPE_CHECKING:  # JAX loads with the device tier, not here: replay runs without it
    import jax

DEVICE, HOST = 0, 1

KINDS = ("weight", "embedding", "kv", "other")


class Prefetcher(Protocol):
    """What the cache asks of a prefetcher: it sees accesses and proposes keys to load."""

    def observe(self, access: dict) -> None: ...

    def predict(self, k: int) -> list[tuple[str, float]]: ...

    def reset(self) -> None: ...


class _Transit:
    """A block moving between tiers; waiters block in ``wait`` outside the cache lock.

    A raw lock held from creation until ``finish`` is the cheapest one-shot event in CPython
    (``threading.Event`` builds a Condition), and transits are made on every miss.
    """

    __slots__ = ("_gate", "value", "error")

    def __init__(self) -> None:
        self._gate = _allocate_lock()
        self._gate.acquire()
        self.value: Any = None  # the device array when the transit was a load
        self.error: BaseException | None = None

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
      prefetcher: reserved for the learned prefetcher (`Prefetcher` protocol). Prefetching is not
        wired into the cache yet, so passing one raises rather than being silently ignored.
      clock: seconds, monotonic; injected for tests and replay.
      device: the L1 device; the default device if omitted.
      tiers: advanced: replace the L1/L2 tier objects (replay uses metadata-only tiers).
      read_buffer: how many buffered hits trigger a policy update (1 applies each at once).

    Raises:
      BudgetError: a budget is negative, not an integer, or too small for the store's blocks.

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
        prefetcher: Prefetcher | None = None,
        clock: Callable[[], float] = time.monotonic,
        device: jax.Device | None = None,
        tiers: Sequence[AbstractTier] | None = None,
        read_buffer: int = 64,
    ) -> None:
        if tiers is None:
            tiers = [DeviceTier(device_bytes, device=device), HostTier(host_bytes)]
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
        self.store = store
        self.policy = get_policy(policy)
        self._admit = None if self.policy.admit is admit_all else self.policy.admit
        if prefetcher is not None:
            raise NotImplementedError(
                "prefetcher=: prefetching is not wired into TieredCache yet; predictors can be "
                "trained and evaluated offline with `cacheflow train` (see docs/predictor.md)"
            )
        self.prefetcher = prefetcher
        self._clock = clock
        self._pstate = self.policy.init(len(self._tiers))
        ttl = self.policy.describe(self._pstate).get("ttl")
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
        self._runtime: dict[str, BlockInfo] = {}  # runtime blocks put into this cache
        self._kinds: dict[str, str] = {}  # runtime block key -> access-log kind given to put
        # Runtime blocks: each put makes a new version; L3 holds version ``_durable[key]``.
        # A dirty block that left L1/L2 waits in ``_unwritten`` (served to readers from there)
        # until its write is durable, so no reader can see L3 before the write lands.
        self._version: dict[str, int] = {}
        self._durable: dict[str, int] = {}
        self._unwritten: dict[str, Any] = {}
        self._writes: dict[str, int] = {}  # key -> version being written
        self._futures: dict[str, Any] = {}  # key -> pending write future
        self._write_errors: list[BaseException] = []
        self._n = {"device": 0, "host": 0, "miss": 0, "bytes": 0, "miss_bytes": 0}
        self._prefetch = {"issued": 0, "used": 0, "demand_misses_removed": 0}

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
                with self._lock:
                    self._drain()
            return value
        return self._get_slow(key)

    def get_many(self, keys: Iterable[str], req: str | None = None) -> list[jax.Array]:
        """Returns several blocks; all the L3 reads among them are issued at once."""
        keys = list(keys)
        out: dict[str, Any] = {}
        for key in keys:
            value = self._l1.get(key)
            if value is not None and key not in out:
                self._reads.append(key)
                out[key] = value
        pending = list(dict.fromkeys(k for k in keys if k not in out))
        while pending:
            owned, waits = [], []
            with self._lock:
                self._drain()
                for key in pending:
                    step = self._begin(key)
                    if step[0] == "hit":
                        out[key] = step[1]
                    elif step[0] == "wait":
                        waits.append((key, step[1]))
                    else:
                        owned.append((key, step[1], step[2]))
            l3 = [(k, info) for k, info, src in owned if src is None]
            futures = dict(zip((k for k, _ in l3), self._read_many([k for k, _ in l3])))
            first_error: BaseException | None = None
            for key, info, src in owned:
                try:
                    out[key] = self._finish(key, info, src, futures.get(key))
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
        if now is None:
            now = self._clock()
        info = self._runtime.get(key) if self._runtime else None
        nbytes = (info or self._store_info(key)).nbytes
        # `_account`, inlined: this is replay's per-access path.
        n = self._n
        n["bytes"] += nbytes
        policy, state = self.policy, self._pstate
        if key in self._l1:
            n["device"] += 1
            policy.access(state, key, now)
            if self._has_ttl and now >= self._next_expire:
                self._expire(now)
            return
        host = self._host
        if host is not None and key in host.entries:
            n["host"] += 1
            policy.access(state, key, now)
            if self._has_ttl and now >= self._next_expire:
                self._expire(now)
            policy.remove(state, HOST, key)
            del host.entries[key]
            host.used -= nbytes
        else:
            n["miss"] += 1
            n["miss_bytes"] += nbytes
            policy.access(state, key, now)
            if self._has_ttl and now >= self._next_expire:
                self._expire(now)
        l1 = self._tiers[DEVICE]
        if l1.used + nbytes <= l1.budget or self._room_sync(DEVICE, nbytes, key, now):
            l1.used += nbytes
            self._l1[key] = PRESENT
            policy.insert(state, DEVICE, key, now, nbytes)
        elif host is not None and (
            host.used + nbytes <= host.budget or self._room_sync(HOST, nbytes, key, now)
        ):
            host.used += nbytes
            host.entries[key] = PRESENT
            policy.insert(state, HOST, key, now, nbytes)

    def _room_sync(self, tier_index: int, nbytes: int, key: str, now: float) -> bool:
        """`_make_room` and `_evict_one` for `access_sync`: the same decisions, no transfers.

        Evicts until ``nbytes`` fit in the tier and returns True, or returns False if the policy
        does not admit ``key``; the caller adds ``nbytes`` to the tier's ``used``.
        """
        tier = self._tiers[tier_index]
        if nbytes > tier.budget:
            return False
        policy, state, admit = self.policy, self._pstate, self._admit
        entries, runtime, store_info = tier.entries, self._runtime, self._store_info
        host = self._host if tier_index == DEVICE else None  # victims of L1 go down to L2
        while tier.used + nbytes > tier.budget:
            victim = policy.victim(state, tier_index)
            if victim is None or admit is not None and not admit(state, key, victim):
                return False
            policy.remove(state, tier_index, victim)
            del entries[victim]
            size = ((runtime.get(victim) if runtime else None) or store_info(victim)).nbytes
            if host is not None and (
                host.used + size <= host.budget or self._room_sync(HOST, size, victim, now)
            ):
                host.used += size
                host.entries[victim] = PRESENT
                policy.insert(state, HOST, victim, now, size)
            tier.used -= size
        return True

    # ----------------------------------------------------------------------------- miss path

    def _get_slow(self, key: str) -> jax.Array:
        while True:
            with self._lock:
                self._drain()
                step = self._begin(key)
            if step[0] == "hit":
                return step[1]
            if step[0] == "own":
                future = self._read(key) if step[2] is None else None
                return self._finish(key, step[1], step[2], future)
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
            return ("wait", transit)
        info = self.info(key)
        host = self._tiers[HOST] if len(self._tiers) > HOST else None
        if host is not None and key in host.entries:
            self._account(key, "host", now, info.nbytes)
            # The block leaves L2 now; its bytes are released so that L1's victim can take them.
            self.policy.remove(self._pstate, HOST, key)
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
        self.policy.access(self._pstate, key, now)
        if self._has_ttl:
            self._expire(now)

    def _finish(self, key: str, info: BlockInfo, source: Any, future: Any) -> Any:
        """Outside the lock: make room, finish the read, install in L1 (or L2), wake waiters."""
        transit = self._inflight[key]
        host_value = None
        try:
            in_l1 = self._make_room(DEVICE, info.nbytes, key)
            try:
                value = self._tiers[DEVICE].load(future.result() if source is None else source)
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
                    self.policy.insert(self._pstate, DEVICE, key, self._clock(), info.nbytes)
                elif host_value is not None:
                    self._tiers[HOST].put_reserved(key, host_value, info.nbytes)
                    self.policy.insert(self._pstate, HOST, key, self._clock(), info.nbytes)
                if in_l1 or host_value is not None:
                    self._unwritten.pop(key, None)
                elif self._is_dirty(key) and key not in self._unwritten:
                    self._unwritten[key] = value  # never lose a runtime block
                del self._inflight[key]
                self._notify_room()
        except BaseException as e:
            with self._lock:
                self._inflight.pop(key, None)
                if source is not None and self._is_dirty(key):
                    self._unwritten.setdefault(key, source)  # never lose a runtime block
            transit.finish(error=e)
            raise
        transit.finish(value=value)
        self._start_writes()
        return value

    def _load_host(self, key: str, nbytes: int, value: Any) -> Any:
        """Reserves room in L2 if the policy admits ``key`` and copies the value to host.

        Returns the host value (the caller installs it under the lock) or None if not admitted.
        """
        if len(self._tiers) <= HOST or not self._make_room(HOST, nbytes, key):
            return None
        try:
            return self._tiers[HOST].load(value)
        except BaseException:
            with self._lock:
                self._tiers[HOST].release(nbytes)
                self._notify_room()
            raise

    def _make_room(self, tier_index: int, nbytes: int, key: str | None) -> bool:
        """Reserves ``nbytes`` in a tier, evicting (demoting) victims as the policy says.

        Returns False when the newcomer ``key`` is not admitted (or nothing can be evicted);
        ``key=None`` skips admission (explicit puts).
        """
        tier = self._tiers[tier_index]
        if nbytes > tier.budget:
            return False
        while True:
            with self._lock:
                if tier.reserve(nbytes):
                    return True
                victim = self.policy.victim(self._pstate, tier_index)
                if victim is None:
                    if not self._inflight:
                        return False
                    # Every byte is reserved by transfers in flight: wait (without the lock)
                    # until one of them releases room.
                    self._room_waiters += 1
                    try:
                        self._room.wait(0.01)
                    finally:
                        self._room_waiters -= 1
                    continue
                if key is not None and not self.policy.admit(self._pstate, key, victim):
                    return False
                self.policy.remove(self._pstate, tier_index, victim)
                value = tier.pop(victim)
                self._inflight[victim] = _Transit()
            self._evict_one(tier_index, victim, value)

    def _evict_one(self, tier_index: int, key: str, value: Any) -> None:
        """Moves one victim down a tier (or out), then releases its room above."""
        nbytes = self.info(key).nbytes
        host_value = None
        try:
            if tier_index == DEVICE:
                host_value = self._load_host(key, nbytes, value)
        finally:
            with self._lock:
                if host_value is not None:
                    self._tiers[HOST].put_reserved(key, host_value, nbytes)
                    self.policy.insert(self._pstate, HOST, key, self._clock(), nbytes)
                elif self._is_dirty(key):
                    self._unwritten[key] = value  # written back later; readers are served from it
                self._tiers[tier_index].release(nbytes)
                transit = self._inflight.pop(key)
                self._notify_room()
            transit.finish()

    def _notify_room(self) -> None:
        """Under the lock: wakes threads waiting for room (cheap when there are none)."""
        if self._room_waiters:
            self._room.notify_all()

    def _is_dirty(self, key: str) -> bool:
        """Under the lock: is L3 missing the latest value of runtime block ``key``?"""
        version = self._version.get(key)
        return version is not None and self._durable.get(key) != version

    def _start_writes(self) -> None:
        """Starts L3 writes for runtime blocks that left the cache; readers use ``_unwritten``."""
        if not self._unwritten:
            return
        with self._lock:
            todo = [(k, v, self._version[k]) for k, v in self._unwritten.items()
                    if k not in self._writes]
            for key, _, version in todo:
                self._writes[key] = version
        for key, value, version in todo:
            self._write(key, value, version)

    def _write(self, key: str, value: Any, version: int) -> None:
        try:
            future = self.store.write(key, _to_host(value))
        except BaseException as e:
            self._write_done(key, version, e)
            return
        with self._lock:
            self._futures[key] = future
        future.add_done_callback(lambda f: self._write_done(key, version, _error_of(f)))

    def _write_done(self, key: str, version: int, error: BaseException | None) -> None:
        with self._lock:
            self._writes.pop(key, None)
            self._futures.pop(key, None)
            if error is not None:
                self._write_errors.append(error)  # the block stays in _unwritten for a retry
                return
            if version > self._durable.get(key, -1):
                self._durable[key] = version
            if self._version.get(key) == version:
                self._unwritten.pop(key, None)
            again = key in self._unwritten
        if again:
            self._start_writes()

    def _read(self, key: str) -> Any:
        return self.store.read(key)

    def _read_many(self, keys: list[str]) -> list[Any]:
        return self.store.read_many(keys) if keys else []

    # -------------------------------------------------------------------------- bookkeeping

    def _drain(self) -> None:
        """Under the lock: applies buffered hits to the policy."""
        reads = self._reads
        count = len(reads)  # hits buffered after this snapshot wait for the next drain
        if not count:
            return
        now = self._clock()
        access, state, popleft = self.policy.access, self._pstate, reads.popleft
        size_of = self._tiers[DEVICE].sizes.get
        nbytes = 0
        for _ in range(count):
            key = popleft()
            # The block was in L1 when hit; if it left since, look its size up in the store.
            nbytes += size_of(key) or self.info(key).nbytes
            access(state, key, now)
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
            for key in self.policy.expired(self._pstate, tier_index, now):
                self.policy.remove(self._pstate, tier_index, key)
                value = tier.pop(key)
                tier.release(self.info(key).nbytes)
                if self._is_dirty(key):
                    self._unwritten[key] = value  # the write starts after the lock is released

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

    def put(self, key: str, array: Any, *, kind: str = "kv") -> None:
        """Stores a runtime block (for example a KV block keyed by prefix hash) in L1.

        The block is written back to L3 when it leaves the cache, and on `flush`.

        Raises:
          ValueError: ``key`` contains ``'@'`` (chunks of stored arrays are read-only).
          BudgetError: the block is larger than ``device_bytes``.
        """
        if KEY_SEPARATOR in key:
            raise ValueError(
                f"cannot put {key!r}: keys with {KEY_SEPARATOR!r} name chunks of stored arrays, "
                "which are read-only; use a key without it for runtime blocks"
            )
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} for {key!r} must be one of {KINDS}")
        nbytes = int(np.asarray(array).nbytes) if not hasattr(array, "nbytes") else array.nbytes
        if nbytes > self._tiers[DEVICE].budget:
            raise BudgetError(
                f"runtime block {key!r} has {nbytes} bytes, more than "
                f"device_bytes={self._tiers[DEVICE].budget}; split it or raise device_bytes"
            )
        value = self._tiers[DEVICE].load(array)
        info = BlockInfo(key, tuple(value.shape), np.dtype(value.dtype), int(value.nbytes))
        while True:
            with self._lock:
                self._drain()
                transit = self._inflight.get(key)
                if transit is None:
                    self._discard(key)
                    self._runtime[key] = info
                    self._kinds[key] = kind
                    self._version[key] = self._version.get(key, 0) + 1
                    self._inflight[key] = transit = _Transit()
                    self.policy.access(self._pstate, key, self._clock())
                    break
            transit.wait()
        try:
            if not self._make_room(DEVICE, info.nbytes, None):
                raise BudgetError(f"no room for runtime block {key!r} in L1; this is a bug")
            with self._lock:
                self._tiers[DEVICE].put_reserved(key, value, info.nbytes)
                self.policy.insert(self._pstate, DEVICE, key, self._clock(), info.nbytes)
                del self._inflight[key]
                self._notify_room()
        except BaseException as e:
            with self._lock:
                self._unwritten[key] = value
                self._inflight.pop(key, None)
            transit.finish(error=e)
            raise
        transit.finish(value=value)
        self._start_writes()

    def _discard(self, key: str) -> None:
        """Under the lock: forgets the cached copy of ``key`` (superseded by a new put)."""
        for tier_index, tier in enumerate(self._tiers):
            if key in tier.entries:
                self.policy.remove(self._pstate, tier_index, key)
                tier.pop(key)
                tier.release(self.info(key).nbytes)
        self._unwritten.pop(key, None)

    # ------------------------------------------------------------------------------ control

    def contains(self, key: str) -> bool:
        """True if ``key`` is resident in L1 or L2."""
        return self.tier_of(key) is not None

    def tier_of(self, key: str) -> str | None:
        """``"device"``, ``"host"`` or None (only in L3, or in transit)."""
        for tier in self._tiers:
            if key in tier.entries:
                return tier.name
        return None

    def evict(self, key: str) -> bool:
        """Evicts ``key`` from L1 and L2 (writing a runtime block back); returns if it was there."""
        with self._lock:
            self._drain()
            for tier_index, tier in enumerate(self._tiers):
                if key in tier.entries:
                    self.policy.remove(self._pstate, tier_index, key)
                    value = tier.pop(key)
                    tier.release(self.info(key).nbytes)
                    if self._is_dirty(key):
                        self._unwritten[key] = value
                    break
            else:
                return False
        self._start_writes()
        return True

    def flush(self, *, timeout: float | None = None) -> None:
        """Writes every dirty runtime block to L3 and waits until all writes are durable.

        Resident blocks stay resident (now clean). Raises the first write error; blocks whose
        write failed stay in memory and are retried by the next flush.
        """
        with self._lock:
            self._drain()
            resident = [(k, t.entries[k], self._version[k]) for t in self._tiers
                        for k in t.entries if self._is_dirty(k) and k not in self._writes]
            for key, _, version in resident:
                self._writes[key] = version
        for key, value, version in resident:
            self._write(key, value, version)
        self._start_writes()
        self.wait_until_finished(timeout=timeout)

    def wait_until_finished(self, *, timeout: float | None = None) -> None:
        """Waits for pending write-backs; raises the first error (the data stays in memory)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._futures.values())
                waiting = bool(self._writes) and not pending
            if not pending and not waiting:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} write-backs still pending after {timeout} s")
            for future in pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    future.result(timeout=left)
                except Exception:  # recorded by the write's callback
                    pass
            if waiting:
                time.sleep(0.001)
        self.check_for_errors()

    def check_for_errors(self) -> None:
        """Raises the first recorded write-back error, once."""
        with self._lock:
            errors, self._write_errors[:] = list(self._write_errors), []
        if errors:
            raise errors[0]

    # -------------------------------------------------------------------------------- stats

    def stats(self) -> dict:
        """Counters in the shape of ``cacheflow replay --json`` (see DESIGN.md)."""
        with self._lock:
            self._drain()
            n = dict(self._n)
            pf = dict(self._prefetch)
            tiers = {t.name: {"used": t.used, "budget": t.budget, "blocks": len(t.entries)}
                     for t in self._tiers}
        requests = n["device"] + n["host"] + n["miss"]
        demand = pf["demand_misses_removed"] + n["miss"]
        return {
            "requests": requests,
            "hits": {"device": n["device"], "host": n["host"]},
            "misses": n["miss"],
            "device_miss_ratio": _ratio(requests - n["device"], requests),
            "miss_ratio": _ratio(n["miss"], requests),
            "byte_miss_ratio": _ratio(n["miss_bytes"], n["bytes"]),
            "prefetch": {
                "issued": pf["issued"],
                "used": pf["used"],
                "accuracy": _ratio(pf["used"], pf["issued"]),
                "coverage": _ratio(pf["demand_misses_removed"], demand),
            },
            "policy": self.policy.describe(self._pstate),
            "tiers": tiers,
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


def _error_of(future: Any) -> BaseException | None:
    try:
        future.result()
    except BaseException as e:
        return e
    return None


def _to_host(value: Any) -> np.ndarray:
    import jax

    return np.asarray(jax.device_get(value)) if isinstance(value, jax.Array) else np.asarray(value)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _largest_block(store: Store) -> int:
    largest = 0
    for array in store.arrays().values():
        chunk = [min(c, s) for c, s in zip(array.chunk_shape, array.shape)]
        largest = max(largest, math.prod(chunk) * array.dtype.itemsize)
    return largest
