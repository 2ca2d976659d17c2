"""Next-key predictors for the prefetcher: the `Predictor` protocol, baselines, the Flax MLP.

The cache talks to predictors only through the `Predictor` protocol
(``cacheflow_jax.TieredCache(prefetcher=...)`` takes one): ``observe(access)``,
``predict(k) -> [(key, score)]``, ``reset()``.

* baselines: `last_successor()`, `markov(decay=...)`, `stride()`;
* the learned predictor: `mlp(model, config)` / `load(path)` give an `MLPPredictor`, which scores
  key-agnostic candidate features (`FeatureConfig`, `FEATURES`) with a `ScoreMLP`;
* `save` / `load` write and read it with orbax; a bad checkpoint is a `CheckpointError`;
* `prediction_metrics` / `run_predictor`: precision and recall as in docs/predictor.md.

>>> import predictor
>>> p = predictor.markov()
>>> for key in ["kv:1", "kv:2", "kv:1"]:
...     p.observe({"key": key, "t": 0.0, "nbytes": 1, "kind": "kv"})
>>> p.predict(2)
[('kv:2', 1.0)]
"""

from predictor._baselines import (
    BASELINES,
    LastSuccessor,
    Markov,
    Stride,
    join_index,
    last_successor,
    markov,
    split_index,
    stride,
)
from predictor._checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    CorruptCheckpointError,
    load,
    read_meta,
    save,
    verify,
)
from predictor._features import FEATURES, NUM_FEATURES, FeatureConfig, FeatureState
from predictor._metrics import Metrics, prediction_metrics, run_predictor
from predictor._model import (
    MLPPredictor,
    ScoreMLP,
    choose,
    last_successor_index,
    mlp,
    score_candidates,
    successor_mask,
)
from predictor._protocol import Access, Predictor, as_access

__all__ = [
    "BASELINES",
    "FEATURES",
    "FORMAT_VERSION",
    "NUM_FEATURES",
    "Access",
    "CheckpointError",
    "CorruptCheckpointError",
    "FeatureConfig",
    "FeatureState",
    "LastSuccessor",
    "MLPPredictor",
    "Markov",
    "Metrics",
    "Predictor",
    "ScoreMLP",
    "Stride",
    "as_access",
    "choose",
    "join_index",
    "last_successor",
    "last_successor_index",
    "load",
    "markov",
    "mlp",
    "prediction_metrics",
    "read_meta",
    "run_predictor",
    "save",
    "score_candidates",
    "split_index",
    "stride",
    "verify",
    "successor_mask",
]
