"""Sub-blocks: stored chunks larger than the block size, served as runs of leading rows.

Real TensorStore stores on local disk: zarr3 and zarr v2 written by TensorStore itself (raw,
compressed, checksummed), stores from write_store, and an orbax checkpoint.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

import cacheflow_jax as cfj
from cacheflow_jax.store.subblocks import DEFAULT_BLOCK_BYTES, sub_block_shape

ROWS, COLS = 256, 64  # a 64 KiB float32 table
TABLE = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)

_CODECS: dict[str, Any] = {
    "raw": [{"name": "bytes", "configuration": {"endian": "little"}}],
    "zstd": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}],
    "crc": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
}


def _file_bytes_read() -> int:
    """TensorStore's count of bytes read from local files, process-wide."""
    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(v.get("value", 0) for m in metrics for v in m["values"])


def _zarr3(root: Path, codecs: str, array: np.ndarray = TABLE, chunks: Any = None) -> Path:
    """A zarr3 hierarchy with one array ``table``, written by TensorStore (not by write_store)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(root / "table")},
        "create": True,
        "metadata": {
            "shape": list(array.shape),
            "data_type": array.dtype.name,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": list(chunks or array.shape)},
            },
            "codecs": _CODECS[codecs],
        },
    }
    ts.open(spec).result().write(array).result()
    return root


def _zarr2_raw(root: Path, array: np.ndarray = TABLE) -> Path:
    """A zarr v2 array with no compressor (raw chunks), inside a zarr3 group for discovery."""
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": str(root / "table")},
        "create": True,
        "metadata": {
            "shape": list(array.shape),
            "chunks": list(array.shape),
            "dtype": array.dtype.str,
            "compressor": None,
        },
    }
    ts.open(spec).result().write(array).result()
    return root


def test_sub_block_shape_follows_the_chunk_rule() -> None:
    assert sub_block_shape((1000, 64), 4, 4096, (1, 1)) == (16, 64)
    assert sub_block_shape((1000, 64), 4, 1 << 20, (1, 1)) == (1000, 64)  # fits: unchanged
    assert sub_block_shape((12, 64), 4, 5 * 256, (3, 1)) == (4, 64)  # divides the chunk
    assert sub_block_shape((4, 1024), 2, 1000, (1, 1)) == (1, 500)  # one row too big
    assert sub_block_shape((7, 3), 4, 1, (1, 1)) == (1, 1)  # never below one element


@pytest.mark.parametrize("codecs", ["raw", "zstd", "crc"])
def test_sub_blocks_equal_the_rows_they_name(tmp_path: Path, codecs: str) -> None:
    store = cfj.open_store(_zarr3(tmp_path / "s", codecs), block_bytes=4096)
    info = store.arrays()["table"]
    assert info.stored_chunk_shape == (ROWS, COLS) and info.chunk_shape == (16, COLS)
    assert info.grid_shape == (16, 1)
    futures = store.read_many([f"table@{i},0" for i in range(16)])
    for i, f in enumerate(futures):
        np.testing.assert_array_equal(f.result(), TABLE[16 * i : 16 * (i + 1)])
    b = store.info("table@3,0")
    assert (b.origin, b.shape, b.nbytes) == ((48, 0), (16, COLS), 4096)


def test_raw_chunks_are_read_as_byte_ranges(tmp_path: Path) -> None:
    store = cfj.open_store(_zarr3(tmp_path / "s", "raw"), block_bytes=4096)
    before = _file_bytes_read()
    np.testing.assert_array_equal(store.read("table@5,0").result(), TABLE[80:96])
    assert _file_bytes_read() - before == 4096  # the block's rows, not the 64 KiB chunk
    stats = store.read_stats()
    assert stats["partial_reads"] == 1 and stats["chunk_reads"] == 0
    assert stats["bytes_read"] == stats["bytes_served"] == 4096
    assert stats["read_amplification"] == 1.0


def test_raw_zarr_v2_chunk_layout(tmp_path: Path) -> None:
    """zarr v2 (what orbax writes) without a compressor is raw too; orbax itself compresses."""
    from cacheflow_jax.store.subblocks import raw_chunk_layout

    _zarr2_raw(tmp_path / "v2")
    kv = {"driver": "file", "path": str(tmp_path / "v2" / "table")}
    handle = ts.open({"driver": "zarr", "kvstore": kv}).result()
    dtype, chunks, name = raw_chunk_layout(handle.spec().to_json()["metadata"], "zarr")
    assert (dtype, chunks, name((0, 0))) == (np.dtype("<f4"), (ROWS, COLS), "0.0")
    raw = handle.kvstore.read("0.0", byte_range=slice(5 * COLS * 4, 9 * COLS * 4)).result()
    np.testing.assert_array_equal(np.frombuffer(raw.value, dtype).reshape(4, COLS), TABLE[5:9])
    compressed = {"compressor": {"id": "zstd"}, "dtype": "<f4", "chunks": [1], "order": "C"}
    assert raw_chunk_layout(compressed, "zarr") is None
    assert raw_chunk_layout({**compressed, "compressor": None, "order": "F"}, "zarr") is None


def test_compressed_chunks_are_read_once_for_the_sub_blocks_asked_together(tmp_path: Path) -> None:
    store = cfj.open_store(_zarr3(tmp_path / "s", "zstd"), block_bytes=4096)
    keys = [f"table@{i},0" for i in range(16)]
    for f, i in zip(store.read_many(keys), range(16)):
        np.testing.assert_array_equal(f.result(), TABLE[16 * i : 16 * (i + 1)])
    stats = store.read_stats()
    assert stats["chunk_reads"] == 1
    assert stats["bytes_read"] == TABLE.nbytes == stats["bytes_served"]


def test_a_truncated_raw_chunk_is_a_corrupt_block(tmp_path: Path) -> None:
    root = _zarr3(tmp_path / "s", "raw")
    chunk = root / "table" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[: TABLE.nbytes // 2])
    store = cfj.open_store(root, block_bytes=4096)
    np.testing.assert_array_equal(store.read("table@0,0").result(), TABLE[:16])  # intact rows
    with pytest.raises(cfj.CorruptBlockError, match=r"table@15,0.*truncated") as err:
        store.read("table@15,0").result()
    assert str(chunk) in str(err.value)
    # The whole chunk, read by TensorStore, is refused too.
    with pytest.raises(cfj.CorruptBlockError, match="table@0,0"):
        cfj.open_store(root).read("table@0,0").result()


def test_write_store_stores_keep_their_blocks_unless_asked(tmp_path: Path) -> None:
    store = cfj.write_store({"t": TABLE}, tmp_path / "w", chunk_bytes=TABLE.nbytes)
    cache = cfj.TieredCache(store, device_bytes=TABLE.nbytes, host_bytes=0)
    assert cache.store is store  # chunk_bytes chose the blocks
    small = cfj.TieredCache(store, device_bytes=TABLE.nbytes, host_bytes=0, block_bytes=8192)
    assert small.store.arrays()["t"].chunk_shape == (32, COLS)
    for i in (0, 7, 3):
        np.testing.assert_array_equal(
            np.asarray(small.get(f"t@{i},0")), TABLE[32 * i : 32 * (i + 1)]
        )
    # Fast path: the chunk file is read whole and checked by its CRC, once per read.
    assert small.store.read_stats()["partial_reads"] == 0


def test_a_flipped_byte_in_a_checked_chunk_fails_every_sub_block(tmp_path: Path) -> None:
    store = cfj.write_store({"t": TABLE}, tmp_path / "w", chunk_bytes=TABLE.nbytes)
    chunk = tmp_path / "w" / "t" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 1
    chunk.write_bytes(bytes(data))
    view = store.with_block_bytes(8192)
    with pytest.raises(cfj.CorruptBlockError, match=r"'t@5,0'.*crc32c") as err:
        view.read("t@5,0").result()  # rows 160..191: far from the flipped byte
    assert str(chunk) in str(err.value)


def test_siblings_take_only_free_l2_room_and_never_displace(tmp_path: Path) -> None:
    store = cfj.open_store(_zarr3(tmp_path / "s", "zstd"), block_bytes=4096)
    cache = cfj.TieredCache(store, device_bytes=2 * 4096, host_bytes=3 * 4096, policy="lru")
    np.testing.assert_array_equal(np.asarray(cache.get("table@0,0")), TABLE[:16])
    l3 = cache.stats()["l3"]
    assert l3["siblings_offered"] == 15 and l3["siblings_kept"] == 3  # L2's free room
    host = {k for k in store.keys() if cache.tier_of(k) == "host"}
    assert len(host) == 3 and "table@15,0" not in host
    # L2 is full: the next chunk read offers its 15 others (the cache skips the resident
    # ones) and keeps none; L2 is unchanged.
    np.testing.assert_array_equal(np.asarray(cache.get("table@15,0")), TABLE[-16:])
    after = cache.stats()["l3"]
    assert after["chunk_reads"] == 2 and after["siblings_offered"] == 15 + 15
    assert after["siblings_kept"] == 3
    assert {k for k in store.keys() if cache.tier_of(k) == "host"} == host
    # The kept siblings are L2 hits, with the right rows, and no further L3 read.
    for key in sorted(host):
        i = int(key.split("@")[1].split(",")[0])
        np.testing.assert_array_equal(np.asarray(cache.get(key)), TABLE[16 * i : 16 * (i + 1)])
    stats = cache.stats()
    assert stats["hits"]["host"] == 3 and stats["misses"] == 2
    assert stats["l3"]["chunk_reads"] == 2
    # Read amplification: two 64 KiB chunks read for 2 blocks asked and 3 siblings kept.
    assert stats["l3"]["read_amplification"] == pytest.approx(2 * TABLE.nbytes / (5 * 4096))
    cache.check_budgets()


def test_concurrent_sub_block_reads_are_right_and_within_budget(tmp_path: Path) -> None:
    store = cfj.open_store(_zarr3(tmp_path / "s", "zstd"), block_bytes=2048)
    cache = cfj.TieredCache(store, device_bytes=4 * 2048, host_bytes=6 * 2048)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                i = int(rng.integers(0, 32))
                got = np.asarray(cache.get(f"table@{i},0"))
                np.testing.assert_array_equal(got, TABLE[8 * i : 8 * (i + 1)])
                cache.check_budgets()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    stats = cache.stats()["l3"]
    assert stats["chunk_reads"] <= stats["blocks_served"]


def test_the_default_blocks_do_not_follow_the_budget(tmp_path: Path) -> None:
    """A store whose chunks nobody chose gets blocks of at most 4 MiB, whatever the budget."""
    big = np.arange(5000 * 256, dtype=np.float32).reshape(5000, 256)  # 5,120,000 bytes
    store = cfj.open_store(_zarr3(tmp_path / "s", "raw", big))
    assert store.block_bytes == DEFAULT_BLOCK_BYTES == 4 << 20
    assert store.arrays()["table"].chunk_shape == (4096, 256)  # 4 MiB of rows
    for device_bytes in (4 << 20, 16 << 20, 1 << 30):
        cache = cfj.TieredCache(store, device_bytes=device_bytes, host_bytes=0)
        assert cache.store is store
        np.testing.assert_array_equal(np.asarray(cache.get("table@1,0")), big[4096:])


def test_a_budget_below_the_largest_block_names_block_bytes(tmp_path: Path) -> None:
    store = cfj.open_store(_zarr3(tmp_path / "s", "raw"))
    with pytest.raises(cfj.BudgetError, match=r"device_bytes=16384 is smaller than block "
                       r"'table@0,0' \(65536 bytes\).*block_bytes=2048") as err:
        cfj.TieredCache(store, device_bytes=TABLE.nbytes // 4, host_bytes=0)
    assert "do not shrink with the budget" in str(err.value)
    # The fix the message names works, and its keys are the ones that block size gives.
    cache = cfj.TieredCache(store, device_bytes=TABLE.nbytes // 4, host_bytes=0, block_bytes=2048)
    assert cache.store.arrays()["table"].chunk_shape == (8, COLS)
    np.testing.assert_array_equal(np.asarray(cache.get("table@31,0")), TABLE[-8:])
