"""Replay speed: ``cacheflow replay`` with the default policy, as a whole process, against
libCacheSim's Python binding running LRU over the same trace in a plain Python loop.

Run: ``python -m bench.replay_speed [--trace PATH | --large] [--size 10%] [--runs 5]
[--policy lfu]`` (or ``cacheflow bench replay_speed``). ``--large`` generates (once) and replays
a trace of 1M accesses over about 217k keys, where the per-access cost of a large key space shows.

Each run, in this order, in fresh processes:

1. **ours**: ``python -m cacheflow_jax.cli replay TRACE --device-bytes SIZE --json`` is timed from
   start to exit (interpreter start, imports, reading the trace, the replay, the JSON). Its rate
   is accesses / that wall time. The replay's own loop rate (its JSON's ``accesses_per_second``)
   is kept too.
2. **peer**: a Python process reads the trace with the same reader, maps keys to integer ids, and
   times only the loop ``cache.get(Request(obj_id=..., obj_size=..., clock_time=i))`` of
   ``libcachesim.LRU`` with the same byte budget. Its whole process is timed as well.

Both run with Python's bytecode cache on, in a temporary folder (``PYTHONPYCACHEPREFIX``; an
inherited ``PYTHONDONTWRITEBYTECODE`` is dropped), and the warm-up run fills it, as an installed
package's ``.pyc`` files are on a user's machine: without it every run recompiles cacheflow's
modules (about 25 ms here).

The ratios are computed per run: **ours, whole process / peer loop** (the target: >= 0.5x),
ours loop / peer loop, and ours whole process / peer whole process. It prints the median and the
p95 (the worst run with 5) of each and the load average, and writes ``replay_speed.json``.
Both sides share the machine alike within a run; runs are interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench._common import percentile
from bench.policies import shared_traces_dir

TARGET = 0.5

_PEER = r"""
import sys, time
from cacheflow_jax.trace.reader import parse_size, read_trace
import libcachesim as lcs
trace = read_trace(sys.argv[1])
budget = parse_size(sys.argv[2], total=trace.distinct_bytes(), largest=int(trace.nbytes.max()),
                    setting="size")
sizes = trace.sizes()
ids = {}
keys = [ids.setdefault(k, len(ids)) for k in trace.keys]
nbytes = [sizes[k] for k in trace.keys]
cache = lcs.LRU(cache_size=budget)
get, request = cache.get, lcs.Request
start = time.perf_counter()
misses = 0
for i, (obj, n) in enumerate(zip(keys, nbytes)):
    if not get(request(obj_id=obj, obj_size=n, clock_time=i)):
        misses += 1
elapsed = time.perf_counter() - start
print(len(keys) / elapsed, misses / len(keys))
"""


def child_env(pycache: str) -> dict[str, str]:
    """The environment of both processes: bytecode cached under ``pycache`` (see the doc)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def ours(trace: str, size: str, policy: str, env: dict[str, str] | None = None) -> dict:
    """One whole ``cacheflow replay`` process: its wall time and its JSON."""
    cmd = [sys.executable, "-m", "cacheflow_jax.cli", "replay", trace, "--device-bytes", size,
           "--policy", policy, "--json", "--no-progress"]
    start = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    wall = time.perf_counter() - start
    stats = json.loads(out)
    return {"wall": wall, "rate": stats["requests"] / wall,
            "loop_rate": stats["accesses_per_second"], "miss_ratio": stats["miss_ratio"],
            "requests": stats["requests"]}


def peer(trace: str, size: str, env: dict[str, str] | None = None) -> dict:
    """One libCacheSim LRU process: its loop rate and its whole wall time."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _PEER, trace, size], check=True,
                         capture_output=True, text=True, env=env).stdout
    wall = time.perf_counter() - start
    rate, miss_ratio = (float(x) for x in out.split())
    return {"wall": wall, "loop_rate": rate, "miss_ratio": miss_ratio}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", help="default: the shared Mooncake trace")
    parser.add_argument("--size", default="10%")
    parser.add_argument("--policy", default="lfu")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    parser.add_argument("--large", action="store_true",
                        help="replay a generated trace of 1M accesses over ~217k keys (a Zipf "
                             "with a shifting hot set, bench.synthetic.write_large) instead")  # fmt: skip
    args = parser.parse_args(argv)
    if args.large:
        from bench.synthetic import write_large

        args.trace = write_large(os.path.join(args.out, "synthetic"))
    trace = args.trace or os.path.join(shared_traces_dir(), "mooncake_synthetic_trace.jsonl")
    os.makedirs(args.out, exist_ok=True)
    runs, loads = [], []
    pycache = tempfile.mkdtemp(prefix="replay_speed_pycache_")
    env = child_env(pycache)
    try:
        peer(trace, args.size, env)  # warm-up: the page cache and the bytecode cache
        ours(trace, args.size, args.policy, env)
        for _ in range(args.runs):
            loads.append(os.getloadavg()[0])
            runs.append((ours(trace, args.size, args.policy, env), peer(trace, args.size, env)))
    finally:
        shutil.rmtree(pycache, ignore_errors=True)
    for i, (a, b) in enumerate(runs):
        runs[i] = {
            "ours": a, "peer": b,
            "process_over_peer_loop": a["rate"] / b["loop_rate"],
            "loop_over_peer_loop": a["loop_rate"] / b["loop_rate"],
            "process_over_peer_process": b["wall"] / a["wall"],
        }
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "trace": trace, "size": args.size, "policy": args.policy, "bytecode_cache": True,
        "runs": runs,
        "load_average": loads,
    }
    lines = [f"Replay speed, {report['date']}, {os.path.basename(trace)} at {args.size}, policy "
             f"{args.policy}, {args.runs} interleaved runs (load average "
             f"{min(loads):.1f}-{max(loads):.1f}; the machine is shared):"]
    for key, what in (
        ("process_over_peer_loop", "ours, whole process / libCacheSim LRU loop"),
        ("loop_over_peer_loop", "ours, replay loop / libCacheSim LRU loop"),
        ("process_over_peer_process", "ours, whole process / libCacheSim, whole process"),
    ):
        values = [r[key] for r in runs]
        median = sorted(values)[len(values) // 2]
        report[key] = {"median": median, "p95": percentile(values, 95, better="high")}
        verdict = ""
        if key == "process_over_peer_loop":
            verdict = f" (target >= {TARGET}x: {'met' if median >= TARGET else 'not met'})"
        lines.append(f"  {what}: median {median:.2f}x, p95 {report[key]['p95']:.2f}x{verdict}")
    r0 = runs[0]
    lines.append(f"  (ours: {r0['ours']['requests']} accesses in {r0['ours']['wall']:.2f} s; "
                 f"miss ratio {r0['ours']['miss_ratio']:.4f}, libCacheSim LRU "
                 f"{r0['peer']['miss_ratio']:.4f})")
    with open(os.path.join(args.out, "replay_speed.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
