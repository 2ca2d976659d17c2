"""What every ``cacheflow`` command shares: exit codes, the one-line user error, the argument
types, the input and output checks made before any work starts, and sizes and tables as text.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from cacheflow_jax.core.blocks import parse_bytes

USER_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports `cat` whose reader went away
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


class UserError(Exception):
    """Bad input from the command line; printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) and exit with status 2."""

    def error(self, message: str) -> NoReturn:
        """Prints ``<prog>: error: <message> (see <prog> --help)`` and exits with status 2."""
        self.exit(USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_size(text: str) -> int:
    """Parses a byte size: ``1048576``, ``64MiB``, ``1.5G``, ``500MB`` (K/M/G/T are binary).

    Args:
      text: a non-negative number with an optional unit (B, K/KiB, KB, M/MiB, MB, G/GiB, GB,
        T/TiB, TB; case-insensitive).

    Returns:
      The size in bytes.

    Raises:
      argparse.ArgumentTypeError: ``text`` is not a size.

    >>> parse_size("64MiB"), parse_size("1.5k"), parse_size("10")
    (67108864, 1536, 10)
    """
    try:
        return parse_bytes(text)[0]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_size(text: str) -> int:
    """A byte size above 0 (see `parse_size`)."""
    value = parse_size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size above 0 bytes")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate in (0, 1], e.g. 0.01")
    return value


def human_size(nbytes: int) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def blocks_or_bytes(n: int, unit_size: bool) -> str:
    """A cache size as a person reads it: ``'4392 blocks'`` on a unit-size trace, else bytes."""
    return f"{n} blocks" if unit_size else human_size(n)


def table_lines(cells: list[Sequence[str]], right: set[int]) -> list[str]:
    """Rows of cells as aligned text lines, a rule under the first (the header)."""
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def check_input_file(path: str, *, what: str) -> Path:
    """Checks that ``path`` is an existing regular file (or a device such as /dev/stdin).

    Args:
      path: the file as given on the command line.
      what: what it is, for the message (``"trace"``, ``"access log"``).

    Returns:
      The path.

    Raises:
      UserError: it does not exist or is a directory.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{what} {path} is a directory; give a file")
    if not p.exists():
        raise UserError(f"{what} {path} does not exist")
    return p


def check_store_location(path: str, *, what: str = "store") -> None:
    """Checks, before opening it, that a local ``path`` can hold a store or checkpoint.

    The command line never creates a store, so the library's way out (``create=True``) is no
    answer there: a missing path or an empty directory is said as it is. URLs (``s3://...``)
    are left to the store to check.

    Args:
      path: the store or checkpoint as given on the command line.
      what: what it should be, for the message (``"checkpoint"``).

    Raises:
      UserError: ``path`` does not exist, is a file, or is an empty directory.
    """
    if "://" in path:
        return
    p = Path(path).expanduser()
    hint = "give a store directory (write_store), an orbax checkpoint or a URL"
    if not p.exists():
        raise UserError(f"{what} {path} does not exist; {hint}")
    if not p.is_dir():
        raise UserError(f"{what} {path} is a file, not a directory; {hint}")
    if not any(p.iterdir()):
        raise UserError(f"{what} {path} is an empty directory: there is no {what} in it; {hint}")


def check_output_file(path: str, *, setting: str, suffixes: Sequence[str] = ()) -> Path:
    """Checks, before any work starts, that a file can be written at ``path``.

    Nothing is created: the path must not be a directory, its suffix must be one of
    ``suffixes`` (when given), and it must be writable, or its closest existing parent must be a
    writable directory (missing parents are made when the file is written).

    Args:
      path: the output file as given on the command line.
      setting: the option, for the message (``"--plot"``).
      suffixes: the allowed suffixes, lower case with the dot (``(".png", ".svg")``).

    Returns:
      The path.

    Raises:
      UserError: the file could not be written there (the message says why).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{setting} {path} is a directory; give a file name")
    if suffixes and p.suffix.lower() not in suffixes:
        raise UserError(
            f"{setting} {path}: unknown file type {p.suffix or '(none)'!r}; "
            f"end the name with one of {', '.join(suffixes)}"
        )
    if p.exists():
        if not os.access(p, os.W_OK):
            raise UserError(f"{setting} {path} is not writable")
        return p
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{setting} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{setting} {path}: cannot create files in {parent} (permission denied)")
    return p
