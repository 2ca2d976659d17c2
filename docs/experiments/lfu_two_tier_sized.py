"""Two tiers against one tier of the summed bytes, with sizes, over several seeds and budgets.

    python docs/experiments/lfu_two_tier_sized.py [--seeds 0-5] [--budgets 300,700,1100,1500]

The trace is the sized two-tier test's (`tests/test_policy.py`: phases of skewed reuse, a scan
and a loop, sizes 1-16 bytes), from each seed; L1 holds a fifth of the budget and L2 the rest.
It prints the miss ratio of one tier, of two tiers and the difference per seed and budget.
docs/policies.md ("Two tiers", "A known gap with sizes") quotes it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from multiprocessing import Pool

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))


def _point(args: tuple[int, int]) -> tuple[int, int, float, float]:
    from test_policy import _phases, _trace  # the test's trace, not a copy of it

    from cacheflow_jax import lfu
    from cacheflow_jax.replay.engine import replay

    seed, budget = args
    keys = _phases(seed=seed, phases=20, scan=300, loop=260, loops=2, hot=800, per=1500)
    sizes = {k: random.Random(k).randint(1, 16) for k in set(keys)}
    trace = _trace(keys, sizes, timed=False)
    one = replay(trace, device_bytes=budget, host_bytes=0, policy=lfu(ttl=None))
    two = replay(trace, device_bytes=budget // 5, host_bytes=budget - budget // 5,
                 policy=lfu(ttl=None))
    return seed, budget, one["miss_ratio"], two["miss_ratio"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0-5", help="first-last (default 0-5)")
    p.add_argument("--budgets", default="300,700,1100,1500", help="bytes, comma-separated")
    args = p.parse_args()
    first, last = (int(x) for x in args.seeds.split("-"))
    budgets = [int(b) for b in args.budgets.split(",")]
    with Pool(2) as pool:
        rows = pool.map(_point, [(s, b) for s in range(first, last + 1) for b in budgets])
    print("seed  budget  one tier  two tiers  two - one")
    for seed, budget, one, two in rows:
        print(f"{seed:4d}  {budget:6d}  {one:8.4f}  {two:9.4f}  {two - one:+9.4f}")
    print(f"largest |two - one|: {max(abs(t - o) for _, _, o, t in rows):.4f}")


if __name__ == "__main__":
    main()
