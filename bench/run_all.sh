#!/usr/bin/env bash
# Runs every benchmark quickly (few runs, smaller sizes); results go to bench/out/<name>.json.
# For the figures quoted in bench/README.md run each command there with its defaults.
# Usage: bench/run_all.sh [extra args passed to every benchmark, e.g. --json]
set -euo pipefail
cd "$(dirname "$0")/.."
python -m bench.hit_cost --runs 3 --hits 50000 "$@"
echo
python -m bench.cold_read --runs 3 "$@"
echo
python -m bench.metadata_memory --runs 1 --blocks 5000 --real-blocks 500 "$@"
# Longer ones (minutes each): python -m bench.policies; python -m bench.two_tier; python -m bench.h2d
