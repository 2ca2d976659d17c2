"""Default byte budgets, from what JAX reports of device memory and from the host's RAM.

``restore_lazy(path)`` with no budgets builds its cache with these:

* L1 (device): ``DEVICE_FRACTION`` (1/2) of the device memory JAX reports free
  (``device.memory_stats()``: ``bytes_limit - bytes_in_use``). Where JAX reports nothing (the
  CPU backend returns ``None``), ``DEFAULT_DEVICE_BYTES`` (1 GiB).
* L2 (host): ``HOST_FRACTION`` (1/4) of the host's physical RAM (``os.sysconf``), or
  ``DEFAULT_HOST_BYTES`` (4 GiB) where the system does not say.

These are budgets, not allocations: the cache holds at most this much, and only what is asked
for.
"""

from __future__ import annotations

import os

import jax

DEVICE_FRACTION = 0.5
DEFAULT_DEVICE_BYTES = 1 << 30
HOST_FRACTION = 0.25
DEFAULT_HOST_BYTES = 4 << 30


def default_device_bytes(device: jax.Device | None = None) -> int:
    """The default L1 budget for ``device`` (this process's first local device if None); see the
    module note."""
    device = device if device is not None else jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and stats.get("bytes_limit"):
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        if free > 0:
            return int(free * DEVICE_FRACTION)
    return DEFAULT_DEVICE_BYTES


def default_host_bytes() -> int:
    """The default L2 budget: ``HOST_FRACTION`` of physical RAM (see the module note)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        total = 0
    return int(total * HOST_FRACTION) if total > 0 else DEFAULT_HOST_BYTES


def default_budgets(device: jax.Device | None = None) -> tuple[int, int]:
    """``(device_bytes, host_bytes)`` for a cache on ``device`` when none are given.

    >>> device_bytes, host_bytes = default_budgets()
    >>> device_bytes > 0 and host_bytes > 0
    True
    """
    return default_device_bytes(device), default_host_bytes()
