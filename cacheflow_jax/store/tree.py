"""The stored pytree: key paths of arrays, and the skeleton `TensorStoreStore.tree` returns.

Every array of a store has a key path in the stored pytree (``jax.tree_util`` ``DictKey`` /
``SequenceKey`` entries): `write_store` saves it in each array's attributes (`key_part`), a
cacheflow store reads it back (`key_path_from_attr`) and an orbax checkpoint has it in its
``_METADATA``. `skeleton` rebuilds the tree's nested dicts and lists from the key paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from cacheflow_jax.core.blocks import KeyKind

_KIND = object()  # the skeleton builder's tag for a node's key type


def skeleton(
    tree_paths: Mapping[str, tuple[KeyKind, ...]], empty_nodes: Mapping[tuple[KeyKind, ...], Any]
) -> Any:
    """The stored pytree's skeleton: nested dicts and lists whose leaves are array paths.

    Args:
      tree_paths: each array path's key path.
      empty_nodes: key paths of nodes that hold no array (empty dicts and lists, ``None``), with
        their value.

    >>> skeleton({"w/0": (jax.tree_util.DictKey("w"), jax.tree_util.SequenceKey(0))}, {})
    {'w': ['w/0']}
    """
    items: list[tuple[tuple[KeyKind, ...], Any]] = [
        (kp, path) for path, kp in tree_paths.items()
    ] + list(empty_nodes.items())
    if not items:
        return {}
    if any(not kp for kp, _ in items):
        return next(v for kp, v in items if not kp)  # the whole tree is one leaf
    # Nodes are dicts keyed by (key type, key), tagged with the type of their own keys.
    root: dict = {_KIND: type(items[0][0][0])}
    for kp, value in items:
        node = root
        for k, nxt in zip(kp[:-1], kp[1:], strict=True):
            node = node.setdefault((type(k), _key_of(k)), {_KIND: type(nxt)})
        node[(type(kp[-1]), _key_of(kp[-1]))] = value
    return _materialize(root)


def _key_of(k: KeyKind) -> Any:
    """The plain key (dict key or list index) of a key path entry."""
    return k.key if isinstance(k, jax.tree_util.DictKey) else k.idx


def _materialize(node: Any) -> Any:
    """Turns the skeleton builder's tagged dicts into plain dicts and lists."""
    if not isinstance(node, dict) or _KIND not in node:
        return node
    kind = node.pop(_KIND, jax.tree_util.DictKey)
    children = {k: _materialize(v) for k, v in node.items()}
    if kind is jax.tree_util.SequenceKey and all(
        t is jax.tree_util.SequenceKey for t, _ in children
    ):
        idxs = sorted(i for _, i in children)
        if idxs == list(range(len(idxs))):
            return [children[(jax.tree_util.SequenceKey, i)] for i in idxs]
    return {k: v for (_, k), v in sorted(children.items(), key=lambda kv: str(kv[0][1]))}


def key_path_from_attr(attr: Any, path: str) -> tuple[KeyKind, ...]:
    """The key path of a cacheflow array: from its attributes, else from its path."""
    try:
        out: list[KeyKind] = []
        for kind, k in attr["tree_path"]:
            out.append(
                jax.tree_util.SequenceKey(int(k)) if kind == "seq" else jax.tree_util.DictKey(k)
            )
        return tuple(out)
    except (TypeError, KeyError, ValueError):
        return tuple(jax.tree_util.DictKey(p) for p in path.split("/"))


def key_part(k: Any) -> tuple[str, str | int]:
    """(kind, key) of one jax key path entry, for naming and for the saved tree path."""
    if isinstance(k, jax.tree_util.SequenceKey):
        return "seq", k.idx
    if isinstance(k, jax.tree_util.DictKey):
        return "dict", k.key
    if isinstance(k, jax.tree_util.GetAttrKey):
        return "dict", k.name
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return "seq", k.key
    return "dict", str(k)
