"""Chunk manifests: the CRC-32C of every chunk, recorded when a store is written.

A zarr3 ``crc32c`` codec checks that a chunk file is self-consistent, not that it is the right
chunk: two chunk files swapped, or a chunk file replaced by an older copy, pass their own checks.
So `write_store` also records, in ``cacheflow_manifest.json`` at the store's root, the CRC-32C of
each chunk's stored payload (the full chunk in C order, little endian; an edge chunk padded with
the fill value, exactly as zarr stores it). Every read is then checked against the manifest:

* the fast path compares the CRC stored at the end of the chunk file (already verified against
  the file's bytes) with the manifest's, at no extra cost;
* reads through TensorStore recompute the CRC of the decoded block (padded the same way).

Format (JSON): ``{"version": 1, "algorithm": "crc32c", "arrays": {"<array path>":
[crc, ...]}}``, one CRC per chunk in ``np.ndindex(grid)`` order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import google_crc32c
import numpy as np

from cacheflow_jax.core.blocks import HOW_TO_REPAIR, StoreError

MANIFEST_NAME = "cacheflow_manifest.json"
_VERSION = 1


def chunk_crc32c(block: np.ndarray, chunk_shape: Sequence[int], fill: object = 0) -> int:
    """The CRC-32C of a chunk's stored payload, from the block it holds.

    Args:
      block: the block (a chunk clipped at the array's edge).
      chunk_shape: the array's chunk shape; an edge block is padded to it with ``fill``.
      fill: the array's fill value.

    >>> chunk_crc32c(np.zeros(2, np.uint8), (2,)) == chunk_crc32c(np.zeros(1, np.uint8), (2,))
    True
    """
    arr = np.asarray(block)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if tuple(arr.shape) != tuple(chunk_shape):
        full = np.full(tuple(chunk_shape), fill, dtype=arr.dtype)
        full[tuple(slice(0, n) for n in arr.shape)] = arr
        arr = full
    return int(google_crc32c.value(np.ascontiguousarray(arr).tobytes()))


def array_crcs(array: np.ndarray, chunk_shape: Sequence[int]) -> list[int]:
    """The manifest entry of one array: each chunk's CRC-32C in ``np.ndindex(grid)`` order."""
    arr = np.asarray(array)
    if arr.ndim == 0:
        return [chunk_crc32c(arr, ())]
    grid = [-(-s // c) if c else 1 for s, c in zip(arr.shape, chunk_shape, strict=True)]
    out = []
    for idx in np.ndindex(*grid):
        sel = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunk_shape, strict=True))
        out.append(chunk_crc32c(arr[sel], chunk_shape))
    return out


def encode_manifest(arrays: Mapping[str, Sequence[int]]) -> bytes:
    """Serializes a manifest (array path -> CRCs in grid order)."""
    doc = {
        "version": _VERSION,
        "algorithm": "crc32c",
        "arrays": {k: list(v) for k, v in arrays.items()},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_manifest(data: bytes, where: str) -> dict[str, list[int]]:
    """Parses a manifest; a damaged one is a `StoreError` naming ``where``."""
    try:
        doc = json.loads(data)
        if doc.get("version") != _VERSION or doc.get("algorithm") != "crc32c":
            raise ValueError(f"unknown version/algorithm {doc.get('version')!r}")
        arrays = {str(k): [int(c) for c in v] for k, v in doc["arrays"].items()}
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise StoreError(
            f"the chunk manifest {where} is damaged ({err}). {HOW_TO_REPAIR}"
        ) from None
    return arrays


# --------------------------------------------------------------------------------------------
# Checkpoint manifests (``cacheflow verify``)

CHECKPOINT_MANIFEST_FORMAT = """\
A checkpoint's chunk manifest (``<checkpoint directory>.cacheflow-manifest.json`` beside it) is
JSON: {"version": 1, "algorithm": "crc32c", "covers": "block", "fingerprint": "<hex>",
"arrays": {"<array path>": [crc, ...]}}. Each CRC-32C covers one stored chunk's elements
within the array (clipped at its edge), C order, little endian, as decoded: so it holds for any
codec (orbax compresses with zstd) and is checked against what TensorStore decodes. The
fingerprint (a SHA-256 digest of the item's ``_METADATA`` and ``manifest.ocdbt``) ties it to one
save of the checkpoint: a checkpoint saved again under the same name is refused until it is
verified again.
"""


class CheckpointManifest:
    """A decoded checkpoint manifest: its fingerprint and each array's chunk CRCs."""

    __slots__ = ("fingerprint", "arrays")

    def __init__(self, fingerprint: str, arrays: dict[str, list[int]]) -> None:
        self.fingerprint = fingerprint
        self.arrays = arrays


def encode_checkpoint_manifest(arrays: Mapping[str, Sequence[int]], fingerprint: str) -> bytes:
    """Serializes a checkpoint manifest (see ``CHECKPOINT_MANIFEST_FORMAT``)."""
    doc = {
        "version": _VERSION,
        "algorithm": "crc32c",
        "covers": "block",
        "fingerprint": fingerprint,
        "arrays": {k: list(v) for k, v in arrays.items()},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_checkpoint_manifest(data: bytes, where: str) -> CheckpointManifest:
    """Parses a checkpoint manifest; a damaged one is a `StoreError` naming ``where``."""
    try:
        doc = json.loads(data)
        if doc.get("covers") != "block":
            raise ValueError(f"covers={doc.get('covers')!r}, expected 'block'")
        arrays = decode_manifest(data, where)
        fingerprint = str(doc["fingerprint"])
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise StoreError(
            f"the chunk manifest {where} is damaged ({err}); run `cacheflow verify` on the "
            "checkpoint again (with --update) to record it anew"
        ) from None
    return CheckpointManifest(fingerprint, arrays)


def block_crc32c(block: np.ndarray) -> int:
    """The CRC-32C a checkpoint manifest records for a chunk (clipped, as decoded)."""
    return chunk_crc32c(block, np.shape(block))
