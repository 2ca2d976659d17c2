"""Key-agnostic candidate features: what the MLP scores instead of keys.

After each access, `FeatureState` proposes candidate keys from several sources and describes each
candidate with features that never look at the key's identity, so the model works for keys it
never saw in training (new KV blocks, new requests):

* sources: the chain of last successors from the current key (``a -> succ(a) -> ...``), its
  Markov top successors, its stride continuations, the keys that followed it within the lookahead
  window before (co-access), the next fresh indices past the largest seen (the allocation
  frontier), the recent distinct keys, the successors and co-accessed keys of the previous keys,
  and keys that often start a burst (after a time gap);
* features: which sources proposed the candidate and at what rank or depth, its recency (in
  accesses and in time relative to the typical gap), decayed frequency, successor and co-access
  probabilities, kind and prefix relative to the current key, block index delta, size ratio, and
  context of the current access (the time gap before it, whether its key is new, whether the last
  stride or last successor predicted it).

`FEATURES` names the columns. Everything here is plain Python over dicts; per access ``observe``
costs O(W + s) for lookahead W and s successors kept per key, and ``features_into`` O(C F) for C
candidates and F features.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Mapping
from operator import itemgetter
from typing import Any

import numpy as np

from predictor._baselines import (
    DEFAULT_MAX_KEYS,
    LastSuccessor,
    Markov,
    Stride,
    split_index,
    touch,
)
from predictor._protocol import Access, as_access

FEATURES = (
    "seen",
    "recency_accesses",
    "recency_time",
    "frequency",
    "is_current",
    "successor_chain",  # 1/depth in the last-successor chain (1: the last_successor baseline)
    "markov_p",
    "markov_rank",
    "coaccess_p",
    "stride_step",
    "frontier_step",
    "recent_rank",
    "prev_markov_p",
    "prev_coaccess_p",
    "prev_successor",
    "burst_start",
    "same_kind",
    "same_prefix",
    "index_delta",
    "index_delta_is_1",
    "size_ratio",
    "sources",
    "ctx_gap",
    "ctx_new_key",
    "ctx_key_count",
    "ctx_on_stride",
    "ctx_on_successor",
    "ctx_key_age",  # accesses since the current key's previous access (its last transition)
    "ctx_branching",  # distinct successors of the current key
)
NUM_FEATURES = len(FEATURES)
_F = {name: i for i, name in enumerate(FEATURES)}
# Columns, named once: `features_into` runs on the prefetch worker for every prediction.
_SEEN, _RECENCY_ACCESSES, _RECENCY_TIME = _F["seen"], _F["recency_accesses"], _F["recency_time"]
_FREQUENCY, _IS_CURRENT, _CHAIN = _F["frequency"], _F["is_current"], _F["successor_chain"]
_MARKOV_P, _MARKOV_RANK, _COACCESS = _F["markov_p"], _F["markov_rank"], _F["coaccess_p"]
_STRIDE, _FRONTIER, _RECENT = _F["stride_step"], _F["frontier_step"], _F["recent_rank"]
_PREV_MARKOV, _PREV_COACCESS = _F["prev_markov_p"], _F["prev_coaccess_p"]
_PREV_SUCCESSOR, _BURST_START = _F["prev_successor"], _F["burst_start"]
_SAME_KIND, _SAME_PREFIX, _INDEX_DELTA = _F["same_kind"], _F["same_prefix"], _F["index_delta"]
_INDEX_DELTA_IS_1, _SIZE_RATIO, _SOURCES = _F["index_delta_is_1"], _F["size_ratio"], _F["sources"]
_CTX = _F["ctx_gap"]  # the context columns, the same for every candidate, run to the end
_SOURCE_WEIGHT = 1.0 / 6.0  # a source's share of the ``sources`` column
_COUNT = itemgetter(1)


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """How candidates are proposed and described; saved with the model.

    Attributes:
      history: H, the current key and the H-1 keys before it whose successors are candidates.
      lookahead: W, the window of the co-access statistics and of the training labels.
      max_candidates: C, candidates scored per call (the model's fixed input height).
      recent: recent distinct keys proposed.
      chain_depth: depth of the last-successor chain followed from the current key.
      markov_top: Markov successors proposed per key.
      stride_steps: stride continuations proposed.
      coaccess_top: co-accessed keys proposed per key.
      frontier_steps: fresh indices past the largest seen index proposed.
      markov_decay: the Markov tables' decay.
      frequency_half_life: half-life of the decayed frequency, in accesses.
      max_successors: successors kept per key in the Markov and co-access tables.
      max_keys: bound of every per-key table.
    """

    history: int = 4
    lookahead: int = 8
    max_candidates: int = 48
    recent: int = 8
    chain_depth: int = 8
    markov_top: int = 4
    stride_steps: int = 6
    coaccess_top: int = 4
    frontier_steps: int = 4
    markov_decay: float = 0.95
    frequency_half_life: float = 2000.0
    max_successors: int = 32
    max_keys: int = DEFAULT_MAX_KEYS

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "markov_decay":
                ok = 0.0 < value <= 1.0
            elif field.name == "frequency_half_life":
                ok = value > 0
            else:
                ok = isinstance(value, int) and value >= 1
            if not ok:
                raise ValueError(f"feature setting {field.name}={value!r} is out of range")

    def to_json(self) -> dict[str, Any]:
        """The settings as a JSON-able dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FeatureConfig:
        """The settings from `to_json`'s dict.

        Raises:
          ValueError: an unknown or out-of-range setting.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown feature settings {sorted(unknown)}; known: {sorted(names)}")
        return cls(**data)


class FeatureState:
    """The explicit state behind the candidate features: statistics of the stream so far."""

    def __init__(self, config: FeatureConfig) -> None:
        self.config = config
        self.reset()

    def reset(self) -> None:
        """Forgets every observed access."""
        cfg = self.config
        self.n = 0  # accesses observed
        self.last_pos: dict[str, int] = {}
        self.last_t: dict[str, float] = {}
        self.info: dict[str, tuple[str, int]] = {}  # key -> (kind, nbytes)
        self.freq: dict[str, tuple[float, int]] = {}  # key -> (decayed count, position)
        self.occ: dict[str, int] = {}  # key -> accesses
        self.coaccess: dict[str, dict[str, float]] = {}  # a -> {b: times b came within W after a}
        self.frontier: dict[str, int] = {}  # prefix of 1-d indices -> largest index seen
        self.starts: dict[str, float] = {}  # key -> decayed count of starting a burst
        self.hist: collections.deque[str] = collections.deque(
            maxlen=max(cfg.lookahead, cfg.history, 4 * cfg.recent)
        )
        self.successor = LastSuccessor(max_keys=cfg.max_keys)
        self.markov = Markov(
            decay=cfg.markov_decay, max_successors=cfg.max_successors, max_keys=cfg.max_keys
        )
        self.stride = Stride(max_keys=cfg.max_keys)
        self.t = 0.0
        self.gap = 0.0  # time since the previous access
        self.ema_gap = 0.0
        self.new_key = True
        self.key_age = 1.0
        self.on_stride = False
        self.on_successor = False

    def observe(self, access: Access | Mapping[str, Any]) -> None:
        """Updates every statistic with one access."""
        a = access if isinstance(access, Access) else as_access(access)
        cfg = self.config
        key, n = a.key, self.n
        prev = self.hist[-1] if self.hist else None
        self.on_successor = prev is not None and self.successor.successor.get(prev) == key
        cont = self.stride.continuations(1)
        self.on_stride = bool(cont) and cont[0][0] == key
        self.successor.observe(a)
        self.markov.observe(a)
        self.stride.observe(a)
        gap = max(a.t - self.t, 0.0) if n else 0.0
        if n and self.ema_gap > 0 and gap > 2.0 * self.ema_gap:
            starts = self.starts
            for s in starts:
                starts[s] *= 0.98
            starts[key] = starts.get(key, 0.0) + 1.0
            if len(starts) > 64:
                del starts[min(starts, key=starts.__getitem__)]
        self.gap = gap
        self.ema_gap = gap if n == 1 else 0.99 * self.ema_gap + 0.01 * gap
        self.t = a.t
        prev_pos = self.last_pos.get(key)
        self.new_key = prev_pos is None
        self.key_age = 1.0 if prev_pos is None else math.log1p(n - prev_pos) / 12.0
        # co-access: key came within W after each of the last W keys
        cap = cfg.max_successors
        for p in list(self.hist)[-cfg.lookahead :]:
            row = self.coaccess.get(p)
            if row is None:
                row = {}
                touch(self.coaccess, p, row, cfg.max_keys)
            row[key] = row.get(key, 0.0) + 1.0
            if len(row) > cap:
                del row[min(row, key=row.__getitem__)]
        touch(self.last_pos, key, n, cfg.max_keys)
        touch(self.last_t, key, a.t, cfg.max_keys)
        touch(self.info, key, (a.kind, a.nbytes), cfg.max_keys)
        self.occ[key] = self.occ.get(key, 0) + 1
        if len(self.occ) > cfg.max_keys:
            touch(self.occ, key, self.occ[key], cfg.max_keys)
        f = self.freq.get(key)
        value = 1.0 if f is None else f[0] * 2.0 ** (-(n - f[1]) / cfg.frequency_half_life) + 1.0
        touch(self.freq, key, (value, n), cfg.max_keys)
        split = split_index(key)
        if split is not None and len(split[1]) == 1:
            top = self.frontier.get(split[0], -1)
            if split[1][0] > top:
                touch(self.frontier, split[0], split[1][0], cfg.max_keys)
        self.hist.append(key)
        self.n = n + 1

    def features_into(self, out: np.ndarray) -> list[str]:
        """Writes the current candidates' features into ``out`` and returns their keys.

        Args:
          out: a zeroed float32 array of shape ``(max_candidates, NUM_FEATURES)``; row ``i``
            receives candidate ``i``'s features, rows past the candidates stay zero.

        Returns:
          The candidate keys, at most ``max_candidates``, in source priority order.
        """
        if not self.hist:
            return []
        cands, split_c = self._candidates()
        return self._fill(out, cands, split_c)

    def _candidates(self) -> tuple[dict[str, list[float]], tuple | None]:
        """The candidates, each a feature row with its sources' columns set, in source priority
        order; and the current key's ``split_index``."""
        hist = self.hist
        cfg = self.config
        c = hist[-1]
        cands: dict[str, list[float]] = {}
        blank = [0.0] * NUM_FEATURES

        def add(key: str, col: int, value: float) -> None:
            row = cands.get(key)
            if row is None:
                row = cands[key] = blank.copy()
            if value > row[col]:
                if not row[col] and col != _MARKOV_RANK:
                    row[_SOURCES] += _SOURCE_WEIGHT  # how many sources proposed it
                row[col] = value

        succ = self.successor.successor
        markov = self.markov
        # last-successor chain from the current key
        x, seen_chain = c, {c}
        for d in range(1, cfg.chain_depth + 1):
            x = succ.get(x)
            if x is None:
                break
            if x in seen_chain:
                if d == 1:  # a repeated key: its last successor is itself, still proposed
                    add(x, _CHAIN, 1.0)
                break
            seen_chain.add(x)
            add(x, _CHAIN, 1.0 / d)
        for r, (x, p) in enumerate(markov.successors(c, cfg.markov_top), 1):
            add(x, _MARKOV_P, p)
            add(x, _MARKOV_RANK, 1.0 / r)
        for x, j in self.stride.continuations(cfg.stride_steps):
            add(x, _STRIDE, 1.0 / j)
        occ = self.occ
        coaccess = self.coaccess
        occ_c = occ.get(c, 1)
        for x, cnt in _top(coaccess.get(c), cfg.coaccess_top):
            add(x, _COACCESS, min(cnt / occ_c, 1.0))
        split_c = split_index(c)
        if split_c is not None and len(split_c[1]) == 1:
            top = self.frontier.get(split_c[0], -1)
            for j in range(1, cfg.frontier_steps + 1):
                add(f"{split_c[0]}{top + j}", _FRONTIER, 1.0 / j)
        r = 0
        for x in reversed(hist):
            if x == c:
                continue
            row = cands.get(x)
            if row is not None and row[_RECENT] > 0:
                continue
            r += 1
            add(x, _RECENT, 1.0 / r)
            if r >= cfg.recent:
                break
        for h in range(2, min(cfg.history, len(hist)) + 1):
            p_key = hist[-h]
            x = succ.get(p_key)
            if x is not None:
                add(x, _PREV_SUCCESSOR, 1.0)
            for x, p in markov.successors(p_key, 2):
                add(x, _PREV_MARKOV, p)
            occ_p = occ.get(p_key, 1)
            for x, cnt in _top(coaccess.get(p_key), 2):
                add(x, _PREV_COACCESS, min(cnt / occ_p, 1.0))
        if self.starts:
            best = max(self.starts.values())
            for x, cnt in _top(self.starts, 4):
                add(x, _BURST_START, cnt / best)
        return cands, split_c

    def _fill(
        self, out: np.ndarray, cands: dict[str, list[float]], split_c: tuple | None
    ) -> list[str]:
        """Completes every candidate's row (recency, frequency, key shape, context), writes the
        first ``max_candidates`` rows into ``out`` and returns their keys."""
        cfg = self.config
        c = self.hist[-1]
        occ = self.occ
        markov = self.markov
        n1 = self.n - 1
        t, ema = self.t, max(self.ema_gap, 1e-9)
        kind_c, nbytes_c = self.info[c]
        last_pos, last_t, freq, info = self.last_pos, self.last_t, self.freq, self.info
        hl = cfg.frequency_half_life
        ctx = (
            math.log1p(self.gap / ema) / 5.0,
            float(self.new_key),
            math.log1p(occ.get(c, 0)) / 5.0,
            float(self.on_stride),
            float(self.on_successor),
            self.key_age,
            math.log1p(len(markov.rows.get(c, ()))) / 3.0,
        )
        prefix_c = split_c[0] if split_c is not None else None
        index_c = split_c[1][0] if split_c is not None and len(split_c[1]) == 1 else None
        log1p, log2 = math.log1p, math.log2
        keys = []
        flat: list[float] = []
        for x, row in itertools.islice(cands.items(), cfg.max_candidates):
            keys.append(x)
            pos = last_pos.get(x)
            if pos is not None:
                row[_SEEN] = 1.0
                row[_RECENCY_ACCESSES] = log1p(n1 - pos) / 12.0
                row[_RECENCY_TIME] = log1p(max(t - last_t[x], 0.0) / ema) / 12.0
                fv, fp = freq[x]
                row[_FREQUENCY] = log1p(fv * 2.0 ** (-(n1 - fp) / hl)) / 5.0
                kind, nb = info[x]
                row[_SAME_KIND] = float(kind == kind_c)
                row[_SIZE_RATIO] = max(-8.0, min(8.0, log2(nb / nbytes_c))) / 8.0
            else:
                row[_RECENCY_ACCESSES] = row[_RECENCY_TIME] = 1.0
                row[_SAME_KIND] = 1.0
            row[_IS_CURRENT] = float(x == c)
            if prefix_c is not None:
                sx = split_index(x)
                if sx is not None and sx[0] == prefix_c:
                    row[_SAME_PREFIX] = 1.0
                    if index_c is not None and len(sx[1]) == 1:
                        d = sx[1][0] - index_c
                        row[_INDEX_DELTA] = math.copysign(log1p(abs(d)), d) / 10.0
                        row[_INDEX_DELTA_IS_1] = float(d == 1)
            row[_CTX:] = ctx
            flat += row
        if flat:
            out.reshape(-1)[: len(flat)] = flat
        return keys


def _top(row: dict[str, float] | None, k: int) -> list[tuple[str, float]]:
    if not row:
        return []
    # ``reverse`` keeps ties in insertion order, as the stable ascending sort of ``-count`` would.
    return sorted(row.items(), key=_COUNT, reverse=True)[:k]
