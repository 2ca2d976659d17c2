"""The ``cacheflow`` command: ``inspect`` a store or checkpoint, run the ``demo``, ``replay`` a trace.

Thin on purpose: each subcommand parses its arguments and calls library code. A user error (a
missing path, a bad size, a store that is not one) prints one line, ``cacheflow <cmd>: error:
...``, and exits with status 2; bugs keep their tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from cacheflow_jax._blocks import KEY_SEPARATOR, StoreError, parse_bytes

USER_ERROR = 2

class UserError(Exception):
    """Bad input from the command line; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) and exit with status 2."""

    def error(self, message: str) -> NoReturn:
        """Prints ``<prog>: error: <message> (see <prog> --help)`` and exits with status 2."""
        self.exit(USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_size(text: str) -> int:
    """Parses a byte size: ``1048576``, ``64MiB``, ``1.5G``, ``500MB`` (K/M/G/T are binary).

    Args:
      text: a non-negative number with an optional unit (B, K/KiB, KB, M/MiB, MB, G/GiB, GB,
        T/TiB, TB; case-insensitive).

    Returns:
      The size in bytes.

    Raises:
      argparse.ArgumentTypeError: ``text`` is not a size.

    >>> parse_size("64MiB"), parse_size("1.5k"), parse_size("10")
    (67108864, 1536, 10)
    """
    try:
        return parse_bytes(text)[0]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _human(nbytes: int) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


# --------------------------------------------------------------------------------------------
# inspect


def inspect_store(path: str) -> dict[str, Any]:
    """Describes a store or orbax checkpoint: its arrays, chunk shapes and block counts.

    Args:
      path: anything `cacheflow_jax.open_store` takes.

    Returns:
      ``{"store", "source", "arrays": [{"path", "shape", "dtype", "chunk_shape", "grid_shape",
      "blocks", "nbytes"}], "array_blocks", "runtime_blocks", "blocks", "nbytes"}``.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      cacheflow_jax.StoreError: ``path`` is not a store or checkpoint.
    """
    from cacheflow_jax._store import open_store

    store = open_store(path)
    arrays = []
    for info in store.arrays().values():
        grid = info.grid_shape
        blocks = 1
        for g in grid:
            blocks *= g
        arrays.append(
            {
                "path": info.path,
                "shape": list(info.shape),
                "dtype": info.dtype.name,
                "chunk_shape": list(info.chunk_shape),
                "grid_shape": list(grid),
                "blocks": blocks,
                "nbytes": info.nbytes,
            }
        )
    keys = store.keys()
    runtime = sum(KEY_SEPARATOR not in k for k in keys)
    return {
        "store": store.spec,
        "source": store.source,
        "arrays": arrays,
        "array_blocks": len(keys) - runtime,
        "runtime_blocks": runtime,
        "blocks": len(keys),
        "nbytes": sum(a["nbytes"] for a in arrays),
    }


def _format_inspect(report: dict[str, Any]) -> str:
    """The ``inspect`` report as a table plus a summary line."""
    header = ("array", "shape", "dtype", "chunk", "blocks", "size")
    cells = [header]
    for a in report["arrays"]:
        cells.append(
            (
                a["path"],
                "(" + ", ".join(map(str, a["shape"])) + ")",
                a["dtype"],
                "(" + ", ".join(map(str, a["chunk_shape"])) + ")",
                str(a["blocks"]),
                _human(a["nbytes"]),
            )
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    right = {4, 5}
    lines = [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        )
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    dtypes = sorted({a["dtype"] for a in report["arrays"]})
    lines.append(
        f"{report['store']} ({report['source']}): {len(report['arrays'])} arrays, "
        f"{report['array_blocks']} array blocks, {report['runtime_blocks']} runtime blocks, "
        f"{_human(report['nbytes'])}; dtypes: {', '.join(dtypes) or '-'}"
    )
    return "\n".join(lines)


def _cmd_inspect(args: argparse.Namespace) -> int:
    report = inspect_store(args.path)
    print(json.dumps(report, indent=1) if args.json else _format_inspect(report))
    return 0


# --------------------------------------------------------------------------------------------
# demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from cacheflow_jax._demo import DemoSettings, format_predictor, format_table, run_demo

    settings = DemoSettings(
        workdir=Path(args.workdir).expanduser().resolve() if args.workdir else None,
        requests=args.requests,
        warmup=args.warmup,
        seed=args.seed,
        layers=args.layers,
        experts=args.experts,
        expert_mb=args.expert_mb,
        d_model=args.d_model,
        top_k=args.top_k,
        device_bytes=args.device_bytes,
        host_bytes=args.host_bytes,
        access_log=Path(args.access_log) if args.access_log else None,
        predictor=Path(args.predictor).expanduser().resolve() if args.predictor else None,
        progress=not args.no_progress,
    )
    result = run_demo(settings, log=lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(result["rows"], indent=1))
    else:
        print(format_table(result["rows"]))
        for row in result["rows"]:
            if "predictor" in row:
                print(format_predictor(row))
    if not result["setup"]["outputs_match"]:
        print("cacheflow demo: error: the passes' outputs differ", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# replay

_REPLAY_COLUMNS = (
    ("size", "size"),
    ("device_bytes", "device B"),
    ("host_bytes", "host B"),
    ("requests", "requests"),
    ("hits.device", "L1 hits"),
    ("hits.host", "L2 hits"),
    ("misses", "misses"),
    ("device_miss_ratio", "L1 miss"),
    ("miss_ratio", "miss ratio"),
    ("byte_miss_ratio", "byte miss"),
    ("accesses_per_second", "acc/s"),
)


def run_replay(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Reads the trace and replays it once per size; returns the replay JSON of each run."""
    from cacheflow_jax._replay import replay
    from cacheflow_jax._trace import parse_size as parse_trace_size
    from cacheflow_jax._trace import read_trace

    trace = read_trace(
        args.trace, format=args.format, block_bytes=args.block_bytes, csv_spec=args.csv_spec
    )
    total = trace.distinct_bytes()
    largest = int(trace.nbytes.max())
    if args.sizes:
        sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    elif args.device_bytes is not None:
        sizes = [args.device_bytes]
    else:
        raise UserError("give --device-bytes SIZE or --sizes 1%,5%,... (see --help)")
    host = parse_trace_size(args.host_bytes, total=total, largest=largest, setting="--host-bytes")
    runs = []
    for size in sizes:
        device = parse_trace_size(size, total=total, largest=largest, setting="--device-bytes")
        stats = replay(
            trace,
            device_bytes=device,
            host_bytes=host,
            policy=args.policy,
            progress=not args.no_progress,
        )
        stats["size"] = size
        stats["distinct_bytes"] = total
        runs.append(stats)
    return runs


def _field(stats: dict[str, Any], name: str) -> Any:
    value: Any = stats
    for part in name.split("."):
        value = value[part]
    return value


def format_replay(runs: list[dict[str, Any]]) -> str:
    """The replay runs as one table, a row per size."""
    cells = [tuple(title for _, title in _REPLAY_COLUMNS)]
    for stats in runs:
        row = []
        for name, _ in _REPLAY_COLUMNS:
            value = _field(stats, name)
            if isinstance(value, float):
                row.append(f"{value:,.0f}" if name == "accesses_per_second" else f"{value:.4f}")
            else:
                row.append(str(value))
        cells.append(tuple(row))
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    first = runs[0]
    lines.append(
        f"{first['trace']}: policy {first['policy']['name']}, "
        f"{first['distinct_bytes']} distinct bytes"
    )
    return "\n".join(lines)


def _cmd_replay(args: argparse.Namespace) -> int:
    runs = run_replay(args)
    if args.json:
        print(json.dumps(runs[0] if len(runs) == 1 and not args.sizes else runs, indent=1))
    else:
        print(format_replay(runs))
    return 0


# --------------------------------------------------------------------------------------------
# train


def _run_train(argv: Sequence[str]) -> int:
    """``cacheflow train ...`` runs ``python -m training.main ...``: the offline training script.

    The library never imports ``training/`` (DESIGN.md: dependencies point one way), so the
    command hands its arguments to the script in a child process and returns its exit status.
    """
    import subprocess

    return subprocess.call([sys.executable, "-m", "training.main", *argv])


# --------------------------------------------------------------------------------------------
# bench

BENCHMARKS = ("hit_cost", "cold_read", "metadata_memory", "policies", "two_tier", "h2d", "synthetic",
              "replay_speed")


def _run_bench(argv: Sequence[str]) -> int:
    """``cacheflow bench NAME ...`` runs ``python -m bench.NAME ...`` from the repository root.

    The benchmarks live in the checkout's ``bench/`` folder (the library never imports them).
    """
    import subprocess

    root = Path(__file__).resolve().parent.parent
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


# --------------------------------------------------------------------------------------------
# main


def build_parser() -> argparse.ArgumentParser:
    """The ``cacheflow`` argument parser with its subcommands."""
    parser = _Parser(
        prog="cacheflow",
        description="A three-tier (device / host / TensorStore) cache for JAX inference data.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser(
        "inspect",
        help="list the arrays and blocks of a store or orbax checkpoint",
        description="List the arrays, shapes, dtypes, chunk shapes, block counts and sizes of a "
        "cacheflow store or an orbax checkpoint (item or CheckpointManager step directory).",
    )
    p.add_argument("path", metavar="PATH", help="store directory, URL or orbax checkpoint")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "demo",
        help="serve an MoE model larger than the device budget: baseline vs cacheflow",
        description="Build a Flax NNX mixture-of-experts model once (orbax checkpoint), then "
        "serve one Zipf-routed request stream three ways: on-demand TensorStore reads "
        "(baseline), through the tiered cache (cacheflow), and with every weight on the device "
        "(all-resident). Prints hit ratios and per-step latency.",
    )
    p.add_argument(
        "--workdir",
        metavar="DIR",
        help="where the model checkpoint is built and reused "
        "(default: $XDG_CACHE_HOME/cacheflow-jax/demo or ~/.cache/cacheflow-jax/demo)",
    )
    p.add_argument(
        "--requests",
        type=_positive_int,
        default=200,
        metavar="N",
        help="measured steps per configuration (default: 200)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the weights and of the request stream (default: 0)",
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
        help="a predictor checkpoint (cacheflow train ... --out OUT writes OUT/checkpoint): after "
        "the passes, replay the cacheflow pass's accesses through it and report the median "
        "predict() time against the cacheflow pass's median step time",
    )
    p.add_argument(
        "--device-bytes",
        type=parse_size,
        metavar="SIZE",
        help="L1 budget, e.g. 24MiB (default: a sixth of the weights)",
    )
    p.add_argument(
        "--host-bytes",
        type=parse_size,
        metavar="SIZE",
        help="L2 budget (default: a third of the weights)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # Sizes for tests and experiments; not part of the documented interface.
    p.add_argument("--layers", type=_positive_int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--experts", type=_positive_int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--expert-mb", type=_positive_float, default=2.0, help=argparse.SUPPRESS)
    p.add_argument("--d-model", type=_positive_int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--top-k", type=_positive_int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=_nonnegative_int, default=5, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "replay",
        help="replay a trace through the cache (metadata only) and report hits and misses",
        description="Drive the live cache's TieredCache and policy objects over a trace, with a "
        "store that holds metadata only, and report the counters (DESIGN.md replay JSON). "
        "SIZE is bytes with an optional unit (64KiB, 2GiB) or a percentage of the trace's "
        "distinct bytes (5%%).",
    )
    p.add_argument("trace", metavar="TRACE", help="trace file (gzip is read transparently)")
    p.add_argument(
        "--format",
        choices=("log", "mooncake", "libcachesim-csv", "txt"),
        help="trace format (default: guessed from the name and first line)",
    )
    p.add_argument("--device-bytes", metavar="SIZE", help="L1 budget")
    p.add_argument("--host-bytes", metavar="SIZE", default="0", help="L2 budget (0: no L2)")
    p.add_argument("--sizes", metavar="LIST", help="comma-separated L1 sizes: a miss-ratio curve")
    p.add_argument(
        "--policy", choices=("lfu", "lru", "lfu-plain", "belady"), default="lfu",
        help="eviction policy (belady: the offline optimum; replay only)",
    )
    p.add_argument("--block-bytes", type=_positive_int, default=1, metavar="N",
                   help="mooncake: bytes per KV block (default 1: unit size)")
    p.add_argument("--csv-spec", metavar="SPEC",
                   help="libcachesim-csv column spec, e.g. time=2,key=5,size=4,header=true")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_replay)

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


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``cacheflow`` command line.

    Args:
      argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
      The exit status: 0 on success, 2 on a user error (bad arguments, missing path, a location
      that is not a store), 1 when the demo's passes disagree.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        return _run_train(argv[1:])
    if argv[:1] == ["bench"]:
        return _run_bench(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    try:
        return args.func(args)
    except (
        FileNotFoundError,
        NotADirectoryError,
        PermissionError,
        StoreError,
        ValueError,
        UserError,
    ) as err:
        message = " ".join(str(err).split())
        print(f"cacheflow {args.command}: error: {message}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print(f"cacheflow {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
