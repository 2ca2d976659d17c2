"""Putting a block's leaves on one device, committed, with less of JAX's Python per leaf.

On JAX's CPU backend a ``jax.device_put`` of a list of small arrays costs about 20-25 us a leaf,
and committing an array already on the device with ``jax.make_array_from_single_device_arrays``
8-11 us (jax 0.10, `python -m bench.h2d`). Nearly all of it is Python: finding each leaf's abstract
value, its sharding and its result handler. Both calls end in the same jaxlib call,
``batched_device_put(aval, sharding, shards, devices, committed)`` for a host array and the
``ArrayImpl`` constructor for a device one, which take 2-5 us. A KV block of a few small leaves
pays that Python on every put and every read from L3, on the serving thread.

`Placement` makes those two calls itself in the plain case: one device, an abstract value it
builds as JAX does (cached per shape and dtype), a C-contiguous numpy array or a ``jax.Array``
already on that device. Anything else goes through the public calls. The jaxlib calls are not
public API, so each dtype is checked the first time it is placed: the result of the direct call
must equal the public call's in type, dtype, shape, abstract value, sharding, commitment and
bytes, else that dtype (or every dtype, if the calls are missing) keeps using the public calls.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax


class Placement:
    """Places leaves on one device as committed ``jax.Array``\\ s (see the module docstring).

    Args:
      device: the device.
      sharding: ``SingleDeviceSharding(device)``.
    """

    def __init__(self, device: jax.Device, sharding: Any) -> None:
        self.device = device
        self.sharding = sharding
        self._devices = [device]
        self._put, self._wrap, self._aval_of = direct_calls()
        self._avals: dict[tuple, Any] = {}  # (shape, dtype) -> the abstract value JAX makes
        self._checked: dict[tuple[bool, Any], bool] = {}  # (from host?, dtype) -> direct is ok
        self._lock = threading.Lock()  # a first check runs once per dtype

    def commit(self, leaf: jax.Array) -> jax.Array:
        """``leaf``, an uncommitted array on the device, as the same buffer committed to it
        (what ``jax.make_array_from_single_device_arrays(leaf.shape, sharding, [leaf])`` returns).
        The caller checks that ``leaf`` is on the device and uncommitted (an uncommitted array
        is in the device's default memory, as ``sharding`` says).
        """
        ok = self._checked.get((False, leaf.dtype))
        if ok:
            return self._wrap(self._aval(leaf.shape, leaf.dtype), self.sharding, [leaf],
                              committed=True, _skip_checks=True)  # fmt: skip
        if ok is None and self._put is not None:
            return self._first(False, leaf)
        return _public_commit(leaf, self.sharding)

    def put(self, leaves: list[Any], *, may_alias: bool | None = None) -> list[jax.Array]:
        """``leaves`` (host arrays) on the device, committed: what ``jax.device_put(leaves,
        device)`` returns, transfers possibly still running (the caller waits with
        ``jax.block_until_ready``). As with ``jax.device_put``, a numpy array the device can
        alias (64-byte aligned, on JAX's CPU backend) may become the device array's buffer: the
        caller must not write to it again. ``may_alias``: as for ``jax.device_put``, for the
        leaves that go through it (a ``jax.Array`` on another device, for example)."""
        import numpy as np

        out: list[Any] = [None] * len(leaves)
        rest = []
        checked, put, sharding, devices = self._checked, self._put, self.sharding, self._devices
        for i, leaf in enumerate(leaves):
            if type(leaf) is np.ndarray and leaf.flags.c_contiguous:
                ok = checked.get((True, leaf.dtype))
                if ok:
                    out[i] = put(self._aval(leaf.shape, leaf.dtype), sharding, [leaf], devices,
                                 True)  # fmt: skip
                    continue
                if ok is None and put is not None:
                    out[i] = self._first(True, leaf)
                    continue
            rest.append(i)
        if rest:
            import jax

            # To the sharding, not the device: jax 0.10.2 refuses an array in another memory kind
            # of the same device (L2's pinned_host) with a device as the target.
            moved = jax.device_put([leaves[i] for i in rest], self.sharding, may_alias=may_alias)
            for i, value in zip(rest, moved):
                out[i] = value
        return out

    def direct(self, dtype: Any, *, host: bool) -> bool | None:
        """Whether leaves of ``dtype`` go through the direct calls: from host memory (`put`)
        or already on the device (`commit`); None until the first such leaf is checked."""
        import numpy as np

        return self._checked.get((host, np.dtype(dtype)))

    def _aval(self, shape: tuple, dtype: Any) -> Any:
        key = (shape, dtype)
        aval = self._avals.get(key)
        if aval is None:
            aval = self._avals[key] = self._aval_of(shape, dtype, self.sharding)
        return aval

    def _first(self, host: bool, leaf: Any) -> jax.Array:
        """Places ``leaf`` the public way and the direct way, and keeps the direct way for its
        dtype if both agree (see the module docstring); returns the public way's array."""
        import jax

        if host:
            public = jax.device_put([leaf], self.device)[0]
        else:
            public = _public_commit(leaf, self.sharding)
        with self._lock:
            if (host, leaf.dtype) not in self._checked:
                self._checked[(host, leaf.dtype)] = self._agrees(host, leaf, public)
        return public

    def _agrees(self, host: bool, leaf: Any, public: jax.Array) -> bool:
        import jax
        import numpy as np

        try:
            aval = self._aval(leaf.shape, leaf.dtype)
            if host:
                direct = self._put(aval, self.sharding, [leaf], self._devices, True)
            else:
                direct = self._wrap(aval, self.sharding, [leaf], committed=True,
                                    _skip_checks=True)  # fmt: skip
            jax.block_until_ready([direct, public])
            return (type(direct) is type(public) and direct.dtype == public.dtype
                    and direct.shape == public.shape and direct.aval == public.aval
                    and direct.sharding == public.sharding and direct.committed
                    and public.committed and direct.weak_type == public.weak_type
                    and np.array_equal(_bits(np.asarray(direct)), _bits(np.asarray(public))))  # fmt: skip
        except Exception:  # a jaxlib without these calls, or with others: the public way
            self._avals.pop((leaf.shape, leaf.dtype), None)
            return False


_SHARED: dict[Any, Placement] = {}  # device -> its Placement, for callers that keep none


def placement_for(device: jax.Device) -> Placement:
    """The process's `Placement` for ``device`` (made on first use), so that a dtype's first
    check runs once per device, not once per call."""
    placement = _SHARED.get(device)
    if placement is None:
        import jax

        placement = _SHARED.setdefault(
            device, Placement(device, jax.sharding.SingleDeviceSharding(device)))
    return placement


def _bits(array: Any) -> Any:
    """The array's bytes, so that NaNs compare by their bits."""
    import numpy as np

    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _public_commit(leaf: jax.Array, sharding: Any) -> jax.Array:
    import jax

    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, [leaf])


def direct_calls() -> tuple[Any, Any, Any]:
    """jaxlib's ``batched_device_put``, the ``ArrayImpl`` constructor and a function making the
    abstract value JAX's calls make, or Nones where this JAX lacks them."""
    try:
        from jax._src import core
        from jax._src.array import ArrayImpl
        from jax._src.lib import xla_client

        put = xla_client.batched_device_put
        update = core.update_aval_with_sharding
        shaped = core.ShapedArray
    except (ImportError, AttributeError):
        return None, None, None

    def aval_of(shape: tuple, dtype: Any, sharding: Any) -> Any:
        return update(shaped(shape, dtype, weak_type=False), sharding)

    return put, ArrayImpl, aval_of
