"""Opening an orbax checkpoint in place: its arrays are read through TensorStore, chunk by chunk.

An orbax item directory holds ``_METADATA`` (the tree, with each leaf's key path and value type)
and, with OCDBT (orbax's default), ``manifest.ocdbt`` plus data files: every leaf is a zarr array
inside the OCDBT kvstore, named by its key path joined with dots (``layers.0.w``); the store's
array path is the key path joined with ``/`` (``layers/0/w``). A ``CheckpointManager`` step
directory (``<root>/<step>``) holds the items; its root holds one directory per step, named by the
step number (`find_steps`), and opening the root opens its latest step. A checkpoint's chunk
manifest, written by ``cacheflow verify``, sits beside the checkpoint, never inside it
(`manifest_location`); `checkpoint_manifest` checks it on open. A checkpoint is never written: its
runtime blocks go to a separate location (``runtime_area.default_runtime_dir``).

The source (see ``sources``): `OrbaxCheckpoint`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import tensorstore as ts

from cacheflow_jax.core.blocks import ArrayInfo, StoreError
from cacheflow_jax.store.futures import Deadline, wait_all, wait_for
from cacheflow_jax.store.locations import (
    CONTEXT_SPEC,
    join_spec,
    list_keys,
    location,
    open_kvstore,
)
from cacheflow_jax.store.manifest import decode_checkpoint_manifest
from cacheflow_jax.store.parts import StoreParts
from cacheflow_jax.store.runtime_area import open_area
from cacheflow_jax.store.sources import Listing, OpenOptions, StoreSource, build_parts
from cacheflow_jax.store.subblocks import raw_chunk_layout

if TYPE_CHECKING:
    from cacheflow_jax.core.blocks import KeyKind

ORBAX_MARKERS = ("_METADATA", "manifest.ocdbt")
# A checkpoint's chunk manifest is ``<checkpoint directory name>`` + this, in its parent.
MANIFEST_SUFFIX = ".cacheflow-manifest.json"
# What marks a CheckpointManager step directory (orbax writes it into every step).
STEP_MARKER = "_CHECKPOINT_METADATA"


def item_directories(keys: Sequence[str]) -> list[str]:
    """The orbax items directly under a location (``<item>/_METADATA`` or ``manifest.ocdbt``)."""
    return sorted(
        {k.split("/")[0] for k in keys if k.count("/") == 1 and k.split("/")[1] in ORBAX_MARKERS}
    )


def is_item(keys: Sequence[str]) -> bool:
    """Whether a location is an orbax item directory itself (its keys hold a marker)."""
    return any(m in keys for m in ORBAX_MARKERS)


def manager_steps(keys: Sequence[str]) -> dict[int, str]:
    """The steps of a location that is a ``CheckpointManager`` root (see `find_steps`); empty for
    an item or step directory, or any other location."""
    if item_directories(keys) or is_item(keys):
        return {}
    return find_steps(keys)


def find_steps(keys: Sequence[str]) -> dict[int, str]:
    """The steps of a ``CheckpointManager`` root, from the keys listed under it.

    A step is a directory named by a non-negative integer (orbax's default step names) holding
    an orbax item (``<step>/<item>/_METADATA`` or ``manifest.ocdbt``); orbax writes a step to a
    temporary name and renames it when complete, so a listed step is a finished one.

    Returns:
      ``{step: item prefix}`` (``"5/default/"``), or ``{step: ""}`` for a step holding several
      items (opening it names them).
    """
    items: dict[int, set[str]] = {}
    for k in keys:
        parts = k.split("/")
        if len(parts) == 3 and parts[0].isdigit() and parts[2] in ORBAX_MARKERS:
            items.setdefault(int(parts[0]), set()).add(f"{parts[0]}/{parts[1]}/")
    return {step: (next(iter(p)) if len(p) == 1 else "") for step, p in sorted(items.items())}


def parent_location(kv_spec: Mapping[str, Any]) -> tuple[dict[str, Any], str] | None:
    """(kvstore spec of the parent directory, last path part) of a location; None at a root."""
    path = str(kv_spec.get("path", "")).rstrip("/")
    head, sep, name = path.rpartition("/")
    if not name:
        return None
    parent = dict(kv_spec)
    parent["path"] = head + "/" if sep else ""
    return parent, name


def manifest_location(
    kv_spec: Mapping[str, Any],
    item: str,
    steps: Mapping[int, str] | None,
    step: int | None,
    item_is_in_step: bool,
) -> tuple[dict[str, Any], str] | None:
    """(kvstore spec of the directory holding the manifest, its key) for a checkpoint.

    The checkpoint directory is the step directory for a ``CheckpointManager`` checkpoint and
    the item directory otherwise; its manifest is ``<that directory>.cacheflow-manifest.json``
    beside it, so ``cacheflow verify`` never writes into the checkpoint.

    Args:
      kv_spec: the location opened.
      item: the item's prefix under it (``""``, ``"default/"`` or ``"5/default/"``).
      steps: the steps found when the location is a root (else None).
      step: the step opened from a root.
      item_is_in_step: the location is an item directory whose parent is a step directory.
    """
    if steps is not None and step is not None:
        return dict(kv_spec), f"{step}{MANIFEST_SUFFIX}"
    up = parent_location(kv_spec)
    if up is None:
        return None
    if item_is_in_step:
        up = parent_location(up[0])
        if up is None:
            return None
    return up[0], up[1] + MANIFEST_SUFFIX


def manifest_label(spec: Mapping[str, Any], name: str) -> str:
    """A readable location of a manifest ``name`` in the directory ``spec``."""
    if spec.get("driver") == "file":
        return f"{str(spec.get('path', '')).rstrip('/')}/{name}"
    try:
        return ts.KvStore.Spec(dict(spec)).url.rstrip("/") + "/" + name
    except Exception:  # not every driver has a URL form
        return f"{name} in {json.dumps(dict(spec), sort_keys=True)}"


def checkpoint_fingerprint(
    kv: ts.KvStore, item: str, metadata_raw: bytes, deadline: Deadline
) -> str:
    """A digest of an item's ``_METADATA`` and ``manifest.ocdbt`` (SHA-256, 16 hex digits).

    Orbax writes ``manifest.ocdbt`` anew on every save, so a manifest recorded for one save does
    not pass for another. (Not a CRC-32C: ``manifest.ocdbt`` ends with its own CRC-32C, and the
    CRC-32C of data followed by its CRC is the same constant for all data.)
    """
    res = wait_for(kv.read(item + "manifest.ocdbt"), deadline, f"reading {item}manifest.ocdbt")
    ocdbt = bytes(res.value) if res.state == "value" else b""
    return hashlib.sha256(metadata_raw + b"\0" + ocdbt).hexdigest()[:16]


class OrbaxCheckpoint(StoreSource):
    """An orbax checkpoint: an item directory, a ``CheckpointManager`` step directory holding one
    item, or the manager's root (its latest step, or ``step``)."""

    name = "orbax"

    def recognizes(self, found: Listing) -> bool:
        keys = found.keys
        if is_item(keys):
            return True
        if item_directories(keys):
            return not found.has_zarr  # items beside zarr3 arrays: a cacheflow store
        return bool(find_steps(keys))

    def open(self, found: Listing, options: OpenOptions) -> StoreParts:
        steps = manager_steps(found.keys)
        item, step = _item_to_open(found, steps, options.step)
        context, deadline = options.context, options.deadline
        fields, metadata_raw = open_orbax(
            found.kv,
            found.kv_spec,
            found.label,
            item,
            found.keys,
            context=context,
            deadline=deadline,
        )
        label = f"{found.label.rstrip('/')}/{step}" if steps else found.label
        fields.update(
            checkpoint_manifest(
                found.kv,
                found.kv_spec,
                label,
                item,
                steps or None,
                step,
                (fields["arrays"], metadata_raw),
                context,
                deadline,
                check=options.manifest,
            )
        )
        rt = open_area(
            options.runtime,
            label,
            options.s3_endpoint,
            options.s3_region,
            context,
            deadline,
            own=None,
            shared=options.shared,
            lookup_ttl=options.lookup_ttl,
        )
        return build_parts(
            found,
            options,
            runtime=rt,
            label=label,
            checkpoint_item=(item, metadata_raw),
            steps=tuple(sorted(steps)),
            step=step if steps else None,
            **fields,
        )


def _item_to_open(
    found: Listing, steps: Mapping[int, str], step: int | None
) -> tuple[str, int | None]:
    """(the item's prefix under the location, the step opened) of a recognised checkpoint."""
    label = found.label
    if is_item(found.keys):
        return "", step
    items = item_directories(found.keys)
    if len(items) == 1:
        return items[0] + "/", step
    if len(items) > 1:
        raise StoreError(
            f"{label} is an orbax step directory with {len(items)} items {items}; open one item "
            f"directory, e.g. {label.rstrip('/')}/{items[0]}"
        )
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise StoreError(
            f"{label} has no step {step}; its steps are {sorted(steps)}. Pass one of them, "
            "or omit step= for the latest"
        )
    item = steps[step]
    if not item:
        raise StoreError(
            f"step {step} of {label} holds several orbax items; open one item directory, "
            f"e.g. {label.rstrip('/')}/{step}/<item>"
        )
    return item, step


def checkpoint_manifest(
    kv: ts.KvStore,
    kv_spec: Mapping[str, Any],
    label: str,
    item: str,
    steps: Mapping[int, str] | None,
    step: int | None,
    opened: tuple[Mapping[str, ArrayInfo], bytes],
    context: ts.Context,
    deadline: Deadline,
    *,
    check: bool,
) -> dict[str, Any]:
    """Where a checkpoint's chunk manifest (``cacheflow verify``) goes, and, with ``check``,
    the manifest itself if there is one (checked against the checkpoint), as `StoreParts`
    fields. ``opened``: the checkpoint's arrays and its ``_METADATA`` bytes."""
    in_step = False
    if steps is None and item == "":
        # An item directory opened directly: is it inside a CheckpointManager step?
        up = parent_location(kv_spec)
        if up is not None:
            parent = open_kvstore(up[0], label, context=context, deadline=deadline)
            got = wait_for(parent.read(STEP_MARKER), deadline, f"reading beside {label}")
            in_step = got.state == "value"
    beside = manifest_location(kv_spec, item, steps, step, in_step)
    if beside is None:
        return {}
    spec, name = beside
    where = manifest_label(spec, name)
    found = {"manifest_at": (spec, name, where)}
    if not check:
        return found
    holder = open_kvstore(spec, where, context=context, deadline=deadline)
    res = wait_for(holder.read(name), deadline, f"reading the chunk manifest {where}")
    if res.state != "value":
        return found
    manifest = decode_checkpoint_manifest(bytes(res.value), where)
    arrays, metadata_raw = opened
    fingerprint = checkpoint_fingerprint(kv, item, metadata_raw, deadline)
    if manifest.fingerprint != fingerprint:
        raise StoreError(
            f"the chunk manifest {where} was made for another version of checkpoint {label} "
            "(the checkpoint was saved again after `cacheflow verify` recorded it); run "
            f"`cacheflow verify {label} --update` to record the checkpoint as it is now"
        )
    for path, crcs in manifest.arrays.items():
        if path not in arrays or len(crcs) != math.prod(arrays[path].grid_shape):
            raise StoreError(
                f"the chunk manifest {where} does not match checkpoint {label} (array {path!r}); "
                f"run `cacheflow verify {label} --update`"
            )
    return {**found, "chunk_crcs": manifest.arrays, "crc_covers": "block", "manifest": where}


def _orbax_chunk_where(item: str, leaf: str, use_ocdbt: bool) -> Callable[[tuple[int, ...]], str]:
    """Names where an orbax chunk lives (for error messages)."""

    def where(idx: tuple[int, ...]) -> str:
        chunk = ".".join(map(str, idx)) or "0"
        if use_ocdbt:
            # The chunk is a value inside OCDBT data files; name the leaf, chunk and folder.
            return f"orbax leaf {leaf!r} chunk {chunk} in the OCDBT data files under {item}/"
        return location(item, f"{leaf}/{chunk}")

    return where


# Value types of orbax's _METADATA that are not arrays: they restore as empty nodes or None.
_EMPTY_VALUES: dict[str, Any] = {"Dict": {}, "List": [], "Tuple": [], "None": None}


def open_orbax(
    kv: ts.KvStore,
    kv_spec: Mapping[str, Any],
    label: str,
    item: str,
    keys: Sequence[str],
    *,
    context: ts.Context,
    deadline: Deadline,
) -> tuple[dict[str, Any], bytes]:
    """Opens an orbax checkpoint item (at ``item``, '' or 'sub/') in place.

    A leaf that ``_METADATA`` lists as an array must be found, and, where the checkpoint records
    that every chunk was stored (``store_array_data_equal_to_fill_value``, orbax's default), a
    missing chunk is an error rather than the fill value.

    Returns:
      (`StoreParts` fields, the item's ``_METADATA`` bytes: ``b""`` without one).
    """
    item_label = f"{label.rstrip('/')}/{item}".rstrip("/")
    metadata, metadata_raw = _read_metadata(kv, item, keys, item_label, deadline)
    use_ocdbt = metadata.get("use_ocdbt", item + "manifest.ocdbt" in keys)
    every_chunk = bool(metadata.get("store_array_data_equal_to_fill_value", False))
    driver = "zarr3" if metadata.get("use_zarr3", False) else "zarr"
    leaf_kv, leaf_keys, context = _leaf_store(
        kv_spec, item, keys, item_label, use_ocdbt, context, deadline
    )
    marker = "/zarr.json" if driver == "zarr3" else "/.zarray"
    leaves = {k[: -len(marker)] for k in leaf_keys if k.endswith(marker)}
    tree_paths, empty_nodes, value_types, leaf_of = _tree_of(metadata, leaves, item_label)
    paths = sorted(tree_paths)
    futures = [
        ts.open(
            {
                "driver": driver,
                "kvstore": join_spec(leaf_kv, leaf_of[p] + "/"),
                "fill_missing_data_reads": not every_chunk,
            },
            context=context,
            read=True,
        )
        for p in paths
    ]
    what = f"opening arrays of checkpoint {item_label}"
    handles = dict(zip(paths, wait_all(futures, what, deadline), strict=True))
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
    raw_layouts = {}
    for p, h in handles.items():
        layout = raw_chunk_layout(h.spec().to_json().get("metadata") or {}, driver)
        if layout is not None:
            raw_layouts[p] = layout
    fields = {
        "raw_layouts": raw_layouts,
        "arrays": arrays,
        "handles": handles,
        "chunk_where": where,
        "tree_paths": tree_paths,
        "empty_nodes": empty_nodes,
        "value_types": value_types,
        "source": "orbax",
    }
    return fields, metadata_raw


def _read_metadata(
    kv: ts.KvStore, item: str, keys: Sequence[str], item_label: str, deadline: Deadline
) -> tuple[dict[str, Any], bytes]:
    """The item's ``_METADATA``, parsed and as bytes ({} and b"" without one)."""
    if item + "_METADATA" not in keys:
        return {}, b""
    what = f"reading orbax metadata {item_label}/_METADATA"
    try:
        metadata_raw = bytes(wait_for(kv.read(item + "_METADATA"), deadline, what).value)
        metadata = json.loads(metadata_raw)
        if not isinstance(metadata, dict):
            raise ValueError(f"expected a JSON object, got {type(metadata).__name__}")
    except StoreError:
        raise
    except Exception as err:
        raise StoreError(f"cannot read orbax metadata {item_label}/_METADATA: {err}") from err
    return metadata, metadata_raw


def _leaf_store(
    kv_spec: Mapping[str, Any],
    item: str,
    keys: Sequence[str],
    item_label: str,
    use_ocdbt: bool,
    context: ts.Context,
    deadline: Deadline,
) -> tuple[dict[str, Any], list[str], ts.Context]:
    """(the kvstore spec the leaves are under, their keys, the context to open them in)."""
    item_spec = join_spec(kv_spec, item)
    if not use_ocdbt:
        return item_spec, [k[len(item) :] for k in keys if k.startswith(item)], context
    if item + "manifest.ocdbt" not in keys:
        raise StoreError(
            f"orbax checkpoint {item_label} uses OCDBT but its manifest "
            f"{item_label}/manifest.ocdbt is missing, so none of its arrays can be found; "
            "the checkpoint is damaged: restore it from a copy or save it again"
        )
    leaf_kv = {"driver": "ocdbt", "base": item_spec, "cache_pool": "cache_pool#ocdbt"}
    # A context of its own per open: the ocdbt driver keeps a database's configuration in
    # its context, and a checkpoint saved again under the same path (a new uuid) would then
    # fail to open in this process ("Configuration mismatch on uuid").
    context = ts.Context({"cache_pool#ocdbt": CONTEXT_SPEC["cache_pool#ocdbt"]}, parent=context)
    leaf_store = open_kvstore(leaf_kv, item_label, context=context, deadline=deadline)
    return leaf_kv, list_keys(leaf_store, item_label, deadline), context


def _tree_of(
    metadata: Mapping[str, Any], leaves: set[str], item_label: str
) -> tuple[
    dict[str, tuple[KeyKind, ...]], dict[tuple[KeyKind, ...], Any], dict[str, str], dict[str, str]
]:
    """(tree paths, empty nodes, value types, leaf name of each array path) of an item, from
    its ``_METADATA`` and the leaves found in it."""
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
    return tree_paths, empty_nodes, value_types, leaf_of
