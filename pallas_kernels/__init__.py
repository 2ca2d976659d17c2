"""Pallas kernels: pack blocks into device cache lines, gather them, update LFU counters.

Filled in by the kernels issue; each kernel will have a plain-jnp reference and an XLA fallback.
"""
