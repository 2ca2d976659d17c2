"""The library's logger: ``logging.getLogger("cacheflow_jax")``.

What the library reports goes here, at ``WARNING``, where a user would otherwise go wrong
without a word: a budget smaller than a block, a streamed working set larger than L1, a
prefetcher that can issue nothing (`cacheflow_jax.cache.advice`). With no logging configured,
Python prints such a record to stderr (`logging.lastResort`); configure the ``cacheflow_jax``
logger to route or silence them. ``cacheflow`` prints them as ``cacheflow <command>: warning:
...``. Nothing is logged on a hit path.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "cacheflow_jax"
logger = logging.getLogger(LOGGER_NAME)
