"""Access log v1: one JSON object per access, written in batches off the hit path.

Format (docs/design.md): ``{"t": 12.034, "key": "...", "nbytes": 8388608, "kind": "weight",
"req": "r17"}``; ``t`` in seconds since the log was opened, non-decreasing; ``kind`` one of
``weight``, ``embedding``, ``kv``, ``other``; ``req`` optional.

The recording side only appends a tuple to a deque (atomic under the GIL, no lock, no I/O). A
background thread formats and writes batches; ``close`` drains everything, so the file is complete
and valid after the session ends, even when the body raised.

Failures never stop the log and never let it grow without bound:

* a record that cannot be described (its key vanished) is skipped and counted;
* a batch that cannot be written (a full disk) is counted as lost, and writing goes on;
* records beyond ``max_pending`` waiting for the writer are dropped and counted.

``close`` warns once about skipped and dropped records and raises ``OSError`` if any were lost
to write errors, so an incomplete log is never mistaken for a complete one.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
import warnings
from collections.abc import Callable

FORMAT_VERSION = 1
_FLUSH_SECONDS = 0.2
# Records waiting for the writer thread, at most (about 100 bytes each): the writer keeps up
# with hundreds of thousands of records a second, so only a stuck writer reaches it.
MAX_PENDING = 1 << 20


class AccessLogWriter:
    """Writes access log v1 records to a JSON Lines file in batches.

    Args:
      path: the file to write (created or truncated; parent directories are created).
      describe: ``describe(key) -> (nbytes, kind)``, called off the hit path by the writer.
      clock: seconds, monotonic.
      max_pending: records that may wait for the writer; more are dropped and counted.

    Attributes:
      records: records written.
      skipped: records whose key could not be described (not written).
      dropped: records dropped because ``max_pending`` were already waiting.
      lost: records in batches that could not be written (for example a full disk).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        describe: Callable[[str], tuple[int, str]],
        clock: Callable[[], float] = time.monotonic,
        max_pending: int = MAX_PENDING,
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
        self._max_pending = max_pending
        self._drop_lock = threading.Lock()
        self._first_skip: tuple[str, BaseException] | None = None
        self._write_error: BaseException | None = None
        self.records = 0
        self.skipped = 0
        self.dropped = 0
        self.lost = 0
        self._thread = threading.Thread(target=self._run, name="cacheflow-access-log", daemon=True)
        self._thread.start()

    def record(self, key: str, req: str | None = None) -> None:
        """Records one access now. Cheap: no I/O, no lock (but when records are dropped)."""
        pending = self._pending
        if len(pending) >= self._max_pending:
            self._drop(1)
            return
        pending.append((self._clock(), key, req))

    def record_many(self, keys: list[str], req: str | None = None) -> None:
        """Records several accesses at the same instant."""
        pending = self._pending
        room = self._max_pending - len(pending)
        if room < len(keys):
            self._drop(len(keys) - max(room, 0))
            keys = keys[: max(room, 0)]
        t = self._clock()
        pending.extend((t, k, req) for k in keys)

    def _drop(self, n: int) -> None:
        with self._drop_lock:
            self.dropped += n

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(_FLUSH_SECONDS)
            self._wake.clear()
            self._write_pending()

    def _write_pending(self) -> None:
        lines = []
        pending = self._pending
        while pending:
            try:
                t, key, req = pending.popleft()
            except IndexError:
                break
            try:
                nbytes, kind = self._describe(key)
            except Exception as err:  # skipped and counted; the rest of the log goes on
                self.skipped += 1
                if self._first_skip is None:
                    self._first_skip = (key, err)
                continue
            # Threads record concurrently; clamp so ``t`` never decreases in the file.
            t = max(round(t - self._t0, 6), self._last_t)
            self._last_t = t
            row = {"t": t, "key": key, "nbytes": nbytes, "kind": kind}
            if req is not None:
                row["req"] = req
            lines.append(json.dumps(row, separators=(", ", ": ")))
        if not lines:
            return
        try:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
        except (OSError, ValueError) as err:
            # A full disk or a dead file: count the batch as lost and keep draining, so that
            # memory stays bounded; close() reports it.
            self.lost += len(lines)
            if self._write_error is None:
                self._write_error = err
            return
        self.records += len(lines)

    def close(self) -> None:
        """Writes everything recorded so far and closes the file. Safe to call twice.

        Raises:
          OSError: records were lost to write errors (the file is incomplete).
        """
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join()
        try:
            self._write_pending()
        finally:
            try:
                self._file.close()
            except OSError as err:
                self._write_error = self._write_error or err
                self.lost += 1 if not self.lost else 0
        if self.skipped or self.dropped:
            first = ""
            if self._first_skip is not None:
                key, err = self._first_skip
                first = f" (the first, key {key!r}: {type(err).__name__}: {err})"
            warnings.warn(
                f"access log {self.path}: {self.skipped} records skipped because their key "
                f"could not be described{first}, {self.dropped} dropped because more than "
                f"{self._max_pending} waited for the writer; {self.records} written",
                RuntimeWarning,
                stacklevel=2,
            )
        if self._write_error is not None:
            raise OSError(
                f"could not write access log {self.path}: {self.lost} records lost "
                f"({self._write_error}); {self.records} were written. Free space or choose "
                "another file"
            ) from self._write_error
