"""Next-key predictors for the prefetcher (the `Predictor` protocol, baselines, the Flax MLP).

Filled in by the predictor issue; the cache talks to predictors only through
`cacheflow_jax.Prefetcher`.
"""
