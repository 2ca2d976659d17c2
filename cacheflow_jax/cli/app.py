"""The ``cacheflow`` command line: its parser, `main`, and the handling of errors, Ctrl-C and
closed pipes that every command shares (see the package note)."""

from __future__ import annotations

import _thread
import argparse
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from cacheflow_jax.cli.bench import run_bench
from cacheflow_jax.cli.common import (
    BROKEN_PIPE,
    INTERRUPTED,
    USER_ERROR,
    Parser,
    UserError,
    nonnegative_int,
    parse_size,
    positive_float,
    positive_int,
    positive_size,
    rate,
)
from cacheflow_jax.cli.inspect import cmd_inspect
from cacheflow_jax.cli.replay import REPLAY_POLICIES, cmd_replay
from cacheflow_jax.cli.stats import cmd_stats
from cacheflow_jax.cli.train import run_train
from cacheflow_jax.cli.verify import cmd_verify
from cacheflow_jax.core.log import LOGGER_NAME


def build_parser() -> argparse.ArgumentParser:
    """The ``cacheflow`` argument parser with its subcommands."""
    from cacheflow_jax import __version__

    parser = Parser(
        prog="cacheflow",
        description="A three-tier (device / host / TensorStore) cache for JAX inference data.",
    )
    parser.add_argument("--version", action="version", version=f"cacheflow-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    _add_inspect(sub)
    _add_verify(sub)
    _add_demo(sub)
    _add_replay(sub)
    _add_stats(sub)
    sub.add_parser(
        "bench",
        help="run a benchmark from bench/ (see cacheflow bench --help)",
        add_help=False,
    )
    sub.add_parser(
        "train",
        help="train the predictor MLP on access logs (see cacheflow train --help)",
        add_help=False,
    )
    return parser


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    """Adds ``cacheflow inspect`` and its options to ``sub``."""
    p = sub.add_parser(
        "inspect",
        help="list the arrays, blocks and block keys of a store or orbax checkpoint",
        description="List the arrays, shapes, dtypes, chunk shapes, block counts, sizes and "
        "block keys of a cacheflow store or an orbax checkpoint (item, step directory, or "
        "CheckpointManager root: its steps are listed and the latest is described). A key names "
        "what `get` serves: '<array path>@<chunk index>' for a chunk of a stored array, any "
        "other string for a runtime block.",
    )
    p.add_argument("path", metavar="PATH", help="store directory, URL or orbax checkpoint")
    p.add_argument("--step", type=nonnegative_int, default=None, help="step of a root")
    p.add_argument(
        "--block-bytes", type=positive_size, default=None, metavar="SIZE",
        help="list the blocks a cache given block_bytes=SIZE serves (default: the store's own "
        "blocks, at most 4 MiB for a checkpoint; keys never depend on a cache's budget)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument(
        "--json", action="store_true",
        help="print machine-readable JSON, with every key and its size in bytes",
    )
    out.add_argument(
        "--keys", action="store_true",
        help="print every block key and its size in bytes, one per line (tab-separated)",
    )
    p.set_defaults(func=cmd_inspect)


def _add_verify(sub: argparse._SubParsersAction) -> None:
    """Adds ``cacheflow verify`` and its options to ``sub``."""
    p = sub.add_parser(
        "verify",
        help="record (or check) a CRC-32C manifest of every chunk of an orbax checkpoint",
        description="Read every chunk of an orbax checkpoint and record its CRC-32C in "
        "CKPT.cacheflow-manifest.json beside the checkpoint (never inside it); from then on "
        "every read of the checkpoint is checked against it. With a manifest already there, "
        "check every chunk against it (exit status 1 if one differs).",
    )
    p.add_argument("path", metavar="CKPT", help="CheckpointManager root, step or item directory")
    p.add_argument("--step", type=nonnegative_int, default=None, help="step of a root")
    p.add_argument(
        "--update", action="store_true", help="record anew (after the checkpoint was saved again)"
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=cmd_verify)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    """Adds ``cacheflow demo`` and its options to ``sub``."""
    p = sub.add_parser(
        "demo",
        help="serve a byte-level MoE on real text: on-demand reads vs the cache, with prefetch",
        description="Build a Flax NNX mixture-of-experts model with a byte embedding once "
        "(orbax checkpoint), record a warm-up on Python's help text, train the MLP predictor on "
        "its access log, then serve the rest of the text five ways: on-demand TensorStore reads "
        "(baseline), the tiered cache without prefetch (cacheflow), with layer-ahead prefetch "
        "by the Markov baseline and by the MLP, and with every expert on the device "
        "(all-resident). Prints L1 hits, L3 share, prefetch accuracy and coverage, and per-step "
        "latency; saves a latency CDF.",
    )
    p.add_argument(
        "--workdir",
        metavar="DIR",
        help="where the model checkpoint is built and reused, with the run's files "
        "(default: $XDG_CACHE_HOME/cacheflow-jax/demo or ~/.cache/cacheflow-jax/demo)",
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=200,
        metavar="N",
        help="measured steps per configuration (default: 200)",
    )
    p.add_argument(
        "--record",
        type=positive_int,
        default=300,
        metavar="N",
        help="warm-up steps recorded to train the MLP and prime the predictors (default: 300)",
    )
    p.add_argument(
        "--tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help="bytes of text per step (default: 64)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the weights (default: 0)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument(
        "--access-log",
        metavar="FILE",
        help="write the cacheflow pass's access log (v1, JSON Lines) to FILE",
    )
    p.add_argument(
        "--predictor",
        metavar="DIR",
        help="serve cacheflow+mlp with this predictor checkpoint (cacheflow train ... --out OUT "
        "writes OUT/checkpoint) instead of training one on the warm-up",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="where to save the latency CDF (PNG; default: latency_cdf.png beside the "
        "checkpoint in the work directory)",
    )
    p.add_argument(
        "--device-bytes",
        type=parse_size,
        metavar="SIZE",
        help="L1 budget, e.g. 24MiB (default: a sixth of the experts)",
    )
    p.add_argument(
        "--host-bytes",
        type=parse_size,
        metavar="SIZE",
        help="L2 budget (default: three quarters of the experts)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # Sizes for tests and experiments; not part of the documented interface.
    p.add_argument("--layers", type=positive_int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--experts", type=positive_int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--expert-mb", type=positive_float, default=2.0, help=argparse.SUPPRESS)
    p.add_argument("--d-model", type=positive_int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--top-k", type=positive_int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=nonnegative_int, default=5, help=argparse.SUPPRESS)
    p.add_argument("--prefetch-k", type=positive_int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_demo)


def _add_replay(sub: argparse._SubParsersAction) -> None:
    """Adds ``cacheflow replay`` and its options to ``sub``."""
    p = sub.add_parser(
        "replay",
        help="replay a trace through the cache (metadata only) and report hits and misses",
        description="Drive the live cache's TieredCache and policy objects over a trace, with a "
        "store that holds metadata only, and report the counters (the replay JSON of "
        "docs/design.md). SIZE is bytes with an optional unit (64KiB, 2GiB) or a percentage of "
        "the trace's distinct bytes (5%). On a unit-size trace (every key one block, as "
        "Mooncake's hash_ids without --block-bytes, or one key per line) a SIZE counts blocks: "
        "a plain number or a percentage; a byte unit is an error there.",
    )
    p.add_argument("trace", metavar="TRACE", help="trace file (gzip is read transparently)")
    p.add_argument(
        "--format",
        choices=("log", "mooncake", "libcachesim-csv", "txt"),
        help="trace format (default: guessed from the name and first line)",
    )
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--device-bytes", metavar="SIZE", help="L1 budget")
    sizes.add_argument(
        "--sizes", metavar="LIST",
        help="comma-separated L1 sizes, one replay each: a miss-ratio curve (instead of "
        "--device-bytes)",
    )
    p.add_argument("--host-bytes", metavar="SIZE", default="0", help="L2 budget (0: no L2)")
    p.add_argument(
        "--policy", choices=REPLAY_POLICIES, default="lfu",
        help="eviction policy (belady: the offline optimum; replay only)",
    )
    p.add_argument(
        "--compare", metavar="LIST",
        help="also replay these policies at the same sizes, e.g. lru,belady",
    )
    p.add_argument(
        "--plot", metavar="FILE",
        help="draw the miss-ratio curve (miss ratio against L1 size, a line per policy) to FILE "
        "(.png, .svg or .pdf)",
    )
    p.add_argument("--block-bytes", type=positive_int, default=1, metavar="N",
                   help="mooncake: bytes per KV block (default 1: unit size)")
    p.add_argument("--csv-spec", metavar="SPEC",
                   help="libcachesim-csv column spec, e.g. time=2,key=5,size=4,header=true")
    p.add_argument(
        "--prefetch", metavar="LIST", default="none",
        help="prefetch with these predictors, one replay each: none, last-successor, markov, "
        "stride, or mlp:DIR (a checkpoint from `cacheflow train`); comma-separated to compare "
        "(default none)",
    )
    p.add_argument(
        "--lead", type=positive_int, default=1, metavar="N",
        help="a prefetch issued at access i is usable from access i+N on (default 1)",
    )
    p.add_argument(
        "--keys-known", action="store_true",
        help="every key of the trace is in L3 from the start (weights); by default a key can "
        "be prefetched only after its first access (KV blocks are written first)",
    )
    p.add_argument(
        "--warmup", metavar="N|P%", default="0",
        help="the first N accesses (or P%% of them, cut between timestamps as `cacheflow train "
        "--eval-fraction` cuts) warm the cache and the predictor up and are not counted; e.g. "
        "70%% to replay the 30%% a predictor trained on the rest never saw",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_replay)


def _add_stats(sub: argparse._SubParsersAction) -> None:
    """Adds ``cacheflow stats`` and its options to ``sub``."""
    p = sub.add_parser(
        "stats",
        help="summarise an access log: keys and bytes by kind, reuse distances, LRU's curve",
        description="Summarise an access log (or any trace replay reads) in one pass: accesses, "
        "distinct keys and bytes by kind, a histogram of reuse distances (distinct keys between "
        "two accesses to a key), and the miss ratio an LRU cache would have at each size "
        "(Mattson's stack algorithm: exact, the same numbers as `cacheflow replay --policy lru "
        "--host-bytes 0`). Use it to size the tiers before deploying.",
    )
    p.add_argument("log", metavar="LOG", help="access log v1, or another trace format")
    p.add_argument(
        "--sizes", default="1%,5%,10%,20%", metavar="LIST",
        help="cache sizes of the curve, as replay takes them (default 1%%,5%%,10%%,20%%)",
    )
    p.add_argument(
        "--sample", type=rate, metavar="RATE",
        help="estimate the curve from a SHARDS sample of RATE of the keys (for big logs; the "
        "report says it is an estimate)",
    )
    p.add_argument(
        "--format",
        choices=("log", "mooncake", "libcachesim-csv", "txt"),
        help="trace format (default: guessed from the name and first line)",
    )
    p.add_argument("--block-bytes", type=positive_int, default=1, metavar="N",
                   help="mooncake: bytes per KV block (default 1: unit size)")
    p.add_argument("--csv-spec", metavar="SPEC",
                   help="libcachesim-csv column spec, e.g. time=2,key=5,size=4,header=true")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=cmd_stats)


def _cmd_demo(args: argparse.Namespace) -> int:
    """Runs `cacheflow_jax.cli.demo.cmd_demo`, imported only now: the other commands start
    without JAX."""
    from cacheflow_jax.cli.demo import cmd_demo  # JAX, orbax and the model: only for the demo

    return cmd_demo(args)


def _message(err: BaseException) -> str:
    """An exception as one line, naming the file for OS errors that carry one."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        text = f"{err.filename}: {err.strerror}"
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def _silence_stdout() -> None:
    """Points stdout at /dev/null, so the interpreter's last flush meets no closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a file (a test's capture)
        pass


@contextlib.contextmanager
def interrupts_reach_main() -> Iterator[None]:
    """Makes Ctrl-C stop the command even when it lands in a callback.

    Python runs the SIGINT handler wherever the main thread is, including inside a garbage
    collector callback (JAX installs one) or a ``__del__``. A KeyboardInterrupt raised there is
    reported as "Exception ignored", with a traceback, and the program goes on. While this is
    active, such an interrupt is not reported but raised again in the main thread, where the
    command's own handler prints one line.
    """
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # From another thread, a moment later: raised in this hook, it would be "ignored"
            # once more.
            threading.Timer(0.01, _thread.interrupt_main).start()
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


@contextlib.contextmanager
def library_warnings(command: str) -> Iterator[None]:
    """Prints what the library logs (logger ``cacheflow_jax``, warnings and above) to stderr as
    one line each, ``cacheflow <command>: warning: <message>``, while a command runs."""
    log = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(f"cacheflow {command}: warning: %(message)s"))
    propagate = log.propagate
    log.addHandler(handler)
    log.propagate = False  # printed here once, not again by a handler of the root logger
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``cacheflow`` command line.

    Args:
      argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
      The exit status: 0 on success, 2 on a user error (bad arguments, a missing or unwritable
      path, a location that is not a store), 1 when the demo's passes disagree, 130 on Ctrl-C,
      141 when the reader of stdout went away (``| head``).
    """
    try:
        with interrupts_reach_main():
            return _main(argv)
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        return run_train(argv[1:])
    if argv[:1] == ["bench"]:
        return run_bench(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        sys.stdout.flush()
        return int(e.code or 0)
    try:
        with library_warnings(args.command):
            code = args.func(args)
    except BrokenPipeError:
        raise
    except (OSError, ValueError, UserError) as err:
        print(f"cacheflow {args.command}: error: {_message(err)}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print(f"cacheflow {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    try:
        sys.stdout.flush()  # a closed pipe or a full disk shows here, not at the exit
    except BrokenPipeError:
        raise
    except OSError as err:
        _silence_stdout()
        print(f"cacheflow {args.command}: error: writing the output: {_message(err)}",
              file=sys.stderr)
        return USER_ERROR
    return code
