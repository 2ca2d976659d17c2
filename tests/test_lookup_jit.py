"""``session.lookup`` and ``jax.jit``: the split step works, a traced lookup is one clear error,
and the session keeps working after it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cacheflow_jax as cfj
from cacheflow_jax.session.embedding import EmbeddingRows, TracedLookupError

_urls = iter(range(10**9))


def _cache(layout: str, table: np.ndarray) -> cfj.TieredCache:
    store = cfj.write_store({"emb": table}, f"memory://test-lookup-jit-{next(_urls)}/",
                            chunk_bytes=16 * table[0].nbytes)  # fmt: skip
    return cfj.TieredCache(store, device_bytes=table.nbytes // 8, host_bytes=table.nbytes // 2,
                           device_layout=layout)  # fmt: skip


def _table() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((512, 8)).astype(np.float32)


def _ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, (4, 16)).astype(np.int32)


@jax.jit
def _step(w: jax.Array, rows: jax.Array) -> jax.Array:
    return jnp.tanh(rows @ w).sum(axis=1)


@pytest.mark.parametrize("layout", ["arrays", "slab"])
def test_the_split_step_equals_a_gather_inside_jit(layout: str) -> None:
    """rows = s.lookup(...) outside, step(w, rows) under jit: bitwise the gather inside jit."""
    table = _table()
    w = jnp.asarray(np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32))
    full = jnp.asarray(table)
    inside = jax.jit(lambda w, t, ids: _step(w, jnp.take(t, ids, axis=0)))
    with cfj.serving(_cache(layout, table), promote_every=2) as s:
        for seed in range(6):  # before and after promotions
            ids = _ids(seed)
            got = _step(w, s.lookup("emb", ids))
            assert np.asarray(got).tobytes() == np.asarray(inside(w, full, ids)).tobytes()
        assert s.stats()["embedding"]["emb"]["rows_device"] > 0


@pytest.mark.parametrize("layout", ["arrays", "slab"])
def test_a_traced_lookup_is_one_clear_error_and_changes_nothing(layout: str) -> None:
    table = _table()
    cache = _cache(layout, table)
    with cfj.serving(cache) as s:
        traced = jax.jit(lambda ids: s.lookup("emb", ids))
        concrete = jax.jit(lambda x: s.lookup("emb", _ids(0)) + x)
        for call in (lambda: traced(_ids(0)), lambda: concrete(1.0)):  # first lookup, traced
            with pytest.raises(TypeError, match="outside") as err:
                call()
            assert "emb" in str(err.value)
        assert cache.stats()["tiers"]["device"]["used"] == 0  # nothing reserved by the failures
        assert np.array_equal(s.lookup("emb", _ids(1)), table[_ids(1)])
        before = s.stats()["embedding"]["emb"]
        counters = np.asarray(s._rows["emb"].counters).copy()
        for call in (lambda: traced(_ids(2)), lambda: concrete(1.0),
                     lambda: jax.vmap(lambda i: s.lookup("emb", i))(_ids(2))):  # fmt: skip
            with pytest.raises(TypeError, match="outside"):
                call()
        assert s.stats()["embedding"]["emb"] == before
        assert np.array_equal(np.asarray(s._rows["emb"].counters), counters)
        for seed in range(3, 6):
            assert np.array_equal(s.lookup("emb", _ids(seed)), table[_ids(seed)])
        cache.check_budgets()
    assert cache.stats()["tiers"]["device"]["used"] == 0


def test_embedding_rows_raise_traced_lookup_error_naming_the_table() -> None:
    table = _table()
    cache = _cache("arrays", table)
    rows = EmbeddingRows(cache, "emb", device_bytes=table.nbytes // 8, period=4, half_life=8.0)
    try:
        with pytest.raises(TracedLookupError, match=r"'emb'.*step\(params, rows\)"):
            jax.jit(rows.lookup)(_ids(0))
        ids = jnp.asarray(_ids(0))  # values, but looked up inside a traced function
        with pytest.raises(TracedLookupError, match="inside a traced function"):
            jax.jit(lambda x: rows.lookup(ids) + x)(1.0)
        with pytest.raises(TracedLookupError, match=r"'emb'.*traced values"):  # a list of them
            jax.jit(lambda i: rows.lookup([i[0], i[1]]))(jnp.asarray(_ids(0)).reshape(-1))
        assert np.array_equal(rows.lookup(_ids(0)), table[_ids(0)])
    finally:
        rows.close()
