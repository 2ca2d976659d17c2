"""The demo's results: a row per pass, the table of them, and the step-latency CDF."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from cacheflow_jax.cli.demo_passes import PassResult

COLUMNS = (
    ("name", "name"),
    ("l1_hit_ratio", "L1 hit"),
    ("l3_share", "to L3"),
    ("prefetch_accuracy", "pf acc"),
    ("prefetch_coverage", "pf cov"),
    ("p50_ms", "p50 ms"),
    ("p95_ms", "p95 ms"),
    ("p95_ratio_to_baseline", "p95/base"),
    ("p95_ratio_to_resident", "p95/resident"),
)


# What each column of the table means, printed under it.
LEGEND = (
    "L1 hit: share of block requests served from device memory (L1); to L3: share read from "
    "the checkpoint (L3), the rest came from host memory (L2); pf acc: prefetched blocks used "
    "/ issued; pf cov: share of the would-be L3 reads that prefetch turned into hits ('-': no "
    "prefetcher); p50/p95 ms: step latency; p95/base, p95/resident: p95 against the baseline's "
    "and the all-resident limit's"
)


def result_row(
    name: str, latencies: Sequence[float], stats: dict | None = None, *, resident: bool = False
) -> dict:
    """One result row; the p95 ratios are filled in once every pass ran.

    ``stats`` (a cache's, counted over the measured steps) gives the hit ratios and prefetch
    figures; without it the row is the baseline (nothing on the device before a step) or, with
    ``resident``, the all-resident limit.
    """
    ms = np.asarray(latencies) * 1e3
    if stats is None:
        l1, host, l3 = (1.0, 0.0, 0.0) if resident else (0.0, 0.0, 1.0)
        accuracy = coverage = 0.0
        prefetch = None
    else:
        n = max(stats["requests"], 1)
        l1, host, l3 = stats["hits"]["device"] / n, stats["hits"]["host"] / n, stats["misses"] / n
        prefetch = stats["prefetch"]
        accuracy, coverage = prefetch["accuracy"], prefetch["coverage"]
    row = {
        "name": name,
        "l1_hit_ratio": round(float(l1), 4),
        "host_hit_ratio": round(float(host), 4),
        "l3_share": round(float(l3), 4),
        "prefetch_accuracy": round(float(accuracy), 4),
        "prefetch_coverage": round(float(coverage), 4),
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "p95_ratio_to_baseline": 1.0,
        "p95_ratio_to_resident": 1.0,
        "mean_ms": float(ms.mean()),
        "steps": len(ms),
    }
    if prefetch is not None:
        row["prefetch"] = prefetch
    return row


def plot_cdf(results: dict[str, PassResult], path: Path, *, title: str) -> None:
    """Saves the step-latency CDF of every pass to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, result in results.items():
        ms = np.sort(np.asarray(result.latencies) * 1e3)
        ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=name)
    ax.set_xscale("log")
    # Labelled ticks at 1, 2, 3 and 5 of each decade: the steps often span less than one decade
    # (15 to 80 ms), where decade ticks alone would leave the axis without a number.
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.LogLocator(base=10, subs="auto"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("step latency (ms, log scale)")
    ax.set_ylabel("fraction of steps")
    ax.axhline(0.95, color="grey", lw=0.5, ls=":")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(rows: Sequence[dict]) -> str:
    """The rows as a plain-text table with the `COLUMNS`."""
    cells = [[title for _, title in COLUMNS]]
    for row in rows:
        cells.append(
            [row["name"]]
            + [f"{row[c]:.3f}" for c in ("l1_hit_ratio", "l3_share")]
            + [
                f"{row[c]:.3f}" if row.get("prefetch", {}).get("issued") else "-"
                for c in ("prefetch_accuracy", "prefetch_coverage")
            ]
            + [f"{row[c]:.2f}" for c in ("p50_ms", "p95_ms")]
            + [f"{row[c]:.2f}x" for c in ("p95_ratio_to_baseline", "p95_ratio_to_resident")]
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
