"""Offline training of the predictor on access logs (``cacheflow train``).

Modules: `training.main` (the command line), `training.config` (the settings), `training.data`
(access logs -> examples), `training.optim` (the Optax loop), `training.selection` (serving
settings chosen on the validation slice), `training.evaluation` (the MLP and the baselines on
the held-out tails), `training.outputs` (checkpoint, metrics.json, loss.png) and
`training.train` (`run`, the pipeline, which re-exports the public names of the others).
"""
