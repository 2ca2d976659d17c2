"""What a `TensorStoreStore` is built from: the parts a source opens (`StoreParts`).

A source (``sources``: a cacheflow store, an orbax checkpoint) opens a location into one frozen
`StoreParts`; the store builds its block table from it (``table``), and a view with another block
size (`TensorStoreStore.with_block_bytes`) is built from the same parts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cacheflow_jax.core.blocks import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    import tensorstore as ts

    from cacheflow_jax.core.blocks import ArrayInfo, KeyKind
    from cacheflow_jax.store.entry import FastArray
    from cacheflow_jax.store.runtime_area import RuntimeArea


@dataclasses.dataclass(frozen=True)
class StoreParts:
    """Everything a store is built from, as a source opened it.

    ``arrays`` are the stored arrays as stored (their chunks, not sub-blocks), ``handles`` their
    open TensorStore handles, ``chunk_where`` names a chunk's file from its grid index (for error
    messages); ``tree_paths``, ``empty_nodes`` and ``value_types`` describe the stored pytree (see
    `TensorStoreStore.tree`). ``fast_arrays`` names the arrays whose chunk files are read directly
    (see `TensorStoreStore.read`); ``chunk_crcs`` is a chunk manifest (see ``manifest``), checked
    on every read, whose CRCs cover each full chunk (``crc_covers="chunk"``) or each chunk clipped
    at the array's edge (``"block"``). ``raw_layouts`` names arrays whose chunks are raw bytes
    (sub-blocks are then read as byte ranges). ``timeout`` bounds the store's own blocking calls.
    """

    label: str
    kvstore: ts.KvStore
    kvstore_spec: Mapping[str, Any]
    runtime: RuntimeArea
    source: str = "cacheflow"
    arrays: Mapping[str, ArrayInfo] = dataclasses.field(default_factory=dict)
    handles: Mapping[str, ts.TensorStore] = dataclasses.field(default_factory=dict)
    chunk_where: Mapping[str, Callable[[tuple[int, ...]], str]] = dataclasses.field(
        default_factory=dict
    )
    tree_paths: Mapping[str, tuple[KeyKind, ...]] = dataclasses.field(default_factory=dict)
    empty_nodes: Mapping[tuple[KeyKind, ...], Any] = dataclasses.field(default_factory=dict)
    value_types: Mapping[str, str] = dataclasses.field(default_factory=dict)
    fast_arrays: Mapping[str, FastArray] = dataclasses.field(default_factory=dict)
    chunk_crcs: Mapping[str, Sequence[int]] = dataclasses.field(default_factory=dict)
    crc_covers: str = "chunk"
    raw_layouts: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    context: ts.Context | None = None
    timeout: float | None = DEFAULT_TIMEOUT
    writer_chose_chunks: bool = False  # written by write_store, whose chunk_bytes set the blocks
    steps: tuple[int, ...] = ()  # every step of a CheckpointManager root opened
    step: int | None = None  # the step opened from a CheckpointManager root or step
    manifest: str | None = None  # the chunk manifest checked on every read (its location)
    manifest_at: tuple[dict[str, Any], str, str] | None = None  # see manifest_location
    checkpoint_item: tuple[str, bytes] | None = None  # (item prefix, its _METADATA bytes)
