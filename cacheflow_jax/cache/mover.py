"""The mover: the tiers, the cache lock, blocks in transit, room and expiry.

Design note.

* Tiers are exclusive: a block lives in at most one of L1 and L2, so their budgets add up and a
  two-tier cache behaves like one cache of the summed size. An access promotes a block to L1; L1's
  victim is demoted to L2 and L2's victim leaves the cache (read-only chunks are dropped, runtime
  blocks are parked for their write-back first).
* Storage never decides and policy never stores: tiers count bytes, the planner (over the
  `Policy`) picks victims, admits newcomers and says where a victim goes (`Planner.destination`).
  `take_victim` is the one place that asks it, for the live moves here and for replay's
  (`cacheflow_jax.cache.replay_moves`), which make the same decisions without moving data.
* Budgets are hard. Room is reserved under the lock before any transfer starts and released only
  after a block has left, so ``used <= budget`` holds at every moment for every tier, whatever the
  threads do. Transfers (L3 reads, host<->device copies) happen outside the lock.
* A block in transit (being loaded, promoted or demoted) is registered in ``inflight``; a second
  request for it waits on that transfer instead of issuing its own, so concurrent misses on one key
  make one read, and a runtime block being written back is never read from L3 too early.
* Hits are buffered (the facade's hit path appends to ``reads``) and applied to the policy in
  batches under the lock (`drain`), on the next miss or when the buffer fills, as in Caffeine.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from _thread import allocate_lock
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cacheflow_jax.core.blocks import BlockInfo, StoreError, StoreTimeoutError
from cacheflow_jax.planning.planner import REFUSED
from cacheflow_jax.tiers.memory import DeviceTier, HostTier, MetadataTier, check_device_dtype

if TYPE_CHECKING:
    from cacheflow_jax.cache.counters import Counters
    from cacheflow_jax.cache.pins import Pins
    from cacheflow_jax.cache.writeback import WriteBack
    from cacheflow_jax.core.blocks import Store
    from cacheflow_jax.planning.planner import Planner
    from cacheflow_jax.tiers.memory import AbstractTier

DEVICE, HOST = 0, 1


class Transit:
    """A block moving between tiers; waiters block in ``wait`` outside the cache lock.

    A raw lock held from creation until ``finish`` is the cheapest one-shot event in CPython
    (``threading.Event`` builds a Condition), and transits are made on every miss.
    """

    __slots__ = ("_gate", "value", "error", "prefetch", "demanded", "rank")

    def __init__(self, prefetch: bool = False) -> None:
        self._gate = allocate_lock()
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


class Mover:
    """Moves blocks between the tiers as the planner decides; see the module's design note.

    Args:
      store: the L3 store.
      tiers: L1 (and L2) tier objects.
      planner: the planner over the cache's policy.
      counters: the cache's counters.
      writeback: the runtime blocks not yet durable (dirty blocks that leave are parked there).
      pins: blocks pinned in L1 (out of the policy's view).
      lock: the cache lock (the write-back's too: a block changes tier and dirtiness together).
      clock: the policy's clock.
      l3_timeout: the deadline of an L3 read, or None.
      read_buffer: buffered hits that trigger a drain.
    """

    def __init__(
        self,
        store: Store,
        tiers: list[AbstractTier],
        planner: Planner,
        counters: Counters,
        writeback: WriteBack,
        pins: Pins,
        *,
        lock: threading.Lock,
        clock: Callable[[], float],
        l3_timeout: float | None,
        read_buffer: int,
    ) -> None:
        self.store = store
        self.tiers = tiers
        self.planner = planner
        self.counters = counters
        self.writeback = writeback
        self.pins = pins
        self.clock = clock
        self.l3_timeout = l3_timeout
        self.read_buffer = max(1, int(read_buffer))
        self.check_dtypes = not isinstance(tiers[DEVICE], MetadataTier)
        self.lock = lock
        self.room_changed = threading.Condition(self.lock)  # tier bytes were released
        self.room_waiters = 0
        self.l1 = tiers[DEVICE].entries  # the hit path reads this dict without the lock
        # L2 if it can hold blocks (replay reads it on every access), else None.
        self.host = tiers[HOST] if len(tiers) > HOST and tiers[HOST].budget > 0 else None
        self.reads: collections.deque[str] = collections.deque()  # buffered hits
        self.inflight: dict[str, Transit] = {}
        planner.watch_transit(self.inflight)  # a key on its way between tiers is not gone
        self.runtime: dict[str, BlockInfo] = {}  # runtime blocks put into this cache
        self.kinds: dict[str, str] = {}  # runtime block key -> access-log kind given to put
        self.volatile: set[str] = set()  # runtime blocks put with writeback=False
        self.parked = writeback.parked
        ttl = planner.describe().get("ttl")
        self.has_ttl = ttl is not None
        # TTL checks run at most every ttl/64 seconds: a block leaves within ttl * 65/64.
        self.expire_every = ttl / 64 if ttl else math.inf
        self.next_expire = -math.inf
        self.plan_access: Callable[[str, float], Any] = planner.access_function()
        l1 = tiers[DEVICE]
        l2 = tiers[HOST] if len(tiers) > HOST else None
        plain = type(l1) is DeviceTier and (l2 is None or type(l2) is HostTier)
        # Moves that never wait, made under the lock (`room_in_place`, `cacheflow_jax.cache.
        # in_place`): on JAX's CPU backend they copy nothing (L2 keeps L1's arrays); with L2 in
        # pinned_host memory they are copies issued without waiting (`moved_down`, `moved_up`).
        self.pinned_moves = plain and l2 is not None and l2.pinned is not None
        self.in_place = plain and (l1.host_memory or self.pinned_moves)

    # ------------------------------------------------------------------------- block facts

    def info(self, key: str) -> BlockInfo:
        """The block's metadata (shape, dtype, nbytes). Raises ``KeyError`` naming the key."""
        info = self.runtime.get(key)
        if info is not None:
            return info
        return self.store.info(key)

    def resident(self, key: str) -> Any:
        """Under the lock: the value of ``key`` in L1 or L2, or None."""
        for tier in self.tiers:
            value = tier.entries.get(key)
            if value is not None:
                return value
        return None

    def fresh(self, key: str) -> bool:
        """Under the lock: ``key`` is not resident, moving or waiting for a write-back."""
        host = self.host
        return not (
            key in self.l1
            or (host is not None and key in host.entries)
            or key in self.inflight
            or key in self.parked
        )

    # ---------------------------------------------------------------------------- L3 reads

    def deadline(self) -> float | None:
        """The monotonic time by which reads issued now must finish (None: no deadline)."""
        return None if self.l3_timeout is None else time.monotonic() + self.l3_timeout

    def read(self, key: str) -> Any:
        return self.counters.timed_reads([key], [self.store.read(key)], self.info)[0]

    def read_many(self, keys: list[str]) -> list[Any]:
        if not keys:
            return []
        return self.counters.timed_reads(keys, self.store.read_many(keys), self.info)

    def read_result(self, key: str, future: Any, deadline: float | None) -> Any:
        """Waits for an L3 read until ``deadline``; past it, `StoreTimeoutError` names the key."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return future.result(timeout=left)
        except TimeoutError as err:
            if isinstance(err, StoreError):
                raise
            raise StoreTimeoutError(
                f"reading block {key!r} from store {self.store.spec} did not finish within "
                f"l3_timeout={self.l3_timeout} s; the store may be unreachable or stopped. "
                "Blocks in L1/L2 are still served; check the store, or raise l3_timeout"
            ) from None

    # --------------------------------------------------------------------------- the moves

    def begin(self, key: str) -> tuple:
        """Under the lock: classify one request as a hit, a wait on a transit, or a load we own.

        Returns ``("hit", value)``, ``("wait", transit)`` or ``("own", info, host_value_or_None)``.
        """
        now = self.clock()
        value = self.l1.get(key)
        if value is not None:
            self.account(key, "device", now, self.info(key).nbytes)
            return ("hit", value)
        transit = self.inflight.get(key)
        if transit is not None:
            if transit.prefetch and not transit.demanded:
                # A prefetch still loading: the access waits for it (a late prefetch, and a
                # demand miss as far as the counters go).
                transit.demanded = True
                nbytes = self.info(key).nbytes
                self.account(key, "miss", now, nbytes)
                self.counters.prefetch_use(nbytes, late=True)
            return ("wait", transit)
        info = self.info(key)
        if self.check_dtypes:
            check_device_dtype(info.dtype, key)  # before anything changes
            if info.leaves and not self.tiers[DEVICE].holds_trees:
                raise TypeError(
                    f"block {key!r} is a pytree block; device_layout='slab' holds arrays only: "
                    "use device_layout='arrays'"
                )
        host = self.tiers[HOST] if len(self.tiers) > HOST else None
        if host is not None and key in host.entries:
            self.account(key, "host", now, info.nbytes)
            # The block leaves L2 now; its bytes are released so that L1's victim can take them.
            self.planner.remove(HOST, key)
            value = host.pop(key)
            host.release(info.nbytes)
        elif key in self.parked:
            self.account(key, "host", now, info.nbytes)
            value = self.parked[key]
        else:
            self.account(key, "miss", now, info.nbytes)
            value = None
        self.inflight[key] = Transit()
        return ("own", info, value)

    def account(self, key: str, where: str, now: float, nbytes: int) -> None:
        """Under the lock: counts one access served from ``where`` and shows it to the policy."""
        self.counters.access(where, nbytes)
        if key in self.pins:
            return  # out of the policy's view while pinned
        if self.plan_access(key, now):
            self.counters.prefetch_use(nbytes, late=False)
        if self.has_ttl:
            self.expire(now)

    def hits_in_batch(self, now: float) -> bool:
        """Under the lock: whether accesses of resident blocks at ``now`` may reach the policy
        in one batch (`account_hits`) with the same result as `account` one at a time: the policy
        has ``hits``, nothing is pinned, no prefetched block waits for its first use or is
        foreseen (the planner would look at each), and no TTL sweep is due."""
        planner = self.planner
        return (planner.policy.hits is not None and not self.pins and not planner.unused_blocks
                and not planner.foreseen_blocks()
                and (not self.has_ttl or now < self.next_expire))  # fmt: skip

    def account_hits(self, keys: list[str], now: float) -> None:
        """Under the lock, while `hits_in_batch`: the policy's accesses of ``keys`` (resident
        in L1 or L2, counted by the caller), in order, in one call."""
        planner = self.planner
        planner.policy.hits(planner.state, keys, now)
        if planner.tracking:
            planner.count += len(keys)

    def abandon(self, owned: list[tuple[str, BlockInfo, Any]], error: BaseException) -> None:
        """Releases loads that were claimed in `begin` but never started (a read failed)."""
        with self.lock:
            transits = []
            for key, _, source in owned:
                transit = self.inflight.pop(key, None)
                if source is not None:
                    self.leave(key, source, replace=False)  # never lose a runtime block
                if transit is not None:
                    transits.append(transit)
        for transit in transits:
            transit.finish(error=error)

    def finish(
        self, key: str, info: BlockInfo, source: Any, future: Any, deadline: float | None = None
    ) -> Any:
        """Outside the lock: make room, finish the read, install in L1 (or L2), wake waiters."""
        transit = self.inflight[key]
        device = self.tiers[DEVICE]
        host_value = None
        try:
            in_l1 = self.make_room(DEVICE, info.nbytes, key)
            try:
                raw = self.read_result(key, future, deadline) if source is None else source
                value = device.load(raw, owned=True)
            except BaseException:
                if in_l1:
                    with self.lock:
                        device.release(info.nbytes)
                        self.notify_room()
                raise
            if not in_l1:
                host_value = self.load_host(key, info.nbytes, value)
            with self.lock:
                if in_l1:
                    self.land(key, DEVICE, value, info.nbytes)
                elif host_value is not None:
                    self.land(key, HOST, host_value, info.nbytes)
                else:
                    self.land(key, None, value, info.nbytes)
        except BaseException as e:
            with self.lock:
                self.inflight.pop(key, None)
                if source is not None:
                    self.leave(key, source, replace=False)  # never lose a runtime block
            transit.finish(error=e)
            raise
        transit.finish(value=value)
        self.writeback.start()
        return value

    def land(self, key: str, tier_index: int | None, value: Any, nbytes: int) -> None:
        """Under the lock: ends a load of ``key`` (in transit) into the room reserved for it in
        ``tier_index``, or into no tier (None: a runtime block is parked or dropped, as when it
        leaves); readers wait on its transit until the caller finishes it."""
        if tier_index is None:
            self.leave(key, value, replace=False)  # never lose a runtime block
        else:
            self.install(tier_index, key, value, nbytes)
            self.parked.pop(key, None)
        del self.inflight[key]
        self.notify_room()

    def install(
        self, tier_index: int, key: str, value: Any, nbytes: int, **guess: Any
    ) -> None:
        """Under the lock: puts ``value`` in the room reserved for it in a tier and tells the
        planner (``guess``: `Planner.insert`'s prefetch keywords); if the tier refuses it, the
        room is given back before the error goes on."""
        tier = self.tiers[tier_index]
        try:
            tier.put_reserved(key, value, nbytes)
        except BaseException:
            tier.release(nbytes)
            self.notify_room()
            raise
        self.planner.insert(tier_index, key, self.clock(), nbytes, **guess)

    def load_host(
        self, key: str, nbytes: int, value: Any, *, prefetch: bool = False, rank: int = 1
    ) -> Any:
        """Reserves room in L2 if the planner admits ``key`` and copies the value to host.

        Returns the host value (the caller installs it under the lock) or None if not admitted.
        """
        if len(self.tiers) <= HOST or not self.make_room(
            HOST, nbytes, key, prefetch=prefetch, rank=rank
        ):
            return None
        try:
            return self.tiers[HOST].load(value, owned=True)
        except BaseException:
            with self.lock:
                self.tiers[HOST].release(nbytes)
                self.notify_room()
            raise

    def take_victim(
        self, tier_index: int, key: str | None, prefetch: bool, rank: int
    ) -> tuple[str, int | None] | Any:
        """Under the lock: the planner's victim in ``tier_index`` for newcomer ``key``, taken
        out of the policy's view, and where it goes (`Planner.destination`).

        Returns ``(victim, destination)``, None (nothing to evict) or `REFUSED`.
        """
        victim = self.planner.victim(tier_index, key, prefetch=prefetch, rank=rank)
        if victim is None or victim is REFUSED:
            return victim
        was_unused = self.planner.remove(tier_index, victim)
        if was_unused:
            self.counters.prefetch("wasted", self.tiers[tier_index].sizes.get(victim)
                                   or self.info(victim).nbytes)  # fmt: skip
        return victim, self.planner.destination(tier_index, was_unused)

    def make_room(
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
        if nbytes > self.tiers[tier_index].budget:
            return False
        if self.in_place and not prefetch:
            with self.lock:  # victims move down without copies: no need to release the lock
                return room_in_place(self, tier_index, nbytes, key)
        while True:
            with self.lock:
                step = self.room_step(tier_index, nbytes, key, prefetch, rank)
                if step is None:
                    self.wait_room()
                    continue
                if type(step) is bool:
                    return step
                victim, value, destination = step
                self.inflight[victim] = Transit()
            self.evict_one(tier_index, victim, value, destination)

    def room_step(
        self, tier_index: int, nbytes: int, key: str | None, prefetch: bool, rank: int
    ) -> bool | tuple[str, Any, int | None] | None:
        """Under the lock: one step of `make_room`. Reserves ``nbytes`` (True), refuses (False),
        takes the planner's next victim out of the tier (``(victim, value, destination)``), or
        finds every byte reserved by transfers in flight (None: `wait_room`, then again)."""
        tier = self.tiers[tier_index]
        if tier.reserve(nbytes):
            return True
        if self.planner.tracking:
            self.drain()  # a buffered hit on an unused prefetch makes it used first
        taken = self.take_victim(tier_index, key, prefetch, rank)
        if taken is REFUSED:
            return False
        if taken is not None:
            return taken[0], tier.pop(taken[0]), taken[1]
        if prefetch or not self.inflight:
            return False
        if tier_index == DEVICE and self.pins.bytes + nbytes > tier.budget:
            return False  # pins hold the room: no transfer will give it back
        return None

    def wait_room(self) -> None:
        """Under the lock: waits (the lock released meanwhile) until room is released, or 10 ms."""
        self.room_waiters += 1
        try:
            self.room_changed.wait(0.01)
        finally:
            self.room_waiters -= 1

    def evict_one(
        self, tier_index: int, key: str, value: Any, destination: int | None
    ) -> None:
        """Moves one victim down a tier (or out), then releases its room above."""
        nbytes = self.info(key).nbytes
        host_value = None
        try:
            if destination == HOST:
                host_value = self.load_host(key, nbytes, value)
        finally:
            with self.lock:
                if host_value is not None:
                    self.tiers[HOST].put_reserved(key, host_value, nbytes)
                    self.planner.insert(HOST, key, self.clock(), nbytes)
                else:
                    self.leave(key, value)  # written back later; readers are served from it
                self.tiers[tier_index].release(nbytes)
                transit = self.inflight.pop(key)
                self.notify_room()
            transit.finish()

    def notify_room(self) -> None:
        """Under the lock: wakes threads waiting for room (cheap when there are none)."""
        if self.room_waiters:
            self.room_changed.notify_all()

    def leave(self, key: str, value: Any, *, replace: bool = True) -> None:
        """Under the lock: a runtime block left L1/L2 (or could not go in) with ``value``.

        A dirty block is parked for its write-back; a block put with ``writeback=False`` is
        dropped and forgotten (a later `get` raises `KeyError`, as for a key never put).
        """
        if key in self.volatile:
            self.volatile.discard(key)
            self.runtime.pop(key, None)
            self.kinds.pop(key, None)
        else:
            self.writeback.park(key, value, replace=replace)

    def discard(self, key: str) -> None:
        """Under the lock: forgets the cached copy of ``key`` (superseded by a new put)."""
        for tier_index, tier in enumerate(self.tiers):
            if key in tier.entries:
                self.planner.remove(tier_index, key)
                tier.pop(key)
                tier.release(self.info(key).nbytes)
        self.parked.pop(key, None)

    def evict(self, key: str) -> bool:
        """Under the lock: takes ``key`` out of L1/L2 (parked if dirty); whether it was there."""
        for tier_index, tier in enumerate(self.tiers):
            if key in tier.entries:
                if self.planner.remove(tier_index, key):
                    self.counters.prefetch("wasted", self.info(key).nbytes)
                value = tier.pop(key)
                tier.release(self.info(key).nbytes)
                self.leave(key, value)
                return True
        return False

    # ------------------------------------------------------------------------- bookkeeping

    def apply_hits(self) -> None:
        """Applies the buffered hits to the policy (a full read buffer, off the common path)."""
        with self.lock:
            self.drain()
        if self.parked:
            self.writeback.start()  # dirty blocks the TTL just expired

    def drain(self) -> None:
        """Under the lock: applies buffered hits to the policy."""
        reads = self.reads
        count = len(reads)  # hits buffered after this snapshot wait for the next drain
        if not count:
            return
        now = self.clock()
        planner, popleft = self.planner, reads.popleft
        size_of = self.tiers[DEVICE].sizes.get
        nbytes = 0
        if self.pins or planner.unused_blocks or planner.foreseen_blocks():
            # Pinned blocks are out of the policy's view, and prefetched blocks waiting for
            # their first use or foreseen ones need the planner to look at each hit.
            pins, access, use = self.pins, planner.access, self.counters.prefetch_use
            for _ in range(count):
                key = popleft()
                # The block was in L1 when hit; if it left since, look its size up in the store.
                size = size_of(key) or self.info(key).nbytes
                nbytes += size
                if key not in pins and access(key, now):
                    use(size, late=False)
        else:
            # `Planner.access` without a guess to look for: the policy's accesses (in one batch
            # where the policy has `hits`), and the count.
            policy = planner.policy
            keys = [popleft() for _ in range(count)]
            try:
                nbytes = sum(map(size_of, keys))
            except TypeError:  # a block left L1 since its hit: the store knows its size
                info = self.info
                nbytes = sum(size_of(key) or info(key).nbytes for key in keys)
            if policy.hits is not None:
                policy.hits(planner.state, keys, now)
            else:
                policy_access, state = policy.access, planner.state
                for key in keys:
                    policy_access(state, key, now)
            if planner.tracking:
                planner.count += count
        self.counters.hits(count, nbytes)
        if self.has_ttl:
            self.expire(now)

    def expire(self, now: float) -> None:
        """Under the lock: evicts residents past the policy's TTL (dirty ones are parked)."""
        if now < self.next_expire:
            return
        self.next_expire = now + self.expire_every
        for tier_index, tier in enumerate(self.tiers):
            for key in self.planner.expired(tier_index, now):
                if self.planner.remove(tier_index, key):
                    self.counters.prefetch("wasted", self.info(key).nbytes)
                value = tier.pop(key)
                tier.release(self.info(key).nbytes)
                self.leave(key, value)  # the write starts after the lock is released


def moved_down(mover: Mover, value: Any) -> Any:
    """Under the lock, where moves are in place: L1's block as L2 keeps it (the same arrays on
    JAX's CPU backend). With L2 in pinned_host memory, a copy issued and not waited for: the
    device frees the block's buffer when it is done, and a reader of the L2 copy waits for it
    as for any array."""
    if not mover.pinned_moves:
        return value
    return mover.tiers[HOST].load(value, owned=True, wait=False)


def moved_up(mover: Mover, value: Any) -> Any:
    """Under the lock, where moves are in place: L2's block as L1 keeps it (`moved_down`'s
    inverse: with L2 in pinned_host memory, a copy to device memory, not waited for)."""
    if not mover.pinned_moves:
        return value
    return mover.tiers[DEVICE].load(value, owned=True, wait=False)


def room_in_place(
    mover: Mover, tier_index: int, nbytes: int, key: str | None, *, moving: bool = False,
    prefetch: bool = False, rank: int = 1,
) -> bool:  # fmt: skip
    """Under the lock: `Mover.make_room` where moving a victim down copies nothing
    (`Mover.in_place`), so the victims move without the lock being released: the same decisions.

    ``key=None``: no admission (a put, a reservation). ``moving``: ``key`` is a victim on its way
    down, in no tier; if this must wait for room (`Mover.wait_room` releases the lock), it is
    first registered in transit, so that readers wait for it instead of missing it (the caller
    finishes that transit). Any other ``key`` is in transit already, or None. ``prefetch`` and
    ``rank``: as for `Mover.make_room` (a prefetch never waits for room).
    """
    if nbytes > mover.tiers[tier_index].budget:
        return False
    while True:
        step = mover.room_step(tier_index, nbytes, key, prefetch, rank)
        if step is None:
            if moving and key not in mover.inflight:
                mover.inflight[key] = Transit()
            mover.wait_room()
            continue
        if type(step) is bool:
            return step
        victim, value, destination = step
        size = mover.info(victim).nbytes
        if destination == HOST and room_in_place(mover, HOST, size, victim, moving=True):
            mover.tiers[HOST].put_reserved(victim, moved_down(mover, value), size)
            mover.planner.insert(HOST, victim, mover.clock(), size)
        else:
            mover.leave(victim, value)
        transit = mover.inflight.pop(victim, None)  # registered if it waited for L2's room
        if transit is not None:
            transit.finish()
        mover.tiers[tier_index].release(size)
        mover.notify_room()
