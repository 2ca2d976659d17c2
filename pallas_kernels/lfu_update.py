"""``lfu_update``: add a batch of accesses to per-key counters and age them, on the device.

With ``n_k`` the number of times key ``k`` occurs in ``ids`` (a repeated id counts each time):

* float32 counters: ``counters[k] <- (counters[k] + n_k) * decay``. Adding before aging keeps
  the result exact on every backend: ``c * decay + n`` may be fused into one FMA by one compiler
  (XLA's CPU fusions do) and not by another, and then the kernel and the reference differ in the
  last bit.
* integer counters: ``counters[k] <- (counters[k] >> s) + n_k`` with ``decay = 2**-s``: halving on
  a period, exact.

The kernel uses no atomics (they are Triton-only and order-dependent): each program owns a block
of counters and counts the ids that fall in it, scanning the ids in blocks. Cost:
O(num_counters * num_ids) compares spread over num_counters / block programs, and one read and
write of every counter; meant for batches of ids (tens to thousands), not millions.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import compiler_params, pow2_divisor, resolve

# Counters per program and ids per step of its scan: powers of two (Triton's blocks must be),
# small enough that the (ids, counters) comparison block fits in registers.
MAX_BLOCK = 256
MAX_IDS_BLOCK = 32
COUNTER_DTYPES = (jnp.float32, jnp.int32, jnp.uint32)


def lfu_update_kernel(
    ids_ref,
    counters_in_ref,
    counters_ref,
    *,
    block: int,
    ids_block: int,
    decay: float,
    shift: int,
):
    """Program i ages counters ``[i*block, (i+1)*block)`` and adds the ids that fall in them.

    ``ids_ref`` holds all ids, padded with -1 (matches no counter) to a multiple of
    ``ids_block``. ``counters_in_ref`` (this program's block) is aliased to ``counters_ref``.
    """
    first = pl.program_id(0) * block
    keys = first + jnp.arange(block, dtype=jnp.int32)

    def count(step, acc):
        chunk = ids_ref[pl.ds(step * ids_block, ids_block)]
        return acc + jnp.sum((chunk[:, None] == keys[None, :]).astype(jnp.int32), axis=0)

    steps = ids_ref.shape[0] // ids_block
    counts = jax.lax.fori_loop(0, steps, count, jnp.zeros((block,), jnp.int32))
    counters_ref[...] = _update(counters_in_ref[...], counts, decay, shift)


def _update(counters, counts, decay: float, shift: int):
    """Ages ``counters`` and adds ``counts`` (int32), in the order the module docstring gives."""
    if jnp.issubdtype(counters.dtype, jnp.floating):
        added = counters + counts.astype(counters.dtype)
        return added if decay == 1.0 else added * jnp.asarray(decay, counters.dtype)
    aged = counters if shift == 0 else counters >> shift
    return aged + counts.astype(counters.dtype)


def _shift_of(counters_dtype, decay: float) -> int:
    """Validates ``decay`` for the counters' dtype; the right shift for integer counters."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"lfu_update: decay={decay} must be in (0, 1]")
    if jnp.issubdtype(counters_dtype, jnp.floating):
        return 0
    shift = -math.log2(decay)
    if shift != int(shift):
        raise ValueError(
            f"lfu_update: integer counters ({counters_dtype}) age by halving; decay={decay} must "
            "be a power of 1/2 (1, 0.5, 0.25, ...), or use float32 counters"
        )
    return int(shift)


def _check(counters, ids, decay: float) -> int:
    if counters.ndim != 1 or counters.dtype not in COUNTER_DTYPES:
        raise ValueError(
            f"lfu_update: counters must be a 1-D array of one of "
            f"{[jnp.dtype(d).name for d in COUNTER_DTYPES]}; got {counters.shape} {counters.dtype}"
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"lfu_update: ids must be integers, not {ids.dtype}")
    return _shift_of(counters.dtype, decay)


def _lfu_update_pallas(counters, ids, *, decay: float, interpret: bool):
    """Validates the inputs, pads the ids, and runs `lfu_update_kernel` over counter blocks."""
    shift = _check(counters, ids, decay)
    ids = ids.reshape(-1).astype(jnp.int32)
    ids_block = min(MAX_IDS_BLOCK, pl.next_power_of_2(max(ids.shape[0], 1)))
    padded = max(1, pl.cdiv(ids.shape[0], ids_block)) * ids_block  # at least one block
    ids = jnp.pad(ids, (0, padded - ids.shape[0]), constant_values=-1)
    block = pow2_divisor(counters.shape[0], MAX_BLOCK)
    return pl.pallas_call(
        functools.partial(
            lfu_update_kernel, block=block, ids_block=ids_block, decay=decay, shift=shift
        ),
        grid=(counters.shape[0] // block,),
        in_specs=[pl.no_block_spec, pl.BlockSpec((block,), lambda i: (i,))],
        out_specs=pl.BlockSpec((block,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct(counters.shape, counters.dtype),
        input_output_aliases={1: 0},
        interpret=interpret,
        compiler_params=compiler_params(interpret),
        name="lfu_update",
    )(ids, counters)


def lfu_update_reference(counters: jax.Array, ids: jax.Array, *, decay: float) -> jax.Array:
    """The plain-jnp definition of `lfu_update` (ids outside the counters are ignored)."""
    shift = _shift_of(counters.dtype, decay)
    ids = ids.reshape(-1)
    n = counters.shape[0]
    inside = (ids >= 0) & (ids < n)
    counts = jnp.zeros((n,), jnp.int32).at[jnp.where(inside, ids, n)].add(1, mode="drop")
    return _update(counters, counts, decay, shift)


@functools.partial(
    jax.jit, static_argnames=("decay", "implementation", "interpret"), donate_argnums=(0,)
)
def _lfu_update(counters, ids, *, decay: float, implementation: str, interpret: bool):
    _check(counters, ids, decay)
    if resolve(implementation, interpret, op="lfu_update") == "pallas":
        return _lfu_update_pallas(counters, ids, decay=decay, interpret=interpret)
    return lfu_update_reference(counters, ids, decay=decay)


def lfu_update(
    counters: jax.Array,
    ids: jax.Array,
    *,
    decay: float = 1.0,
    implementation: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Ages ``counters`` and adds one for each occurrence of each id in ``ids``, on the device.

    The counters are donated (updated in place); ``ids`` stay on the device: nothing is copied
    to the host.

    Args:
      counters: ``(num_keys,)`` float32, int32 or uint32. Sizes with a factor of 256 run
        fastest in the kernel (one program per 256 counters).
      ids: integer array of any shape; ids outside ``[0, num_keys)`` are ignored.
      decay: aging factor in (0, 1]: float counters are multiplied by it after the batch is
        added, integer counters shifted right before (it must then be 1, 1/2, 1/4, ...).
      implementation: ``"auto"`` (the Pallas kernel on GPU, XLA elsewhere), ``"pallas"`` or
        ``"xla"``.
      interpret: run the Pallas kernel in interpret mode (any backend; for tests).

    Returns:
      The updated counters.

    Raises:
      ValueError: bad dtypes or shapes, or a decay that the counters' dtype cannot apply.

    >>> import jax.numpy as jnp
    >>> lfu_update(jnp.zeros(4, jnp.int32), jnp.array([1, 3, 1])).tolist()
    [0, 2, 0, 1]
    """
    return _lfu_update(
        counters, ids, decay=float(decay), implementation=implementation, interpret=interpret
    )
