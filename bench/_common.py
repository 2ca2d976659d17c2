"""Shared pieces of the benchmarks: command line, statistics, targets, tables, JSON, machine facts.

Statistics. Each benchmark repeats a measured pass ``--runs`` times after ``--warmup`` unrecorded
passes, and reports the median and the p95 of the runs. The p95 is taken on the *bad* side
(slow times, low bandwidths, high ratios when lower is better) with the nearest-rank method, so
with 7 runs it is the worst run. A ratio is computed per run from the variant and its baseline
measured in that same run, then summarised like any other sample.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

DEFAULT_RUNS = 7
OUT_DIR = Path(__file__).resolve().parent / "out"

Better = Literal["low", "high"]


def parser(name: str, description: str, *, runs: int = DEFAULT_RUNS) -> argparse.ArgumentParser:
    """The command line every benchmark shares: ``--json``, ``--runs``, ``--warmup``, ``--out``."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=description)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--runs", type=int, default=runs, help=f"measured runs (default {runs})")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded runs first (default 1)")
    p.add_argument(
        "--out", type=Path, default=OUT_DIR, help=f"folder for <name>.json (default {OUT_DIR})"
    )
    return p


def check_runs(args: argparse.Namespace) -> None:
    """Rejects run counts that cannot give a median."""
    if args.runs < 1 or args.warmup < 0:
        raise SystemExit(f"--runs={args.runs} must be >= 1 and --warmup={args.warmup} >= 0")


def percentile(samples: Sequence[float], q: float, *, better: Better) -> float:
    """The nearest-rank ``q``-th percentile on the bad side (high if lower is better)."""
    ordered = sorted(samples)
    if better == "high":  # the bad tail is the low end
        ordered.reverse()
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summarize(samples: Sequence[float], *, better: Better) -> dict[str, Any]:
    """Median, p95 on the bad side, best, worst and the raw samples of one measured quantity."""
    if not samples:
        raise ValueError("no samples to summarise; --runs must be >= 1")
    return {
        "median": statistics.median(samples),
        "p95": percentile(samples, 95, better=better),
        "best": max(samples) if better == "high" else min(samples),
        "runs": len(samples),
        "better": better,
        "samples": list(samples),
    }


@dataclass(frozen=True)
class Target:
    """A goal for a summarised quantity: ``median <op> bound`` (the p95 is shown beside it)."""

    label: str
    op: Literal["<=", ">="]
    bound: float
    unit: str = "x"

    def met(self, value: float) -> bool:
        """Whether ``value`` satisfies the target."""
        return value <= self.bound if self.op == "<=" else value >= self.bound

    def verdict(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The target's result for ``stats`` (from `summarize`), judged on the median."""
        return {
            "label": self.label,
            "target": f"{self.op} {self.bound:g}{self.unit}",
            "unit": self.unit,
            "median": stats["median"],
            "p95": stats["p95"],
            "met": self.met(stats["median"]),
            "p95_met": self.met(stats["p95"]),
        }

    @staticmethod
    def line(v: dict[str, Any], fmt: str = "{:.2f}") -> str:
        """One printed line: ``label: target <= 2x: met (median 1.23x, p95 1.40x)``."""
        unit = v["unit"]
        median, p95 = fmt.format(v["median"]), fmt.format(v["p95"])
        state = "met" if v["met"] else "not met"
        tail = "" if v["p95_met"] == v["met"] else f"; p95 {'meets' if v['p95_met'] else 'misses'}"
        return (
            f"{v['label']}: target {v['target']}: {state} "
            f"(median {median}{unit}, p95 {p95}{unit}{tail})"
        )


@dataclass
class Report:
    """What a benchmark prints and saves: tables, target verdicts and notes."""

    name: str
    title: str
    settings: dict[str, Any]
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)

    def add_table(self, caption: str, headers: list[str], rows: list[list[str]]) -> None:
        """Adds a table to print (the numbers also go to ``results`` for the JSON)."""
        self.tables.append((caption, headers, rows))

    def text(self) -> str:
        """The readable report."""
        m = machine()
        lines = [
            f"== {self.title} ==",
            f"{m['date']}  {m['summary']}",
            "settings: " + ", ".join(f"{k}={v}" for k, v in self.settings.items()),
        ]
        for caption, headers, rows in self.tables:
            lines += ["", caption, format_table(headers, rows)]
        if self.verdicts:
            lines.append("")
            lines += [Target.line(v) for v in self.verdicts]
        if self.notes:
            lines.append("")
            lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def payload(self) -> dict[str, Any]:
        """The JSON document."""
        return {
            "benchmark": self.name,
            "title": self.title,
            "machine": machine(),
            "settings": self.settings,
            "results": self.results,
            "targets": self.verdicts,
            "notes": self.notes,
        }

    def emit(self, args: argparse.Namespace) -> Path:
        """Prints the table (or JSON with ``--json``) and writes ``<out>/<name>.json``."""
        payload = self.payload()
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{self.name}.json"
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        if args.json:
            print(json.dumps(payload, indent=2, default=str))
        else:
            print(self.text())
            print(f"\nwrote {path}")
        return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def fmt(cells: Sequence[str]) -> str:
        out = [str(cells[0]).ljust(widths[0])]
        out += [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(headers), rule, *(fmt(r) for r in rows)])


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes, with the garbage collector paused as ``timeit`` does."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()


_MACHINE: dict[str, Any] = {}


def machine() -> dict[str, Any]:
    """Date and machine facts printed with every result (absolute times depend on them)."""
    if _MACHINE:
        return _MACHINE
    import importlib.metadata as md

    import jax

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "absent"

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = 0.0
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        pass
    devices = jax.devices()
    accel = [d for d in devices if d.platform != "cpu"]
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = f"{len(accel)}x {accel[0].device_kind}" if accel else "no GPU"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    _MACHINE.update(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        summary=(
            f"{platform.system()} {platform.machine()}, {ncpu} CPU cores ({cpu}), "
            f"{mem_gib:.0f} GiB RAM, {gpu}; Python {platform.python_version()}, "
            f"jax {jax.__version__} ({devices[0].platform}), "
            f"tensorstore {version('tensorstore')}, numpy {version('numpy')}; "
            f"load average {load:.2f} at start (other processes add noise)"
        ),
        cpus=ncpu,
        cpu_model=cpu,
        memory_gib=round(mem_gib, 1),
        load_average_1m=load,
        jax_backend=devices[0].platform,
        devices=[str(d) for d in devices],
        python=sys.version.split()[0],
        versions={d: version(d) for d in ("jax", "jaxlib", "tensorstore", "numpy", "cachetools")},
    )
    return _MACHINE


def fmt_ns(seconds: float) -> str:
    """Seconds as whole nanoseconds."""
    return f"{seconds * 1e9:,.0f}"


def fmt_ratio(x: float) -> str:
    """A ratio as ``1.23x``."""
    return f"{x:.2f}x"
