"""The demand path: gets that miss L1, batched gets, host reads for `lookup`, L1 reservations.

A hit is the facade's dict lookup (`TieredCache.get`); everything here runs through the mover's
`begin` / `finish` protocol: claim under the lock, transfer outside it, install under it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from cacheflow_jax.cache.in_place import can_move_in_place, finish_in_place, promote_in_place
from cacheflow_jax.cache.mover import DEVICE, HOST, Transit
from cacheflow_jax.core.blocks import BudgetError
from cacheflow_jax.core.pytree import TREES, tree_map
from cacheflow_jax.tiers.memory import MetadataTier, check_device_dtype

if TYPE_CHECKING:
    import jax
    import numpy as np

    from cacheflow_jax.cache.mover import Mover
    from cacheflow_jax.tiers.memory import AbstractTier


class Demand:
    """Gets for the cache (see the module docstring)."""

    def __init__(self, mover: Mover) -> None:
        self.mover = mover

    def get(self, key: str) -> jax.Array:
        """`TieredCache.get` without prefetch hooks: the hit path, else `get_slow`."""
        mover = self.mover
        value = mover.l1.get(key)
        if value is not None:
            reads = mover.reads
            reads.append(key)
            if len(reads) >= mover.read_buffer:
                mover.apply_hits()
            return value
        return self.get_slow(key)

    def get_slow(self, key: str) -> jax.Array:
        """A get that did not hit L1 on the hit path: claims, waits or loads."""
        if not isinstance(key, str):
            raise TypeError(f"block keys are str; got {type(key).__name__} {key!r}")
        mover = self.mover
        while True:
            with mover.lock:
                mover.drain()
                step = mover.begin(key)
                if step[0] == "own" and step[2] is not None and can_move_in_place(mover, step[2]):
                    step = ("moved", promote_in_place(mover, key, step[1], step[2]))
            if step[0] == "hit":
                return step[1]
            if step[0] == "moved":
                mover.writeback.start()  # L2's victims may have been parked
                return step[1]
            if step[0] == "own":
                deadline = mover.deadline()
                try:
                    future = mover.read(key) if step[2] is None else None
                except BaseException as e:
                    mover.abandon([(key, step[1], step[2])], e)
                    raise
                return mover.finish(key, step[1], step[2], future, deadline)
            transit = step[1]
            transit.wait()
            if transit.error is not None:
                raise transit.error
            if transit.value is not None:
                return transit.value
            # The transit was a demotion or write-back: look again.

    def get_many(self, keys: Iterable[str]) -> list[jax.Array]:
        """See `TieredCache.get_many`."""
        mover = self.mover
        keys = list(keys)
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"block keys are str; got {type(key).__name__} {key!r} in get_many")
        out: dict[str, Any] = {}
        for key in keys:
            value = mover.l1.get(key)
            if value is not None and key not in out:
                mover.reads.append(key)
                out[key] = value
        pending = list(dict.fromkeys(k for k in keys if k not in out))
        for key in pending:  # bad keys fail before anything moves or waits on this call
            info = mover.info(key)
            if mover.check_dtypes:
                check_device_dtype(info.dtype, key)
        while pending:
            pending = self._round(pending, out)
        return [out[k] for k in keys]

    def _round(self, pending: list[str], out: dict[str, Any]) -> list[str]:
        """One round of `get_many`: returns the keys to look at again (they moved meanwhile)."""
        mover = self.mover
        owned, waits, in_tiers = [], [], []
        first_error: BaseException | None = None
        deadline = mover.deadline()
        # First the blocks only L3 holds: claimed at once and their reads issued, so that
        # they run while the blocks in L2 are promoted below.
        try:
            with mover.lock:
                mover.drain()
                host = mover.tiers[HOST].entries if len(mover.tiers) > HOST else {}
                for key in pending:
                    if (key in mover.l1 or key in mover.inflight or key in host
                            or key in mover.parked):  # fmt: skip
                        in_tiers.append(key)
                    else:
                        _, info, src = mover.begin(key)
                        owned.append((key, info, src))
            claimed = [k for k, _, _ in owned]
            futures = dict(zip(claimed, mover.read_many(claimed)))
        except BaseException as e:  # release the loads claimed so far: none may hang
            mover.abandon(owned, e)
            raise
        # Then the rest in order. A block in L2 is promoted before the next key's access, so
        # the policy sees each access followed by its own moves, as in `get` and replay (a
        # promotion left pending behind later accesses would be judged as a block that had
        # left the cache).
        late = []
        i = 0
        while i < len(in_tiers):
            try:
                i, step = self._held(in_tiers, i, out)
            except BaseException as e:
                mover.abandon(owned + late, e)
                raise
            if step is None:
                break
            key = in_tiers[i - 1]
            if step[0] == "wait":
                waits.append((key, step[1]))
            elif step[2] is not None:
                try:
                    out[key] = mover.finish(key, step[1], step[2], None, deadline)
                except BaseException as e:  # finish the other loads before raising
                    first_error = first_error or e
            else:  # it left L2 while the blocks before it moved: read it too
                late.append((key, step[1], None))
        mover.writeback.start()  # in-place promotions may have parked L2's victims
        if late:
            try:
                moved = [k for k, _, _ in late]
                futures.update(zip(moved, mover.read_many(moved)))
            except BaseException as e:
                mover.abandon(owned + late, e)
                raise
            owned += late
        if mover.in_place and len(owned) > 1:
            owned = finish_in_place(mover, owned, futures, out, deadline)
        for key, info, src in owned:
            try:
                out[key] = mover.finish(key, info, src, futures.get(key), deadline)
            except BaseException as e:  # finish the other loads before raising
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        again = []
        for key, transit in waits:
            transit.wait()
            if transit.error is not None:
                raise transit.error
            if transit.value is not None:
                out[key] = transit.value
            else:
                again.append(key)
        return again

    def _held(self, keys: list[str], i: int, out: dict[str, Any]) -> tuple[int, tuple | None]:
        """`Mover.begin` for ``keys[i:]`` in one hold of the lock, serving hits and promotions
        that copy nothing (`cacheflow_jax.cache.in_place`), up to the first key whose step needs
        work outside the lock; returns the index after that key and its step (None: no such key).
        """
        mover = self.mover
        with mover.lock:
            while i < len(keys):
                key = keys[i]
                i += 1
                mover.drain()
                step = mover.begin(key)
                if step[0] == "hit":
                    out[key] = step[1]
                elif step[0] == "own" and step[2] is not None and can_move_in_place(mover, step[2]):
                    out[key] = promote_in_place(mover, key, step[1], step[2])
                else:
                    return i, step
        return i, None

    # ------------------------------------------------------------ embedding rows (`lookup`)

    def get_host_many(self, keys: Iterable[str]) -> list[np.ndarray]:
        """See `TieredCache.get_host_many`."""
        mover = self.mover
        keys = list(keys)
        infos = {key: mover.info(key) for key in keys}
        out: dict[str, Any] = {}
        pending = list(infos)
        while pending:
            owned, waits = [], []
            with mover.lock:
                mover.drain()
                now = mover.clock()
                host = mover.tiers[HOST].entries if len(mover.tiers) > HOST else {}
                # Accesses of resident blocks go to the policy in runs (`Mover.account_hits`),
                # each applied before the next access that is not one: the same order.
                run: list[str] | None = [] if mover.hits_in_batch(now) else None
                count = mover.counters.access
                for key in pending:
                    transit = mover.inflight.get(key)
                    if transit is not None:
                        waits.append((key, transit))
                        continue
                    nbytes = infos[key].nbytes
                    value = mover.l1.get(key)
                    where = "device" if value is not None else "host" if key in host else None
                    if where == "host":
                        value = host[key]
                    if where is not None and run is not None:
                        count(where, nbytes)
                        run.append(key)
                        out[key] = value
                        continue
                    if run:
                        mover.account_hits(run, now)
                        run = []
                    if where is not None:
                        mover.account(key, where, now, nbytes)
                    elif key in mover.parked:  # not resident: the policy sees it alone
                        mover.account(key, "host", now, nbytes)
                        value = mover.parked[key]
                    else:
                        mover.account(key, "miss", now, nbytes)
                        mover.inflight[key] = Transit()
                        owned.append(key)
                        continue
                    out[key] = value
                if run:
                    mover.account_hits(run, now)
            self._host_loads(owned, infos, out)
            pending = []
            for key, transit in waits:
                transit.wait()
                if transit.error is not None:
                    raise transit.error
                pending.append(key)  # look again: it is now in a tier (or back in L3)
        return [to_host(out[key]) for key in keys]

    def _host_loads(self, owned: list[str], infos: Mapping[str, Any], out: dict[str, Any]) -> None:
        """Reads ``owned`` from L3 into ``out``, keeping them in L2 where admitted."""
        mover = self.mover
        first_error: BaseException | None = None
        deadline = mover.deadline()
        for key, future in zip(owned, mover.read_many(owned)):
            transit = mover.inflight[key]
            nbytes = infos[key].nbytes
            try:
                value = mover.read_result(key, future, deadline)
                host_value = mover.load_host(key, nbytes, value)
                with mover.lock:
                    if host_value is not None:
                        mover.tiers[HOST].put_reserved(key, host_value, nbytes)
                        mover.planner.insert(HOST, key, mover.clock(), nbytes)
                    del mover.inflight[key]
                    mover.notify_room()
                out[key] = value
                transit.finish()
            except BaseException as e:  # finish the other reads before raising
                with mover.lock:
                    mover.inflight.pop(key, None)
                transit.finish(error=e)
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def reserve_device(self, nbytes: int) -> AbstractTier:
        """See `TieredCache.reserve_device`."""
        mover = self.mover
        if not mover.make_room(DEVICE, nbytes, None):
            tier = mover.tiers[DEVICE]
            raise BudgetError(
                f"cannot reserve {nbytes} bytes of L1 (device_bytes={tier.budget}, "
                f"{tier.used} in use by blocks in transit or other reservations); ask for "
                "less or raise device_bytes"
            )
        return mover.tiers[DEVICE]

    def release_device(self, nbytes: int) -> None:
        """Returns bytes reserved with `reserve_device`."""
        mover = self.mover
        with mover.lock:
            mover.tiers[DEVICE].release(nbytes)
            mover.notify_room()

    def take_siblings(self, siblings: Mapping[str, np.ndarray]) -> list[str]:
        """Keeps sub-blocks read along with a requested one in L2's free room (a prefetch).

        The store calls this when it read a whole chunk for one sub-block (see
        `TensorStoreStore.add_sibling_listener`). A sibling only takes room nobody holds: it
        never displaces a resident block, and blocks resident or in transit are skipped.

        Returns:
          The keys kept.
        """
        mover = self.mover
        if len(mover.tiers) <= HOST or isinstance(mover.tiers[HOST], MetadataTier):
            return []
        host = mover.tiers[HOST]
        taken = []
        with mover.lock:
            for key, view in siblings.items():
                if key in mover.inflight or key in mover.l1 or key in host.entries:
                    continue
                if not host.reserve(view.nbytes):
                    break
                mover.inflight[key] = Transit()
                taken.append((key, view, mover.inflight[key]))
        kept = []
        import numpy as np

        for key, view, transit in taken:
            try:
                value = np.array(view)  # a copy: the view holds the whole chunk's buffer
            except MemoryError:  # a prefetch is optional: give its room back
                value = None
            with mover.lock:
                if value is not None:
                    host.put_reserved(key, value, view.nbytes)
                    # A guess like any prefetch: unused, it is the first to leave.
                    mover.planner.insert(HOST, key, mover.clock(), view.nbytes, prefetched=True)
                    kept.append(key)
                else:
                    host.release(view.nbytes)
                del mover.inflight[key]
                mover.notify_room()
            transit.finish()
        return kept


def to_host(value: Any) -> np.ndarray:
    """A block (an array, or a pytree of arrays) as numpy arrays on the host."""
    if type(value) in TREES:
        return tree_map(_leaf_to_host, value)
    return _leaf_to_host(value)


def _leaf_to_host(value: Any) -> np.ndarray:
    import numpy as np

    # ``np.asarray`` of a ready jax.Array is what ``jax.device_get`` returns for it (the same
    # host buffer), without device_get's pytree walk and asynchronous copy request per call.
    return np.asarray(value)
