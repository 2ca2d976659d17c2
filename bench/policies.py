"""Policy benchmark: miss-ratio curves of our policies, libCacheSim's peers and Belady.

Run: ``python -m bench.policies [--traces PATH ...] [--sizes 1%,5%,10%,20%] [--out bench/out]``

Besides the shared traces it replays an access log recorded from ``cacheflow demo`` (weights of a
mixture-of-experts model, 1 MiB expert blocks); the log is recorded once into
``<out>/demo_access.jsonl`` (``--no-demo`` skips it). ``--synthetic`` adds the textbook patterns
of `bench.synthetic` (Zipf, moving hot sets, scans over a hot set, a loop, pure recency).

For every trace it replays our policies through `cacheflow_jax.replay` (the live cache's objects)
and the `libcachesim` package's LRU, ARC, LIRS, S3-FIFO, SIEVE, W-TinyLFU and LFU on the same
accesses with the same byte budgets, in one run. Every policy sees each key with one size, the
one replay gives it (its largest ``nbytes`` in the trace, `Trace.sizes`): a cached block has one
size. (libCacheSim on its own keeps the size of the access that inserted an object, so where a
trace's sizes vary per key, as in cloudPhysicsIO, its numbers differ; with the same sizes its LRU
equals ours exactly.) It writes
``policies.md`` (a table per trace), ``policies.json`` and ``mrc_<trace>.png`` under ``--out``.
The "gap closed" column is ``(LRU - ours) / (LRU - Belady)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from cacheflow_jax._replay import replay
from cacheflow_jax._trace import parse_size, read_trace

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces")
DEFAULT_TRACES = [
    os.path.join(SHARED, "mooncake_synthetic_trace.jsonl"),
    os.path.join(SHARED, "cloudPhysicsIO.csv.gz"),
]
OURS = ["lfu", "lru", "lfu-plain"]
PEERS = ["LRU", "ARC", "LIRS", "S3FIFO", "Sieve", "WTinyLFU", "LFU"]


def peer_miss_ratio(trace, name: str, size: int) -> float:
    """The request miss ratio of a libCacheSim policy on ``trace`` with ``size`` bytes."""
    import libcachesim as lcs

    cache = getattr(lcs, name)(cache_size=size)
    ids: dict[str, int] = {}
    sizes = trace.sizes()
    misses = 0
    get = cache.get
    request = lcs.Request
    for i, key in enumerate(trace.keys):
        obj = ids.setdefault(key, len(ids))
        if not get(request(obj_id=obj, obj_size=sizes[key], clock_time=i)):
            misses += 1
    return misses / len(trace.keys)


_TRACE = None


def _load(path: str):
    global _TRACE
    if _TRACE is None or _TRACE.path != path:
        _TRACE = read_trace(path)
    return _TRACE


def _job(args: tuple) -> tuple:
    path, who, name, size = args
    trace = _load(path)
    start = time.perf_counter()
    if who == "ours":
        mr = replay(trace, device_bytes=size, host_bytes=0, policy=name)["miss_ratio"]
    else:
        mr = peer_miss_ratio(trace, name, size)
    return path, who, name, size, mr, time.perf_counter() - start


def run(traces: list[str], sizes: list[str], *, workers: int) -> dict:
    """Runs every policy on every trace and size; returns {trace: {size: {policy: miss ratio}}}."""
    jobs = []
    meta = {}
    for path in traces:
        trace = read_trace(path)
        total = trace.distinct_bytes()
        largest = int(trace.nbytes.max())
        byte_sizes = [parse_size(s, total=total, largest=largest, setting="--sizes") for s in sizes]
        meta[path] = {
            "accesses": len(trace),
            "distinct_bytes": total,
            "sizes": dict(zip(sizes, byte_sizes)),
            "compulsory": len(set(trace.keys)) / len(trace),
        }
        for size in byte_sizes:
            for name in [*OURS, "belady"]:
                jobs.append((path, "ours", name, size))
            for name in PEERS:
                jobs.append((path, "peer", name, size))
    results: dict = {p: {"meta": meta[p], "miss_ratio": {}} for p in traces}
    with ProcessPoolExecutor(workers) as ex:
        for path, who, name, size, mr, secs in ex.map(_job, jobs):
            label = name if who == "ours" else f"lcs:{name}"
            results[path]["miss_ratio"].setdefault(str(size), {})[label] = mr
            print(
                f"{os.path.basename(path)} {label:14s} {size:>12d} {mr:.4f} ({secs:.1f} s)",
                file=sys.stderr,
            )
    return results


def markdown(results: dict, sizes: list[str]) -> str:
    """One table per trace: rows are policies, columns sizes; plus best peer and gap closed."""
    out = []
    for path, res in results.items():
        meta = res["meta"]
        cols = [str(meta["sizes"][s]) for s in sizes]
        mr = res["miss_ratio"]
        names = list(mr[cols[0]])
        out.append(f"### {os.path.basename(path)}\n")
        out.append(
            f"{meta['accesses']} accesses, {meta['distinct_bytes']} distinct bytes, "
            f"compulsory miss ratio {meta['compulsory']:.3f}. Miss ratios:\n"
        )
        out.append("| policy | " + " | ".join(sizes) + " |")
        out.append("|---" * (len(sizes) + 1) + "|")
        for name in sorted(names, key=lambda n: (n.startswith("lcs:"), n)):
            out.append(f"| {name} | " + " | ".join(f"{mr[c][name]:.4f}" for c in cols) + " |")
        best = []
        gap = []
        for c in cols:
            peers = {n: v for n, v in mr[c].items() if n.startswith("lcs:")}
            b = min(peers, key=peers.get)
            best.append(f"{peers[b]:.4f} ({b[4:]})")
            lru, ours, opt = mr[c]["lcs:LRU"], mr[c]["lfu"], mr[c]["belady"]
            # n/a where LRU is already within 0.001 of the optimum: the ratio would be noise.
            gap.append(f"{(lru - ours) / (lru - opt):+.3f}" if lru - opt >= 0.001 else "n/a")
        out.append("| best peer | " + " | ".join(best) + " |")
        out.append(
            "| lfu - best peer | "
            + " | ".join(
                f"{mr[c]['lfu'] - min(v for n, v in mr[c].items() if n.startswith('lcs:')):+.4f}"
                for c in cols
            )
            + " |"
        )
        out.append("| gap closed (LRU-lfu)/(LRU-Belady) | " + " | ".join(gap) + " |\n")
    return "\n".join(out)


def plot(results: dict, sizes: list[str], out_dir: str) -> list[str]:
    """A miss-ratio-curve PNG per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for path, res in results.items():
        meta = res["meta"]
        cols = [str(meta["sizes"][s]) for s in sizes]
        xs = [float(s.rstrip("%")) if s.endswith("%") else int(c) for s, c in zip(sizes, cols)]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        palette = plt.get_cmap("tab20").colors
        for i, name in enumerate(res["miss_ratio"][cols[0]]):
            ys = [res["miss_ratio"][c][name] for c in cols]
            if name == "lfu":  # ours, the default: the one line to look at
                style = {"color": "black", "linewidth": 2.8, "zorder": 5}
            elif name == "belady":
                style = {"color": "tab:red", "linewidth": 2.0, "linestyle": ":"}
            else:
                style = {"color": palette[(2 * i) % 20 + (i // 10) % 2], "linestyle": "--"}
            ax.plot(xs, ys, marker="o", label=name, **style)
        ax.set_xlabel("cache size (% of distinct bytes)" if sizes[0].endswith("%") else "bytes")
        ax.set_ylabel("miss ratio")
        ax.set_title(os.path.basename(path))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        name = "mrc_" + os.path.basename(path).split(".")[0] + ".png"
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=110)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--traces", nargs="+", default=DEFAULT_TRACES)
    parser.add_argument("--sizes", default="1%,5%,10%,20%")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-demo", action="store_true", help="skip the demo's access log")
    parser.add_argument(
        "--synthetic", action="store_true",
        help="also replay bench.synthetic's patterns (zipf, phases, scan_hot, loop, recency)",
    )
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    os.makedirs(args.out, exist_ok=True)
    traces = list(args.traces)
    if not args.no_demo:
        traces.append(demo_log(args.out))
    if args.synthetic:
        from bench.synthetic import write_all

        traces += write_all(os.path.join(args.out, "synthetic"))
    results = run(traces, sizes, workers=args.workers)
    table = markdown(results, sizes)
    stamp = time.strftime("%Y-%m-%d")
    header = (
        f"Policy benchmark, {stamp}, `python -m bench.policies --sizes {args.sizes}`. "
        "Object miss ratios, single tier (host bytes 0).\n\n"
    )
    with open(os.path.join(args.out, "policies.md"), "w") as f:
        f.write(header + table)
    with open(os.path.join(args.out, "policies.json"), "w") as f:
        json.dump(results, f, indent=1)
    files = plot(results, sizes, args.out)
    print(header + table)
    print("wrote", ", ".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
