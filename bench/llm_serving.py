"""LLM serving with KV prefix reuse: time to first token against recomputing, and the peers'.

```
python -m bench.llm_serving [--requests 800] [--load 0.7] [--runs 3] [--quick] [--json]
                            [--host-memory auto|pinned|pageable]
```

A Flax NNX decoder (`bench._decoder`: its FLOPs per KV byte are within 4x of a 1B model's)
serves requests of the Mooncake trace (`data/traces/mooncake_synthetic_trace.jsonl`): each of a
request's ``hash_ids`` is one 16-token KV block whose tokens are drawn from the id, so requests
that share ids share their prefix, as in the trace. Blocks are keyed by `prefix_keys` (vLLM's hash
chain). Arrivals follow the gaps of the Azure conversation trace, scaled so that the offered
load is ``--load`` (default 70%) of what recomputing sustains; output lengths are the Azure
trace's generated tokens / 32, 1 to 16.

The engine batches continuously, one iteration at a time: a decode step for every running
request, then up to ``--chunk`` blocks of prefill for the waiting ones in arrival order, with
at most 100 requests in flight. A request starting its prefill asks the way how many leading
blocks it holds, loads them and computes the rest (at least its last block, for the first
token); each computed block is stored (cacheflow stores an iteration's blocks in one call at
its end, or before a later lookup in it). A waiting request whose blocks the way is still reading
up (cacheflow's staging from L3) is passed over for the next one until they are in, as vLLM's
scheduler passes over a request whose KV a connector loads (``WAITING_FOR_REMOTE_KVS``); an
engine with nothing else to run waits for them. Time is the engine's own: each iteration advances a
clock by its measured wall time (less the time a way spends measuring its put yardstick), and the
clock jumps over idle gaps to the next arrival. The threads a way runs beside the engine
(cacheflow's write-backs and stagings) would have an idle gap's real time to themselves: the
harness gives them up to the gap's length of real time to finish what they have in flight
(`Way.idle`) before the clock jumps, so that a gap compressed to nothing does not push their
work into the engine's next iterations. Request KV buffers come from a pool allocated once.

The measured requests are the trace's last ``--requests``; every way first serves the earlier
requests as a warm-up (their blocks come from one precomputation, computed as the engine
computes them, bitwise), so each cache starts as it would after the whole trace so far. The
baseline is `recompute`; the peers and limits are in `bench._kv_ways`. Every way's generated
tokens are checked equal. L1 holds 5% of the distinct blocks of the requests served, L2 four
times that; cacheflow's L3 is a local zarr3 store (its reads may come from the OS page cache, as
in production: the blocks were written during the run).
"""

from __future__ import annotations

import collections
import csv
import datetime
import gc
import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import Report, Target, parser, percentile, summarize
from bench._decoder import KV_DTYPE, DecoderConfig, Engine, bucket, llama_1b_flops_per_kv_byte
from bench._kv_ways import AllResident, Cacheflow, DeviceLru, HostLru, Way
from bench.policies import shared_traces_dir

NAME = "llm_serving"
WAYS = ("recompute", "device-lru", "host-lru", "cacheflow", "all-resident")
MAX_INFLIGHT = 100


@dataclass
class Request:
    """One request and its progress through the engine."""

    index: int
    arrival: float
    keys: list[str]
    tokens: np.ndarray  # [blocks, block_tokens]
    n_out: int
    done: int = 0  # prompt blocks with KV in the buffer
    started: bool = False
    length: int = 0  # tokens with KV in the buffer
    buf_k: np.ndarray | None = None
    buf_v: np.ndarray | None = None
    out: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # when each output token was ready
    computed: int = 0


def load_trace(cfg: DecoderConfig, *, traces: str) -> tuple[list[list[int]], list[float], list[int]]:
    """The Mooncake requests' hash ids, and the Azure conversation gaps and output lengths."""
    ids = []
    with open(os.path.join(traces, "mooncake_synthetic_trace.jsonl")) as f:
        for line in f:
            ids.append(json.loads(line)["hash_ids"][: cfg.max_blocks])
    stamps, outs = [], []
    with open(os.path.join(traces, "AzureLLMInferenceTrace_conv.csv")) as f:
        for row in csv.DictReader(f):
            t = datetime.datetime.fromisoformat(row["TIMESTAMP"][:26])
            stamps.append(t.timestamp())
            outs.append(int(row["GeneratedTokens"]))
    gaps = list(np.diff(np.asarray(stamps)))
    outs = [int(np.clip(-(-o // 32), 1, cfg.max_new)) for o in outs]
    return ids, gaps, outs


def block_tokens(hash_id: int, cfg: DecoderConfig) -> np.ndarray:
    rng = np.random.default_rng(hash_id)
    return rng.integers(0, cfg.vocab, cfg.block_tokens, dtype=np.int32)


def make_requests(ids: list[list[int]], cfg: DecoderConfig, outs: list[int]) -> list[Request]:
    from cacheflow_jax.kv import prefix_keys

    reqs = []
    for i, hids in enumerate(ids):
        tokens = np.stack([block_tokens(h, cfg) for h in hids])
        keys = prefix_keys(tokens.reshape(-1), block_tokens=cfg.block_tokens, salt="bench-decoder")
        reqs.append(Request(i, 0.0, keys, tokens, outs[i % len(outs)]))
    return reqs


class Server:
    """The engine loop over one way (see the module docstring)."""

    def __init__(self, engine: Engine, way: Way, *, chunk: int,
                 max_inflight: int = MAX_INFLIGHT) -> None:  # fmt: skip
        self.engine, self.way, self.chunk = engine, way, chunk
        self.max_inflight = max_inflight
        self.cfg = engine.cfg
        # Request KV buffers, allocated once and reused, as an engine's KV memory is (vLLM
        # allocates its KV cache at start): allocating 1.5 MB per request would time the
        # process's allocator, which the ways' own memory use changes (measured: 0.1 vs 0.4 ms
        # a request). A reused buffer keeps an earlier request's values past the request's
        # length; attention masks them (`bench._decoder`), so the tokens are the same.
        self._free: list[tuple[np.ndarray, np.ndarray]] = []

    def _buffers(self, r: Request) -> None:
        if self._free:
            r.buf_k, r.buf_v = self._free.pop()
            return
        cfg = self.cfg
        shape = (cfg.layers, bucket(cfg.max_context, cfg.block_tokens), cfg.kv_dim)
        r.buf_k, r.buf_v = np.zeros(shape, KV_DTYPE), np.zeros(shape, KV_DTYPE)

    def release(self, r: Request) -> None:
        """Gives a finished request's buffers back to the pool."""
        if r.buf_k is not None:
            self._free.append((r.buf_k, r.buf_v))
        r.buf_k = r.buf_v = None

    def start(self, r: Request) -> None:
        """Looks the request's prefix up and loads what the way holds (at most all but one)."""
        self._buffers(r)
        n = min(self.way.lookup(r.keys), len(r.keys) - 1)
        t = self.cfg.block_tokens
        for i, block in enumerate(self.way.load(r.keys[:n])):
            r.buf_k[:, i * t : (i + 1) * t] = np.asarray(block["k"])
            r.buf_v[:, i * t : (i + 1) * t] = np.asarray(block["v"])
        r.done = n
        r.length = n * t
        r.started = True

    def prefill(self, r: Request) -> int | None:
        """Computes the request's next block and stores it; the next token if it was the last."""
        import jax.numpy as jnp

        t = self.cfg.block_tokens
        i = r.done
        p = bucket(i * t, t)
        k, v, nxt = self.engine.prefill_block(
            r.tokens[i], jnp.asarray(r.buf_k[:, :p]), jnp.asarray(r.buf_v[:, :p]), i * t
        )
        r.buf_k[:, i * t : (i + 1) * t] = np.asarray(k)
        r.buf_v[:, i * t : (i + 1) * t] = np.asarray(v)
        self.way.store(r.keys[i], {"k": k, "v": v})
        r.done += 1
        r.length += t
        r.computed += 1
        return int(nxt) if r.done == len(r.keys) else None

    def decode(self, running: list[Request], now: Callable[[], float]) -> list[Request]:
        """One token for every running request (batches of equal past bucket); the finished."""
        cfg, eng = self.cfg, self.engine
        groups: dict[int, list[Request]] = collections.defaultdict(list)
        for r in running:
            groups[bucket(r.length + 1, cfg.block_tokens)].append(r)
        finished = []
        b = eng.decode_batch
        for p, rows in sorted(groups.items()):
            for start in range(0, len(rows), b):
                batch = rows[start : start + b]
                pad = b - len(batch)
                past_k = np.stack([r.buf_k[:, :p] for r in batch] + [batch[0].buf_k[:, :p]] * pad)
                past_v = np.stack([r.buf_v[:, :p] for r in batch] + [batch[0].buf_v[:, :p]] * pad)
                toks = np.array([r.out[-1] for r in batch] + [0] * pad, np.int32)
                lens = np.array([r.length for r in batch] + [0] * pad, np.int32)
                k, v, nxt = eng.decode(toks, past_k, past_v, lens)
                t = now()
                for j, r in enumerate(batch):
                    r.buf_k[:, r.length] = k[j]
                    r.buf_v[:, r.length] = v[j]
                    r.length += 1
                    r.out.append(int(nxt[j]))
                    r.times.append(t)
                    if len(r.out) >= r.n_out:
                        finished.append(r)
        return finished

    def _next_prefill(self, prefilling: collections.deque[Request], *, idle: bool) -> Request | None:
        """The first request, in arrival order, that has started or whose blocks the way has
        ready; None if there is none and the engine has decodes to run meanwhile. An idle
        engine takes the first request and waits for its blocks (engine time)."""
        for r in prefilling:
            if r.started or self.way.ready(r.keys):
                return r
        return prefilling[0] if idle else None

    def serve(self, reqs: list[Request]) -> float:
        """Serves ``reqs`` (sorted by arrival); returns the busy seconds."""
        pending = collections.deque(reqs)
        queue: collections.deque[Request] = collections.deque()
        prefilling: collections.deque[Request] = collections.deque()
        running: list[Request] = []
        vt = busy = 0.0
        while pending or queue or prefilling or running:
            if not (queue or prefilling or running):
                if pending[0].arrival > vt:
                    self.way.idle(pending[0].arrival - vt)  # (not engine time)
                vt = max(vt, pending[0].arrival)
            while pending and pending[0].arrival <= vt:
                r = pending.popleft()
                queue.append(r)
                self.way.queued(r.keys)
            while queue and len(prefilling) + len(running) < self.max_inflight:
                prefilling.append(queue.popleft())
            t0 = time.perf_counter()

            def now(t0: float = t0, vt: float = vt) -> float:
                return vt + time.perf_counter() - t0

            if running:
                for r in self.decode(running, now):
                    running.remove(r)
                    self.release(r)
            budget = self.chunk
            while budget and prefilling:
                r = self._next_prefill(prefilling, idle=not running)
                if r is None:
                    break  # every waiting request's blocks are still on their way up
                if not r.started:
                    self.start(r)
                while budget and r.done < len(r.keys):
                    nxt = self.prefill(r)
                    budget -= 1
                    if nxt is not None:
                        r.out.append(nxt)
                        r.times.append(now())
                if r.done == len(r.keys):
                    prefilling.remove(r)
                    if r.n_out > 1:
                        running.append(r)
                    else:
                        self.release(r)
            self.way.end_step()  # (cacheflow stores the step's blocks here: engine time)
            # The way's own measurements (cacheflow's put yardstick) are not engine time.
            step = time.perf_counter() - t0 - self.way.take_harness_seconds()
            vt += step
            busy += step
        return busy


def precompute(engine: Engine, reqs: list[Request], *, out: Path) -> dict[str, dict[str, Any]]:
    """Every block of ``reqs``, computed as the engine computes it (the warm-up's source).

    Kept in ``out`` (``llm_serving_warmup_<digest>.npz``, the digest of the model's config and
    the requests' keys): the blocks are deterministic, and computing them takes minutes.
    """
    import jax

    cfg = engine.cfg
    digest = hashlib.sha256(repr((cfg, [r.keys for r in reqs])).encode()).hexdigest()[:16]
    path = out / f"llm_serving_warmup_{digest}.npz"
    if not path.exists():
        _compute_warmup(engine, reqs, path)
    # Always from the file: a run that computed the blocks holds them as one that loaded them
    # does (views of a few large arrays), so the two kinds of run differ in nothing else.
    with np.load(path) as saved:
        keys, ks, vs = list(saved["keys"]), saved["k"].view(KV_DTYPE), saved["v"].view(KV_DTYPE)
    return {str(key): {"k": jax.device_put(k), "v": jax.device_put(v)}
            for key, k, v in zip(keys, ks, vs)}  # fmt: skip


def _compute_warmup(engine: Engine, reqs: list[Request], path: Path) -> None:
    """Computes every block of ``reqs`` as the engine does and saves them in ``path``."""
    import jax
    import tqdm

    cfg = engine.cfg
    oracle: dict[str, dict[str, Any]] = {}
    server = Server(engine, Way(), chunk=1 << 30)
    t = cfg.block_tokens
    for r in tqdm.tqdm(reqs, desc="warm-up blocks", leave=False):
        server._buffers(r)
        for i, key in enumerate(r.keys):
            block = oracle.get(key)
            if block is None:
                server.prefill(r)
                block = oracle[key] = {
                    "k": jax.device_put(r.buf_k[:, i * t : (i + 1) * t].copy()),
                    "v": jax.device_put(r.buf_v[:, i * t : (i + 1) * t].copy()),
                }
            else:
                r.buf_k[:, i * t : (i + 1) * t] = np.asarray(block["k"])
                r.buf_v[:, i * t : (i + 1) * t] = np.asarray(block["v"])
                r.done += 1
        server.release(r)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(oracle)
    np.savez(path, keys=np.array(keys),
             k=np.stack([np.asarray(oracle[k]["k"]) for k in keys]).view(np.uint16),
             v=np.stack([np.asarray(oracle[k]["v"]) for k in keys]).view(np.uint16))  # fmt: skip


def warm(way: Way, reqs: list[Request], oracle: dict[str, dict[str, Any]]) -> None:
    """Serves the warm-up requests' lookups, loads and stores without computing."""
    for r in reqs:
        n = way.lookup(r.keys)
        way.load(r.keys[:n])
        for key in r.keys[n:]:
            way.store(key, oracle[key])
    way.settle()
    way.hits.clear()
    way.put_seconds.clear()
    way.device_put_seconds.clear()
    way.take_harness_seconds()


def make_way(name: str, device_bytes: int, host_bytes: int, root: Path, *,
             prefetch: bool = True, host_memory: str = "auto") -> Way:  # fmt: skip
    if name == "recompute":
        return Way()
    if name == "device-lru":
        return DeviceLru(device_bytes)
    if name == "host-lru":
        return HostLru(device_bytes, host_bytes)
    if name == "cacheflow":
        return Cacheflow(device_bytes, host_bytes, root, prefetch=prefetch,
                         host_memory=host_memory)  # fmt: skip
    return AllResident()


def fresh(reqs: list[Request]) -> list[Request]:
    return [Request(r.index, r.arrival, r.keys, r.tokens, r.n_out) for r in reqs]


def run_once(engine: Engine, warmup: list[Request], measured: list[Request],
             oracle: dict[str, Any], budgets: tuple[int, int], *, chunk: int,
             order: list[str], prefetch: bool = True,
             host_memory: str = "auto") -> dict[str, dict[str, Any]]:  # fmt: skip
    """Serves the measured requests once per way (in ``order``); each way's figures."""
    out = {}
    for name in order:
        with tempfile.TemporaryDirectory(prefix="cacheflow-llm-") as tmp:
            way = make_way(name, *budgets, Path(tmp) / "l3", prefetch=prefetch,
                           host_memory=host_memory)  # fmt: skip
            warm(way, fresh(warmup), oracle)
            reqs = fresh(measured)
            server = Server(engine, way, chunk=chunk)
            # What is alive before the measured requests (the model, the warm-up's blocks, the
            # way's warmed state) is kept out of the collector's full passes, as a server does
            # after loading (gc.freeze): otherwise one pass over the harness's objects pauses
            # the engine (150 ms seen) and which way it lands in is chance.
            gc.collect()
            gc.freeze()
            try:
                busy = server.serve(reqs)
            finally:
                gc.unfreeze()
            way.close()
            ttft = [(r.times[0] - r.arrival) * 1e3 for r in reqs]
            tpot = [(r.times[-1] - r.times[0]) * 1e3 / (len(r.times) - 1)
                    for r in reqs if len(r.times) > 1]  # fmt: skip
            blocks = sum(len(r.keys) for r in reqs)
            span = max(r.times[-1] for r in reqs) - min(r.arrival for r in reqs)
            tokens = hashlib.sha256(json.dumps([r.out for r in reqs]).encode()).hexdigest()
            out[name] = {
                "ttft_p50_ms": statistics.median(ttft),
                "ttft_p95_ms": percentile(ttft, 95, better="low"),
                "tpot_p50_ms": statistics.median(tpot) if tpot else 0.0,
                "tpot_p95_ms": percentile(tpot, 95, better="low") if tpot else 0.0,
                "computed_share": sum(r.computed for r in reqs) / blocks,
                "busy_share": busy / span if span else 0.0,
                "put_p95_us": percentile(way.put_seconds, 95, better="low") * 1e6
                if way.put_seconds else 0.0,
                "device_put_p95_us": percentile(way.device_put_seconds, 95, better="low") * 1e6
                if way.device_put_seconds else 0.0,
                "tokens_sha256": tokens,
                "ttft_ms": ttft,  # each request's, for the CDFs of bench.scenarios
                **way.stats(),
            }
            del way
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(NAME, __doc__.split("\n")[0], runs=3)
    p.add_argument("--requests", type=int, default=800, help="measured requests (the trace's last)")
    p.add_argument("--warm", type=int, default=None,
                   help="warm-up requests before them (default: all earlier ones)")  # fmt: skip
    p.add_argument("--load", type=float, default=0.7, help="offered load / recompute's capacity")
    p.add_argument("--chunk", type=int, default=32, help="prefill blocks per engine iteration")
    p.add_argument("--quick", action="store_true", help="100 measured requests after 300, 1 run")
    p.add_argument("--traces", default=None, help="trace folder (default data/traces)")
    p.add_argument("--max-blocks", type=int, default=DecoderConfig.max_blocks,
                   help="prompts longer than this many blocks are cut (default: none is)")  # fmt: skip
    p.add_argument("--no-prefetch", action="store_true",
                   help="cacheflow does not bring queued requests' blocks up ahead")  # fmt: skip
    p.add_argument("--ways", default=",".join(WAYS), help=f"ways to run (default {','.join(WAYS)})")
    p.add_argument("--host-memory", default="auto", choices=("auto", "pinned", "pageable"),
                   help="cacheflow's L2 memory (TieredCache's host_memory; default auto)")  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.warm, args.runs, args.warmup = 100, 300, 1, 0
    report = run(args)
    report.emit(args)
    return 0


def run(args: Any) -> Report:
    import tqdm

    cfg = DecoderConfig(max_blocks=args.max_blocks)
    engine = Engine(cfg)
    engine.warm_up()
    ids, gaps, outs = load_trace(cfg, traces=args.traces or shared_traces_dir())
    reqs = make_requests(ids, cfg, outs)
    measured = reqs[-args.requests :]
    first = len(reqs) - len(measured)
    warmup = reqs[max(0, first - args.warm) : first] if args.warm is not None else reqs[:first]
    # Recompute's service time per request, measured by serving the requests back to back
    # (each arrives when the engine has nothing else to do), sets the arrival rate.
    pilot = fresh(measured)
    service = Server(engine, Way(), chunk=args.chunk).serve(pilot) / len(pilot)
    scale = service / args.load / float(np.mean(gaps[: len(measured)]))
    t = 0.0
    for r, gap in zip(measured, gaps):
        r.arrival = t
        t += gap * scale
    distinct = len({k for r in warmup + measured for k in r.keys})
    device_bytes = int(0.05 * distinct) * cfg.block_kv_bytes()
    budgets = (device_bytes, 4 * device_bytes)
    oracle = precompute(engine, fresh(warmup), out=args.out)
    rng = np.random.default_rng(0)
    runs = []
    for _ in tqdm.tqdm(range(args.warmup + args.runs), desc="llm_serving runs", leave=False):
        order = [w for w in WAYS if w in args.ways.split(",")]
        rng.shuffle(order)
        runs.append(run_once(engine, warmup, measured, oracle, budgets, chunk=args.chunk,
                             order=order, prefetch=not args.no_prefetch,
                             host_memory=args.host_memory))  # fmt: skip
    runs = runs[args.warmup :]
    return build_report(args, cfg, runs, budgets, distinct, service, len(warmup))


def build_report(args: Any, cfg: DecoderConfig, runs: list[dict], budgets: tuple[int, int],
                 distinct: int, service: float, warm_count: int) -> Report:  # fmt: skip
    report = Report(NAME, "LLM serving with KV prefix reuse (Mooncake trace)", {
        "requests": args.requests, "warm_up_requests": warm_count, "load": args.load,
        "chunk_blocks": args.chunk, "runs": len(runs), "prefetch": not args.no_prefetch, "device_bytes": budgets[0],
        "host_bytes": budgets[1], "host_memory": args.host_memory, "distinct_blocks": distinct,
        "block_kv_bytes": cfg.block_kv_bytes(), "recompute_service_ms": round(service * 1e3, 2),
        "max_blocks": cfg.max_blocks, "model_flops_per_kv_byte": round(cfg.flops_per_kv_byte()),
        "llama_1b_flops_per_kv_byte": round(llama_1b_flops_per_kv_byte()),
    })  # fmt: skip
    ways = [w for w in WAYS if w in runs[0]]
    equal = all(len({r[w]["tokens_sha256"] for w in ways}) == 1 for r in runs)
    rows, summary = [], {}
    for way in ways:
        def med(field: str, way: str = way) -> float:
            return statistics.median(r[way][field] for r in runs)

        hits = collections.Counter()
        for r in runs:
            hits.update(r[way]["hits"])
        n = len(runs)
        rows.append([way, f"{med('ttft_p50_ms'):.1f}", f"{med('ttft_p95_ms'):.1f}",
                     f"{med('tpot_p50_ms'):.1f}", f"{med('tpot_p95_ms'):.1f}",
                     f"{med('computed_share'):.3f}",
                     " / ".join(str(hits[t] // n) for t in ("device", "host", "store")),
                     f"{med('busy_share'):.2f}"])  # fmt: skip
        summary[way] = {f: med(f) for f in ("ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms",
                                            "tpot_p95_ms", "computed_share", "busy_share")}
    report.add_table("per way (median of runs; TTFT and TPOT in ms of engine time)",
                     ["way", "TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95", "computed",
                      "hits L1 / L2 / L3", "busy"], rows)  # fmt: skip
    ratios = {
        "cacheflow / recompute (TTFT p95)": ("recompute", 0.62),
        "cacheflow / device-lru (TTFT p95)": ("device-lru", 0.9),
        "cacheflow / all-resident (TTFT p95)": ("all-resident", 1.3),
    }
    for label, (base, bound) in ratios.items():
        if "cacheflow" not in ways or base not in ways:
            continue
        samples = [r["cacheflow"]["ttft_p95_ms"] / r[base]["ttft_p95_ms"] for r in runs]
        report.verdicts.append(Target(label, "<=", bound).verdict(summarize(samples, better="low")))
    if "cacheflow" not in ways:
        report.results = {"summary": summary, "runs": runs, "tokens_equal": equal}
        return report
    put = [r["cacheflow"]["put_p95_us"] / r["cacheflow"]["device_put_p95_us"] for r in runs]
    report.notes.append(
        "cacheflow put p95 {:.0f} us, device_put of the same block p95 {:.0f} us (median of "
        "runs)".format(statistics.median(r["cacheflow"]["put_p95_us"] for r in runs),
                       statistics.median(r["cacheflow"]["device_put_p95_us"] for r in runs))
    )
    report.verdicts.append(
        Target("cacheflow put p95 / device_put p95", "<=", 1.2).verdict(summarize(put, better="low"))
    )
    wb = runs[-1]["cacheflow"].get("writebacks", {})
    report.notes.append(f"tokens identical across ways in every run: {equal}")
    report.notes.append(
        f"cacheflow write-backs (last run): {wb.get('count', 0)} blocks, stalls "
        f"{wb.get('stalls', 0)} ({wb.get('stall_seconds', 0.0):.3f} s)"
    )
    report.results = {"summary": summary, "runs": runs, "tokens_equal": equal}
    return report


if __name__ == "__main__":
    raise SystemExit(main())
