"""``cacheflow replay``: a trace through the cache (metadata only), its table and its curve."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cacheflow_jax.cli.common import (
    PLOT_SUFFIXES,
    UserError,
    blocks_or_bytes,
    check_input_file,
    check_output_file,
    human_size,
    table_lines,
)

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
                    names=(f"{setting} {size}", f"--host-bytes {args.host_bytes}"),
                    unit="blocks" if unit else "bytes",
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
                row.append(blocks_or_bytes(value, stats["unit_size"]))
            elif isinstance(value, float):
                row.append(f"{value:,.0f}" if name == "accesses_per_second" else f"{value:.4f}")
            else:
                row.append(str(value))
        cells.append(row)
    lines = table_lines(cells, right=set(range(len(lead), len(cells[0]))))
    first = runs[0]
    total = first["distinct_bytes"]
    if first["unit_size"]:
        what = f"{total} distinct blocks (unit size: a size counts blocks, not bytes)"
    else:
        what = f"{total} distinct bytes ({human_size(total)})"
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
        + ("" if first["unit_size"] else f" ({human_size(total)})")
        + (f"; L2 {blocks_or_bytes(first['host_bytes'], first['unit_size'])}"
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


def cmd_replay(args: argparse.Namespace) -> int:
    """``cacheflow replay``: the runs as a table or JSON, and the curve with ``--plot``."""
    runs = run_replay(args)
    if args.json:
        single = len(runs) == 1 and args.sizes is None and args.compare is None
        print(json.dumps(runs[0] if single else runs, indent=1))
    else:
        print(format_replay(runs))
    if args.plot:
        print(f"cacheflow replay: wrote {args.plot}", file=sys.stderr)
    return 0
