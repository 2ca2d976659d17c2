#!/usr/bin/env bash
# One short call on a lent GPU machine: install, check, time. Writes everything to $OUT/gpu_check.log.
# Usage (device tool): bash bench/gpu_check.sh   (timeout_s ~420)
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
log="$OUT/gpu_check.log"
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  python -m pip install -q -e '.[test,bench]' 2>&1 | tail -2
  python -c "import jax; print('jax', jax.__version__, jax.devices())"
  # Correctness first: the cache, store and kernels (when present) on the accelerator.
  timeout 240 python -m pytest -q -x -p no:cacheprovider tests/test_cache.py tests/test_store.py \
    $(ls tests/test_kernels*.py 2>/dev/null) 2>&1 | tail -3
  # Host-to-device paths and the cache's hit and cold-read costs.
  timeout 60 python -m bench.h2d --runs 5
  timeout 60 python -m bench.hit_cost --runs 3 | tail -12
  timeout 90 python -m bench.cold_read --runs 3 | tail -16
} 2>&1 | tee "$log"
