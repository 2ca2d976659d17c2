"""``cacheflow train``: the offline training script, ``python -m training.main``."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def run_train(argv: Sequence[str]) -> int:
    """``cacheflow train ...`` runs ``python -m training.main ...``: the offline training script.

    The library never imports ``training/`` (docs/design.md: dependencies point one way), so the
    command hands its arguments to the script in a child process and returns its exit status.
    """
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "training.main", *argv])
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C reaches the whole process group, so the script has it too and reports it
            # (one line, status 130). Waiting for it, rather than raising here, keeps a second
            # report (and `subprocess.call`'s kill mid-write) away.
            continue
