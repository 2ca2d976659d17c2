"""The Pallas kernels on this machine's device: checked against their references, then timed.

    python -m bench.gpu_kernels [--json] [--runs N] [--warmup N] [--out DIR] [--iters N] [--small]

For ``pack_lines``, ``gather_lines`` and ``lfu_update``:

1. **check**: the op (``implementation="pallas"``; in interpret mode off GPU) and its plain-jnp
   reference run on fresh random data (seeded from the clock, printed), and the outputs are
   compared bit for bit;
2. **time**: the Pallas kernel and the XLA implementation, ``--iters`` calls per run after a
   warm-up, as achieved GB/s (bytes read + bytes written per call / time per call), against a
   device-to-device copy of the same number of bytes measured in the same run (``jnp.copy`` under
   ``jit``: the memory-bandwidth yardstick).

Then the **host -> device block transfer** of the slab tier (``SlabTier.load`` + ``put_reserved``:
``jax.device_put`` of the block, then ``pack_lines`` into the slab) against a bare
``jax.device_put`` of the same bytes, 16 blocks of 4 MiB.

Everything ends in one table. Medians and p95 (bad side) over ``--runs`` runs. Off GPU, the
kernels run in Pallas interpret mode on small sizes (``--small`` is implied): the table then
only shows that the script works; the numbers mean something on a GPU only.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from bench._common import Report, check_runs, parser, summarize
from cacheflow_jax.tiers.slab import SlabTier

NAME = "gpu_kernels"


def _bytes(x) -> bytes:
    return np.asarray(x).tobytes()


def _seconds(step, state: tuple, iters: int) -> tuple[float, tuple]:
    """Median seconds of one ``state = step(state)`` over ``iters`` calls, and the last state.

    ``step`` passes donated buffers on (a slab or counters updated in place is the next call's
    input), so nothing is uploaded between calls.
    """
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        state = jax.block_until_ready(step(state))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), state


def _cases(small: bool, rng: np.random.Generator) -> list[dict]:
    """The three ops, each with its data, moved bytes, pallas/xla/reference calls."""
    if small:
        lines, width, n, keys, ids = 64, 256, 16, 4096, 64
    else:  # 64 MiB slab of 64 KiB lines; 256 lines (16 MiB) per call
        lines, width, n, keys, ids = 1024, 16384, 256, 1 << 20, 256
    slab = rng.integers(0, 2**32, (lines, width), dtype=np.uint32)
    rows = rng.integers(0, 2**32, (n, width), dtype=np.uint32)
    slots = rng.choice(lines, n, replace=False).astype(np.int32)
    gather_slots = rng.integers(0, lines, n).astype(np.int32)  # repeats allowed
    counters = (rng.random(keys) * 1000).astype(np.float32)
    ids_ = rng.integers(0, keys, ids).astype(np.int32)
    ids_[: ids // 4] = ids_[ids // 4 : ids // 2]  # repeated ids
    line_bytes = n * width * 4
    return [
        {
            "op": "pack_lines",
            "moved": 2 * line_bytes,
            "inputs": lambda: (jnp.asarray(slab), jnp.asarray(rows), jnp.asarray(slots)),
            "call": lambda impl, interp: functools.partial(
                pk.pack_lines, implementation=impl, interpret=interp
            ),
            "step": lambda op: lambda s: (op(*s), *s[1:]),
            "reference": pk.pack_lines_reference,
        },
        {
            "op": "gather_lines",
            "moved": 2 * line_bytes,
            "inputs": lambda: (jnp.asarray(slab), jnp.asarray(gather_slots)),
            "call": lambda impl, interp: functools.partial(
                pk.gather_lines, implementation=impl, interpret=interp
            ),
            "step": lambda op: lambda s: (s[0], s[1], op(s[0], s[1])),
            "reference": pk.gather_lines_reference,
        },
        {
            "op": "lfu_update",
            "moved": 2 * keys * 4 + ids * 4,
            "inputs": lambda: (jnp.asarray(counters), jnp.asarray(ids_)),
            "call": lambda impl, interp: functools.partial(
                pk.lfu_update, decay=0.5 ** (1 / 64), implementation=impl, interpret=interp
            ),
            "step": lambda op: lambda s: (op(*s), *s[1:]),
            "reference": functools.partial(pk.lfu_update_reference, decay=0.5 ** (1 / 64)),
        },
    ]


def _h2d(runs: int, iters_blocks: int = 16, block_mib: int = 4) -> dict:
    """GB/s of the slab's host -> device block path and of a bare ``jax.device_put``."""
    n = block_mib << 20
    host = [
        np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8) for i in range(iters_blocks)
    ]
    device = jax.devices()[0]
    tier = SlabTier(n * iters_blocks, line_bytes=64 << 10, device=device)
    keys = [f"b{i}" for i in range(iters_blocks)]
    out = {"slab load + pack_lines": [], "jax.device_put": []}
    total = n * iters_blocks
    for run in range(runs + 1):
        start = time.perf_counter()
        jax.block_until_ready([jax.device_put(h, device) for h in host])
        put = time.perf_counter() - start
        start = time.perf_counter()
        for key, h in zip(keys, host):
            assert tier.reserve(n)
            tier.put_reserved(key, tier.load(h), n)
        tier.slab.array.block_until_ready()
        slab = time.perf_counter() - start
        for key in keys:  # untimed: back to an empty slab
            tier.pop(key)
            tier.release(n)
        if run:
            out["jax.device_put"].append(total / put / 1e9)
            out["slab load + pack_lines"].append(total / slab / 1e9)
    for key, h in zip(keys, host):  # the slab path is checked too: every block read back
        assert tier.reserve(n)
        tier.put_reserved(key, tier.load(h), n)
    exact = all(np.asarray(tier.entries[k]).tobytes() == h.tobytes() for k, h in zip(keys, host))
    return out, exact


def main(argv: list[str] | None = None) -> int:
    p = parser(NAME, __doc__.split("\n\n")[0], runs=5)
    p.add_argument("--iters", type=int, default=20, help="timed calls per run and variant")
    p.add_argument("--small", action="store_true", help="small sizes (implied off GPU)")
    args = p.parse_args(argv)
    check_runs(args)
    on_gpu = jax.default_backend() == "gpu"
    small, interpret = args.small or not on_gpu, not on_gpu
    seed = time.time_ns() % 2**32
    rng = np.random.default_rng(seed)
    report = Report(
        NAME,
        "Pallas kernels: check and bandwidth",
        {
            "runs": args.runs,
            "iters": args.iters,
            "small": small,
            "interpret": interpret,
            "seed": seed,
            "backend": jax.default_backend(),
        },
    )
    copy = jax.jit(jnp.copy)
    rows = []
    for case in _cases(small, rng):
        # The public ops are jitted with their buffers donated; another jit around them would
        # drop the donation and add a copy of the slab to every call.
        pallas = case["call"]("pallas", interpret)
        xla = case["call"]("xla", False)
        want = case["reference"](*case["inputs"]())
        got = pallas(*case["inputs"]())
        exact = _bytes(got) == _bytes(want) and np.asarray(got).shape == np.asarray(want).shape
        same_xla = _bytes(xla(*case["inputs"]())) == _bytes(want)
        # The copy moves as many bytes as the op: it reads and writes moved / 2 bytes.
        half = jnp.zeros(case["moved"] // 8, jnp.uint32)
        samples = {"pallas": [], "xla": [], "copy": []}
        states = {"pallas": case["inputs"](), "xla": case["inputs"](), "copy": (half,)}
        steps = {
            "pallas": case["step"](pallas),
            "xla": case["step"](xla),
            "copy": lambda s: (copy(s[0]),),
        }
        for run in range(args.warmup + args.runs):
            t = {}
            for variant in ("pallas", "xla", "copy"):
                t[variant], states[variant] = _seconds(steps[variant], states[variant], args.iters)
            if run >= args.warmup:
                for k, v in t.items():
                    samples[k].append(case["moved"] / v / 1e9)
        stats = {k: summarize(v, better="high") for k, v in samples.items()}
        ratio = summarize(
            [a / c for a, c in zip(samples["pallas"], samples["copy"])], better="high"
        )
        report.results[case["op"]] = {
            "exact": exact,
            "xla_exact": same_xla,
            "gbps": stats,
            "pallas_over_copy": ratio,
            "bytes_per_call": case["moved"],
        }
        for impl in ("pallas", "xla"):
            rows.append(
                [
                    case["op"],
                    impl + (" (interpret)" if impl == "pallas" and interpret else ""),
                    "exact" if (exact if impl == "pallas" else same_xla) else "MISMATCH",
                    f"{stats[impl]['median']:.2f}",
                    f"{stats[impl]['p95']:.2f}",
                    f"{stats[impl]['median'] / stats['copy']['median']:.2f}x",
                ]
            )
        rows.append(
            [
                case["op"],
                "d2d copy, same bytes",
                "",
                f"{stats['copy']['median']:.2f}",
                f"{stats['copy']['p95']:.2f}",
                "1.00x",
            ]
        )
    h2d, h2d_exact = _h2d(args.runs)
    base = summarize(h2d["jax.device_put"], better="high")
    report.results["h2d_gbps"] = {k: summarize(v, better="high") for k, v in h2d.items()}
    for name, values in h2d.items():
        s = summarize(values, better="high")
        check = "" if name == "jax.device_put" else "exact" if h2d_exact else "MISMATCH"
        rows.append(
            [
                "host->device 16 x 4 MiB",
                name,
                check,
                f"{s['median']:.2f}",
                f"{s['p95']:.2f}",
                f"{s['median'] / base['median']:.2f}x",
            ]
        )
    report.add_table(
        "kernel, implementation, check against the reference, GB/s (median, p95), ratio to the "
        "baseline (the d2d copy for kernels, jax.device_put for transfers)",
        ["what", "variant", "check", "GB/s", "p95", "ratio"],
        rows,
    )
    if not on_gpu:
        report.notes.append(
            "no GPU: kernels ran in Pallas interpret mode on small sizes; GB/s are not kernel "
            "speeds"
        )
    report.emit(args)
    bad = [
        op for op, r in report.results.items() if isinstance(r, dict) and r.get("exact") is False
    ]
    return 1 if bad or not h2d_exact else 0


if __name__ == "__main__":
    raise SystemExit(main())
