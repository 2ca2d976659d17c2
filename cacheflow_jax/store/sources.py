"""Store sources: the formats `open_store` understands, one small class each, and their registry.

As orbax picks the handler of a checkpoint item, `open_store` lists a location once (a
`Listing`) and asks the sources of its `SourceRegistry`, in order, which one recognises what it
found; that source opens it into the `StoreParts` a `TensorStoreStore` is built from. A source is
a `StoreSource`: a name, ``recognizes(listing)`` (no I/O: the listing has every key) and
``open(listing, options)``. The sources, in the order ``open.SOURCES`` asks them:

* ``orbax_source.OrbaxCheckpoint``: an orbax checkpoint: an item directory, a
  ``CheckpointManager`` step directory holding one item, or the manager's root;
* ``zarr_source.CacheflowStore``: zarr3 arrays under a root (a store `write_store` wrote, or any
  zarr3 hierarchy);
* ``zarr_source.EmptyLocation``: a location without data (a store of runtime blocks only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cacheflow_jax.store.parts import StoreParts

if TYPE_CHECKING:
    import tensorstore as ts

    from cacheflow_jax.store.futures import Deadline
    from cacheflow_jax.store.runtime_area import RuntimeArea

HOW_TO_CREATE = (
    "Create a store with cacheflow_jax.write_store(tree, path) or `cacheflow demo`, or point at "
    "an orbax checkpoint directory"
)


@dataclasses.dataclass(frozen=True)
class OpenOptions:
    """What `open_store` was asked for, as the sources use it (see its arguments)."""

    s3_endpoint: str | None
    s3_region: str | None
    create: bool
    timeout: float | None
    step: int | None
    runtime: Any
    manifest: bool
    context: ts.Context
    deadline: Deadline
    shared: bool = False
    lookup_ttl: float = 1.0


@dataclasses.dataclass(frozen=True)
class Listing:
    """A location as `open_store` found it: its open kvstore and every key listed under it."""

    kv: ts.KvStore
    kv_spec: dict[str, Any]
    label: str
    local: Path | None  # the local directory of a file location
    keys: list[str]  # the data keys: every key but the runtime blocks', sorted
    runtime_keys: list[str]  # the runtime blocks found there (their keys)

    @property
    def has_zarr(self) -> bool:
        """Whether a zarr3 node's metadata (``zarr.json``) is among the keys."""
        return any(k == "zarr.json" or k.endswith("/zarr.json") for k in self.keys)

    def own_runtime(self) -> tuple[ts.KvStore, str, str | None, list[str]]:
        """The location itself as a runtime area: (kvstore, label, local root, runtime keys)."""
        local = str(self.local) if self.local is not None else None
        return self.kv, self.label, local, self.runtime_keys


def build_parts(
    found: Listing,
    options: OpenOptions,
    *,
    runtime: RuntimeArea,
    label: str | None = None,
    **fields: Any,
) -> StoreParts:
    """The parts of a store at ``found`` (under ``label`` if given): ``fields`` are a source's."""
    return StoreParts(
        label=found.label if label is None else label,
        kvstore=found.kv,
        kvstore_spec=found.kv_spec,
        runtime=runtime,
        context=options.context,
        timeout=options.timeout,
        **fields,
    )


class StoreSource:
    """One format `open_store` can open. Subclasses set ``name`` and implement both methods."""

    name: ClassVar[str] = ""

    def recognizes(self, found: Listing) -> bool:
        """Whether the location ``found`` is in this format (decided from its keys alone)."""
        raise NotImplementedError

    def open(self, found: Listing, options: OpenOptions) -> StoreParts:
        """Opens the location ``found`` (which this source recognised).

        Raises:
          StoreError: the location is damaged, or cannot be read.
          StoreTimeoutError: the store did not answer before ``options.deadline``.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SourceRegistry:
    """The sources `open_store` asks, in order; the first that recognises a location opens it."""

    def __init__(self, sources: Iterable[StoreSource] = ()) -> None:
        self._sources: list[StoreSource] = list(sources)

    def add(self, source: StoreSource, *, first: bool = False) -> None:
        """Adds ``source``, asked after the others (before them with ``first``)."""
        if first:
            self._sources.insert(0, source)
        else:
            self._sources.append(source)

    def sources(self) -> tuple[StoreSource, ...]:
        """The sources, in the order they are asked."""
        return tuple(self._sources)

    def find(self, found: Listing) -> StoreSource | None:
        """The first source that recognises ``found``, or None."""
        return next((s for s in self._sources if s.recognizes(found)), None)
