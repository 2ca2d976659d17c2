"""``gather_lines``: read the lines at given slots of a slab, in order.

The read half of the device cache: a block's lines are gathered (they need not be contiguous)
into one array, which the caller bitcasts and reshapes into the block.

Cost: N * line_width elements read and written once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import as_words, compiler_params, from_words, pow2_divisor, resolve

MAX_BLOCK_WIDTH = 1024


def gather_lines_kernel(slots_ref, slab_ref, *out_refs, block_width: int):
    """Program (i, j) copies piece j of line ``slots[i]`` to piece j of output row i.

    ``out_refs`` is the output ref, preceded by the caller's ``out`` buffer when one was given
    (aliased to the output and not read).
    """
    i, j = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[i]
    out_refs[-1][...] = slab_ref[pl.ds(slot, 1), pl.ds(j * block_width, block_width)]


def _check(slab, slots, out) -> None:
    if slab.ndim != 2:
        raise ValueError(f"gather_lines: slab must be 2-D (lines, width); got {slab.shape}")
    if slots.ndim != 1 or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(
            f"gather_lines: slots must be a 1-D integer array; got {slots.shape} {slots.dtype}"
        )
    want = (slots.shape[0], slab.shape[1])
    if out is not None and (out.shape != want or out.dtype != slab.dtype):
        raise ValueError(f"gather_lines: out {out.shape} {out.dtype} must be {want} {slab.dtype}")


def _gather_lines_pallas(slab, slots, out=None, *, interpret: bool):
    """Validates the inputs and runs `gather_lines_kernel` over a (slots, pieces) grid."""
    _check(slab, slots, out)
    n, width = slots.shape[0], slab.shape[1]
    shape = jax.ShapeDtypeStruct((n, width), slab.dtype)
    if n == 0:
        return jnp.zeros(shape.shape, shape.dtype)
    block_width = pow2_divisor(width, MAX_BLOCK_WIDTH)
    dtype, slab = slab.dtype, as_words(slab)  # bytes, not floats: see `as_words`
    given = [] if out is None else [as_words(out)]
    shape = jax.ShapeDtypeStruct((n, width), slab.dtype)
    lines = pl.pallas_call(
        functools.partial(gather_lines_kernel, block_width=block_width),
        grid=(n, width // block_width),
        # slots (one scalar read per program), the slab (read at data-dependent rows), and the
        # caller's output buffer if any.
        in_specs=[pl.no_block_spec, pl.no_block_spec] + [pl.no_block_spec] * len(given),
        out_specs=pl.BlockSpec((1, block_width), lambda i, j: (i, j)),
        out_shape=shape,
        input_output_aliases={2: 0} if given else {},
        interpret=interpret,
        compiler_params=compiler_params(interpret),
        name="gather_lines",
    )(slots.astype(jnp.int32), slab, *given)
    return from_words(lines, dtype)


def gather_lines_reference(slab: jax.Array, slots: jax.Array) -> jax.Array:
    """``slab[slots]``: the plain-jnp definition of `gather_lines`."""
    return slab[slots]


@functools.partial(
    jax.jit, static_argnames=("implementation", "interpret"), donate_argnames=("out",)
)
def _gather_lines(slab, slots, out, *, implementation: str, interpret: bool):
    _check(slab, slots, out)
    if resolve(implementation, interpret, op="gather_lines") == "pallas":
        return _gather_lines_pallas(slab, slots, out, interpret=interpret)
    lines = gather_lines_reference(slab, slots)
    # Writing into the donated buffer lets XLA reuse it, as the kernel does.
    return lines if out is None else jax.lax.dynamic_update_slice(out, lines, (0, 0))


def gather_lines(
    slab: jax.Array,
    slots: jax.Array,
    *,
    out: jax.Array | None = None,
    implementation: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Returns ``slab[slots]``: the lines at ``slots``, in order, as an ``(n, width)`` array.

    Args:
      slab: ``(num_lines, width)``, any dtype.
      slots: ``(n,)`` integers in ``[0, num_lines)``; repeats are allowed.
      out: optional ``(n, width)`` buffer of the slab's dtype, donated; the Pallas kernel writes
        the result into it (every element), so a caller can reuse one output buffer.
      implementation: ``"auto"`` (the Pallas kernel on GPU, XLA elsewhere), ``"pallas"`` or
        ``"xla"``.
      interpret: run the Pallas kernel in interpret mode (any backend; for tests).

    Returns:
      The gathered lines.

    Raises:
      ValueError: shapes or dtypes disagree.

    >>> import jax.numpy as jnp
    >>> gather_lines(jnp.arange(6).reshape(3, 2), jnp.array([2, 0])).tolist()
    [[4, 5], [0, 1]]
    """
    return _gather_lines(slab, slots, out, implementation=implementation, interpret=interpret)
