"""Promotions that copy nothing: L2 -> L1 where the device's memory is host memory.

On JAX's CPU backend a block in L1 is a ``jax.Array`` in host memory, and L2 keeps such arrays as
they are (`HostTier`), so promoting a block from L2 and demoting L1's victims to L2 move no bytes.
`Mover.finish` would still release the lock between the victims and register a `Transit` for
each; `promote_in_place` makes the same moves and the same decisions in one hold of the lock
(nothing in it waits on a transfer). `cacheflow_jax.cache.demand` uses it for every L2 hit it can,
and `put` (`cacheflow_jax.cache.runtime`) to make room in L1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cacheflow_jax.cache.mover import DEVICE, HOST, Transit
from cacheflow_jax.core.pytree import TREES, leaves_of

if TYPE_CHECKING:
    from cacheflow_jax.cache.mover import Mover
    from cacheflow_jax.core.blocks import BlockInfo


def can_move_in_place(mover: Mover, value: Any) -> bool:
    """Whether promoting ``value`` from L2, and demoting L1's victims to L2, copy nothing.

    True when L1's device memory is host memory (JAX's CPU backend), L2 keeps such a
    device's arrays as they are (`HostTier`), and ``value``'s leaves are arrays committed
    to L1's device, as blocks that came down from L1 are (`to_device` returns them as they
    are). Such a promotion runs in one hold of the lock (`promote_in_place`).
    """
    if not mover.in_place:
        return False
    import jax

    sharding = mover.tiers[DEVICE].sharding
    if type(value) in TREES:
        return all(isinstance(leaf, jax.Array) and leaf.committed and leaf.sharding == sharding
                   for leaf in leaves_of(value))  # fmt: skip
    return isinstance(value, jax.Array) and value.committed and value.sharding == sharding


def promote_in_place(mover: Mover, key: str, info: BlockInfo, source: Any) -> Any:
    """Under the lock: `finish` for a block `begin` took from L2 that moves in place
    (`can_move_in_place`): the same moves and decisions, without releasing the lock.
    The caller starts the write-back after releasing it."""
    transit = mover.inflight[key]
    try:
        value = source  # what `device.load` returns for it: see can_move_in_place
        kept = True
        if room_in_place(mover, DEVICE, info.nbytes, key):
            mover.install(DEVICE, key, value, info.nbytes)
        elif len(mover.tiers) > HOST and room_in_place(mover, HOST, info.nbytes, key):
            mover.install(HOST, key, value, info.nbytes)  # not admitted to L1: kept in L2
        else:
            kept = False
        if kept:
            mover.parked.pop(key, None)
        else:
            mover.leave(key, value, replace=False)  # never lose a runtime block
        del mover.inflight[key]
        mover.notify_room()
    except BaseException as e:
        mover.inflight.pop(key, None)
        mover.leave(key, source, replace=False)  # never lose a runtime block
        transit.finish(error=e)
        raise
    transit.finish(value=value)
    return value


def room_in_place(mover: Mover, tier_index: int, nbytes: int, key: str | None) -> bool:
    """Under the lock: `Mover.make_room` where moving a victim down copies nothing, so the
    victims move without the lock being released: the same decisions.

    ``key=None``: no admission (a put). If it must wait for room (`Mover.wait_room` releases
    the lock), ``key`` is first registered in transit unless it already is (a victim on its
    way down is then in no tier): readers wait for it instead of missing it. The caller
    finishes that transit.
    """
    if nbytes > mover.tiers[tier_index].budget:
        return False
    while True:
        step = mover.room_step(tier_index, nbytes, key, False, 1)
        if step is None:
            if key is not None and key not in mover.inflight:
                mover.inflight[key] = Transit()
            mover.wait_room()
            continue
        if type(step) is bool:
            return step
        victim, value, destination = step
        size = mover.info(victim).nbytes
        if destination == HOST and room_in_place(mover, HOST, size, victim):
            mover.tiers[HOST].put_reserved(victim, value, size)  # L1's arrays: L2's too
            mover.planner.insert(HOST, victim, mover.clock(), size)
        else:
            mover.leave(victim, value)
        transit = mover.inflight.pop(victim, None)  # registered if it waited for L2's room
        if transit is not None:
            transit.finish()
        mover.tiers[tier_index].release(size)
        mover.notify_room()
