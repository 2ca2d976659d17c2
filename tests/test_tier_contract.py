"""The tier contract: one behavioural suite run over every tier (as cachetools' ``CacheTestMixin``
is over its caches).

The fixture `case` is parametrized over each `AbstractTier` the cache is built from:

* ``device-arrays``: `DeviceTier`, L1 as one ``jax.Array`` per block (``device_layout="arrays"``);
* ``device-slab``: `SlabTier`, L1 as one preallocated slab of lines (``device_layout="slab"``);
* ``host``: `HostTier`, L2 in host memory;
* ``host-pinned``: `HostTier` keeping blocks that come down from the device in its
  ``pinned_host`` memory (``host_memory="pinned"``; the default on a GPU, forced here on JAX's CPU
  backend, which has that memory kind too); alone, it is fed device arrays, as L1 feeds it;
* ``metadata``: `MetadataTier`, residency and bytes without data (replay).

What is checked is what the docstrings of `AbstractTier` (``cacheflow_jax.tiers.memory``) and of
each tier promise, first on the tier alone, then through `cacheflow_jax.TieredCache` (its
``tiers``): a hard byte budget that ``used`` never passes, ``used`` counting reserved room until it
is released, exact bytes in and out, and clear errors. What a tier cannot do is declared on its
case (`TierCase.lacks`); those tests skip with the case's reason.
"""

from __future__ import annotations

import uuid
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from _bits import random_bits, same_bits

import cacheflow_jax as cfj
from cacheflow_jax.replay.engine import TraceStore
from cacheflow_jax.store.locations import CONTEXT
from cacheflow_jax.tiers.memory import PRESENT, AbstractTier, DeviceTier, HostTier, MetadataTier
from cacheflow_jax.tiers.slab import SlabTier
from cacheflow_jax.trace.reader import Trace

# Capabilities a case may lack (`TierCase.lacks`: capability -> why).
DATA = "data"  # holds the blocks' bytes
TREES = "trees"  # holds pytree blocks (a dict/list of arrays under one key)
L1 = "l1"  # is the cache's L1, where `TieredCache.put` and `reserve_device` land

LINE_BYTES = 64  # the slab's line in the tier-alone tests




# ------------------------------------------------------------------------------------- cases


class TierCase:
    """One tier under test: how to make it alone and inside a cache, and what it cannot do."""

    name = ""
    setting = "device_bytes"  # the budget's name in errors
    lacks: dict[str, str] = {}
    narrows_64bit = False  # refuses 64-bit dtypes (a device tier with jax_enable_x64 off)
    index = 0  # its place in `TieredCache.tiers`

    def make(self, budget: Any) -> AbstractTier:
        raise NotImplementedError

    def budget_of(self, requested: int) -> int:
        """The budget a tier made with ``requested`` bytes has."""
        return requested

    def room(self, tier: AbstractTier, nbytes: int) -> int:
        """The part of the budget a block of ``nbytes`` takes."""
        return nbytes

    def check(self, tier: AbstractTier) -> None:
        """Invariants of this kind of tier beyond `AbstractTier`'s (every reservation installed)."""

    def cache(self, budget: int, other: int, store: Any) -> cfj.TieredCache:
        """A cache whose tier `index` is this kind of tier, with ``budget`` bytes (the other tier
        gets ``other``)."""
        raise NotImplementedError


class DeviceArrays(TierCase):
    name = "device-arrays"
    narrows_64bit = True

    def make(self, budget: Any) -> AbstractTier:
        return DeviceTier(budget)

    def cache(self, budget: int, other: int, store: Any) -> cfj.TieredCache:
        return cfj.TieredCache(store, device_bytes=budget, host_bytes=other, read_buffer=1)


class DeviceSlab(TierCase):
    name = "device-slab"
    narrows_64bit = True
    lacks = {TREES: "a slab's line run holds one array (SlabTier.holds_trees is False)"}

    def make(self, budget: Any) -> AbstractTier:
        return SlabTier(budget, line_bytes=LINE_BYTES)

    def budget_of(self, requested: int) -> int:
        return requested // LINE_BYTES * LINE_BYTES  # whole lines

    def room(self, tier: AbstractTier, nbytes: int) -> int:
        return -(-nbytes // tier.line_bytes) * tier.line_bytes

    def check(self, tier: AbstractTier) -> None:
        # Every line is free or held by exactly one block, and the free ones are the budget's
        # unused part: no line leaks.
        held = [int(i) for entry in tier.table.values() for i in entry.lines]
        assert len(held) == len(set(held)), "a line is held by two blocks"
        assert sorted(held + tier.slab.free) == list(range(tier.slab.num_lines))
        assert len(tier.slab.free) * tier.line_bytes == tier.budget - tier.used

    def cache(self, budget: int, other: int, store: Any) -> cfj.TieredCache:
        return cfj.TieredCache(
            store, device_bytes=budget, host_bytes=other, device_layout="slab", read_buffer=1
        )


class Host(TierCase):
    name = "host"
    setting = "host_bytes"
    index = 1
    lacks = {L1: "blocks come to L2 only when they leave L1; put and reserve_device use L1"}

    def make(self, budget: Any) -> AbstractTier:
        return HostTier(budget)

    def cache(self, budget: int, other: int, store: Any) -> cfj.TieredCache:
        # pageable: "auto" would be pinned on a GPU (the host-pinned case)
        return cfj.TieredCache(store, device_bytes=other, host_bytes=budget, read_buffer=1,
                               host_memory="pageable")  # fmt: skip


class HostPinned(Host):
    name = "host-pinned"

    def make(self, budget: Any) -> AbstractTier:
        return HostTier(budget, pinned=jax.devices()[0])

    def cache(self, budget: int, other: int, store: Any) -> cfj.TieredCache:
        return cfj.TieredCache(store, device_bytes=other, host_bytes=budget, read_buffer=1,
                               host_memory="pinned")  # fmt: skip


class Metadata(TierCase):
    name = "metadata"
    _why = "MetadataTier tracks residency and bytes, not data (replay)"
    lacks = {DATA: _why, L1: _why + "; replay neither puts nor reserves"}

    def make(self, budget: Any) -> AbstractTier:
        return MetadataTier(budget, name="device", setting="device_bytes")

    def cache(self, budget: int, other: int, store: Any) -> cfj.TieredCache:
        # As replay builds it: metadata tiers over a store that holds sizes only.
        return cfj.TieredCache(
            store, device_bytes=budget, host_bytes=other, read_buffer=1,
            tiers=[MetadataTier(budget, name="device", setting="device_bytes"),
                   MetadataTier(other, name="host", setting="host_bytes")],
        )  # fmt: skip


CASES = {c.name: c for c in (DeviceArrays, DeviceSlab, Host, HostPinned, Metadata)}
# Each tier class's case, for the other tier of a cache under test.
CASE_OF = {DeviceTier: DeviceArrays(), SlabTier: DeviceSlab(), HostTier: Host(),
           MetadataTier: Metadata()}  # fmt: skip


def case_of(tier: AbstractTier) -> TierCase:
    """The case of a cache's tier."""
    if isinstance(tier, HostTier) and tier.pinned is not None:
        return HostPinned()
    return CASE_OF[type(tier)]


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> TierCase:
    return CASES[request.param]()


def need(case: TierCase, *capabilities: str) -> None:
    """Skips the test, with the case's reason, if the tier lacks one of ``capabilities``."""
    for capability in capabilities:
        if capability in case.lacks:
            pytest.skip(f"{case.name}: no {capability}: {case.lacks[capability]}")


def check_accounting(case: TierCase, tier: AbstractTier, expected: dict[str, Any]) -> None:
    """``used`` is the room of exactly the resident entries, within the budget, and each entry
    holds exactly the bytes put (``expected``: key -> value, and its size in ``tier.sizes``)."""
    assert set(tier.entries) == set(expected) and len(tier.entries) == len(expected)
    assert set(tier.sizes) == set(expected)
    assert tier.used == sum(case.room(tier, n) for n in tier.sizes.values())
    assert 0 <= tier.used <= tier.budget
    for key, value in expected.items():
        got = tier.entries.get(key)
        if DATA in case.lacks:
            assert got is PRESENT
        else:
            assert same_bits(got, value), key
    case.check(tier)


def insert(tier: AbstractTier, key: str, value: Any) -> bool:
    """The cache's way in: reserve the room, convert the value, install it."""
    nbytes = sum(np.asarray(v).nbytes for v in jax.tree.leaves(value))
    if getattr(tier, "pinned", None) is not None:
        value = jax.tree.map(on_device, value)  # L1's blocks come down to L2
    if not tier.reserve(nbytes):
        return False
    tier.put_reserved(key, tier.load(value), nbytes)
    return True


def on_device(leaf: Any) -> Any:
    """``leaf`` on the default device, as L1 holds it (a dtype JAX would narrow stays numpy:
    L1 refuses it)."""
    if np.dtype(leaf.dtype) != jax.dtypes.canonicalize_dtype(leaf.dtype):
        return leaf
    return jax.device_put(leaf, jax.devices()[0])


def remove(tier: AbstractTier, key: str) -> Any:
    """The cache's way out: take the value, then release its room."""
    nbytes = tier.sizes[key]
    value = tier.pop(key)
    tier.release(nbytes)
    return value


# ------------------------------------------------------------------------------ the tier alone


@pytest.mark.parametrize("budget", [-1, 1.5, "64", True, None, np.float32(8)], ids=repr)
def test_a_bad_budget_is_a_budget_error_naming_the_setting(case: TierCase, budget: Any) -> None:
    with pytest.raises(cfj.BudgetError) as err:
        case.make(budget)
    assert f"{case.setting}=" in str(err.value)
    if budget == -1:
        assert "negative" in str(err.value)


def test_a_new_tier_is_empty_with_the_budget_given(case: TierCase) -> None:
    for requested in (0, 1000, np.int64(4096)):
        tier = case.make(requested)
        assert tier.budget == case.budget_of(int(requested))
        assert tier.used == 0 and len(tier.entries) == 0 and list(tier.entries) == []
        assert tier.entries.get("k") is None and "k" not in tier.entries
        case.check(tier)


def test_reserve_counts_room_and_never_passes_the_budget(case: TierCase) -> None:
    tier = case.make(1000)
    budget = tier.budget
    assert tier.reserve(0) and tier.used == 0
    assert tier.reserve(100) and tier.used == case.room(tier, 100)
    used = tier.used
    assert not tier.reserve(budget - used + 1) and tier.used == used  # refused: nothing counted
    assert tier.reserve(budget - used) and tier.used == budget  # exactly the rest fits
    assert not tier.reserve(1) and tier.used == budget
    tier.release(budget - used)
    tier.release(100)
    assert tier.used == 0
    assert not tier.reserve(budget + 1) and tier.used == 0


DTYPES = [
    np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
    np.int8, np.uint8, np.int16, np.uint32, np.bool_,
]  # fmt: skip
# Every dtype in one shape, and the edge shapes (0-d, empty) in two dtypes: each new shape and
# dtype compiles the slab's pack and gather again.
BLOCKS = [(dtype, (3, 5)) for dtype in DTYPES] + [
    (dtype, shape) for dtype in (np.float32, np.bool_) for shape in ((7,), (), (0,), (2, 0, 3))
]


def test_insert_lookup_remove_round_trip_the_exact_bytes(case: TierCase) -> None:
    rng = np.random.default_rng(0)
    tier = case.make(1 << 14)
    for dtype, shape in BLOCKS:
        key = f"{np.dtype(dtype).name}{shape}"
        value = random_bits(rng, shape, dtype)
        assert insert(tier, key, value)
        assert key in tier.entries and tier.sizes[key] == value.nbytes
        check_accounting(case, tier, {key: value})
        used = tier.used
        out = tier.pop(key)
        # Gone at once, but its bytes stay counted until released.
        assert key not in tier.entries and tier.entries.get(key) is None
        assert tier.used == used
        assert out is PRESENT if DATA in case.lacks else same_bits(out, value), key
        tier.release(value.nbytes)
        check_accounting(case, tier, {})


def test_a_new_value_under_a_key_replaces_the_old(case: TierCase) -> None:
    rng = np.random.default_rng(1)
    tier = case.make(4096)
    old, new = random_bits(rng, (40,), np.float32), random_bits(rng, (3, 3), np.int8)
    assert insert(tier, "k", old)
    # The cache reserves room for the new value, installs it, then releases the old room.
    assert tier.reserve(new.nbytes)
    tier.put_reserved("k", tier.load(new), new.nbytes)
    tier.release(old.nbytes)
    check_accounting(case, tier, {"k": new})
    assert same_bits(remove(tier, "k"), new) or DATA in case.lacks
    check_accounting(case, tier, {})


def test_removing_an_absent_key_is_a_key_error_and_changes_nothing(case: TierCase) -> None:
    tier = case.make(4096)
    value = random_bits(np.random.default_rng(2), (8,), np.int16)
    assert insert(tier, "here", value)
    for key in ("absent", "here-not"):
        with pytest.raises(KeyError):
            tier.pop(key)
        with pytest.raises(KeyError):
            tier.entries[key]
        assert tier.entries.get(key) is None and key not in tier.entries
        check_accounting(case, tier, {"here": value})
    remove(tier, "here")
    with pytest.raises(KeyError):  # removed twice
        tier.pop("here")
    check_accounting(case, tier, {})


def test_used_is_the_room_of_the_resident_entries_after_any_sequence(case: TierCase) -> None:
    rng = np.random.default_rng(3)
    tier = case.make(500)
    expected: dict[str, Any] = {}
    refused = 0
    sizes = (0, 1, 17, 63, 64, 65, 100)  # a few sizes: each one compiles the slab's ops
    for _ in range(300):
        key = f"k{rng.integers(12)}"
        if key in expected and rng.random() < 0.5:
            remove(tier, key)
            del expected[key]
        else:
            value = random_bits(rng, (sizes[int(rng.integers(len(sizes)))],), np.uint8)
            if key in expected:  # replaced: as the cache does, new room first, old room after
                if not tier.reserve(value.nbytes):
                    refused += 1
                    continue
                tier.put_reserved(key, tier.load(value), value.nbytes)
                tier.release(expected[key].nbytes)
            elif not insert(tier, key, value):
                refused += 1
                continue
            expected[key] = value
        check_accounting(case, tier, expected)
    assert refused > 0 and expected  # the budget was reached, and blocks stayed


def test_load_gives_the_block_in_the_tiers_form(case: TierCase) -> None:
    value = random_bits(np.random.default_rng(4), (4, 4), np.float32)
    tier = case.make(4096)
    for owned in (False, True):
        out = tier.load(value.copy(), owned=owned)
        if DATA in case.lacks:
            assert out is PRESENT
        elif case.index == 0:  # L1: a committed array on the tier's device
            assert isinstance(out, jax.Array) and out.devices() == {tier.device}
            assert out.committed
            assert same_bits(out, value)
        else:  # L2: host memory (a numpy array, or a jax.Array already in host memory)
            assert isinstance(out, np.ndarray) or all(d.platform == "cpu" for d in out.devices())
            assert same_bits(out, value)


@pytest.mark.parametrize(
    "case",
    [
        "device-arrays",
        "device-slab",
        "host",
        "metadata",
    ],
    indirect=True,
)
def test_load_copies_a_value_it_does_not_own(case: TierCase) -> None:
    need(case, DATA)
    tier = case.make(4096)
    buffer = np.arange(16, dtype=np.int32)
    assert tier.reserve(buffer.nbytes)
    tier.put_reserved("k", tier.load(buffer, owned=False), buffer.nbytes)
    buffer[:] = -1  # the caller writes into its array again
    check_accounting(case, tier, {"k": np.arange(16, dtype=np.int32)})


def test_64_bit_blocks_are_refused_by_the_device_kept_exactly_by_the_host(case: TierCase) -> None:
    need(case, DATA)
    if jax.config.jax_enable_x64:
        pytest.skip("jax_enable_x64 is on: JAX keeps 64-bit dtypes on the device")
    tier = case.make(4096)
    for dtype in (np.int64, np.float64, np.uint64):
        value = np.arange(5, dtype=dtype) - 2  # values the narrowed dtype could hold
        if case.narrows_64bit:
            with pytest.raises(cfj.DtypeError, match=np.dtype(dtype).name):
                tier.load(value)
            check_accounting(case, tier, {})
        else:
            assert insert(tier, f"k-{dtype.__name__}", value)
            assert same_bits(remove(tier, f"k-{dtype.__name__}"), value)


def test_a_pytree_block_round_trips(case: TierCase) -> None:
    need(case, TREES)
    assert case.make(0).holds_trees
    rng = np.random.default_rng(6)
    tree = {"k": random_bits(rng, (2, 3), ml_dtypes.bfloat16), "v": [random_bits(rng, (5,), np.int8)]}
    tier = case.make(4096)
    assert insert(tier, "t", tree)
    assert tier.sizes["t"] == 12 + 5
    got = tier.entries.get("t")
    if DATA in case.lacks:
        assert got is PRESENT
    else:
        assert set(got) == {"k", "v"}
        assert same_bits(got["k"], tree["k"]) and same_bits(got["v"][0], tree["v"][0])
    remove(tier, "t")
    check_accounting(case, tier, {})


@pytest.mark.parametrize(
    "case",
    [
        "device-arrays",
        "device-slab",
        "host",
        "metadata",
    ],
    indirect=True,
)
def test_a_complex_block_round_trips(case: TierCase) -> None:
    value = random_bits(np.random.default_rng(7), (3, 4), np.complex64)
    tier = case.make(4096)
    try:
        assert insert(tier, "c", value)
    finally:
        case.check(tier)  # a failed install leaks no line
    check_accounting(case, tier, {"c": value})
    assert same_bits(remove(tier, "c"), value) or DATA in case.lacks


# ------------------------------------------------------------------------ inside a TieredCache


def _url() -> str:
    return f"memory://tier-contract-{uuid.uuid4().hex}/"


# A store of 12 blocks of 64 bytes (w) and 3 of bfloat16 (e), the last of them clipped to 32.
STORE_TREE = {
    "w": random_bits(np.random.default_rng(8), (12, 16), np.float32),
    "e": random_bits(np.random.default_rng(9), (10, 8), ml_dtypes.bfloat16),
}
BLOCK = 64  # the largest block


def _data_store() -> Any:
    return cfj.write_store(STORE_TREE, _url(), chunk_bytes=BLOCK)


def _trace_store() -> TraceStore:
    """A store of sizes only: 10 blocks of 10..100 bytes and one larger than any budget here."""
    keys = [f"b{i}" for i in range(10)] + ["huge"]
    sizes = [10 * (i + 1) for i in range(10)] + [1 << 20]
    trace = Trace("tier-contract.log", [0.0] * 11, keys, sizes, ["kv"] * 11, [None] * 11)
    return TraceStore(trace)


def _store_for(case: TierCase) -> Any:
    return _trace_store() if DATA in case.lacks else _data_store()


def _block(store: Any, key: str) -> np.ndarray:
    info = store.info(key)
    where = tuple(slice(o, o + n) for o, n in zip(info.origin, info.shape))
    return STORE_TREE[info.array][where]


def check_cache(case: TierCase, cache: cfj.TieredCache, puts: dict[str, Any] | None = None) -> None:
    """Every tier of ``cache``: ``used`` is the room of its resident blocks, within its budget,
    and each resident block holds its exact bytes (from the store, or as put)."""
    assert cache.moving() == 0
    puts = puts or {}
    for tier in cache.tiers:
        kind = case_of(tier)
        resident = {k: cache.info(k).nbytes for k in tier.entries}
        assert tier.used == sum(kind.room(tier, n) for n in resident.values()), tier.name
        assert 0 <= tier.used <= tier.budget, tier.name
        for key in tier.entries:
            value = tier.entries.get(key)
            if DATA in case.lacks:
                assert value is PRESENT
            else:
                want = puts[key] if key in puts else _block(cache.store, key)
                assert same_bits(value, want), (tier.name, key)
        kind.check(tier)
    cache.check_budgets()


def check_cache_reserved(case: TierCase, cache: cfj.TieredCache, reserved: int) -> None:
    """`check_cache` for L1 while ``reserved`` bytes are held by `reserve_device`."""
    tier = cache.tiers[case.index]
    resident = sum(case.room(tier, cache.info(k).nbytes) for k in tier.entries)
    assert tier.used == resident + case.room(tier, reserved) <= tier.budget


def _access(case: TierCase, cache: cfj.TieredCache, key: str, now: float) -> None:
    if DATA in case.lacks:
        cache.access_sync(key, now)
    else:
        value = cache.get(key)
        assert same_bits(value, _block(cache.store, key))


def test_the_cache_keeps_the_tier_accounting_exact(case: TierCase) -> None:
    store = _store_for(case)
    cache = case.cache(4 * BLOCK, 2 * BLOCK, store)
    tier = cache.tiers[case.index]
    assert case_of(tier).name == case.name
    keys = [k for k in store.keys() if k != "huge"]
    rng = np.random.default_rng(10)
    seen = set()
    for step in range(80):
        key = keys[int(rng.integers(len(keys)))] if step % 5 else keys[step // 5 % len(keys)]
        _access(case, cache, key, float(step))
        check_cache(case, cache)
        seen.update(tier.entries)
        if step % 9 == 8:
            victim = keys[int(rng.integers(len(keys)))]
            was = cache.tier_of(victim) is not None
            assert cache.evict(victim) == was
            assert cache.evict(victim) is False  # evicting an absent block changes nothing
            check_cache(case, cache)
    assert len(seen) > 1 and tier.used > 0  # the tier under test held blocks
    if "huge" in store.keys():  # a block larger than the budgets is never cached
        _access(case, cache, "huge", 100.0)
        assert cache.tier_of("huge") is None
        check_cache(case, cache)


@pytest.mark.parametrize(
    "case",
    [
        "device-arrays",
        "device-slab",
        "host",
        "metadata",
    ],
    indirect=True,
)
def test_a_budget_below_the_largest_block_is_refused_naming_it(case: TierCase) -> None:
    need(case, DATA)  # a store of sizes only lists no arrays: its cache never caches what can't fit
    with pytest.raises(cfj.BudgetError) as err:
        case.cache(BLOCK - 1, 4 * BLOCK, _data_store())
    assert f"{case.setting}={BLOCK - 1}" in str(err.value) and f"({BLOCK} bytes)" in str(err.value)


def _damage(store: Any, key: str) -> None:
    """Flips one bit of the chunk of ``key`` (zarr3 chunk key encoding ``<array>/c/<i>/<j>``)."""
    path, index = cfj.parse_key(key)
    name = f"{path}/c/" + "/".join(map(str, index))
    kv = ts.KvStore.open(store.kvstore_spec, context=CONTEXT).result()
    data = bytearray(kv.read(name).result().value)
    data[len(data) // 2] ^= 1
    kv.write(name, bytes(data)).result()


def test_a_failed_load_reserves_nothing(case: TierCase) -> None:
    need(case, DATA)
    store = _data_store()
    cache = case.cache(2 * BLOCK, 2 * BLOCK, cfj.open_store(store.spec))
    for key in ("w@0,0", "w@1,0", "w@2,0", "w@3,0"):
        cache.get(key)
    _damage(store, "w@5,0")
    before = [(t.used, list(t.entries)) for t in cache.tiers]
    for _ in range(3):
        with pytest.raises(cfj.CorruptBlockError, match="'w@5,0'"):
            cache.get("w@5,0")
        check_cache(case, cache)
    tier = cache.tiers[case.index]
    assert tier.used <= before[case.index][0]  # room made for the failed load was given back
    assert cache.locate("w@5,0") == "store"


def test_reserve_device_counts_until_released(case: TierCase) -> None:
    need(case, DATA, L1)
    cache = case.cache(4 * BLOCK, 0, _data_store())
    tier = cache.tiers[case.index]
    for key in ("w@0,0", "w@1,0", "w@2,0"):
        cache.get(key)
    assert cache.reserve_device(2 * BLOCK) is tier  # evicts a block to make room
    assert tier.used == 4 * BLOCK and len(tier.entries) == 2
    check_cache_reserved(case, cache, 2 * BLOCK)
    with pytest.raises(cfj.BudgetError, match="cannot reserve"):
        cache.reserve_device(4 * BLOCK + 1)
    check_cache_reserved(case, cache, 2 * BLOCK)
    cache.release_device(2 * BLOCK)
    assert tier.used <= 2 * BLOCK
    check_cache(case, cache)


def test_a_refused_put_changes_nothing(case: TierCase) -> None:
    need(case, DATA, L1)
    cache = case.cache(4 * BLOCK, 0, _data_store())
    ok = random_bits(np.random.default_rng(11), (4, 4), np.float32)
    cache.put("kv:ok", ok)
    cache.get("w@0,0")
    tier = cache.tiers[case.index]
    before = (tier.used, sorted(tier.entries))
    refused = [
        ("kv:big", np.zeros(4 * BLOCK + 1, np.uint8), cfj.BudgetError),  # over device_bytes
        ("kv:64", np.zeros(4, np.int64), cfj.DtypeError),  # JAX would narrow it
        ("kv@1", np.zeros(4, np.float32), ValueError),  # a chunk key
        ("", np.zeros(4, np.float32), ValueError),
    ]
    if TREES in case.lacks:  # documented: a pytree block with device_layout="slab"
        refused.append(("kv:tree", {"k": np.zeros(4, np.float32)}, TypeError))
    for key, value, error in refused:
        with pytest.raises(error):
            cache.put(key, value)
        assert (tier.used, sorted(tier.entries)) == before, key
        assert cache.locate(key) is None
        check_cache(case, cache, {"kv:ok": ok})
    assert same_bits(cache.get("kv:ok"), ok)


def test_put_then_get_round_trips_the_exact_bytes(case: TierCase) -> None:
    need(case, DATA)
    cache = case.cache(4 * BLOCK, 4 * BLOCK, _data_store())
    rng = np.random.default_rng(12)
    puts = {f"kv:{i}": random_bits(rng, (32,), dtype) for i, dtype in enumerate(DTYPES)}
    for key, value in puts.items():  # more than L1 holds: the first ones go down to L2
        cache.put(key, value)
        check_cache(case, cache, puts)
    assert any(k in cache.tiers[case.index].entries for k in puts)
    for key, value in puts.items():
        assert same_bits(cache.get(key), value), key
        check_cache(case, cache, puts)


@pytest.mark.parametrize(
    "case",
    [
        "device-arrays",
        "device-slab",
        "host",
    ],
    indirect=True,
)
def test_a_complex_chunk_is_served_through_the_tier(case: TierCase) -> None:
    src = random_bits(np.random.default_rng(13), (4, 8), np.complex64)  # 4 blocks of 64 bytes
    store = cfj.write_store({"c": src}, _url(), chunk_bytes=BLOCK)
    cache = case.cache(2 * BLOCK, 2 * BLOCK, store)
    for _ in range(2):  # twice: a failed get must leave the cache as it found it
        for i in range(4):
            try:
                got = cache.get(f"c@{i},0")
            finally:
                # Accounting holds even when a get fails.
                tier = cache.tiers[case.index]
                assert tier.used == sum(case.room(tier, cache.info(k).nbytes) for k in tier.entries)
            assert same_bits(got, src[i : i + 1])
    assert any(k.startswith("c@") for k in cache.tiers[case.index].entries)
