"""Runtime blocks (KV blocks and other blocks put at run time): puts, evictions, lookups, pins.

A put checks everything before anything changes, then takes room under the write-back budget
(`cacheflow_jax.cache.writeback`) and in L1 (`Mover.make_room`), beside the pinned blocks
(`cacheflow_jax.cache.pins`). Lookups (`locate`, `cached_prefix`) read the tiers' tables and the
store's, never a block's bytes.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from cacheflow_jax.cache.mover import DEVICE, Transit, room_in_place
from cacheflow_jax.core.blocks import BlockInfo, BudgetError, CorruptBlockError
from cacheflow_jax.core.pytree import flatten, is_tree, plain_leaves
from cacheflow_jax.store.runtime_format import check_runtime_key, numeric
from cacheflow_jax.tiers.memory import check_device_dtype

if TYPE_CHECKING:
    import jax

    from cacheflow_jax.cache.demand import Demand
    from cacheflow_jax.cache.mover import Mover

KINDS = ("weight", "embedding", "kv", "other")


class RuntimeBlocks:
    """Puts and the calls about where blocks are (see the module docstring)."""

    def __init__(self, mover: Mover, demand: Demand) -> None:
        self.mover = mover
        self.demand = demand
        self.later: set[concurrent.futures.Future] = set()  # `put_many_later`'s installs
        self._later_lock = threading.Lock()

    def put(self, key: str, value: Any, *, kind: str, writeback: bool) -> None:
        """See `TieredCache.put`."""
        key, value, info = self._checked(key, value, writeback)
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} for {key!r} must be one of {KINDS}")
        self._put_checked(key, value, info, kind, writeback)

    def put_many(self, items: Iterable[tuple[str, Any]] | Mapping[str, Any], *, kind: str,
                 writeback: bool) -> None:  # fmt: skip
        """See `TieredCache.put_many`."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {KINDS}")
        blocks = self._checked_items(items, writeback)
        done = self._put_in_place(blocks, kind, writeback) if self.mover.in_place else 0
        for key, value, info in blocks[done:]:
            self._put_checked(key, value, info, kind, writeback)

    def put_many_later(self, items: Iterable[tuple[str, Any]] | Mapping[str, Any], *, kind: str,
                       writeback: bool) -> concurrent.futures.Future:  # fmt: skip
        """See `TieredCache.put_many` with ``wait=False``: the checks and the claims here (each
        block is then in transit: a reader of its key waits for it), the installs in order on
        one background thread."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {KINDS}")
        blocks = self._checked_items(items, writeback)
        claimed: list[tuple[str, Any, int, Transit]] = []
        before: list[concurrent.futures.Future] = []
        mine: set[str] = set()  # the keys in ``claimed``
        try:
            for key, value, info in blocks:
                if key in mine:  # a key put twice in one call: its first put goes in first
                    before.append(self._submit(claimed, []))
                    claimed, mine = [], set()
                transit = self._claim(key, info, kind, writeback, value, install=False)
                claimed.append((key, value, info.nbytes, transit))
                mine.add(key)
        finally:  # the blocks claimed are in transit: they go in (or are released) whatever happens
            future = self._submit(claimed, before)
        return future

    def _submit(self, claimed: list[tuple[str, Any, int, Transit]],
                before: list[concurrent.futures.Future]) -> concurrent.futures.Future:  # fmt: skip
        """Hands claimed puts to the one background thread (which runs them in order)."""
        from cacheflow_jax.store.futures import thread_pool  # numpy: not for replay's imports

        future = thread_pool("put", 1).submit(self._install_all, claimed, before)
        with self._later_lock:
            self.later.add(future)
        future.add_done_callback(self._done_later)
        return future

    def _done_later(self, future: concurrent.futures.Future) -> None:
        with self._later_lock:
            self.later.discard(future)

    def wait_later(self, timeout: float | None) -> None:
        """Waits until the installs of every `put_many_later` issued so far have ended (their
        errors stay on their futures, and readers of a block that failed to go in got them).

        Raises:
          TimeoutError: some were still running after ``timeout`` seconds.
        """
        with self._later_lock:
            pending = list(self.later)
        _, left = concurrent.futures.wait(pending, timeout=timeout)
        if left:
            raise TimeoutError(
                f"{len(left)} put_many(wait=False) calls were still installing their blocks after "
                f"{timeout} s; their blocks are kept and go in when done. Wait longer (the "
                "timeout of flush/wait_until_finished, or l3_timeout)"
            )

    def _install_all(self, claimed: list[tuple[str, Any, int, Transit]],
                     before: list[concurrent.futures.Future]) -> None:  # fmt: skip
        """Installs claimed puts in order (each as `put` would); raises the first error after
        trying every block (a block that cannot go in is parked or dropped as in `put`), or the
        first of the jobs ``before`` it (one call's earlier parts, done by now: one thread).

        Between two blocks it hands the interpreter to a thread waiting for it (``sleep(0)``):
        a thread running Python keeps the interpreter until a waiter has waited a switch
        interval (5 ms), so without it the serving thread, back from a jitted step, could wait
        that long for its own next line (docs/kv_cache.md, "Puts stay off the critical path")."""
        mover = self.mover
        first = next((f.exception() for f in before if f.exception() is not None), None)
        done = 0
        try:
            for key, value, nbytes, transit in claimed:
                if done:
                    time.sleep(0)  # a waiting serving thread runs now, not in 5 ms
                done += 1
                try:
                    with mover.lock:
                        try:  # the policy sees the put now, then its moves: as `put` makes them
                            mover.planner.access(key, mover.clock())
                        except BaseException as e:
                            self._release(key, value, transit, e)
                            raise
                        if mover.in_place and self._install_in_place(key, value, nbytes, transit):
                            continue
                    self._install(key, value, nbytes, transit)
                except Exception as e:  # its transit carries the error to its readers
                    first = first or e
        except BaseException as e:  # the blocks not tried yet are released: none may hang
            with mover.lock:
                for key, value, _, transit in claimed[done:]:
                    self._release(key, value, transit, e)
            raise
        finally:
            mover.writeback.start()
        if first is not None:
            raise first

    def _checked_items(self, items: Iterable[tuple[str, Any]] | Mapping[str, Any],
                       writeback: bool) -> list[tuple[str, Any, BlockInfo]]:  # fmt: skip
        """`_checked` of every ``(key, block)`` pair, before any goes in."""
        if isinstance(items, Mapping):
            items = items.items()
        blocks = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(
                    f"put_many takes (key, block) pairs or a dict of blocks; got {item!r:.80}"
                )
            blocks.append(self._checked(*item, writeback))
        return blocks

    def _checked(self, key: str, value: Any, writeback: bool) -> tuple[str, Any, BlockInfo]:
        """``put``'s checks of one block, before anything changes: ``(key, the value as L1 holds
        it, its info)``, or the error that names the key."""
        mover = self.mover
        check_runtime_key(key, mover.store.spec)
        value, info = as_block(key, value)
        nbytes = info.nbytes
        device, wb = mover.tiers[DEVICE], mover.writeback
        if nbytes > device.budget:
            raise BudgetError(
                f"runtime block {key!r} has {nbytes} bytes, more than "
                f"device_bytes={device.budget}; split it or raise device_bytes"
            )
        if writeback and nbytes > wb.budget:
            raise BudgetError(
                f"runtime block {key!r} has {nbytes} bytes, more than "
                f"writeback_bytes={wb.budget}; split it or raise writeback_bytes"
            )
        if info.leaves and not device.holds_trees:
            raise TypeError(
                f"cannot put pytree block {key!r}: device_layout='slab' holds arrays only; "
                "use device_layout='arrays' or put each leaf under its own key"
            )
        return key, device.load(value), info

    def _put_checked(self, key: str, value: Any, info: BlockInfo, kind: str,
                     writeback: bool) -> None:  # fmt: skip
        """`put` of a checked block (`_checked`)."""
        mover = self.mover
        transit = self._claim(key, info, kind, writeback, value)
        if transit is not None:  # else installed in place, under the claim's hold of the lock
            self._install(key, value, info.nbytes, transit)
        mover.writeback.start()

    def _install(self, key: str, value: Any, nbytes: int, transit: Transit) -> None:
        """Makes room in L1 and installs a claimed put (its transit ends with it)."""
        mover = self.mover
        try:
            if not mover.make_room(DEVICE, nbytes, None):
                raise mover.pins.no_room(key, nbytes, mover.tiers[DEVICE].budget)
            with mover.lock:
                mover.install(DEVICE, key, value, nbytes)
                del mover.inflight[key]
                mover.notify_room()
        except BaseException as e:
            with mover.lock:
                self._release(key, value, transit, e)
            raise
        transit.finish(value=value)

    def _put_in_place(self, blocks: list[tuple[str, Any, BlockInfo]], kind: str,
                      writeback: bool) -> int:  # fmt: skip
        """`put_many`'s puts where L1's victims move down without copies (`Mover.in_place`), in
        one hold of the lock, in order, with `put`'s decisions; it stops before the first block
        a put would have to wait for (its key moving, write-back room, pins) and returns how
        many went in (the rest go through `put`)."""
        mover = self.mover
        wb = mover.writeback
        done, left = 0, None
        try:
            with mover.lock:
                mover.drain()
                for key, value, info in blocks:
                    nbytes = info.nbytes
                    if mover.pins or key in mover.inflight:
                        break
                    durable = writeback or wb.is_dirty(key) or mover.store.holds(key)
                    if durable and nbytes > wb.room(key):
                        break
                    transit = self._record(key, info, kind, durable)
                    done += 1
                    if not self._install_in_place(key, value, nbytes, transit):
                        left = (key, value, nbytes, transit)  # ends below, as in `put`
                        break
            if left is not None:
                self._install(*left)
        finally:
            wb.start()
        return done

    def _claim(self, key: str, info: Any, kind: str, writeback: bool, value: Any, *,
               install: bool = True) -> Transit | None:  # fmt: skip
        """Records the put under the lock once its key is not moving and write-back has room;
        returns the put's transit (the block is on its way into L1), or None if ``value`` is
        already in L1: where L1's victims move down without copies (`Mover.in_place`) and
        ``install`` is True, they move and the block goes in under the same hold of the lock."""
        mover = self.mover
        nbytes, device, wb = info.nbytes, mover.tiers[DEVICE], mover.writeback
        deadline = mover.deadline()
        stalled = None  # when the put started waiting for write-back room
        while True:
            with mover.lock:
                mover.drain()
                mover.pins.check_put(key, nbytes, device.budget)
                transit = mover.inflight.get(key)
                durable = writeback or wb.is_dirty(key) or mover.store.holds(key)
                if durable and nbytes > wb.budget:
                    raise BudgetError(
                        f"runtime block {key!r} must be written back (L3 holds an earlier "
                        f"version) and has {nbytes} bytes, more than writeback_bytes="
                        f"{wb.budget}; raise writeback_bytes"
                    )
                if transit is None and (not durable or nbytes <= wb.room(key)):
                    transit = self._record(key, info, kind, durable, access=install)
                    if stalled is not None:
                        wb.count_stall(time.perf_counter() - stalled)
                    if install and mover.in_place and self._install_in_place(
                        key, value, nbytes, transit
                    ):
                        return None
                    return transit
            if transit is not None:
                transit.wait()
                continue
            if stalled is None:
                stalled = time.perf_counter()
            wb.wait_for_room(key, nbytes, deadline, mover.l3_timeout)

    def _record(self, key: str, info: BlockInfo, kind: str, durable: bool, *,
                access: bool = True) -> Transit:  # fmt: skip
        """Under the lock: a put of ``key`` supersedes its cached copy and is shown to the policy
        (``access=False``: by whoever installs it); returns its transit (the block is on its
        way into L1)."""
        mover = self.mover
        mover.discard(key)
        mover.runtime[key] = info
        mover.kinds[key] = kind
        if durable:
            mover.writeback.record_put(key, info.nbytes)
            mover.volatile.discard(key)
        else:
            mover.volatile.add(key)
        mover.inflight[key] = transit = Transit()
        if access:
            mover.planner.access(key, mover.clock())
        return transit

    def _release(self, key: str, value: Any, transit: Transit, error: BaseException) -> None:
        """Under the lock: a claimed put that cannot go in leaves (a block that must be durable
        is parked for its write-back: never lost) and its readers get ``error``."""
        self.mover.leave(key, value)
        self.mover.inflight.pop(key, None)
        transit.finish(error=error)

    def _install_in_place(self, key: str, value: Any, nbytes: int, transit: Transit) -> bool:
        """Under the lock: `put`'s room and install where L1's victims move down without copies
        (`room_in_place`); False if there is no room (`put` then raises as usual)."""
        mover = self.mover
        try:
            if not room_in_place(mover, DEVICE, nbytes, None):
                return False
            mover.install(DEVICE, key, value, nbytes)
        except BaseException as e:
            self._release(key, value, transit, e)
            raise
        del mover.inflight[key]
        mover.notify_room()
        transit.finish(value=value)
        return True

    def evict(self, key: str) -> bool:
        """See `TieredCache.evict`."""
        mover = self.mover
        with mover.lock:
            mover.drain()
            if key in mover.pins:
                raise ValueError(
                    f"cannot evict {key!r}: it is pinned by a running request (cache.pinned); "
                    "it leaves when the request releases it"
                )
            if not mover.evict(key):
                return False
        mover.writeback.start()
        return True

    # ----------------------------------------------------------------------- where blocks are

    def locate(self, key: str) -> str | None:
        """See `TieredCache.locate`."""
        mover = self.mover
        for tier in mover.tiers:
            if key in tier.entries:
                return tier.name
        if key in mover.parked:
            return "host"
        if key in mover.inflight:
            return "moving"
        if key in mover.runtime or mover.store.holds(key):
            return "store"
        try:  # a key this process does not know: the store looks it up (another may have put it)
            mover.store.info(key)
        except (KeyError, CorruptBlockError):
            return None
        return "store"

    def cached_prefix(self, keys: Iterable[str]) -> int:
        """See `TieredCache.cached_prefix`."""
        runtime = self.mover.runtime  # a runtime block put here is in a tier, moving or in L3
        n = 0
        for key in keys:
            if key not in runtime and self.locate(key) is None:
                break
            n += 1
        return n

    # ------------------------------------------------------------------------------- pins

    def pin(self, keys: list[str]) -> list[jax.Array]:
        """Loads ``keys`` into L1 and pins each once (see `TieredCache.pinned`).

        Raises:
          BudgetError: a block cannot stay in L1 beside the pinned ones (nothing stays pinned).
        """
        mover = self.mover
        device, pins = mover.tiers[DEVICE], mover.pins
        held: dict[str, Any] = {}
        try:
            for _ in range(3):  # a block evicted between its get and its pin is got again
                todo = [k for k in dict.fromkeys(keys) if k not in held]
                if not todo:
                    break
                self.demand.get_many(todo)
                with mover.lock:
                    mover.drain()
                    for key in todo:
                        value = mover.l1.get(key)
                        if value is None:
                            continue
                        nbytes = device.sizes.get(key)
                        if pins.add(key, mover.info(key).nbytes if nbytes is None else nbytes):
                            mover.planner.remove(DEVICE, key)
                        held[key] = value
            left = [k for k in keys if k not in held]
            if left:
                with mover.lock:
                    raise pins.no_room(left[0], mover.info(left[0]).nbytes, device.budget)
        except BaseException:
            self.unpin(list(held))
            raise
        return [held[k] for k in keys]

    def unpin(self, keys: list[str]) -> None:
        """Releases one pin of each of ``keys``; a block no longer pinned rejoins the policy."""
        mover = self.mover
        with mover.lock:
            now = mover.clock()
            for key in dict.fromkeys(keys):
                nbytes = mover.pins.remove(key)
                if nbytes is not None and key in mover.l1:
                    mover.planner.insert(DEVICE, key, now, nbytes)
            mover.notify_room()


def forget_runtime(mover: Mover, key: str) -> None:
    """Under the lock: forgets the cache's own copy of runtime block ``key`` (from every tier,
    the write-back's parking and the runtime table), so that the next get reads what the store
    holds. For a write-back a shared store refused (`ConflictError`)."""
    mover.discard(key)
    mover.runtime.pop(key, None)
    mover.kinds.pop(key, None)
    mover.volatile.discard(key)


def as_block(key: str, value: Any) -> tuple[Any, BlockInfo]:
    """``value`` as a block the device holds exactly, and its `BlockInfo`: a numeric numpy or
    JAX array, or a pytree of them (`cacheflow_jax.core.pytree`), else an error naming the key
    (and the leaf's path)."""
    import numpy as np

    if not is_tree(value):
        value = _as_array(key, value)
        return value, BlockInfo(key, tuple(value.shape), np.dtype(value.dtype), int(value.nbytes))
    leaves = plain_leaves(value)
    if leaves is None or not all(type(leaf) in _CHECKED and leaf.dtype in _CHECKED[type(leaf)]
                                 for leaf in leaves):  # fmt: skip
        _check_leaves(key, value)  # the slow path: every leaf checked, errors name the path
        leaves = plain_leaves(value)
    nbytes = 0
    described = []
    for leaf in leaves:
        nbytes += int(leaf.nbytes)
        described.append((tuple(leaf.shape), leaf.dtype))
    return value, BlockInfo(key, (nbytes,), np.dtype(np.uint8), nbytes, leaves=tuple(described))


# Leaf types and dtypes checked once (numeric, not narrowed by the device): the dtypes seen so
# far per array type, so that a KV block's leaves skip the check after the first put.
_CHECKED: dict[type, set] = {}


def _check_leaves(key: str, value: Any) -> None:
    """Checks every leaf of the pytree ``value`` (errors name the key and the leaf's path)."""
    import jax
    import numpy as np

    leaves, _ = flatten(value, key)
    for path, leaf in leaves:
        if not _has_dtype(leaf):
            raise TypeError(
                f"cannot put {key!r}: the leaf at {path} is a {type(leaf).__name__}; the leaves "
                "of a pytree block are numpy or JAX arrays"
            )
        _as_array(f"{key}{path}", leaf)
        if isinstance(leaf, jax.Array | np.ndarray) and not jax.config.jax_enable_x64:
            # x64 off: a dtype that passed stays good (turning x64 on only widens what passes)
            _CHECKED.setdefault(type(leaf), set()).add(np.dtype(leaf.dtype))


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
    if not numeric(dtype):
        raise TypeError(
            f"cannot put {key!r}: dtype {dtype} is not a numeric array dtype; put a numpy or JAX "
            "array of numbers"
        )
    check_device_dtype(dtype, key)
    return array
