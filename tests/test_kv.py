"""The KV tier a serving engine uses: pytree blocks, prefix lookup, pins, non-durable puts and
blocks that never make a jitted function compile again."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import cacheflow_jax as cfj
from cacheflow_jax.kv import prefix_keys

KIB = 1 << 10


def _kv(seed: int, layers: int = 3, tokens: int = 16, width: int = 8) -> dict[str, Any]:
    """Per-layer K and V of one block, as an engine would hand them over."""
    rng = np.random.default_rng(seed)
    return {
        "layers": [
            {"k": rng.standard_normal((tokens, width)).astype(ml_dtypes.bfloat16),
             "v": rng.standard_normal((tokens, width)).astype(np.float32)}
            for _ in range(layers)
        ],
        "pos": (np.arange(tokens, dtype=np.int32),),
    }  # fmt: skip


def _same_tree(a: Any, b: Any) -> bool:
    """Same containers, keys, order, shapes, dtypes and bytes."""
    containers = dict | list | tuple
    if (isinstance(a, containers) or isinstance(b, containers)) and type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    x, y = np.asarray(a), np.asarray(b)
    return x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()


def _cache(root: Path, **kw: Any) -> cfj.TieredCache:
    kw.setdefault("device_bytes", 64 * KIB)
    kw.setdefault("host_bytes", 64 * KIB)
    return cfj.TieredCache(cfj.open_store(root, create=True), **kw)


# ------------------------------------------------------------------------------ pytree blocks


def test_pytree_block_comes_back_the_same_from_every_tier(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "s")
    block = _kv(0)
    cache.put("kv:0", block)
    assert cache.stats()["tiers"]["device"]["blocks"] == 1  # one key, one budget entry
    assert cache.info("kv:0").nbytes == sum(x.nbytes for x in jax.tree.leaves(block))
    from_l1 = cache.get("kv:0")
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(from_l1))
    assert _same_tree(from_l1, block)
    cache.evict("kv:0")
    cache.flush()
    assert cache.locate("kv:0") == "store"
    assert _same_tree(cache.get("kv:0"), block)  # from L3
    files = list((tmp_path / "s" / "_runtime").iterdir())
    assert len(files) == 1  # one file in L3
    assert _same_tree(cfj.open_store(tmp_path / "s").read("kv:0").result(), block)


def test_pytree_block_through_l2_and_a_second_cache(tmp_path: Path) -> None:
    one = _kv(1, layers=2)  # 2 x 16 x 8 x (2 + 4) + 64 = 1600 bytes
    cache = _cache(tmp_path / "s", device_bytes=2 * KIB, host_bytes=4 * KIB)
    cache.put("kv:a", one)
    cache.put("kv:b", _kv(2, layers=2))  # pushes kv:a down to L2
    assert cache.locate("kv:a") == "host"
    assert _same_tree(cache.get("kv:a"), one)
    cache.flush()
    other = _cache(tmp_path / "s", device_bytes=2 * KIB, host_bytes=0)  # opened after the puts
    assert _same_tree(other.get("kv:a"), one)


def test_a_list_of_per_layer_k_v_is_a_tree_not_a_stacked_array(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "s")
    layers = [(np.ones((4, 2), np.float32), np.zeros((4, 2), np.float32)) for _ in range(3)]
    cache.put("kv:list", layers)
    got = cache.get("kv:list")
    assert isinstance(got, list) and len(got) == 3 and isinstance(got[0], tuple)
    assert _same_tree(got, layers)
    cache.put("kv:numbers", [1, 2, 3])  # no array inside: one array, as jnp.asarray reads it
    assert np.asarray(cache.get("kv:numbers")).tolist() == [1, 2, 3]


class _KV(NamedTuple):
    k: np.ndarray
    v: np.ndarray


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (_KV(np.ones(2, np.float32), np.ones(2, np.float32)), "_KV.*dict, list and tuple"),
        ({"k": np.ones(2, np.float32), "n": "text"}, r"leaf at \['n'\] is a str"),
        ({1: np.ones(2, np.float32)}, "key 1 of type int"),
        ({"k": np.ones(2, np.float64)}, "float64"),
        ({"k": {}}, "no arrays"),
    ],
)
def test_bad_pytree_blocks_are_refused_and_change_nothing(
    tmp_path: Path, value: Any, match: str
) -> None:
    cache = _cache(tmp_path / "s")
    with pytest.raises(TypeError, match=match):
        cache.put("kv:bad", value)
    assert cache.locate("kv:bad") is None
    assert cache.stats()["tiers"]["device"]["used"] == 0


def test_pytree_block_with_the_slab_layout_is_a_clear_error(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "s", device_layout="slab", line_bytes=4 * KIB)
    with pytest.raises(TypeError, match="device_layout='slab' holds arrays only"):
        cache.put("kv:t", _kv(0))


# ------------------------------------------------------------------------------ prefix lookup


def test_prefix_keys_follow_the_shared_prefix() -> None:
    a = prefix_keys(list(range(40)), block_tokens=16, salt="m")
    b = prefix_keys(list(range(32)) + [7] * 16, block_tokens=16, salt="m")
    assert len(a) == 2 and len(b) == 3  # full blocks only
    assert a[:2] == b[:2] and b[2] not in a
    assert prefix_keys(list(range(40)), block_tokens=16, salt="other")[0] != a[0]
    assert prefix_keys(np.arange(40), block_tokens=16, salt="m") == a
    assert prefix_keys(jnp.arange(40), block_tokens=16, salt="m") == a
    with pytest.raises(ValueError, match="block_tokens=0"):
        prefix_keys([1], block_tokens=0)
    with pytest.raises(ValueError, match="integer token ids"):
        prefix_keys([1.5], block_tokens=1)


def test_cached_prefix_counts_blocks_in_every_tier_without_reading(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = prefix_keys(np.arange(16 * 6), block_tokens=16, salt="t")
    cache = _cache(root, device_bytes=4 * KIB, host_bytes=4 * KIB)
    for i, key in enumerate(keys[:4]):
        cache.put(key, np.full(512, i, np.float32))  # 2 KiB: two in L1, two in L2
    assert cache.cached_prefix(keys) == 4
    assert [cache.locate(k) for k in keys[:5]] == ["host", "host", "device", "device", None]
    assert cache.contains(keys[:5]) == [True, True, True, True, False]
    cache.flush()
    # A new cache over the same store finds them in L3, reads nothing, counts no access.
    other = _cache(root, device_bytes=4 * KIB, host_bytes=0)
    assert other.cached_prefix(keys) == 4 and other.locate(keys[0]) == "store"
    assert other.stats()["requests"] == 0 and other.stats()["l3"]["reads"] == 0
    assert other.cached_prefix([keys[0], "kv:gap", keys[2]]) == 1
    found, missing = other.get_found(keys)
    assert list(found) == keys[:4] and missing == keys[4:]
    assert [int(np.asarray(found[k])[0]) for k in keys[:4]] == [0, 1, 2, 3]


def test_get_many_async_overlaps_and_returns_the_blocks(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "s")
    cache.put("kv:x", np.arange(8, dtype=np.int32))
    future = cache.get_many_async(["kv:x", "kv:x"])
    got = future.result(timeout=30)
    assert [np.asarray(g).tolist() for g in got] == [list(range(8))] * 2
    with pytest.raises(KeyError, match="kv:none"):
        cache.get_many_async(["kv:none"]).result(timeout=30)


def test_session_exposes_the_kv_calls(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "s")
    keys = prefix_keys(np.arange(48), block_tokens=16, salt="s")
    with cfj.serving(cache, access_log=tmp_path / "log.jsonl") as s:
        s.put(keys[0], _kv(0))
        assert s.cached_prefix(keys) == 1
        found, missing = s.get_found(keys)
        assert list(found) == keys[:1] and missing == keys[1:]
        with s.pinned(keys[:1]) as (block,):
            assert _same_tree(block, _kv(0))
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert len(lines) == 2  # the put and the found block


# ------------------------------------------------------------------------------- put_many


def _state(cache: cfj.TieredCache, keys: list[str]) -> tuple:
    """Where every key is, and the counters and policy state that do not depend on timing."""
    s = cache.stats()
    return ([cache.locate(k) for k in keys], s["hits"], s["misses"], s["policy"], s["tiers"],
            s["bytes"], s["writebacks"]["dirty_bytes"])  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1])
def test_put_many_decides_as_puts_one_at_a_time(tmp_path: Path, seed: int) -> None:
    # An engine's step of puts, between gets that hit L1 (buffered for the policy), promote
    # from L2 and read L3: put_many leaves every block, counter and policy state as the same
    # puts one at a time do, after every step.
    rng = np.random.default_rng(seed)
    one, many = (_cache(tmp_path / name, device_bytes=8 * KIB, host_bytes=16 * KIB,
                        clock=lambda: 1000.0) for name in ("one", "many"))  # fmt: skip
    keys: list[str] = []
    for step in range(40):
        # Reads first, after the last step's flush: no block is waiting for its write-back
        # (such a block is an L2 hit until its write ends, then an L3 read: timing).
        reads = [k for k in rng.choice(keys, size=min(len(keys), 6), replace=False)
                 if one.locate(k) is not None] if keys else []  # fmt: skip
        expected, got = one.get_many(reads), many.get_many(reads)
        assert all(_same_tree(a, b) for a, b in zip(got, expected))
        batch = [(f"kv:{step}.{j}", np.full(256, step * 10 + j, np.float32))
                 for j in range(int(rng.integers(1, 8)))]  # fmt: skip
        if keys and step % 3 == 0:  # a key put again, in the batch and from an earlier step
            batch += [(batch[0][0], np.full(256, -step, np.float32)),
                      (str(rng.choice(keys)), np.full(256, -step - 0.5, np.float32))]  # fmt: skip
        durable = bool(rng.integers(0, 4))
        for key, block in batch:
            one.put(key, block, writeback=durable)
        many.put_many(batch, writeback=durable)
        keys = list(dict.fromkeys(keys + [key for key, _ in batch]))
        one.flush()
        many.flush()
        assert _state(many, keys) == _state(one, keys), f"step {step}"
    one.flush()
    many.flush()
    for key in keys:
        if one.locate(key) is not None:
            assert _same_tree(many.get(key), one.get(key))


def test_put_many_checks_every_block_first_and_stops_at_a_pinned_key(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "s")
    good = [(f"kv:{i}", np.full(16, i, np.float32)) for i in range(3)]
    with pytest.raises(TypeError, match="kv:bad"):
        cache.put_many(good + [("kv:bad", np.array(["x"]))] + good)
    assert [cache.locate(k) for k, _ in good] == [None] * 3  # nothing went in
    with pytest.raises(TypeError, match=r"\(key, block\) pairs"):
        cache.put_many([("kv:0", np.ones(4, np.float32), "extra")])
    cache.put("kv:p", np.ones(16, np.float32))
    # As puts one at a time: the blocks before the pinned key go in, the rest do not.
    with cache.pinned(["kv:p"]), pytest.raises(ValueError, match="kv:p.*pinned"):
        cache.put_many(good[:2] + [("kv:p", np.zeros(16, np.float32))] + good[2:])
    assert [cache.locate(k) for k, _ in good] == ["device", "device", None]
    cache.put_many({"kv:2": good[2][1]})  # a dict of blocks
    assert _same_tree(cache.get("kv:2"), good[2][1])


def test_session_put_many_logs_each_block(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "s")
    keys = prefix_keys(np.arange(48), block_tokens=16, salt="s")
    with cfj.serving(cache, access_log=tmp_path / "log.jsonl") as s:
        s.put_many([(k, _kv(i)) for i, k in enumerate(keys)])
        assert s.cached_prefix(keys) == 3
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 3


# ------------------------------------------------------------------------------------- pins


def test_pinned_blocks_are_never_evicted_and_budgets_stay_hard(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "s", device_bytes=8 * KIB, host_bytes=4 * KIB)
    for i in range(4):
        cache.put(f"kv:{i}", np.full(512, i, np.float32))  # 2 KiB each: L1 is full
    with cache.pinned(["kv:0", "kv:1"]) as (a, b):
        assert int(a[0]) == 0 and int(b[0]) == 1
        assert cache.stats()["tiers"]["device"]["pinned_bytes"] == 4 * KIB
        for i in range(4, 20):  # pressure: every unpinned block is pushed out in turn
            cache.put(f"kv:{i}", np.full(512, i, np.float32))
            cache.get(f"kv:{i - 2}")
            assert cache.locate("kv:0") == "device" and cache.locate("kv:1") == "device"
            cache.check_budgets()
        with pytest.raises(ValueError, match="pinned"):
            cache.evict("kv:0")
        with pytest.raises(ValueError, match="pinned"):
            cache.put("kv:0", np.zeros(4, np.float32))
        # 6 KiB cannot fit beside 4 KiB of pins in 8 KiB: refused, naming the pinned bytes.
        with pytest.raises(cfj.BudgetError, match="4096 of device_bytes=8192 are pinned"):
            cache.put("kv:big", np.zeros(1536, np.float32))
        assert cache.locate("kv:big") is None
        with cache.pinned(["kv:0"]):  # pins nest
            pass
        assert cache.stats()["tiers"]["device"]["pinned_blocks"] == 2
    assert cache.stats()["tiers"]["device"]["pinned_bytes"] == 0
    cache.put("kv:big", np.zeros(1536, np.float32))  # room once released
    assert cache.evict("kv:0") is True
    cache.check_budgets()


def test_pinning_more_than_l1_holds_is_refused_and_releases_what_it_took(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "s", device_bytes=4 * KIB, host_bytes=16 * KIB)
    for i in range(4):
        cache.put(f"kv:{i}", np.full(512, i, np.float32))
    with pytest.raises(cfj.BudgetError, match="pinned"), cache.pinned([f"kv:{i}" for i in range(4)]):
        pass
    assert cache.stats()["tiers"]["device"]["pinned_bytes"] == 0
    with cache.pinned(["kv:3"]):
        pass


def test_pins_hold_under_threads(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "s", device_bytes=16 * KIB, host_bytes=8 * KIB)
    for i in range(16):
        cache.put(f"kv:{i}", np.full(256, i, np.float32))  # 1 KiB
    errors: list[BaseException] = []

    def request(t: int) -> None:
        try:
            rng = np.random.default_rng(t)
            for _ in range(40):
                keys = [f"kv:{int(k)}" for k in rng.choice(16, 3, replace=False)]
                with cache.pinned(keys) as blocks:
                    for key, block in zip(keys, blocks):
                        assert int(block[0]) == int(key[3:])
                    cache.get(f"kv:{int(rng.integers(16))}")
                    for key in keys:
                        assert cache.locate(key) == "device", key
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=request, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert cache.stats()["tiers"]["device"]["pinned_bytes"] == 0
    cache.check_budgets()


# ------------------------------------------------------------------------ writeback=False


def test_a_block_that_need_not_be_durable_is_dropped_not_written(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "s", device_bytes=4 * KIB, host_bytes=0, writeback_bytes=0)
    for i in range(6):  # writeback_bytes=0: only non-durable puts are possible
        cache.put(f"kv:{i}", np.full(512, i, np.float32), writeback=False)
    with pytest.raises(cfj.BudgetError, match="writeback_bytes=0"):
        cache.put("kv:durable", np.ones(4, np.float32))
    assert [cache.locate(f"kv:{i}") for i in range(6)] == [None] * 4 + ["device"] * 2
    with pytest.raises(KeyError, match="kv:0"):
        cache.get("kv:0")
    cache.flush()
    assert not (tmp_path / "s" / "_runtime").exists() or not list(
        (tmp_path / "s" / "_runtime").iterdir()
    )
    assert cache.stats()["writebacks"]["count"] == 0


def test_writeback_false_over_a_durable_key_is_written_so_l3_never_serves_old_bytes(
    tmp_path: Path,
) -> None:
    cache = _cache(tmp_path / "s", device_bytes=4 * KIB, host_bytes=0)
    cache.put("kv:k", np.full(4, 1, np.int32))
    cache.flush()
    cache.put("kv:k", np.full(4, 2, np.int32), writeback=False)
    cache.evict("kv:k")
    assert np.asarray(cache.get("kv:k")).tolist() == [2] * 4
    cache.flush()
    assert cfj.open_store(tmp_path / "s").read("kv:k").result().tolist() == [2] * 4


# --------------------------------------------------------------------------- no recompiles


def test_blocks_from_every_tier_never_make_a_jitted_step_compile_again(tmp_path: Path) -> None:
    step = jax.jit(lambda kv, x: jax.tree.reduce(lambda a, b: a + b.astype(jnp.float32).sum(),
                                                 kv, x))  # fmt: skip
    cache = _cache(tmp_path / "s", device_bytes=4 * KIB, host_bytes=4 * KIB)
    x = jnp.zeros(())
    blocks = {f"kv:{i}": {"k": np.full(256, i, np.float32), "v": np.full(256, i, np.float32)}
              for i in range(6)}  # fmt: skip
    blocks["kv:jax"] = {"k": jnp.ones(256), "v": jnp.ones(256)}  # uncommitted user arrays
    for key, value in blocks.items():
        cache.put(key, value)
    seen = set()
    for _ in range(3):  # the blocks move L1 -> L2 -> L3 and back
        for key in [k for k in blocks for _ in range(2)]:  # the second get is an L1 hit
            seen.add(cache.locate(key))
            value = cache.get(key)
            leaves = jax.tree.leaves(value)
            assert all(leaf.committed for leaf in leaves), key
            assert {leaf.sharding for leaf in leaves} == {jax.sharding.SingleDeviceSharding(
                jax.devices()[0])}  # fmt: skip
            step(value, x).block_until_ready()
        cache.evict("kv:2")
        cache.flush()
    assert {"device", "host", "store"} <= seen, seen
    assert step._cache_size() == 1


def test_weight_chunks_from_l1_l2_and_l3_share_one_compilation(tmp_path: Path) -> None:
    store = cfj.write_store({"w": np.arange(4096, dtype=np.float32).reshape(16, 256)},
                            tmp_path / "w", chunk_bytes=4 * KIB)  # fmt: skip
    cache = cfj.TieredCache(store, device_bytes=8 * KIB, host_bytes=4 * KIB)
    f = jax.jit(lambda w: w * 2)
    where = set()
    for _ in range(3):
        for i in [0, 0, 1, 1, 2, 2, 3, 3]:
            where.add(cache.locate(f"w@{i},0"))
            f(cache.get(f"w@{i},0")).block_until_ready()
    assert {"device", "host", "store"} <= where, where
    assert f._cache_size() == 1


# ------------------------------------------------------------------- puts in the background


@pytest.mark.parametrize("seed", [0, 1])
def test_put_many_without_waiting_serves_only_the_newest_values(tmp_path: Path, seed: int) -> None:
    # put_many(wait=False) returns before its installs: from then on the blocks are counted by
    # cached_prefix and a get returns the new value (waiting for it if need be), never an older
    # one; after flush every key holds its newest value in some tier and the budgets held. Keys
    # are put again within a call and across calls, with reads between.
    rng = np.random.default_rng(seed)
    cache = _cache(tmp_path / "s", device_bytes=8 * KIB, host_bytes=16 * KIB)
    newest: dict[str, np.ndarray] = {}
    futures = []
    for step in range(40):
        batch = [(f"kv:{step}.{j}", np.full(256, step * 10 + j, np.float32))
                 for j in range(int(rng.integers(1, 8)))]  # fmt: skip
        if newest and step % 3 == 0:
            batch += [(batch[0][0], np.full(256, -step, np.float32)),
                      (str(rng.choice(list(newest))), np.full(256, -step - 0.5, np.float32))]  # fmt: skip
        futures.append(cache.put_many(batch, wait=False))
        for key, block in batch:
            newest[key] = block
        assert cache.cached_prefix([key for key, _ in batch]) == len(batch)
        reads = [str(k) for k in rng.choice(list(newest), size=min(len(newest), 6), replace=False)]
        for key, got in zip(reads, cache.get_many(reads)):
            assert _same_tree(got, newest[key]), (step, key)
        cache.check_budgets()
    cache.flush()
    assert all(f.done() and f.exception() is None for f in futures)
    for key, block in newest.items():
        assert _same_tree(cache.get(key), block), key
    cache.close()
    reopened = _cache(tmp_path / "s")
    for key, block in newest.items():
        assert _same_tree(reopened.get(key), block), key


def test_put_many_without_waiting_checks_first_and_refuses_what_put_refuses(
    tmp_path: Path,
) -> None:
    cache = _cache(tmp_path / "s", device_bytes=4 * KIB, host_bytes=4 * KIB)
    with pytest.raises(TypeError, match="kv:bad"):  # checked before the call returns
        cache.put_many([("kv:0", np.ones(16, np.float32)), ("kv:bad", np.array(["x"]))],
                       wait=False)  # fmt: skip
    assert cache.locate("kv:0") is None  # nothing went in
    cache.put_many([(f"kv:p{i}", np.full(256, i, np.float32)) for i in range(4)])
    with cache.pinned([f"kv:p{i}" for i in range(3)]):  # 3 of L1's 4 KiB pinned
        with pytest.raises(cfj.BudgetError, match="kv:late.*pinned"):
            cache.put_many([("kv:ok", np.ones(8, np.float32)), ("kv:late", np.ones(512, np.float32))],
                           wait=False)  # fmt: skip
        assert cache.locate("kv:late") is None  # refused: nothing of it is left in transit
        with pytest.raises(KeyError, match="kv:late"):
            cache.get("kv:late")
    # The block claimed before the refused one goes in, as with puts one at a time.
    cache.wait_until_finished(timeout=10)
    assert _same_tree(cache.get("kv:ok"), np.ones(8, np.float32))
    cache.close()


def test_a_get_waits_for_a_put_still_in_the_background(tmp_path: Path) -> None:
    from cacheflow_jax.store.futures import thread_pool

    cache = _cache(tmp_path / "s")
    old, new = np.zeros(64, np.float32), np.ones(64, np.float32)
    cache.put("kv:a", old)
    gate = threading.Event()
    blocker = thread_pool("put", 1).submit(gate.wait, 10)  # the put thread is busy until set
    future = cache.put_many([("kv:a", new), ("kv:b", new)], wait=False)
    assert cache.cached_prefix(["kv:a", "kv:b"]) == 2 and not future.done()
    got: dict[str, Any] = {}
    reader = threading.Thread(target=lambda: got.update(a=cache.get("kv:a")))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not got  # it waits: neither the old value nor an error
    gate.set()
    reader.join(10)
    assert _same_tree(got["a"], new)
    assert future.result(timeout=10) is None and blocker.result()
    cache.close()
