"""``cacheflow inspect``: the arrays, chunk shapes, blocks and block keys of a store."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from cacheflow_jax.cli.common import human_size, table_lines
from cacheflow_jax.core.blocks import KEY_SEPARATOR


def inspect_store(path: str, *, step: int | None = None) -> dict[str, Any]:
    """Describes a store or orbax checkpoint: its arrays, chunk shapes, blocks and block keys.

    Args:
      path: anything `cacheflow_jax.open_store` takes.
      step: the step of a ``CheckpointManager`` root to describe (default: the latest).

    Returns:
      ``{"store", "source", "arrays": [{"path", "shape", "dtype", "chunk_shape", "grid_shape",
      "blocks", "nbytes", "first_key", "last_key"}], "keys": [{"key", "nbytes", "shape",
      "dtype"}], "array_blocks", "runtime_blocks", "blocks", "nbytes", "steps", "step",
      "manifest", "runtime"}``; ``keys`` lists every block the cache can be asked for
      (``get(key)``), chunks first, then runtime blocks; ``steps`` lists a
      ``CheckpointManager`` root's steps.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      cacheflow_jax.StoreError: ``path`` is not a store or checkpoint.
    """
    from cacheflow_jax.core.blocks import block_key
    from cacheflow_jax.store.open import open_store

    store = open_store(path, step=step)
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
    runtime = sum(KEY_SEPARATOR not in k["key"] for k in keys)
    return {
        "store": store.spec,
        "source": store.source,
        "arrays": arrays,
        "keys": keys,
        "array_blocks": len(keys) - runtime,
        "runtime_blocks": runtime,
        "blocks": len(keys),
        "nbytes": sum(a["nbytes"] for a in arrays),
        # A CheckpointManager root: its steps, and the one listed (the latest).
        "steps": list(store.steps),
        "step": store.step,
        "manifest": store.manifest,
        "runtime": store.runtime_spec,
    }


_RUNTIME_SHOWN = 5


def _format_inspect(report: dict[str, Any]) -> str:
    """The ``inspect`` report as a table of arrays with their key ranges, plus a summary."""
    header = ("array", "shape", "dtype", "chunk", "blocks", "size", "keys")
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
        f"{report['array_blocks']} array blocks, {report['runtime_blocks']} runtime blocks, "
        f"{human_size(report['nbytes'])}; dtypes: {', '.join(dtypes) or '-'}; "
        "every key: cacheflow inspect --keys"
    )
    if report.get("steps"):
        lines.append(
            f"CheckpointManager steps: {', '.join(map(str, report['steps']))} "
            f"(listed: step {report['step']}, the latest; open another with step=N)"
        )
    if not report["arrays"]:
        lines.append("no arrays: this location holds no stored arrays")
    if report.get("manifest"):
        lines.append(f"chunk manifest (checked on every read): {report['manifest']}")
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``cacheflow inspect``: the report as a table, JSON (``--json``) or keys (``--keys``)."""
    report = inspect_store(args.path, step=args.step)
    if args.json:
        print(json.dumps(report, indent=1))
    elif args.keys:
        for k in report["keys"]:
            print(f"{k['key']}\t{k['nbytes']}")
    else:
        print(_format_inspect(report))
    return 0
