"""Access log v1: one JSON object per access, written in batches off the hit path.

Format (docs/design.md): ``{"t": 12.034, "key": "...", "nbytes": 8388608, "kind": "weight",
"req": "r17"}``; ``t`` in seconds since the log was opened, non-decreasing; ``kind`` one of
``weight``, ``embedding``, ``kv``, ``other``; ``req`` optional.

The recording side only appends a tuple to a deque (atomic under the GIL, no lock, no I/O). A
background thread formats and writes batches; ``close`` drains everything, so the file is complete
and valid after the session ends, even when the body raised.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Callable

FORMAT_VERSION = 1
_FLUSH_SECONDS = 0.2


class AccessLogWriter:
    """Writes access log v1 records to a JSON Lines file in batches.

    Args:
      path: the file to write (created or truncated; parent directories are created).
      describe: ``describe(key) -> (nbytes, kind)``, called off the hit path by the writer.
      clock: seconds, monotonic.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        describe: Callable[[str], tuple[int, str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._describe = describe
        self._clock = clock
        self._t0 = clock()
        self._last_t = 0.0
        self._pending: collections.deque[tuple[float, str, str | None]] = collections.deque()
        self._wake = threading.Event()
        self._closed = False
        self._error: BaseException | None = None
        self.records = 0
        self._thread = threading.Thread(target=self._run, name="cacheflow-access-log", daemon=True)
        self._thread.start()

    def record(self, key: str, req: str | None = None) -> None:
        """Records one access now. Cheap: no I/O, no lock."""
        self._pending.append((self._clock(), key, req))

    def record_many(self, keys: list[str], req: str | None = None) -> None:
        """Records several accesses at the same instant."""
        t = self._clock()
        self._pending.extend((t, k, req) for k in keys)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(_FLUSH_SECONDS)
            self._wake.clear()
            try:
                self._write_pending()
            except BaseException as e:  # reported by close()
                self._error = e
                return

    def _write_pending(self) -> None:
        lines = []
        pending = self._pending
        while pending:
            try:
                t, key, req = pending.popleft()
            except IndexError:
                break
            # Threads record concurrently; clamp so ``t`` never decreases in the file.
            t = max(round(t - self._t0, 6), self._last_t)
            self._last_t = t
            nbytes, kind = self._describe(key)
            row = {"t": t, "key": key, "nbytes": nbytes, "kind": kind}
            if req is not None:
                row["req"] = req
            lines.append(json.dumps(row, separators=(", ", ": ")))
        if lines:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
            self.records += len(lines)

    def close(self) -> None:
        """Writes everything recorded so far and closes the file. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join()
        try:
            if self._error is None:
                self._write_pending()
        finally:
            self._file.close()
        if self._error is not None:
            raise OSError(f"could not write access log {self.path}: {self._error}") from self._error
