"""The measurement history: ``bench/results/history.jsonl``, rendered as ``docs/results.md``.

Run: ``python -m bench.results`` (writes docs/results.md), ``python -m bench.results --check``
(exit status 1 if docs/results.md is not what this would write) or ``--stdout``.

``bench/results/history.jsonl`` holds one JSON object per recorded run, in the order they were recorded:

| field | what |
|---|---|
| ``date`` | ``YYYY-MM-DD`` (UTC) |
| ``time`` | optional: the time as recorded, e.g. ``"23:35 UTC"``, ``"05:00-05:16 UTC"``, ``"17:2x UTC"`` |
| ``benchmark`` | the group it is listed under: ``hit_cost``, ``policies``, ``demo``, ... |
| ``command`` | the command that ran |
| ``metrics`` | ``{name: value}``; values are strings, exactly as recorded (``"5.29x"``, ``"-.00557"``) |
| ``machine`` | the machine it ran on |
| ``notes`` | what else was recorded about the run (may be empty) |
| ``target``, ``load``, ``commit``, ``source`` | optional: the verdict, the load average, the commit, and where the record was first written |

To add a run, append a line to ``bench/results/history.jsonl`` and run ``python -m bench.results``;
``tests/test_results_doc.py`` fails while docs/results.md is stale. The benchmarks are listed in
the order they first appear in the file, each as one table, newest run first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HISTORY = Path(__file__).resolve().with_name("history.jsonl")
DOC = ROOT / "docs" / "results.md"

REQUIRED = ("date", "benchmark", "command", "metrics", "machine", "notes")
OPTIONAL = ("time", "target", "load", "commit", "source")
# A benchmark whose runs report more metric names than this gets one "metrics" column.
MAX_METRIC_COLUMNS = 10


def load(path: Path = HISTORY) -> list[dict[str, Any]]:
    """The records of ``path``, checked; ValueError names the line of a bad one."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            _check(record)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}:{number}: {err}") from None
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def _check(record: Any) -> None:
    if not isinstance(record, dict):
        raise ValueError("a record is a JSON object")
    missing = [k for k in REQUIRED if k not in record]
    unknown = sorted(set(record) - set(REQUIRED) - set(OPTIONAL))
    if missing or unknown:
        raise ValueError(f"missing fields {missing}, unknown fields {unknown}")
    if not isinstance(record["date"], str) or not re.fullmatch(
        r"\d{4}-\d{2}-\d{2}", record["date"]
    ):
        raise ValueError(f"date {record['date']!r} is not YYYY-MM-DD")
    datetime.date.fromisoformat(record["date"])  # a real day
    for key in ("benchmark", "command", "machine"):
        if not isinstance(record[key], str) or not record[key]:
            raise ValueError(f"{key} must be a non-empty string")
    for key in ("notes", *OPTIONAL):
        if key in record and not isinstance(record[key], str):
            raise ValueError(f"{key} must be a string")
    metrics = record["metrics"]
    if not isinstance(metrics, dict) or not metrics:
        raise ValueError("metrics must be a non-empty object")
    for name, value in metrics.items():
        if not isinstance(value, str) or not value:
            raise ValueError(f"metric {name!r}: a value is a non-empty string, as recorded")


def _minutes(time: str | None) -> int:
    """The first HH:MM of a recorded time, in minutes (an ``x`` digit counts as 0); -1 if none."""
    match = re.search(r"(\d{1,2}):(\d)([\dx])", time or "")
    if not match:
        return -1
    return int(match[1]) * 60 + int(match[2]) * 10 + int(match[3].replace("x", "0"))


def _when(member: tuple[int, dict[str, Any]]) -> tuple[str, int, int]:
    """Sort key: date, time of day, then place in the file (a later line is newer)."""
    index, record = member
    return record["date"], _minutes(record.get("time")), index


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|") or "-"


def _code(text: str) -> str:
    return f"`{text}`" if "`" not in text else text


def _table(
    records: list[dict[str, Any]], in_file_order: list[dict[str, Any]], one_machine: bool
) -> list[str]:
    names: list[str] = []  # metric columns in the order the file first names them
    for record in in_file_order:
        names += [n for n in record["metrics"] if n not in names]
    wide = len(names) <= MAX_METRIC_COLUMNS
    optional = [k for k in ("target", "load", "commit") if any(k in r for r in records)]
    header = ["date", "time", "command", *(names if wide else ["metrics"]), *optional]
    if not one_machine:
        header.append("machine")
    header.append("notes")
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |",
             "|" + "---|" * len(header)]  # fmt: skip
    for record in records:
        metrics = record["metrics"]
        row = [record["date"], record.get("time", ""), _code(record["command"])]
        if wide:
            row += [metrics.get(n, "") for n in names]
        else:
            row.append("; ".join(f"{n}: {v}" for n, v in metrics.items()))
        row += [record.get(k, "") for k in optional]
        if not one_machine:
            row.append(record["machine"])
        row.append(record["notes"])
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines


def render(records: Sequence[dict[str, Any]]) -> str:
    """docs/results.md for ``records``: one table per benchmark, newest run first."""
    machines = sorted({r["machine"] for r in records})
    one_machine = len(machines) == 1
    machine_lines = [f"Every run was on one machine: {machines[0]}.", ""] if one_machine else []
    groups: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for index, record in enumerate(records):
        groups.setdefault(record["benchmark"], []).append((index, record))
    out = [
        "# Results",
        "",
        "<!-- Generated by `python -m bench.results` from bench/results/history.jsonl: edit that",
        "file and rerun the command; tests/test_results_doc.py fails while this page is stale. -->",
        "",
        "Every recorded run of the benchmarks and the demo, one table per benchmark, newest run",
        "first. The values are exactly as recorded (`-` where a run did not report a metric);",
        "speed figures are ratios against a baseline measured in the same run, median unless the",
        "name says p95. The commands and what each benchmark measures are in",
        "[bench/README.md](../bench/README.md); the README's table of headline numbers quotes the",
        "newest runs.",
        "",
        *machine_lines,
        "| benchmark | runs | newest |",
        "|---|---|---|",
    ]
    ordered = {}
    for name, members in groups.items():
        newest_first = sorted(members, key=_when, reverse=True)
        ordered[name] = [record for _, record in newest_first]
        out.append(f"| [`{name}`](#{name}) | {len(members)} | {ordered[name][0]['date']} |")
    for name, members in ordered.items():
        in_file_order = [r for _, r in groups[name]]
        out += ["", f"## {name}", "", *_table(members, in_file_order, one_machine)]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Writes docs/results.md from bench/results/history.jsonl (or checks it, or prints it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=Path, default=HISTORY, help="the JSONL history")
    parser.add_argument("--doc", type=Path, default=DOC, help="the page to write")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    how.add_argument("--stdout", action="store_true", help="print the page instead")
    args = parser.parse_args(argv)
    text = render(load(args.history))
    if args.stdout:
        sys.stdout.write(text)
    elif args.check:
        if not args.doc.is_file() or args.doc.read_text(encoding="utf-8") != text:
            print(f"{args.doc} is stale: run python -m bench.results", file=sys.stderr)
            return 1
    else:
        args.doc.write_text(text, encoding="utf-8")
        print(f"wrote {args.doc} ({text.count(chr(10))} lines)")
    return 0
