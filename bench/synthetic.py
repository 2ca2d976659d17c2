"""Synthetic access patterns that stress one side of a policy each, written as one-key-per-line text.

Run: ``python -m bench.synthetic [--out bench/out/synthetic]`` (``bench.policies --synthetic`` calls
it). Besides the 19 shared traces, the policy benchmark can replay these textbook patterns, one
side of a policy each (seeded, 100,000 accesses each, unit sizes, one key per line: no clock):

* ``zipf``: independent draws from a Zipf(0.9) popularity over 20,000 keys (frequency wins).
* ``phases``: five phases of 20,000 accesses, each a Zipf(0.8) over its own 3,000 keys (the hot set
  moves; old counts must fade).
* ``scan_hot``: a Zipf(0.8) hot set over 2,000 keys with a scan of 300 new keys every 1,000
  accesses (scans must not flush the hot set).
* ``loop``: a loop over 1,200 keys (LRU and FIFO miss every access below 1,200 entries).
* ``recency``: 70% of accesses reuse a recent key (stack distance exponential with mean 300), 30%
  are new keys (recency wins; counts mislead).
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np

N = 100_000


def zipf(seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, 20_001) ** 0.9
    return rng.choice(20_000, N, p=w / w.sum()).tolist()


def phases(seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, 3_001) ** 0.8
    out: list[int] = []
    for phase in range(5):
        out += (rng.choice(3_000, N // 5, p=w / w.sum()) + phase * 3_000).tolist()
    return out


def scan_hot(seed: int = 2) -> list[int]:
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, 2_001) ** 0.8
    hot = rng.choice(2_000, N, p=w / w.sum()).tolist()
    out: list[int] = []
    fresh = 10**6
    for i, key in enumerate(hot):
        out.append(key)
        if i % 1_000 == 0:
            out += range(fresh, fresh + 300)
            fresh += 300
    return out


def loop(seed: int = 3) -> list[int]:
    return [i % 1_200 for i in range(N)]


def recency(seed: int = 4) -> list[int]:
    rng = random.Random(seed)
    stack: list[int] = []
    out: list[int] = []
    new = 0
    for _ in range(N):
        if stack and rng.random() < 0.7:
            depth = min(int(rng.expovariate(1 / 300)), len(stack) - 1)
            key = stack.pop(-1 - depth)
        else:
            key, new = new, new + 1
        stack.append(key)
        out.append(key)
    return out


PATTERNS = {"zipf": zipf, "phases": phases, "scan_hot": scan_hot, "loop": loop, "recency": recency}


def shifting_zipf(accesses: int = 1_000_000, keys: int = 250_000, seed: int = 5) -> list[int]:
    """A large key space for replay speed: Zipf(0.9) draws over ``keys`` ranks whose hot set
    shifts ten times (each tenth of the trace rotates the rank -> key map by ``keys // 10``), so
    most keys are seen and counts must fade."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, keys + 1) ** 0.9
    ranks = rng.choice(keys, accesses, p=w / w.sum())
    phase = np.arange(accesses) * 10 // accesses
    return ((ranks + phase * (keys // 10)) % keys).tolist()


def write_large(out_dir: str, accesses: int = 1_000_000, keys: int = 250_000) -> str:
    """Writes ``large_zipf_<accesses>_<keys>.txt`` (once; `shifting_zipf`); returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.abspath(os.path.join(out_dir, f"large_zipf_{accesses}_{keys}.txt"))
    if not os.path.exists(path):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(f"k{k}" for k in shifting_zipf(accesses, keys)) + "\n")
        os.replace(tmp, path)
    return path


def write_all(out_dir: str) -> list[str]:
    """Writes ``synthetic_<name>.txt`` for every pattern (once); returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, make in PATTERNS.items():
        path = os.path.abspath(os.path.join(out_dir, f"synthetic_{name}.txt"))
        if not os.path.exists(path):
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(f"k{k}" for k in make()) + "\n")
            os.replace(tmp, path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.synthetic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "synthetic"))
    args = parser.parse_args(argv)
    for path in write_all(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
