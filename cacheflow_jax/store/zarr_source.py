"""Opening a cacheflow store: zarr3 arrays under a root, read in place through TensorStore.

A cacheflow store is any zarr3 hierarchy; the array path is the array's directory relative to the
root, ``/``-separated. A store written by `write_store` says so in its root group's attributes
(``ATTR``): it has a file for every chunk, a chunk manifest, and a fingerprint of each array's
metadata (`array_fingerprint`), so a missing chunk is an error instead of the fill value and an
edited ``zarr.json`` is refused. Its runtime blocks go under ``_runtime/`` of the store itself.

The sources (see ``sources``): `CacheflowStore` (zarr3 arrays) and `EmptyLocation` (no data: a
store of runtime blocks only).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from cacheflow_jax.core.blocks import HOW_TO_REPAIR, ArrayInfo, StoreError
from cacheflow_jax.store.fastread import fast_layout, zarr3_chunk_where
from cacheflow_jax.store.futures import Deadline, wait_all
from cacheflow_jax.store.locations import join_spec, location
from cacheflow_jax.store.manifest import MANIFEST_NAME, chunk_crc32c, decode_manifest
from cacheflow_jax.store.parts import StoreParts
from cacheflow_jax.store.runtime_area import RuntimeArea, open_area
from cacheflow_jax.store.runtime_format import RUNTIME_PREFIX
from cacheflow_jax.store.sources import (
    HOW_TO_CREATE,
    Listing,
    OpenOptions,
    StoreSource,
    build_parts,
)
from cacheflow_jax.store.subblocks import raw_chunk_layout
from cacheflow_jax.store.tree import key_path_from_attr

# The attribute (of the root group and of each array) where write_store records what it wrote.
ATTR = "cacheflow"


class CacheflowStore(StoreSource):
    """A cacheflow store: zarr3 arrays under a root (``zarr.json`` files)."""

    name = "cacheflow"

    def recognizes(self, found: Listing) -> bool:
        return found.has_zarr

    def open(self, found: Listing, options: OpenOptions) -> StoreParts:
        fields = open_cacheflow(
            found.kv,
            found.kv_spec,
            found.label,
            found.keys,
            context=options.context,
            deadline=options.deadline,
        )
        return build_parts(found, options, runtime=_own_area(found, options), **fields)


class EmptyLocation(StoreSource):
    """A location without data: a store of runtime blocks only (with ``create``, or if it holds
    runtime blocks already)."""

    name = "empty"

    def recognizes(self, found: Listing) -> bool:
        return not found.keys

    def open(self, found: Listing, options: OpenOptions) -> StoreParts:
        if not found.runtime_keys and not options.create:
            raise StoreError(
                f"store {found.label} is empty. {HOW_TO_CREATE}, or pass create=True for an empty "
                "store of runtime blocks"
            )
        return build_parts(found, options, runtime=_own_area(found, options), source="cacheflow")


def _own_area(found: Listing, options: OpenOptions) -> RuntimeArea:
    """The runtime area of a cacheflow store: ``options.runtime``, else the store itself."""
    return open_area(
        options.runtime,
        found.label,
        options.s3_endpoint,
        options.s3_region,
        options.context,
        options.deadline,
        own=found.own_runtime(),
        shared=options.shared,
        lookup_ttl=options.lookup_ttl,
    )


def array_fingerprint(meta: Mapping[str, Any]) -> str:
    """A digest of what decides an array's bytes in its zarr.json (not its attributes)."""
    fields = ("shape", "data_type", "chunk_grid", "chunk_key_encoding", "codecs", "fill_value")
    canon = json.dumps({f: meta.get(f) for f in fields}, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(canon.encode()):08x}"


def read_manifest(
    kv: ts.KvStore, label: str, record: Any, deadline: Deadline
) -> dict[str, list[int]]:
    """The chunk manifest named by the root group's ``record``, checked; {} if there is none."""
    if not isinstance(record, Mapping):
        return {}
    name = str(record.get("name", MANIFEST_NAME))
    where = location(label, name)
    res = wait_all([kv.read(name)], f"reading the chunk manifest {where}", deadline)[0]
    if res.state != "value":
        raise StoreError(f"the chunk manifest {where} is missing. {HOW_TO_REPAIR}")
    data = bytes(res.value)
    if chunk_crc32c(np.frombuffer(data, np.uint8), (len(data),)) != record.get("crc32c"):
        raise StoreError(
            f"the chunk manifest {where} does not match the CRC recorded in the store's "
            f"zarr.json. {HOW_TO_REPAIR}"
        )
    return decode_manifest(data, where)


def open_cacheflow(
    kv: ts.KvStore,
    kv_spec: Mapping[str, Any],
    label: str,
    keys: Sequence[str],
    *,
    context: ts.Context,
    deadline: Deadline,
) -> dict[str, Any]:
    """Finds and opens the zarr3 arrays of a cacheflow store; returns `StoreParts` fields.

    A store written by `write_store` (its root group says so) has a file for every chunk and
    records a fingerprint of each array's metadata: a missing chunk is then an error, not the
    fill value, and an edited ``zarr.json`` is refused. Other zarr3 hierarchies follow zarr's
    rule that a chunk without a file holds the fill value.
    """
    found, root_attr = _read_metadata(kv, label, keys, deadline)
    every_chunk = "complete" in root_attr  # written by write_store: every chunk has a file
    _check_written(label, root_attr.get("arrays"), found)
    chunk_crcs = read_manifest(kv, label, root_attr.get("manifest"), deadline)
    paths = sorted(found)
    futures = [
        ts.open(
            {
                "driver": "zarr3",
                "kvstore": join_spec(kv_spec, p + "/"),
                "fill_missing_data_reads": not every_chunk,
            },
            context=context,
            read=True,
        )
        for p in paths
    ]
    handles = dict(
        zip(paths, wait_all(futures, f"opening arrays of store {label}", deadline), strict=True)
    )
    arrays: dict[str, ArrayInfo] = {}
    where: dict[str, Callable[[tuple[int, ...]], str]] = {}
    tree_paths, fast, raw_layouts = {}, {}, {}
    for p in paths:
        meta, h = found[p], handles[p]
        arrays[p] = ArrayInfo(
            path=p,
            shape=tuple(h.shape),
            dtype=np.dtype(h.dtype.numpy_dtype),
            chunk_shape=tuple(h.chunk_layout.read_chunk.shape or ()),
        )
        where[p] = zarr3_chunk_where(label, p, meta.get("chunk_key_encoding"))
        tree_paths[p] = key_path_from_attr(meta.get("attributes", {}).get(ATTR), p)
        layout = fast_layout(meta, arrays[p])
        if layout is not None:
            fast[p] = layout
        raw = raw_chunk_layout(meta, "zarr3")
        if raw is not None:
            raw_layouts[p] = raw
        _check_manifest_entry(label, p, arrays[p], chunk_crcs.get(p))
    return {
        "arrays": arrays,
        "fast_arrays": fast,
        "raw_layouts": raw_layouts,
        "writer_chose_chunks": every_chunk,
        "chunk_crcs": chunk_crcs,
        "handles": handles,
        "chunk_where": where,
        "tree_paths": tree_paths,
        "empty_nodes": {},
        "value_types": {},
        "source": "cacheflow",
    }


def _read_metadata(
    kv: ts.KvStore, label: str, keys: Sequence[str], deadline: Deadline
) -> tuple[dict[str, dict], dict[str, Any]]:
    """Reads every ``zarr.json``: (array path -> its metadata, the root group's ``ATTR``)."""
    meta_keys = [
        k
        for k in keys
        if (k == "zarr.json" or k.endswith("/zarr.json")) and not k.startswith(RUNTIME_PREFIX)
    ]
    metas = wait_all(
        [kv.read(k) for k in meta_keys], f"reading metadata of store {label}", deadline
    )
    found: dict[str, dict] = {}
    root_attr: dict[str, Any] = {}
    for k, res in zip(meta_keys, metas, strict=True):
        try:
            meta = json.loads(res.value)
            if not isinstance(meta, dict):
                raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
        except ValueError as err:
            raise StoreError(
                f"{location(label, k)} is not valid zarr metadata: {err}. {HOW_TO_REPAIR}"
            ) from None
        path = k[: -len("zarr.json")].rstrip("/")
        if meta.get("node_type") == "group" and path == "":
            root_attr = (meta.get("attributes") or {}).get(ATTR) or {}
            if root_attr.get("complete") is False:
                raise StoreError(
                    f"store {label} was not completely written (a write_store call was "
                    "interrupted); re-run write_store(tree, path, overwrite=True)"
                )
        if meta.get("node_type") != "array":
            continue
        if not path:
            raise StoreError(
                f"store {label} is a single zarr3 array, not a hierarchy; write it with "
                "write_store({'name': array}, path) or open its parent directory"
            )
        found[path] = meta
    return found, root_attr


def _check_written(label: str, written: Any, found: Mapping[str, Mapping[str, Any]]) -> None:
    """Checks the arrays found against the root group's record of those write_store wrote."""
    if not isinstance(written, Mapping):
        return
    for p in sorted(set(written) | set(found)):
        if p not in found:
            raise StoreError(
                f"store {label} lost array {p!r}: write_store wrote it but "
                f"{location(label, p + '/zarr.json')} is missing. {HOW_TO_REPAIR}"
            )
        if p not in written:
            continue  # an array added to the hierarchy later, by another writer
        expected = (written[p] or {}).get("fingerprint")
        if expected is not None and expected != array_fingerprint(found[p]):
            raise StoreError(
                f"{location(label, p + '/zarr.json')} was changed after write_store wrote "
                f"it (its shape, data type, chunking or codecs differ from the store's "
                f"record); its chunks cannot be trusted. {HOW_TO_REPAIR}"
            )


def _check_manifest_entry(
    label: str, path: str, arr: ArrayInfo, crcs: Sequence[int] | None
) -> None:
    """Checks that the chunk manifest lists one CRC per chunk of array ``path`` (if any)."""
    if crcs is not None and len(crcs) != math.prod(arr.grid_shape):
        raise StoreError(
            f"the chunk manifest of store {label} lists {len(crcs)} chunks for array {path!r}, "
            f"whose grid {arr.grid_shape} has {math.prod(arr.grid_shape)}. "
            f"{HOW_TO_REPAIR}"
        )
