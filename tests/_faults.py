"""The fault suite's tally: per fault, how many were injected, detected, served wrong or lost.

Tests in ``test_faults.py`` (and ``test_writeback.py``) record what they injected and what came of it; ``conftest.py`` prints
the table at the end of the run (and writes it to ``$CACHEFLOW_FAULT_REPORT`` if set).
"""

from __future__ import annotations

import collections

COLUMNS = ("injected", "detected", "served_wrong", "lost")
RESULTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def record(fault: str, **counts: int) -> None:
    """Adds ``counts`` (keys from COLUMNS) to ``fault``'s row."""
    unknown = set(counts) - set(COLUMNS)
    if unknown:
        raise ValueError(f"unknown columns {sorted(unknown)}; use {COLUMNS}")
    RESULTS[fault].update(counts)


def table() -> str:
    """The tally as a fixed-width table (empty string if nothing was recorded)."""
    if not RESULTS:
        return ""
    width = max(len(f) for f in RESULTS)
    lines = [f"{'fault':<{width}}  " + "  ".join(f"{c:>12}" for c in COLUMNS)]
    for fault in sorted(RESULTS):
        row = RESULTS[fault]
        lines.append(f"{fault:<{width}}  " + "  ".join(f"{row[c]:>12}" for c in COLUMNS))
    total = collections.Counter()
    for row in RESULTS.values():
        total.update(row)
    lines.append(f"{'total':<{width}}  " + "  ".join(f"{total[c]:>12}" for c in COLUMNS))
    return "\n".join(lines)
