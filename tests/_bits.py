"""Random bit patterns and bit-exact comparison, for the contract suites."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Random bits of ``dtype`` (NaN payloads and -0.0 included); valid bools for bool."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    n = math.prod(shape)
    return rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)


def same_bits(a: Any, b: Any) -> bool:
    """Shape, dtype and every byte equal."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
