"""Where a store lives: paths, URLs and kvstore specs, and the TensorStore context they open in.

`resolve` turns what a user passes to ``open_store`` (a local path, ``file://``, ``memory://``,
``s3://``, ``gs://`` or a kvstore spec dict) into one kvstore spec, a label for error messages and
the local directory if there is one. Every store of the process opens in one TensorStore context
(``CONTEXT``), so ``memory://`` stores written and opened in one process see the same data.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tensorstore as ts

from cacheflow_jax.core.blocks import DEFAULT_RETRIES, DEFAULT_TIMEOUT, StoreError  # noqa: F401
from cacheflow_jax.store.futures import Deadline, wait_for

# One context for every store in the process.
# * cache_pool 0: the cache's L2 tier is the host cache; a TensorStore chunk cache would hold a
#   second copy of the same bytes outside any budget and make "cold" L3 reads warm.
# * cache_pool#ocdbt: orbax checkpoints are read through the ocdbt kvstore, whose manifest and
#   b-tree nodes would otherwise be re-read for every chunk; these nodes are small metadata, not
#   block data, so a bounded cache for them does not duplicate L2.
# * data_copy_concurrency: decoding (checksum, copy out) is CPU work; one thread per core.
# * file_io_concurrency: block reads are many small independent reads issued at once by the
#   prefetcher; SSDs need a deep queue to reach their bandwidth, and blocked threads are cheap.
# * memory://: the memory kvstore lives in this context, so write_store and open_store in one
#   process see the same data.
CONTEXT_SPEC: dict[str, Any] = {
    "cache_pool": {"total_bytes_limit": 0},
    "cache_pool#ocdbt": {"total_bytes_limit": 64 * 2**20},
    "data_copy_concurrency": {"limit": max(2, os.cpu_count() or 2)},
    "file_io_concurrency": {"limit": max(32, 8 * (os.cpu_count() or 2))},
}
CONTEXT = ts.Context(CONTEXT_SPEC)

# L3 operations have deadlines (see TieredCache(l3_timeout=) and open_store(timeout=)). Object
# stores also retry failed requests; TensorStore's default is 32 retries with backoff, about 11
# minutes against a dead endpoint, far past any deadline. A store's context bounds them.
_CONTEXTS: dict[int, ts.Context] = {}


def store_context(retries: int) -> ts.Context:
    """The TensorStore context of stores that retry failed S3/GCS requests ``retries`` times.

    A child of ``CONTEXT``: it shares the cache pools, the concurrency limits and the memory
    kvstore, and overrides only the retry policy.
    """
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries={retries!r} must be an integer >= 0")
    context = _CONTEXTS.get(retries)
    if context is None:
        policy = {"max_retries": max(1, retries), "initial_delay": "100ms", "max_delay": "2s"}
        context = _CONTEXTS.setdefault(
            retries,
            ts.Context(
                {"s3_request_retries": policy, "gcs_request_retries": policy}, parent=CONTEXT
            ),
        )
    return context


def join_spec(kv: Mapping[str, Any], sub: str) -> dict[str, Any]:
    """The kvstore spec ``kv`` with ``sub`` appended to its path."""
    out = dict(kv)
    out["path"] = str(kv.get("path", "")) + sub
    return out


def _dir_spec(kv: Mapping[str, Any]) -> dict[str, Any]:
    """``kv`` with a path that ends in '/' (or is empty), so sub-paths join as directories."""
    out = dict(kv)
    path = str(out.get("path", ""))
    if path and not path.endswith("/"):
        out["path"] = path + "/"
    return out


def _s3_spec(bucket: str, prefix: str, endpoint: str | None, region: str | None) -> dict[str, Any]:
    """The kvstore spec of ``s3://bucket/prefix``, with endpoint/region from args or env."""
    endpoint = (
        endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint and not region:
        # S3-compatible servers (moto, MinIO) answer as us-east-1; without a region TensorStore
        # would try to discover it from the bucket, which these servers do not all support.
        region = "us-east-1"
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": prefix}
    if endpoint:
        spec["endpoint"] = endpoint
    if region:
        spec["aws_region"] = region
    return spec


def resolve(
    spec_or_path: str | os.PathLike[str] | Mapping[str, Any],
    s3_endpoint: str | None,
    s3_region: str | None,
) -> tuple[dict[str, Any], str, Path | None]:
    """Turns a path, URL or kvstore spec into (kvstore spec, label, local directory or None)."""
    if isinstance(spec_or_path, Mapping):
        kv = dict(spec_or_path)
        if "kvstore" in kv and "driver" in kv and kv["driver"] in ("zarr3", "zarr"):
            kv = dict(kv["kvstore"])
        if "driver" not in kv:
            raise ValueError(
                f"kvstore spec {spec_or_path!r} has no 'driver'; pass e.g. "
                "{'driver': 'file', 'path': '/data/store'}"
            )
        kv = _dir_spec(kv)
        local = Path(kv["path"]) if kv["driver"] == "file" else None
        try:
            label = ts.KvStore.Spec(kv).url
        except Exception:  # not every driver has a URL form
            label = json.dumps(kv, sort_keys=True)
        return kv, label, local
    text = os.fspath(spec_or_path)
    scheme, sep, rest = text.partition("://")
    if not sep:
        local = Path(text).expanduser().absolute()
        return {"driver": "file", "path": str(local) + "/"}, str(local), local
    if scheme == "file":
        local = Path(urllib.parse.unquote(rest)).absolute()
        return {"driver": "file", "path": str(local) + "/"}, str(local), local
    if scheme == "memory":
        return _dir_spec({"driver": "memory", "path": rest}), text, None
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"{text!r} names no bucket; expected {scheme}://bucket/prefix")
        prefix = prefix.strip("/")
        prefix = prefix + "/" if prefix else ""
        if scheme == "s3":
            return _s3_spec(bucket, prefix, s3_endpoint, s3_region), text, None
        return {"driver": "gcs", "bucket": bucket, "path": prefix}, text, None
    raise ValueError(
        f"unsupported store URL {text!r}: expected a local path, file://, memory://, s3:// or "
        "gs:// URL, or a TensorStore kvstore spec dict"
    )


def location(label: str, name: str) -> str:
    """A readable location of kvstore key ``name`` under a store labelled ``label``: a file on
    local disk, an object in an object store (or the memory kvstore)."""
    scheme, sep, _ = label.partition("://")
    kind = "object" if sep and scheme != "file" else "file"
    return f"{kind} {label.rstrip('/')}/{name}"


def list_keys(kv: ts.KvStore, label: str, deadline: Deadline | None = None) -> list[str]:
    """Every key under ``kv``, sorted; StoreError (or StoreTimeoutError past ``deadline``)."""
    try:
        keys = wait_for(kv.list(), deadline or Deadline(None), f"listing store {label}")
    except StoreError:
        raise
    except Exception as err:
        raise StoreError(f"cannot list store {label}: {err}") from err
    return sorted(k.decode() for k in keys)


def open_kvstore(
    kv_spec: Mapping[str, Any],
    label: str,
    *,
    context: ts.Context | None = None,
    deadline: Deadline | None = None,
) -> ts.KvStore:
    """Opens a kvstore in ``context`` (default: the process's); StoreError naming ``label``."""
    try:
        future = ts.KvStore.open(dict(kv_spec), context=context or CONTEXT)
        return wait_for(future, deadline or Deadline(None), f"opening store {label}")
    except StoreError:
        raise
    except Exception as err:
        raise StoreError(f"cannot open store {label} ({dict(kv_spec)}): {err}") from err
