"""``cacheflow bench``: a benchmark of the checkout's ``bench/`` folder."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from cacheflow_jax.cli.common import USER_ERROR

BENCHMARKS = (
    "hit_cost", "cold_read", "metadata_memory", "policies", "two_tier", "h2d", "synthetic",
    "embedding", "gpu_kernels", "stats_speed", "subblocks", "soak", "replay_speed", "prefetchers",
    "foresight", "llm_serving", "embedding_model", "multimodal", "scenarios", "scale",
    "policy_spread",
)


def run_bench(argv: Sequence[str]) -> int:
    """``cacheflow bench NAME ...`` runs ``python -m bench.NAME ...`` from the repository root.

    The benchmarks live in the checkout's ``bench/`` folder (the library never imports them).
    """
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: cacheflow bench NAME [options]\n\nRuns a benchmark from the repository's "
            f"bench/ folder (see bench/README.md). NAME is one of: {', '.join(BENCHMARKS)}.\n"
            "`cacheflow bench NAME --help` lists its options."
        )
        return 0 if argv else USER_ERROR
    if argv[0] not in BENCHMARKS:
        print(
            f"cacheflow bench: error: unknown benchmark {argv[0]!r}; choose one of "
            f"{', '.join(BENCHMARKS)}",
            file=sys.stderr,
        )
        return USER_ERROR
    if not (root / "bench" / f"{argv[0]}.py").is_file():
        print(
            f"cacheflow bench: error: no bench/ folder next to {root / 'cacheflow_jax'}; the "
            "benchmarks run from a checkout of the repository (pip install -e .)",
            file=sys.stderr,
        )
        return USER_ERROR
    return subprocess.call([sys.executable, "-m", f"bench.{argv[0]}", *argv[1:]], cwd=root)
