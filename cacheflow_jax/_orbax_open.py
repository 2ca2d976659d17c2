"""Opening an orbax checkpoint in place: its arrays are read through TensorStore, chunk by chunk.

An orbax item directory holds ``_METADATA`` (the tree, with each leaf's key path and value type)
and, with OCDBT (orbax's default), ``manifest.ocdbt`` plus data files: every leaf is a zarr array
inside the OCDBT kvstore, named by its key path joined with dots (``layers.0.w``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from cacheflow_jax._blocks import ArrayInfo, KeyKind, StoreError
from cacheflow_jax._futures import Deadline, _result, _wait_all
from cacheflow_jax._locations import _join, _list, _location, _open_kvstore

ORBAX_MARKERS = ("_METADATA", "manifest.ocdbt")


def _orbax_chunk_where(item: str, leaf: str, use_ocdbt: bool) -> Callable[[tuple[int, ...]], str]:
    """Names where an orbax chunk lives (for error messages)."""

    def where(idx: tuple[int, ...]) -> str:
        chunk = ".".join(map(str, idx)) or "0"
        if use_ocdbt:
            # The chunk is a value inside OCDBT data files; name the leaf, chunk and folder.
            return f"orbax leaf {leaf!r} chunk {chunk} in the OCDBT data files under {item}/"
        return _location(item, f"{leaf}/{chunk}")

    return where


# Value types of orbax's _METADATA that are not arrays: they restore as empty nodes or None.
_EMPTY_VALUES: dict[str, Any] = {"Dict": {}, "List": [], "Tuple": [], "None": None}


def _open_orbax(
    kv: ts.KvStore,
    kv_spec: Mapping[str, Any],
    label: str,
    item: str,
    keys: Sequence[str],
    *,
    context: ts.Context,
    deadline: Deadline,
) -> dict[str, Any]:
    """Opens an orbax checkpoint item (at ``item``, '' or 'sub/') in place.

    A leaf that ``_METADATA`` lists as an array must be found, and, where the checkpoint records
    that every chunk was stored (``store_array_data_equal_to_fill_value``, orbax's default), a
    missing chunk is an error rather than the fill value.
    """
    item_label = f"{label.rstrip('/')}/{item}".rstrip("/")
    item_spec = _join(kv_spec, item)
    metadata: dict[str, Any] = {}
    if item + "_METADATA" in keys:
        what = f"reading orbax metadata {item_label}/_METADATA"
        try:
            metadata = json.loads(_result(kv.read(item + "_METADATA"), deadline, what).value)
            if not isinstance(metadata, dict):
                raise ValueError(f"expected a JSON object, got {type(metadata).__name__}")
        except StoreError:
            raise
        except Exception as err:
            raise StoreError(f"cannot read orbax metadata {item_label}/_METADATA: {err}") from err
    use_ocdbt = metadata.get("use_ocdbt", item + "manifest.ocdbt" in keys)
    every_chunk = bool(metadata.get("store_array_data_equal_to_fill_value", False))
    driver = "zarr3" if metadata.get("use_zarr3", False) else "zarr"
    if use_ocdbt:
        if item + "manifest.ocdbt" not in keys:
            raise StoreError(
                f"orbax checkpoint {item_label} uses OCDBT but its manifest "
                f"{item_label}/manifest.ocdbt is missing, so none of its arrays can be found; "
                "the checkpoint is damaged: restore it from a copy or save it again"
            )
        leaf_kv = {"driver": "ocdbt", "base": item_spec, "cache_pool": "cache_pool#ocdbt"}
        leaf_store = _open_kvstore(leaf_kv, item_label, context=context, deadline=deadline)
        leaf_keys = _list(leaf_store, item_label, deadline)
    else:
        leaf_kv = item_spec
        leaf_keys = [k[len(item) :] for k in keys if k.startswith(item)]
    marker = "/zarr.json" if driver == "zarr3" else "/.zarray"
    leaves = {k[: -len(marker)] for k in leaf_keys if k.endswith(marker)}
    tree_paths: dict[str, tuple[KeyKind, ...]] = {}
    empty_nodes: dict[tuple[KeyKind, ...], Any] = {}
    value_types: dict[str, str] = {}
    leaf_of: dict[str, str] = {}
    for entry in metadata.get("tree_metadata", {}).values():
        kp = tuple(
            jax.tree_util.SequenceKey(int(m["key"]))
            if m.get("key_type") == 1
            else jax.tree_util.DictKey(m["key"])
            for m in entry.get("key_metadata", ())
        )
        names = [str(m["key"]) for m in entry.get("key_metadata", ())]
        vmeta = entry.get("value_metadata", {})
        name = ".".join(names)
        value_type = vmeta.get("value_type")
        if name in leaves and not vmeta.get("skip_deserialize", False):
            path = "/".join(names) or name
            tree_paths[path], leaf_of[path] = kp, name
            value_types[path] = str(value_type or "")
        elif value_type in _EMPTY_VALUES or vmeta.get("skip_deserialize", False):
            empty_nodes[kp] = _EMPTY_VALUES.get(value_type)
        else:
            raise StoreError(
                f"orbax checkpoint {item_label} lists leaf {name!r} ({value_type}) in its "
                f"_METADATA, but its array is not in the checkpoint; the checkpoint is damaged "
                "or incomplete: restore it from a copy or save it again"
            )
    for name in sorted(leaves - set(leaf_of.values())):
        # A leaf without metadata (an older checkpoint): name its path from the leaf name.
        path = name.replace(".", "/")
        tree_paths[path] = tuple(jax.tree_util.DictKey(p) for p in path.split("/"))
        leaf_of[path] = name
    paths = sorted(tree_paths)
    futures = [
        ts.open(
            {
                "driver": driver,
                "kvstore": _join(leaf_kv, leaf_of[p] + "/"),
                "fill_missing_data_reads": not every_chunk,
            },
            context=context,
            read=True,
        )
        for p in paths
    ]
    what = f"opening arrays of checkpoint {item_label}"
    handles = dict(zip(paths, _wait_all(futures, what, deadline), strict=True))
    arrays = {
        p: ArrayInfo(
            path=p,
            shape=tuple(h.shape),
            dtype=np.dtype(h.dtype.numpy_dtype),
            chunk_shape=tuple(h.chunk_layout.read_chunk.shape or ()),
        )
        for p, h in handles.items()
    }
    where = {p: _orbax_chunk_where(item_label, leaf_of[p], use_ocdbt) for p in paths}
    return {
        "arrays": arrays,
        "handles": handles,
        "chunk_where": where,
        "tree_paths": tree_paths,
        "empty_nodes": empty_nodes,
        "value_types": value_types,
        "source": "orbax",
    }
