"""The source article's three scenarios, measured with peers: ``cacheflow bench scenarios``.

```
python -m bench.scenarios [--quick] [--runs 3] [--only llm,embedding,multimodal] [--json] [--reuse]
                          [--png bench/out/scenarios_cdf.png]
```

Runs `bench.llm_serving`, `bench.embedding_model` and `bench.multimodal` (each in this
process, its own printout sent to stderr, its JSON kept as ``<out>/scenarios_<name>.json``) and
prints the article's table beside ours: for each scenario each way's p50 and p95 latency and
its p95 against the baseline's, from the same runs. The ways, the all-resident limit and the
baseline of a scenario run side by side in every run, and their outputs are checked equal.

| scenario | latency | baseline (why) |
|---|---|---|
| `llm` | time to first token | `recompute`: KV that is not cached is computed again |
| `embedding` | a batch of 64 sequences, ids to vectors | `tensorstore`: rows that are not cached are read from the store on demand |
| `multimodal` | time to first token of a turn (its text vector and image tokens first) | `baseline`: weights and rows read on demand, KV recomputed |

``--quick`` runs each with its ``--quick`` settings (one run; about 6 minutes on 2 cores).
Without it each runs ``--runs`` runs after one warm-up run at its default size (about an hour).
The latency CDFs of every way (all measured runs pooled) go into one PNG.

``--json`` prints ``{"scenarios": [{"name", "outputs_equal", "rows": [{"way", "p50_ms",
"p95_ms"}]}]}``; each row also has ``p95_vs_baseline`` and each scenario its ``baseline`` way,
the article's figures and the target verdicts. The baseline's row is named ``baseline``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench._common import OUT_DIR, Target, format_table, machine, summarize

NAME = "scenarios"
SCENARIOS = {
    # name: (module, baseline way, article baseline p95 ms, article cacheflow p95 ms, label)
    "llm": ("llm_serving", "recompute", 450.0, 280.0,
            "LLM serving, 8k context, 100 concurrent"),
    "embedding": ("embedding_model", "tensorstore", 120.0, 75.0, "embedding model, batch 64"),
    "multimodal": ("multimodal", "baseline", 800.0, 500.0,
                   "multimodal (image + text), 50 concurrent"),
}  # fmt: skip
BOUNDS = {"baseline": 0.62, "all-resident": 1.3}
# Seconds-long sizes for tests (``--tiny``): the numbers mean nothing, the plumbing is checked.
TINY = {
    "llm": ["--requests", "6", "--warm", "10", "--max-blocks", "8"],
    "embedding": ["--batches", "3", "--warm-batches", "2", "--batch", "4", "--seq", "8",
                  "--layers", "1", "--dim", "32"],
    "multimodal": ["--requests", "6", "--warm", "10", "--warm-tables", "3", "--max-blocks", "8"],
}  # fmt: skip


def run_scenario(name: str, *, size: str, runs: int, out: Path) -> dict[str, Any]:
    """Runs one scenario's benchmark (its printout to stderr) and returns its JSON payload.

    ``size`` is ``"full"`` (``runs`` runs at the benchmark's defaults), ``"quick"`` or
    ``"tiny"`` (`TINY`, one run).
    """
    module = importlib.import_module(f"bench.{SCENARIOS[name][0]}")
    folder = out / f"scenarios_{name}"
    argv = ["--out", str(folder)]
    if name != "llm":
        argv += ["--dir", str(folder / "store")]
    if size == "quick":
        argv.append("--quick")
    elif size == "tiny":
        argv += [*TINY[name], "--runs", "1", "--warmup", "0"]
    else:
        argv += ["--runs", str(runs)]
    with contextlib.redirect_stdout(sys.stderr):
        module.main(argv)
    payload = json.loads((folder / f"{module.NAME}.json").read_text())
    (out / f"scenarios_{name}.json").write_text(json.dumps(payload, indent=1, default=str))
    return payload


def per_run(payload: dict[str, Any]) -> list[dict[str, dict[str, Any]]]:
    """Each run's ``{way: {"p50_ms", "p95_ms", "latencies_ms"}}`` (llm_serving's TTFT names)."""
    out = []
    for run in payload["results"]["runs"]:
        out.append({way: {"p50_ms": r.get("p50_ms", r.get("ttft_p50_ms")),
                          "p95_ms": r.get("p95_ms", r.get("ttft_p95_ms")),
                          "latencies_ms": r.get("latencies_ms", r.get("ttft_ms", [])),
                          "outputs": r.get("outputs_sha256", r.get("tokens_sha256"))}
                    for way, r in run.items()})  # fmt: skip
    return out


def summarize_scenario(name: str, payload: dict[str, Any]) -> dict[str, Any]:
    """One scenario's entry of the JSON: rows per way, ratios per run, targets."""
    _, baseline, art_base, art_cf, label = SCENARIOS[name]
    runs = per_run(payload)
    ways = list(runs[0])
    equal = all(len({r[w]["outputs"] for w in ways}) == 1 for r in runs)
    listed = list(payload["results"].get("summary", ways))  # the benchmark's own order
    ordered = sorted(
        ways,
        key=lambda w: (
            w != baseline,
            w == "all-resident",
            w == "cacheflow",
            listed.index(w) if w in listed else len(listed),
        ),
    )
    rows, verdicts = [], []
    for way in ordered:
        ratio = [r[way]["p95_ms"] / r[baseline]["p95_ms"] for r in runs]
        rows.append({"way": "baseline" if way == baseline else way,
                     "p50_ms": statistics.median(r[way]["p50_ms"] for r in runs),
                     "p95_ms": statistics.median(r[way]["p95_ms"] for r in runs),
                     "p95_vs_baseline": statistics.median(ratio)})  # fmt: skip
        if "cacheflow" in ways and way != "cacheflow":
            cf = summarize([r["cacheflow"]["p95_ms"] / r[way]["p95_ms"] for r in runs],
                           better="low")  # fmt: skip
            bound = BOUNDS.get("baseline" if way == baseline else way, 1.0)
            verdicts.append(Target(f"cacheflow / {way} (p95)", "<=", bound).verdict(cf))
    return {
        "name": name, "label": label, "outputs_equal": equal, "baseline": baseline,
        "runs": len(runs), "rows": rows,
        "article": {"baseline_p95_ms": art_base, "cacheflow_p95_ms": art_cf,
                    "cut": 1 - art_cf / art_base},
        "targets": verdicts, "settings": payload.get("settings", {}),
        "latencies_ms": {w: [x for r in runs for x in r[w]["latencies_ms"]] for w in ordered},
    }  # fmt: skip


def headline(entries: list[dict[str, Any]]) -> str:
    """The article's table beside ours."""
    rows = []
    for e in entries:
        by = {r["way"]: r for r in e["rows"]}
        a = e["article"]
        ours = "-"
        if "cacheflow" in by:
            cut = 1 - by["cacheflow"]["p95_vs_baseline"]
            ours = f"{by['baseline']['p95_ms']:.1f} -> {by['cacheflow']['p95_ms']:.1f} ({cut:.1%})"
        rows.append([e["label"], f"{a['baseline_p95_ms']:.0f} -> {a['cacheflow_p95_ms']:.0f} "
                     f"({a['cut']:.1%})", ours, str(e["outputs_equal"])])  # fmt: skip
    return format_table(["scenario", "article p95 ms (cut)", "ours p95 ms (cut, median of runs)",
                         "outputs equal"], rows)  # fmt: skip


def text(entries: list[dict[str, Any]], png: Path | None) -> str:
    """The readable report: the headline table, then each scenario's ways and targets."""
    m = machine()
    lines = ["== the source article's three scenarios, measured with peers ==",
             f"{m['date']}  {m['summary']}", "", headline(entries)]  # fmt: skip
    for e in entries:
        rows = [[r["way"], f"{r['p50_ms']:.1f}", f"{r['p95_ms']:.1f}",
                 f"{r['p95_vs_baseline']:.2f}x", f"{1 - r['p95_vs_baseline']:.1%}"]
                for r in e["rows"]]  # fmt: skip
        lines += [
            "",
            f"{e['label']} ({e['name']}, baseline {e['baseline']}, {e['runs']} runs)",
            format_table(["way", "p50 ms", "p95 ms", "p95 / baseline", "p95 cut"], rows),
        ]
        lines += [Target.line(v) for v in e["targets"]]
    lines += ["", "absolute times are CPU-only; compare ratios within one run"]
    if png is not None:
        lines.append(f"latency CDFs: {png}")
    return "\n".join(lines)


def plot(entries: list[dict[str, Any]], path: Path) -> None:
    """Each scenario's latency CDFs (one line per way) as panels of one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fixed = {"baseline": "black", "cacheflow": "tab:red", "all-resident": "tab:purple"}
    others = iter(["tab:blue", "tab:orange", "tab:green", "tab:olive", "tab:cyan", "tab:brown"])
    colors: dict[str, str] = {}
    fig, axes = plt.subplots(1, len(entries), figsize=(5.5 * len(entries), 4.2), squeeze=False)
    for ax, e in zip(axes[0], entries):
        for way, lat in e["latencies_ms"].items():
            if not lat:
                continue
            xs = np.sort(np.asarray(lat))
            key = "baseline" if way == e["baseline"] else way
            color = fixed.get(key) or colors.setdefault(key, next(others, "tab:gray"))
            label = f"{way} (baseline)" if way == e["baseline"] else way
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label, color=color)
        ax.set_xscale("log")
        ax.axhline(0.95, color="grey", lw=0.6, ls=":")
        ax.set_title(e["label"], fontsize=9)
        ax.set_xlabel("latency, ms (CPU)")
        ax.set_ylabel("share of requests")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m bench.scenarios", description=__doc__.split("\n")[0]
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--quick", action="store_true", help="each benchmark's --quick (1 run)")
    p.add_argument("--tiny", action="store_true",
                   help="seconds-long sizes for tests (meaningless numbers)")  # fmt: skip
    p.add_argument("--runs", type=int, default=3, help="measured runs per scenario (default 3)")
    p.add_argument("--only", default=",".join(SCENARIOS),
                   help=f"scenarios to run (default {','.join(SCENARIOS)})")  # fmt: skip
    p.add_argument("--out", type=Path, default=OUT_DIR, help=f"folder for results ({OUT_DIR})")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="report the runs saved in --out (<out>/scenarios_<name>.json) again",
    )
    p.add_argument("--png", type=Path, default=None,
                   help="latency CDFs (default <out>/scenarios_cdf.png)")  # fmt: skip
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        p.error(f"--only: unknown scenario {unknown}; choose from {', '.join(SCENARIOS)}")
    if args.runs < 1:
        p.error(f"--runs={args.runs} must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    entries = []
    for name in names:
        print(f"scenario {name} ...", file=sys.stderr, flush=True)
        size = "tiny" if args.tiny else "quick" if args.quick else "full"
        saved = args.out / f"scenarios_{name}.json"
        if args.reuse and not saved.is_file():
            p.error(f"--reuse: no {saved}; run the scenarios with --out {args.out} first")
        payload = (json.loads(saved.read_text()) if args.reuse
                   else run_scenario(name, size=size, runs=args.runs, out=args.out))  # fmt: skip
        entries.append(summarize_scenario(name, payload))
    png = args.png or args.out / "scenarios_cdf.png"
    plot(entries, png)
    doc = {"scenarios": [{k: v for k, v in e.items() if k != "latencies_ms"} for e in entries],
           "machine": machine(), "quick": args.quick, "tiny": args.tiny, "png": str(png)}  # fmt: skip
    (args.out / "scenarios.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps(doc, indent=1, default=str) if args.json else text(entries, png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
