"""`write_store`: writes a pytree of arrays as a cacheflow store (zarr3, CRC32C-checked chunks).

Each leaf becomes one zarr3 array whose chunks (`chunk_shape_for`) each get a file, encoded with
the ``bytes`` and ``crc32c`` codecs (the fast read path's layout, see ``fastread``). The root
group records the leaves' key paths, a fingerprint of each array's metadata and the chunk
manifest's CRC (see ``zarr_source`` and ``manifest``), and marks the store complete only once
every chunk is written. The written store is opened with `open_store`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from cacheflow_jax.core.blocks import KEY_SEPARATOR, StoreError
from cacheflow_jax.store.futures import wait_all
from cacheflow_jax.store.locations import CONTEXT, join_spec, list_keys, open_kvstore, resolve
from cacheflow_jax.store.manifest import MANIFEST_NAME, array_crcs, chunk_crc32c, encode_manifest
from cacheflow_jax.store.open import open_store
from cacheflow_jax.store.runtime_format import RUNTIME_PREFIX, numeric
from cacheflow_jax.store.tensorstore_store import TensorStoreStore
from cacheflow_jax.store.tree import key_part
from cacheflow_jax.store.zarr_source import ATTR, array_fingerprint

__all__ = ["chunk_shape_for", "write_store"]

_CODECS: list[dict[str, Any]] = [
    {"name": "bytes", "configuration": {"endian": "little"}},
    {"name": "crc32c"},
]


def chunk_shape_for(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """The regular chunk shape :func:`write_store` uses: each chunk at most ``chunk_bytes``.

    Trailing dimensions are kept whole while they fit; the first one that does not is split,
    and every dimension before it gets chunk size 1. Chunk sizes are at least 1.

    Args:
      shape: the array's shape.
      itemsize: bytes per element.
      chunk_bytes: the largest chunk in bytes (> 0).

    Returns:
      The chunk shape (``()`` for a 0-d array).

    >>> chunk_shape_for((10, 4, 8), 4, 256)
    (2, 4, 8)
    """
    budget = max(1, chunk_bytes // max(1, itemsize))
    out = [1] * len(shape)
    inner = 1
    for d in range(len(shape) - 1, -1, -1):
        size = max(1, int(shape[d]))
        if inner * size <= budget:
            out[d] = size
            inner *= size
        else:
            out[d] = max(1, budget // inner)
            break
    return tuple(out)


def write_store(
    tree: Any,
    path: str | os.PathLike[str] | Mapping[str, Any],
    *,
    chunk_bytes: int = 4 * 2**20,
    chunk_bytes_for: Mapping[str, int] | None = None,
    overwrite: bool = False,
    s3_endpoint: str | None = None,
    s3_region: str | None = None,
) -> TensorStoreStore:
    """Writes a pytree of arrays as a cacheflow store (zarr3, CRC32C-checked chunks).

    Each leaf becomes the array ``"/".join(key path)`` (``{"params": {"w": x}}`` ->
    ``params/w``; list index -> ``0``); a bare array is named ``array``. All arrays are written
    concurrently, every chunk gets a file (all-zero ones too), and the root group records a
    fingerprint of each array's metadata. The root group marks the store incomplete until every
    chunk is written, so an interrupted write is refused on open instead of serving zero-filled
    chunks; a chunk missing later, or an edited ``zarr.json``, is an error on read or open.

    With ``overwrite=True`` only a cacheflow store (or an empty location) is replaced. A local
    store is written beside the old one and swapped in only when complete, so a failed write
    leaves the old store as it was; other locations are cleared first (after every leaf has
    been checked). Runtime blocks (``_runtime/``, KV blocks other processes may be serving)
    are kept either way: only the arrays are replaced. To publish new weights while processes
    still serve the old ones, write them to a new location instead (docs/scale.md).

    Args:
      tree: nested dicts/lists/tuples of numpy or JAX arrays (or numbers).
      path: where to write: as for :func:`open_store`.
      chunk_bytes: the largest chunk (= block) in bytes; see :func:`chunk_shape_for`.
      chunk_bytes_for: the largest chunk of some arrays, by array path (``"text/embed"``) or
        by folder (``"vision/"``: every array under it); the longest match wins, and the other
        arrays use ``chunk_bytes``. As orbax's per-leaf ``SaveArgs(chunk_byte_size=...)``: an
        embedding table wants small chunks (rows are read a few at a time), weights whole ones.
      overwrite: replace an existing cacheflow store at ``path``.
      s3_endpoint: as for :func:`open_store`.
      s3_region: as for :func:`open_store`.

    Returns:
      The written store, opened.

    Raises:
      ValueError: ``chunk_bytes`` <= 0, a leaf is not a numeric array, a leaf's name is not
        usable as an array path, two leaves map to the same array path, or an entry of
        ``chunk_bytes_for`` has no positive size or names no array.
      FileExistsError: ``path`` holds data and ``overwrite`` is False, or ``path`` holds data
        that is not a cacheflow store (never deleted).
      StoreError: a write failed.

    >>> store = write_store({"w": np.ones((4, 4), np.float32)}, "memory://doc/", overwrite=True)
    >>> store.keys()
    ('w@0,0',)
    """
    _check_chunk_bytes("chunk_bytes", chunk_bytes)
    kv_spec, label, local = resolve(path, s3_endpoint, s3_region)
    leaves = _leaves_to_write(tree)
    sizes = _chunk_sizes(list(leaves), int(chunk_bytes), chunk_bytes_for or {})
    if local is not None and local.exists() and not local.is_dir():
        raise FileExistsError(f"{local} is a file, not a store directory; choose another path")
    kv = open_kvstore(kv_spec, label)
    existing = list_keys(kv, label)
    if existing:
        if not overwrite:
            raise FileExistsError(
                f"{label} already holds data; pass overwrite=True to replace it, or choose "
                "another path"
            )
        _check_replaceable(kv, label, existing)
    if local is not None and existing:
        _write_local_swap(leaves, local, sizes)
    else:
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
        if existing:
            _clear_data(kv, label)
        _write_arrays(kv, kv_spec, label, leaves, sizes)
    return open_store(path, s3_endpoint=s3_endpoint, s3_region=s3_region)


def _check_chunk_bytes(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{what} must be a positive number of bytes, got {value!r}")


def _chunk_sizes(names: list[str], default: int, chosen: Mapping[str, int]) -> dict[str, int]:
    """Each array's largest chunk: the longest entry of ``chosen`` that covers it (its path, or
    a folder above it ending in ``/``), else ``default``."""

    def covers(entry: str, name: str) -> bool:
        return name == entry or (entry.endswith("/") and name.startswith(entry))

    for entry, size in chosen.items():
        _check_chunk_bytes(f"chunk_bytes_for[{entry!r}]", size)
        if not any(covers(entry, name) for name in names):
            shown = ", ".join(sorted(names)[:8]) + (", ..." if len(names) > 8 else "")
            raise ValueError(
                f"chunk_bytes_for names {entry!r}, which is no array path or folder of the tree "
                f"(its arrays: {shown}); give an array's path, or a folder ending in '/'"
            )
    out = {}
    for name in names:
        entries = [entry for entry in chosen if covers(entry, name)]
        out[name] = int(chosen[max(entries, key=len)]) if entries else default
    return out


def _leaves_to_write(tree: Any) -> dict[str, tuple[np.ndarray, list[list]]]:
    """Checks every leaf of ``tree`` and names it (before anything on disk is touched)."""
    leaves: dict[str, tuple[np.ndarray, list[list]]] = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [key_part(k) for k in kp]
        names = [str(k) for _, k in parts]
        name = "/".join(names) if names else "array"
        if any(not n or "/" in n or KEY_SEPARATOR in n for n in names) or name.split("/")[
            0
        ] == RUNTIME_PREFIX.rstrip("/"):
            raise ValueError(
                f"cannot name leaf {jax.tree_util.keystr(kp)!r} as an array path: keys must be "
                f"non-empty and contain no '/' or {KEY_SEPARATOR!r}, and a top-level "
                f"{RUNTIME_PREFIX.rstrip('/')!r} is reserved for runtime blocks; rename it"
            )
        if name in leaves:
            raise ValueError(f"two leaves map to the same array path {name!r}; rename one")
        arr = np.asarray(leaf)
        if not numeric(arr.dtype):
            raise ValueError(f"leaf {name!r} has dtype {arr.dtype}; only numeric arrays are stored")
        leaves[name] = (arr, [list(p) for p in parts])
    return leaves


def _check_replaceable(kv: ts.KvStore, label: str, keys: Sequence[str]) -> None:
    """Raises FileExistsError unless the keys under ``kv`` are a cacheflow store's."""
    attr = None
    if "zarr.json" in keys:
        try:
            meta = json.loads(wait_all([kv.read("zarr.json")], f"reading {label}")[0].value)
            attr = (meta.get("attributes") or {}).get(ATTR) if isinstance(meta, dict) else None
        except (StoreError, ValueError):
            attr = None
    if not isinstance(attr, Mapping) or "complete" not in attr:
        others = [k for k in keys if not k.startswith(RUNTIME_PREFIX)][:3] or list(keys[:3])
        raise FileExistsError(
            f"{label} holds data that is not a store written by write_store (e.g. {others}); "
            "overwrite=True only replaces cacheflow stores, so nothing was deleted. Choose "
            "another path, or remove the data yourself"
        )


def _clear_data(kv: ts.KvStore, label: str) -> None:
    """Deletes every key under ``kv`` but the runtime blocks' (``_runtime/``)."""
    prefix = RUNTIME_PREFIX.encode()
    after = prefix[:-1] + bytes([prefix[-1] + 1])  # the first key past the prefix
    ranges = [ts.KvStore.KeyRange(b"", prefix), ts.KvStore.KeyRange(after, b"")]
    wait_all([kv.delete_range(r) for r in ranges], f"clearing the arrays of {label}")


def _write_local_swap(
    leaves: dict[str, tuple[np.ndarray, list[list]]], local: Path, sizes: Mapping[str, int]
) -> None:
    """Writes a new store beside ``local`` and swaps it in once complete; the runtime blocks
    move into the new store (blocks published during the swap are moved after it)."""
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    stage = local.parent / f".{local.name}.cacheflow-new-{tag}"
    old = local.parent / f".{local.name}.cacheflow-old-{tag}"
    spec = {"driver": "file", "path": str(stage) + "/"}
    try:
        stage.mkdir()
        _write_arrays(open_kvstore(spec, str(stage)), spec, str(local), leaves, sizes)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    runtime = RUNTIME_PREFIX.rstrip("/")
    if (local / runtime).is_dir():
        os.rename(local / runtime, stage / runtime)
    os.rename(local, old)
    os.rename(stage, local)
    _move_blocks(old / runtime, local / runtime)
    shutil.rmtree(old, ignore_errors=True)


def _move_blocks(src: Path, dst: Path) -> None:
    """Moves the block files of ``src`` that ``dst`` lacks into it (temporaries are left)."""
    if not src.is_dir():
        return
    dst.mkdir(exist_ok=True)
    for path in src.iterdir():
        if not path.name.startswith(".") and not (dst / path.name).exists():
            os.rename(path, dst / path.name)


def _write_arrays(
    kv: ts.KvStore,
    kv_spec: Mapping[str, Any],
    label: str,
    leaves: dict[str, tuple[np.ndarray, list[list]]],
    sizes: Mapping[str, int],
) -> None:
    """Writes the arrays under an empty ``kv`` (``sizes``: each one's largest chunk in bytes);
    the root group is marked complete last."""

    def group(complete: bool, arrays: Mapping[str, Any], manifest: bytes = b"") -> bytes:
        attr: dict[str, Any] = {"complete": complete, "arrays": arrays}
        if manifest:
            attr["manifest"] = {
                "name": MANIFEST_NAME,
                "crc32c": chunk_crc32c(np.frombuffer(manifest, np.uint8), (len(manifest),)),
            }
        meta = {"zarr_format": 3, "node_type": "group", "attributes": {ATTR: attr}}
        return json.dumps(meta).encode()

    wait_all([kv.write("zarr.json", group(False, {}))], f"writing {label}/zarr.json")
    opens = []
    crcs: dict[str, list[int]] = {}
    for name, (arr, parts) in leaves.items():
        chunks = chunk_shape_for(arr.shape, arr.dtype.itemsize, sizes[name])
        crcs[name] = array_crcs(arr, chunks)
        spec = {
            "driver": "zarr3",
            "kvstore": join_spec(kv_spec, name + "/"),
            "create": True,
            # Every chunk gets a file (also all-zero ones), so every block has a checksum.
            "store_data_equal_to_fill_value": True,
            "metadata": {
                "shape": list(arr.shape),
                "data_type": arr.dtype.name,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
                "codecs": _CODECS,
                "attributes": {ATTR: {"tree_path": parts}},
            },
        }
        opens.append(ts.open(spec, context=CONTEXT))
    handles = wait_all(opens, f"creating arrays in {label}")
    writes = [h.write(arr) for h, (arr, _) in zip(handles, leaves.values(), strict=True)]
    wait_all(writes, f"writing arrays to {label}")
    metas = wait_all(
        [kv.read(name + "/zarr.json") for name in leaves], f"reading back metadata of {label}"
    )
    fingerprints = {
        name: {"fingerprint": array_fingerprint(json.loads(res.value))}
        for name, res in zip(leaves, metas, strict=True)
    }
    manifest = encode_manifest(crcs)
    wait_all([kv.write(MANIFEST_NAME, manifest)], f"writing {label}/{MANIFEST_NAME}")
    root = group(True, fingerprints, manifest)
    wait_all([kv.write("zarr.json", root)], f"writing {label}/zarr.json")
