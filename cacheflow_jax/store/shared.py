"""The bound of a shared runtime store: `trim_runtime`, an eviction pass run by one process.

Design note. Many processes put KV blocks into one shared store (``open_store(...,
shared=True)``, docs/scale.md); each keeps its own L1 and L2 within hard budgets, but the store
itself would grow with every distinct prefix. Two ways bound it, and neither needs processes to
agree on anything, because the blocks are immutable and re-creatable (a KV block that is gone
is a miss: its reader gets ``KeyError`` / `TieredCache.get_found` reports it missing, and the
engine computes and puts it again):

* an object-store lifecycle rule that expires ``<store>/_runtime/`` objects some days after
  they were written (S3, GCS, MinIO all have one): nothing of ours runs, the bound is in days;
* `trim_runtime`, run by one elected process (process 0 of a ``jax.distributed`` job, or a
  cron job): it lists the blocks, reads their headers (one small ranged read each), and
  removes the oldest until the blocks take at most ``max_bytes``. Two passes at once only
  remove more. The order is the time each block was published (its header's ``time``), first
  in first out: a hot block removed early is published again by the next process that
  computes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorstore as ts

from cacheflow_jax.core.blocks import CorruptBlockError
from cacheflow_jax.store.futures import Deadline, wait_all
from cacheflow_jax.store.runtime_area import runtime_keys
from cacheflow_jax.store.runtime_format import (
    RUNTIME_MIN_HEADER,
    RUNTIME_PREFIX,
    parse_runtime_header,
    runtime_name,
)

if TYPE_CHECKING:
    from cacheflow_jax.store.tensorstore_store import TensorStoreStore

__all__ = ["trim_runtime"]

# Header reads and deletes are issued this many at a time.
_BATCH = 256


def trim_runtime(
    store: TensorStoreStore, *, max_bytes: int, dry_run: bool = False
) -> dict[str, Any]:
    """Removes the oldest runtime blocks of a shared store until the rest take ``max_bytes``.

    Run it from one process at a time (see the module note); the others need not stop: a block
    removed under a reader is a ``KeyError`` for it, never a damaged block.

    Args:
      store: a store opened with ``open_store(..., shared=True)``.
      max_bytes: the most bytes (block files: headers and payloads) the runtime blocks may take
        after the pass.
      dry_run: only report what would be removed.

    Returns:
      ``{"blocks", "bytes"}`` found, ``{"removed", "removed_bytes"}`` (to be) removed, and
      ``"damaged"``: blocks whose header failed its checks (removed first).

    Raises:
      ValueError: ``store`` is not shared, or ``max_bytes`` is negative.
      StoreError: the store could not be listed, read or written (StoreTimeoutError past the
        store's deadline).

    >>> trim_runtime(cfj.open_store("s3://bucket/kv", shared=True), max_bytes=50 << 30)  # doctest: +SKIP
    {'blocks': 1200, 'bytes': 2516582400, 'removed': 0, 'removed_bytes': 0, 'damaged': 0}
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes={max_bytes!r} must be a number of bytes >= 0")
    area = store.runtime_area
    if not area.shared:
        raise ValueError(
            f"trim_runtime removes blocks of shared stores only; store {store.spec} was opened "
            "without shared=True, so its cache may hold blocks that exist nowhere else. Open it "
            "with open_store(..., shared=True)"
        )
    deadline = Deadline(area.timeout)
    prefix = RUNTIME_PREFIX.encode()
    listing = area.kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + b"0"))
    names = sorted(k.decode() for k in wait_all([listing], f"listing {area.label}", deadline)[0])
    keys = runtime_keys(names)
    blocks: list[tuple[float, int, str]] = []  # (published, bytes, key)
    damaged = 0
    for lo in range(0, len(keys), _BATCH):
        batch = keys[lo : lo + _BATCH]
        heads = wait_all(
            [area.kv.read(runtime_name(k), byte_range=slice(0, RUNTIME_MIN_HEADER)) for k in batch],
            f"reading block headers of {area.label}",
            deadline,
        )
        for key, head in zip(batch, heads):
            if head.state != "value":
                continue  # removed meanwhile
            data = head.value
            if len(data) >= 12 and int.from_bytes(data[8:12], "little") > len(data):
                whole = slice(0, int.from_bytes(data[8:12], "little"))  # a long header
                read = area.kv.read(runtime_name(key), byte_range=whole)
                data = wait_all([read], f"reading the header of {key!r}", deadline)[0].value
            size = _size_and_time(key, data, area)
            damaged += size is None
            blocks.append(size or (float("-inf"), RUNTIME_MIN_HEADER, key))
    blocks.sort()
    total = sum(nbytes for _, nbytes, _ in blocks)
    remove, left = [], total
    for _, nbytes, key in blocks:
        if left <= max_bytes:
            break
        remove.append(key)
        left -= nbytes
    if not dry_run:
        for lo in range(0, len(remove), _BATCH):
            batch = remove[lo : lo + _BATCH]
            names = [runtime_name(k) for k in batch]
            ranges = [ts.KvStore.KeyRange(n.encode(), n.encode() + b"\0") for n in names]
            wait_all(
                [area.kv.delete_range(r) for r in ranges],
                f"removing blocks of {area.label}",
                deadline,
            )
            for key in batch:
                area.forget(key)
    return {
        "blocks": len(blocks),
        "bytes": total,
        "removed": len(remove),
        "removed_bytes": total - left,
        "damaged": damaged,
    }


def _size_and_time(key: str, head: bytes, area: Any) -> tuple[float, int, str] | None:
    """(publication time, file bytes, key) from a block's first bytes; None if damaged."""
    try:
        header, size = parse_runtime_header(head, key, area.label, area.where(runtime_name(key)))
    except CorruptBlockError:
        return None
    if not header:  # cut short: damaged
        return None
    dtype, shape = header["dtype"], header["shape"]
    payload = dtype.itemsize
    for n in shape:
        payload *= n
    return (float(header.get("time", 0.0)), size + payload, key)
