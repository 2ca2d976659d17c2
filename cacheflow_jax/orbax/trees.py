"""`restore_lazy`'s trees and locations: a checkpoint's skeleton mapped to leaves, a target
tree matched by key path, and whether a path and a store name the same checkpoint."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from cacheflow_jax.store.orbax_source import ORBAX_MARKERS
from cacheflow_jax.store.tensorstore_store import TensorStoreStore


def key_name(k: Any) -> str:
    """One key path entry as it appears in an array path."""
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def restore_into(target: Any, store: TensorStoreStore, leaf: Any) -> Any:
    """The checkpoint's leaves in ``target``'s structure (orbax's ``StandardRestore(target)``):
    ``leaf(array path, target leaf)`` for each.

    Raises:
      ValueError: a target leaf has no array in the checkpoint, or another shape or dtype.
    """
    arrays = store.arrays()
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    out, missing, wrong = [], [], []
    for kp, want in flat:
        names = [key_name(k) for k in kp]
        path = "/".join(names)
        if path not in arrays and names and names[-1] == "value":
            path = "/".join(names[:-1])  # an NNX variable's value, saved from a pure dict
        info = arrays.get(path)
        if info is None:
            missing.append("/".join(names))
            out.append(None)
            continue
        shape, dtype = getattr(want, "shape", None), getattr(want, "dtype", None)
        if (
            shape is not None
            and tuple(shape) != info.shape
            or (dtype is not None and np.dtype(dtype) != info.dtype)
        ):
            wrong.append(
                f"{path}: target {tuple(shape or ())} {dtype}, stored {info.shape} {info.dtype}"
            )
        out.append(leaf(path, want))
    if missing or wrong:
        raise ValueError(
            f"target does not match checkpoint {store.spec}: "
            + (
                f"no array for {missing[:5]} (the checkpoint has {sorted(arrays)[:5]}...)"
                if missing
                else ""
            )
            + ("; " if missing and wrong else "")
            + (f"shape or dtype differ for {wrong[:5]}" if wrong else "")
            + ". Build the target from the model that was saved (nnx.eval_shape), or restore "
            "without target= and cast after materialize()"
        )
    return jax.tree_util.tree_unflatten(treedef, out)


def map_skeleton(node: Any, leaf: Any) -> Any:
    """Rebuilds ``store.tree()``'s skeleton, mapping each array path string with ``leaf``."""
    if isinstance(node, str):
        return leaf(node)
    if isinstance(node, dict):
        return {k: map_skeleton(v, leaf) for k, v in node.items()}
    if isinstance(node, list):
        return [map_skeleton(v, leaf) for v in node]
    return node


def label(path: Any) -> str:
    """A short text for ``path`` in error messages."""
    return str(dict(path)) if isinstance(path, Mapping) else os.fspath(path)


def item_dir(local: Path) -> Path:
    """The orbax item directory of a local item or single-item step directory (else itself)."""
    if any((local / m).exists() for m in ORBAX_MARKERS):
        return local
    try:
        items = [p for p in local.iterdir() if any((p / m).exists() for m in ORBAX_MARKERS)]
    except OSError:
        return local
    return items[0] if len(items) == 1 else local


def spec_location(spec: Mapping[str, Any]) -> tuple[str, str]:
    """(everything but the path, the path) of a kvstore spec."""
    rest = sorted((k, repr(v)) for k, v in spec.items() if k != "path")
    return repr(rest), str(spec.get("path", "")).strip("/")


def path_locations(path: Any) -> set[tuple[str, str]]:
    """The canonical locations of a path, URL or kvstore spec, as (base, path) pairs.

    Raises:
      FileNotFoundError: a local path does not exist.
    """
    if isinstance(path, Mapping):
        spec = dict(path["kvstore"]) if "kvstore" in path else dict(path)
        if spec.get("driver") != "file":
            return {spec_location(spec)}
        path = str(spec.get("path", ""))
    text = os.fspath(path)
    scheme, sep, rest = text.partition("://")
    if sep and scheme != "file":
        return {(scheme + "://", rest.strip("/"))}
    local = Path(rest if sep else text).expanduser().absolute()
    if not local.exists():
        raise FileNotFoundError(
            f"no orbax checkpoint at {local}: the path does not exist; pass an item directory "
            "or a CheckpointManager step directory"
        )
    return {("file", os.path.realpath(item_dir(local)))}


def store_locations(store: TensorStoreStore) -> set[tuple[str, str]]:
    """The canonical locations of an open store, as (base, path) pairs."""
    spec = store.kvstore_spec
    if spec.get("driver") == "file":
        local = Path(str(spec.get("path", "")))
        if store.step is not None:
            # Opened at a CheckpointManager root: the root and the step opened are this store.
            step_dir = local / str(store.step)
            return {
                ("file", os.path.realpath(local)),
                ("file", os.path.realpath(item_dir(step_dir))),
            }
        return {("file", os.path.realpath(item_dir(local)) if local.exists() else str(local))}
    out = {spec_location(spec)}
    scheme, sep, rest = store.spec.partition("://")
    if sep:
        out.add((scheme + "://", rest.strip("/")))
    return out


def check_same_checkpoint(path: Any, store: TensorStoreStore) -> None:
    """Raises ValueError unless ``store`` reads the checkpoint at ``path``.

    Raises:
      FileNotFoundError: ``path`` is a local path that does not exist.
      ValueError: ``store`` is somewhere else.
    """
    have = store_locations(store)
    for base, want in path_locations(path):
        for other_base, got in have:
            if base != other_base:
                continue
            if want == got:
                return
            # A step directory and its single item (local paths are resolved to the item already).
            short, long = sorted((want, got), key=len)
            if (
                base != "file"
                and long.startswith(short + "/")
                and "/" not in long[len(short) + 1 :]
            ):
                return
    raise ValueError(
        f"restore_lazy({label(path)!r}, cache=...): the cache reads store {store.spec}, not "
        f"this checkpoint; build the cache over open_store({label(path)!r}), or omit cache= "
        "and pass device_bytes= and host_bytes="
    )
