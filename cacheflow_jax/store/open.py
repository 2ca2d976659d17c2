"""`open_store`: opens an L3 store (a cacheflow zarr3 store or an orbax checkpoint) in place.

`open_store` resolves the location (``locations``), lists it once, and asks the sources of
`SOURCES` which one recognises what it found (see ``sources``: an orbax checkpoint, a cacheflow
store, an empty location); that source opens it, and the store is built from what it opened.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from cacheflow_jax.core.blocks import StoreError
from cacheflow_jax.store.futures import Deadline
from cacheflow_jax.store.locations import (
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    list_keys,
    open_kvstore,
    resolve,
    store_context,
)
from cacheflow_jax.store.orbax_source import OrbaxCheckpoint, manager_steps
from cacheflow_jax.store.runtime_area import DEFAULT_LOOKUP_TTL, runtime_keys
from cacheflow_jax.store.runtime_format import RUNTIME_PREFIX
from cacheflow_jax.store.sources import HOW_TO_CREATE, Listing, OpenOptions, SourceRegistry
from cacheflow_jax.store.subblocks import DEFAULT_BLOCK_BYTES, check_block_bytes
from cacheflow_jax.store.tensorstore_store import TensorStoreStore
from cacheflow_jax.store.zarr_source import CacheflowStore, EmptyLocation

__all__ = ["SOURCES", "open_store"]

# The formats open_store understands, asked in this order: a checkpoint marker or step
# directories make an orbax checkpoint even where zarr3 metadata is present too.
SOURCES = SourceRegistry([OrbaxCheckpoint(), CacheflowStore(), EmptyLocation()])


def open_store(
    spec_or_path: str | os.PathLike[str] | Mapping[str, Any],
    *,
    s3_endpoint: str | None = None,
    s3_region: str | None = None,
    create: bool = False,
    timeout: float | None = DEFAULT_TIMEOUT,
    retries: int = DEFAULT_RETRIES,
    step: int | None = None,
    block_bytes: int | None = None,
    runtime: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    manifest: bool = True,
    shared: bool = False,
    lookup_ttl: float = DEFAULT_LOOKUP_TTL,
) -> TensorStoreStore:
    """Opens an L3 store: a cacheflow zarr3 store or an orbax checkpoint, read in place.

    Args:
      spec_or_path: a local directory; a URL (``file:///abs/dir``, ``memory://name/``,
        ``s3://bucket/prefix``, ``gs://bucket/prefix``); or a TensorStore kvstore spec dict such
        as ``{"driver": "file", "path": "/data/store"}``. An orbax checkpoint may be given as its
        item directory, as a ``CheckpointManager`` step directory holding one item, or as the
        manager's root directory (its latest step is opened, as orbax's ``latest_step``).
      s3_endpoint: S3 endpoint URL (default: env ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``).
      s3_region: S3 region (default: env ``AWS_REGION`` / ``AWS_DEFAULT_REGION``; ``us-east-1``
        when only an endpoint is set).
      create: allow an empty or missing location (a store of runtime blocks only); a missing
        local directory is created. Without it, nothing is created or changed.
      timeout: seconds the whole open may take, and the deadline of each of the store's own
        blocking calls later (runtime headers, write-backs); None waits forever.
      retries: how often a failed S3/GCS request is retried (0.1 s to 2 s apart) before it
        counts as failed. TensorStore's own default, 32, takes about 11 minutes against a
        dead server.
      step: the step to open from a ``CheckpointManager`` root (default: the latest).
      block_bytes: serve stored chunks larger than this many bytes as sub-blocks along their
        leading axis (see `TensorStoreStore.with_block_bytes`). None (the default): a store
        whose chunks nobody chose for caching (an orbax checkpoint, a zarr3 store written by
        another tool) gets blocks of at most `DEFAULT_BLOCK_BYTES` (4 MiB), and a store from
        `write_store` serves its chunks whole. Keys follow the array's metadata and this size
        only, never a cache's budget; give the same ``block_bytes`` wherever the keys are used.
      runtime: where runtime blocks (``write``) go: a path, URL or kvstore spec. Default: the
        store itself for a cacheflow store; for an orbax checkpoint, which is never written,
        ``$XDG_CACHE_HOME/cacheflow_jax/runtime/<name>-<digest>/`` (``~/.cache`` by default;
        see ``runtime_area.default_runtime_dir``).
      manifest: check every read of an orbax checkpoint against its chunk manifest, where
        ``cacheflow verify`` recorded one (see `cacheflow_jax.verify_checkpoint`); False ignores
        it (``cacheflow verify --update`` records a new one).
      shared: the runtime blocks are written by many processes at once (serving processes, or
        the processes of a ``jax.distributed`` job; docs/scale.md). Each block is then
        immutable: published once with a create-if-absent write, so readers never see part of
        one and two writers of one key never both succeed; a writer that finds the same value
        published succeeds, and one that finds another value gets a `ConflictError`. For
        content-addressed blocks such as KV blocks keyed by prefix hash.
      lookup_ttl: a runtime key the store does not know is looked up in the store when asked
        for (another process may have written it); a lookup that found nothing is remembered
        this many seconds before the store is asked again.

    Returns:
      The opened store.

    Raises:
      FileNotFoundError: a local path does not exist (and ``create`` is False).
      StoreError: the location is neither a cacheflow store nor an orbax checkpoint, or cannot
        be read; ``step`` is not among a root's steps; a checkpoint's chunk manifest is damaged
        or older than the checkpoint.
      StoreTimeoutError: the store did not answer within ``timeout`` (a `StoreError`).
      ValueError: an unsupported URL or spec, a bad ``timeout`` / ``retries`` /
        ``block_bytes`` / ``lookup_ttl``, or ``step`` given for a location that is not a
        ``CheckpointManager`` root.

    >>> store = open_store("memory://demo/", create=True)
    >>> store.keys()
    ()
    """
    if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
        raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0, or None")
    block_bytes = check_block_bytes(block_bytes)
    if isinstance(lookup_ttl, bool) or not isinstance(lookup_ttl, int | float) or lookup_ttl < 0:
        raise ValueError(f"lookup_ttl={lookup_ttl!r} must be a number of seconds >= 0")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int | np.integer)):
        raise ValueError(f"step={step!r} must be an integer step number, or None for the latest")
    options = OpenOptions(
        s3_endpoint=s3_endpoint,
        s3_region=s3_region,
        create=create,
        timeout=timeout,
        step=step,
        runtime=runtime,
        manifest=manifest,
        context=store_context(retries),
        deadline=Deadline(timeout),
        shared=bool(shared),
        lookup_ttl=float(lookup_ttl),
    )
    found = _list_location(spec_or_path, options)
    if step is not None and not manager_steps(found.keys):
        raise ValueError(
            f"step={step} was given, but {found.label} is not a CheckpointManager root (it has "
            "no step directories); pass the root, or drop step="
        )
    source = SOURCES.find(found)
    if source is None:
        raise StoreError(
            f"{found.label} is neither a cacheflow store (no zarr.json arrays) nor an orbax "
            f"checkpoint (no _METADATA or manifest.ocdbt); it holds {len(found.keys)} other "
            f"files, e.g. {found.keys[:3]}. {HOW_TO_CREATE}"
        )
    parts = source.open(found, options)
    if block_bytes is None and not parts.writer_chose_chunks:
        block_bytes = DEFAULT_BLOCK_BYTES
    return TensorStoreStore(parts, block_bytes=block_bytes)


def _list_location(
    spec_or_path: str | os.PathLike[str] | Mapping[str, Any], options: OpenOptions
) -> Listing:
    """Resolves the location, checks a local one (creating it with ``create``), opens its
    kvstore and lists every key under it."""
    kv_spec, label, local = resolve(spec_or_path, options.s3_endpoint, options.s3_region)
    if local is not None:
        if not local.exists():
            if not options.create:
                raise FileNotFoundError(
                    f"no store at {local}: the path does not exist. {HOW_TO_CREATE}, or pass "
                    "create=True for an empty store of runtime blocks"
                )
            local.mkdir(parents=True)
        elif not local.is_dir():
            raise StoreError(f"{local} is a file, not a store directory. {HOW_TO_CREATE}")
    kv = open_kvstore(kv_spec, label, context=options.context, deadline=options.deadline)
    keys = list_keys(kv, label, options.deadline)
    return Listing(
        kv=kv,
        kv_spec=kv_spec,
        label=label,
        local=local,
        keys=[k for k in keys if not k.startswith(RUNTIME_PREFIX)],
        runtime_keys=runtime_keys(keys),
    )
