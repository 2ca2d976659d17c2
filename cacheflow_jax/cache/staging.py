"""Staging: blocks only L3 holds, read into L2 ahead of the request that will ask for them.

What SGLang's HiCache does for a queued request (its storage hits are read into host memory
while the request waits) and what LMCache's prefetch does: the slow part of a later miss, the
L3 read, happens before the miss, and the request then finds its blocks in L2. Nothing moves
into L1 (a queued request's blocks would push out the running requests' ones), and a staged
block goes into L2 only with prefetch admission (`Planner.victim`): it never displaces a block
the policy would rather keep. Blocks already in L1 or L2, moving, or parked are left alone.

An access that comes while a block is being staged waits for it, then finds it in L2 (an L2
hit) or, if L2 refused it or the read failed, reads it itself (and sees the error itself).
Staged blocks are counted in ``stats()["prefetch"]["staged"]`` (and ``staged_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from cacheflow_jax.cache.mover import DEVICE, HOST, Transit, room_in_place
from cacheflow_jax.tiers.memory import MetadataTier, narrowed

if TYPE_CHECKING:
    from cacheflow_jax.cache.mover import Mover


# Blocks installed per hold of the lock (about 20 us each on 2 cores).
_HOLD = 8


class Staging:
    """Reads blocks from L3 into L2 (see the module docstring)."""

    def __init__(self, mover: Mover) -> None:
        self.mover = mover

    def has_work(self, keys: list[str]) -> bool:
        """Whether any of ``keys`` is neither resident, moving nor parked: the blocks `stage`
        would look up. Read without the lock (dict membership, as the hit path reads L1): a
        block that moves meanwhile only makes a staging job find nothing, or a hint missed."""
        mover = self.mover
        host = mover.host
        if host is None or isinstance(host, MetadataTier):
            return False
        return any(type(key) is str and mover.fresh(key) for key in keys)

    def stage(self, keys: Iterable[str]) -> int:
        """Reads the blocks of ``keys`` that only L3 holds into L2; returns how many went in.

        Unknown keys, blocks L1 or L2 holds or that are moving, and blocks JAX would narrow are
        skipped; a read that fails is dropped (a later get reads the block again and raises).
        """
        mover = self.mover
        host = mover.host
        if host is None or isinstance(host, MetadataTier):
            return 0
        claimed: list[tuple[str, int, Transit]] = []
        with mover.lock:
            for key in dict.fromkeys(keys):
                if not isinstance(key, str) or not mover.fresh(key):
                    continue
                try:
                    info = mover.info(key)
                except KeyError:
                    continue
                if info.nbytes > host.budget or (mover.check_dtypes and narrowed(info.dtype)):
                    continue
                mover.inflight[key] = transit = Transit()
                claimed.append((key, info.nbytes, transit))
        if not claimed:
            return 0
        try:
            futures = mover.read_many([key for key, _, _ in claimed])
        except Exception:
            futures = [None] * len(claimed)
        raws = self._collect(claimed, futures)
        if mover.in_place:
            return self._install_in_place(claimed, raws)
        staged = 0
        for (key, nbytes, transit), raw in zip(claimed, raws):
            value = None
            try:
                if raw is not None:
                    value = mover.load_host(key, nbytes, raw, prefetch=True)
            except Exception:
                value = None  # not admitted after all: a get reads the block itself
            finally:
                with mover.lock:
                    if value is not None:
                        host.put_reserved(key, value, nbytes)
                        mover.planner.insert(HOST, key, mover.clock(), nbytes)
                        mover.counters.prefetch("staged", nbytes)
                        staged += 1
                    del mover.inflight[key]
                    mover.notify_room()
                transit.finish()
        return staged

    def _install_in_place(self, claimed: list, raws: list) -> int:
        """`stage`'s installs where moves copy nothing (`Mover.in_place`): L2's room is made
        and the blocks go in under the lock, `_HOLD` blocks a hold (a running request's get or
        put waits for the lock at most that long), with the decisions `load_host` makes one
        block at a time (a prefetch's room never waits, so nothing here does)."""
        mover = self.mover
        staged = 0
        for start in range(0, len(claimed), _HOLD):
            transits = []
            chunk = claimed[start : start + _HOLD]
            with mover.lock:
                try:
                    for (key, nbytes, transit), raw in zip(chunk, raws[start : start + _HOLD]):
                        if raw is not None and self._put_in_place(key, nbytes, raw):
                            staged += 1
                        del mover.inflight[key]
                        transits.append(transit)
                except BaseException:  # every claimed block is released: none may hang
                    for key, _, transit in claimed[start + len(transits) :]:
                        mover.inflight.pop(key, None)
                        transits.append(transit)
                    raise
                finally:
                    mover.notify_room()
                    for transit in transits:
                        transit.finish()
        mover.writeback.start()  # L2's victims may have been parked
        return staged

    def _put_in_place(self, key: str, nbytes: int, raw: Any) -> bool:
        """Under the lock: one block of `_install_in_place`; whether it went into L2 (a block
        that fails to go in is dropped, as in `stage`: a get reads it itself)."""
        mover = self.mover
        try:
            value = mover.host.load(raw, owned=True)
            if not room_in_place(mover, HOST, nbytes, key, prefetch=True):
                return False
            mover.install(HOST, key, value, nbytes)  # gives the room back if L2 refuses
        except Exception:
            return False
        mover.counters.prefetch("staged", nbytes)
        return True

    def _collect(self, claimed: list, futures: list) -> list:
        """The blocks read (None where a read failed). Where the device's memory is host memory
        (JAX's CPU backend), as device arrays: L2 then holds them as it holds the blocks that
        come down from L1, and their promotion copies nothing. They move in one transfer, here,
        off the path of the request that will ask for them."""
        mover = self.mover
        deadline = mover.deadline()
        raws: list = []
        for (key, _, _), future in zip(claimed, futures):
            try:
                raws.append(None if future is None else mover.read_result(key, future, deadline))
            except Exception:
                raws.append(None)  # a get reads the block itself and raises
        device = mover.tiers[DEVICE]
        read = [i for i, raw in enumerate(raws) if raw is not None]
        if device.host_memory and read and not mover.pinned_moves:  # (pinned L2 keeps numpy)
            try:
                moved = device.load_many([raws[i] for i in read], owned=True)
            except Exception:
                return raws  # kept as host arrays: the promotion copies them
            for i, value in zip(read, moved):
                raws[i] = value
        return raws
