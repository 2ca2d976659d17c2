"""Prefetcher benchmark: every prefetch option on every shared trace, held-out part only.

Run: ``python -m bench.prefetchers [--quick] [--traces PATH ...] [--sizes 5%] [--workers 2]
[--epochs 2] [--positions 20000] [--lead 1] [--out bench/out]``.

For each shared trace with keys (``data/traces/``, read with the project's `read_trace`), it
trains the predictor MLP on the first 70% (by time, as ``cacheflow train --eval-fraction 0.3``
splits; small settings: ``--epochs`` passes over at most ``--positions`` sampled positions), then
replays the last 30% (``--warmup`` at the same cut: the first 70% only warms the cache and the
predictor up) with one tier (host bytes 0) at each of ``--sizes`` of the trace's distinct
bytes, once per prefetch option: ``none``, ``last-successor``, ``markov``, ``stride`` and
``mlp`` (the checkpoint just trained). It prints a table of ``device_miss_ratio`` and prefetch
``accuracy`` per trace and size, then a summary: on how many points ``mlp`` is the best option,
and within .002 of the best baseline (the best of the other four). It writes
``prefetchers.json`` under ``--out`` (every replay's numbers, the settings, the machine).

``--fixed-admission`` replays with ``PrefetchSettings(adaptive=False)`` (the rule before adaptive
admission); ``--hedge N`` serves the MLP with another ``hedge`` than training chose (an
experiment knob). ``--quick`` (about a minute on 2 cores) runs the five shortest LIRS traces and the first 40,000
accesses of Mooncake.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from bench._common import machine
from bench.policies import QUICK, shared_traces, shared_traces_dir

OPTIONS = ["none", "last-successor", "markov", "stride", "mlp"]
NEAR = 0.002  # "within .002 of the best baseline"
QUICK_MOONCAKE_LIMIT = 40_000


def _predictor(name: str, checkpoint: str | None, hedge: int | None = None):
    import predictor

    if name == "none":
        return None
    if name == "mlp":
        mlp = predictor.load(checkpoint)
        if hedge is not None:
            mlp.hedge = hedge  # a serving-time experiment: the checkpoint keeps its own
        return mlp
    return {"last-successor": predictor.last_successor, "markov": predictor.markov,
            "stride": predictor.stride}[name]()


def _job(args: tuple) -> dict:
    """Trains the MLP on one trace's head and replays every option on its tail."""
    path, sizes, epochs, positions, lead, limit, hedge, adaptive = args
    from cacheflow_jax.prefetch.scheduler import PrefetchSettings
    from cacheflow_jax.replay.engine import replay
    from cacheflow_jax.trace.reader import parse_size, read_trace, split_point, write_log
    from training import train

    trace = read_trace(path, limit=limit)
    start = split_point(trace.t, 0.3)
    total = trace.distinct_bytes()
    largest = int(trace.nbytes.max())
    unit = largest == 1
    out: dict = {"trace": os.path.basename(path), "accesses": len(trace), "warmup": start,
                 "points": []}
    with tempfile.TemporaryDirectory(prefix="cacheflow-bench-pf-") as tmp:
        log = os.path.join(tmp, "log.jsonl")
        write_log(trace, log)  # the training reader then sees exactly these accesses
        t0 = time.perf_counter()
        cfg = train.config([log], os.path.join(tmp, "out"), epochs=epochs,
                           max_train_positions=positions, max_eval_examples=2_000,
                           timing_calls=10, progress=False)
        metrics = train.run(cfg)
        out["train_seconds"] = time.perf_counter() - t0
        out["selected"] = metrics["selected"]
        checkpoint = os.path.join(tmp, "out", "checkpoint")
        settings = PrefetchSettings(lead=lead, adaptive=adaptive)
        for size in sizes:
            device = parse_size(size, total=total, largest=largest, setting="--sizes",
                                unit_size=unit)
            point = {"size": size, "device_bytes": device, "options": {}}
            for name in OPTIONS:
                t1 = time.perf_counter()
                stats = replay(trace, device_bytes=device, host_bytes=0,
                               prefetcher=_predictor(name, checkpoint, hedge),
                               prefetch=settings if name != "none" else None, warmup=start)
                pf = stats["prefetch"]
                point["options"][name] = {
                    "device_miss_ratio": stats["device_miss_ratio"],
                    "accuracy": pf["accuracy"], "coverage": pf["coverage"],
                    "issued": pf["issued"], "used": pf["used"], "wasted": pf["wasted"],
                    "seconds": time.perf_counter() - t1,
                }
            out["points"].append(point)
    print(f"{out['trace']}: done ({out['train_seconds']:.0f} s training)", file=sys.stderr)
    return out


def summarize(results: list[dict]) -> dict:
    """Counts the points where ``mlp`` is best, and within `NEAR` of the best baseline."""
    best = near = n = 0
    rows = []
    for r in results:
        for p in r["points"]:
            mr = {k: v["device_miss_ratio"] for k, v in p["options"].items()}
            base = min(v for k, v in mr.items() if k not in ("mlp", "none"))
            n += 1
            best += mr["mlp"] <= min(mr.values())
            near += mr["mlp"] <= base + NEAR
            rows.append((r["trace"], p["size"], mr["mlp"] - base))
    return {"points": n, "mlp_best": best, "mlp_within_002_of_best_baseline": near,
            "mlp_minus_best_baseline": rows}


def table(results: list[dict]) -> str:
    """The readable table: miss ratio (accuracy) per option, a row per trace and size."""
    head = ["trace", "size"] + OPTIONS
    lines = []
    for r in results:
        for p in r["points"]:
            cells = [r["trace"], p["size"]]
            low = min(v["device_miss_ratio"] for v in p["options"].values())
            for name in OPTIONS:
                o = p["options"][name]
                mark = "*" if o["device_miss_ratio"] == low else " "
                acc = "" if name == "none" else f" ({o['accuracy']:.2f})"
                cells.append(f"{o['device_miss_ratio']:.4f}{mark}{acc}")
            lines.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*c) for c in lines])


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m bench.prefetchers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="five short LIRS traces and a Mooncake slice")
    p.add_argument("--traces", nargs="+", help="trace files (default: every shared trace with keys)")
    p.add_argument("--sizes", default="5%", help="L1 sizes, comma-separated (default 5%%)")
    p.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    p.add_argument("--epochs", type=int, default=2, help="MLP training epochs (default 2)")
    p.add_argument("--positions", type=int, default=20_000,
                   help="training positions sampled per trace (default 20000)")
    p.add_argument("--lead", type=int, default=1, help="prefetch lead in accesses (default 1)")
    p.add_argument("--hedge", type=int, default=None,
                   help="serve the MLP with this hedge instead of the one training chose")
    p.add_argument("--fixed-admission", action="store_true",
                   help="PrefetchSettings(adaptive=False): the fixed min_score and rank rule")
    p.add_argument("--out", default=os.path.join("bench", "out"), help="output folder")
    args = p.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    limits: dict[str, int | None] = {}
    if args.traces:
        traces = args.traces
    elif args.quick:
        folder = shared_traces_dir()
        traces = [os.path.join(folder, n) for n in QUICK]
        traces.append(os.path.join(folder, "mooncake_synthetic_trace.jsonl"))
        limits[traces[-1]] = QUICK_MOONCAKE_LIMIT
    else:
        traces = shared_traces()
    jobs = [(t, sizes, args.epochs, args.positions, args.lead, limits.get(t), args.hedge,
             not args.fixed_admission) for t in traces]
    jobs.sort(key=lambda j: -os.path.getsize(j[0]))  # longest first: the pool ends together
    start = time.time()
    with ProcessPoolExecutor(args.workers) as ex:
        results = list(ex.map(_job, jobs))
    results.sort(key=lambda r: r["trace"])
    summary = summarize(results)
    text = table(results)
    print(text)
    print(f"\nmlp best on {summary['mlp_best']} of {summary['points']} points; within {NEAR} of "
          f"the best baseline on {summary['mlp_within_002_of_best_baseline']}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "prefetchers.json")
    with open(path, "w") as f:
        json.dump({"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "seconds": time.time() - start, "load": os.getloadavg(),
                   "settings": vars(args), "results": results, "summary": summary}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
