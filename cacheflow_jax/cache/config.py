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


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The settings of a `TieredCache` (its constructor's keywords; see there for each).

    Raises (at construction):
      BudgetError: ``writeback_bytes`` is not a non-negative integer.
      ValueError: ``l3_timeout`` is not a positive number or None, or ``device_layout`` is
        unknown.
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
