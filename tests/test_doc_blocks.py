"""Every code block of README.md and docs/*.md runs as written (issue 30's "docs that are tested").

Each document runs in a fresh folder, top to bottom: its ``python`` blocks in one namespace (as a
reader pastes them into one session), its ``bash`` blocks as shell commands in the same folder.
The folder holds one real checkpoint a document may name without saving it, ``ckpt/``: a
list-shaped pytree saved by orbax's ``CheckpointManager`` (steps 1 and 2), whose ``embed`` leaf
(4.9 MB) is larger than the default 4 MiB block. docs/orbax.md saves its own Flax NNX model with
``CheckpointManager`` (the Flax guide's way, with the ``value`` level) in its first block.

A block without a language (or ``text``) is output or a diagram and is not run. A python block
whose fence follows ``<!-- doc-test: warns -->`` must log a warning through the
``cacheflow_jax`` logger (it shows one); any other python block must log none. The few shell
commands that cannot run inside the test suite are listed in `NOT_RUN`, each with where it is
exercised instead; an entry that matches no command fails the suite.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
_DIRECTIVE = re.compile(r"<!--\s*doc-test:\s*([\w-]+)\s*-->\s*$")
RUN = ("python", "bash")
_OPERATORS = {"&&", "||", "|", ";", ">", ">>", "<", "2>&1"}
TEXT = ("", "text")

# Shell commands the suite cannot run, by prefix, with where they are exercised instead.
NOT_RUN = {
    "python -m pip install -e . && cacheflow demo": (
        "installs the package and runs the full-size demo (about 45 s, 600 MB); "
        "tests/test_cli.py::test_demo_end_to_end_small runs the demo end to end, smaller"
    ),
    "python -m pip install -e '.[test]' && python -m pytest -q": (
        "CI's own command: .ci/run runs exactly this (checked below), and this test is part of it"
    ),
    "python -m pip install -e '.[docs]'": "an install; the test extra brings pdoc already",
    "python docs/build_api.py build/api": "tests/test_docs.py builds the API reference",
}


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a document."""

    doc: Path
    line: int  # the fence's line, 1-based
    lang: str
    code: str
    directive: str | None  # from a ``<!-- doc-test: ... -->`` line just above the fence

    @property
    def where(self) -> str:
        doc = self.doc.relative_to(ROOT) if self.doc.is_relative_to(ROOT) else self.doc
        return f"{doc}:{self.line}"


def blocks_of(doc: Path) -> list[Block]:
    """The fenced code blocks of ``doc``, in order."""
    text = doc.read_text(encoding="utf-8")
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        directive = _DIRECTIVE.search(before)
        out.append(
            Block(
                doc=doc,
                line=text.count("\n", 0, m.start()) + 1,
                lang=m.group(1).strip(),
                code=m.group(2),
                directive=directive.group(1) if directive else None,
            )
        )
    return out


def commands_of(block: Block) -> list[str]:
    """The shell commands of a bash block: continuation lines joined, comments dropped."""
    joined = block.code.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(" ".join(w if w in _OPERATORS else shlex.quote(w) for w in words))
    return out


def _not_run(command: str) -> str | None:
    for prefix, reason in NOT_RUN.items():
        if " ".join(shlex.split(command)).startswith(" ".join(shlex.split(prefix))):
            return reason
    return None


# --------------------------------------------------------------------------- the checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ckpt/``: a list-shaped pytree saved by a CheckpointManager at steps 1 and 2."""
    import orbax.checkpoint as ocp

    root = tmp_path_factory.mktemp("doc-checkpoint") / "ckpt"
    rng = np.random.default_rng(0)
    tree = {
        "embed": rng.standard_normal((5000, 256)).astype(np.float32),  # 2 blocks of <= 4 MiB
        "layers": [
            {"w": (rng.standard_normal((256, 256)) / 16).astype(np.float32)} for _ in range(4)
        ],
    }
    with ocp.CheckpointManager(root) as manager:
        manager.save(1, args=ocp.args.StandardSave(tree))
        manager.save(2, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    return root


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def run_document(doc: Path, work: Path) -> list[str]:
    """Runs every block of ``doc`` in ``work`` (the current folder); returns what was not run.

    Raises:
      AssertionError: a block failed, naming the document and line.
    """
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    namespace: dict[str, Any] = {"__name__": "__doc_test__"}
    log = logging.getLogger("cacheflow_jax")
    skipped: list[str] = []
    try:
        _run_blocks(doc, work, env, namespace, log, skipped)
    finally:
        # The document's functions may stay in JAX's jit caches, and their globals are this
        # namespace: emptied, it keeps no array of the document alive for later tests.
        namespace.clear()
    return skipped


def _run_blocks(
    doc: Path, work: Path, env: dict[str, str], namespace: dict[str, Any],
    log: logging.Logger, skipped: list[str],
) -> None:  # fmt: skip
    for block in blocks_of(doc):
        if block.lang == "python":
            handler = _Records()
            log.addHandler(handler)
            try:
                exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102
            except BaseException as err:
                raise AssertionError(f"{block.where}: {type(err).__name__}: {err}") from err
            finally:
                log.removeHandler(handler)
            said = [r.getMessage() for r in handler.records]
            if block.directive == "warns":
                assert said, f"{block.where} is marked to warn, and logged no warning"
            else:
                assert not said, f"{block.where} logged warnings: {said}"
        elif block.lang == "bash":
            for command in commands_of(block):
                reason = _not_run(command)
                if reason is not None:
                    skipped.append(f"{block.where}: {command} ({reason})")
                    continue
                done = subprocess.run(
                    command, shell=True, cwd=work, env=env, capture_output=True, text=True,
                    timeout=300, check=False,
                )  # fmt: skip
                assert done.returncode == 0, (
                    f"{block.where}: `{command}` exited with {done.returncode}: "
                    f"{done.stderr[-2000:]}"
                )


# -------------------------------------------------------------------------------- the tests


def test_every_code_block_is_python_bash_or_output() -> None:
    for doc in DOCS:
        for block in blocks_of(doc):
            assert block.lang in RUN + TEXT, (
                f"{block.where}: a ```{block.lang} block; use python or bash for code that runs "
                "(tests/test_doc_blocks.py runs it) and no language for output"
            )
            if block.lang in TEXT:
                first = block.code.lstrip().split("\n", 1)[0]
                assert not first.startswith(("import ", "from ", ">>>")), (
                    f"{block.where}: Python code in a block without a language is never run; "
                    "mark it ```python"
                )


def test_what_is_not_run_is_listed_and_run_elsewhere() -> None:
    commands = [c for d in DOCS for b in blocks_of(d) if b.lang == "bash" for c in commands_of(b)]
    for prefix in NOT_RUN:
        assert any(_not_run(c) == NOT_RUN[prefix] for c in commands), (
            f"NOT_RUN lists {prefix!r}, which no document shows any more: remove it"
        )
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pip install -e '.[test]' && python -m pytest -q" in ci


RUNNABLE = [d for d in DOCS if any(b.lang in RUN for b in blocks_of(d))]


@pytest.mark.parametrize(
    "doc",
    RUNNABLE,
    ids=[str(d.relative_to(ROOT)) for d in RUNNABLE],
)  # fmt: skip
def test_the_blocks_run_as_written(
    doc: Path, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(checkpoint, work / "ckpt")
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))  # runtime blocks go here
    skipped = run_document(doc, work)
    for line in skipped:
        print(f"not run: {line}")
