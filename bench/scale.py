"""Beyond one process: N processes share one S3 L3 (moto on loopback), and a ``jax.distributed``
job restores a checkpoint with each process reading its own shards.

    python -m bench.scale [--processes 2 4] [--dim 256] [--keys 1000] [--kills 20] [--json]

For each N of ``--processes`` it runs (each process is ``bench._scale_worker``):

* **restore**: N ``jax.distributed`` CPU processes save a checkpoint with orbax over a mesh of
  all of them (about ``64 * dim**2`` bytes), copy it to S3, restore it with orbax (from disk)
  and with ``restore_lazy(target=...)`` + ``materialize`` (from S3). Reported per process: the
  bytes cacheflow read from S3 against the checkpoint's bytes, against orbax's in the same
  process, and whether every shard is bitwise orbax's.
* **kv**: N serving processes over one shared runtime store on S3 (``open_store(...,
  shared=True)``), each opened before anyone writes. Each puts ``--own`` blocks of its own and
  the same ``--keys`` blocks as every other (in its own order), and publishes one block
  ``--race`` times while reading it; then each finds and reads the others' blocks. Reported:
  the KV blocks found that another process wrote, wrong bytes, lost blocks, conflicts, L3
  requests per second (TensorStore's own counters), torn reads.

Then, once: **kills**: a writer process publishing 4 MiB blocks is SIGKILLed ``--kills`` times at
random moments; after each kill every block of the store is read and checked. Reported: kills
that landed during a write, torn or wrong blocks visible afterwards.

Every figure is a count or a ratio of bytes; nothing here is a timing except the requests per
second, which depend on the machine (moto is a Python server sharing the CPU with the clients).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench._common import OUT_DIR, format_table, machine

NAME = "scale"
ROOT = Path(__file__).resolve().parent.parent
_ENV = {
    "AWS_ACCESS_KEY_ID": "cacheflow-bench",
    "AWS_SECRET_ACCESS_KEY": "cacheflow-bench-secret",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# Targets of issue 28: bytes each process reads of the checkpoint, by process count.
READ_SHARE_TARGET = {2: 0.6, 4: 0.35}


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto(bucket: str = "cacheflow-scale") -> Iterator[str]:
    """A ``moto_server`` on a free loopback port with ``bucket``; yields its endpoint URL."""
    exe = Path(sys.executable).with_name("moto_server")
    port = free_port()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"moto_server did not start on port {port}") from None
                    time.sleep(0.1)
            endpoint = f"http://127.0.0.1:{port}"
            import boto3

            boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name="us-east-1",
                aws_access_key_id=_ENV["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=_ENV["AWS_SECRET_ACCESS_KEY"],
            ).create_bucket(Bucket=bucket)
            yield endpoint
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def worker_env(endpoint: str | None) -> dict[str, str]:
    """The environment of a worker: S3 credentials and endpoint, one CPU device, quiet logs."""
    env = {**os.environ, **_ENV, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    env.pop("XLA_FLAGS", None)
    return env


def launch(
    role: str, specs: list[dict[str, Any]], env: dict[str, str], timeout: float
) -> list[dict]:
    """Runs one worker per spec at once; returns their results (their stderr on a failure)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench._scale_worker", role, json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for spec in specs
    ]
    deadline = time.monotonic() + timeout
    failures = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{role} workers did not finish within {timeout} s") from None
        if proc.returncode != 0:
            failures.append(err[-3000:])
    if failures:
        raise RuntimeError(f"{role} worker failed:\n" + "\n---\n".join(failures))
    return [json.loads(Path(spec["out"]).read_text()) for spec in specs]


def run_restore(
    processes: int, dim: int, workdir: Path, *, endpoint: str | None = None, timeout: float = 300
) -> list[dict[str, Any]]:
    """The restore phase with ``processes`` ``jax.distributed`` processes; one result each.

    With ``endpoint``, the checkpoint is copied to S3 and cacheflow reads it from there.
    """
    port = free_port()
    ckpt = workdir / f"ckpt-{processes}"
    specs = []
    for p in range(processes):
        spec: dict[str, Any] = {
            "process": p,
            "processes": processes,
            "port": port,
            "dim": dim,
            "ckpt": str(ckpt),
            "out": str(workdir / f"restore-{processes}-{p}.json"),
            "runtime": str(workdir / f"runtime-{processes}-{p}"),
        }
        if endpoint:
            url = f"s3://cacheflow-scale/ckpt-{processes}"
            spec.update(upload=url, cacheflow_path=url, runtime=f"{url}-kv-{p}")
        specs.append(spec)
    return launch("restore", specs, worker_env(endpoint), timeout)


def run_kv(
    processes: int,
    url: str,
    workdir: Path,
    *,
    endpoint: str | None,
    own: int,
    same: int,
    race: int,
    block_bytes: int = 16 * 1024,
    timeout: float = 300,
) -> list[dict[str, Any]]:
    """The KV phase: ``processes`` serving processes over the shared store at ``url``."""
    folder = Path(tempfile.mkdtemp(dir=workdir, prefix="barrier-"))
    budget = max(4 * 2**20, 2 * (own + same + 1) * block_bytes)
    specs = [
        {
            "process": p,
            "processes": processes,
            "url": url,
            "barrier": str(folder),
            "own": own,
            "same": same,
            "race": race,
            "block_bytes": block_bytes,
            "device_bytes": budget,
            "host_bytes": budget,
            "out": str(workdir / f"kv-{processes}-{p}.json"),
        }
        for p in range(processes)
    ]
    return launch("kv", specs, worker_env(endpoint), timeout)


def run_kills(
    url: str,
    workdir: Path,
    *,
    endpoint: str | None,
    kills: int,
    block_bytes: int = 4 * 2**20,
    seed: int = 0,
) -> dict[str, Any]:
    """SIGKILLs a writer ``kills`` times at random moments; after each, checks every block."""
    import cacheflow_jax as cfj
    from bench._scale_worker import block_value, same_block

    rng = random.Random(seed)
    env = worker_env(endpoint)
    in_write, torn, wrong, checked, errors = 0, 0, 0, 0, []
    saved = {k: os.environ.get(k) for k in env if k.startswith("AWS_")}
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    try:
        for n in range(kills):
            log = workdir / f"kill-{n}.log"
            spec = {"url": url, "block_bytes": block_bytes, "log": str(log), "round": n}
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench._scale_worker", "writer", json.dumps(spec)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            _wait_for_writes(proc, log, 1 + rng.randrange(3))
            time.sleep(rng.uniform(0.0, 0.05))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            lines = log.read_text().split()
            in_write += len(lines) >= 2 and lines[-2] == "begin"
            store = cfj.open_store(url, create=True, shared=True)
            for key in store.keys():
                checked += 1
                try:
                    got = store.read(key).result(timeout=60)
                except cfj.StoreError as err:
                    torn += 1
                    errors.append(repr(err)[:300])
                    continue
                wrong += not same_block(got, block_value(key, block_bytes))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {
        "kills": kills,
        "kills_during_a_write": in_write,
        "blocks_checked": checked,
        "torn_blocks": torn,
        "wrong_blocks": wrong,
        "errors": errors[:5],
    }


def _wait_for_writes(proc: subprocess.Popen, log: Path, writes: int, timeout: float = 60) -> None:
    """Waits until the writer has begun its ``writes``-th write."""
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text() if log.exists() else ""
        if text.count("begin ") >= writes:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the writer exited with {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the writer did not start {writes} writes within {timeout} s")
        time.sleep(0.005)


def summarize_restore(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The restore figures over the processes of one job."""
    total = results[0]["checkpoint_bytes"]
    shares = [r["cacheflow_bytes"] / total for r in results]
    vs_orbax = [r["cacheflow_bytes"] / max(1, r["orbax_bytes"]) for r in results]
    return {
        "processes": len(results),
        "checkpoint_bytes": total,
        "bytes_read": [r["cacheflow_bytes"] for r in results],
        "orbax_bytes_read": [r["orbax_bytes"] for r in results],
        "read_share_max": max(shares),
        "vs_orbax_max": max(vs_orbax),
        "outputs_equal_orbax": all(
            r["mismatched_shards"] == 0 and r["shards"] > 0 for r in results
        ),
        "jit_ok": all(r["jit_ok"] for r in results),
        "l1_local": all(r["l1_local"] for r in results),
        "target": READ_SHARE_TARGET.get(len(results)),
    }


def summarize_kv(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The KV figures over the processes of one run."""
    seconds = max(r["seconds"] for r in results)
    return {
        "processes": len(results),
        "found_from_others": sum(r["found_from_others"] for r in results),
        "expected_from_others": sum(r["expected_from_others"] for r in results),
        "wrong_bytes": sum(r["wrong_bytes"] for r in results),
        "lost": sum(r["lost"] for r in results),
        "errors": sum(len(r["errors"]) for r in results),
        "conflicts": sum(r["conflicts"] for r in results),
        "race_torn_reads": sum(r["race_torn_reads"] for r in results),
        "race_errors": sum(len(r["race_errors"]) for r in results),
        "l3_requests": sum(r["l3_requests"] for r in results),
        "l3_requests_per_second": sum(r["l3_requests"] for r in results) / seconds,
        "seconds": seconds,
    }


def run(args: Any, workdir: Path) -> dict[str, Any]:
    """Every phase, for every process count of ``args``."""
    out: dict[str, Any] = {"restore": {}, "kv": {}}
    with moto() as endpoint:
        for n in args.processes:
            results = run_restore(n, args.dim, workdir, endpoint=endpoint)
            out["restore"][n] = {"summary": summarize_restore(results), "processes": results}
            url = f"s3://cacheflow-scale/kv-{n}"
            results = run_kv(
                n, url, workdir, endpoint=endpoint, own=args.own, same=args.keys, race=args.race
            )
            out["kv"][n] = {"summary": summarize_kv(results), "processes": results}
        out["kills"] = run_kills(
            "s3://cacheflow-scale/kills", workdir, endpoint=endpoint, kills=args.kills
        )
    return out


def verdicts(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 28's targets, judged on this run."""
    rows = []
    for n, r in out["restore"].items():
        s = r["summary"]
        target = s["target"] or 1.0 / n + 0.1
        rows.append(
            {
                "label": f"{n} processes: bytes read per process / checkpoint",
                "value": s["read_share_max"],
                "target": f"<= {target}",
                "met": s["read_share_max"] <= target and s["outputs_equal_orbax"],
            }
        )
    for n, r in out["kv"].items():
        s = r["summary"]
        ok = (
            s["wrong_bytes"] == 0
            and s["lost"] == 0
            and s["errors"] == 0
            and s["race_torn_reads"] == 0
            and s["found_from_others"] == s["expected_from_others"]
        )
        rows.append(
            {
                "label": f"{n} processes: KV blocks of others read bitwise, 0 wrong, 0 lost",
                "value": s["found_from_others"],
                "target": s["expected_from_others"],
                "met": ok,
            }
        )
    k = out["kills"]
    rows.append(
        {
            "label": "SIGKILLed writer: torn or wrong blocks visible",
            "value": k["torn_blocks"] + k["wrong_blocks"],
            "target": 0,
            "met": k["torn_blocks"] + k["wrong_blocks"] == 0 and k["kills"] > 0,
        }
    )
    return rows


def _table(out: dict[str, Any]) -> str:
    rows = []
    for n, r in out["restore"].items():
        s = r["summary"]
        rows.append(
            [
                f"restore, {n} processes",
                f"read share max {s['read_share_max']:.3f} "
                f"(target {s['target']}), vs orbax max {s['vs_orbax_max']:.2f}x, "
                f"equal to orbax: {s['outputs_equal_orbax']}, jit: {s['jit_ok']}",
            ]
        )
    for n, r in out["kv"].items():
        s = r["summary"]
        rows.append(
            [
                f"kv, {n} processes",
                f"found {s['found_from_others']}/"
                f"{s['expected_from_others']} of others' blocks, wrong bytes "
                f"{s['wrong_bytes']}, lost {s['lost']}, errors {s['errors']}, conflicts "
                f"{s['conflicts']}, torn {s['race_torn_reads']}, "
                f"{s['l3_requests_per_second']:.0f} L3 requests/s",
            ]
        )
    k = out["kills"]
    rows.append(
        [
            "SIGKILL",
            f"{k['kills']} kills ({k['kills_during_a_write']} during a write), "
            f"{k['blocks_checked']} blocks checked, torn {k['torn_blocks']}, wrong "
            f"{k['wrong_blocks']}",
        ]
    )
    for v in verdicts(out):
        rows.append(
            [
                v["label"],
                f"{v['value']} (target {v['target']}): " + ("met" if v["met"] else "not met"),
            ]
        )
    return format_table(["scale", "result"], rows)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--dim", type=int, default=256, help="model width: 64 * dim**2 bytes")
    p.add_argument("--keys", type=int, default=1000, help="KV blocks every process puts")
    p.add_argument("--own", type=int, default=200, help="KV blocks only one process puts")
    p.add_argument("--race", type=int, default=200, help="publishes of one block per process")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", type=Path, default=OUT_DIR, help=f"folder for scale.json ({OUT_DIR})")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.processes) or args.dim % 8 or args.kills < 0:
        p.error("--processes must be >= 1, --dim a multiple of 8, --kills >= 0")
    with tempfile.TemporaryDirectory(prefix="cacheflow-scale-") as tmp:
        out = run(args, Path(tmp))
    doc = {
        "name": NAME,
        "machine": machine(),
        "settings": vars(args) | {"out": str(args.out)},
        "results": out,
        "targets": verdicts(out),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(doc, indent=2, default=str))
    print(json.dumps(doc, indent=2, default=str) if args.json else _table(out))
    return 0 if all(v["met"] for v in doc["targets"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
