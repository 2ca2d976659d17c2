"""Prefetch (issue 10): the planner, the scheduler, the live worker and replay, on real stores."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import cacheflow_jax as cfj
import predictor
from cacheflow_jax.tiers.memory import MetadataTier

ROW = 256  # float32 elements per block: 1 KiB blocks
KIB = 1024


def _store(tmp_path: Path, rows: int = 64) -> tuple[cfj.TensorStoreStore, np.ndarray]:
    data = np.random.default_rng(0).standard_normal((rows, ROW)).astype(np.float32)
    return cfj.write_store({"w": data}, tmp_path / "s", chunk_bytes=ROW * 4), data


def _key(i: int) -> str:
    return f"w@{i},0"


def _pattern(n: int, seed: int = 0) -> list[str]:
    """Requests that follow a few fixed chains (so successors repeat), with some noise."""
    rng = np.random.default_rng(seed)
    chains = [rng.choice(64, size=int(rng.integers(3, 9)), replace=False) for _ in range(10)]
    out: list[str] = []
    while len(out) < n:
        chain = chains[int(rng.zipf(1.5)) % len(chains)]
        out += [_key(int(i)) for i in chain]
        if rng.random() < 0.2:
            out.append(_key(int(rng.integers(64))))
    return out[:n]


def _residency(cache: cfj.TieredCache) -> dict[str, set[str]]:
    return {tier.name: set(tier.entries) for tier in cache.tiers}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- one way to move


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize(("device", "host"), [(12, 0), (8, 16)])
@pytest.mark.parametrize("prefetch", [None, "markov", "last-successor"])
def test_live_and_replay_residency_agree_step_by_step(
    tmp_path: Path, policy: str, device: int, host: int, prefetch: str | None
) -> None:
    # The live cache (real data, the threaded get path) and replay's access_sync (no data) make
    # the same decisions through the one planner: the same blocks in the same tiers after every
    # access, with prefetch on (synchronous live prefetch = replay with lead 1) and off.
    store, _ = _store(tmp_path)
    make = {"markov": predictor.markov, "last-successor": predictor.last_successor}.get(prefetch)
    clocks = _Clock(), _Clock()
    live = cfj.TieredCache(
        store,
        device_bytes=device * KIB,
        host_bytes=host * KIB,
        policy=policy,
        clock=clocks[0],
        read_buffer=1,
        prefetcher=make() if make else None,
        prefetch=cfj.PrefetchSettings(synchronous=True) if make else None,
    )
    replay = cfj.TieredCache(
        store,
        device_bytes=device * KIB,
        host_bytes=host * KIB,
        policy=policy,
        clock=clocks[1],
        read_buffer=1,
        tiers=[
            MetadataTier(device * KIB, name="device", setting="device_bytes"),
            MetadataTier(host * KIB, name="host", setting="host_bytes"),
        ],
        prefetcher=make() if make else None,
        prefetch=cfj.PrefetchSettings(lead=1, keys_known=True) if make else None,
    )
    for step, key in enumerate(_pattern(600)):
        clocks[0].now = clocks[1].now = step * 0.01
        live.get(key)
        replay.access_sync(key, step * 0.01)
        assert _residency(live) == _residency(replay), f"step {step} ({key})"
    a, b = live.stats(), replay.stats()
    for field in ("requests", "hits", "misses", "byte_miss_ratio", "tiers", "prefetch"):
        if field == "prefetch":
            a[field].pop("predict_us", None), b[field].pop("predict_us", None)
        assert a[field] == b[field], field
    if make:
        assert a["prefetch"]["issued"] > 50 and a["prefetch"]["timely"] > 0
    live.check_budgets()


# ------------------------------------------------------------------------------ scheduling


class _Proposes:
    """A predictor that proposes fixed keys (some not in the store) after every access."""

    def __init__(self, keys: list, score: float = 0.9) -> None:
        self.keys, self.score = keys, score
        self.observed: list[str] = []

    def observe(self, access) -> None:
        self.observed.append(access["key"])

    def predict(self, k: int) -> list[tuple[str, float]]:
        return [(key, self.score) for key in self.keys][:k]

    def reset(self) -> None:
        self.observed.clear()


def test_never_prefetches_a_key_the_store_does_not_hold(tmp_path: Path) -> None:
    store, data = _store(tmp_path)
    bad = _Proposes(["nope", "w@999,0", "kv:never-put", 123])
    cache = cfj.TieredCache(store, device_bytes=16 * KIB, host_bytes=0, prefetcher=bad,
                            prefetch=cfj.PrefetchSettings(synchronous=True))  # fmt: skip
    for i in range(20):
        assert np.array_equal(np.asarray(cache.get(_key(i))), data[i : i + 1])
    stats = cache.stats()["prefetch"]
    assert stats["issued"] == 0 and stats["enabled"]
    assert bad.observed == [_key(i) for i in range(20)]


def test_scores_below_the_threshold_are_not_loaded(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    weak = _Proposes([_key(40), _key(41)], score=0.1)
    cache = cfj.TieredCache(store, device_bytes=16 * KIB, host_bytes=0, prefetcher=weak,
                            prefetch=cfj.PrefetchSettings(synchronous=True, min_score=0.2))  # fmt: skip
    cache.get(_key(0))
    cache.get(_key(1))
    assert cache.stats()["prefetch"]["issued"] == 0 and cache.tier_of(_key(40)) is None


def test_prefetch_does_not_displace_a_block_worth_more(tmp_path: Path) -> None:
    # L1 holds 4 blocks; LRU's victim is block 0. A guess may push it out, unless the predictor
    # itself ranks block 0 above the guess (it expects block 0 back sooner): then the guess goes
    # to L2 instead (or nowhere when there is none).
    store, _ = _store(tmp_path)
    for host in (0, 8):
        for proposals, displaces in (([_key(0), _key(50)], False), ([_key(50), _key(0)], True)):
            guess = _Proposes([])
            cache = cfj.TieredCache(
                store, device_bytes=4 * KIB, host_bytes=host * KIB, policy="lru",
                prefetcher=guess, prefetch=cfj.PrefetchSettings(synchronous=True),
                read_buffer=1,
            )  # fmt: skip
            for i in range(4):
                cache.get(_key(i))
            guess.keys = proposals
            cache.get(_key(3))  # the guess is issued after this access and lands before the next
            cache.get(_key(2))
            l1 = set(cache.tiers[0].entries)
            pf = cache.stats()["prefetch"]
            if displaces:
                assert _key(50) in l1 and _key(0) not in l1
                assert cache.tier_of(_key(0)) == ("host" if host else None)  # demoted as usual
            else:
                assert l1 == {_key(i) for i in range(4)}
                assert cache.tier_of(_key(50)) == ("host" if host else None)
                assert pf["issued"] >= 1 and (pf["dropped"] >= 1) == (host == 0)


def test_unused_prefetched_blocks_leave_first(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    guess = _Proposes([_key(60), _key(61)])
    cache = cfj.TieredCache(
        store, device_bytes=6 * KIB, host_bytes=0, policy="lru", prefetcher=guess,
        prefetch=cfj.PrefetchSettings(synchronous=True), read_buffer=1,
    )  # fmt: skip
    for i in range(4):
        cache.get(_key(i))
    cache.get(_key(0))  # the guesses (60, 61) landed; L1 is full: 0, 1, 2, 3, 60, 61
    assert cache.tier_of(_key(60)) == "device" and cache.tier_of(_key(61)) == "device"
    guess.keys = []
    cache.get(_key(3))  # a hit; the predictor, asked again, no longer names the guesses
    cache.get(_key(10))  # a demand miss: the oldest unused guess leaves, not LRU's victim (1)
    cache.get(_key(11))
    assert cache.tier_of(_key(60)) is None and cache.tier_of(_key(61)) is None
    assert all(cache.tier_of(_key(i)) == "device" for i in (0, 1, 2, 3, 10, 11))
    pf = cache.stats()["prefetch"]
    assert pf["wasted"] == 2 and pf["wasted_bytes"] == 2 * KIB and pf["used"] == 0


def test_a_prefetched_block_used_counts_once_as_timely(tmp_path: Path) -> None:
    store, data = _store(tmp_path)
    cache = cfj.TieredCache(
        store, device_bytes=16 * KIB, host_bytes=0, prefetcher=predictor.last_successor(),
        prefetch=cfj.PrefetchSettings(synchronous=True), read_buffer=1,
    )  # fmt: skip
    seq = [_key(i) for i in (0, 5, 9)]
    for key in seq * 2:
        cache.get(key)  # the first round teaches the successors
    for key in seq:
        cache.evict(key)
    for key in seq:
        assert np.array_equal(np.asarray(cache.get(key)), data[int(key[2:-2]) : int(key[2:-2]) + 1])
    pf = cache.stats()["prefetch"]
    assert pf["timely"] >= 2 and pf["used"] == pf["timely"] + pf["late"]
    assert pf["accuracy"] == pf["used"] / pf["issued"]


# -------------------------------------------------------------------------- the live worker


def test_prefetch_under_8_threads_keeps_budgets_and_bytes(tmp_path: Path) -> None:
    store, data = _store(tmp_path)
    cache = cfj.TieredCache(store, device_bytes=12 * KIB, host_bytes=12 * KIB,
                            prefetcher=predictor.markov())  # fmt: skip
    stop = threading.Event()
    errors: list[str] = []
    violations = [0]

    def sampler() -> None:
        while not stop.is_set():
            try:
                cache.check_budgets()
            except AssertionError:
                violations[0] += 1
            time.sleep(0.001)

    def worker(seed: int, s) -> None:
        for key in _pattern(400, seed):
            i = int(key[2:-2])
            try:
                got = np.asarray(s.get(key) if seed % 2 else s.get_many([key])[0])
            except Exception as err:  # noqa: BLE001
                errors.append(repr(err))
                continue
            if not np.array_equal(got, data[i : i + 1]):
                errors.append(f"wrong bytes for {key}")
            # A step's compute between accesses, which releases the interpreter: without it
            # eight threads of pure hits can starve the prefetch worker of it.
            time.sleep(0.0005)

    watcher = threading.Thread(target=sampler)
    watcher.start()
    with cfj.serving(cache) as s:
        threads = [threading.Thread(target=worker, args=(seed, s)) for seed in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    stop.set()
    watcher.join()
    assert errors == [] and violations[0] == 0
    pf = cache.stats()["prefetch"]
    assert pf["issued"] > 0 and pf["used"] > 0, pf
    assert pf["promoted"] > 0, pf  # the worker's L2 -> L1 swaps ran under the threads too
    assert not [t for t in threading.enumerate() if t.name == "cacheflow-prefetch"]


class _SlowStore:
    """A real store whose reads take a while (to catch loads in flight at session exit)."""

    def __init__(self, store: cfj.TensorStoreStore, delay: float) -> None:
        self._store, self._delay = store, delay
        self.spec = store.spec

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def read(self, key: str):
        time.sleep(self._delay)
        return self._store.read(key)

    def read_many(self, keys):
        return [self.read(k) for k in keys]


def test_session_exit_cancels_prefetch_cleanly(tmp_path: Path) -> None:
    store, data = _store(tmp_path)
    cache = cfj.TieredCache(_SlowStore(store, 0.02), device_bytes=32 * KIB, host_bytes=0,
                            prefetcher=_Proposes([_key(i) for i in range(20, 40)]),
                            prefetch=cfj.PrefetchSettings(k=20))  # fmt: skip
    with cfj.serving(cache) as s:
        for i in range(5):
            s.get(_key(i))
        time.sleep(0.05)  # some loads are in flight, some landed
    assert not [t for t in threading.enumerate() if t.name == "cacheflow-prefetch"]
    resident = _residency(cache)
    counters = cache.stats()["prefetch"]
    time.sleep(0.5)  # loads still running in reader threads must not land now
    assert _residency(cache) == resident and cache.stats()["prefetch"] == counters
    assert cache.moving() == 0 and cache.prefetch_settled()
    cache.check_budgets()
    # The cache keeps working, and a new session prefetches again.
    with cfj.serving(cache) as s:
        assert np.array_equal(np.asarray(s.get(_key(45))), data[45:46])
        assert [t for t in threading.enumerate() if t.name == "cacheflow-prefetch"]


class _Raises(_Proposes):
    def predict(self, k: int):
        raise RuntimeError("the model broke")


class _Slow(_Proposes):
    def predict(self, k: int):
        time.sleep(0.004)
        return super().predict(k)


@pytest.mark.parametrize("mode", ["synchronous", "worker"])
@pytest.mark.parametrize("bad", ["raises", "slow"])
def test_a_failing_or_slow_predictor_turns_prefetch_off_with_one_warning(
    tmp_path: Path, mode: str, bad: str
) -> None:
    store, data = _store(tmp_path)
    guess = (_Raises if bad == "raises" else _Slow)([_key(30)])
    settings = cfj.PrefetchSettings(synchronous=mode == "synchronous", predict_budget_s=0.001)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = cfj.TieredCache(store, device_bytes=16 * KIB, host_bytes=0, prefetcher=guess,
                                prefetch=settings)  # fmt: skip
        with cfj.serving(cache) as s:
            for i in range(40):
                assert np.array_equal(np.asarray(s.get(_key(i % 10))), data[i % 10 : i % 10 + 1])
                if mode == "worker":
                    time.sleep(0.002)
            deadline = time.monotonic() + 5
            while cache.stats()["prefetch"]["enabled"] and time.monotonic() < deadline:
                s.get(_key(0))
                time.sleep(0.01)
    ours = [w for w in caught if "prefetching turned off" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert ("the model broke" if bad == "raises" else "predict_budget_s") in str(ours[0].message)
    pf = cache.stats()["prefetch"]
    assert not pf["enabled"] and pf["disabled_reason"]


def test_a_predictor_checkpoint_path_loads_and_a_damaged_one_serves_without_prefetch(
    tmp_path: Path,
) -> None:
    # Issue 9: a damaged predictor checkpoint must not stop the cache; it warns once and serves.
    store, data = _store(tmp_path)
    path = predictor.save(tmp_path / "ckpt", predictor.mlp(hidden=8))
    cache = cfj.TieredCache(store, device_bytes=16 * KIB, host_bytes=0, prefetcher=str(path))
    assert cache.stats()["prefetch"]["enabled"] and cache.prefetcher is not None
    cache.close()
    params = sorted(p for p in (path / "params").rglob("*") if p.is_file())
    raw = bytearray(params[-1].read_bytes())
    raw[len(raw) // 2] ^= 0x10
    params[-1].write_bytes(bytes(raw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = cfj.TieredCache(store, device_bytes=16 * KIB, host_bytes=0, prefetcher=path)
        with cfj.serving(cache) as s:
            for i in range(20):
                assert np.array_equal(np.asarray(s.get(_key(i))), data[i : i + 1])
    ours = [w for w in caught if "prefetching turned off" in str(w.message)]
    assert len(ours) == 1 and str(params[-1]) in str(ours[0].message), [str(w.message) for w in caught]
    assert cache.prefetcher is None and not cache.stats()["prefetch"]["enabled"]
    with pytest.raises(predictor.CheckpointError, match="nowhere"):
        cfj.TieredCache(store, device_bytes=16 * KIB, host_bytes=0, prefetcher=tmp_path / "nowhere")


# ---------------------------------------------------------------------------------- replay


def test_replay_with_prefetch_lead_and_keys_known(tmp_path: Path) -> None:
    from cacheflow_jax.replay.engine import replay
    from cacheflow_jax.trace.reader import read_trace

    keys = [f"kv:{i}" for i in (1, 2, 3, 4, 5, 6, 7, 8)] * 30
    path = tmp_path / "loop.txt"
    path.write_text("\n".join(keys) + "\n")
    trace = read_trace(str(path), format="txt")
    base = replay(trace, device_bytes=4, host_bytes=0, policy="lru")
    assert base["device_miss_ratio"] == 1.0  # a loop of 8 through 4 slots of LRU
    one = replay(trace, device_bytes=4, host_bytes=0, policy="lru",
                 prefetcher=predictor.last_successor(), prefetch=cfj.PrefetchSettings(lead=1))  # fmt: skip
    assert one["device_miss_ratio"] < 0.1 and one["prefetch"]["accuracy"] > 0.9
    late = replay(trace, device_bytes=4, host_bytes=0, policy="lru",
                  prefetcher=predictor.last_successor(), prefetch=cfj.PrefetchSettings(lead=2))  # fmt: skip
    assert late["prefetch"]["late"] > 200 and late["prefetch"]["timely"] == 0
    # Keys are fetchable only after their first access, unless every key is known to be in L3.
    first = replay(trace, device_bytes=4, host_bytes=0, policy="lru", prefetcher=_Proposes(["kv:8"]),
                   prefetch=cfj.PrefetchSettings(lead=1))  # fmt: skip
    known = replay(trace, device_bytes=4, host_bytes=0, policy="lru", prefetcher=_Proposes(["kv:8"]),
                   prefetch=cfj.PrefetchSettings(lead=1, keys_known=True))  # fmt: skip
    assert known["prefetch"]["issued"] > first["prefetch"]["issued"]
    # A warm-up teaches the predictor; the counters cover the rest only.
    warm = replay(trace, device_bytes=4, host_bytes=0, policy="lru",
                  prefetcher=predictor.last_successor(), prefetch=cfj.PrefetchSettings(lead=1),
                  warmup=80)  # fmt: skip
    assert warm["requests"] == len(keys) - 80 and warm["device_miss_ratio"] < 0.05


# --------------------------------------------------------------------- adaptive admission


def _planner(*, adaptive: bool):
    from cacheflow_jax.planning.planner import Planner
    from cacheflow_jax.policies import get_policy

    planner = Planner(get_policy("lru"), 1, has_host=False, tracking=True, adaptive=adaptive)
    for i in range(4):  # a full tier of 4 blocks: k0 .. k3, k0 least recent
        planner.access(f"k{i}", 0.0)
        planner.insert(0, f"k{i}", 0.0, 1)
    return planner


def _waste_rank_2_and_return_victims(planner, rounds: int = 8) -> int:
    """Rank-2 guesses displace LRU's victim, are never used, and each victim comes back soon:
    prefetching at rank 2 has cost a hit every time. Returns the rounds admitted before the
    first refusal (``rounds`` if none)."""
    from cacheflow_jax.planning.planner import REFUSED

    resident = [f"k{i}" for i in range(4)]
    for n in range(rounds):
        guess = f"g{n}"
        victim = planner.victim(0, guess, prefetch=True, rank=2)
        if victim is REFUSED:
            return n
        assert victim == resident[0]
        planner.remove(0, victim)
        resident.remove(victim)
        planner.insert(0, guess, 0.0, 1, prefetched=True, rank=2)
        for key in resident[-2:]:  # two hits: the guess's time (rank 2) passes unused
            planner.access(key, 0.0)
        # The victim is demanded (a miss): it comes back, and the stale guess leaves for it.
        planner.access(victim, 0.0)
        assert planner.victim(0, victim) == guess
        assert planner.remove(0, guess)  # it left unused: wasted
        planner.insert(0, victim, 0.0, 1)
        resident = resident[:-2] + [victim] + resident[-2:]
    return rounds


def test_an_overdue_guess_the_predictor_names_again_is_not_stale() -> None:
    """A guess's wait is its rank in accesses; a guess ranked 3rd may be 4 accesses ahead. One
    still among the predictor's latest proposals waits on; one that is not leaves first."""
    planner = _planner(adaptive=False)
    assert planner.victim(0, "g") == "k0"
    planner.remove(0, "k0")
    planner.insert(0, "g", 0.0, 1, prefetched=True, rank=1)  # expected within 1 access
    for key in ("k1", "k2"):
        planner.access(key, 0.0)  # its access has not come: overdue
    planner.ranking = {"g": 1}  # ... but the latest prediction names it again
    assert planner.victim(0, "new") == "k3"  # LRU's victim (k1, k2 were just used)
    planner.access("k1", 0.0)
    planner.access("k2", 0.0)
    planner.ranking = {}  # no longer proposed: stale, it leaves first
    assert planner.victim(0, "new") == "g"


def test_a_renewed_guess_saves_misses_where_guesses_look_further_than_their_rank(
    tmp_path: Path,
) -> None:
    """Requests walk fixed chains; the predictor names the block 3 ahead first, then the next
    one, then the one 2 ahead, so its first guess is used 3 accesses after it was made, past its
    rank's wait. Kept while it is proposed again, it is a hit (287 misses; 861 when overdue
    guesses left first whatever the predictor said)."""
    from cacheflow_jax.replay.engine import replay
    from cacheflow_jax.trace.reader import read_trace

    chains = 30
    lines = []
    rng = np.random.default_rng(2)
    for _ in range(600):
        h = int(rng.integers(chains))
        lines += [f"c{h}_{j}" for j in range(8)]
    path = tmp_path / "chains.txt"
    path.write_text("\n".join(lines) + "\n")
    trace = read_trace(path)

    class Ahead:
        """Proposes the blocks 3, 1 and 2 ahead in the chain, in that order."""

        def __init__(self) -> None:
            self.last = None

        def observe(self, access) -> None:
            self.last = access["key"]

        def predict(self, k: int) -> list[tuple[str, float]]:
            h, j = self.last[1:].split("_")
            return [(f"c{h}_{int(j) + d}", 1.0) for d in (3, 1, 2) if int(j) + d < 8][:k]

        def reset(self) -> None:
            self.last = None

    out = replay(trace, device_bytes=12, host_bytes=0, policy="lru", prefetcher=Ahead(),
                 prefetch=cfj.PrefetchSettings(lead=1, adaptive=False),
                 warmup=len(lines) // 2)  # fmt: skip
    # The first two blocks of each request cannot be foreseen; every other one is.
    assert out["misses"] <= 2 * (len(lines) // 2) // 8 + 8, out["misses"]


def test_adaptive_admission_refuses_a_rank_whose_guesses_cost_more_than_they_gave() -> None:
    from cacheflow_jax.planning.planner import REFUSED

    planner = _planner(adaptive=True)
    admitted = _waste_rank_2_and_return_victims(planner)
    assert 2 <= admitted < 8  # cold, the priors admit as without the rule; then it learns
    adm = planner.admission
    assert adm.useful(2) < adm.victim_return() and adm.refused == 1
    assert planner.victim(0, "late", prefetch=True, rank=2) is REFUSED
    # One refused guess in EXPLORE is admitted anyway, so the rates go on being measured.
    tries = [planner.victim(0, f"try{n}", prefetch=True, rank=2) for n in range(adm.EXPLORE)]
    assert [t is REFUSED for t in tries].count(False) == 1
    # Rank 1 has no bad record (its prior says useful): still admitted against the victim.
    assert isinstance(planner.victim(0, "soon", prefetch=True, rank=1), str)
    # A demand newcomer is never judged by it.
    assert isinstance(planner.victim(0, "demand"), str)


def test_adaptive_admission_off_admits_the_same_guesses() -> None:
    planner = _planner(adaptive=False)
    assert _waste_rank_2_and_return_victims(planner) == 8
    assert planner.admission is None
    assert isinstance(planner.victim(0, "late", prefetch=True, rank=2), str)


def test_adaptive_admission_recovers_when_guesses_pay_off_again() -> None:
    from cacheflow_jax.planning.planner import REFUSED

    planner = _planner(adaptive=True)
    _waste_rank_2_and_return_victims(planner)
    assert planner.victim(0, "late", prefetch=True, rank=2) is REFUSED
    adm = planner.admission
    # Rank-2 guesses now land in free room and are used; displaced victims stop coming back
    # (the tier's next demand eviction comes first): both rates move, and rank 2 is admitted
    # again.
    for n in range(16):
        adm.guess_landed()
        adm.guess_resolved(2, True)
        adm.victim_displaced(f"gone{n}", f"used{n}")
        adm.room_freed(f"used{n}")  # the guess was used before its victim came back
    assert adm.useful(2) > adm.victim_return()
    assert isinstance(planner.victim(0, "again", prefetch=True, rank=2), str)


def test_replay_reports_the_admission_rates(tmp_path: Path) -> None:
    from cacheflow_jax.replay.engine import replay
    from cacheflow_jax.trace.reader import read_trace

    path = tmp_path / "t.txt"
    path.write_text("\n".join(str(i % 12) for i in range(240)) + "\n")
    stats = replay(read_trace(path), device_bytes=6, host_bytes=0,
                   prefetcher=predictor.last_successor(), prefetch=cfj.PrefetchSettings())
    adm = stats["prefetch"]["admission"]
    assert adm["useful"][1] > 0.9 and adm["refused"] == 0
    assert set(adm["foresight"]) == {"foreseen_return", "victim_return", "foreseen_first"}
    off = replay(read_trace(path), device_bytes=6, host_bytes=0,
                 prefetcher=predictor.last_successor(),
                 prefetch=cfj.PrefetchSettings(adaptive=False))
    assert "admission" not in off["prefetch"]


def test_the_score_floor_follows_the_measured_victim_return_rate() -> None:
    from cacheflow_jax.planning.planner import Admission
    from cacheflow_jax.prefetch.scheduler import PrefetchScheduler

    class Fixed:
        def observe(self, access) -> None:
            pass

        def predict(self, k: int) -> list[tuple[str, float]]:
            return [("a", 0.9), ("b", 0.2), ("c", 0.02)][:k]

        def reset(self) -> None:
            pass

    settings = cfj.PrefetchSettings(min_score=0.25)
    describe, fetchable = (lambda key: (1, "other")), (lambda key: True)
    fixed = PrefetchScheduler(Fixed(), settings, describe=describe, fetchable=fetchable)
    assert [k for k, _ in fixed.candidates()] == ["a"]
    adm = Admission(1, prior_return=settings.min_score)
    sched = PrefetchScheduler(Fixed(), settings, describe=describe, fetchable=fetchable,
                              admission=adm)
    assert sched.floor() == 0.25 and [k for k, _ in sched.candidates()] == ["a"]  # cold: as today
    for n in range(100):  # guesses land; the victims they displace never come back in time
        adm.guess_landed()
        adm.victim_displaced(f"v{n}", f"g{n}")
        adm.room_freed(f"g{n}")
    assert sched.floor() < 0.01 and [k for k, _ in sched.candidates()] == ["a", "b", "c"]
    for n in range(1000):  # now every other one comes back while a guess holds its room
        adm.guess_landed()
        adm.victim_displaced(f"w{n}", f"h{n}")
        if n % 2:
            adm.accessed(f"w{n}")
        adm.room_freed(f"h{n}")
    assert 0.4 < sched.floor() < 0.6 and [k for k, _ in sched.candidates()] == ["a"]


def test_a_displaced_victim_counts_while_guesses_hold_its_room() -> None:
    from cacheflow_jax.planning.planner import Admission

    adm = Admission(1)
    adm.victim_displaced("v", "g1")
    adm.room_passed("g1", "g2")  # g1 went stale and left for the guess g2: v's room still held
    adm.accessed("v")  # v is demanded: the guesses cost this hit
    assert adm.returned == 1 and adm.watching == 0
    adm.victim_displaced("u", "g3")
    adm.room_freed("g3")  # g3 was used (or left for a demand newcomer): u would be out anyway
    adm.accessed("u")
    assert adm.returned == 1 and adm.watching == 0 and not adm.held


# --------------------------------------------------------------------- foreseen blocks


def _use_guess(planner, key: str) -> None:
    """``key`` comes in as a rank-1 guess (room made first) and is used at once."""
    victim = planner.victim(0, key, prefetch=True)
    planner.remove(0, victim)
    planner.insert(0, key, 0.0, 1, prefetched=True)
    assert planner.access(key, 0.0)  # its first use: a prefetch used


def test_a_foreseen_block_leaves_before_the_policys_victim() -> None:
    planner = _planner(adaptive=True)  # LRU over k0 .. k3, k0 least recent
    _use_guess(planner, "g")  # displaces k0; g is now the most recent
    assert planner.victim(0, "demand") == "g"  # the predictor can bring it back in time
    # Hit again on demand, it is an ordinary resident: LRU's victim (k1) goes instead.
    planner.access("g", 0.0)
    assert planner.victim(0, "demand") == "k1"
    # Without adaptive (no measurement), the policy alone decides.
    plain = _planner(adaptive=False)
    _use_guess(plain, "g")
    assert plain.victim(0, "demand") == "k1"


def test_foreseen_blocks_stop_going_first_when_they_come_back_uncovered() -> None:
    planner = _planner(adaptive=True)
    foresight = planner.foresight
    for n in range(6):
        _use_guess(planner, f"g{n}")
        victim = planner.victim(0, f"d{n}")
        assert victim == f"g{n}"
        planner.remove(0, victim)
        planner.insert(0, f"d{n}", 0.0, 1)
        # The foreseen block is demanded again and not prefetched: a miss its eviction caused.
        planner.access(f"g{n}", 0.0)
        other = planner.victim(0, f"g{n}")
        planner.remove(0, other)
        planner.insert(0, f"g{n}", 0.0, 1)
        if not foresight.first:
            break
    assert not foresight.first and foresight.rate(1) > foresight.rate(0)
    _use_guess(planner, "late")
    assert planner.victim(0, "demand") != "late"  # the policy decides again
    # Policy victims that come back uncovered as often make foreseen blocks go first again.
    for n in range(8):
        foresight.left_tier(0, f"v{n}")
        foresight.accessed(f"v{n}", None)
    assert foresight.first and planner.victim(0, "demand") == "late"


def test_foreseen_first_saves_misses_on_chains_behind_unpredictable_heads(tmp_path: Path) -> None:
    """Requests walk fixed chains from heads drawn at random: the chains' blocks are prefetched
    from their heads, so only the heads need to stay; foreseen blocks leaving first keeps them."""
    from cacheflow_jax.replay.engine import replay
    from cacheflow_jax.trace.reader import read_trace

    rng = np.random.default_rng(1)
    heads = 40
    lines = []
    for _ in range(1500):
        h = int(rng.zipf(1.3)) % heads
        lines += [f"h{h}"] + [f"c{h}_{j}" for j in range(6)]
    path = tmp_path / "chains.txt"
    path.write_text("\n".join(lines) + "\n")
    trace = read_trace(path)

    def misses(adaptive: bool) -> int:
        return replay(trace, device_bytes=30, host_bytes=0, policy="lru",
                      prefetcher=predictor.last_successor(),
                      prefetch=cfj.PrefetchSettings(lead=1, adaptive=adaptive),
                      warmup=len(lines) // 2)["misses"]  # fmt: skip

    with_foresight, without = misses(True), misses(False)
    assert with_foresight < 0.8 * without, (with_foresight, without)


def test_foresight_counts_what_left_and_what_came_back_uncovered_per_byte() -> None:
    from cacheflow_jax.planning.planner import Foresight

    f = Foresight(1)
    f.arrived("a", 4, prefetched=True)
    f.accessed("a", 0)  # a prefetch used: foreseen
    f.left_tier(0, "a")  # evicted: one foreseen block of 4 bytes left
    assert (f.left, f.left_bytes) == ([0.0, 1.0], [0.0, 4.0])
    f.arrived("a", 4, prefetched=True)  # prefetched back: a covered return, no cost
    assert (f.left, f.returned) == ([0.0, 1.0], [0.0, 0.0])
    f.arrived("b", 2, prefetched=False)
    f.left_tier(0, "b")
    f.arrived("b", 2, prefetched=False)  # a move between tiers, not an eviction: undone
    assert (f.left[0], f.left_bytes[0]) == (0.0, 0.0)
    f.arrived("c", 8, prefetched=False)
    f.left_tier(0, "c")
    f.accessed("c", None)  # back on a demand access: an uncovered return of a policy victim
    assert f.returned == [1.0, 0.0] and f.left_bytes[0] == 8.0
    assert f.rate(0) == 1.0 / (8.0 + f.PRIOR * 8.0) and f.rate(1) == 0.0 and f.first


class _Next:
    """Proposes the key ``offset`` places after the last one accessed (a loop of ``n`` keys)."""

    def __init__(self, n: int, offset: int) -> None:
        self.n, self.offset, self.last = n, offset, 0

    def observe(self, access) -> None:
        key = access["key"] if isinstance(access, dict) else access.key
        self.last = int(key[2:-2])

    def predict(self, k: int) -> list[tuple[str, float]]:
        return [(_key((self.last + self.offset) % 64), 0.9)]

    def reset(self) -> None:
        self.last = 0


def _reads_for(tmp_path: Path, offset: int) -> dict:
    """L3 prefetch reads over a loop of 16 keys (L1 4 blocks, no L2), one access at a time."""
    store, data = _store(tmp_path)
    cache = cfj.TieredCache(store, device_bytes=4 * KIB, host_bytes=0, policy="lru",
                            prefetcher=_Next(16, offset),
                            prefetch=cfj.PrefetchSettings(k=1, adaptive=False))  # fmt: skip
    with cfj.serving(cache) as s:
        for i in range(240):
            assert np.array_equal(np.asarray(s.get(_key(i % 16))), data[i % 16 : i % 16 + 1])
            end = time.monotonic() + 5
            while not cache.prefetch_settled():
                assert time.monotonic() < end, "the prefetch worker did not settle"
                time.sleep(0.001)
    return cache.stats()["prefetch"]


def test_l3_prefetch_reads_earn_their_rate(tmp_path: Path) -> None:
    """Guesses that are never used stop costing reads (one in ReadGate.EXPLORE goes on, to keep
    measuring); guesses used in time keep the reads going."""
    wrong = _reads_for(tmp_path / "wrong", offset=32)  # keys 32..47: never accessed
    right = _reads_for(tmp_path / "right", offset=1)  # the next key of the loop
    assert right["timely"] > 150 and right["issued"] > 150, right
    assert wrong["used"] == 0 and wrong["wasted"] > 0, wrong
    assert wrong["issued"] < 40, wrong  # without the gate: one read per access (240)
