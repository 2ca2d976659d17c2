"""Pins: blocks a running request still reads, held in L1 until released.

A pinned block stays in L1's entries (its hits are plain dict lookups) and in L1's ``used``
bytes, but leaves the policy's view: the policy cannot pick it as a victim, its hits are not
counted as accesses, and its TTL does not run. When the last pin is released it rejoins the
policy as a block inserted without an access (as a prefetch lands), with its earlier score.
Budgets stay hard: a put that cannot find room outside the pinned bytes is refused before
anything changes, with a `BudgetError` that names them.

Pins are counted per key (``pinned`` of overlapping key lists nests). The cache calls every
method under its lock.
"""

from __future__ import annotations

from cacheflow_jax.core.blocks import BudgetError


class Pins:
    """Pin counts and bytes of the blocks pinned in L1."""

    __slots__ = ("counts", "sizes", "bytes")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.bytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self.counts

    def __bool__(self) -> bool:
        return bool(self.counts)

    def add(self, key: str, nbytes: int) -> bool:
        """Pins ``key`` once more; True if it was not pinned before (it leaves the policy)."""
        count = self.counts.get(key, 0)
        self.counts[key] = count + 1
        if count:
            return False
        self.sizes[key] = nbytes
        self.bytes += nbytes
        return True

    def remove(self, key: str) -> int | None:
        """Releases one pin of ``key``; its bytes if that was the last one (it rejoins the
        policy), else None."""
        count = self.counts.get(key, 0)
        if count > 1:
            self.counts[key] = count - 1
            return None
        if not count:
            return None
        del self.counts[key]
        nbytes = self.sizes.pop(key)
        self.bytes -= nbytes
        return nbytes

    def check_put(self, key: str, nbytes: int, budget: int) -> None:
        """Refuses a put of a pinned key, or of a block that cannot fit beside the pins.

        Raises:
          ValueError: ``key`` is pinned (a running request reads it).
          BudgetError: ``nbytes`` exceeds the L1 room that the pinned blocks leave.
        """
        if key in self.counts:
            raise ValueError(
                f"cannot put {key!r}: it is pinned by a running request (cache.pinned); put it "
                "after the request releases it, or under another key"
            )
        if self.bytes and nbytes > budget - self.bytes:
            raise self.no_room(key, nbytes, budget)

    def no_room(self, key: str, nbytes: int, budget: int) -> BudgetError:
        """The error of a block that finds no unpinned room in L1."""
        return BudgetError(
            f"no room for block {key!r} ({nbytes} bytes) in L1: {self.bytes} of "
            f"device_bytes={budget} are pinned by {len(self.counts)} blocks of running requests "
            f"and the rest is in use or moving; release pins (leave cache.pinned(...)) sooner, "
            "or raise device_bytes"
        )
