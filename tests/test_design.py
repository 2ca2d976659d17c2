"""docs/design.md stays true: its module map against the imports, its replay JSON table against
what replay and stats() return, and its contracts all present."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np
import pytest

import cacheflow_jax as cfj
from cacheflow_jax.cli import main

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = ("cacheflow_jax", "predictor", "pallas_kernels", "training")
PROJECT = (*PACKAGES, "bench", "tests", "examples")


def _section(title: str) -> str:
    text = DESIGN.read_text()
    match = re.search(rf"^##+ {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/design.md has no section {title!r}"
    return match.group(1)


def _table_rows(section: str) -> list[list[str]]:
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:]  # without the header


def _module_map() -> dict[str, list[str]]:
    """row (a package ``x/*`` or a module) -> what it may import; a name followed by
    "(types only)" is kept as "name:types"."""
    out = {}
    for row in _table_rows(_section("Module map")):
        module = row[0].strip("`")
        out[module] = [
            name + (":types" if types else "")
            for name, types in re.findall(r"`([A-Za-z_][\w.]*)`( \(types only\))?", row[2])
        ]
    return out


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """The ids of the import nodes under ``if TYPE_CHECKING:`` (no import at run time)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _module_name(path: Path) -> str:
    return path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".").removesuffix(
        ".__init__"
    )


def _imports(path: Path) -> set[str]:
    """The project modules ``path`` imports, anywhere in the file (absolute names); an import
    made only for type checkers is ``"name:types"``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = _type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import mod` imports pkg.mod when mod is a module.
            names = [node.module] + [
                f"{node.module}.{a.name}" for a in node.names
                if (ROOT / node.module.replace(".", "/") / f"{a.name}.py").is_file()
                or (ROOT / node.module.replace(".", "/") / a.name / "__init__.py").is_file()
            ]  # fmt: skip
        else:
            continue
        suffix = ":types" if id(node) in type_only else ""
        found.update(n + suffix for n in names if n.split(".")[0] in PROJECT)
    return found


def _allowed(name: str, allowed: list[str]) -> bool:
    """Whether import ``name`` (maybe ``"x:types"``) is covered by a "may import" entry."""
    plain, _, types = name.partition(":")
    for entry in allowed:
        module, _, entry_types = entry.partition(":")
        if entry_types and not types:
            continue  # allowed for type checkers only, imported at run time
        if plain == module or plain.startswith(module + "."):
            return True
    return False


def _row_for(path: Path, rows: dict[str, list[str]]) -> str | None:
    """The most specific row for ``path``: the module itself, else its innermost package."""
    rel = path.relative_to(ROOT).as_posix()
    if rel in rows:
        return rel
    parts = rel.split("/")[:-1]
    while parts:
        package = "/".join(parts) + "/*"
        if package in rows:
            return package
        parts.pop()
    return None


def _library_files() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]


def test_module_map_lists_every_module_and_allows_its_imports() -> None:
    rows = _module_map()
    problems = []
    for path in _library_files():
        row = _row_for(path, rows)
        if row is None:
            problems.append(f"{path.relative_to(ROOT)} has no row in the module map")
            continue
        allowed = rows[row]
        own = _module_name(path)
        # A package's modules may import each other (the cycle test below keeps them acyclic).
        home = row.removesuffix("/*").replace("/", ".") if row.endswith("/*") else own
        for name in sorted(_imports(path)):
            plain = name.partition(":")[0]
            if plain in (own, home) or plain.startswith(home + ".") or _allowed(name, allowed):
                continue
            problems.append(f"{path.relative_to(ROOT)} imports {name}, not in its row {row}")
    assert not problems, "docs/design.md's module map is out of date:\n" + "\n".join(problems)


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (at run time, in functions, or for types)."""
    modules = {_module_name(p): p for p in _library_files()}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imp in _imports(path):
            target = imp.partition(":")[0]
            while target and target not in modules:  # `from pkg.mod import name` -> pkg.mod
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_name_is_imported_across_modules() -> None:
    bad = []
    for path in _library_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] not in PROJECT:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.endswith("__"):
                        bad.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_module_map_forbids_what_the_design_forbids() -> None:
    rows = _module_map()
    # The cache sees a predictor only as the protocol's type, and never the training script.
    cache = rows["cacheflow_jax/cache/*"]
    assert [a for a in cache if a.startswith("predictor")] == ["predictor:types"]
    assert not any(a.startswith("training") for a in cache)
    assert _allowed("predictor:types", cache) and not _allowed("predictor", cache)
    assert rows["pallas_kernels/*"] == ["pallas_kernels"]
    assert "training" not in " ".join(rows["cacheflow_jax/cli/*"])
    # Each layer imports only downward: no package imports one listed after it in the table.
    order = [r for r in rows if r.startswith("cacheflow_jax/") and r.endswith("/*")]
    for i, row in enumerate(order):
        later = {o.removesuffix("/*").replace("/", ".") for o in order[i + 1:]}
        assert not [a for a in rows[row] if a.partition(":")[0] in later], row


def test_design_covers_the_contracts() -> None:
    for title in ("Data flow", "Blocks and keys", "Access log v1", "Replay JSON and `stats()`",
                  "Command line", "Metrics", "Module map"):  # fmt: skip
        assert _section(title).strip()
    keys = _section("Blocks and keys")
    assert cfj.block_key("params/layers_3/mlp/kernel", (0, 2)) in keys
    assert cfj.block_key("step", ()) in keys


def _replay_fields() -> list[tuple[str, bool]]:
    return [(row[0].strip("`"), row[1] == "yes")
            for row in _table_rows(_section("Replay JSON and `stats()`"))]  # fmt: skip


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def test_replay_json_and_stats_have_the_documented_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"t": i, "key": f"k{i % 5}", "nbytes": 64, "kind": "kv"} for i in range(40)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["replay", str(trace), "--device-bytes", "128", "--host-bytes", "64", "--json",
                 "--no-progress"]) == 0  # fmt: skip
    replayed = json.loads(capsys.readouterr().out)
    store = cfj.write_store({"w": np.ones((4, 16), np.float32)}, tmp_path / "s", chunk_bytes=64)
    cache = cfj.TieredCache(store, device_bytes=128, host_bytes=64)
    cache.get("w@0,0")
    live = cache.stats()
    fields = _replay_fields()
    assert len(fields) > 20
    for name, in_stats in fields:
        _get(replayed, name)  # KeyError names a documented field replay lacks
        if in_stats:
            _get(live, name)
    documented = {name.split(".")[0] for name, _ in fields}
    assert set(replayed) <= documented, set(replayed) - documented


# ------------------------------------------------------------------------------ references

# Files the benchmarks write under their --out folder (bench/out/ by default).
GENERATED = {"policies.md", "two_tier.md"}


def _tracked_text_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "bench").glob("*.md"))]  # fmt: skip
    for package in PACKAGES:
        files += sorted((ROOT / package).glob("*.py"))
    return files


def test_every_doc_reference_points_inside_the_project() -> None:
    bad = []
    for path in _tracked_text_files():
        text = path.read_text()
        if "DESIGN.md" in text:
            bad.append(f"{path.relative_to(ROOT)} cites DESIGN.md, which is not in the project")
        for ref in re.findall(r"(?<![\w/.:-])((?:\.\./|[\w-]+/)*[\w-]+\.md)\b", text):
            if ref in GENERATED or ref.startswith("bench/out/"):
                continue
            if not ((ROOT / ref).is_file() or (path.parent / ref).resolve().is_file()):
                bad.append(f"{path.relative_to(ROOT)} points to {ref}, which is not in the project")
            elif not (path.parent / ref).resolve().is_relative_to(ROOT) and not (
                ROOT / ref
            ).is_file():
                bad.append(f"{path.relative_to(ROOT)} points outside the project: {ref}")
    assert not bad, "\n".join(bad)


def test_no_module_class_or_function_is_too_long() -> None:
    """The house limits: a module of at most 800 lines, a class of 500, a function of 120."""
    limits = {"module": 800, "class": 500, "function": 120}
    bad = []
    for path in _library_files():
        text = path.read_text()
        rel = path.relative_to(ROOT)
        if text.count("\n") > limits["module"]:
            bad.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                kind = "class"
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                kind = "function"
            else:
                continue
            length = node.end_lineno - node.lineno + 1
            if length > limits[kind]:
                bad.append(f"{rel}:{node.lineno}: {kind} {node.name} has {length} lines")
    assert not bad, "over the limits (800/500/120 lines):\n" + "\n".join(bad)


def test_nothing_reads_the_shared_folder_beside_the_checkout() -> None:
    """A clone with nothing beside it passes its tests: no test, benchmark or library module
    builds a path to ``../shared`` (the traces ship in data/traces)."""
    pattern = re.compile(r"""["']shared["']|\.\./shared|parent\.parent\.parent""")
    bad = []
    for folder in (*PACKAGES, "tests", "bench", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and path.name != "test_design.py":
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "paths outside the project:\n" + "\n".join(bad)
