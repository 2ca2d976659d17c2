"""L1 (device) and L2 (host) tiers: storage and byte accounting only; the policy decides.

A tier holds values by key and counts bytes against a hard budget. ``used`` includes bytes
*reserved* for blocks on their way in, so the budget holds at every moment: room is reserved before
a transfer starts and released only after a block has left. Tiers are not thread-safe on their own;
`TieredCache` calls them under its lock and never performs a transfer (``load``) under it.
"""

from __future__ import annotations

import abc
import numbers
from typing import TYPE_CHECKING, Any

from cacheflow_jax.core.blocks import BudgetError, DtypeError
from cacheflow_jax.core.pytree import TREES, leaves_of, tree_map
from cacheflow_jax.tiers.placement import Placement, placement_for

if TYPE_CHECKING:  # imported where used: replay's metadata tiers run without JAX or numpy
    import jax
    import numpy as np

# A value standing in for a block's bytes when the cache only tracks metadata (replay).
PRESENT = True


# Dtypes of fewer than 8 bytes that `check_device_dtype` found JAX keeps as they are: JAX narrows
# only 64-bit types (and complex128), so whether ``jax_enable_x64`` is on does not change that,
# and the check of a block on every access is one set lookup.
_KEPT_DTYPES: set[Any] = set()


def check_device_dtype(dtype: np.dtype, key: str) -> None:
    """Raises `DtypeError` if JAX would change ``dtype`` on the way to the device.

    With ``jax_enable_x64`` off (JAX's default), ``jax.device_put`` silently narrows 64-bit
    arrays (int64 -> int32, float64 -> float32, complex128 -> complex64); a cache must never
    serve or write back such a changed block.
    """
    if dtype in _KEPT_DTYPES:
        return
    import jax
    import numpy as np

    dtype = np.dtype(dtype)
    kept = jax.dtypes.canonicalize_dtype(dtype)
    if kept == dtype and dtype.itemsize < 8:
        _KEPT_DTYPES.add(dtype)
    if kept != dtype:
        narrowed = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
        raise DtypeError(
            f"block {key!r} has dtype {dtype}, which JAX would silently narrow to {narrowed} on "
            "the device because jax_enable_x64 is off. Enable 64-bit types first "
            "(jax.config.update('jax_enable_x64', True)), or store the array as "
            f"{narrowed} yourself"
        )


def narrowed(dtype: Any) -> bool:
    """Whether JAX would narrow ``dtype`` on the way to the device (64-bit, x64 off)."""
    import jax
    import numpy as np

    return np.dtype(dtype) != jax.dtypes.canonicalize_dtype(dtype)


class AbstractTier(abc.ABC):
    """A byte-budgeted map from key to a block value."""

    name: str
    budget: int
    used: int
    entries: dict[str, Any]
    holds_trees = True  # pytree blocks (`_pytree`) as well as arrays
    host_memory = False  # a device tier whose device's memory is host memory (JAX's CPU)

    def __init__(self, budget: int, *, setting: str) -> None:
        # numbers.Integral: Python's and numpy's integers (numpy registers its own).
        if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
            raise BudgetError(f"{setting}={budget!r} must be an integer number of bytes")
        if budget < 0:
            raise BudgetError(f"{setting}={budget} is negative; give a byte budget >= 0")
        self.budget = int(budget)
        self.used = 0
        self.entries = {}
        self.sizes: dict[str, int] = {}  # key -> nbytes of entries put with put_reserved

    def reserve(self, nbytes: int) -> bool:
        """Reserves ``nbytes`` if they fit in the budget; returns whether they did."""
        if self.used + nbytes > self.budget:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Returns ``nbytes`` of reserved or resident room."""
        self.used -= nbytes

    def put_reserved(self, key: str, value: Any, nbytes: int) -> None:
        """Stores ``value`` (``nbytes`` bytes) in room already reserved for it."""
        self.entries[key] = value
        self.sizes[key] = nbytes

    def pop(self, key: str) -> Any:
        """Removes and returns a value; its bytes stay counted until ``release``."""
        self.sizes.pop(key, None)
        return self.entries.pop(key)

    @abc.abstractmethod
    def load(self, value: Any, *, owned: bool = False) -> Any:
        """Converts a value from another tier (or the store) into this tier's form. May block.

        ``owned``: the cache holds the only reference to ``value`` and nothing writes to it again
        (a store read, or a block leaving another tier), so the result may share its memory.
        A caller's array (`TieredCache.put`) is never owned: it is copied.
        """

    def load_many(self, values: list[Any], *, owned: bool = False) -> list[Any]:
        """`load` of several values (a tier may move them in one transfer)."""
        return [self.load(value, owned=owned) for value in values]


class DeviceTier(AbstractTier):
    """L1: ``jax.Array`` values on one device."""

    name = "device"

    def __init__(self, budget: int, *, device: jax.Device | None = None) -> None:
        import jax

        super().__init__(budget, setting="device_bytes")
        self.device = device if device is not None else jax.local_devices()[0]
        self.sharding = jax.sharding.SingleDeviceSharding(self.device)
        self.placement = Placement(self.device, self.sharding)
        self.host_memory = self.device.platform == "cpu"

    def load(self, value: Any, *, owned: bool = False, wait: bool = True) -> jax.Array:
        """The block (an array, or a pytree of arrays: `_pytree`) on the device; ``wait=False``:
        its transfer may still run (see `to_device`)."""
        return to_device(value, self.device, owned=owned, placement=self.placement, wait=wait)

    def load_many(self, values: list[Any], *, owned: bool = False) -> list[Any]:
        """`load` of several blocks in one batch of transfers."""
        return to_device(list(values), self.device, owned=owned, placement=self.placement)


def to_device(
    value: Any, device: jax.Device, *, owned: bool = False, placement: Placement | None = None,
    wait: bool = True,
) -> Any:  # fmt: skip
    """``value`` (an array or a pytree of arrays) as ready arrays on ``device``, committed.

    Every leaf is committed to ``device``, as a block coming from any other tier is, so that a
    jitted function taking blocks compiles once wherever each came from (an uncommitted array
    is another cache entry); a leaf already there is not copied. The leaves that move go in one
    batch (`Placement.put`). An ``owned`` host block (see `AbstractTier.load`) may become the
    device array itself where the device's memory is host memory (the CPU backend, with a
    64-byte aligned buffer, as `_fastread`'s are): an L2 -> L1 move is then free, as it is in
    fact. A caller's array is copied: the CPU backend aliases an aligned numpy array whatever
    ``may_alias`` says (jax 0.10), and the caller may write into it later.

    ``wait``: False returns the arrays with their transfers possibly still running (a reader
    waits for them as for any array); the cache's moves under its lock use it (`moved_up`).

    ``placement``: the device's `Placement`, when the caller keeps one (it makes committing a
    leaf and moving a small one cost a fraction of the public calls; `DeviceTier` has one);
    else the process's one for ``device`` (`placement_for`).

    Raises:
      DtypeError: the device changed a dtype (callers check with `check_device_dtype` first).
    """
    import jax

    if placement is None:
        placement = placement_for(device)
    tree = type(value) in TREES
    leaves = leaves_of(value) if tree else [value]
    moving = []
    changed = False
    for i, leaf in enumerate(leaves):
        if (isinstance(leaf, jax.Array) and leaf.devices() == {device}
                and leaf.sharding.memory_kind in (None, "device")):  # not pinned_host (L2)
            if not leaf.committed:
                changed = True
                leaves[i] = placement.commit(leaf)  # the same buffer, committed
            continue
        if not owned and device.platform == "cpu" and not isinstance(leaf, jax.Array):
            import numpy as np

            leaf = np.array(leaf, copy=True)
        moving.append((i, leaf))
    if moving:
        out = placement.put([leaf for _, leaf in moving], may_alias=True if owned else None)
        for (i, leaf), moved in zip(moving, out):
            if moved.dtype != leaf.dtype:
                raise DtypeError(
                    f"the device changed a block's dtype from {leaf.dtype} to {moved.dtype}"
                )
            leaves[i] = moved
        if wait:
            jax.block_until_ready(out)  # the transfer has finished before the bytes count
        changed = True
    if not tree:
        return leaves[0]
    if owned and not changed:
        return value  # every leaf is already there, committed: the same (owned) block
    it = iter(leaves)
    return tree_map(lambda _: next(it), value)


class HostTier(AbstractTier):
    """L2: arrays in host memory.

    A numpy array, or, for a block that comes down from a device whose memory is host memory
    (JAX's CPU backend), that block's ``jax.Array`` itself: a copy would only duplicate the same
    bytes in the same memory, and a promotion would copy them back. Elsewhere blocks are copied
    to numpy (``jax.device_get``), or, with ``pinned``, to that device's ``pinned_host`` memory.

    Args:
      budget: bytes.
      pinned: the L1 device whose blocks, when they come down, are kept in its ``pinned_host``
        memory (``jax.device_put`` to that memory kind): page-locked host memory, which the
        device's copy engines read and write directly, where a numpy array is pageable memory
        that the runtime first copies through a staging buffer. Blocks read from L3 stay numpy.
        None: every block is numpy (or the CPU backend's own array, as above).
    """

    name = "host"

    def __init__(self, budget: int, *, pinned: jax.Device | None = None) -> None:
        super().__init__(budget, setting="host_bytes")
        self.pinned = None
        if pinned is not None:
            import jax

            self.pinned = jax.sharding.SingleDeviceSharding(pinned, memory_kind="pinned_host")

    def load(
        self, value: Any, *, owned: bool = False, wait: bool = True
    ) -> np.ndarray | jax.Array:
        """The block as L2 keeps it; ``wait=False`` (pinned only): a copy to pinned_host memory
        may still run (`moved_down`)."""
        if type(value) in TREES:
            leaves = leaves_of(value)
            pinned = self._pin_leaves(leaves, wait) if self.pinned is not None else leaves
            kept = [_to_host_tier(leaf, owned, self.pinned, wait) for leaf in pinned]
            if owned and all(a is b for a, b in zip(kept, leaves)):
                return value  # device arrays in host memory: the same (owned) block
            it = iter(kept)
            return tree_map(lambda _: next(it), value)
        return _to_host_tier(value, owned, self.pinned, wait)

    def _pin_leaves(self, leaves: list[Any], wait: bool) -> list[Any]:
        """A block's leaves with those in the pinned device's memory copied to its
        ``pinned_host`` memory in one batch (one transfer call and one wait for the block, where
        `_to_host_tier` would make one of each per leaf)."""
        import jax

        pinned = self.pinned
        moving = [i for i, leaf in enumerate(leaves)
                  if isinstance(leaf, jax.Array) and leaf.devices() == pinned.device_set
                  and leaf.sharding.memory_kind != "pinned_host"]  # fmt: skip
        if len(moving) < 2:
            return leaves
        moved = jax.device_put([leaves[i] for i in moving], pinned)
        if wait:
            jax.block_until_ready(moved)
        out = list(leaves)
        for i, leaf in zip(moving, moved):
            out[i] = leaf
        return out


def pinned_memory(device: jax.Device) -> bool:
    """Whether ``device`` is an accelerator with a ``pinned_host`` memory kind, where L2 keeps
    the blocks coming down from L1 (`HostTier`'s ``pinned``; the cache's ``host_memory="auto"``).
    JAX's CPU backend has one too, but its device memory is host memory already."""
    return device.platform != "cpu" and has_pinned_host(device)


def has_pinned_host(device: jax.Device) -> bool:
    """Whether ``device`` has a ``pinned_host`` memory kind."""
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except (AttributeError, NotImplementedError, RuntimeError):  # a backend without memories
        return False


def _to_host_tier(value: Any, owned: bool, pinned: Any = None, wait: bool = True) -> Any:
    import jax
    import numpy as np

    if isinstance(value, jax.Array):
        if pinned is not None and value.devices() == pinned.device_set:
            if value.sharding.memory_kind == "pinned_host":
                return value  # already there, and immutable
            moved = jax.device_put(value, pinned)
            return jax.block_until_ready(moved) if wait else moved
        if all(d.platform == "cpu" for d in value.devices()):
            return value  # already in host memory, and immutable
        return np.asarray(jax.device_get(value))
    if not owned and isinstance(value, np.ndarray):
        return value.copy()  # the caller may write to its array again
    return value


class MetadataTier(AbstractTier):
    """A tier that tracks residency and bytes but holds no data (replay)."""

    def __init__(self, budget: int, *, name: str, setting: str) -> None:
        super().__init__(budget, setting=setting)
        self.name = name

    def load(self, value: Any, *, owned: bool = False) -> Any:
        return PRESENT
