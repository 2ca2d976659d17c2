"""``cacheflow verify``: record, or check, the CRC-32C of every chunk of an orbax checkpoint.

Orbax's data chunks carry no checksum, so a flipped byte in a checkpoint is restored silently, by
orbax too. `verify_checkpoint` reads every chunk once and records its CRC-32C in a manifest kept
beside the checkpoint (``<checkpoint directory>.cacheflow-manifest.json``; the format is
``manifest.CHECKPOINT_MANIFEST_FORMAT``), never inside it. From then on `open_store` checks every
read of that checkpoint against it, and a later ``verify`` checks every chunk. Record the manifest
right after saving: it vouches for the bytes as they are when it is recorded.

A ``CheckpointManager`` deletes old steps (``max_to_keep``) but knows nothing of the manifests
beside them: `orphaned_manifests` lists those whose step is gone, and `verify_checkpoint` of the
root removes them.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cacheflow_jax.core.blocks import CorruptBlockError, StoreError, block_key
from cacheflow_jax.store.futures import Deadline, wait_for
from cacheflow_jax.store.locations import list_keys, open_kvstore
from cacheflow_jax.store.manifest import block_crc32c, encode_checkpoint_manifest
from cacheflow_jax.store.open import open_store
from cacheflow_jax.store.orbax_source import MANIFEST_SUFFIX
from cacheflow_jax.store.runtime_format import atomic_write_file
from cacheflow_jax.store.tensorstore_store import TensorStoreStore

# Chunks read at once: bounds the memory a verify takes on a large checkpoint.
BATCH_BYTES = 256 * 2**20
# The manifest of step N of a CheckpointManager root, beside the step directory.
_STEP_MANIFEST = re.compile(r"(\d+)" + re.escape(MANIFEST_SUFFIX))


def verify_checkpoint(
    path: str | os.PathLike[str] | Mapping[str, Any],
    *,
    step: int | None = None,
    update: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Records the CRC-32C of every chunk of an orbax checkpoint beside it, or checks them.

    Without a manifest (or with ``update``), every chunk is read, decoded and its CRC-32C
    recorded; a chunk that cannot be decoded (truncated, damaged) is reported and nothing is
    recorded. With a manifest, every chunk is read and checked against it.

    Args:
      path: an orbax checkpoint: a ``CheckpointManager`` root (its latest step, or ``step``), a
        step directory or an item directory (anything `cacheflow_jax.open_store` takes).
      step: the step of a root to verify.
      update: record a new manifest even if one exists (after the checkpoint was saved again).
      progress: called with (bytes done, bytes in all) after each batch of chunks.

    Returns:
      ``{"checkpoint", "manifest", "status": "recorded" | "ok" | "corrupt", "arrays",
      "chunks", "nbytes", "errors": [message, ...], "removed": [manifest, ...]}``;
      ``removed`` lists the manifests of a root's deleted steps (see `orphaned_manifests`),
      removed once the step verified is not corrupt.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      StoreError: ``path`` is not an orbax checkpoint, or the manifest cannot be written next
        to it (a checkpoint at the root of a bucket has no place beside it).
    """
    # The manifest covers the stored chunks, whatever block size serves them.
    store = open_store(path, step=step, manifest=not update).with_block_bytes(None)
    if store.source != "orbax" or store.manifest_location is None:
        raise StoreError(
            f"{store.spec} is not an orbax checkpoint with a place beside it for a manifest; "
            "stores written by write_store carry their own chunk manifest and are checked on "
            "every read already"
        )
    checking = store.manifest is not None
    chunks = [(p, idx) for p, a in store.arrays().items() for idx in _grid(a.grid_shape)]
    total = sum(a.nbytes for a in store.arrays().values())
    crcs: dict[str, list[int]] = {p: [] for p in store.arrays()}
    errors: list[str] = []
    batches: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for p, idx in chunks:
        nbytes = store.info(block_key(p, idx)).nbytes
        if batches[-1] and size + nbytes > BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append((p, idx))
        size += nbytes
    done = 0
    for batch in batches:
        done += _check_batch(store, batch, crcs, errors)
        if progress is not None:
            progress(done, total)
    spec, name, where = store.manifest_location
    report = {
        "checkpoint": store.spec,
        "manifest": where,
        "arrays": len(crcs),
        "chunks": len(chunks),
        "nbytes": total,
        "errors": errors,
        "removed": [],
    }
    if errors:
        report["status"] = "corrupt"
        return report
    report["removed"] = _remove(spec, orphaned_manifests(store))
    if checking:
        report["status"] = "ok"
        return report
    data = encode_checkpoint_manifest(crcs, store.checkpoint_fingerprint() or "")
    if spec.get("driver") == "file":
        atomic_write_file(os.path.join(str(spec.get("path", "")), name), data)
    else:
        kv = open_kvstore(spec, where)
        wait_for(kv.write(name, data), Deadline(60.0), f"writing {where}")
    report["status"] = "recorded"
    return report


def orphaned_manifests(store: TensorStoreStore) -> list[str]:
    """The chunk manifests beside a ``CheckpointManager`` root whose step is gone.

    Orbax deletes old steps (``max_to_keep``) and leaves the manifests ``cacheflow verify``
    wrote beside them. Only a store opened at a root has steps to compare with.

    Args:
      store: a store opened by `open_store`.

    Returns:
      The manifests' names (``3.cacheflow-manifest.json``), sorted; empty for a store that is not
      a ``CheckpointManager`` root.

    Raises:
      StoreError: the root cannot be listed.
    """
    if not store.steps or store.manifest_location is None:
        return []
    spec = store.manifest_location[0]
    if spec.get("driver") == "file":
        try:
            names = os.listdir(str(spec.get("path", "")))
        except FileNotFoundError:
            return []
    else:
        kv = open_kvstore(spec, store.spec)
        names = [k for k in list_keys(kv, store.spec, Deadline(60.0)) if "/" not in k]
    gone = []
    for name in names:
        m = _STEP_MANIFEST.fullmatch(name)
        if m is not None and int(m.group(1)) not in store.steps:
            gone.append(name)
    return sorted(gone)


def _remove(spec: Mapping[str, Any], names: list[str]) -> list[str]:
    """Removes the manifests ``names`` from the directory ``spec``; returns them."""
    if spec.get("driver") == "file":
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(str(spec.get("path", "")), name))
        return names
    kv = open_kvstore(spec, "the manifests' directory")
    for name in names:
        wait_for(kv.write(name, None), Deadline(60.0), f"removing {name}")
    return names


def _grid(grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in idx) for idx in np.ndindex(*grid)]


def _check_batch(
    store: TensorStoreStore,
    batch: list[tuple[str, tuple[int, ...]]],
    crcs: dict[str, list[int]],
    errors: list[str],
) -> int:
    """Reads one batch of chunks (all issued at once); records CRCs or errors; returns bytes."""
    keys = [block_key(p, idx) for p, idx in batch]
    futures = store.read_many(keys)
    nbytes = 0
    for (p, _), future in zip(batch, futures, strict=True):
        try:
            value = future.result()
        except (CorruptBlockError, StoreError) as err:
            errors.append(str(err))
            crcs[p].append(0)
            continue
        crcs[p].append(block_crc32c(value))
        nbytes += value.nbytes
    return nbytes
