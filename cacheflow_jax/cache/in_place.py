"""Promotions that never wait: L2 -> L1 where a move copies nothing, or copies without waiting.

On JAX's CPU backend a block in L1 is a ``jax.Array`` in host memory, and L2 keeps such arrays as
they are (`HostTier`), so promoting a block from L2 and demoting L1's victims to L2 move no bytes.
With L2 in the device's pinned_host memory (``host_memory="pinned"``, the default on a GPU) each
move is a copy issued without waiting (`moved_up`, `moved_down` in `cacheflow_jax.cache.mover`):
the copy engines run it while the lock is free again, and a reader of the array waits for it as
for any JAX array.
`Mover.finish` would still release the lock between the victims and register a `Transit` for
each; `promote_in_place` makes the same moves and the same decisions in one hold of the lock
(nothing in it waits on a transfer). `cacheflow_jax.cache.demand` uses it for every L2 hit it can;
`Mover.make_room` and `put` make room the same way (`cacheflow_jax.cache.mover.room_in_place`).
`finish_in_place` does the same for a batch of blocks read from L3: one transfer to the device
for all of them, then their installs in one hold of the lock, in the order `Mover.finish` would
make them one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cacheflow_jax.cache.mover import DEVICE, HOST, moved_down, moved_up, room_in_place
from cacheflow_jax.core.pytree import TREES, leaves_of

if TYPE_CHECKING:
    from cacheflow_jax.cache.mover import Mover
    from cacheflow_jax.core.blocks import BlockInfo


def can_move_in_place(mover: Mover, value: Any) -> bool:
    """Whether promoting ``value`` from L2, and demoting L1's victims to L2, never wait.

    True when L1's device memory is host memory (JAX's CPU backend), L2 keeps such a
    device's arrays as they are (`HostTier`), and ``value``'s leaves are arrays committed
    to L1's device, as blocks that came down from L1 are (`to_device` returns them as they
    are); or when L2 is in pinned_host memory (`Mover.pinned_moves`) and ``value``'s leaves are
    committed arrays in L1's device memory or in that pinned memory. Such a promotion runs in
    one hold of the lock (`promote_in_place`).
    """
    if not mover.in_place:
        return False
    import jax

    sharding = mover.tiers[DEVICE].sharding
    if mover.pinned_moves:
        return _on_device_or_pinned(value, sharding, mover.tiers[HOST].pinned)
    if type(value) is dict:  # a block's usual pytree (K and V): accepted without `leaves_of`
        for leaf in value.values():
            if not (isinstance(leaf, jax.Array) and leaf.sharding is sharding and leaf.committed):
                break
        else:
            return True
    if type(value) in TREES:
        return all(isinstance(leaf, jax.Array) and leaf.committed and leaf.sharding == sharding
                   for leaf in leaves_of(value))  # fmt: skip
    return isinstance(value, jax.Array) and value.committed and value.sharding == sharding


def _on_device_or_pinned(value: Any, sharding: Any, pinned: Any) -> bool:
    """Whether ``value``'s leaves are committed arrays in L1's device memory or in its
    pinned_host memory (L2's), so that `moved_up` moves them without waiting."""
    import jax

    if type(value) is dict:
        leaves = value.values()
    elif type(value) in TREES:
        leaves = leaves_of(value)
    else:
        leaves = (value,)
    for leaf in leaves:
        if not (isinstance(leaf, jax.Array) and leaf.committed):
            return False
        kept = leaf.sharding
        if not (kept is sharding or kept is pinned or kept in (sharding, pinned)):
            return False
    return True


def promote_in_place(mover: Mover, key: str, info: BlockInfo, source: Any) -> Any:
    """Under the lock: `finish` for a block `begin` took from L2 that moves in place
    (`can_move_in_place`): the same moves and decisions, without releasing the lock.
    The caller starts the write-back after releasing it."""
    transit = mover.inflight[key]
    try:
        value = moved_up(mover, source)  # what `device.load` returns: see can_move_in_place
        if room_in_place(mover, DEVICE, info.nbytes, key):
            mover.land(key, DEVICE, value, info.nbytes)
        elif len(mover.tiers) > HOST and room_in_place(mover, HOST, info.nbytes, key):
            # Not admitted to L1: kept in L2, in L2's memory (pinned L2: not the device copy).
            mover.land(key, HOST, moved_down(mover, source), info.nbytes)
        else:
            mover.land(key, None, value, info.nbytes)
    except BaseException as e:
        mover.inflight.pop(key, None)
        mover.leave(key, source, replace=False)  # never lose a runtime block
        transit.finish(error=e)
        raise
    transit.finish(value=value)
    return value


def finish_in_place(
    mover: Mover, owned: list[tuple[str, BlockInfo, Any]], futures: dict[str, Any],
    out: dict[str, Any], deadline: float | None,
) -> list[tuple[str, BlockInfo, Any]]:  # fmt: skip
    """`Mover.finish` for the L3 reads of ``owned`` (those with no source) where moves copy
    nothing (`Mover.in_place`): the blocks read go to the device in one ``jax.device_put`` and
    are installed under one hold of the lock, in ``owned``'s order, with the same decisions
    (`promote_in_place`); their values go into ``out``.

    Returns the entries left to `Mover.finish`, in order: blocks with a source (L2 or parked),
    and reads that failed or timed out (`finish` raises their error and releases them). If the
    batch cannot move at once (a dtype the device would change), every entry is returned.

    Raises:
      BaseException: an install failed; every entry not installed was released with it.
    """
    batch, rest, raws = [], [], []
    for entry in owned:
        key, _, source = entry
        future = futures.get(key)
        if source is not None or future is None:
            rest.append(entry)
            continue
        try:
            raws.append(mover.read_result(key, future, deadline))
        except BaseException:
            rest.append(entry)  # `finish` sees the same error (the future keeps it)
            continue
        batch.append(entry)
    if len(batch) < 2:
        return owned  # nothing to gain over `finish`
    try:
        values = mover.tiers[DEVICE].load_many(raws, owned=True)
    except BaseException:
        return owned  # `finish` raises for the keys that cannot move
    done = 0
    try:
        with mover.lock:
            for (key, info, _), value in zip(batch, values):
                out[key] = promote_in_place(mover, key, info, value)
                done += 1
    except BaseException as e:  # the blocks not installed yet are released: none may hang
        mover.abandon(batch[done + 1 :], e)  # promote_in_place released the one that failed
        mover.abandon(rest, e)
        raise
    finally:
        mover.writeback.start()  # L1's and L2's victims may have been parked
    return rest
