"""``cacheflow inspect``: the arrays, chunk shapes, blocks and block keys of a store."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from cacheflow_jax.cli.common import check_store_location, human_size, table_lines
from cacheflow_jax.core.blocks import KEY_SEPARATOR


def inspect_store(
    path: str, *, step: int | None = None, block_bytes: int | None = None
) -> dict[str, Any]:
    """Describes a store or orbax checkpoint: its arrays, chunk shapes, blocks and block keys.

    The keys are the ones a cache over the store serves, at any budget: the store's own blocks
    (at most 4 MiB for a checkpoint; see `cacheflow_jax.open_store`), or those of
    ``block_bytes`` when given, as ``TieredCache(..., block_bytes=)`` cuts them.

    Args:
      path: anything `cacheflow_jax.open_store` takes.
      step: the step of a ``CheckpointManager`` root to describe (default: the latest).
      block_bytes: describe the blocks of this size instead of the store's own.

    Returns:
      ``{"store", "source", "arrays": [{"path", "shape", "dtype", "chunk_shape",
      "stored_chunk_shape", "grid_shape", "blocks", "nbytes", "first_key", "last_key"}],
      "keys": [{"key", "nbytes", "shape", "dtype"}], "array_blocks", "runtime_blocks",
      "blocks", "nbytes", "runtime_nbytes", "block_bytes", "steps", "step", "manifest",
      "orphaned_manifests", "runtime"}``; ``keys`` lists every block the cache can be asked
      for (``get(key)``), chunks first, then runtime blocks; ``steps`` lists a
      ``CheckpointManager`` root's steps; ``orphaned_manifests`` the chunk manifests beside
      it whose step is gone.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      cacheflow_jax.StoreError: ``path`` is not a store or checkpoint.
    """
    from cacheflow_jax.core.blocks import block_key
    from cacheflow_jax.store.open import open_store
    from cacheflow_jax.store.verify import orphaned_manifests

    store = open_store(path, step=step, block_bytes=block_bytes)
    arrays = []
    for info in store.arrays().values():
        grid = info.grid_shape
        blocks = 1
        for g in grid:
            blocks *= g
        arrays.append(
            {
                "path": info.path,
                "shape": list(info.shape),
                "dtype": info.dtype.name,
                "chunk_shape": list(info.chunk_shape),
                "stored_chunk_shape": list(info.stored_chunks),
                "grid_shape": list(grid),
                "blocks": blocks,
                "nbytes": info.nbytes,
                "first_key": block_key(info.path, [0] * len(grid)),
                "last_key": block_key(info.path, [max(g - 1, 0) for g in grid]),
            }
        )
    keys = []
    for key in store.keys():
        block = store.info(key)
        keys.append(
            {
                "key": key,
                "nbytes": block.nbytes,
                "shape": list(block.shape),
                "dtype": block.dtype.name,
            }
        )
    runtime = [k for k in keys if KEY_SEPARATOR not in k["key"]]
    return {
        "store": store.spec,
        "source": store.source,
        "arrays": arrays,
        "keys": keys,
        "array_blocks": len(keys) - len(runtime),
        "runtime_blocks": len(runtime),
        "blocks": len(keys),
        "nbytes": sum(a["nbytes"] for a in arrays),
        "runtime_nbytes": sum(k["nbytes"] for k in runtime),
        "block_bytes": store.block_bytes,
        # A CheckpointManager root: its steps, and the one listed (the latest).
        "steps": list(store.steps),
        "step": store.step,
        "manifest": store.manifest,
        "orphaned_manifests": orphaned_manifests(store) if store.source == "orbax" else [],
        "runtime": store.runtime_spec,
    }


_RUNTIME_SHOWN = 5


def _format_inspect(report: dict[str, Any]) -> str:
    """The ``inspect`` report as a table of arrays with their key ranges, plus a summary."""
    header = ("array", "shape", "dtype", "block", "blocks", "size", "keys")
    cells: list[Sequence[str]] = [header]
    for a in report["arrays"]:
        first, last = a["first_key"], a["last_key"]
        cells.append(
            (
                a["path"],
                "(" + ", ".join(map(str, a["shape"])) + ")",
                a["dtype"],
                "(" + ", ".join(map(str, a["chunk_shape"])) + ")",
                str(a["blocks"]),
                human_size(a["nbytes"]),
                first if first == last else f"{first} .. {last}",
            )
        )
    lines = table_lines(cells, right={4, 5})
    runtime = [k for k in report["keys"] if KEY_SEPARATOR not in k["key"]]
    if runtime:
        shown = ", ".join(f"{k['key']} ({human_size(k['nbytes'])})" for k in runtime[:_RUNTIME_SHOWN])
        more = len(runtime) - _RUNTIME_SHOWN
        lines.append(f"runtime blocks: {shown}" + (f", and {more} more" if more > 0 else ""))
    dtypes = sorted({a["dtype"] for a in report["arrays"]})
    lines.append(
        f"{report['store']} ({report['source']}): {len(report['arrays'])} arrays, "
        f"{report['array_blocks']} array blocks ({human_size(report['nbytes'])}), "
        f"{report['runtime_blocks']} runtime blocks ({human_size(report['runtime_nbytes'])}); "
        f"dtypes: {', '.join(dtypes) or '-'}; every key: cacheflow inspect --keys"
    )
    cut = [a["path"] for a in report["arrays"] if a["chunk_shape"] != a["stored_chunk_shape"]]
    if cut:
        lines.append(
            f"{len(cut)} arrays stored as chunks larger than {human_size(report['block_bytes'])} "
            f"are served as blocks of their leading rows (e.g. {cut[0]}); a key names the same "
            "block at every budget (--block-bytes lists other blocks)"
        )
    if report.get("steps"):
        lines.append(
            f"CheckpointManager steps: {', '.join(map(str, report['steps']))} "
            f"(listed: step {report['step']}, the latest; open another with --step N)"
        )
    if not report["arrays"]:
        lines.append("no arrays: this location holds no stored arrays")
    if report.get("manifest"):
        lines.append(f"chunk manifest (checked on every read): {report['manifest']}")
    elif report["source"] == "orbax":
        which = "" if report.get("step") is None else f" for step {report['step']}"
        if report.get("steps") and report.get("step") == max(report["steps"]):
            which += " (the newest)"
        lines.append(
            f"no chunk manifest{which}: reads are not checked against one; record it with "
            "`cacheflow verify`"
        )
    if report.get("orphaned_manifests"):
        lines.append(
            f"manifests of deleted steps (the CheckpointManager removed them, max_to_keep): "
            f"{', '.join(report['orphaned_manifests'])}; `cacheflow verify` removes them"
        )
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``cacheflow inspect``: the report as a table, JSON (``--json``) or keys (``--keys``)."""
    check_store_location(args.path)
    report = inspect_store(args.path, step=args.step, block_bytes=args.block_bytes)
    if args.json:
        print(json.dumps(report, indent=1))
    elif args.keys:
        for k in report["keys"]:
            print(f"{k['key']}\t{k['nbytes']}")
    else:
        print(_format_inspect(report))
    return 0
