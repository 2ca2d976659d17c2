"""Eviction and admission policies, one file each: pure functions over an explicit state.

* `lfu` (the default, ``lfu.py``): decayed frequency weighed with recency, over an adaptive
  window; `lfu_plain` is the same with plain counts.
* `lru` (``lru.py``): least recently used.
* `belady` (``belady.py``): the offline optimum, for replay only.

`get_policy` turns a name into a policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cacheflow_jax.policies.base import Policy, admit_all, check_ttl
from cacheflow_jax.policies.lfu import LfuState, lfu, lfu_plain
from cacheflow_jax.policies.lru import LruState, lru

POLICIES: dict[str, Callable[..., Policy]] = {"lfu": lfu, "lru": lru, "lfu-plain": lfu_plain}

__all__ = [
    "POLICIES",
    "LfuState",
    "LruState",
    "Policy",
    "admit_all",
    "check_ttl",
    "get_policy",
    "lfu",
    "lfu_plain",
    "lru",
]


def get_policy(name_or_policy: str | Policy, **settings: Any) -> Policy:
    """Returns a policy by name (``lfu``, ``lru``, ``lfu-plain``) or passes a `Policy` through.

    Args:
      name_or_policy: a name from `POLICIES`, or a `Policy`.
      **settings: keyword settings for the named policy's factory.

    Returns:
      The policy.

    Raises:
      ValueError: the name is unknown; the message lists the known names.
    """
    if isinstance(name_or_policy, Policy):
        return name_or_policy
    try:
        factory = POLICIES[name_or_policy]
    except KeyError:
        raise ValueError(
            f"unknown policy {name_or_policy!r}; choose one of {sorted(POLICIES)}"
        ) from None
    return factory(**settings)
