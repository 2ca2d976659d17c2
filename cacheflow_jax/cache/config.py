"""`CacheConfig`: a `TieredCache`'s settings, checked once, before anything is built."""

from __future__ import annotations

import dataclasses
import numbers
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cacheflow_jax.core.blocks import DEFAULT_TIMEOUT, BudgetError
from cacheflow_jax.prefetch.scheduler import PrefetchSettings

if TYPE_CHECKING:
    from cacheflow_jax.policies import Policy
    from predictor import Predictor

DEVICE_LAYOUTS = ("arrays", "slab")
HOST_MEMORIES = ("auto", "pinned", "pageable")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The settings of a `TieredCache` (its constructor's keywords), checked once.

    Args:
      device_bytes: L1 budget in bytes; at least the largest block of the store.
      host_bytes: L2 budget in bytes; 0 disables L2, otherwise at least the largest block.
      policy: a policy name (``"lfu"``, ``"lru"``, ``"lfu-plain"``) or a `Policy`.
      prefetcher: a `predictor.Predictor` (``observe`` / ``predict`` / ``reset``) that drives
        asynchronous L3 -> L2 -> L1 loads of the blocks it expects next; or the path of a
        predictor checkpoint (``cacheflow train ... --out OUT`` writes ``OUT/checkpoint``), loaded
        here: a damaged one (`predictor.CorruptCheckpointError`) warns once and the cache runs
        without prefetch, a path that is no checkpoint raises `predictor.CheckpointError`;
        None: no prefetch. See `cacheflow_jax.prefetch.scheduler` and ``prefetch``.
      prefetch: how to prefetch (a `PrefetchSettings`); the defaults when None.
      clock: seconds, monotonic; injected for tests and replay.
      device: the L1 device; the default device if omitted.
      read_buffer: how many buffered hits trigger a policy update (1 applies each at once).
      l3_timeout: seconds an L3 read may take before the miss raises `StoreTimeoutError` (a
        `StoreError` naming the key and the store); also the longest `put` waits for room in
        the write-back budget and the default deadline of `flush`. None waits forever. Hits in
        L1 and L2 never wait on L3.
      writeback_bytes: the most bytes of runtime blocks not yet durable in L3 that the cache
        holds at once, resident in L1/L2 or waiting to be written back; a `put` beyond it first
        starts write-backs and waits for them (up to ``l3_timeout``), then raises `StoreError`.
        Default: twice ``device_bytes + host_bytes``.
      device_layout: ``"arrays"`` (one ``jax.Array`` per L1 block, the default) or ``"slab"``
        (one preallocated slab of fixed-size lines filled and read by the Pallas kernels; see
        `cacheflow_jax.tiers.slab`).
      line_bytes: the slab's line size (``device_layout="slab"`` only); by default the largest
        power of two dividing the store's chunk sizes, within 4-64 KiB (see
        `cacheflow_jax.tiers.slab.default_line_bytes`).
      host_memory: where L2 keeps the blocks that come down from L1: ``"pinned"``, in the
        device's ``pinned_host`` memory (page-locked: the copy engines move it both ways without
        a staging copy); ``"pageable"``, as numpy arrays; ``"auto"`` (the default), pinned on an
        accelerator that has that memory kind, else pageable (on JAX's CPU backend, L1's arrays
        themselves). Blocks read from L3 are numpy arrays either way.
      block_bytes: the largest block (a `TensorStoreStore` only): a stored chunk larger than
        this is served as sub-blocks along its leading axis, and ``cache.store`` is then a view
        of the store with those blocks (`TensorStoreStore.with_block_bytes`). Default: the
        store's own blocks, never a share of a budget, so that a key names the same data at
        every budget: at most 4 MiB for stores whose chunks their writer did not choose for
        caching (orbax checkpoints, other zarr3 stores), ``chunk_bytes`` for a store from
        ``write_store``. A ``device_bytes`` smaller than the largest block is a `BudgetError`
        that names a ``block_bytes`` that fits.

    Raises (at construction):
      BudgetError: ``writeback_bytes`` is not a non-negative integer.
      ValueError: ``l3_timeout`` is not a positive number or None, or ``device_layout`` or
        ``host_memory`` is unknown.
      TypeError: ``prefetch`` is not a `PrefetchSettings`.
    """

    device_bytes: int
    host_bytes: int
    policy: str | Policy = "lfu"
    prefetcher: Predictor | str | os.PathLike | None = None
    prefetch: PrefetchSettings | None = None
    clock: Callable[[], float] = time.monotonic
    device: Any = None
    read_buffer: int = 64
    l3_timeout: float | None = DEFAULT_TIMEOUT
    writeback_bytes: int | None = None
    device_layout: str = "arrays"
    line_bytes: int | None = None
    block_bytes: int | None = None
    host_memory: str = "auto"

    def __post_init__(self) -> None:
        timeout = self.l3_timeout
        if timeout is not None and not (
            isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0
        ):
            raise ValueError(f"l3_timeout={timeout!r} must be a number of seconds > 0, or None")
        wb = self.writeback_bytes
        if wb is not None:
            if isinstance(wb, bool) or not isinstance(wb, numbers.Integral):
                raise BudgetError(f"writeback_bytes={wb!r} must be an integer number of bytes")
            if wb < 0:
                raise BudgetError(f"writeback_bytes={wb} is negative; give a byte budget >= 0")
        if self.prefetch is not None and not isinstance(self.prefetch, PrefetchSettings):
            raise TypeError(f"prefetch={self.prefetch!r} must be a PrefetchSettings or None")
        if self.host_memory not in HOST_MEMORIES:
            raise ValueError(f"host_memory={self.host_memory!r} must be one of {HOST_MEMORIES}")
        if self.device_layout not in DEVICE_LAYOUTS:
            raise ValueError(
                f"device_layout={self.device_layout!r} must be one of {DEVICE_LAYOUTS}"
            )

    @property
    def prefetch_settings(self) -> PrefetchSettings:
        return self.prefetch or PrefetchSettings()

    def writeback_budget(self, tier_budgets: int) -> int:
        """``writeback_bytes``, by default twice the tiers' budgets."""
        wb = self.writeback_bytes
        return 2 * tier_budgets if wb is None else int(wb)
