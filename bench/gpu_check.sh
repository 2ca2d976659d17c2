#!/usr/bin/env bash
# One short call on a lent GPU machine: check and time the Pallas kernels, the device slab, the
# host<->device paths and the scenarios' quick runs.
# Usage (device tool, from the repository root, carrying .whl): bash bench/gpu_check.sh
# (timeout_s 590; the steps after the tests run while the script's own budget, GPU_CHECK_SECONDS
# (default 560), has room for them, so a slow step costs the later ones, not the call).
# Everything it prints is also written to $OUT/gpu_check.log; the JSON reports go to $OUT.
#
# The machine (Python 3.12, JAX with CUDA, flax, optax, orbax, tensorstore, pytest, hypothesis)
# cannot reach PyPI, so nothing is installed from the network: the checkout runs from PYTHONPATH.
# Packages it lacks (cachetools for bench.hit_cost, google-crc32c for the store's fast path) can
# travel as wheels in .whl/ (see the device tool's README); they are installed when present.
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
log="$OUT/gpu_check.log"
# The reports go to $RES first (the benchmarks also write warm-up files beside them), then only
# the JSON reports are copied to $OUT: the device tool brings back at most 8 files.
RES=${GPU_CHECK_RESULTS:-/tmp/gpu_check_results}
mkdir -p "$RES"
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_SECONDS:-560}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# step SECONDS CMD...: runs CMD under `timeout SECONDS` if that much of the budget is left.
step() {
  local need=$1; shift
  local left=$((BUDGET - SECONDS))
  if ((left < need)); then echo "== skipped (${left}s of the budget left, needs ${need}s): $*"; return; fi
  echo "== $* (at ${SECONDS}s)"
  timeout "$need" "$@" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' ; echo "rc=${PIPESTATUS[0]}"
}
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
  step 120 $PY -m bench.gpu_kernels --runs 5 --out "$RES"
  # 2. The tests that touch the device: kernels (compiled Pallas in the base classes, interpret
  #    mode in the Interpret ones), the slab, embedding lookups, the cache on both layouts, L2 in
  #    pinned_host memory, the tier contract and `Placement` (jaxlib's own transfer calls must
  #    agree with the public ones on this device). Deprecation warnings are shown, not raised:
  #    newer JAX deprecates Pallas' Triton backend.
  step 200 $PY -m pytest -q -x -p no:cacheprovider -m "not s3" -W default::DeprecationWarning \
    tests/test_kernels.py tests/test_slab.py tests/test_embedding.py tests/test_cache.py \
    tests/test_placement.py tests/test_host_memory.py tests/test_tier_contract.py
  # 3. Host<->device paths, with L2 pageable and pinned, for large (4 MiB) and KV-sized (2 KiB)
  #    blocks.
  step 60 $PY -m bench.h2d --runs 5
  step 60 $PY -m bench.h2d --runs 5 --blocks 512 --block-kib 2 --leaves 500
  # 4. The LLM serving scenario, quick, with cacheflow's L2 pinned (auto on a GPU) and pageable.
  step 130 $PY -m bench.llm_serving --quick --ways cacheflow,host-lru,all-resident --out "$RES"
  mv "$RES/llm_serving.json" "$RES/llm_serving_pinned.json" 2>/dev/null
  step 100 $PY -m bench.llm_serving --quick --ways cacheflow,all-resident --host-memory pageable \
    --out "$RES"
  mv "$RES/llm_serving.json" "$RES/llm_serving_pageable.json" 2>/dev/null
  # 5. The embedding scenario (host offload is not free here, as it is on the CPU backend).
  step 150 $PY -m bench.embedding_model --quick --out "$RES"
  # 6. Embedding lookups, slab against one array per row; the hit path's cost.
  step 60 $PY -m bench.embedding --no-demo --runs 3 --out "$RES"
  if $PY -c "import cachetools" 2>/dev/null; then
    step 50 $PY -m bench.hit_cost --runs 3 --out "$RES"
  fi
  step 130 $PY -m bench.multimodal --quick --out "$RES"
  cp "$RES"/*.json "$OUT"/ 2>/dev/null
  echo "done at ${SECONDS}s"
} 2>&1 | tee "$log"
