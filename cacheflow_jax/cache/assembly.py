"""How a `TieredCache` is put together: its store view, tiers, policy, planner and helpers.

The facade (`cacheflow_jax.cache.tiered`) only delegates; `assemble` builds the objects it
delegates to, in dependency order, from a checked `CacheConfig`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cacheflow_jax.cache.counters import Counters
from cacheflow_jax.cache.demand import Demand, to_host
from cacheflow_jax.cache.mover import HOST, Mover
from cacheflow_jax.cache.pins import Pins
from cacheflow_jax.cache.prefetch_driver import PrefetchDriver
from cacheflow_jax.cache.replay_moves import SyncMoves
from cacheflow_jax.cache.runtime import RuntimeBlocks, forget_runtime
from cacheflow_jax.cache.staging import Staging
from cacheflow_jax.cache.writeback import WriteBack
from cacheflow_jax.core.blocks import BudgetError, Store
from cacheflow_jax.planning.planner import Planner
from cacheflow_jax.policies import Policy, get_policy
from cacheflow_jax.prefetch.scheduler import load_prefetcher
from cacheflow_jax.tiers.memory import AbstractTier, HostTier, has_pinned_host, pinned_memory

if TYPE_CHECKING:
    from cacheflow_jax.cache.config import CacheConfig


@dataclasses.dataclass
class Parts:
    """What a `TieredCache` is made of (see the facade's module docstring for each job)."""

    store: Store
    policy: Policy
    prefetcher: Any
    counters: Counters
    writeback: WriteBack
    mover: Mover
    demand: Demand
    runtime: RuntimeBlocks
    staging: Staging
    driver: PrefetchDriver | None
    sync: SyncMoves


def assemble(
    store: Store,
    config: CacheConfig,
    tiers: Sequence[AbstractTier] | None,
    describe: Callable[[str], tuple[int, str]],
) -> Parts:
    """Builds a cache's parts over ``store`` (its sub-block view where blocks are cut).

    Raises:
      BudgetError: a budget is too small for the store's largest block.
    """
    if config.block_bytes is not None or tensorstore_store(store):
        from cacheflow_jax.store.tensorstore_store import fit_blocks

        store = fit_blocks(store, config.device_bytes, config.block_bytes)
    asked = None if tiers is not None else (config.device_bytes, config.host_bytes)
    tiers = make_tiers(config, store) if tiers is None else list(tiers)
    largest = check_budgets(tiers, store, asked)
    policy = get_policy(config.policy)
    settings = config.prefetch_settings
    prefetcher = config.prefetcher
    if isinstance(prefetcher, str | os.PathLike):
        prefetcher = load_prefetcher(prefetcher)
    planner = Planner(policy, len(tiers), has_host=len(tiers) > HOST and tiers[HOST].budget > 0,
                      tracking=prefetcher is not None, adaptive=settings.adaptive,
                      prior_return=settings.min_score)  # fmt: skip
    lock = threading.Lock()
    counters = Counters()
    mover: Mover | None = None
    writeback = WriteBack(
        store, lock, budget=config.writeback_budget(sum(t.budget for t in tiers)),
        resident=lambda key: mover.resident(key), to_host=to_host,
        forget=lambda key: forget_runtime(mover, key),
    )  # fmt: skip
    mover = Mover(store, tiers, planner, counters, writeback, Pins(), lock=lock,
                  clock=config.clock, l3_timeout=config.l3_timeout,
                  read_buffer=config.read_buffer)  # fmt: skip
    demand = Demand(mover)
    if tensorstore_store(store):
        store.add_sibling_listener(demand.take_siblings)
    driver = None
    if prefetcher is not None:
        driver = PrefetchDriver(mover, demand, prefetcher, settings, largest, describe=describe)
    replay = driver.replay if driver is not None else None
    sync = SyncMoves(mover, replay if replay is not None and not replay.data else None)
    if replay is not None:
        replay.moves = sync
    return Parts(store, policy, prefetcher, counters, writeback, mover, demand,
                 RuntimeBlocks(mover, demand), Staging(mover), driver, sync)  # fmt: skip


def make_tiers(config: CacheConfig, store: Store) -> list[AbstractTier]:
    from cacheflow_jax.tiers.slab import make_device_tier  # JAX comes with the device tier

    l1 = make_device_tier(config.device_layout, config.device_bytes, store=store,
                          line_bytes=config.line_bytes, device=config.device)  # fmt: skip
    pinned = None
    if config.host_memory == "pinned" or (config.host_memory == "auto"
                                          and pinned_memory(l1.device)):  # fmt: skip
        if not has_pinned_host(l1.device):
            raise ValueError(
                f"host_memory='pinned': device {l1.device} has no pinned_host memory; "
                "use host_memory='pageable' or 'auto'"
            )
        pinned = l1.device
    return [l1, HostTier(config.host_bytes, pinned=pinned)]


def check_budgets(
    tiers: Sequence[AbstractTier], store: Store, asked: Sequence[int] | None = None
) -> int:
    """Checks that each tier holds the store's largest block; returns that block's size.
    ``asked``: the budgets as given (a slab rounds L1's down to whole lines)."""
    largest = 0
    for array in store.arrays().values():
        chunk = [min(c, s) for c, s in zip(array.chunk_shape, array.shape)]
        largest = max(largest, math.prod(chunk) * array.dtype.itemsize)
    for i, (tier, setting) in enumerate(zip(tiers, ("device_bytes", "host_bytes"))):
        if tier.budget == 0 and setting == "host_bytes":
            continue
        if tier.budget < largest:
            given = tier.budget if asked is None else asked[i]
            lines = "" if given == tier.budget else f" (whole lines: {tier.budget} bytes)"
            raise BudgetError(
                f"{setting}={given}{lines} is smaller than the largest block of "
                f"{store.spec} ({largest} bytes); raise {setting} to at least {largest}"
                + (" or set it to 0 to disable L2" if setting == "host_bytes" else "")
                + ", or serve it in smaller blocks (block_bytes=... for open_store, TieredCache "
                "or restore_lazy; or write_store(chunk_bytes=...))"
            )
    return largest


def tensorstore_store(store: Any) -> bool:
    """Whether ``store`` is a `TensorStoreStore` (without importing TensorStore to find out:
    if the store module was never imported, no such store exists)."""
    module = sys.modules.get("cacheflow_jax.store.tensorstore_store")
    return module is not None and isinstance(store, module.TensorStoreStore)
