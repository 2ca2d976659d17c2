"""Pytree blocks: one runtime block that is a tree of arrays (for example per-layer K and V).

A pytree block is a ``dict`` (``str`` keys), ``list`` or ``tuple``, nested, whose leaves are
arrays. It is one key, one budget entry and one file in L3; every tier keeps its structure, and
a block read back from L3 has the same containers, key order, shapes and dtypes, bitwise.

Only these three containers are accepted, so that the structure can be written as JSON and
rebuilt exactly from any tier: a ``NamedTuple``, a dataclass or a Flax ``State`` is refused at
``put`` with a clear error (convert it with ``dataclasses.asdict``, ``nnx.to_pure_dict`` or
``tuple(...)`` first).

A ``list`` or ``tuple`` with no array inside (``[1, 2, 3]``) is not a tree but one array, as
``jnp.asarray`` reads it; a ``dict`` is always a tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cacheflow_jax.core.blocks import BlockInfo

# The containers of a pytree block (exact types: a subclass is refused at put).
TREES = (dict, list, tuple)

# The structure's JSON: {"dict": [[key, sub], ...]} | {"list": [sub, ...]} | {"tuple": [...]}
# | {"leaf": index}. ``dict`` keeps its keys' order (a list of pairs).


def is_tree(value: Any) -> bool:
    """Whether ``value`` is a pytree block rather than one array (see the module docstring)."""
    if isinstance(value, dict):
        return True
    if isinstance(value, list | tuple):
        return any(_has_array(v) for v in value)
    return False


def _has_array(value: Any) -> bool:
    if isinstance(value, dict):
        return True
    if isinstance(value, list | tuple):
        return any(_has_array(v) for v in value)
    return hasattr(value, "dtype") and hasattr(value, "shape") and not _is_scalar(value)


def _is_scalar(value: Any) -> bool:
    import numpy as np

    return isinstance(value, np.generic)


def flatten(value: Any, key: str) -> tuple[list[tuple[str, Any]], dict]:
    """The leaves of a pytree block, in order, each with its path (``"['k'][0]"``), and its
    structure (JSON-ready).

    Raises:
      TypeError: a container that is not a ``dict``/``list``/``tuple``, a dict key that is not
        a ``str``, or an empty tree; named by its path in the tree.
    """
    leaves: list[Any] = []

    def walk(node: Any, path: str) -> dict:
        if isinstance(node, dict):
            items = []
            for k, sub in node.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"cannot put {key!r}: the dict at {path or 'the root'} has a key "
                        f"{k!r} of type {type(k).__name__}; pytree blocks take str keys"
                    )
                items.append([k, walk(sub, f"{path}[{k!r}]")])
            return {"dict": items}
        if type(node) in (list, tuple):
            kind = type(node).__name__
            return {kind: [walk(sub, f"{path}[{i}]") for i, sub in enumerate(node)]}
        if isinstance(node, list | tuple):  # a NamedTuple, a list subclass
            raise TypeError(
                f"cannot put {key!r}: {path or 'the root'} is a {type(node).__name__}; pytree "
                "blocks take dict, list and tuple containers only (convert it, e.g. tuple(x))"
            )
        leaves.append((path, node))
        return {"leaf": len(leaves) - 1}

    structure = walk(value, "")
    if not leaves:
        raise TypeError(f"cannot put {key!r}: the pytree has no arrays; put at least one array")
    return leaves, structure


def plain_leaves(value: Any) -> list[Any] | None:
    """The leaves of a pytree block built of exact ``dict`` (str keys), ``list`` and ``tuple``
    containers, in `flatten`'s order; None for anything else (`flatten` then says what is
    wrong). The fast path of a put: no paths, no structure."""
    out: list[Any] = []
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is dict:
            for k in node:
                if type(k) is not str:
                    return None
            stack.extend(reversed(node.values()))
        elif kind is list or kind is tuple:
            stack.extend(reversed(node))
        elif isinstance(node, list | tuple | dict):
            return None
        else:
            out.append(node)
    return out or None


def unflatten(structure: dict, leaves: list[Any]) -> Any:
    """Rebuilds a pytree block from its structure (`flatten`) and leaves."""
    if "leaf" in structure:
        return leaves[structure["leaf"]]
    if "dict" in structure:
        return {k: unflatten(sub, leaves) for k, sub in structure["dict"]}
    if "list" in structure:
        return [unflatten(sub, leaves) for sub in structure["list"]]
    return tuple(unflatten(sub, leaves) for sub in structure["tuple"])


def tree_map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` over the leaves of a block (a plain array is its own only leaf)."""
    if isinstance(value, dict):
        return {k: tree_map(fn, v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(tree_map(fn, v) for v in value)
    return fn(value)


def leaves_of(value: Any) -> list[Any]:
    """The leaves of a block, in `flatten`'s order (a plain array: itself)."""
    out: list[Any] = []
    _collect(value, out)
    return out


def _collect(node: Any, out: list[Any]) -> None:
    """Appends the leaves of ``node`` to ``out`` (`tree_map`'s walk, building nothing)."""
    if isinstance(node, dict):
        children: Any = node.values()
    elif type(node) in (list, tuple):
        children = node
    else:
        out.append(node)
        return
    for child in children:
        if isinstance(child, dict) or type(child) in (list, tuple):
            _collect(child, out)
        else:
            out.append(child)


def block_info(key: str, value: Any) -> BlockInfo:
    """The `BlockInfo` of a runtime block: an array's shape and dtype, or for a pytree block
    its bytes (``shape=(nbytes,)``, uint8) and each leaf's shape and dtype."""
    import numpy as np

    if not is_tree(value):
        return BlockInfo(key, tuple(value.shape), np.dtype(value.dtype), int(value.nbytes))
    leaves = leaves_of(value)
    nbytes = sum(int(leaf.nbytes) for leaf in leaves)
    described = tuple((tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in leaves)
    return BlockInfo(key, (nbytes,), np.dtype(np.uint8), nbytes, leaves=described)
