"""Policy benchmark: the default policy against LRU, every libCacheSim peer and Belady.

Run: ``python -m bench.policies [--quick] [--traces PATH ...] [--sizes 1%,5%,10%,20%]
[--out bench/out] [--set NAME=VALUE ...] [--synthetic] [--demo]`` (or ``cacheflow bench policies``).

By default it replays every shared trace with keys (the 19 of ``data/traces/``; the Azure files
list no keys) at 1/5/10/20% of each trace's distinct bytes, one tier (host bytes 0). Ours, through
`cacheflow_jax.replay` (the live cache's objects): ``lfu`` (the default), ``lru`` and ``belady``
(the offline optimum). The peers, through the ``libcachesim`` package on the same accesses with
the same byte budgets, in the same run: LRU, ARC, LIRS, S3-FIFO, SIEVE, W-TinyLFU and LFU. Every
policy sees each key with one size, the one replay gives it (its largest ``nbytes`` in the trace):
a cached block has one size. libCacheSim's S3-FIFO needs at least 10 objects (its small queue is
10% of the cache) and its W-TinyLFU at least 5; below that they are reported as n/a.

It writes ``policies.md`` (the summary, then a table per trace), ``policies.json`` and
``mrc_<trace>.png`` (a miss-ratio curve per trace) under ``--out``, and prints the summary:

* the worst and the mean margin of ``lfu`` to the best peer (its miss ratio minus the lowest peer
  miss ratio at that point; negative is better);
* the points where ``lfu`` is at most the best peer, and within .005 of it;
* the worst margin to LRU (libCacheSim's, which equals our ``lru``);
* the mean share of the LRU -> Belady gap that ``lfu`` closes, ``(LRU - lfu) / (LRU - Belady)``,
  over the points where LRU is at least .001 above Belady;
* the five worst points.

``--quick`` (for CI, about a minute on 2 cores) runs the five shortest LIRS traces only.
``--spread`` adds the miss-ratio curve at unit steps around each point (`bench.policy_spread`):
the spread over 9 adjacent capacities and the hits lost by one more block, with the curve of the
worst point plotted.
``--set NAME=VALUE`` overrides a module constant of the default policy in the workers (for
example ``--set HISTORY=4``): the constant sweeps in docs/policies.md were made this way.
``--synthetic`` adds the textbook patterns of `bench.synthetic`; ``--demo`` adds an access log
recorded from ``cacheflow demo`` (it needs JAX and builds the demo's checkpoint once).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from bench import policy_spread
from bench._peers import (  # noqa: F401  (re-exported: other benchmarks import them here)
    DEFAULT,
    GAP_MIN,
    OURS,
    PEER_MIN_SIZE,
    PEERS,
    QUICK,
    cached_trace,
    peer_miss_ratio,
    shared_traces,
    shared_traces_dir,
)
from cacheflow_jax.replay.engine import replay
from cacheflow_jax.trace.reader import parse_size, read_trace


def _apply_settings(settings: dict[str, float]) -> None:
    """Sets the default policy's module constants in this process (``--set``)."""
    module = importlib.import_module(f"cacheflow_jax.policies.{DEFAULT}")
    for name, value in settings.items():
        if not hasattr(module, name):
            raise SystemExit(f"--set {name}: cacheflow_jax.policies.{DEFAULT} has no such constant")
        setattr(module, name, value)


def _job(args: tuple) -> tuple:
    path, who, name, size, settings = args
    _apply_settings(settings)
    trace = cached_trace(path)
    start = time.perf_counter()
    if who == "ours":
        mr = replay(trace, device_bytes=size, host_bytes=0, policy=name)["miss_ratio"]
    else:
        mr = peer_miss_ratio(trace, name, size)
    return path, who, name, size, mr, time.perf_counter() - start


def run(
    traces: list[str], sizes: list[str], *, workers: int, settings: dict | None = None,
    reuse: dict | None = None,
) -> dict:
    """Replays every policy on every trace and size.

    Args:
      traces: trace files.
      sizes: cache sizes (``5%`` or bytes).
      workers: processes.
      settings: module constants of the default policy to set in the workers.
      reuse: a previous run's results; every policy but the default is taken from it when it
        has the same trace and size (they do not depend on the default's constants).

    Returns:
      ``{trace path: {"meta": {...}, "miss_ratio": {size in bytes: {policy: miss ratio}}}}``;
      peers are labelled ``lcs:<name>``.
    """
    jobs, meta = [], {}
    old = {os.path.basename(p): r["miss_ratio"] for p, r in (reuse or {}).items()}
    for path in traces:
        trace = read_trace(path)
        total = trace.distinct_bytes()
        largest = int(trace.nbytes.max())
        byte_sizes = [parse_size(s, total=total, largest=largest, setting="--sizes") for s in sizes]
        meta[path] = {
            "accesses": len(trace),
            "distinct_bytes": total,
            "sizes": dict(zip(sizes, byte_sizes)),
            "compulsory": len(trace.sizes()) / len(trace),
            "timed": trace.timed,
        }
        for size in byte_sizes:
            known = old.get(os.path.basename(path), {}).get(str(size), {})
            jobs += [(path, "ours", name, size, settings or {}) for name in OURS
                     if name == DEFAULT or name not in known]
            jobs += [(path, "peer", name, size, settings or {}) for name in PEERS
                     if f"lcs:{name}" not in known]
    jobs.sort(key=lambda j: -meta[j[0]]["accesses"])  # longest first: the pool ends together
    results: dict = {p: {"meta": meta[p], "miss_ratio": {}} for p in traces}
    for path in traces:
        for size in meta[path]["sizes"].values():
            known = old.get(os.path.basename(path), {}).get(str(size), {})
            results[path]["miss_ratio"][str(size)] = {
                k: v for k, v in known.items() if k != DEFAULT}
    with ProcessPoolExecutor(workers) as ex:
        for path, who, name, size, mr, secs in ex.map(_job, jobs):
            label = name if who == "ours" else f"lcs:{name}"
            results[path]["miss_ratio"].setdefault(str(size), {})[label] = mr
            print(f"{os.path.basename(path)} {label:14s} {size:>12d} "
                  f"{'n/a' if mr is None else f'{mr:.4f}'} ({secs:.1f} s)", file=sys.stderr)
    return results


def points(results: dict) -> list[dict]:
    """One row per (trace, size): ours, the best peer, LRU, Belady and the margins."""
    rows = []
    for path, res in results.items():
        for label, size in res["meta"]["sizes"].items():
            mr = res["miss_ratio"][str(size)]
            peers = {n[4:]: v for n, v in mr.items() if n.startswith("lcs:") and v is not None}
            if not peers:
                continue
            best = min(peers, key=peers.get)
            ours, lru, opt = mr[DEFAULT], peers.get("LRU", mr["lru"]), mr["belady"]
            rows.append({
                "trace": os.path.basename(path), "size": label, "bytes": size,
                "ours": ours, "best_peer": best, "best": peers[best],
                "margin": ours - peers[best], "margin_lru": ours - lru, "lru": lru,
                "belady": opt,
                "gap_closed": (lru - ours) / (lru - opt) if lru - opt >= GAP_MIN else None,
            })
    return rows


def summary(rows: list[dict]) -> dict:
    """The summary the issue asks for, over all points."""
    margins = [r["margin"] for r in rows]
    gaps = [r["gap_closed"] for r in rows if r["gap_closed"] is not None]
    worst = sorted(rows, key=lambda r: -r["margin"])[:5]
    return {
        "points": len(rows),
        "worst_margin_to_best_peer": max(margins),
        "mean_margin_to_best_peer": sum(margins) / len(margins),
        "points_at_or_below_best_peer": sum(m <= 0 for m in margins),
        "points_within_005_of_best_peer": sum(m <= 0.005 for m in margins),
        "worst_margin_to_lru": max(r["margin_lru"] for r in rows),
        "mean_lru_to_belady_gap_closed": sum(gaps) / len(gaps) if gaps else None,
        "worst_five": [
            {k: r[k] for k in ("trace", "size", "ours", "best_peer", "best", "margin")}
            for r in worst
        ],
    }


def format_summary(s: dict) -> str:
    """The summary as a few lines of text (markdown)."""
    lines = [
        f"Summary over {s['points']} points (`{DEFAULT}` against the best libCacheSim peer at each):",
        "",
        f"- worst margin to the best peer: {s['worst_margin_to_best_peer']:+.4f}; "
        f"mean: {s['mean_margin_to_best_peer']:+.5f}",
        f"- points where `{DEFAULT}` <= the best peer: {s['points_at_or_below_best_peer']} of "
        f"{s['points']}; within .005 of it: {s['points_within_005_of_best_peer']}",
        f"- worst margin to LRU: {s['worst_margin_to_lru']:+.4f}",
        "- mean share of the LRU -> Belady gap closed: "
        + ("n/a" if s["mean_lru_to_belady_gap_closed"] is None
           else f"{s['mean_lru_to_belady_gap_closed']:+.3f}"),
        "",
        "Worst five points:",
        "",
        "| trace | size | `lfu` | best peer | margin |",
        "|---|---|---|---|---|",
    ]
    for w in s["worst_five"]:
        lines.append(f"| {w['trace']} | {w['size']} | {w['ours']:.4f} | "
                     f"{w['best']:.4f} ({w['best_peer']}) | {w['margin']:+.4f} |")
    return "\n".join(lines)


def markdown(results: dict, sizes: list[str]) -> str:
    """One table per trace: rows are policies, columns sizes; then best peer and margins."""
    out = []
    for path, res in results.items():
        meta = res["meta"]
        cols = [str(meta["sizes"][s]) for s in sizes]
        mr = res["miss_ratio"]
        names = list(mr[cols[0]])
        out.append(f"### {os.path.basename(path)}\n")
        out.append(
            f"{meta['accesses']} accesses, {meta['distinct_bytes']} distinct bytes, compulsory "
            f"miss ratio {meta['compulsory']:.3f}"
            + ("" if meta["timed"] else ", no timestamps (no TTL)") + ". Miss ratios:\n"
        )
        out.append("| policy | " + " | ".join(sizes) + " |")
        out.append("|---" * (len(sizes) + 1) + "|")
        for name in sorted(names, key=lambda n: (n.startswith("lcs:"), n != DEFAULT, n)):
            cells = ["n/a" if mr[c][name] is None else f"{mr[c][name]:.4f}" for c in cols]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        rows = {r["bytes"]: r for r in points({path: res})}
        out.append("| best peer | " + " | ".join(
            f"{rows[int(c)]['best']:.4f} ({rows[int(c)]['best_peer']})" for c in cols) + " |")
        out.append(f"| {DEFAULT} - best peer | " + " | ".join(
            f"{rows[int(c)]['margin']:+.4f}" for c in cols) + " |")
        out.append("| gap closed (LRU-lfu)/(LRU-Belady) | " + " | ".join(
            "n/a" if rows[int(c)]["gap_closed"] is None else f"{rows[int(c)]['gap_closed']:+.3f}"
            for c in cols) + " |\n")
    return "\n".join(out)


def plot(results: dict, sizes: list[str], out_dir: str) -> list[str]:
    """A miss-ratio-curve PNG per trace; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for path, res in results.items():
        meta = res["meta"]
        cols = [str(meta["sizes"][s]) for s in sizes]
        xs = [float(s.rstrip("%")) if s.endswith("%") else int(c) for s, c in zip(sizes, cols)]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        palette = plt.get_cmap("tab10").colors
        names = sorted(res["miss_ratio"][cols[0]], key=lambda n: (n != DEFAULT, n))
        for i, name in enumerate(names):
            ys = [res["miss_ratio"][c][name] for c in cols]
            if any(y is None for y in ys):
                continue
            if name == DEFAULT:  # the one line to look at
                style = {"color": "black", "linewidth": 2.8, "zorder": 5}
            elif name == "belady":
                style = {"color": "tab:red", "linewidth": 2.0, "linestyle": ":"}
            else:
                style = {"color": palette[i % 10], "linestyle": "--"}
            ax.plot(xs, ys, marker="o", label=name, **style)
        ax.set_xlabel("cache size (% of distinct bytes)" if sizes[0].endswith("%") else "bytes")
        ax.set_ylabel("miss ratio")
        ax.set_title(os.path.basename(path))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        name = "mrc_" + os.path.basename(path).split(".")[0] + ".png"
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=100)
        plt.close(fig)
        files.append(os.path.join(out_dir, name))
    return files


def demo_log(out_dir: str) -> str:
    """Records (once) the access log of ``cacheflow demo``'s cacheflow pass; returns its path."""
    path = os.path.abspath(os.path.join(out_dir, "demo_access.jsonl"))
    if not os.path.exists(path):
        import subprocess

        workdir = os.path.abspath(os.path.join(out_dir, "demo"))
        subprocess.run(
            [sys.executable, "-m", "cacheflow_jax.cli", "demo", "--workdir", workdir,
             "--requests", "300", "--seed", "0", "--access-log", path, "--no-progress"],
            check=True,
        )
    return path


def _settings(pairs: list[str]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {pair!r}: use NAME=VALUE, e.g. --set HISTORY=4")
        out[name] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--traces", nargs="*",
                        help="trace files (default: every shared one; none: only --synthetic)")
    parser.add_argument("--quick", action="store_true", help="the five shortest LIRS traces")
    parser.add_argument("--sizes", default="1%,5%,10%,20%")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="override a constant of the default policy (experiments)")
    parser.add_argument("--synthetic", action="store_true", help="add bench.synthetic's patterns")
    parser.add_argument("--demo", action="store_true", help="add the demo's access log")
    parser.add_argument("--reuse", metavar="JSON",
                        help="take every policy but the default from this earlier policies.json")
    parser.add_argument("--spread", action="store_true",
                        help="also replay lfu, lru, ARC and S3-FIFO at the 9 capacities around "
                             "each point (bench.policy_spread; about 4x the time)")  # fmt: skip
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    os.makedirs(args.out, exist_ok=True)
    if args.traces is not None:
        traces = list(args.traces)
    else:
        traces = shared_traces()
        if args.quick:
            traces = [t for t in traces if os.path.basename(t) in QUICK]
    if args.synthetic:
        from bench.synthetic import write_all

        traces += write_all(os.path.join(args.out, "synthetic"))
    if args.demo:
        traces.append(demo_log(args.out))
    settings = _settings(args.set)
    start = time.perf_counter()
    reuse = None
    if args.reuse:
        with open(args.reuse) as f:
            reuse = json.load(f)["results"]
    results = run(traces, sizes, workers=args.workers, settings=settings, reuse=reuse)
    elapsed = time.perf_counter() - start
    rows = points(results)
    s = summary(rows)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "python -m bench.policies " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (
        f"Policy benchmark, {stamp}, `{command.strip()}`, {elapsed:.0f} s with {args.workers} "
        f"workers (load average {os.getloadavg()[0]:.1f}). Object miss ratios, one tier."
        + (f" Constants set: {settings}." if settings else "") + "\n\n"
    )
    text = header + format_summary(s)
    spread = None
    if args.spread:
        found = policy_spread.run(traces, sizes, workers=args.workers,
                                  policies=[DEFAULT, "lru"], peers=["ARC", "S3FIFO"])  # fmt: skip
        table = policy_spread.rows(found)
        spread = {"summary": policy_spread.summary(table), "rows": table,
                  "plot": policy_spread.plot_worst(found, table, args.out)}  # fmt: skip
        text += "\n\n" + policy_spread.format_summary(spread["summary"])
    text += "\n\n" + markdown(results, sizes)
    with open(os.path.join(args.out, "policies.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "policies.json"), "w") as f:
        json.dump({"summary": s, "points": rows, "results": results, "settings": settings,
                   "elapsed_s": elapsed, "spread": spread}, f, indent=1)
    files = plot(results, sizes, args.out)
    print(header + format_summary(s))
    if spread is not None:
        print("\n" + policy_spread.format_summary(spread["summary"]))
    print(f"\nwrote {os.path.join(args.out, 'policies.md')} and {len(files)} miss-ratio curves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
