"""Pallas kernels for the device cache: pack lines into a slab, gather them, update LFU counters.

Each op lives in its own module as a kernel over refs (``xxx_kernel``), a wrapper that checks the
inputs and builds the grid and BlockSpecs, and a plain-jnp reference (``xxx_reference``). The
public op takes ``implementation="auto" | "pallas" | "xla"`` (``auto``: the Pallas kernel on GPU,
XLA elsewhere) and ``interpret=`` (run the kernel in Pallas interpret mode, on any backend).

This package depends on jax only; nothing of cacheflow_jax is imported here.
"""

from pallas_kernels._common import IMPLEMENTATIONS, Implementation
from pallas_kernels.gather_lines import gather_lines, gather_lines_kernel, gather_lines_reference
from pallas_kernels.lfu_update import lfu_update, lfu_update_kernel, lfu_update_reference
from pallas_kernels.pack_lines import pack_lines, pack_lines_kernel, pack_lines_reference

__all__ = [
    "IMPLEMENTATIONS",
    "Implementation",
    "gather_lines",
    "gather_lines_kernel",
    "gather_lines_reference",
    "lfu_update",
    "lfu_update_kernel",
    "lfu_update_reference",
    "pack_lines",
    "pack_lines_kernel",
    "pack_lines_reference",
]
