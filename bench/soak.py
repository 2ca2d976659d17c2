"""Soak: threads hammer one cache with random get/put/evict/flush; count every wrong byte.

```
python -m bench.soak [--seconds 60] [--threads 8] [--seed 0] [--json] [--out DIR]
                     [--host-memory auto|pinned|pageable]
```

A store of read-only chunks (4 arrays x 32 blocks of 4 KiB, float32, the fast read path) and 64
runtime blocks (4 KiB each) is served through a `TieredCache` whose budgets hold about a quarter
of it (L1 128 KiB, L2 256 KiB), so blocks move between tiers and to L3 all the time. Each thread
loops over random operations:

| op | share | checked |
|---|---|---|
| `get` of a chunk | 45% | every byte equals the source array's slice |
| `get` of a runtime block | 20% | the block is one of the versions put for that key, whole |
| `get_many` of 4 chunks | 5% | as `get` |
| `put` of a new version | 15% | - |
| "recompute": `evict` of a runtime block, then `put` of a new version at once | 5% | - |
| `evict` | 7% | - |
| `flush` | 3% | - |

A runtime block's value is ``key_id * 1_000_000 + version`` in every element, so a torn,
mixed or foreign block is caught, as is a version never put. A put holds its key's lock (puts
of other keys, gets, evicts and flushes go on beside it), so each key has a newest version; the
"recompute" op puts a key again while its evicted version is being written back. A sampler thread checks the
budgets (`TieredCache.check_budgets`) every 5 ms and the process's resident memory (RSS) every
0.25 s. A watchdog counts a hang when no thread has finished an operation for 30 s.

It reports operations, wrong bytes, budget violations, hangs, errors, and whether RSS is flat:
over the second half of the run, max/min RSS must be within 10%. After the run, the cache is
flushed (right after evicting every runtime block and putting each again) and the store reopened: every runtime
block must read back as its newest version
(``lost_updates`` counts those that do not; ``reputs`` the puts of a key already put).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import OUT_DIR, format_table, machine

NAME = "soak"
KB = 1 << 10
RUNTIME_KEYS = 64
RSS_TOLERANCE = 0.10


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_soak(seconds: float, threads: int, *, seed: int = 0, workdir: Path | None = None,
             host_memory: str = "auto") -> dict:  # fmt: skip
    """Runs the soak and returns its summary (see the module docstring)."""
    import cacheflow_jax as cfj

    rng = np.random.default_rng(seed)
    arrays = {f"a{i}": rng.standard_normal((32, 1024)).astype(np.float32) for i in range(4)}
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="cacheflow-soak-")
        workdir = Path(tmp.name)
    try:
        root = workdir / "store"
        store = cfj.write_store(arrays, root, chunk_bytes=4 * KB, overwrite=True)
        cache = cfj.TieredCache(store, device_bytes=128 * KB, host_bytes=256 * KB, l3_timeout=30.0,
                                host_memory=host_memory)  # fmt: skip
        chunk_keys = [k for k in store.keys() if "@" in k]
        expected = {}
        for key in chunk_keys:
            info = store.info(key)
            sel = tuple(slice(o, o + n) for o, n in zip(info.origin, info.shape, strict=True))
            expected[key] = arrays[info.array][sel]
        versions = [itertools.count(1) for _ in range(RUNTIME_KEYS)]
        highest = [0] * RUNTIME_KEYS  # the highest version put so far (a lower bound is enough)
        newest = [0] * RUNTIME_KEYS  # the version of each key's last put (under its lock)
        put_locks = [threading.Lock() for _ in range(RUNTIME_KEYS)]
        n = {"ops": 0, "wrong": 0, "budget": 0, "errors": 0, "hangs": 0, "reputs": 0}
        first_error: list[str] = []
        stop = threading.Event()
        last_op = [time.monotonic()]
        lock = threading.Lock()

        def runtime_value(key_id: int, version: int) -> np.ndarray:
            return np.full(1024, key_id * 1_000_000 + version, np.int32)

        def check_runtime(key_id: int, value: Any) -> bool:
            arr = np.asarray(value)
            if arr.shape != (1024,) or arr.dtype != np.int32 or not (arr == arr[0]).all():
                return False
            kid, version = divmod(int(arr[0]), 1_000_000)
            return kid == key_id and 1 <= version <= highest[key_id] + threads

        def put(kid: int, *, recompute: bool) -> int:
            """Puts a new version of ``kid`` (after evicting it, for a recompute); 1 if a re-put."""
            with put_locks[kid]:
                if recompute:
                    cache.evict(f"kv:{kid}")
                version = next(versions[kid])
                cache.put(f"kv:{kid}", runtime_value(kid, version))
                again = int(newest[kid] > 0)
                newest[kid] = version
                highest[kid] = max(highest[kid], version)
            return again

        def worker(wid: int) -> None:
            r = random.Random(seed * 1000 + wid)
            ops = wrong = errors = reputs = 0
            while not stop.is_set():
                p = r.random()
                try:
                    if p < 0.45:
                        key = r.choice(chunk_keys)
                        if not np.array_equal(np.asarray(cache.get(key)), expected[key]):
                            wrong += 1
                    elif p < 0.65:
                        kid = r.randrange(RUNTIME_KEYS)
                        if highest[kid] and not check_runtime(kid, cache.get(f"kv:{kid}")):
                            wrong += 1
                    elif p < 0.70:
                        keys = r.sample(chunk_keys, 4)
                        for key, value in zip(keys, cache.get_many(keys), strict=True):
                            if not np.array_equal(np.asarray(value), expected[key]):
                                wrong += 1
                    elif p < 0.90:
                        reputs += put(r.randrange(RUNTIME_KEYS), recompute=p >= 0.85)
                    elif p < 0.97:
                        cache.evict(
                            r.choice(chunk_keys)
                            if r.random() < 0.5
                            else f"kv:{r.randrange(RUNTIME_KEYS)}"
                        )
                    else:
                        cache.flush()
                except Exception as err:  # counted and shown; the soak goes on
                    errors += 1
                    with lock:
                        if not first_error:
                            first_error.append(f"{type(err).__name__}: {err}")
                ops += 1
                last_op[0] = time.monotonic()
            with lock:
                n["ops"] += ops
                n["wrong"] += wrong
                n["errors"] += errors
                n["reputs"] += reputs

        rss: list[tuple[float, int]] = []

        def sampler() -> None:
            t0 = time.monotonic()
            next_rss = t0
            while not stop.is_set():
                try:
                    cache.check_budgets()
                except AssertionError:
                    n["budget"] += 1
                now = time.monotonic()
                if now >= next_rss:
                    rss.append((now - t0, _rss_bytes()))
                    next_rss = now + 0.25
                if now - last_op[0] > 30:
                    n["hangs"] += 1
                    last_op[0] = now
                time.sleep(0.005)

        pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
        watcher = threading.Thread(target=sampler, daemon=True)
        t_start = time.monotonic()
        for t in [*pool, watcher]:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in pool:
            t.join(timeout=60)
            if t.is_alive():
                n["hangs"] += 1
        watcher.join(timeout=10)
        elapsed = time.monotonic() - t_start
        # The last step recomputes every key: all are evicted (their write-backs start), then
        # all are put again at once, so that the flush below meets write-backs of older
        # versions still in flight, as a session's exit after a batch of recomputes does.
        for kid in range(RUNTIME_KEYS):
            cache.evict(f"kv:{kid}")
        for kid in range(RUNTIME_KEYS):
            n["reputs"] += put(kid, recompute=False)
        cache.flush()
        reopened = cfj.open_store(root)
        unreadable = lost_updates = 0
        for kid in range(RUNTIME_KEYS):
            if not newest[kid]:
                continue
            value = reopened.read(f"kv:{kid}").result()
            if not check_runtime(kid, value):
                unreadable += 1
            elif int(np.asarray(value)[0]) != kid * 1_000_000 + newest[kid]:
                lost_updates += 1  # an older version outlived the newest one
        half = [b for t, b in rss if t >= seconds / 2] or [b for _, b in rss]
        spread = (max(half) - min(half)) / min(half) if half else 0.0
        return {
            "seconds": round(elapsed, 2),
            "threads": threads,
            "operations": n["ops"],
            "wrong_bytes": n["wrong"],
            "budget_violations": n["budget"],
            "hangs": n["hangs"],
            "errors": n["errors"],
            "first_error": first_error[0] if first_error else None,
            "lost_after_flush": unreadable,
            "reputs": n["reputs"],
            "lost_updates": lost_updates,
            "rss_mib_second_half": [round(min(half) / 2**20, 1), round(max(half) / 2**20, 1)],
            "rss_spread_second_half": round(spread, 4),
            "rss_flat": spread <= RSS_TOLERANCE,
            "ok": n["wrong"] == 0
            and n["budget"] == 0
            and n["hangs"] == 0
            and unreadable == 0
            and lost_updates == 0
            and n["errors"] == 0
            and spread <= RSS_TOLERANCE,
        }
    finally:
        if tmp is not None:
            tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run (default 60)")
    p.add_argument("--threads", type=int, default=8, help="worker threads (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-memory", default="auto", choices=("auto", "pinned", "pageable"),
                   help="L2's memory (TieredCache's host_memory; pinned runs on the CPU too)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", type=Path, default=OUT_DIR, help=f"folder for soak.json ({OUT_DIR})")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.threads < 1:
        p.error("--seconds must be > 0 and --threads >= 1")
    result = run_soak(args.seconds, args.threads, seed=args.seed, host_memory=args.host_memory)
    doc = {"name": NAME, "machine": machine(), "load_average": os.getloadavg(), **result}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(doc, indent=2))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        rows = [[k, str(v)] for k, v in result.items()]
        print(format_table(["soak", "value"], rows))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
