#!/usr/bin/env bash
# One short call on a lent GPU machine: check and time the Pallas kernels and the device slab.
# Usage (device tool, from the repository root): bash bench/gpu_check.sh   (timeout_s 540;
# about 6 minutes). Everything it prints is also written to $OUT/gpu_check.log, and the kernel
# table to $OUT/gpu_kernels.json.
#
# The machine (Python 3.12, JAX with CUDA, flax, optax, orbax, tensorstore, pytest, hypothesis)
# cannot reach PyPI, so nothing is installed from the network: the checkout runs from PYTHONPATH.
# Packages it lacks (cachetools for bench.hit_cost, google-crc32c for the store's fast path) can
# travel as wheels in .whl/ (see the device tool's README); they are installed when present.
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
log="$OUT/gpu_check.log"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  $PY -c "import jax; print('jax', jax.__version__, jax.devices())"
  # 1. Each kernel against its reference on fresh random data, then timed as GB/s against a
  #    device-to-device copy of the same bytes; the slab's host->device block path against
  #    jax.device_put. One table.
  timeout 150 $PY -m bench.gpu_kernels --runs 5 --out "$OUT"
  # 2. The tests that touch the device: kernels (compiled Pallas in the base classes, interpret
  #    mode in the Interpret ones), the slab, embedding lookups, the cache on both layouts, and
  #    `Placement` (jaxlib's own transfer calls must agree with the public ones on this device).
  #    Deprecation warnings are shown, not raised: newer JAX deprecates Pallas' Triton backend.
  timeout 240 $PY -m pytest -q -x -p no:cacheprovider -m "not s3" -W default::DeprecationWarning \
    tests/test_kernels.py tests/test_slab.py tests/test_embedding.py tests/test_cache.py \
    tests/test_placement.py 2>&1 \
    | tail -25
  # 3. Embedding lookups, slab against one array per row, on the GPU; host->device paths.
  timeout 90 $PY -m bench.embedding --no-demo --runs 3 --out "$OUT"
  timeout 60 $PY -m bench.h2d --runs 5
  if $PY -c "import cachetools" 2>/dev/null; then
    timeout 60 $PY -m bench.hit_cost --runs 3 --out "$OUT" | tail -12
  fi
} 2>&1 | tee "$log"
