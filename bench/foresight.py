"""Foresight on and off: Markov prefetching over every shared trace at several sizes.

Run: ``python -m bench.foresight [--sizes 1%,10%,20%] [--out bench/out]`` (or ``cacheflow bench
foresight``).

For each shared trace with keys, it replays the last 30% (the first 70% warms the cache and the
predictor up; lead 1, one tier) with `predictor.markov` twice: as the cache runs (foreseen
blocks leave first while the measured rates say it pays, `_planner.Foresight`) and with
foresight never going first (the rates are still kept; everything else is the same). It prints
how many points each way moved by more than .0005, the mean change per size and the worst and
best points, and writes ``foresight.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import predictor
from bench.policies import shared_traces_dir
from cacheflow_jax import _planner
from cacheflow_jax.prefetch.scheduler import PrefetchSettings
from cacheflow_jax.replay.engine import replay
from cacheflow_jax.trace.reader import parse_size, read_trace


def _run(paths: list[Path], sizes: list[str]) -> dict[str, float]:
    out = {}
    for path in paths:
        trace = read_trace(path)
        warmup = int(len(trace.keys) * 0.7)
        for size in sizes:
            budget = parse_size(size, total=trace.distinct_bytes(),
                                largest=int(trace.nbytes.max()), setting="size")
            stats = replay(trace, device_bytes=budget, host_bytes=0, prefetcher=predictor.markov(),
                           prefetch=PrefetchSettings(lead=1), warmup=warmup)
            out[f"{path.name} {size}"] = stats["device_miss_ratio"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs the comparison and prints the summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1%,10%,20%")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    root = Path(shared_traces_dir())
    paths = sorted(p for p in root.iterdir()
                   if p.name.endswith((".gz", ".jsonl")) and not p.name.startswith("Azure"))
    on = _run(paths, sizes)
    first = _planner.Foresight.first
    _planner.Foresight.first = property(lambda self: False, lambda self, value: None)
    try:
        off = _run(paths, sizes)
    finally:
        _planner.Foresight.first = first
    delta = {k: on[k] - off[k] for k in on}
    better = [k for k, d in delta.items() if d < -0.0005]
    worse = [k for k, d in delta.items() if d > 0.0005]
    print(f"{len(delta)} points: foresight lower at {len(better)}, higher at {len(worse)}; "
          f"mean change {sum(delta.values()) / len(delta):+.5f}")
    for size in sizes:
        ks = [k for k in delta if k.endswith(" " + size)]
        print(f"  {size}: lower {sum(k in better for k in ks)}, higher {sum(k in worse for k in ks)}, "
              f"mean {sum(delta[k] for k in ks) / len(ks):+.5f}")
    for k in sorted(delta, key=delta.get)[:3] + sorted(delta, key=delta.get)[-3:]:
        print(f"  {k}: {off[k]:.4f} -> {on[k]:.4f}")
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "foresight.json").write_text(json.dumps({"on": on, "off": off}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
