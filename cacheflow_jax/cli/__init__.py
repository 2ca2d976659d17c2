"""The ``cacheflow`` command: ``inspect`` a store, run the ``demo``, ``replay`` a trace, and more.

Thin on purpose: each subcommand parses its arguments and calls library code. A user error (a
missing path, a bad size, a store that is not one, an output that cannot be written) prints one
line, ``cacheflow <cmd>: error: ...``, and exits with status 2, with nothing on disk changed:
inputs and outputs are checked before any work starts. Ctrl-C prints ``interrupted`` and exits
with 130; a closed output pipe (``cacheflow inspect ... | head``) ends the command quietly, as it
ends ``cat``, with status 141. Bugs keep their tracebacks.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from cacheflow_jax.core.blocks import KEY_SEPARATOR, parse_bytes

USER_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports `cat` whose reader went away
PLOT_SUFFIXES = (".png", ".svg", ".pdf")

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


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate in (0, 1], e.g. 0.01")
    return value


def _human(nbytes: int) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _blocks_or_bytes(n: int, unit_size: bool) -> str:
    """A cache size as a person reads it: ``'4392 blocks'`` on a unit-size trace, else bytes."""
    return f"{n} blocks" if unit_size else _human(n)


def check_input_file(path: str, *, what: str) -> Path:
    """Checks that ``path`` is an existing regular file (or a device such as /dev/stdin).

    Args:
      path: the file as given on the command line.
      what: what it is, for the message (``"trace"``, ``"access log"``).

    Returns:
      The path.

    Raises:
      UserError: it does not exist or is a directory.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{what} {path} is a directory; give a {what} file")
    if not p.exists():
        raise UserError(f"{what} {path} does not exist")
    return p


def check_output_file(path: str, *, setting: str, suffixes: Sequence[str] = ()) -> Path:
    """Checks, before any work starts, that a file can be written at ``path``.

    Nothing is created: the path must not be a directory, its suffix must be one of
    ``suffixes`` (when given), and it must be writable, or its closest existing parent must be a
    writable directory (missing parents are made when the file is written).

    Args:
      path: the output file as given on the command line.
      setting: the option, for the message (``"--plot"``).
      suffixes: the allowed suffixes, lower case with the dot (``(".png", ".svg")``).

    Returns:
      The path.

    Raises:
      UserError: the file could not be written there (the message says why).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{setting} {path} is a directory; give a file name")
    if suffixes and p.suffix.lower() not in suffixes:
        raise UserError(
            f"{setting} {path}: unknown file type {p.suffix or '(none)'!r}; "
            f"end the name with one of {', '.join(suffixes)}"
        )
    if p.exists():
        if not os.access(p, os.W_OK):
            raise UserError(f"{setting} {path} is not writable")
        return p
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{setting} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{setting} {path}: cannot create files in {parent} (permission denied)")
    return p


# --------------------------------------------------------------------------------------------
# inspect


def inspect_store(path: str, *, step: int | None = None) -> dict[str, Any]:
    """Describes a store or orbax checkpoint: its arrays, chunk shapes, blocks and block keys.

    Args:
      path: anything `cacheflow_jax.open_store` takes.
      step: the step of a ``CheckpointManager`` root to describe (default: the latest).

    Returns:
      ``{"store", "source", "arrays": [{"path", "shape", "dtype", "chunk_shape", "grid_shape",
      "blocks", "nbytes", "first_key", "last_key"}], "keys": [{"key", "nbytes", "shape",
      "dtype"}], "array_blocks", "runtime_blocks", "blocks", "nbytes", "steps", "step",
      "manifest", "runtime"}``; ``keys`` lists every block the cache can be asked for
      (``get(key)``), chunks first, then runtime blocks; ``steps`` lists a
      ``CheckpointManager`` root's steps.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      cacheflow_jax.StoreError: ``path`` is not a store or checkpoint.
    """
    from cacheflow_jax.core.blocks import block_key
    from cacheflow_jax.store.tensorstore_store import open_store

    store = open_store(path, step=step)
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
                "first_key": block_key(info.path, [0] * len(grid)),
                "last_key": block_key(info.path, [max(g - 1, 0) for g in grid]),
            }
        )
    keys = []
    for key in store.keys():
        block = store.info(key)
        keys.append(
            {
                "key": key,
                "nbytes": block.nbytes,
                "shape": list(block.shape),
                "dtype": block.dtype.name,
            }
        )
    runtime = sum(KEY_SEPARATOR not in k["key"] for k in keys)
    return {
        "store": store.spec,
        "source": store.source,
        "arrays": arrays,
        "keys": keys,
        "array_blocks": len(keys) - runtime,
        "runtime_blocks": runtime,
        "blocks": len(keys),
        "nbytes": sum(a["nbytes"] for a in arrays),
        # A CheckpointManager root: its steps, and the one listed (the latest).
        "steps": list(store.steps),
        "step": store.step,
        "manifest": store.manifest,
        "runtime": store.runtime_spec,
    }


def _table(cells: list[Sequence[str]], right: set[int]) -> list[str]:
    """Rows of cells as aligned text lines, a rule under the first (the header)."""
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


_RUNTIME_SHOWN = 5


def _format_inspect(report: dict[str, Any]) -> str:
    """The ``inspect`` report as a table of arrays with their key ranges, plus a summary."""
    header = ("array", "shape", "dtype", "chunk", "blocks", "size", "keys")
    cells: list[Sequence[str]] = [header]
    for a in report["arrays"]:
        first, last = a["first_key"], a["last_key"]
        cells.append(
            (
                a["path"],
                "(" + ", ".join(map(str, a["shape"])) + ")",
                a["dtype"],
                "(" + ", ".join(map(str, a["chunk_shape"])) + ")",
                str(a["blocks"]),
                _human(a["nbytes"]),
                first if first == last else f"{first} .. {last}",
            )
        )
    lines = _table(cells, right={4, 5})
    runtime = [k for k in report["keys"] if KEY_SEPARATOR not in k["key"]]
    if runtime:
        shown = ", ".join(f"{k['key']} ({_human(k['nbytes'])})" for k in runtime[:_RUNTIME_SHOWN])
        more = len(runtime) - _RUNTIME_SHOWN
        lines.append(f"runtime blocks: {shown}" + (f", and {more} more" if more > 0 else ""))
    dtypes = sorted({a["dtype"] for a in report["arrays"]})
    lines.append(
        f"{report['store']} ({report['source']}): {len(report['arrays'])} arrays, "
        f"{report['array_blocks']} array blocks, {report['runtime_blocks']} runtime blocks, "
        f"{_human(report['nbytes'])}; dtypes: {', '.join(dtypes) or '-'}; "
        "every key: cacheflow inspect --keys"
    )
    if report.get("steps"):
        lines.append(
            f"CheckpointManager steps: {', '.join(map(str, report['steps']))} "
            f"(listed: step {report['step']}, the latest; open another with step=N)"
        )
    if not report["arrays"]:
        lines.append("no arrays: this location holds no stored arrays")
    if report.get("manifest"):
        lines.append(f"chunk manifest (checked on every read): {report['manifest']}")
    return "\n".join(lines)


def _cmd_inspect(args: argparse.Namespace) -> int:
    report = inspect_store(args.path, step=args.step)
    if args.json:
        print(json.dumps(report, indent=1))
    elif args.keys:
        for k in report["keys"]:
            print(f"{k['key']}\t{k['nbytes']}")
    else:
        print(_format_inspect(report))
    return 0


# --------------------------------------------------------------------------------------------
# verify


def _cmd_verify(args: argparse.Namespace) -> int:
    """Records (or checks) the chunk manifest of an orbax checkpoint; 1 if a chunk is bad."""
    from cacheflow_jax.store.verify import verify_checkpoint

    report = verify_checkpoint(args.path, step=args.step, update=args.update)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        what = {
            "recorded": "recorded the CRC-32C of every chunk in",
            "ok": "every chunk matches",
            "corrupt": "DAMAGED chunks; manifest",
        }[report["status"]]
        print(
            f"{report['checkpoint']}: {report['arrays']} arrays, {report['chunks']} chunks, "
            f"{_human(report['nbytes'])}: {what} {report['manifest']}"
        )
        for err in report["errors"]:
            print(f"  {err}")
    return 1 if report["status"] == "corrupt" else 0


# --------------------------------------------------------------------------------------------
# demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from cacheflow_jax.cli.demo import DemoSettings, format_table, run_demo

    if args.access_log:
        check_output_file(args.access_log, setting="--access-log")
    settings = DemoSettings(
        workdir=Path(args.workdir).expanduser().resolve() if args.workdir else None,
        requests=args.requests,
        warmup=args.warmup,
        record=args.record,
        seed=args.seed,
        layers=args.layers,
        experts=args.experts,
        expert_mb=args.expert_mb,
        d_model=args.d_model,
        top_k=args.top_k,
        tokens=args.tokens,
        device_bytes=args.device_bytes,
        host_bytes=args.host_bytes,
        access_log=Path(args.access_log) if args.access_log else None,
        predictor=Path(args.predictor).expanduser().resolve() if args.predictor else None,
        plot=Path(args.plot).expanduser().resolve() if args.plot else None,
        prefetch_k=args.prefetch_k,
        progress=not args.no_progress,
    )
    result = run_demo(settings, log=lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(result["rows"], indent=1))
    else:
        print(result["setup"]["header"])
        print(format_table(result["rows"]))
        print(f"latency CDF: {result['setup']['plot']}")
    if not result["setup"]["outputs_match"]:
        print("cacheflow demo: error: the passes' outputs differ", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# replay

_REPLAY_COLUMNS = (
    ("size", "size"),
    ("device_bytes", "L1 size"),
    ("host_bytes", "L2 size"),
    ("requests", "requests"),
    ("hits.device", "L1 hits"),
    ("hits.host", "L2 hits"),
    ("misses", "misses"),
    ("device_miss_ratio", "L1 miss"),
    ("miss_ratio", "miss ratio"),
    ("byte_miss_ratio", "byte miss"),
    ("accesses_per_second", "acc/s"),
)
_PREFETCH_COLUMNS = (
    ("prefetch.issued", "issued"),
    ("prefetch.timely", "timely"),
    ("prefetch.late", "late"),
    ("prefetch.accuracy", "accuracy"),
    ("prefetch.coverage", "coverage"),
)
REPLAY_POLICIES = ("lfu", "lru", "lfu-plain", "belady")


def _replay_prefetchers(spec: str) -> list[tuple[str, Callable[[], Any]]]:
    """``--prefetch``: (name, factory) per predictor, checked before any replay runs.

    Raises:
      UserError: an unknown name, or an ``mlp:DIR`` that is not a loadable checkpoint.
    """
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise UserError(f"--prefetch {spec!r} lists no predictor; give e.g. --prefetch none,markov")
    out: list[tuple[str, Callable[[], Any]]] = []
    for name in names:
        if name == "none":
            out.append((name, lambda: None))
            continue
        import predictor

        baselines = {
            "last-successor": predictor.last_successor,
            "markov": predictor.markov,
            "stride": predictor.stride,
        }
        if name in baselines:
            out.append((name, baselines[name]))
        elif name.startswith("mlp:"):
            path = name[4:]
            try:
                predictor.load(path)  # checked now, loaded fresh for each replay
            except predictor.CheckpointError as err:
                raise UserError(f"--prefetch {name}: {err}") from None
            out.append((name, lambda path=path: predictor.load(path)))
        else:
            raise UserError(
                f"--prefetch {name!r} is not a predictor; use none, last-successor, markov, "
                "stride or mlp:DIR"
            )
    return out


def _replay_warmup(text: str, trace: Any) -> int:
    """``--warmup``: a count of accesses, or a percentage cut between timestamps."""
    from cacheflow_jax.trace.reader import split_point

    n = len(trace.keys)
    try:
        if text.endswith("%"):
            share = float(text[:-1]) / 100.0
            if not 0.0 <= share < 1.0:
                raise ValueError
            return 0 if share == 0.0 else split_point(trace.t, 1.0 - share)
        count = int(text)
        if not 0 <= count < n:
            raise ValueError
        return count
    except ValueError:
        raise UserError(
            f"--warmup {text!r} must be a number of accesses below the trace's {n}, or a "
            "percentage below 100%, e.g. 70%"
        ) from None


def _replay_policies(args: argparse.Namespace) -> list[str]:
    """``--policy`` then each ``--compare`` policy, once each, checked before any work."""
    names = [args.policy]
    if args.compare is not None:
        extra = [c.strip() for c in args.compare.split(",") if c.strip()]
        if not extra:
            raise UserError(f"--compare {args.compare!r} lists no policies; give e.g. lru,belady")
        for name in extra:
            if name not in REPLAY_POLICIES:
                raise UserError(
                    f"--compare: unknown policy {name!r}; choose from {', '.join(REPLAY_POLICIES)}"
                )
            if name not in names:
                names.append(name)
    return names


def run_replay(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Checks the inputs and outputs, reads the trace, and replays it per policy and size.

    Returns:
      The replay JSON of each run, policy by policy, each size in order; each run also has
      ``size`` (as given), ``distinct_bytes`` and ``unit_size`` (the trace counts blocks).

    Raises:
      UserError: a bad or missing setting, a trace that is not a file, or an unwritable --plot.
      ValueError: a size that cannot be parsed, or a malformed trace.
    """
    from cacheflow_jax.prefetch.scheduler import PrefetchSettings
    from cacheflow_jax.replay.engine import replay
    from cacheflow_jax.trace.reader import parse_size as parse_trace_size
    from cacheflow_jax.trace.reader import read_trace

    check_input_file(args.trace, what="trace")
    if args.plot:
        check_output_file(args.plot, setting="--plot", suffixes=PLOT_SUFFIXES)
    if args.sizes is not None:
        sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
        if not sizes:
            raise UserError(f"--sizes {args.sizes!r} lists no sizes; give e.g. --sizes 1%,5%,10%")
        setting = "--sizes"
    elif args.device_bytes is not None:
        sizes, setting = [args.device_bytes], "--device-bytes"
    else:
        raise UserError("give --device-bytes SIZE or --sizes 1%,5%,... (see --help)")
    policies = _replay_policies(args)
    prefetchers = _replay_prefetchers(args.prefetch)
    trace = read_trace(
        args.trace, format=args.format, block_bytes=args.block_bytes, csv_spec=args.csv_spec
    )
    warmup = _replay_warmup(args.warmup, trace)
    total = trace.distinct_bytes()
    largest = trace.largest()
    unit = largest == 1
    host = parse_trace_size(
        args.host_bytes, total=total, largest=largest, setting="--host-bytes", unit_size=unit
    )
    # Every size is checked before the first replay starts.
    devices = [
        parse_trace_size(size, total=total, largest=largest, setting=setting, unit_size=unit)
        for size in sizes
    ]
    runs = []
    settings = PrefetchSettings(lead=args.lead, keys_known=args.keys_known)
    for policy in policies:
        for size, device in zip(sizes, devices):
            for name, make in prefetchers:
                stats = replay(
                    trace,
                    device_bytes=device,
                    host_bytes=host,
                    policy=policy,
                    prefetcher=make(),
                    prefetch=settings if name != "none" else None,
                    warmup=warmup,
                    progress=not args.no_progress,
                    label=f"replay {policy} {size}" + (f" {name}" if name != "none" else ""),
                )
                stats["size"] = size
                stats["distinct_bytes"] = total
                stats["unit_size"] = unit
                stats["prefetcher"] = name
                stats["lead"] = args.lead
                stats["keys_known"] = args.keys_known
                stats["warmup"] = warmup
                runs.append(stats)
    if args.plot:
        plot_miss_ratio_curve(runs, args.plot)
    return runs


def _field(stats: dict[str, Any], name: str) -> Any:
    value: Any = stats
    for part in name.split("."):
        value = value[part]
    return value


def format_replay(runs: list[dict[str, Any]]) -> str:
    """The replay runs as one table, a row per policy and size; sizes read as blocks or bytes."""
    several = len({r["policy"]["name"] for r in runs}) > 1
    prefetching = any(r.get("prefetcher", "none") != "none" for r in runs)
    columns = _REPLAY_COLUMNS + (_PREFETCH_COLUMNS if prefetching else ())
    titles = [title for _, title in columns]
    lead = ["policy"] if several else []
    if prefetching:
        lead.append("prefetch")
    cells: list[Sequence[str]] = [lead + titles]
    for stats in runs:
        row = [stats["policy"]["name"]] if several else []
        if prefetching:
            row.append(stats.get("prefetcher", "none"))
        for name, _ in columns:
            value = _field(stats, name)
            if name in ("device_bytes", "host_bytes"):
                row.append(_blocks_or_bytes(value, stats["unit_size"]))
            elif isinstance(value, float):
                row.append(f"{value:,.0f}" if name == "accesses_per_second" else f"{value:.4f}")
            else:
                row.append(str(value))
        cells.append(row)
    lines = _table(cells, right=set(range(len(lead), len(cells[0]))))
    first = runs[0]
    total = first["distinct_bytes"]
    if first["unit_size"]:
        what = f"{total} distinct blocks (unit size: a size counts blocks, not bytes)"
    else:
        what = f"{total} distinct bytes ({_human(total)})"
    policy = "" if several else f"policy {first['policy']['name']}, "
    lines.append(f"{first['trace']}: {policy}{what}")
    return "\n".join(lines)


def plot_miss_ratio_curve(runs: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Draws miss ratio against L1 size, one line per policy (and prefetcher), to ``path``.

    Args:
      runs: replay runs (see `run_replay`), any number of policies and sizes.
      path: the image file (.png, .svg or .pdf); missing parent directories are made.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = runs[0]
    total = first["distinct_bytes"]
    unit = "blocks" if first["unit_size"] else "bytes"
    fig, ax = plt.subplots(figsize=(6.4, 4.2))

    def line(r: dict[str, Any]) -> str:
        prefetcher = r.get("prefetcher", "none")
        return r["policy"]["name"] + ("" if prefetcher == "none" else f" + {prefetcher}")

    for name in dict.fromkeys(line(r) for r in runs):
        points = sorted(
            (100.0 * r["device_bytes"] / total, r["miss_ratio"]) for r in runs if line(r) == name
        )
        xs, ys = zip(*points)
        ax.plot(xs, ys, "o-", label=name)
    ax.set_xlabel(
        f"L1 size, % of the trace's {total} distinct {unit}"
        + ("" if first["unit_size"] else f" ({_human(total)})")
        + (f"; L2 {_blocks_or_bytes(first['host_bytes'], first['unit_size'])}"
           if first["host_bytes"] else "")
    )
    ax.set_ylabel("miss ratio (went to L3)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(f"miss-ratio curve: {Path(first['trace']).name}")
    ax.legend()
    fig.tight_layout()
    Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cmd_replay(args: argparse.Namespace) -> int:
    runs = run_replay(args)
    if args.json:
        single = len(runs) == 1 and args.sizes is None and args.compare is None
        print(json.dumps(runs[0] if single else runs, indent=1))
    else:
        print(format_replay(runs))
    if args.plot:
        print(f"cacheflow replay: wrote {args.plot}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# stats


def _cmd_stats(args: argparse.Namespace) -> int:
    from cacheflow_jax.trace.stats import trace_stats
    from cacheflow_jax.trace.reader import read_trace

    check_input_file(args.log, what="access log")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes:
        raise UserError(f"--sizes {args.sizes!r} lists no sizes; give e.g. --sizes 1%,5%,10%")
    trace = read_trace(
        args.log, format=args.format, block_bytes=args.block_bytes, csv_spec=args.csv_spec
    )
    report = trace_stats(trace, sizes=sizes, sample=args.sample)
    print(json.dumps(report, indent=1) if args.json else format_stats(report))
    return 0


def format_stats(report: dict[str, Any]) -> str:
    """The ``stats`` report: totals and kinds, the reuse-distance histogram, LRU's curve."""
    unit = report["unit_size"]
    lines = [
        f"{report['trace']}: {report['accesses']} accesses, {report['distinct_keys']} distinct "
        f"keys, " + (f"{report['distinct_bytes']} distinct blocks (unit size)" if unit
                     else f"{_human(report['distinct_bytes'])} distinct"),
        "",
    ]
    cells: list[Sequence[str]] = [("kind", "accesses", "distinct keys", "distinct size")]
    for kind, row in sorted(report["by_kind"].items()):
        cells.append(
            (
                kind,
                str(row["accesses"]),
                str(row["distinct_keys"]),
                _blocks_or_bytes(row["distinct_bytes"], unit),
            )
        )
    lines += _table(cells, right={1, 2, 3})
    reuse = report["reuse"]
    median = reuse["median"]
    median_text = "-" if median is None else f"{median:g}"
    lines += ["", f"reuse distance, in {reuse['unit']}; median {median_text}:"]
    n = report["accesses"]
    cells = [("distance", "accesses", "share")]
    cells.append(("first access", str(reuse["first_accesses"]),
                  f"{reuse['first_accesses'] / n:.3f}"))
    for row in reuse["histogram"]:
        label = str(row["lo"]) if row["hi"] == row["lo"] + 1 else f"{row['lo']}-{row['hi'] - 1}"
        cells.append((label, str(row["accesses"]), f"{row['accesses'] / n:.3f}"))
    lines += _table(cells, right={0, 1, 2})
    lines += ["", "LRU miss-ratio curve (one tier):"]
    cells = [("size", "cache", "miss ratio", "byte miss")]
    for row in report["lru"]:
        cells.append(
            (
                row["size"],
                _blocks_or_bytes(row["cache_bytes"], unit),
                f"{row['miss_ratio']:.4f}",
                f"{row['byte_miss_ratio']:.4f}",
            )
        )
    lines += _table(cells, right={0, 1, 2, 3})
    lines.append(f"method: {report['method']}; {report['seconds']:.2f} s")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# train


def _run_train(argv: Sequence[str]) -> int:
    """``cacheflow train ...`` runs ``python -m training.main ...``: the offline training script.

    The library never imports ``training/`` (docs/design.md: dependencies point one way), so the
    command hands its arguments to the script in a child process and returns its exit status.
    """
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "training.main", *argv])
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C reaches the whole process group, so the script has it too and reports it
            # (one line, status 130). Waiting for it, rather than raising here, keeps a second
            # report (and `subprocess.call`'s kill mid-write) away.
            continue


# --------------------------------------------------------------------------------------------
# bench

BENCHMARKS = (
    "hit_cost", "cold_read", "metadata_memory", "policies", "two_tier", "h2d", "synthetic",
    "embedding", "gpu_kernels", "stats_speed", "subblocks", "soak", "replay_speed", "prefetchers",
    "foresight", "llm_serving",
)


def _run_bench(argv: Sequence[str]) -> int:
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


# --------------------------------------------------------------------------------------------
# main


def build_parser() -> argparse.ArgumentParser:
    """The ``cacheflow`` argument parser with its subcommands."""
    from cacheflow_jax import __version__

    parser = _Parser(
        prog="cacheflow",
        description="A three-tier (device / host / TensorStore) cache for JAX inference data.",
    )
    parser.add_argument("--version", action="version", version=f"cacheflow-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

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
    p.add_argument("--step", type=_nonnegative_int, default=None, help="step of a root")
    out = p.add_mutually_exclusive_group()
    out.add_argument(
        "--json", action="store_true",
        help="print machine-readable JSON, with every key and its size in bytes",
    )
    out.add_argument(
        "--keys", action="store_true",
        help="print every block key and its size in bytes, one per line (tab-separated)",
    )
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "verify",
        help="record (or check) a CRC-32C manifest of every chunk of an orbax checkpoint",
        description="Read every chunk of an orbax checkpoint and record its CRC-32C in "
        "CKPT.cacheflow-manifest.json beside the checkpoint (never inside it); from then on "
        "every read of the checkpoint is checked against it. With a manifest already there, "
        "check every chunk against it (exit status 1 if one differs).",
    )
    p.add_argument("path", metavar="CKPT", help="CheckpointManager root, step or item directory")
    p.add_argument("--step", type=_nonnegative_int, default=None, help="step of a root")
    p.add_argument(
        "--update", action="store_true", help="record anew (after the checkpoint was saved again)"
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_verify)

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
        type=_positive_int,
        default=200,
        metavar="N",
        help="measured steps per configuration (default: 200)",
    )
    p.add_argument(
        "--record",
        type=_positive_int,
        default=300,
        metavar="N",
        help="warm-up steps recorded to train the MLP and prime the predictors (default: 300)",
    )
    p.add_argument(
        "--tokens",
        type=_positive_int,
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
    p.add_argument("--layers", type=_positive_int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--experts", type=_positive_int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--expert-mb", type=_positive_float, default=2.0, help=argparse.SUPPRESS)
    p.add_argument("--d-model", type=_positive_int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--top-k", type=_positive_int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=_nonnegative_int, default=5, help=argparse.SUPPRESS)
    p.add_argument("--prefetch-k", type=_positive_int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "replay",
        help="replay a trace through the cache (metadata only) and report hits and misses",
        description="Drive the live cache's TieredCache and policy objects over a trace, with a "
        "store that holds metadata only, and report the counters (the replay JSON of "
        "docs/design.md). SIZE is bytes with an optional unit (64KiB, 2GiB) or a percentage of "
        "the trace's distinct bytes (5%%). On a unit-size trace (every key one block, as "
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
    p.add_argument("--block-bytes", type=_positive_int, default=1, metavar="N",
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
        "--lead", type=_positive_int, default=1, metavar="N",
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
    p.set_defaults(func=_cmd_replay)

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
        "--sample", type=_rate, metavar="RATE",
        help="estimate the curve from a SHARDS sample of RATE of the keys (for big logs; the "
        "report says it is an estimate)",
    )
    p.add_argument(
        "--format",
        choices=("log", "mooncake", "libcachesim-csv", "txt"),
        help="trace format (default: guessed from the name and first line)",
    )
    p.add_argument("--block-bytes", type=_positive_int, default=1, metavar="N",
                   help="mooncake: bytes per KV block (default 1: unit size)")
    p.add_argument("--csv-spec", metavar="SPEC",
                   help="libcachesim-csv column spec, e.g. time=2,key=5,size=4,header=true")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_stats)

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
        return _run_train(argv[1:])
    if argv[:1] == ["bench"]:
        return _run_bench(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        sys.stdout.flush()
        return int(e.code or 0)
    try:
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
