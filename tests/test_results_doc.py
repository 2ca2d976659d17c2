"""The measurement history stays out of the READMEs, and docs/results.md is generated from it.

`bench/results/history.jsonl` holds every recorded run; `python -m bench.results` writes docs/results.md
from it. The README keeps one table of headline numbers, each quoted from a recorded run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import results

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCH_README = ROOT / "bench" / "README.md"
# A dated log line: a calendar date, or a clock time of a run ("23:35 UTC", "05:0x UTC").
DATED = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}:\d[\dx](?:-\d{1,2}:\d\d)? UTC\b")


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no section {title!r}"
    return match[1]


def _rows(section: str) -> list[list[str]]:
    """The body rows of the section's first table, cells split on unescaped pipes."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    assert len(lines) > 2, "the section has no table"
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]


def test_results_doc_is_what_bench_results_writes() -> None:
    expected = results.render(results.load())
    actual = results.DOC.read_text(encoding="utf-8")
    assert actual == expected, "docs/results.md is stale: run python -m bench.results"


def test_check_mode_reports_a_stale_page(tmp_path: Path) -> None:
    doc = tmp_path / "results.md"
    assert results.main(["--doc", str(doc), "--check"]) == 1
    assert results.main(["--doc", str(doc)]) == 0
    assert results.main(["--doc", str(doc), "--check"]) == 0
    doc.write_text(doc.read_text() + "edited by hand\n")
    assert results.main(["--doc", str(doc), "--check"]) == 1


def test_history_records_are_well_formed() -> None:
    records = results.load()
    assert len(records) >= 50
    for record in records:
        assert set(results.REQUIRED) <= set(record)
    # newest first within a benchmark
    text = results.render(records)
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        dates = [row.split(" | ")[0].lstrip("| ") for row in section.splitlines()
                 if re.match(r"\| \d{4}-", row)]  # fmt: skip
        assert dates == sorted(dates, reverse=True), section.splitlines()[0]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ({"date": "2026-12-01"}, "missing fields"),
        ({"date": "1 Dec", "benchmark": "b", "command": "c", "metrics": {"m": "1"},
          "machine": "m", "notes": ""}, "is not YYYY-MM-DD"),
        ({"date": "2026-12-01", "benchmark": "b", "command": "c", "metrics": {"m": 1.5},
          "machine": "m", "notes": ""}, "as recorded"),
        ({"date": "2026-12-01", "benchmark": "b", "command": "c", "metrics": {"m": "1"},
          "machine": "m", "notes": "", "extra": 1}, "unknown fields"),
    ],
)  # fmt: skip
def test_a_bad_record_is_refused_with_its_line(tmp_path: Path, line: dict, problem: str) -> None:
    path = tmp_path / "h.jsonl"
    good = {"date": "2026-12-01", "benchmark": "b", "command": "c", "metrics": {"m": "1"},
            "machine": "m", "notes": ""}  # fmt: skip
    path.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=rf"h\.jsonl:2: .*{problem}"):
        results.load(path)


def test_readme_is_short_and_undated() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines"
    dated = [f"{n}: {line}" for n, line in enumerate(lines, 1) if DATED.search(line)]
    assert not dated, (
        "README.md has dated lines (they go to bench/results/history.jsonl):\n" + "\n".join(dated)
    )


def test_bench_readme_is_undated() -> None:
    lines = BENCH_README.read_text(encoding="utf-8").splitlines()
    dated = [f"{n}: {line}" for n, line in enumerate(lines, 1) if DATED.search(line)]
    assert not dated, "bench/README.md has dated lines:\n" + "\n".join(dated)


def test_readme_set_up_is_the_two_commands_and_ci_runs_the_second() -> None:
    setup = _section(README.read_text(encoding="utf-8"), "Set up (fresh machine, Python >= 3.11)")
    commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert commands == [
        "python -m pip install -e . && cacheflow demo --workdir cacheflow-demo/",
        "python -m pip install -e '.[test]' && python -m pytest -q",
    ]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_every_headline_number_is_a_recorded_one() -> None:
    """Each row of the README's table names a recorded command, and quotes only its numbers."""
    records = results.load()
    by_command: dict[str, list[str]] = {}
    for record in records:
        by_command.setdefault(record["command"], []).append(json.dumps(record))
    rows = _rows(_section(README.read_text(encoding="utf-8"), "Numbers"))
    assert len(rows) >= 10
    for measure, command, result, target in rows:
        quoted = [c for c in re.findall(r"`([^`]+)`", command) if c in by_command]
        assert quoted, f"{measure}: no recorded run has the command {command}"
        recorded = " ".join(text for c in quoted for text in by_command[c])
        for number in re.findall(r"\d[\d,]*\.\d+|\.\d+|\d{1,3}(?:,\d{3})+", result + " " + target):
            assert number in recorded, f"{measure}: {number} is not in a recorded run of {quoted}"
