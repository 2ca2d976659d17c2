"""The `Predictor` protocol and the `Access` record every predictor observes.

The cache talks to predictors only through `Predictor` (``TieredCache(prefetcher=...)`` takes
one): ``observe`` one access, ``predict`` the ``k`` keys most likely to be accessed soon with a
score each (higher first), ``reset`` to forget everything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

KINDS = ("weight", "embedding", "kv", "other")


class Access(NamedTuple):
    """One access of the access log v1 (docs/design.md).

    Attributes:
      key: the block's key, e.g. ``"kv:123"`` or ``"params/w@3,0"``.
      t: seconds, non-decreasing along a stream.
      nbytes: the block's size in bytes.
      kind: one of ``weight``, ``embedding``, ``kv``, ``other``.
      req: the request id, if the log has one.
    """

    key: str
    t: float = 0.0
    nbytes: int = 1
    kind: str = "other"
    req: str | None = None


class Predictor(Protocol):
    """What a next-key predictor offers the cache: it sees accesses and proposes keys."""

    def observe(self, access: Access | Mapping[str, Any]) -> None:
        """Updates the predictor's state with one access (an `Access` or an access-log dict)."""
        ...

    def predict(self, k: int) -> list[tuple[str, float]]:
        """Up to ``k`` distinct ``(key, score)`` pairs, best first."""
        ...

    def reset(self) -> None:
        """Forgets every observed access."""
        ...


def as_access(access: Access | Mapping[str, Any]) -> Access:
    """Converts an access-log dict (``{"t", "key", "nbytes", "kind", "req"}``) to an `Access`.

    Args:
      access: an `Access` (returned as is) or a mapping with at least ``key``.

    Returns:
      The `Access`; missing fields take their defaults (t=0, nbytes=1, kind="other").

    Raises:
      TypeError: ``access`` is neither an `Access` nor a mapping with a string ``key``.

    >>> as_access({"key": "kv:3", "t": 1.5, "nbytes": 8, "kind": "kv"})
    Access(key='kv:3', t=1.5, nbytes=8, kind='kv', req=None)
    """
    if isinstance(access, Access):
        return access
    if isinstance(access, Mapping) and isinstance(access.get("key"), str):
        return Access(
            access["key"],
            float(access.get("t", 0.0)),
            int(access.get("nbytes", 1)),
            str(access.get("kind", "other")),
            access.get("req"),
        )
    raise TypeError(
        f"an access must be a predictor.Access or a dict with a string 'key', got {access!r}"
    )
