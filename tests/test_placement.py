"""`Placement`: the direct jaxlib calls give what ``jax.device_put`` and
``jax.make_array_from_single_device_arrays`` give, and the public calls take over where they
do not (missing, or disagreeing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cacheflow_jax.tiers import placement as placement_module
from cacheflow_jax.tiers.memory import DeviceTier, to_device
from cacheflow_jax.tiers.placement import Placement
from tests._bits import random_bits, same_bits

DEVICE = jax.devices()[0]
SHARDING = jax.sharding.SingleDeviceSharding(DEVICE)
DTYPES = [np.float32, ml_dtypes.bfloat16, np.int8, np.uint16, np.bool_, np.complex64]


def _host(dtype: type, shape: tuple = (2, 3, 4), seed: int = 0) -> np.ndarray:
    return random_bits(np.random.default_rng(seed), shape, dtype)  # NaN payloads included


def _same_array(a: jax.Array, b: jax.Array) -> None:
    assert type(a) is type(b)
    assert (a.dtype, a.shape, a.aval, a.sharding, a.weak_type) == (
        b.dtype, b.shape, b.aval, b.sharding, b.weak_type)  # fmt: skip
    assert a.committed and b.committed
    assert same_bits(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_put_and_commit_equal_the_public_calls(dtype: type) -> None:
    p = Placement(DEVICE, SHARDING)
    for seed in range(3):  # the first places the public way and checks; the rest go direct
        host = _host(dtype, seed=seed)
        (placed,) = p.put([host])
        _same_array(placed, jax.device_put([host], DEVICE)[0])
        on_device = jnp.asarray(host)  # uncommitted
        assert not on_device.committed
        committed = p.commit(on_device)
        _same_array(committed, jax.make_array_from_single_device_arrays(
            on_device.shape, SHARDING, [on_device]))  # fmt: skip
        assert committed.unsafe_buffer_pointer() == on_device.unsafe_buffer_pointer()
    if placement_module.direct_calls()[0] is not None:  # jax 0.10: the direct calls are used
        assert p.direct(dtype, host=True) is True
        assert p.direct(dtype, host=False) is True


def test_no_recompile_whichever_way_a_leaf_came() -> None:
    p = Placement(DEVICE, SHARDING)
    f = jax.jit(lambda x: x * 2)
    host = _host(np.float32)
    ways = [jax.device_put(host, DEVICE), p.put([host])[0], p.put([host])[0],
            p.commit(jnp.asarray(host)), p.commit(jnp.asarray(host))]  # fmt: skip
    for value in ways:
        f(value).block_until_ready()
    assert f._cache_size() == 1


def test_missing_direct_calls_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement_module, "direct_calls", lambda: (None, None, None))
    p = Placement(DEVICE, SHARDING)
    host = _host(ml_dtypes.bfloat16)
    for _ in range(2):
        _same_array(p.put([host])[0], jax.device_put(host, DEVICE))
        _same_array(p.commit(jnp.asarray(host)), jax.device_put(host, DEVICE))
    assert p.direct(ml_dtypes.bfloat16, host=True) is None
    assert p.direct(ml_dtypes.bfloat16, host=False) is None


def test_a_direct_call_that_disagrees_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong_put(aval, sharding, shards, devices, committed):  # noqa: ANN001, ANN202
        return jax.device_put(np.zeros_like(shards[0]), devices[0])  # other bytes

    def aval_of(shape, dtype, sharding):  # noqa: ANN001, ANN202
        return jax.core.ShapedArray(shape, dtype)

    # No constructor for committed arrays either: `commit` must fall back too.
    monkeypatch.setattr(placement_module, "direct_calls", lambda: (wrong_put, None, aval_of))
    p = Placement(DEVICE, SHARDING)
    for seed in range(1, 4):
        host = _host(np.float32, seed=seed)
        _same_array(p.put([host])[0], jax.device_put(host, DEVICE))
        _same_array(p.commit(jnp.asarray(host)), jax.device_put(host, DEVICE))
    assert p.direct(np.float32, host=True) is False
    assert p.direct(np.float32, host=False) is False


def test_other_leaves_take_the_public_call() -> None:
    """Non-contiguous arrays, numpy scalars and arrays of another layout keep their values."""
    p = Placement(DEVICE, SHARDING)
    base = _host(np.float32, shape=(4, 6))
    leaves = [base[:, ::2], np.float32(3.5), base.T, base]
    out = p.put(leaves)
    for leaf, value in zip(leaves, out):
        assert value.committed and value.sharding == SHARDING
        assert same_bits(np.asarray(value), np.asarray(leaf))


def test_to_device_with_a_tier_placement_keeps_blocks() -> None:
    tier = DeviceTier(1 << 20, device=DEVICE)
    block = {"k": _host(ml_dtypes.bfloat16), "v": [jnp.asarray(_host(np.int8)), _host(np.bool_)]}
    for _ in range(2):
        moved = to_device(block, DEVICE, placement=tier.placement)
        for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(block)):
            assert a.committed and a.sharding == tier.sharding
            assert same_bits(np.asarray(a), np.asarray(b))


def test_to_device_without_a_placement_shares_one_per_device() -> None:
    from cacheflow_jax.tiers.placement import placement_for

    host = _host(np.int8)
    for _ in range(2):
        assert same_bits(np.asarray(to_device(host, DEVICE)), host)
    assert placement_for(DEVICE) is placement_for(DEVICE)
    if placement_module.direct_calls()[0] is not None:
        assert placement_for(DEVICE).direct(np.int8, host=True) is True


def test_a_narrowed_dtype_is_refused_after_kept_ones_were_checked() -> None:
    """`check_device_dtype` remembers dtypes JAX keeps (under 8 bytes); 64-bit ones are checked
    every time, so float64 with x64 off is refused however many blocks came before."""
    import jax

    from cacheflow_jax.core.blocks import DtypeError
    from cacheflow_jax.tiers.memory import check_device_dtype

    for dtype in (np.float32, np.dtype("bfloat16"), np.int8, np.float32):
        check_device_dtype(np.dtype(dtype), "kv:kept")
    assert not jax.config.jax_enable_x64  # JAX's default, as the suite runs
    with pytest.raises(DtypeError, match="kv:narrowed"):
        check_device_dtype(np.dtype(np.float64), "kv:narrowed")
    with pytest.raises(DtypeError):
        check_device_dtype(np.dtype(np.float64), "kv:narrowed")
