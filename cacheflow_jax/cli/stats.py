"""``cacheflow stats``: an access log's kinds, reuse distances and LRU miss-ratio curve."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from cacheflow_jax.cli.common import (
    UserError,
    blocks_or_bytes,
    check_input_file,
    human_size,
    table_lines,
)


def cmd_stats(args: argparse.Namespace) -> int:
    """``cacheflow stats``: the report of `format_stats`, or JSON (``--json``)."""
    from cacheflow_jax.trace.reader import read_trace
    from cacheflow_jax.trace.stats import trace_stats

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
                     else f"{human_size(report['distinct_bytes'])} distinct"),
        "",
    ]
    cells: list[Sequence[str]] = [("kind", "accesses", "distinct keys", "distinct size")]
    for kind, row in sorted(report["by_kind"].items()):
        cells.append(
            (
                kind,
                str(row["accesses"]),
                str(row["distinct_keys"]),
                blocks_or_bytes(row["distinct_bytes"], unit),
            )
        )
    lines += table_lines(cells, right={1, 2, 3})
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
    lines += table_lines(cells, right={0, 1, 2})
    lines += ["", "LRU miss-ratio curve (one tier):"]
    cells = [("size", "cache", "miss ratio", "byte miss")]
    for row in report["lru"]:
        cells.append(
            (
                row["size"],
                blocks_or_bytes(row["cache_bytes"], unit),
                f"{row['miss_ratio']:.4f}",
                f"{row['byte_miss_ratio']:.4f}",
            )
        )
    lines += table_lines(cells, right={0, 1, 2, 3})
    lines.append(f"method: {report['method']}; {report['seconds']:.2f} s")
    return "\n".join(lines)
