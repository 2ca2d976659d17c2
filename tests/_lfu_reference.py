"""A slow, direct implementation of the ``lfu`` rules (one tier), for the property tests.

It restates the rules of `cacheflow_jax.policies.lfu` with plain lists scanned end to end and
byte counts summed afresh each time: no ordered dicts, no running counters, no lazy trimming. The
fast policy must make the same decisions. Scores use the same formula (``log2`` of the decayed
count plus ``tick * rate``), so they compare equal to the last bit. The shadows of the adaptive
policy are reference caches too, one per candidate share (the share 1 is LRU), fed the sampled
accesses (a key is sampled when the low ``shift`` bits of its CRC-32 are 0).
"""

from __future__ import annotations

import math
import zlib

PROTECTED, HISTORY, STEP, START, MIN_GHOSTS = 0.8, 8.0, 0.02, 0.01, 64
CANDIDATES, SAMPLE_BLOCKS, JUMP_LEAD = (0.0, 0.05, 0.2, 1.0), 32, 0.5
CLOSE_SAMPLE, SIGNIFICANCE = 2, 2.0


class ReferenceLfu:
    """One tier of ``budget`` bytes under the ``lfu`` rules with a fixed half-life."""

    def __init__(
        self, budget: float, *, half_life: float, window: float | None = None,
        sample: int = SAMPLE_BLOCKS,
    ) -> None:
        self.budget = budget
        self.rate = 0.0 if half_life == math.inf else 1.0 / half_life
        self.adaptive = window is None
        self.share = 1.0 if window is None else window  # adaptive: LRU until the first reuse
        self.cold = self.adaptive
        self.least = 0.0
        self.pending_votes: list[int] = []  # +1 up, -1 down, since the share last moved
        self.tick = 0
        self.window: list[str] = []  # oldest first
        self.probation: list[str] = []
        self.protected: list[str] = []
        self.size: dict[str, int] = {}
        self.score: dict[str, float] = {}
        self.before: dict[str, float] = {}
        self.ghosts: list[tuple] = []  # (key, nbytes, from_window, stamp), oldest first
        self.window_out = 0
        self.main_out = 0
        self.order: list[str] = []  # residents in the order they came in (a shadow's pruning)
        self.shadows = [] if window is not None else [
            ReferenceLfu(0, half_life=half_life, window=w) for w in CANDIDATES]
        self.shadow_hits = [0] * len(self.shadows)
        self.live_hits = 0
        self.sample = sample
        self.shift = 0
        self.shadow_budget = 0.0

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
        if self.cold and (hit or ghost is not None):  # the first reuse: the share becomes START
            self.cold = False
            self.set_share(START)
        sampled = self.shadows and self.sampled(key)
        if hit and sampled:
            self.step_shadows(key, self.size[key], True, 0)
        if not hit and nbytes <= self.budget:
            self.size[key] = nbytes
            full = False
            while self.bytes_of(self.resident()) + nbytes > self.budget:
                full = True
                self.forget(self.victim())
            if sampled:
                self.step_shadows(key, nbytes, False, nbytes)
            self.insert(key, nbytes, full)
        return hit

    def sampled(self, key: str) -> bool:
        return zlib.crc32(key.encode()) % (1 << self.shift) == 0

    def step_shadows(self, key: str, nbytes: int, hit: bool, coming: int) -> None:
        """A sampled access, ``coming`` bytes before it is inserted here."""
        resident = self.bytes_of(self.resident()) + coming
        count = len(self.resident()) + (coming > 0)
        self.shadow_budget = max(self.shadow_budget, resident / 2**self.shift)
        if count // 2**self.shift > 2 * self.sample:
            self.shift += 1
            self.shadow_budget /= 2
            for shadow in self.shadows:
                for gone in [k for k in shadow.order if not self.sampled(k)]:
                    shadow.forget(gone)
            if not self.sampled(key):
                return
        for i, shadow in enumerate(self.shadows):
            shadow.budget = self.shadow_budget
            self.shadow_hits[i] += shadow.access(key, nbytes)
        self.live_hits += hit
        most = max(self.shadow_hits)
        near = min(range(len(CANDIDATES)), key=lambda i: abs(CANDIDATES[i] - self.share))
        reference = min(self.live_hits, self.shadow_hits[near])
        if most - reference >= JUMP_LEAD * max(count // 2**self.shift, 8):
            share = CANDIDATES[self.shadow_hits.index(most)]
            self.shadow_hits = [0] * len(self.shadows)
            self.live_hits = 0
            self.least = share if share > self.share else 0.0
            self.pending_votes = []
            self.set_share(share)

    def set_share(self, share: float) -> None:
        """The window's share becomes ``share``; its overflow goes to probation, oldest first."""
        self.share = share
        while (len(self.window) > 1 and self.bytes_of(self.window[1:])
               >= share * self.bytes_of(self.resident())):
            self.to_probation(self.window[0])

    def to_probation(self, key: str) -> None:
        self.window.remove(key)
        self.before.pop(key, None)
        self.window_out += self.size[key]
        self.probation.append(key)

    def vote(self, ghost: tuple) -> None:
        _, _, from_window, stamp = ghost
        margin = STEP * self.bytes_of(self.resident())
        if from_window and self.window_out - stamp <= margin:
            up = True
        elif not from_window and self.main_out - stamp <= margin:
            up = False
        else:
            return
        if 2**self.shift <= CLOSE_SAMPLE:  # the shadows are close copies: the votes must agree
            self.pending_votes.append(1 if up else -1)
            net = sum(self.pending_votes)
            if abs(net) < SIGNIFICANCE * math.sqrt(len(self.pending_votes)):
                return
            up = net > 0
            self.pending_votes = []
        if up:
            self.share = min(self.share + STEP, 1.0)
        else:
            self.share = max(self.share - STEP, self.least)

    def victim(self) -> str:
        main = self.probation if self.probation else self.protected
        window_full = self.bytes_of(self.window) >= self.share * self.bytes_of(self.resident())
        if self.window and (not main or window_full):
            candidate = self.window[0]
            if not main:
                if self.share < 1.0:  # main emptied while the share was 1: it starts main
                    self.to_probation(candidate)
                    return self.victim()
                return candidate
            weakest = main[0]
            if self.before.get(candidate, -math.inf) >= self.score[weakest]:
                self.to_probation(candidate)
                return weakest
            return candidate
        return main[0] if main else self.window[0]

    def forget(self, key: str) -> None:
        nbytes = self.size[key]
        self.order.remove(key)
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
        self.order.append(key)
        resident = self.bytes_of(self.resident())
        if not full:
            while (self.bytes_of(self.window) > self.share * resident and len(self.window) > 1):
                self.to_probation(self.window[0])
