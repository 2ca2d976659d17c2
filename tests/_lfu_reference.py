"""A slow, direct implementation of the ``lfu`` rules (one tier), for the property tests.

It restates the rules of `cacheflow_jax.policies.lfu` with plain lists scanned end to end and
byte counts summed afresh each time: no ordered dicts, no running counters, no lazy trimming. The
fast policy must make the same decisions. Scores use the same formula (``log2`` of the decayed
count plus ``tick * rate``), so they compare equal to the last bit.
"""

from __future__ import annotations

import math

PROTECTED, HISTORY, STEP, START, MIN_GHOSTS = 0.8, 8.0, 0.02, 0.01, 64


class ReferenceLfu:
    """One tier of ``budget`` bytes under the ``lfu`` rules with a fixed half-life."""

    def __init__(self, budget: int, *, half_life: float, window: float | None = None) -> None:
        self.budget = budget
        self.rate = 0.0 if half_life == math.inf else 1.0 / half_life
        self.adaptive = window is None
        self.share = START if window is None else window
        self.least = 0.0
        self.lead = 0
        self.tick = 0
        self.window: list[str] = []  # oldest first
        self.probation: list[str] = []
        self.protected: list[str] = []
        self.size: dict[str, int] = {}
        self.score: dict[str, float] = {}
        self.before: dict[str, float] = {}
        self.ghosts: list[tuple] = []  # (key, nbytes, from_window, stamp), oldest first
        self.referee: list[str] = []  # LRU order, oldest first
        self.referee_size: dict[str, int] = {}
        self.window_out = 0
        self.main_out = 0

    # ---------------------------------------------------------------------- helpers

    def bytes_of(self, keys: list[str]) -> int:
        return sum(self.size[k] for k in keys)

    def resident(self) -> list[str]:
        return self.window + self.probation + self.protected

    def ghost_of(self, key: str) -> tuple | None:
        for ghost in self.ghosts:
            if ghost[0] == key:
                return ghost
        return None

    # ---------------------------------------------------------------------- one access

    def access(self, key: str, nbytes: int) -> bool:
        """One access as the cache makes it; returns whether it hit."""
        self.tick += 1
        base = self.tick * self.rate
        old = self.score.get(key)
        if old is None:
            self.score[key] = base
            old = -math.inf
        else:
            x = old - base
            self.score[key] = base + (math.log2(1.0 + 2.0**x) if x < 50.0 else x)
        lru_hit = key in self.referee
        if lru_hit:
            self.referee.remove(key)
            self.referee.append(key)
        if key in self.window:
            self.window.remove(key)
            self.window.append(key)
            self.before[key] = old
            hit = True
        elif key in self.protected:
            self.protected.remove(key)
            self.protected.append(key)
            hit = True
        elif key in self.probation:
            self.probation.remove(key)
            self.protected.append(key)
            while (self.bytes_of(self.protected)
                   > PROTECTED * (self.bytes_of(self.resident()) - self.bytes_of(self.window))
                   and len(self.protected) > 1):
                self.probation.append(self.protected.pop(0))
            hit = True
        else:
            hit = False
            ghost = self.ghost_of(key)
            if ghost is not None:
                self.ghosts.remove(ghost)
                if self.adaptive:
                    self.vote(ghost)
            self.before[key] = old
        if lru_hit != hit and self.adaptive:
            self.judge(lru_hit)
        if not hit and nbytes <= self.budget:
            self.size[key] = nbytes
            full = False
            while self.bytes_of(self.resident()) + nbytes > self.budget:
                full = True
                self.forget(self.victim())
            self.insert(key, nbytes, full)
        return hit

    def vote(self, ghost: tuple) -> None:
        _, _, from_window, stamp = ghost
        margin = STEP * self.bytes_of(self.resident())
        if from_window and self.window_out - stamp <= margin:
            self.share = min(self.share + STEP, 1.0)
        elif not from_window and self.main_out - stamp <= margin:
            self.share = max(self.share - STEP, self.least)

    def judge(self, lru_hit: bool) -> None:
        self.lead += 1 if lru_hit else -1
        count = len(self.resident())
        worth = max(count, 8)
        if self.lead >= worth:
            self.share += (1.0 - self.share) / 2
            if 1.0 - self.share < 1.0 / max(count, 1):
                self.share = 1.0
            self.least = self.share
            self.lead = 0
        elif self.lead <= -worth:
            self.least /= 2
            self.lead = 0

    def victim(self) -> str:
        main = self.probation if self.probation else self.protected
        window_full = self.bytes_of(self.window) >= self.share * self.bytes_of(self.resident())
        if self.window and (not main or window_full):
            candidate = self.window[0]
            if not main:
                return candidate
            weakest = main[0]
            if self.before.get(candidate, -math.inf) >= self.score[weakest]:
                self.window.remove(candidate)
                self.before.pop(candidate, None)
                self.window_out += self.size[candidate]
                self.probation.append(candidate)
                return weakest
            return candidate
        return main[0] if main else self.window[0]

    def forget(self, key: str) -> None:
        nbytes = self.size[key]
        if key in self.window:
            self.window.remove(key)
            self.before.pop(key, None)
            self.window_out += nbytes
            self.ghosts.append((key, nbytes, True, self.window_out))
        else:
            (self.probation if key in self.probation else self.protected).remove(key)
            self.main_out += nbytes
            self.ghosts.append((key, nbytes, False, self.main_out))
        resident = self.resident()
        while (len(self.ghosts) > max(HISTORY * len(resident), MIN_GHOSTS)
               or sum(g[1] for g in self.ghosts) > HISTORY * self.bytes_of(resident)
               and len(self.ghosts) > MIN_GHOSTS):
            gone = self.ghosts.pop(0)[0]
            del self.score[gone]
            self.before.pop(gone, None)

    def insert(self, key: str, nbytes: int, full: bool) -> None:
        if key not in self.before:
            self.before[key] = -math.inf
        self.window.append(key)
        resident = self.bytes_of(self.resident())
        if key not in self.referee:
            self.referee.append(key)
            self.referee_size[key] = nbytes
            while sum(self.referee_size[k] for k in self.referee) > resident and self.referee:
                self.referee_size.pop(self.referee.pop(0))
        if not full:
            while (self.bytes_of(self.window) > self.share * resident and len(self.window) > 1):
                moved = self.window.pop(0)
                self.before.pop(moved, None)
                self.window_out += self.size[moved]
                self.probation.append(moved)
