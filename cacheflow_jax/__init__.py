"""cacheflow-jax: a three-tier cache (device, host, TensorStore) for JAX inference data.

Public surface (docs/design.md has the contracts): `open_store`, `write_store`, `TieredCache`,
`trim_runtime` (the bound of a store shared by many processes, docs/scale.md),
`serving`, the policies `lfu`, `lru`, `lfu_plain`, `cacheflow_jax.orbax.restore_lazy`,
`cacheflow_jax.kv.prefix_keys` (KV block keys by prefix hash), and
`cacheflow_jax.metrics` (the cache's counters in Prometheus text format). The command line is
`cacheflow` (`cacheflow --help`).
"""

import importlib

from cacheflow_jax.cache.config import CacheConfig
from cacheflow_jax.cache.tiered import TieredCache, kind_of
from cacheflow_jax.core.blocks import (
    ArrayInfo,
    BlockInfo,
    BudgetError,
    ConflictError,
    CorruptBlockError,
    DtypeError,
    Store,
    StoreError,
    StoreTimeoutError,
    block_key,
    parse_key,
)
from cacheflow_jax.policies import Policy, get_policy, lfu, lfu_plain, lru
from cacheflow_jax.prefetch.scheduler import PrefetchSettings

# Names from modules that import JAX, TensorStore or orbax load on first use, so that the pure
# Python parts (policies, replay: `cacheflow replay`) start without paying a second for JAX.
_LAZY = {
    "orbax": ("cacheflow_jax.orbax", None),
    "kv": ("cacheflow_jax.kv", None),
    "prefix_keys": ("cacheflow_jax.kv", "prefix_keys"),
    "LazyArray": ("cacheflow_jax.orbax", "LazyArray"),
    "materialize": ("cacheflow_jax.orbax", "materialize"),
    "restore_lazy": ("cacheflow_jax.orbax", "restore_lazy"),
    "ServingSession": ("cacheflow_jax.session.session", "ServingSession"),
    "serving": ("cacheflow_jax.session.session", "serving"),
    "TensorStoreStore": ("cacheflow_jax.store.tensorstore_store", "TensorStoreStore"),
    "open_store": ("cacheflow_jax.store.open", "open_store"),
    "write_store": ("cacheflow_jax.store.write", "write_store"),
    "trim_runtime": ("cacheflow_jax.store.shared", "trim_runtime"),
}


def __getattr__(name: str) -> object:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'cacheflow_jax' has no attribute {name!r}") from None
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__version__ = "0.1.0"

__all__ = [
    "ArrayInfo",
    "LazyArray",
    "BlockInfo",
    "BudgetError",
    "CacheConfig",
    "ConflictError",
    "CorruptBlockError",
    "DtypeError",
    "Policy",
    "PrefetchSettings",
    "ServingSession",
    "Store",
    "StoreError",
    "StoreTimeoutError",
    "TensorStoreStore",
    "TieredCache",
    "block_key",
    "get_policy",
    "kind_of",
    "kv",
    "lfu",
    "lfu_plain",
    "lru",
    "materialize",
    "orbax",
    "open_store",
    "parse_key",
    "prefix_keys",
    "restore_lazy",
    "serving",
    "trim_runtime",
    "write_store",
]
