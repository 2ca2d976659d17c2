"""Tests for `predictor`: baselines on hand-made streams, metrics by hand, features, save/load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import predictor
from predictor import Access

KV = "kv"


def _feed(p: predictor.Predictor, keys: list[str]) -> None:
    for i, key in enumerate(keys):
        p.observe(Access(key, float(i), 1, KV))


# --------------------------------------------------------------------------------------------
# protocol and baselines


def test_access_from_dict_and_tuple() -> None:
    a = predictor.as_access({"t": 1.5, "key": "kv:3", "nbytes": 8, "kind": "kv", "req": "r1"})
    assert a == Access("kv:3", 1.5, 8, "kv", "r1")
    assert predictor.as_access(a) is a
    with pytest.raises(TypeError, match="string 'key'"):
        predictor.as_access({"t": 1.0})


@pytest.mark.parametrize("name", ["last_successor", "markov", "stride"])
def test_baselines_take_dicts_and_reset(name: str) -> None:
    p = predictor.BASELINES[name]()
    for i, key in enumerate(["kv:1", "kv:2", "kv:1", "kv:2", "kv:3"]):
        p.observe({"t": float(i), "key": key, "nbytes": 1, "kind": "kv"})
    assert p.predict(0) == []
    p.reset()
    assert p.predict(4) == []


def test_last_successor_predicts_what_followed_last_time() -> None:
    p = predictor.last_successor()
    _feed(p, ["a", "b", "c", "a", "d", "x", "a"])
    assert p.predict(4) == [("d", 1.0)]  # "a" was followed by "b", then by "d"
    _feed(p, ["q"])
    assert p.predict(4) == []  # "q" never had a successor


def test_markov_ranks_successors_by_decayed_count() -> None:
    p = predictor.markov(decay=1.0)
    _feed(p, ["a", "b", "a", "b", "a", "c", "a"])
    assert p.predict(4) == [("b", 2 / 3), ("c", 1 / 3)]
    assert p.predict(1) == [("b", 2 / 3)]
    q = predictor.markov(decay=0.25)  # recent transitions dominate
    _feed(q, ["a", "b", "a", "b", "a", "c", "a"])
    (first, s1), (second, _) = q.predict(2)
    assert (first, second) == ("c", "b") and s1 == pytest.approx(1 / (1 + 0.25 + 0.0625))
    with pytest.raises(ValueError, match="decay"):
        predictor.markov(decay=0.0)


def test_stride_follows_the_last_stride_of_the_prefix() -> None:
    p = predictor.stride()
    _feed(p, ["kv:10", "kv:12"])
    assert p.predict(3) == [("kv:14", 1.0), ("kv:16", 0.5), ("kv:18", 1 / 3)]
    _feed(p, ["params/w@3,0", "params/w@3,1"])
    assert [k for k, _ in p.predict(2)] == ["params/w@3,2", "params/w@3,3"]
    _feed(p, ["kv:11"])  # kv: stride is now -1; never below 0
    assert [k for k, _ in p.predict(20)] == [f"kv:{i}" for i in range(10, -1, -1)]
    _feed(p, ["bias"])
    assert p.predict(3) == []
    q = predictor.stride()
    _feed(q, ["kv:5"])
    assert q.predict(3) == []  # no stride observed yet


def test_split_and_join_index() -> None:
    assert predictor.split_index("kv:123") == ("kv:", (123,))
    assert predictor.split_index("layers/0/w@3,0") == ("layers/0/w@", (3, 0))
    assert predictor.split_index("norm") is None
    assert predictor.join_index("kv:", (7,)) == "kv:7"


def test_tables_stay_bounded() -> None:
    p = predictor.last_successor(max_keys=100)
    _feed(p, [f"kv:{i}" for i in range(1000)])
    assert len(p.successor) <= 100
    assert p.successor["kv:998"] == "kv:999"


# --------------------------------------------------------------------------------------------
# metrics


def test_metrics_by_hand() -> None:
    keys = ["a", "b", "c", "a", "b", "d", "a"]
    # start=3, W=2: positions 3, 4, 5, 6
    preds = [["b", "x"], ["a"], ["a", "b"], []]
    m = predictor.prediction_metrics(keys, preds, start=3, lookahead=2)
    # correct: pos3 "b" in [b, d] yes, "x" no; pos4 "a" in [d, a] yes; pos5 "a" in [a] yes,
    # "b" no; pos6 nothing -> 3 of 5.
    assert (m["predictions"], m["correct"]) == (5, 3)
    assert m["precision"] == pytest.approx(3 / 5)
    # seen before: j=3 a, j=4 b, j=6 a (j=5 "d" is new). Predicted within 2 positions before,
    # from evaluated positions only: a@3 none (no position 1..2 evaluated), b@4 yes (pos 3),
    # a@6 yes (pos 4, 5) -> 2 of 3.
    assert (m["seen_accesses"], m["predicted_accesses"]) == (3, 2)
    assert m["recall"] == pytest.approx(2 / 3)


def test_metrics_errors_and_empty() -> None:
    m = predictor.prediction_metrics(["a", "b"], [[], []], start=0, lookahead=1)
    assert m["precision"] == 0.0 and m["recall"] == 0.0
    with pytest.raises(ValueError, match="prediction lists"):
        predictor.prediction_metrics(["a", "b"], [[]], start=0, lookahead=1)
    with pytest.raises(ValueError, match="lookahead"):
        predictor.prediction_metrics(["a"], [[]], start=0, lookahead=0)


def test_run_predictor_matches_manual_loop() -> None:
    keys = ["a", "b", "c", "a", "b", "c", "a"]
    accesses = [Access(k, float(i), 1, KV) for i, k in enumerate(keys)]
    preds = predictor.run_predictor(predictor.last_successor(), accesses, start=3, top_k=4)
    assert preds == [["b"], ["c"], ["a"], ["b"]]
    m = predictor.prediction_metrics(keys, preds, start=3, lookahead=1)
    # the last prediction ("b" after position 6) has no later access; a@3 had no evaluated
    # position before it
    assert m["precision"] == pytest.approx(3 / 4) and m["recall"] == pytest.approx(3 / 4)


# --------------------------------------------------------------------------------------------
# features and the MLP predictor


def _mooncake_like(n_requests: int = 30, seed: int = 0) -> list[Access]:
    """Requests listing KV blocks in prefix order: shared prefixes and fresh blocks."""
    rng = np.random.default_rng(seed)
    prefixes: list[list[int]] = []
    nxt, out = 0, []
    for r in range(n_requests):
        if prefixes and rng.random() < 0.5:
            base = prefixes[rng.integers(len(prefixes))]
            ids = base[: rng.integers(1, len(base) + 1)]
        else:
            ids = []
        fresh = list(range(nxt, nxt + int(rng.integers(2, 8))))
        nxt += len(fresh)
        ids = ids + fresh
        prefixes.append(ids)
        out += [Access(f"kv:{h}", float(r), 1, KV, f"r{r}") for h in ids]
    return out


def test_features_name_sources_and_work_for_unseen_keys() -> None:
    cfg = predictor.FeatureConfig()
    state = predictor.FeatureState(cfg)
    for i, key in enumerate(["kv:0", "kv:1", "kv:2", "kv:0", "kv:1"]):
        state.observe(Access(key, float(i), 1, KV))
    buf = np.zeros((cfg.max_candidates, predictor.NUM_FEATURES), np.float32)
    keys = state.features_into(buf)
    f = {name: i for i, name in enumerate(predictor.FEATURES)}
    row = {k: buf[i] for i, k in enumerate(keys)}
    assert row["kv:2"][f["successor_chain"]] == 1.0  # last successor of kv:1
    assert row["kv:2"][f["stride_step"]] == 1.0
    assert row["kv:3"][f["frontier_step"]] == 1.0  # a key never seen: the next fresh block
    assert row["kv:3"][f["seen"]] == 0.0
    assert np.all(buf[len(keys) :] == 0)
    assert len(keys) == len(set(keys)) <= cfg.max_candidates


def test_feature_config_round_trip_and_checks() -> None:
    cfg = predictor.FeatureConfig(history=3, lookahead=5)
    assert predictor.FeatureConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    with pytest.raises(ValueError, match="lookahead"):
        predictor.FeatureConfig(lookahead=0)
    with pytest.raises(ValueError, match="unknown feature settings"):
        predictor.FeatureConfig.from_json({"nope": 1})


def test_mlp_predictor_protocol() -> None:
    p = predictor.mlp(seed=0, hedge=1)
    assert p.predict(4) == []
    for a in _mooncake_like(5):
        p.observe(a._asdict())
    got = p.predict(4)
    assert 1 <= len(got) <= 4 and len({k for k, _ in got}) == len(got)
    assert all(0.0 <= s <= 1.0 for _, s in got)
    p.reset()
    assert p.predict(4) == []
    with pytest.raises(ValueError, match="min_score"):
        predictor.mlp(min_score=2.0)


def test_choose_is_the_serving_rule() -> None:
    # columns: p_window, ranking score; rows 1 and 3 are successors of the current key
    scores = np.array([[0.9, 0.5], [0.3, 0.4], [0.95, 0.9], [0.2, 0.3], [0.1, 0.2]])
    succ = np.array([False, True, False, True, False])
    assert predictor.choose(scores, succ, 4, 0.8, 0) == [2, 0]  # confident, by rank
    assert predictor.choose(scores, succ, 4, 0.8, 1) == [2, 0, 1]  # + best successor
    assert predictor.choose(scores, succ, 4, 0.8, 3) == [2, 0, 1, 3]  # room for two only
    assert predictor.choose(scores, succ, 1, 0.8, 3) == [2]  # no room left for the hedge
    assert predictor.choose(scores, succ, 4, 0.99, 1) == [1]
    assert predictor.choose(scores, succ, 0, 0.0, 1) == []
    assert predictor.choose(scores[:0], succ[:0], 4, 0.0, 1) == []


def test_choose_keeps_the_last_successor() -> None:
    scores = np.array([[0.9, 0.5], [0.3, 0.4], [0.95, 0.9], [0.2, 0.3], [0.1, 0.2]])
    succ = np.array([False, True, False, True, False])
    assert predictor.choose(scores, succ, 4, 0.8, 0, keep=3) == [2, 0, 3]  # below min_score
    assert predictor.choose(scores, succ, 2, 0.8, 0, keep=3) == [2, 3]  # takes the last place
    assert predictor.choose(scores, succ, 2, 0.8, 0, keep=0) == [2, 0]  # already confident
    assert predictor.choose(scores, succ, 1, 0.8, 0, keep=3) == [3]
    assert predictor.choose(scores, succ, 4, 0.8, 1, keep=3) == [2, 0, 3, 1]  # then the hedge
    assert predictor.choose(scores, succ, 4, 0.8, 0, keep=-1) == [2, 0]
    x = np.zeros((2, 3, predictor.NUM_FEATURES), np.float32)
    x[0, 1, predictor.FEATURES.index("successor_chain")] = 1.0
    x[1, 0, predictor.FEATURES.index("successor_chain")] = 0.5  # depth 2 is not the successor
    assert predictor.last_successor_index(x).tolist() == [1, -1]


def test_mlp_proposals_contain_last_successors() -> None:
    # Whatever the model's scores, the MLP proposes what last_successor proposes, so its recall
    # can never be below last_successor's.
    repeats = [Access(k, 100.0 + i, 1, KV) for i, k in enumerate("aabaacbba")]
    accesses = _mooncake_like(40, seed=2) + repeats
    keys = [a.key for a in accesses]
    p = predictor.mlp(seed=4, min_score=1.0, hedge=0)
    mlp_preds = predictor.run_predictor(p, accesses, start=0, top_k=4)
    ls_preds = predictor.run_predictor(predictor.last_successor(), accesses, start=0, top_k=4)
    assert all(set(b) <= set(a) for a, b in zip(mlp_preds, ls_preds))
    assert any(ls_preds)
    m = predictor.prediction_metrics(keys, mlp_preds, start=0, lookahead=4)
    ls = predictor.prediction_metrics(keys, ls_preds, start=0, lookahead=4)
    assert m["predicted_accesses"] >= ls["predicted_accesses"]


def test_mlp_predict_applies_choose_to_its_scores() -> None:
    p = predictor.mlp(seed=1, min_score=0.5, hedge=2)
    for a in _mooncake_like(6):
        p.observe(a)
        buf = np.zeros((p.config.max_candidates, predictor.NUM_FEATURES), np.float32)
        keys = p.features.features_into(buf)
        scores = np.asarray(predictor.score_candidates(*nnx.split(p.model()), buf))[: len(keys)]
        mask = predictor.successor_mask(buf[: len(keys)])
        keep = int(predictor.last_successor_index(buf[: len(keys)]))
        want = [keys[i] for i in predictor.choose(scores, mask, 4, 0.5, 2, keep=keep)]
        assert [k for k, _ in p.predict(4)] == want


def test_host_scores_equal_the_jax_model() -> None:
    # Serving scores in NumPy (no XLA dispatch behind the served model); the JAX model that
    # training uses is the reference, on random and extreme inputs (large logits saturate).
    p = predictor.mlp(seed=3, hidden=32)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, predictor.NUM_FEATURES)).astype(np.float32)
    x[:4] *= 1000.0
    want = np.asarray(predictor.score_candidates(*nnx.split(p.model()), x))
    got = p.score(x)
    assert got.shape == want.shape == (48, 2) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# save / load


def _predictions(p: predictor.MLPPredictor, accesses: list[Access]) -> list:
    p.reset()
    out = []
    for a in accesses:
        p.observe(a)
        out.append(p.predict(4))
    return out


def test_save_load_round_trip_gives_identical_predictions(tmp_path: Path) -> None:
    p = predictor.mlp(seed=3, hidden=16, min_score=0.1, hedge=1)
    path = predictor.save(tmp_path / "ckpt", p, extra={"note": "test"})
    q = predictor.load(path)
    assert (q.min_score, q.hedge, q.config, q.hidden) == (0.1, 1, p.config, 16)
    assert predictor.read_meta(path)["extra"] == {"note": "test"}
    accesses = _mooncake_like(12)
    assert _predictions(q, accesses) == _predictions(p, accesses)


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(predictor.CheckpointError, match="no predictor checkpoint.*fall back"):
        predictor.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(predictor.CheckpointError, match="not a predictor checkpoint"):
        predictor.load(tmp_path / "empty")
    assert issubclass(predictor.CheckpointError, ValueError)


def test_wrong_version_is_a_clear_error(tmp_path: Path) -> None:
    path = predictor.save(tmp_path / "ckpt", predictor.mlp(hidden=8))
    meta_file = path / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["format_version"] = predictor.FORMAT_VERSION + 1
    meta_file.write_text(json.dumps(meta))
    # A checkpoint genuinely saved by another version passes its integrity check: re-record it.
    from predictor._checkpoint import INTEGRITY_FILE, _digests

    (path / INTEGRITY_FILE).write_text(json.dumps({"algorithm": "sha256", "files": _digests(path)}))
    with pytest.raises(predictor.CheckpointError, match=f"format version {meta['format_version']}"):
        predictor.load(path)


def test_corrupted_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    path = predictor.save(tmp_path / "ckpt", predictor.mlp(hidden=8))
    (path / "meta" / "metadata").write_text("{not json")
    with pytest.raises(predictor.CorruptCheckpointError, match=str(path)):
        predictor.load(path)
    path2 = predictor.save(tmp_path / "ckpt2", predictor.mlp(hidden=8))
    shutil.rmtree(path2 / "params")
    with pytest.raises(predictor.CorruptCheckpointError, match="is missing"):
        predictor.load(path2)


def test_every_bit_flip_or_truncation_of_a_checkpoint_is_caught(tmp_path: Path) -> None:
    # Issue 9: bit flips in orbax's unchecksummed chunks changed predictions silently, and some
    # damage raised a plain ValueError. Now every damaged file is a CorruptCheckpointError.
    from _faults import record

    rng = np.random.default_rng(9)
    path = predictor.save(tmp_path / "ckpt", predictor.mlp(seed=1, hidden=8))
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != "integrity.json")
    caught = 0
    for trial in range(25):
        f = files[trial % len(files)]
        saved = f.read_bytes()
        if trial % 5 == 4:
            f.write_bytes(saved[: int(rng.integers(0, len(saved)))])
        else:
            data = bytearray(saved)
            data[int(rng.integers(0, len(data)))] ^= 1 << int(rng.integers(0, 8))
            f.write_bytes(bytes(data))
        with pytest.raises(predictor.CorruptCheckpointError, match=str(f)):
            predictor.load(path)
        caught += 1
        f.write_bytes(saved)
    record("predictor checkpoint bit-flipped or truncated", injected=25, detected=caught)
    predictor.load(path)  # restored: loads again
