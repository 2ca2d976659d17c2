"""One process of `bench.scale` (and of tests/test_scale.py): ``python -m bench._scale_worker ROLE
JSON``, where ROLE is one of

* ``restore``: a process of a ``jax.distributed`` job. It saves a checkpoint with orbax over a mesh
  of every process, restores it with orbax into a sharded target, then with
  ``restore_lazy(target=...)`` + ``materialize``, and compares the two shard by shard, counting
  the bytes each read (TensorStore's own kvstore counters);
* ``kv``: a serving process over a shared runtime store (``open_store(..., shared=True)``): it
  opens its cache before anyone writes, puts its own KV blocks and blocks every process puts,
  publishes one block many times while reading it, then finds and reads the others' blocks;
* ``writer``: puts large blocks into a shared store until it is killed (the SIGKILL case).

Each writes its result as JSON to ``spec["out"]``. Block values follow from their keys
(`block_value`), so any process can check any block bitwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

# ------------------------------------------------------------------------------------ shared


def block_value(key: str, nbytes: int) -> dict[str, np.ndarray]:
    """The KV block stored under ``key``: a pytree of K and V (bfloat16), about ``nbytes``."""
    import ml_dtypes

    seed = int(hashlib.sha256(key.encode()).hexdigest()[:16], 16)
    rng = np.random.default_rng(seed)
    per = max(1, nbytes // 4)  # two leaves of 2-byte elements
    tokens = max(1, per // 64)
    bits = rng.integers(0, 2**16, size=(2, tokens, 64), dtype=np.uint16)
    bits &= 0x7F7F  # finite values only (no NaN payloads that compare unequal)
    return {"k": bits[0].view(ml_dtypes.bfloat16), "v": bits[1].view(ml_dtypes.bfloat16)}


def same_block(got: Any, want: dict[str, np.ndarray]) -> bool:
    """Bitwise equality of a block read back and its expected value (dtype and shape too)."""
    if not isinstance(got, dict) or set(got) != set(want):
        return False
    for name, w in want.items():
        g = np.asarray(got[name])
        if g.dtype != w.dtype or g.shape != w.shape or g.tobytes() != w.tobytes():
            return False
    return True


def kvstore_counts() -> dict[str, int]:
    """TensorStore's kvstore counters in this process: requests and bytes per driver."""
    import tensorstore as ts

    out: dict[str, int] = {}
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        parts = metric["name"].split("/")
        if len(parts) != 5 or not metric["values"] or "value" not in metric["values"][0]:
            continue
        driver, what = parts[3], parts[4]
        if what in ("read", "write", "list", "delete_range", "bytes_read", "bytes_written"):
            out[f"{driver}.{what}"] = int(metric["values"][0]["value"])
    return out


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Counters that grew between two `kvstore_counts`."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def requests(counts: dict[str, int], driver: str) -> int:
    """The requests of one kvstore driver among `kvstore_counts`."""
    return sum(counts.get(f"{driver}.{w}", 0) for w in ("read", "write", "list", "delete_range"))


def barrier(folder: str, name: str, process: int, processes: int, timeout: float = 120.0) -> None:
    """Waits until every process reached ``name`` (a file per process in ``folder``)."""
    Path(folder, f"{name}.{process}").touch()
    deadline = time.monotonic() + timeout
    while not all(Path(folder, f"{name}.{p}").exists() for p in range(processes)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name!r}: not every process arrived within {timeout} s")
        time.sleep(0.01)


# ------------------------------------------------------------------------------------ restore


def model(dim: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The arrays of the test model and their partition specs over mesh axis ``x``: about
    ``64 * dim**2`` bytes of float32."""
    from jax.sharding import PartitionSpec as P

    return {
        "embed": ((8 * dim, dim), P("x", None)),
        "layers/0/w1": ((dim, 4 * dim), P(None, "x")),
        "layers/0/w2": ((4 * dim, dim), P("x", None)),
        "layers/0/bias": ((4 * dim,), P()),
    }


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


def _file_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def restore(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``restore`` role (see the module docstring)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process, processes = spec["process"], spec["processes"]
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{spec['port']}",
        num_processes=processes,
        process_id=process,
        initialization_timeout=120,
    )
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding

    from cacheflow_jax.orbax import materialize, restore_lazy

    mesh = jax.make_mesh((processes,), ("x",), devices=jax.devices())
    arrays = model(spec["dim"])
    rng = np.random.default_rng(0)  # every process builds the same global values
    full = {n: rng.standard_normal(shape).astype(np.float32) for n, (shape, _) in arrays.items()}
    shardings = {n: NamedSharding(mesh, pspec) for n, (_, pspec) in arrays.items()}
    tree = _nest(
        {
            n: jax.make_array_from_callback(full[n].shape, shardings[n], lambda i, n=n: full[n][i])
            for n in arrays
        }
    )
    ckpt = spec["ckpt"]
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(ckpt, tree, force=True)
    checkpointer.wait_until_finished()
    multihost_utils.sync_global_devices("saved")
    if spec.get("upload") and process == 0:
        _upload(ckpt, spec["upload"])
    multihost_utils.sync_global_devices("uploaded")
    target = _nest(
        {n: jax.ShapeDtypeStruct(full[n].shape, np.float32, sharding=shardings[n]) for n in arrays}
    )
    before = kvstore_counts()
    theirs = checkpointer.restore(ckpt, target)
    orbax_counts = delta(kvstore_counts(), before)
    before = kvstore_counts()
    lazy = restore_lazy(
        spec.get("cacheflow_path", ckpt),
        target=target,
        device_bytes=spec.get("device_bytes", 64 * 2**20),
        host_bytes=spec.get("host_bytes", 0),
        runtime=spec.get("runtime"),
    )
    # The embedding takes its target's sharding; the layers are given theirs (both ways).
    layers = jax.tree.map(lambda x: x.sharding, target["layers"])
    ours = {
        "embed": materialize(lazy["embed"]),
        "layers": materialize(lazy["layers"], sharding=layers),
    }
    ours_counts = delta(kvstore_counts(), before)
    cache = lazy["embed"].cache
    mismatched, shards = 0, 0
    for name in arrays:
        a, b = _leaf(theirs, name), _leaf(ours, name)
        if a.sharding != b.sharding or a.shape != b.shape or a.dtype != b.dtype:
            mismatched += 1
            continue
        by_device = {s.device: s for s in b.addressable_shards}
        for s in a.addressable_shards:
            shards += 1
            mine = by_device.get(s.device)
            same = mine is not None and mine.index == s.index
            mismatched += not (same and _bits(mine.data) == _bits(s.data))
    summed = jax.jit(lambda x, y: x + y)(_leaf(theirs, "embed"), _leaf(ours, "embed"))
    jit_ok = all(
        np.array_equal(np.asarray(s.data), 2 * full["embed"][s.index])
        for s in summed.addressable_shards
    )
    driver = "s3" if str(spec.get("cacheflow_path", "")).startswith("s3://") else "file"
    result = {
        "process": process,
        "processes": processes,
        "checkpoint_bytes": _file_bytes(ckpt),
        "array_bytes": int(sum(v.nbytes for v in full.values())),
        "orbax_bytes": orbax_counts.get("file.bytes_read", 0),
        "cacheflow_bytes": ours_counts.get(f"{driver}.bytes_read", 0),
        "cacheflow_requests": requests(ours_counts, driver),
        "cacheflow_read_stats": cache.store.read_stats(),
        "shards": shards,
        "mismatched_shards": mismatched,
        "jit_ok": bool(jit_ok),
        "l1_device": str(cache.device),
        "l1_local": cache.device in jax.local_devices(),
    }
    multihost_utils.sync_global_devices("compared")
    jax.distributed.shutdown()
    return result


def _bits(array: Any) -> bytes:
    return np.asarray(array).tobytes()


def _leaf(tree: Any, path: str) -> Any:
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _upload(folder: str, url: str) -> None:
    """Copies a local checkpoint to ``s3://bucket/prefix`` (the endpoint from the environment)."""
    import boto3

    bucket, _, prefix = url[len("s3://") :].partition("/")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    for path in Path(folder).rglob("*"):
        if path.is_file():
            client.upload_file(
                str(path), bucket, f"{prefix.rstrip('/')}/{path.relative_to(folder)}"
            )


# ------------------------------------------------------------------------------------ kv


def kv(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``kv`` role (see the module docstring)."""
    import cacheflow_jax as cfj

    process, processes, folder = spec["process"], spec["processes"], spec["barrier"]
    nbytes, own, same, race = spec["block_bytes"], spec["own"], spec["same"], spec["race"]
    store = cfj.open_store(spec["url"], create=True, shared=True)
    cache = cfj.TieredCache(
        store, device_bytes=spec["device_bytes"], host_bytes=spec["host_bytes"], l3_timeout=60
    )
    barrier(folder, "opened", process, processes)  # every cache is open before anyone puts
    start, counts = time.perf_counter(), kvstore_counts()
    errors: list[str] = []
    order = list(range(same))
    np.random.default_rng(process).shuffle(order)  # the processes meet on the shared keys
    puts = [f"own-{process}-{k}" for k in range(own)] + [f"same-{k}" for k in order]
    for key in puts:
        cache.put(key, block_value(key, nbytes))
    torn, race_errors = _race(store, "race", nbytes, race)
    try:
        cache.flush()
    except cfj.StoreError as err:
        errors.append(repr(err))
    barrier(folder, "written", process, processes)
    wanted = [f"own-{p}-{k}" for p in range(processes) if p != process for k in range(own)]
    wanted += [f"same-{k}" for k in range(same)] + (["race"] if race else [])
    found, wrong, wrong_bytes, lost = 0, 0, 0, 0
    for lo in range(0, len(wanted), 64):
        keys = wanted[lo : lo + 64]
        try:
            blocks, missing = cache.get_found(keys)
        except (KeyError, cfj.StoreError) as err:
            errors.append(repr(err))
            continue
        lost += len(missing)
        for key, got in blocks.items():
            want = block_value(key, nbytes)
            if same_block(got, want):
                found += key.startswith("own-")
            else:
                wrong += 1
                wrong_bytes += sum(v.nbytes for v in want.values())
    counts = delta(kvstore_counts(), counts)
    seconds = time.perf_counter() - start
    driver = "s3" if spec["url"].startswith("s3://") else "file"
    return {
        "process": process,
        "puts": len(puts),
        "found_from_others": found,
        "expected_from_others": own * (processes - 1),
        "wrong_blocks": wrong,
        "wrong_bytes": wrong_bytes,
        "lost": lost,
        "errors": errors,
        "conflicts": cache.stats()["writebacks"]["conflicts"],
        "race_publishes": race,
        "race_torn_reads": torn,
        "race_errors": race_errors,
        "seconds": seconds,
        "l3_requests": requests(counts, driver),
        "l3_requests_per_second": requests(counts, driver) / seconds,
        "l3_bytes_read": counts.get(f"{driver}.bytes_read", 0),
        "l3_bytes_written": counts.get(f"{driver}.bytes_written", 0),
    }


def _race(store: Any, key: str, nbytes: int, times: int) -> tuple[int, list[str]]:
    """Publishes ``key`` ``times`` times (the same value) while a thread reads it back; returns
    the torn or wrong reads and the errors."""
    want = block_value(key, nbytes)
    done = threading.Event()
    torn = [0]
    errors: list[str] = []

    def read() -> None:
        while not done.is_set():
            try:
                got = store.read(key).result(timeout=60)
            except KeyError:
                continue  # not published yet
            except Exception as err:  # a damaged block would land here
                torn[0] += 1
                errors.append(repr(err))
                continue
            torn[0] += not same_block(got, want)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        for _ in range(times):
            try:
                store.write(key, want).result(timeout=60)
            except Exception as err:
                errors.append(repr(err))
    finally:
        done.set()
        reader.join()
    return torn[0], errors


# ------------------------------------------------------------------------------------ writer


def writer(spec: dict[str, Any]) -> None:
    """The ``writer`` role: publishes large blocks until killed, logging each write's start and
    end (flushed) to ``spec["log"]``."""
    import cacheflow_jax as cfj

    store = cfj.open_store(spec["url"], create=True, shared=True)
    nbytes = spec["block_bytes"]
    with open(spec["log"], "a", buffering=1) as log:
        for n in range(10**9):
            key = f"kill-{spec['round']}-{n}"
            value = block_value(key, nbytes)
            log.write(f"begin {key}\n")
            store.write(key, value).result(timeout=60)
            log.write(f"end {key}\n")


def main(argv: list[str]) -> int:
    role, spec = argv[0], json.loads(argv[1])
    if role == "writer":
        writer(spec)
        return 0
    result = {"restore": restore, "kv": kv}[role](spec)
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
