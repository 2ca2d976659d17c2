"""``pack_lines``: write N lines into a slab of fixed-size lines at given slots, in place.

The slab is a 2-D array ``(num_lines, line_width)``; a line is one row. The op is the write half
of the device cache: a block is cut into lines and each line lands in a free slot of the slab.

Cost: N * line_width elements read and written once; the rest of the slab is untouched (the slab
is donated to the op, or aliased inside a caller's ``jit``, never copied whole).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels._common import as_words, compiler_params, from_words, pow2_divisor, resolve

# The widest row piece one program copies (elements). A power of two for Triton.
MAX_BLOCK_WIDTH = 1024


def pack_lines_kernel(slots_ref, lines_ref, slab_in_ref, slab_ref, *, block_width: int):
    """Program (i, j) copies piece j of line i to the same piece of line ``slots[i]``.

    ``slab_in_ref`` is the slab as an input; it is aliased to ``slab_ref`` and not read.
    """
    del slab_in_ref
    i, j = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[i]
    slab_ref[pl.ds(slot, 1), pl.ds(j * block_width, block_width)] = lines_ref[...]


def _check(slab, lines, slots) -> None:
    if slab.ndim != 2 or lines.ndim != 2:
        raise ValueError(
            f"pack_lines: slab and lines must be 2-D (lines, width); got slab {slab.shape} "
            f"and lines {lines.shape}"
        )
    if lines.shape[1] != slab.shape[1] or lines.dtype != slab.dtype:
        raise ValueError(
            f"pack_lines: lines {lines.shape} {lines.dtype} must have the slab's width and "
            f"dtype ({slab.shape[1]}, {slab.dtype})"
        )
    if slots.ndim != 1 or slots.shape[0] != lines.shape[0]:
        raise ValueError(
            f"pack_lines: slots {slots.shape} must be 1-D with one slot per line "
            f"({lines.shape[0]} lines)"
        )
    if not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"pack_lines: slots must be integers, not {slots.dtype}")


def _pack_lines_pallas(slab, lines, slots, *, interpret: bool):
    """Validates the inputs and runs `pack_lines_kernel` over a (lines, pieces) grid."""
    _check(slab, lines, slots)
    n, width = lines.shape
    if n == 0:
        return slab
    block_width = pow2_divisor(width, MAX_BLOCK_WIDTH)
    dtype, slab, lines = slab.dtype, as_words(slab), as_words(lines)  # bytes: see `as_words`
    packed = pl.pallas_call(
        functools.partial(pack_lines_kernel, block_width=block_width),
        grid=(n, width // block_width),
        in_specs=[
            pl.no_block_spec,  # slots: read one scalar per program
            pl.BlockSpec((1, block_width), lambda i, j: (i, j)),
            pl.no_block_spec,  # the slab, written at data-dependent rows
        ],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(slab.shape, slab.dtype),
        input_output_aliases={2: 0},
        interpret=interpret,
        compiler_params=compiler_params(interpret),
        name="pack_lines",
    )(slots.astype(jnp.int32), lines, slab)
    return from_words(packed, dtype)


def pack_lines_reference(slab: jax.Array, lines: jax.Array, slots: jax.Array) -> jax.Array:
    """``slab`` with ``slab[slots[i]] = lines[i]``: the plain-jnp definition of `pack_lines`.

    Floats are scattered as words (`as_words`): XLA's scatter on the CPU flushed bfloat16
    subnormals to zero.
    """
    return from_words(as_words(slab).at[slots].set(as_words(lines)), slab.dtype)


@functools.partial(jax.jit, static_argnames=("implementation", "interpret"), donate_argnums=(0,))
def _pack_lines(slab, lines, slots, *, implementation: str, interpret: bool):
    _check(slab, lines, slots)
    if resolve(implementation, interpret, op="pack_lines") == "pallas":
        return _pack_lines_pallas(slab, lines, slots, interpret=interpret)
    packed = as_words(slab).at[slots].set(as_words(lines), unique_indices=True)
    return from_words(packed, slab.dtype)


def pack_lines(
    slab: jax.Array,
    lines: jax.Array,
    slots: jax.Array,
    *,
    implementation: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Writes ``lines[i]`` into line ``slots[i]`` of ``slab`` and returns the updated slab.

    The slab is donated: on return the array passed in is invalid and the result reuses its
    buffer (inside a caller's ``jit``, donate the slab there to keep the update in place).

    Args:
      slab: ``(num_lines, width)``, any dtype.
      lines: ``(n, width)``, the slab's dtype.
      slots: ``(n,)`` integers, distinct, each in ``[0, num_lines)``. Host slots (numpy, lists)
        are checked; device slots are trusted (a repeated slot leaves either line there).
      implementation: ``"auto"`` (the Pallas kernel on GPU, XLA elsewhere), ``"pallas"`` or
        ``"xla"``.
      interpret: run the Pallas kernel in interpret mode (any backend; for tests).

    Returns:
      The slab with the lines written.

    Raises:
      ValueError: shapes or dtypes disagree, or host slots repeat or fall outside the slab.

    >>> import jax.numpy as jnp
    >>> slab = pack_lines(jnp.zeros((4, 2)), jnp.ones((1, 2)), jnp.array([2]))
    >>> slab[:, 0].tolist()
    [0.0, 0.0, 1.0, 0.0]
    """
    if not isinstance(slots, jax.Array):
        host = np.asarray(slots)
        num_lines = np.shape(slab)[0]
        if host.size and (host.min() < 0 or host.max() >= num_lines):
            bad = host[(host < 0) | (host >= num_lines)][0]
            raise ValueError(
                f"pack_lines: slot {bad} is outside the slab's {num_lines} lines; slots must "
                f"lie in [0, {num_lines})"
            )
        if np.unique(host).size != host.size:
            raise ValueError(
                f"pack_lines: slots {host.tolist()} repeat a slot; give each line its own slot"
            )
        slots = host.astype(np.int32)
    return _pack_lines(slab, lines, slots, implementation=implementation, interpret=interpret)
