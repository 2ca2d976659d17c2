"""What the three ops share: choosing an implementation, block sizes, and GPU compiler settings.

The kernels use only generic Pallas primitives (``program_id``, ref indexing with ``pl.ds``,
``fori_loop``), so that ``interpret=True`` runs them on any backend. On a GPU they are lowered
through the Triton backend, selected explicitly: with jax 0.10 a bare ``pl.pallas_call`` on GPU
goes to Mosaic GPU, whose ``pallas_call`` entry point is deprecated and which needs warpgroup-sized
copies; Triton takes any power-of-two block.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Implementation = Literal["auto", "pallas", "xla"]
IMPLEMENTATIONS = ("auto", "pallas", "xla")


def resolve(implementation: str, interpret: bool, *, op: str) -> str:
    """``"pallas"`` or ``"xla"`` for a requested implementation (``auto``: Pallas on GPU only).

    Raises:
      ValueError: an unknown implementation, or a compiled Pallas kernel off GPU.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{op}: implementation={implementation!r} must be one of {IMPLEMENTATIONS}"
        )
    backend = jax.default_backend()
    if implementation == "auto":
        return "pallas" if backend == "gpu" else "xla"
    if implementation == "pallas" and not interpret and backend != "gpu":
        raise ValueError(
            f"{op}: implementation='pallas' compiles a Triton kernel, which needs a GPU, and "
            f"the default backend is {backend!r}; pass interpret=True to run the kernel in "
            "interpret mode here, or implementation='xla'"
        )
    return implementation


def compiler_params(interpret: bool):
    """Triton compiler parameters for a compiled GPU kernel; None in interpret mode."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=1)


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap`` (1 for odd ``n``).

    Block sizes are powers of two because Triton's blocks must be; dividing the array means no
    block hangs over its edge, so no masking is needed on any backend.
    """
    if n <= 0:
        return 1
    block = n & -n  # the lowest set bit: the largest power of two dividing n
    while block > cap:
        block //= 2
    return block


def as_words(x: jax.Array) -> jax.Array:
    """``x`` bitcast to unsigned integers of its width, if it holds floats; else ``x`` itself.

    The kernels move bytes. Moved as floats, a value can change on the way: interpret mode on
    the CPU flushed bfloat16 subnormals to zero (bits 0x000b came out as 0x0000) and quiets
    signalling NaNs. As words every bit pattern arrives unchanged, on any backend.
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def from_words(x: jax.Array, dtype) -> jax.Array:
    """The inverse of `as_words`: ``x`` bitcast back to ``dtype``."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)
