"""Multimodal serving, 50 concurrent requests: vision weights, text rows and KV under one budget.

```
python -m bench.multimodal [--requests 300] [--warm 600] [--image-share 0.3] [--load 0.7]
                           [--runs 3] [--quick] [--json]
```

A request is a turn of a multimodal assistant. It carries a user message, embedded by the text
encoder of `bench.embedding_model` (32 tokens of Python's help text at a seeded offset: the
token rows are served by the way), and with probability ``--image-share`` (default 0.3) an
image: 16 patches of 8x8x3 seeded pixels, run through a small ViT (`bench._encoders.
VisionEncoder`: a patch embedding and 4 blocks of width 256, 12.7 MiB of float32 weights, served
by the way) whose patches become 16 image tokens, one KV block. The LLM decoder of
`bench.llm_serving` (`bench._decoder`) then prefills the prompt: the Mooncake request's blocks
(prefix-shared as in the trace, cut at ``--max-blocks``), then the image block if any (an image
in the newest turn: its block is never reused), and generates. Arrivals follow the Azure
conversation trace's gaps, scaled so the offered load is ``--load`` of what the baseline
sustains; at most 50 requests are in flight (`bench.llm_serving.Server` with
``max_inflight=50``, continuous batching). A request's latency is its time to first token:
arrival to the first generated token, which needs its text vector, its image tokens and its
prefill.

The store (`write_store`, zarr3 on local disk) holds the table in 64 KiB chunks of rows and each
vision weight (1 MiB at most) as one chunk, read whole, as orbax writes an unsharded array. A
cacheflow cache serves the stored chunks as blocks while its L1 holds 8 of the largest weights;
a smaller L1 (a cache of the per-kind split) serves pieces of an eighth of it (`block_bytes`).

Budgets: L1 is ``--l1-share`` (10%) of the distinct bytes the requests touch (vision weights +
text table + the text prompts' distinct KV blocks) and L2 four times L1. The ways:

| way | vision weights and text rows | KV blocks |
|---|---|---|
| `baseline` | read from the store on demand (TensorStore, no cache) | recomputed |
| `tensorstore-pool` | TensorStore's ``cache_pool`` LRU, the weights' and rows' share of L1 + L2 | device LRU over host LRU (LMCache), the KV share |
| `host-offload` | JAX host offload: all in ``pinned_host``, moved / gathered inside the step | device LRU over host LRU, the KV share |
| `cacheflow-split` | cacheflow, one cache per kind, each with its fixed share of L1 and L2 | cacheflow, the KV share |
| `cacheflow` | one `TieredCache` for all three kinds, L1 + L2 + L3 | the same cache |
| `all-resident` | all on the device | every block kept on the device |

A kind's share is its share of the distinct bytes; the rows' L1 room (``session.lookup``'s
reservation) is the table's share of L1 in both cacheflow ways. `host-offload` holds every
weight and row in host memory, more than its share (the report says how much).

Why these baselines: weights and rows that are not cached are read from the store when needed,
and KV that is not cached is recomputed, so the baseline caches nothing at all. The warm-up
serves the earlier requests first (KV from one precomputation, bitwise what the engine computes,
and the last ``--warm-tables`` requests' messages and images), and the store's page cache is
dropped before the measured requests. Every way's tokens and vectors are checked equal.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from bench._common import Report, parser, percentile
from bench._decoder import DecoderConfig, Engine
from bench._encoders import TextConfig, TextModel, VisionConfig, VisionModel, help_text_ids
from bench._kv_ways import AllResident, Cacheflow, HostLru, Way
from bench._table_ways import (
    CacheflowTable,
    HostOffload,
    Resident,
    TableWay,
    TensorStoreReads,
)
from bench.embedding_model import CHUNK_BYTES, build_report, drop_page_cache, write_table
from bench.llm_serving import Request, Server, load_trace, make_requests, precompute, warm
from bench.policies import shared_traces_dir

NAME = "multimodal"
WAYS = ("baseline", "tensorstore-pool", "host-offload", "cacheflow-split", "cacheflow",
        "all-resident")  # fmt: skip
BASELINE = "baseline"
MAX_INFLIGHT = 50
SALT = "bench-decoder"  # bench.llm_serving's keys
TEXT_TOKENS = 32
FLUSH_TIMEOUT = 900.0
WARM_CHUNK = 50  # warm-up requests between two flushes (a flush's cost grows with its blocks)


@dataclasses.dataclass
class TurnRequest(Request):
    """A request with a user message (help-text row ids) and maybe an image (its seed)."""

    text_ids: np.ndarray | None = None
    image_seed: int | None = None
    vectors: list = dataclasses.field(default_factory=list)


class KvCacheflow(Cacheflow):
    """`bench._kv_ways.Cacheflow` whose flushes wait up to `FLUSH_TIMEOUT` seconds.

    After the warm-up every KV block that L1 and L2 hold is dirty (blocks are written back
    when they leave L2), and a flush writes each (about 0.5 ms a block on 2 cores; until
    3733c1d `TieredCache.flush` also took time quadratic in the dirty blocks, about 25 s for
    4,000); the warm-up is served in chunks of `WARM_CHUNK` requests, each followed by
    ``settle`` (a flush of that chunk's blocks). The flushes are outside the measured requests.
    """

    def settle(self) -> None:
        self.end_step()
        self.cache.flush(timeout=FLUSH_TIMEOUT)
        super().settle()

    def close(self) -> None:
        self.end_step()
        self.cache.flush(timeout=FLUSH_TIMEOUT)
        super().close()


def image_patches(seed: int, cfg: VisionConfig) -> np.ndarray:
    """A seeded image as ``(patches, patch_dim)`` float32 pixels."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((cfg.patches, cfg.patch_dim)).astype(np.float32)


class TurnServer(Server):
    """`bench.llm_serving.Server` whose requests first get their text vector and image tokens."""

    def __init__(self, engine: Engine, way: Way, tables: TableWay, models: tuple, *,
                 chunk: int) -> None:  # fmt: skip
        super().__init__(engine, way, chunk=chunk, max_inflight=MAX_INFLIGHT)
        self.tables = tables
        self.text, self.vision = models

    def start(self, r: TurnRequest) -> None:
        from cacheflow_jax.kv import prefix_keys

        r.vectors.append(np.asarray(self.tables.text(self.text, r.text_ids[None])))
        if r.image_seed is not None:
            vec, tokens = self.tables.vision(self.vision, image_patches(r.image_seed,
                                                                        self.vision.cfg))  # fmt: skip
            r.tokens = r.tokens.copy()
            r.tokens[-1] = np.asarray(tokens)
            r.keys = prefix_keys(r.tokens.reshape(-1), block_tokens=self.cfg.block_tokens,
                                 salt=SALT)  # fmt: skip
            r.vectors.append(np.asarray(vec))
        super().start(r)


def make_turns(reqs: list[Request], cfg: DecoderConfig, text: np.ndarray, *, share: float,
               seed: int) -> list[TurnRequest]:  # fmt: skip
    """The requests with their messages, and an image block on a ``share`` of them."""
    from cacheflow_jax.kv import prefix_keys

    rng = np.random.default_rng(seed)
    out = []
    for r in reqs:
        start = int(rng.integers(0, len(text) - TEXT_TOKENS))
        image = int(rng.integers(1 << 30)) if rng.random() < share else None
        tokens, keys = r.tokens, r.keys
        if image is not None:
            # The image's block (its tokens are known once the encoder ran) ends the prompt.
            tokens = np.concatenate([tokens[: cfg.max_blocks - 1],
                                     np.zeros((1, cfg.block_tokens), np.int32)])  # fmt: skip
            keys = prefix_keys(tokens.reshape(-1), block_tokens=cfg.block_tokens, salt=SALT)
        out.append(
            TurnRequest(
                r.index,
                r.arrival,
                keys,
                tokens,
                r.n_out,
                text_ids=text[start : start + TEXT_TOKENS],
                image_seed=image,
            )
        )
    return out


def fresh(reqs: list[TurnRequest]) -> list[TurnRequest]:
    return [TurnRequest(r.index, r.arrival, r.keys, r.tokens, r.n_out, text_ids=r.text_ids,
                        image_seed=r.image_seed) for r in reqs]  # fmt: skip


def text_prompts(reqs: list[TurnRequest]) -> list[Request]:
    """The requests' text blocks only (the warm-up's KV: an image block is never reused)."""
    n = [len(r.keys) - (r.image_seed is not None) for r in reqs]
    return [Request(r.index, r.arrival, r.keys[:k], r.tokens[:k], r.n_out)
            for r, k in zip(reqs, n)]  # fmt: skip


@dataclasses.dataclass
class Setup:
    """What every way of a run shares: models, the store, the budgets and the kinds' shares."""

    engine: Engine
    text: TextModel
    vision: VisionModel
    root: Path  # the store with the table and the vision weights (read by the TensorStore ways)
    budgets: tuple[int, int]
    shares: dict[str, float]  # weight, embedding, kv
    chunk: int


def make_ways(name: str, s: Setup, tmp: Path) -> tuple[Way, TableWay]:
    """The KV way and the table way of ``name`` (see the module docstring)."""
    import cacheflow_jax as cfj

    d, h = s.budgets
    share = s.shares
    kv = (int(d * share["kv"]), int(h * share["kv"]))
    rows_l1 = int(d * share["embedding"])
    names = s.vision.names
    if name == "baseline":
        return Way(), TensorStoreReads(s.root, vision=names)
    if name == "tensorstore-pool":
        return HostLru(*kv), TensorStoreReads(s.root, pool_bytes=d + h - sum(kv), vision=names)
    if name == "host-offload":
        return HostLru(*kv), HostOffload(s.text.table, s.text, s.vision)
    if name == "all-resident":
        return AllResident(), Resident(s.text.table, s.vision)
    # The cacheflow ways serve a copy of the store: KV blocks are written back into it.
    root = tmp / "l3"
    shutil.copytree(s.root, root)
    drop_page_cache(root)
    largest = max(int(v.nbytes) for v in s.vision.values)  # a weight is one stored block
    if name == "cacheflow":
        way = KvCacheflow(d, h, root, block_bytes=block_bytes_for(d, largest))
        return way, CacheflowTable(way.cache, embedding_bytes=rows_l1, vision=names)
    if name == "cacheflow-split":
        way = KvCacheflow(*kv, tmp / "kv")

        def cache(kind: str) -> Any:
            l1 = int(d * share[kind])
            return cfj.TieredCache(cfj.open_store(root), device_bytes=l1,
                                   host_bytes=int(h * share[kind]),
                                   block_bytes=block_bytes_for(l1, largest))  # fmt: skip

        tables = CacheflowTable(cache("embedding"), embedding_bytes=rows_l1, vision=names,
                                weights_cache=cache("weight"))  # fmt: skip
        return way, tables
    raise ValueError(f"unknown way {name!r}; choose from {', '.join(WAYS)}")


def block_bytes_for(device_bytes: int, largest: int) -> int | None:
    """The blocks of a cacheflow cache with L1 ``device_bytes`` over the store: the stored
    chunks (a weight whole, the table in `CHUNK_BYTES`) while L1 holds 8 of the ``largest``,
    else pieces of an eighth of L1 (a power of two, at least `CHUNK_BYTES`), as `TieredCache`
    advises when a stored block is too large for L1."""
    if device_bytes >= 8 * largest:
        return None
    return max(CHUNK_BYTES, 1 << max(0, (device_bytes // 8).bit_length() - 1))


def warm_tables(tables: TableWay, s: Setup, reqs: list[TurnRequest]) -> None:
    """The warm-up requests' messages and images through ``tables`` (not timed)."""
    for r in reqs:
        jax.block_until_ready(tables.text(s.text, r.text_ids[None]))
        if r.image_seed is not None:
            jax.block_until_ready(tables.vision(s.vision, image_patches(r.image_seed,
                                                                        s.vision.cfg)))  # fmt: skip


def serve_way(name: str, s: Setup, warmup: list[TurnRequest], measured: list[TurnRequest],
              oracle: dict[str, Any], *, warm_tables_count: int) -> dict[str, Any]:  # fmt: skip
    """One way over the measured requests, after the warm-up; its figures."""
    with tempfile.TemporaryDirectory(prefix="cacheflow-mm-") as tmp:
        way, tables = make_ways(name, s, Path(tmp))
        try:
            prompts = text_prompts(warmup)
            for i in range(0, len(prompts), WARM_CHUNK):  # each ends with a short flush
                warm(way, prompts[i : i + WARM_CHUNK], oracle)
            warm_tables(tables, s, warmup[len(warmup) - warm_tables_count :])
            drop_page_cache(s.root)
            reqs = fresh(measured)
            server = TurnServer(s.engine, way, tables, (s.text, s.vision), chunk=s.chunk)
            gc.collect()
            gc.freeze()  # as bench.llm_serving: the warm state stays out of full collections
            try:
                server.serve(reqs)
            finally:
                gc.unfreeze()
            stats = tables.stats()
        finally:
            tables.close()
            way.close()
    ttft = [(r.times[0] - r.arrival) * 1e3 for r in reqs]
    digest = hashlib.sha256(json.dumps([r.out for r in reqs]).encode())
    for r in reqs:
        for v in r.vectors:
            digest.update(v.tobytes())
    return {"p50_ms": statistics.median(ttft), "p95_ms": percentile(ttft, 95, better="low"),
            "latencies_ms": ttft, "outputs_sha256": digest.hexdigest(),
            "computed_share": sum(r.computed for r in reqs) / sum(len(r.keys) for r in reqs),
            "hits": dict(way.hits), **stats}  # fmt: skip


def build_setup(args: Any) -> tuple[Setup, list[TurnRequest], list[TurnRequest], dict[str, Any]]:
    """Models, store, requests (arrivals scaled to ``--load``), budgets and the warm-up KV."""
    cfg = DecoderConfig(max_blocks=args.max_blocks)
    engine = Engine(cfg)
    engine.warm_up()
    text_ids, vocab = help_text_ids()
    text = TextModel(TextConfig(rows=-(-vocab // 64) * 64), seed=args.seed)
    vision = VisionModel(VisionConfig(), seed=args.seed + 1)
    root = Path(args.dir) / "store"
    write_table(text.table, root, dict(zip(vision.names, vision.values)))
    ids, gaps, outs = load_trace(cfg, traces=args.traces or shared_traces_dir())
    reqs = make_turns(make_requests(ids, cfg, outs), cfg, text_ids, share=args.image_share,
                      seed=args.seed)  # fmt: skip
    measured = reqs[-args.requests :]
    first = len(reqs) - len(measured)
    warmup = reqs[max(0, first - args.warm) : first]
    distinct = len({k for r in warmup + measured for k in r.keys})
    nbytes = {"weight": vision.nbytes(), "embedding": text.table.nbytes,
              "kv": distinct * cfg.block_kv_bytes()}  # fmt: skip
    total = sum(nbytes.values())
    shares = {k: v / total for k, v in nbytes.items()}
    d = int(args.l1_share * total)
    s = Setup(engine, text, vision, root, (d, 4 * d), shares, args.chunk)
    # The baseline's service time per request, served back to back, sets the arrival rate.
    pilot = fresh(measured)
    way, tables = make_ways(BASELINE, s, Path(args.dir))
    busy = TurnServer(engine, way, tables, (text, vision), chunk=args.chunk).serve(pilot)
    scale = busy / len(pilot) / args.load / float(np.mean(gaps[: len(measured)]))
    t = 0.0
    for r, gap in zip(measured, gaps):
        r.arrival = t
        t += gap * scale
    return s, warmup, measured, {"service_ms": busy / len(pilot) * 1e3, "nbytes": nbytes}


def run(args: Any) -> Report:
    """The whole benchmark (see the module docstring); returns its report."""
    import tqdm

    s, warmup, measured, facts = build_setup(args)
    ways = [w for w in WAYS if w in args.ways.split(",")]
    oracle = precompute(s.engine, text_prompts(warmup), out=args.out)
    rng = np.random.default_rng(args.seed)
    runs = []
    for _ in tqdm.tqdm(range(args.warmup + args.runs), desc=f"{NAME} runs", leave=False):
        order = list(ways)
        rng.shuffle(order)
        runs.append({name: serve_way(name, s, warmup, measured, oracle,
                                     warm_tables_count=min(args.warm_tables, len(warmup)))
                     for name in order})  # fmt: skip
    runs = runs[args.warmup :]
    d, h = s.budgets
    report = Report(NAME, "multimodal serving, 50 concurrent: vision weights, text rows, KV", {
        "requests": len(measured), "warm_up_requests": len(warmup), "runs": len(runs),
        "image_share": args.image_share, "images": sum(r.image_seed is not None for r in measured),
        "load": args.load, "max_inflight": MAX_INFLIGHT, "max_blocks": args.max_blocks,
        "device_bytes": d, "host_bytes": h, "l1_share": args.l1_share,
        "bytes_by_kind": facts["nbytes"],
        "shares": {k: round(v, 3) for k, v in s.shares.items()},
        "baseline_service_ms": round(facts["service_ms"], 2),
        "host_offload_host_bytes": facts["nbytes"]["weight"] + facts["nbytes"]["embedding"]
        + int(h * s.shares["kv"]),
    })  # fmt: skip
    return build_report(report, runs, ways, baseline=BASELINE)


def main(argv: list[str] | None = None) -> int:
    p = parser(NAME, __doc__.split("\n")[0], runs=3)
    p.add_argument("--requests", type=int, default=300, help="measured requests (the trace's last)")
    p.add_argument("--warm", type=int, default=600, help="warm-up requests before them")
    p.add_argument("--warm-tables", type=int, default=100,
                   help="of those, how many also warm the weights and rows")  # fmt: skip
    p.add_argument("--image-share", type=float, default=0.3, help="requests with an image")
    p.add_argument("--load", type=float, default=0.7, help="offered load / baseline's capacity")
    p.add_argument("--l1-share", type=float, default=0.1, help="L1 / distinct bytes (L2 = 4x)")
    p.add_argument("--chunk", type=int, default=32, help="prefill blocks per engine iteration")
    p.add_argument(
        "--max-blocks", type=int, default=128, help="prompts are cut at this many blocks"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traces", default=None, help="trace folder (default data/traces)")
    p.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent / "out" / NAME,
                   help="where the store is written")  # fmt: skip
    p.add_argument("--ways", default=",".join(WAYS), help=f"ways to run (default {','.join(WAYS)})")
    p.add_argument("--quick", action="store_true", help="80 measured requests after 240, 1 run")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.warm, args.runs, args.warmup = 80, 240, 1, 0
    run(args).emit(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
