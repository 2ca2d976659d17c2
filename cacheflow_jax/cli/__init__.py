"""The ``cacheflow`` command: ``inspect`` a store, run the ``demo``, ``replay`` a trace, and more.

Thin on purpose: each subcommand parses its arguments and calls library code. A user error (a
missing path, a bad size, a store that is not one, an output that cannot be written) prints one
line, ``cacheflow <cmd>: error: ...``, and exits with status 2, with nothing on disk changed:
inputs and outputs are checked before any work starts. Ctrl-C prints ``interrupted`` and exits
with 130; a closed output pipe (``cacheflow inspect ... | head``) ends the command quietly, as it
ends ``cat``, with status 141. Bugs keep their tracebacks.

The package: `cacheflow_jax.cli.app` (the parser and `main`), a module per command (``inspect``,
``verify``, ``demo``, ``replay``, ``stats``, ``train``, ``bench``), the demo's parts
(``demo_*``), and what the commands share (`cacheflow_jax.cli.common`).
"""

from cacheflow_jax.cli.app import build_parser, interrupts_reach_main, main
from cacheflow_jax.cli.bench import BENCHMARKS
from cacheflow_jax.cli.common import (
    BROKEN_PIPE,
    INTERRUPTED,
    PLOT_SUFFIXES,
    USER_ERROR,
    UserError,
    check_input_file,
    check_output_file,
    parse_size,
)
from cacheflow_jax.cli.inspect import inspect_store
from cacheflow_jax.cli.replay import (
    REPLAY_POLICIES,
    format_replay,
    plot_miss_ratio_curve,
    run_replay,
)
from cacheflow_jax.cli.stats import format_stats

__all__ = [
    "BENCHMARKS",
    "BROKEN_PIPE",
    "INTERRUPTED",
    "PLOT_SUFFIXES",
    "REPLAY_POLICIES",
    "USER_ERROR",
    "UserError",
    "build_parser",
    "check_input_file",
    "check_output_file",
    "format_replay",
    "format_stats",
    "inspect_store",
    "interrupts_reach_main",
    "main",
    "parse_size",
    "plot_miss_ratio_curve",
    "run_replay",
]
