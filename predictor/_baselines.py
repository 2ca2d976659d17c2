"""Baseline predictors: `last_successor`, `markov` and `stride`.

Each is a small final class implementing `Predictor`, made by a short lowercase factory. Costs
per call (n = successors kept per key, at most ``max_successors``):

* ``last_successor``: observe O(1), predict O(1); one prediction at most.
* ``markov``: observe O(n) (decay of one row), predict O(n log n).
* ``stride``: observe O(d) for a d-dimensional block index, predict O(k d).

Per-key tables are bounded (``max_keys``): when one grows past its bound, the entries touched
least recently are dropped, so a live cache that sees new KV blocks forever keeps bounded memory.
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
from collections.abc import Mapping
from typing import Any

from predictor._protocol import Access, as_access

DEFAULT_MAX_KEYS = 1 << 18

_COUNT = operator.itemgetter(1)
_INDEX = re.compile(r"^(.*?)(\d+(?:,\d+)*)$")


@functools.lru_cache(maxsize=1 << 16)
@functools.lru_cache(maxsize=1 << 16)  # called per candidate per prediction: keys recur
def split_index(key: str) -> tuple[str, tuple[int, ...]] | None:
    """Splits a key into its prefix and trailing numeric block index, if it has one.

    Args:
      key: a key such as ``"kv:123"`` or ``"params/w@3,0"``.

    Returns:
      ``(prefix, index)``, or None when the key does not end in digits.

    >>> split_index("kv:123"), split_index("params/w@3,0"), split_index("bias")
    (('kv:', (123,)), ('params/w@', (3, 0)), None)
    """
    m = _INDEX.match(key)
    if m is None:
        return None
    return m.group(1), tuple(int(p) for p in m.group(2).split(","))


def join_index(prefix: str, index: tuple[int, ...]) -> str:
    """The key of block ``index`` under ``prefix`` (the inverse of `split_index`).

    >>> join_index("params/w@", (3, 1))
    'params/w@3,1'
    """
    return prefix + ",".join(map(str, index))


def touch(table: dict, key: Any, value: Any, max_keys: int) -> None:
    """Sets ``table[key] = value`` as the most recent entry; drops the oldest quarter when full."""
    table.pop(key, None)
    table[key] = value
    if len(table) > max_keys:
        for old in list(itertools.islice(table, len(table) - (3 * max_keys) // 4)):
            del table[old]


class LastSuccessor:
    """After key ``a``, predicts the key that followed ``a`` the last time (one key, score 1)."""

    def __init__(self, *, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.max_keys = max_keys
        self.reset()

    def reset(self) -> None:
        """Forgets every observed access."""
        self.successor: dict[str, str] = {}
        self.last: str | None = None

    def observe(self, access: Access | Mapping[str, Any]) -> None:
        """Records that ``access.key`` followed the previous key."""
        key = access.key if isinstance(access, Access) else as_access(access).key
        if self.last is not None:
            touch(self.successor, self.last, key, self.max_keys)
        self.last = key

    def predict(self, k: int) -> list[tuple[str, float]]:
        """The last successor of the last key, if any (at most one pair, and none if k < 1)."""
        nxt = self.successor.get(self.last) if self.last is not None else None
        return [(nxt, 1.0)] if nxt is not None and k >= 1 else []


class Markov:
    """First-order Markov chain: the top-k successors of the last key by decayed count.

    On each transition ``a -> b`` the counts of ``a``'s successors are multiplied by ``decay`` and
    ``b``'s count grows by one; scores are the counts normalised to sum to one over the row.
    """

    def __init__(
        self, *, decay: float = 0.95, max_successors: int = 16, max_keys: int = DEFAULT_MAX_KEYS
    ) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"markov decay={decay} must be in (0, 1]")
        if max_successors < 1:
            raise ValueError(f"markov max_successors={max_successors} must be >= 1")
        self.decay = decay
        self.max_successors = max_successors
        self.max_keys = max_keys
        self.reset()

    def reset(self) -> None:
        """Forgets every observed access."""
        self.rows: dict[str, dict[str, float]] = {}
        self.last: str | None = None

    def observe(self, access: Access | Mapping[str, Any]) -> None:
        """Counts the transition from the previous key to ``access.key``."""
        key = access.key if isinstance(access, Access) else as_access(access).key
        prev = self.last
        self.last = key
        if prev is None:
            return
        row = self.rows.get(prev)
        if row is None:
            row = {}
        elif self.decay != 1.0:
            d = self.decay
            for succ in row:
                row[succ] *= d
        row[key] = row.get(key, 0.0) + 1.0
        if len(row) > self.max_successors:
            del row[min(row, key=row.__getitem__)]
        touch(self.rows, prev, row, self.max_keys)

    def successors(self, key: str, k: int) -> list[tuple[str, float]]:
        """The top-``k`` successors of ``key`` with their probabilities, best first."""
        row = self.rows.get(key)
        if not row or k < 1:
            return []
        total = sum(row.values())
        best = sorted(row.items(), key=_COUNT, reverse=True)[:k]  # ties: insertion order
        return [(s, c / total) for s, c in best]

    def predict(self, k: int) -> list[tuple[str, float]]:
        """The top-``k`` successors of the last key (probability scores), best first."""
        return self.successors(self.last, k) if self.last is not None else []


class Stride:
    """For keys with a numeric block index, predicts the next indices along the last stride.

    The stride of a prefix (``"kv:"``, ``"params/w@"``) is the difference between the indices of
    its last two accesses with different indices; after ``kv:10`` then ``kv:12`` it predicts
    ``kv:14, kv:16, ...`` with scores ``1, 1/2, ...``. Negative indices are never proposed.
    """

    def __init__(self, *, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.max_keys = max_keys
        self.reset()

    def reset(self) -> None:
        """Forgets every observed access."""
        self.index: dict[str, tuple[int, ...]] = {}  # prefix -> last index
        self.stride: dict[str, tuple[int, ...]] = {}  # prefix -> last non-zero stride
        self.last: tuple[str, tuple[int, ...]] | None = None

    def observe(self, access: Access | Mapping[str, Any]) -> None:
        """Updates the last index and stride of ``access.key``'s prefix."""
        key = access.key if isinstance(access, Access) else as_access(access).key
        split = split_index(key)
        self.last = split
        if split is None:
            return
        prefix, idx = split
        prev = self.index.get(prefix)
        if prev is not None and len(prev) == len(idx) and prev != idx:
            touch(self.stride, prefix, tuple(a - b for a, b in zip(idx, prev)), self.max_keys)
        touch(self.index, prefix, idx, self.max_keys)

    def continuations(self, k: int) -> list[tuple[str, int]]:
        """The next ``k`` keys along the stride with their step numbers 1, 2, ..."""
        if self.last is None or k < 1:
            return []
        prefix, idx = self.last
        step = self.stride.get(prefix)
        if step is None or len(step) != len(idx):
            return []
        out = []
        for j in range(1, k + 1):
            nxt = tuple(a + j * s for a, s in zip(idx, step))
            if min(nxt) < 0:
                break
            out.append((join_index(prefix, nxt), j))
        return out

    def predict(self, k: int) -> list[tuple[str, float]]:
        """Up to ``k`` keys along the last stride of the last key's prefix, scores ``1/step``."""
        return [(key, 1.0 / j) for key, j in self.continuations(k)]


def last_successor(*, max_keys: int = DEFAULT_MAX_KEYS) -> LastSuccessor:
    """A `LastSuccessor` predictor.

    Args:
      max_keys: bound of the successor table (least recently updated entries are dropped).

    Returns:
      A fresh predictor.

    >>> p = last_successor()
    >>> for key in ["a", "b", "a"]:
    ...     p.observe({"key": key})
    >>> p.predict(4)
    [('b', 1.0)]
    """
    return LastSuccessor(max_keys=max_keys)


def markov(
    *, decay: float = 0.95, max_successors: int = 16, max_keys: int = DEFAULT_MAX_KEYS
) -> Markov:
    """A first-order `Markov` predictor with decayed counts.

    Args:
      decay: factor applied to a key's successor counts on each transition out of it (1: none).
      max_successors: successors kept per key (the smallest count is dropped).
      max_keys: bound of the table of keys.

    Returns:
      A fresh predictor.

    Raises:
      ValueError: ``decay`` not in (0, 1] or ``max_successors`` < 1.
    """
    return Markov(decay=decay, max_successors=max_successors, max_keys=max_keys)


def stride(*, max_keys: int = DEFAULT_MAX_KEYS) -> Stride:
    """A `Stride` predictor over keys with a numeric block index (``kv:12``, ``w@3,0``).

    Args:
      max_keys: bound of the per-prefix tables.

    Returns:
      A fresh predictor.

    >>> p = stride()
    >>> for key in ["kv:10", "kv:12"]:
    ...     p.observe({"key": key})
    >>> p.predict(2)
    [('kv:14', 1.0), ('kv:16', 0.5)]
    """
    return Stride(max_keys=max_keys)


BASELINES = {"last_successor": last_successor, "markov": markov, "stride": stride}
