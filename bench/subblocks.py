"""Row lookups from a one-chunk embedding table 8x the device budget: sub-blocks, read amplification.

    python -m bench.subblocks [--json] [--runs N] [--warmup N] [--out DIR] [--dir DIR]
                              [--rows N] [--dim N] [--batch 64] [--lookups N] [--zipf A]
                              [--seed N] [--block-bytes N] [--keep]

A float32 table of ``--rows`` x ``--dim`` (32 MiB by default) is stored as ONE chunk three ways,
under ``--dir`` (on disk; removed at the end unless ``--keep``):

* ``orbax``: saved by ``orbax.checkpoint.CheckpointManager`` (zarr v2, zstd, OCDBT: orbax's
  defaults); a sub-block is cut from one read of the whole chunk, the other sub-blocks are
  offered to L2;
* ``zarr3-raw``: zarr3 with only the ``bytes`` codec (written by TensorStore): a sub-block is one
  byte range of the chunk file (a partial read);
* ``write_store``: ``write_store(chunk_bytes=<the table>)`` (crc32c + manifest, the fast path):
  the chunk file is read whole and checked, as for orbax.

The cache has ``device_bytes`` = 1/8 of the table (half of it reserved for hot rows) and
``host_bytes`` = 1/4, so the table is 8x L1 and can only be served as sub-blocks (block size
1/8 of L1, the default, or ``--block-bytes``). Each run serves the same ``--lookups`` batches of ``--batch`` Zipf ids through
``session.lookup`` (variant ``cacheflow``), and the same batches with:

* ``tensorstore`` (**baseline**): plain TensorStore reads of each batch's rows
  (``handle[rows].read()``, ``cache_pool`` 0): every batch reads and decodes the whole chunk;
* ``tensorstore+pool``: the same with a ``cache_pool`` as large as the table (it keeps the
  decoded chunk after the first batch: the table in host memory, outside any budget);
* ``all-resident`` (the limit): ``jnp.take`` on the whole table on the device.

Before every pass the page cache of the store's files is dropped (``POSIX_FADV_DONTNEED``), so
each pass starts cold. Reported per store: lookup time ratio baseline / cacheflow (per run;
median and p95 over runs), and from the cache's ``stats()["l3"]``: bytes read from L3,
``read_amplification`` (bytes read from L3 per byte of the blocks served from it, siblings kept
in L2 included), and bytes read per byte of rows returned. ``file bytes`` is TensorStore's own
count of bytes read from files (orbax's are compressed; the fast path reads with ``preadv``, not
counted there).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from bench._common import Report, check_runs, fmt_ratio, parser, summarize, timed
from cacheflow_jax import TieredCache, open_store, serving, write_store
from cacheflow_jax.cli.demo import drop_page_cache

NAME = "subblocks"
STORES = ("orbax", "zarr3-raw", "write_store")
VARIANTS = ("cacheflow", "tensorstore", "tensorstore+pool", "all-resident")


def _file_bytes() -> int:
    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(v.get("value", 0) for m in metrics for v in m["values"])


def _build(table: np.ndarray, where: Path) -> dict[str, Path]:
    """The three one-chunk stores of ``table``."""
    if where.exists():
        shutil.rmtree(where)
    where.mkdir(parents=True)
    paths = {"orbax": where / "orbax", "zarr3-raw": where / "raw", "write_store": where / "ws"}
    with ocp.CheckpointManager(paths["orbax"]) as manager:
        manager.save(0, args=ocp.args.StandardSave({"embed": table}))
        manager.wait_until_finished()
    raw = paths["zarr3-raw"]
    raw.mkdir()
    (raw / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(raw / "embed")},
        "create": True,
        "metadata": {
            "shape": list(table.shape),
            "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(table.shape)}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        },
    }
    ts.open(spec).result().write(table).result()
    write_store({"embed": table}, paths["write_store"], chunk_bytes=table.nbytes)
    return paths


def _ids(args: Any, rows: int) -> list[np.ndarray]:
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(rows)
    return [
        perm[(rng.zipf(args.zipf, args.batch) - 1) % rows].astype(np.int32)
        for _ in range(args.lookups)
    ]


def _pass(variant: str, path: Path, table: np.ndarray, batches: list, args: Any) -> dict:
    """One cold pass of one variant over one store; returns time and counters."""
    device_bytes, host_bytes = table.nbytes // 8, table.nbytes // 4
    drop_page_cache(path)
    out: dict[str, Any] = {}
    files_before = _file_bytes()
    if variant == "cacheflow":
        store = open_store(path)
        # 1/8 of L1 in every layout (a cache's own default is 4 MiB blocks, whatever the
        # budget, which a table this size would not split finely enough to compare).
        block = args.block_bytes or device_bytes // 8
        cache = TieredCache(
            store, device_bytes=device_bytes, host_bytes=host_bytes, block_bytes=block
        )
        ids = [jax.device_put(b) for b in batches]
        with serving(cache, embedding_bytes=device_bytes // 2) as session:

            def run() -> None:
                for b in ids:
                    session.lookup("embed", b).block_until_ready()

            out["seconds"] = timed(run)
            stats = session.stats()
        l3 = stats["l3"]
        out["l3"] = l3
        out["row_bytes"] = sum(b.size for b in batches) * table.shape[1] * table.itemsize
        cache.check_budgets()
    elif variant.startswith("tensorstore"):
        pool = table.nbytes * 2 if variant.endswith("pool") else 0
        context = ts.Context({"cache_pool": {"total_bytes_limit": pool}})
        if path.name == "orbax":
            kv = {"driver": "ocdbt", "base": f"file://{path}/0/default/"}
            spec = {"driver": "zarr", "kvstore": {**kv, "path": "embed/"}}
        elif path.name == "raw":
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / "embed")}}
        else:
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / "embed")}}
        handle = ts.open(spec, context=context, read=True).result()

        def run() -> None:
            for b in batches:
                rows = np.unique(b)
                got = handle[rows].read().result()
                jax.device_put(got[np.searchsorted(rows, b)]).block_until_ready()

        out["seconds"] = timed(run)
    else:
        device_table = jax.device_put(table)
        ids = [jax.device_put(b) for b in batches]

        def run() -> None:
            for b in ids:
                jnp.take(device_table, b, axis=0).block_until_ready()

        out["seconds"] = timed(run)
    out["file_bytes"] = _file_bytes() - files_before
    return out


def main(argv: list[str] | None = None) -> None:
    p = parser(NAME, __doc__.split("\n\n")[0], runs=3)
    p.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent / "out" / NAME)
    p.add_argument("--rows", type=int, default=131072)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lookups", type=int, default=100)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--block-bytes", type=int, default=None, help="the cache's block size (default 1/8 of L1)"
    )
    p.add_argument("--keep", action="store_true", help="keep the stores under --dir")
    args = p.parse_args(argv)
    check_runs(args)
    rng = np.random.default_rng(args.seed)
    table = rng.standard_normal((args.rows, args.dim)).astype(np.float32)
    settings = {
        "table": f"{args.rows}x{args.dim} float32 ({table.nbytes / 2**20:.0f} MiB, one chunk)",
        "device_bytes": table.nbytes // 8,
        "host_bytes": table.nbytes // 4,
        "batch": args.batch,
        "lookups": args.lookups,
        "zipf": args.zipf,
        "block_bytes": args.block_bytes or (table.nbytes // 8) // 8,
        "runs": args.runs,
        "warmup": args.warmup,
        "load": os.getloadavg(),
    }
    report = Report(NAME, "row lookups from a one-chunk table 8x L1 (sub-blocks)", settings)
    batches = _ids(args, args.rows)
    paths = _build(table, args.dir)
    try:
        samples: dict[str, dict[str, list]] = {s: {v: [] for v in VARIANTS} for s in STORES}
        last: dict[str, dict[str, Any]] = {s: {} for s in STORES}
        order = random.Random(args.seed)
        for run in range(args.warmup + args.runs):
            for store in STORES:
                variants = list(VARIANTS)
                order.shuffle(variants)
                for variant in variants:
                    res = _pass(variant, paths[store], table, batches, args)
                    if run >= args.warmup:
                        samples[store][variant].append(res)
                        last[store][variant] = res
        rows = []
        for store in STORES:
            s = samples[store]
            ratio = summarize(
                [
                    b["seconds"] / c["seconds"]
                    for b, c in zip(s["tensorstore"], s["cacheflow"], strict=True)
                ],
                better="high",
            )
            pool = summarize(
                [
                    b["seconds"] / c["seconds"]
                    for b, c in zip(s["tensorstore+pool"], s["cacheflow"], strict=True)
                ],
                better="high",
            )
            limit = summarize(
                [
                    b["seconds"] / c["seconds"]
                    for b, c in zip(s["all-resident"], s["cacheflow"], strict=True)
                ],
                better="high",
            )
            l3 = last[store]["cacheflow"]["l3"]
            row_bytes = last[store]["cacheflow"]["row_bytes"]
            amp = summarize([c["l3"]["read_amplification"] for c in s["cacheflow"]], better="low")
            report.results[store] = {
                "ratio_tensorstore_over_cacheflow": ratio,
                "ratio_pool_over_cacheflow": pool,
                "ratio_all_resident_over_cacheflow": limit,
                "read_amplification": amp,
                "l3": l3,
                "bytes_read_per_row_byte": l3["bytes_read"] / row_bytes,
                "file_bytes": {v: s[v][-1]["file_bytes"] for v in VARIANTS},
                "seconds": {v: [r["seconds"] for r in s[v]] for v in VARIANTS},
            }
            rows.append(
                [
                    store,
                    f"{fmt_ratio(ratio['median'])} (p95 {fmt_ratio(ratio['p95'])})",
                    f"{fmt_ratio(pool['median'])} (p95 {fmt_ratio(pool['p95'])})",
                    f"{fmt_ratio(limit['median'])} (p95 {fmt_ratio(limit['p95'])})",
                    f"{amp['median']:.2f} (p95 {amp['p95']:.2f})",
                    f"{l3['bytes_read'] / 2**20:.0f} MiB",
                    f"{l3['bytes_read'] / row_bytes:.1f}",
                    f"{l3['chunk_reads']}/{l3['partial_reads']}",
                    f"{l3['siblings_kept']}/{l3['siblings_offered']}",
                    f"{s['cacheflow'][-1]['file_bytes'] / 2**20:.0f} / "
                    f"{s['tensorstore'][-1]['file_bytes'] / 2**20:.0f} MiB",
                ]
            )
        report.add_table(
            "per store: time ratios (> 1: cacheflow faster), read amplification and L3 bytes "
            "of the last run",
            [
                "store",
                "tensorstore/cacheflow",
                "ts+pool/cacheflow",
                "all-resident/cacheflow",
                "read amplification",
                "L3 bytes",
                "per row byte",
                "chunk/partial reads",
                "siblings kept/offered",
                "file bytes cacheflow / ts",
            ],
            rows,
        )
        report.notes.append(
            "without sub-blocks this table cannot be cached at all: its one chunk is 8x "
            "device_bytes (BudgetError), so every lookup reads the whole chunk, as the "
            "tensorstore baseline does"
        )
        report.notes.append(
            "the machine was shared with other jobs; ratios are per run (same data, same ids, "
            "shuffled order, page cache dropped before each pass)"
        )
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    report.emit(args)


if __name__ == "__main__":
    main()
