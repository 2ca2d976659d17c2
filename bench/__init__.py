"""Benchmarks for cacheflow-jax: each module runs as ``python -m bench.<name>``.

See ``bench/README.md`` for the commands, what each one measures and its target. Every speed figure
is a ratio against a baseline measured in the same run, after a warm-up, reported as the median and
p95 over several runs (docs/design.md, "Measuring"). Benchmarks report; they never assert on timings.
"""
