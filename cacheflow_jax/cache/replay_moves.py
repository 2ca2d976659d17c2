"""Replay's moves: the mover's decisions, carried out at once and without data.

Replay drives the live cache's objects (policy, planner, tiers) over a trace with metadata-only
tiers (`MetadataTier`) in one thread. It makes the same calls on the same planner, in the same
order, as the live path (`cacheflow_jax.cache.mover`) with ``read_buffer=1``, and asks the same
`Mover.take_victim` for victims and their destinations; what it skips is the transit and locking
machinery that concurrent data movement needs. ``tests/test_replay.py`` checks that both give
identical counters and residency.

Cost per access: one policy access, plus on a miss one insert and the evictions it takes (each
a victim choice and a remove), as the policy's own file states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cacheflow_jax.planning.planner import REFUSED
from cacheflow_jax.tiers.memory import PRESENT

if TYPE_CHECKING:
    from cacheflow_jax.cache.mover import Mover

DEVICE, HOST = 0, 1


class SyncMoves:
    """Accesses and moves without data, for replay (see the module docstring).

    Args:
      mover: the cache's mover (its tiers, planner, counters and `take_victim`).
      prefetch: replay's prefetch driver (`cacheflow_jax.cache.prefetch_driver.ReplayPrefetch`),
        or None.
    """

    def __init__(self, mover: Mover, prefetch: Any = None) -> None:
        self.mover = mover
        self.prefetch = prefetch

    def access_many(
        self,
        keys: Sequence[str],
        times: Sequence[float],
        sizes: Sequence[int] | None = None,
        *,
        general: bool = False,
    ) -> None:
        """Each of ``keys`` accessed in turn at its time in ``times`` (replay's loop); with
        ``general``, by the loop for every case even where the one-tier loop applies.

        Raises:
          KeyError: a key is neither in the store nor among runtime blocks (nothing counted).
        """
        mover = self.mover
        if sizes is None:
            sizes = [mover.info(key).nbytes for key in keys]
        if (not general and self.prefetch is None and mover.host is None
                and not mover.planner.tracking):
            self._access_l1(keys, times, sizes)
        else:
            self._access_tiers(keys, times, sizes)

    def _access_tiers(
        self, keys: Sequence[str], times: Sequence[float], sizes: Sequence[int]
    ) -> None:
        """`access_many` in general: L1 and L2, with or without prefetch."""
        mover, prefetch = self.mover, self.prefetch
        plan_access, planner, install = mover.plan_access, mover.planner, self.install
        l1, host, use = mover.l1, mover.host, mover.counters.prefetch_use
        has_ttl = mover.has_ttl
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
                        use(nbytes, late=False)
                    if has_ttl and now >= mover.next_expire:
                        mover.expire(now)
                else:
                    if host is not None and key in host.entries:
                        in_host += 1
                        host_bytes += nbytes
                        if plan_access(key, now):
                            use(nbytes, late=False)
                        if has_ttl and now >= mover.next_expire:
                            mover.expire(now)
                        planner.remove(HOST, key)
                        host.pop(key)
                        host.used -= nbytes
                    else:
                        miss += 1
                        miss_bytes += nbytes
                        plan_access(key, now)
                        if has_ttl and now >= mover.next_expire:
                            mover.expire(now)
                    install(key, nbytes, now)
                if prefetch is not None:
                    prefetch.after(key, now)
        finally:
            mover.counters.add(device, in_host, miss, total, host_bytes, miss_bytes)

    def _access_l1(
        self, keys: Sequence[str], times: Sequence[float], sizes: Sequence[int]
    ) -> None:
        """`access_many` with one tier and no prefetch (a policy replay): the same decisions in
        the same order, with L1's bookkeeping in locals and the policy's functions called
        straight (`Planner.direct`): replay's loop went from 0.64x to 0.71x the accesses per
        second of libCacheSim's LRU loop (`bench.replay_speed`)."""
        mover = self.mover
        tier = mover.tiers[DEVICE]
        entries, tier_sizes, budget = tier.entries, tier.sizes, tier.budget
        plan_access = mover.plan_access
        victim, admit, remove, insert = mover.planner.direct()
        state = mover.planner.state
        has_ttl = mover.has_ttl
        info = mover.info
        device = miss = total = miss_bytes = 0
        try:
            for key, now, nbytes in zip(keys, times, sizes):
                total += nbytes
                if key in entries:
                    device += 1
                    plan_access(key, now)
                    if has_ttl and now >= mover.next_expire:
                        mover.expire(now)
                    continue
                miss += 1
                miss_bytes += nbytes
                plan_access(key, now)
                if has_ttl and now >= mover.next_expire:
                    mover.expire(now)
                if nbytes > budget:
                    continue  # larger than L1: never cached (as `room` refuses it)
                used = tier.used
                while used + nbytes > budget:
                    out = victim(DEVICE)
                    if out is None or (admit is not None and not admit(state, key, out)):
                        break
                    remove(DEVICE, out)
                    del entries[out]
                    used -= tier_sizes.pop(out, None) or info(out).nbytes
                else:
                    entries[key] = PRESENT
                    tier_sizes[key] = nbytes
                    used += nbytes
                    insert(DEVICE, key, now, nbytes)
                tier.used = used
        finally:
            mover.counters.add(device, 0, miss, total, 0, miss_bytes)

    def install(
        self, key: str, nbytes: int, now: float, prefetched: bool = False, rank: int = 1
    ) -> bool:
        """Puts ``key`` in L1, else L2, as the planner admits; True if it went in."""
        mover = self.mover
        l1, host, planner = mover.tiers[DEVICE], mover.host, mover.planner
        if l1.used + nbytes <= l1.budget or self.room(DEVICE, nbytes, key, now, prefetched, rank):
            l1.used += nbytes
            l1.put_reserved(key, PRESENT, nbytes)
            planner.insert(DEVICE, key, now, nbytes, prefetched=prefetched, rank=rank)
            return True
        if host is not None and (
            host.used + nbytes <= host.budget
            or self.room(HOST, nbytes, key, now, prefetched, rank)
        ):
            host.used += nbytes
            host.put_reserved(key, PRESENT, nbytes)
            planner.insert(HOST, key, now, nbytes, prefetched=prefetched, rank=rank)
            return True
        return False

    def room(
        self,
        tier_index: int,
        nbytes: int,
        key: str,
        now: float,
        prefetch: bool = False,
        rank: int = 1,
    ) -> bool:
        """`Mover.make_room` and `Mover.evict_one` without transfers: the same decisions.

        Evicts until ``nbytes`` fit in the tier and returns True, or returns False if the planner
        does not admit ``key``; the caller adds ``nbytes`` to the tier's ``used``.
        """
        mover = self.mover
        tier = mover.tiers[tier_index]
        if nbytes > tier.budget:
            return False
        entries, sizes, host = tier.entries, tier.sizes, mover.host
        while tier.used + nbytes > tier.budget:
            taken = mover.take_victim(tier_index, key, prefetch, rank)
            if taken is None or taken is REFUSED:
                return False
            victim, destination = taken
            del entries[victim]
            # Replay puts each block with its size (`install`); the store knows the rest.
            size = sizes.pop(victim, None) or mover.info(victim).nbytes
            if destination == HOST and host is not None and (
                host.used + size <= host.budget or self.room(HOST, size, victim, now)
            ):
                host.used += size
                host.put_reserved(victim, PRESENT, size)
                mover.planner.insert(HOST, victim, now, size)
            tier.used -= size
        return True
