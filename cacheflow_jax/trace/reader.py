"""Access log v1 reader, and converters from other public trace formats into it.

Every reader returns a `Trace`: columns of one access each (time, key, nbytes, kind, request).
Formats:

* ``log``: access log v1 (docs/design.md), JSON Lines or CSV with the header ``t,key,nbytes,kind,req``.
* ``mooncake``: Mooncake-style JSON Lines, one request per line with ``timestamp`` (ms) and
  ``hash_ids``; each hash id becomes one access to key ``kv:<id>`` of ``block_bytes`` bytes (unit
  size by default).
* ``libcachesim-csv``: a CSV as libCacheSim reads it, with a column spec such as
  ``"time=2,key=5,size=4,header=true"`` (1-based columns, like libCacheSim's ``-t``).
* ``txt``: one key per line, unit size. It has no clock: ``t`` is the line number and
  `Trace.timed` is False (replay then applies no TTL). Guessed only for a name ending in
  ``.txt`` (or ``.txt.gz``): any other file whose first line fits no format is not a trace (a
  `TraceFormatError`), never a list of keys.

Gzip input (by its magic bytes) is read transparently. A malformed line is a `TraceFormatError`
naming the file and the line number; nothing is skipped silently.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from cacheflow_jax.core.blocks import parse_bytes

if TYPE_CHECKING:
    import numpy as np

FORMATS = ("log", "mooncake", "libcachesim-csv", "txt")
KINDS = ("weight", "embedding", "kv", "other")
LOG_COLUMNS = ("t", "key", "nbytes", "kind", "req")
# The largest block a trace may name (256 TiB): far above any cache block, and small enough that
# the sizes of millions of keys add up without overflowing 64-bit integers.
MAX_NBYTES = 2**48


class TraceFormatError(ValueError):
    """A trace line could not be read; the message names the file and line."""


class Trace:
    """An access trace in columns.

    Attributes:
      path: the file it was read from.
      t: float64 seconds, non-decreasing (a numpy array, built on first use).
      keys: the keys accessed.
      nbytes: int64 sizes > 0 (a numpy array, built on first use).
      kinds: each access's kind.
      reqs: each access's request id, or None.
      timed: False when the format has no clock and ``t`` is the access index.

    ``t`` and ``nbytes`` may be given as lists (`read_trace` does): they become arrays only when
    asked for, so that a replay, which needs lists, never imports numpy (its import is a tenth of
    a replay's process time).
    """

    def __init__(
        self,
        path: str,
        t: Sequence[float] | np.ndarray,
        keys: list[str],
        nbytes: Sequence[int] | np.ndarray,
        kinds: list[str],
        reqs: list[str | None],
        timed: bool = True,
    ) -> None:
        self.path = path
        self._t = t
        self.keys = keys
        self._nbytes = nbytes
        self.kinds = kinds
        self.reqs = reqs
        self.timed = timed
        self._sizes: dict[str, int] | None = None

    def __repr__(self) -> str:
        return f"Trace(path={self.path!r}, accesses={len(self.keys)}, timed={self.timed})"

    @property
    def t(self) -> np.ndarray:
        """The accesses' times in seconds (float64)."""
        if isinstance(self._t, list | tuple):
            import numpy as np

            self._t = np.asarray(self._t, np.float64)
        return self._t

    @property
    def nbytes(self) -> np.ndarray:
        """The accesses' sizes in bytes (int64)."""
        if isinstance(self._nbytes, list | tuple):
            import numpy as np

            self._nbytes = np.asarray(self._nbytes, np.int64)
        return self._nbytes

    def times(self) -> list[float]:
        """The accesses' times as a list of floats (without building the array)."""
        t = self._t
        return list(t) if isinstance(t, list | tuple) else t.tolist()

    def _nbytes_list(self) -> list[int]:
        n = self._nbytes
        return list(n) if isinstance(n, list | tuple) else n.tolist()

    def largest(self) -> int:
        """The largest access size in bytes (0 for an empty trace)."""
        return max(self._nbytes_list(), default=0)

    def __len__(self) -> int:
        return len(self.keys)

    def sizes(self) -> dict[str, int]:
        """Each distinct key's size (its largest ``nbytes`` in the trace), in first-access order.

        Computed once per trace (a `Trace` is not changed after it is read).
        """
        if self._sizes is None:
            nbytes = self._nbytes_list()
            if nbytes and min(nbytes) == max(nbytes):  # one size for all: no loop
                self._sizes = dict.fromkeys(self.keys, int(nbytes[0]))
            else:
                out: dict[str, int] = {}
                for key, n in zip(self.keys, nbytes):
                    if n > out.get(key, 0):
                        out[key] = n
                self._sizes = out
        return self._sizes

    def distinct_bytes(self) -> int:
        """The bytes of all distinct keys: the size of a cache that never misses twice."""
        return sum(self.sizes().values())

    def records(self) -> Iterator[dict]:
        """The accesses as access log v1 dicts."""
        for t, key, n, kind, req in zip(
            self.times(), self.keys, self._nbytes_list(), self.kinds, self.reqs
        ):
            row = {"t": t, "key": key, "nbytes": n, "kind": kind}
            if req is not None:
                row["req"] = req
            yield row

    def slice(self, start: int, stop: int) -> Trace:
        """The accesses ``start:stop`` as a new trace."""
        return Trace(
            self.path,
            self._t[start:stop],
            self.keys[start:stop],
            self._nbytes[start:stop],
            self.kinds[start:stop],
            self.reqs[start:stop],
            self.timed,
        )


def write_log(trace: Trace, path: str | os.PathLike) -> None:
    """Writes a trace as access log v1 JSON Lines."""
    with open(path, "w", encoding="utf-8") as f:
        for row in trace.records():
            f.write(json.dumps(row, separators=(", ", ": ")) + "\n")


def _open_text(path: str) -> io.TextIOBase:
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace file {path!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115 (returned to a with block)


NOT_A_TRACE = (
    "is not a trace: {why}. A trace is access log v1 (JSON Lines, or a CSV whose header is "
    "t,key,nbytes,kind,req), Mooncake JSON Lines, a libCacheSim CSV (with a column spec), or "
    "one key per line in a file named *.txt; name its format (--format, or "
    "read_trace(format=...)) if it is one of them"
)


def guess_format(path: str) -> str:
    """Guesses a trace's format from its name and first line.

    Raises:
      TraceFormatError: the file is not text, or its first line fits no format and its name
        does not end in ``.txt`` (a Python file, say): it is not a trace.
    """
    name = path.lower().removesuffix(".gz")
    if name.endswith(".txt"):
        return "txt"
    try:
        with _open_text(path) as f:
            first = f.readline().strip()
    except UnicodeDecodeError:
        raise TraceFormatError(
            f"{path} " + NOT_A_TRACE.format(why="it is not text (UTF-8, or gzip of it)")
        ) from None
    if first.startswith("{"):
        try:
            row = json.loads(first)
        except json.JSONDecodeError:
            return "log"
        return "mooncake" if isinstance(row, dict) and "hash_ids" in row else "log"
    if first.replace(" ", "").startswith("t,key,nbytes"):
        return "log"
    if "," in first:
        return "libcachesim-csv"
    raise TraceFormatError(
        f"{path} " + NOT_A_TRACE.format(why=f"its first line {first[:60]!r} fits no format")
    )


def read_trace(
    path: str | os.PathLike,
    *,
    format: str | None = None,  # noqa: A002 (the CLI's word)
    block_bytes: int = 1,
    block_tokens: int = 512,
    csv_spec: str | None = None,
    limit: int | None = None,
) -> Trace:
    """Reads a trace file into a `Trace`.

    Args:
      path: the file (gzip or plain).
      format: one of ``log``, ``mooncake``, ``libcachesim-csv``, ``txt``; guessed if None.
      block_bytes: bytes per Mooncake block (1: unit size).
      block_tokens: tokens per Mooncake block (recorded; the Mooncake trace uses 512).
      csv_spec: libCacheSim CSV column spec, e.g. ``"time=2,key=5,size=4,header=true"``.
      limit: read at most this many accesses.

    Raises:
      ValueError: unknown format, or an empty trace.
      TraceFormatError: a malformed line (the message names the file and line).
      FileNotFoundError: no such file.
    """
    path = os.fspath(path)
    fmt = format or guess_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r} for {path}; choose one of {FORMATS}")
    if block_bytes <= 0 or block_tokens <= 0:
        raise ValueError(f"block_bytes={block_bytes} and block_tokens={block_tokens} must be > 0")
    cols: tuple[list, list, list, list, list] = ([], [], [], [], [])
    reader = {
        "log": _read_log,
        "mooncake": _read_mooncake,
        "libcachesim-csv": _read_csv,
        "txt": _read_txt,
    }[fmt]
    try:
        with _open_text(path) as f:
            clock = reader(f, path, cols, limit=limit, block_bytes=block_bytes, csv_spec=csv_spec)
    except UnicodeDecodeError:
        raise TraceFormatError(
            f"{path} " + NOT_A_TRACE.format(why="it is not text (UTF-8, or gzip of it)")
        ) from None
    t, keys, nbytes, kinds, reqs = cols
    if not keys:
        raise ValueError(f"trace {path} ({fmt}) holds no accesses; give a non-empty trace")
    # Lists: the arrays are built when first asked for (`Trace.t`), so a replay never needs numpy.
    return Trace(path, t, keys, nbytes, kinds, reqs, timed=clock is not False)


def _fail(path: str, line: int, what: str) -> TraceFormatError:
    return TraceFormatError(f"{path}:{line}: {what}")


def _check_row(path: str, line: int, row: dict, last_t: float) -> tuple:
    try:
        t, key, nbytes, kind = row["t"], row["key"], row["nbytes"], row["kind"]
    except KeyError as e:
        raise _fail(path, line, f"missing field {e.args[0]!r}; need {LOG_COLUMNS[:4]}") from None
    if isinstance(t, str):
        try:
            t = float(t)
        except ValueError:
            raise _fail(path, line, f"t={t!r} is not a number") from None
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise _fail(path, line, f"t={t!r} is not a finite number of seconds")
    if t < last_t:
        raise _fail(path, line, f"t={t} goes back in time (previous t={last_t})")
    if not isinstance(key, str) or not key:
        raise _fail(path, line, f"key={key!r} must be a non-empty string")
    if isinstance(nbytes, str):
        try:
            nbytes = int(nbytes)
        except ValueError:
            raise _fail(path, line, f"nbytes={nbytes!r} is not an integer") from None
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise _fail(path, line, f"nbytes={nbytes!r} must be an integer > 0")
    if nbytes > MAX_NBYTES:
        raise _fail(path, line, f"nbytes={nbytes} is more than {MAX_NBYTES} (256 TiB)")
    if kind not in KINDS:
        raise _fail(path, line, f"kind={kind!r} must be one of {KINDS}")
    req = row.get("req")
    if req == "":
        req = None
    if req is not None and not isinstance(req, str):
        req = str(req)
    return float(t), key, nbytes, kind, req


def _append(cols: tuple, row: tuple) -> None:
    for col, value in zip(cols, row):
        col.append(value)


def _read_log(f, path: str, cols: tuple, *, limit: int | None, **_) -> None:
    first = f.readline()
    last_t = -math.inf
    if first.lstrip().startswith("{") or not first.strip():
        lines = _chain_first(first, f)
        for lineno, text in enumerate(lines, 1):
            if limit is not None and len(cols[1]) >= limit:
                return
            if not text.strip():
                raise _fail(path, lineno, "empty line")
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise _fail(path, lineno, f"not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise _fail(path, lineno, "expected a JSON object")
            checked = _check_row(path, lineno, row, last_t)
            last_t = checked[0]
            _append(cols, checked)
        return
    header = [h.strip() for h in first.strip().split(",")]
    if header[:4] != list(LOG_COLUMNS[:4]):
        raise _fail(path, 1, f"CSV header {header} must be {','.join(LOG_COLUMNS)}")
    for lineno, fields in enumerate(csv.reader(f), 2):
        if limit is not None and len(cols[1]) >= limit:
            return
        if len(fields) not in (4, 5):
            raise _fail(path, lineno, f"expected 4 or 5 fields, got {len(fields)}")
        checked = _check_row(path, lineno, dict(zip(LOG_COLUMNS, fields)), last_t)
        last_t = checked[0]
        _append(cols, checked)


def _chain_first(first: str, f) -> Iterator[str]:
    if first:
        yield first
    yield from f


def _read_mooncake(f, path: str, cols: tuple, *, limit: int | None, block_bytes: int, **_) -> None:
    t_col, k_col, n_col, kind_col, r_col = cols
    last_t = -math.inf
    for lineno, text in enumerate(f, 1):
        try:
            row = json.loads(text)
            ts, ids = row["timestamp"], row["hash_ids"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise _fail(path, lineno, f"not a Mooncake request (need timestamp, hash_ids): {e}") \
                from None
        if not isinstance(ts, (int, float)) or not isinstance(ids, list):
            raise _fail(path, lineno, "timestamp must be a number and hash_ids a list")
        t = ts / 1000.0
        if t < last_t:
            raise _fail(path, lineno, f"timestamp {ts} goes back in time")
        last_t = t
        if limit is not None:
            ids = ids[: max(limit - len(k_col), 0)]
        n = len(ids)
        k_col.extend([f"kv:{h}" for h in ids])
        t_col.extend([t] * n)
        n_col.extend([block_bytes] * n)
        kind_col.extend(["kv"] * n)
        r_col.extend([f"r{lineno}"] * n)
        if limit is not None and len(k_col) >= limit:
            return


def parse_csv_spec(spec: str | None) -> dict:
    """Parses a libCacheSim-style column spec ``"time=2,key=5,size=4,header=true,delim=,"``."""
    out = {"time": None, "key": None, "size": None, "header": None, "delim": ","}
    if not spec:
        return out
    for part in spec.split(","):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip().removesuffix("-col").replace("obj-id", "key").replace("obj-size", "size")
        if not sep or name not in out:
            raise ValueError(f"bad column spec entry {part!r} in {spec!r}; use e.g. "
                             "'time=2,key=5,size=4,header=true'")
        if name == "header":
            out[name] = value.strip().lower() in ("1", "true", "yes")
        elif name == "delim":
            out[name] = value or ","
        else:
            out[name] = int(value) - 1
    return out


def _read_csv(f, path: str, cols: tuple, *, limit: int | None, csv_spec: str | None, **_) -> bool:
    """Reads the rows; returns whether the CSV has a time column (else ``t`` is the row index)."""
    spec = parse_csv_spec(csv_spec)
    reader = csv.reader(f, delimiter=spec["delim"])
    first = next(reader, None)
    if first is None:
        return spec["time"] is not None
    names = [c.strip().lower() for c in first]
    has_header = spec["header"]
    if has_header is None:
        has_header = not all(_is_number(c) for c in first)
    if has_header and spec["key"] is None:
        for field, choices in (("time", ("time", "timestamp", "clock_time")),
                               ("key", ("obj_id", "key", "lbn", "lba", "id")),
                               ("size", ("size", "obj_size", "nbytes"))):
            spec[field] = next((names.index(c) for c in choices if c in names), spec[field])
    if spec["key"] is None:
        raise _fail(path, 1, "cannot tell which column is the key; give a column spec such as "
                    "'time=2,key=5,size=4,header=true'")
    rows = reader if has_header else _chain_first_row(first, reader)
    start = 2 if has_header else 1
    last_t = -math.inf
    tc, kc, sc = spec["time"], spec["key"], spec["size"]
    for lineno, fields in enumerate(rows, start):
        if limit is not None and len(cols[1]) >= limit:
            break
        try:
            t = float(fields[tc]) if tc is not None else float(lineno - start)
            key = fields[kc].strip()
            size = int(float(fields[sc])) if sc is not None else 1
        except (IndexError, ValueError, OverflowError) as e:
            raise _fail(path, lineno, f"bad row {fields!r}: {e}") from None
        if not key:
            raise _fail(path, lineno, "empty key")
        if size <= 0:
            raise _fail(path, lineno, f"size {size} must be > 0")
        if size > MAX_NBYTES:
            raise _fail(path, lineno, f"size {size} is more than {MAX_NBYTES} (256 TiB)")
        last_t = max(last_t, t)  # libCacheSim tolerates small reorderings; keep t monotone
        _append(cols, (last_t, key, size, "other", None))
    return tc is not None


def _chain_first_row(first: list, reader) -> Iterator[list]:
    yield first
    yield from reader


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _read_txt(f, path: str, cols: tuple, *, limit: int | None, **_) -> bool:
    """Reads one key per line; returns False: the format has no clock (``t`` is the index)."""
    if limit is None:  # the whole file, the columns built at once (1M lines: 0.46 s -> 0.17 s)
        keys = [text.strip() for text in f]
        n = len(keys)
        while n and not keys[n - 1]:
            n -= 1
        del keys[n:]
        if not all(keys):
            raise _fail(path, keys.index("") + 1, "empty line; one key per line expected")
        t, names, nbytes, kinds, reqs = cols
        t.extend(map(float, range(n)))
        names.extend(keys)
        nbytes.extend([1] * n)
        kinds.extend(["other"] * n)
        reqs.extend([None] * n)
        return False
    blank = 0  # the first empty line seen: allowed only at the end of the file
    for lineno, text in enumerate(f, 1):
        if limit is not None and len(cols[1]) >= limit:
            break
        key = text.strip()
        if not key:
            blank = blank or lineno
            continue
        if blank:
            raise _fail(path, blank, "empty line; one key per line expected")
        _append(cols, (float(lineno - 1), key, 1, "other", None))
    return False


def parse_size(
    text: str | int, *, total: int, largest: int, setting: str, unit_size: bool = False
) -> int:
    """Parses a byte size: ``1024``, ``64KiB``, ``1.5GiB`` or ``5%`` (of ``total``, rounded down).

    Args:
      text: the size as given.
      total: what 100% is (the trace's distinct bytes).
      largest: the trace's largest object, in bytes.
      setting: the option's name, for messages (``--device-bytes``).
      unit_size: the trace counts every key as one block (no byte sizes): a size is then a block
        count or a percentage, and a byte unit is an error rather than a silent reinterpretation.

    Raises:
      ValueError: unparsable, negative, not finite, a fraction of a byte, a plain number smaller
        than the largest object (the message suggests a unit or a percentage), or a byte unit on a
        unit-size trace.
    """
    if isinstance(text, int):
        value, unitless = text, True
    elif text.strip().endswith("%"):
        try:
            share = float(text.strip()[:-1])
        except ValueError:
            raise ValueError(f"{setting}={text!r} is not a percentage such as 5%") from None
        if not math.isfinite(share):
            raise ValueError(f"{setting}={text!r} is not a finite percentage; give e.g. 5%")
        value, unitless = int(total * share / 100), False
    else:
        try:
            value, unitless = parse_bytes(text)
        except ValueError as e:
            if "whole number" in str(e):
                raise ValueError(
                    f"{setting}={text!r} is not a whole number of "
                    f"{'blocks' if unit_size else 'bytes'}"
                ) from None
            raise ValueError(
                f"{setting}={text!r} is not a size; use "
                + ("a number of blocks (1000)" if unit_size
                   else "bytes with an optional unit (1048576, 64KiB, 2GiB)")
                + " or a percentage of the trace's distinct "
                + ("blocks" if unit_size else "bytes") + " (5%)"
            ) from None
        if unit_size and not unitless:
            raise ValueError(
                f"{setting}={text!r} is in bytes, but this trace has unit sizes (every key is one "
                f"block, {total} blocks in all), so sizes count blocks: give a number of blocks "
                f"({max(total // 10, 1)}) or a percentage (10%); for byte sizes give the trace "
                "byte sizes (--block-bytes for a Mooncake trace)"
            )
    if value < 0:
        raise ValueError(f"{setting}={text!r} is negative")
    if unitless and 0 < value < largest:
        raise ValueError(
            f"{setting}={text!r} has no unit and is smaller than the trace's largest object "
            f"({largest} bytes); did you mean {text}% or {text}MiB?"
        )
    return value


def split_point(t: Sequence[float] | np.ndarray, eval_fraction: float) -> int:
    """The first held-out position: the last ``eval_fraction`` of accesses, cut between timestamps.

    `cacheflow train` splits its logs here, and `cacheflow replay --warmup P%` starts counting
    here, so a predictor trained on the head is replayed on exactly the tail it never saw.

    Args:
      t: the accesses' times (non-decreasing).
      eval_fraction: the share held out, in (0, 1).

    Returns:
      ``start`` with ``t[start-1] < t[start]`` (unless no later timestamp exists), ``1 <= start``.

    >>> split_point([0., 0., 1., 1., 1., 2.], 0.5)
    5
    """
    n = len(t)
    start = min(max(int(math.ceil((1.0 - eval_fraction) * n)), 1), n - 1) if n > 1 else n
    while 0 < start < n and t[start] == t[start - 1]:
        start += 1
    if start >= n:  # one timestamp to the end: fall back to the plain access count
        start = min(max(int(math.ceil((1.0 - eval_fraction) * n)), 1), n)
    return start
