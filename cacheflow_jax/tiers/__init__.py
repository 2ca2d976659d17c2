"""Private to cacheflow_jax: its public names are re-exported by ``cacheflow_jax``."""
