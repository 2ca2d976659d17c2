"""cacheflow-jax: a three-tier cache (device, host, TensorStore) for JAX inference data.

Public surface (docs/design.md has the contracts): `open_store`, `write_store`, `TieredCache`,
`serving`, the policies `lfu`, `lru`, `lfu_plain`, `cacheflow_jax.orbax.restore_lazy`, and
`cacheflow_jax.metrics` (the cache's counters in Prometheus text format). The command line is
`cacheflow` (`cacheflow --help`).
"""

from cacheflow_jax import orbax  # noqa: E402  (cfj.orbax.restore_lazy)
from cacheflow_jax._blocks import (
    ArrayInfo,
    BlockInfo,
    BudgetError,
    CorruptBlockError,
    DtypeError,
    Store,
    StoreError,
    StoreTimeoutError,
    block_key,
    parse_key,
)
from cacheflow_jax._cache import TieredCache, kind_of
from cacheflow_jax._policy import Policy, get_policy, lfu, lfu_plain, lru
from cacheflow_jax._prefetch import PrefetchSettings
from cacheflow_jax._serving import ServingSession, serving
from cacheflow_jax._store import TensorStoreStore, open_store, write_store
from cacheflow_jax.orbax import LazyArray, materialize, restore_lazy

__version__ = "0.1.0"

__all__ = [
    "ArrayInfo",
    "LazyArray",
    "BlockInfo",
    "BudgetError",
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
    "lfu",
    "lfu_plain",
    "lru",
    "materialize",
    "orbax",
    "open_store",
    "parse_key",
    "restore_lazy",
    "serving",
    "write_store",
]
