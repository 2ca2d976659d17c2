"""Saving and loading the MLP predictor with orbax.

A checkpoint is one orbax composite directory with two items: ``params`` (the model's parameters,
``StandardSave``) and ``meta`` (JSON: the format version, the feature config, the feature names,
the hidden width, and whatever the trainer adds, such as its metrics). Loading checks the version
and the feature names before touching the parameters, so an old or foreign checkpoint is a clear
`CheckpointError` and the caller can fall back to a baseline.

Integrity. Orbax's array chunks carry no checksum, so a flipped bit would silently change the
predictions. `save` therefore writes ``integrity.json`` beside the two items: the SHA-256 and size
of every file of the checkpoint. `load` and `read_meta` check it first; any difference (a file
changed, truncated, missing, or added) is a `CorruptCheckpointError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from flax import nnx

from predictor._features import FEATURES, FeatureConfig
from predictor._model import MLPPredictor, ScoreMLP

FORMAT_VERSION = 1

_FIX = (
    "retrain it with `cacheflow train LOG --out DIR`, or fall back to a baseline "
    "(predictor.markov(), predictor.last_successor())"
)


class CheckpointError(ValueError):
    """A predictor checkpoint is missing, from another format version, or unreadable."""


class CorruptCheckpointError(CheckpointError):
    """A predictor checkpoint exists but its files are damaged (they fail the integrity check)."""


INTEGRITY_FILE = "integrity.json"


def _digests(path: Path) -> dict[str, dict[str, Any]]:
    """SHA-256 and size of every file under ``path`` but the integrity file itself."""
    out = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix()
        if rel == INTEGRITY_FILE:
            continue
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(chunk)
        out[rel] = {"size": file.stat().st_size, "sha256": digest.hexdigest()}
    return out


def verify(path: str | os.PathLike) -> None:
    """Checks every file of the checkpoint at ``path`` against its ``integrity.json``.

    Raises:
      CheckpointError: no checkpoint there.
      CorruptCheckpointError: the integrity file is missing or damaged, or a file differs from
        it (the message names the file).
    """
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise CheckpointError(f"no predictor checkpoint at {path} (no such directory); {_FIX}")
    record = path / INTEGRITY_FILE
    try:
        want = json.loads(record.read_text())["files"]
        if not isinstance(want, dict):
            raise TypeError("'files' is not an object")
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"predictor checkpoint {path} has no {INTEGRITY_FILE}, so its bytes cannot be "
            f"checked (saved by an older version, or damaged); {_FIX}"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{record} is damaged ({e}); {_FIX}") from None
    have = _digests(path)
    for rel in sorted(set(want) | set(have)):
        if rel not in have:
            raise CorruptCheckpointError(
                f"predictor checkpoint file {path / rel} is missing; {_FIX}"
            )
        if rel not in want:
            raise CorruptCheckpointError(
                f"predictor checkpoint {path} holds {path / rel}, which it was not saved with; "
                f"{_FIX}"
            )
        if have[rel] != want[rel]:
            raise CorruptCheckpointError(
                f"predictor checkpoint file {path / rel} is damaged: its size or SHA-256 differs "
                f"from the one recorded when it was saved; {_FIX}"
            )


def save(path: str | os.PathLike, predictor: MLPPredictor, *, extra: dict | None = None) -> Path:
    """Writes ``predictor``'s model and feature config as an orbax checkpoint at ``path``.

    Args:
      path: the checkpoint directory (replaced if it exists).
      predictor: the predictor to save.
      extra: more JSON-able metadata stored under ``meta["extra"]`` (e.g. training metrics).

    Returns:
      The absolute checkpoint path.
    """
    path = Path(path).expanduser().resolve()
    meta = {
        "format_version": FORMAT_VERSION,
        "features": list(FEATURES),
        "feature_config": predictor.config.to_json(),
        "hidden": predictor.hidden,
        "min_score": predictor.min_score,
        "hedge": predictor.hedge,
        "extra": extra or {},
    }
    params = nnx.to_pure_dict(nnx.state(predictor.model()))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(
            path,
            ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
    record = {"algorithm": "sha256", "files": _digests(path)}
    tmp = path / f".{INTEGRITY_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path / INTEGRITY_FILE)
    return path


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of the checkpoint at ``path``, checked for the format version.

    Raises:
      CheckpointError: no checkpoint there, no readable metadata, or another format version.
      CorruptCheckpointError: the checkpoint's files fail their integrity check.
    """
    path = Path(path).expanduser().resolve()
    meta_file = path / "meta" / "metadata"
    if not path.is_dir():
        raise CheckpointError(f"no predictor checkpoint at {path} (no such directory); {_FIX}")
    if not meta_file.is_file() and not (path / INTEGRITY_FILE).is_file():
        raise CheckpointError(
            f"{path} is not a predictor checkpoint: {meta_file} is missing; {_FIX}"
        )
    verify(path)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            meta = ckptr.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax raises many types for a damaged file
        raise CorruptCheckpointError(
            f"cannot read the metadata of {meta_file} ({type(e).__name__}: {e}); {_FIX}"
        ) from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file} holds {type(meta).__name__}, not a dict; {_FIX}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"predictor checkpoint {path} has format version {version!r}, this code reads "
            f"version {FORMAT_VERSION}; {_FIX}"
        )
    if meta.get("features") != list(FEATURES):
        raise CheckpointError(
            f"predictor checkpoint {path} was trained on features {meta.get('features')}, this "
            f"code computes {list(FEATURES)}; {_FIX}"
        )
    return meta


def load(
    path: str | os.PathLike, *, min_score: float | None = None, hedge: int | None = None
) -> MLPPredictor:
    """Loads an `MLPPredictor` saved by `save`.

    Args:
      path: the checkpoint directory.
      min_score: override the saved lowest probability of a confident proposal.
      hedge: override the saved number of hedged successor proposals.

    Returns:
      The predictor, with fresh stream statistics.

    Raises:
      CheckpointError: the checkpoint is missing or of another version (the message names the
        path and what to do).
      CorruptCheckpointError: its files are damaged (a `CheckpointError` too).
    """
    path = Path(path).expanduser().resolve()
    meta = read_meta(path)
    try:
        config = FeatureConfig.from_json(meta["feature_config"])
        hidden = int(meta["hidden"])
        abstract = nnx.eval_shape(lambda: ScoreMLP(len(FEATURES), hidden=hidden, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        target = nnx.to_pure_dict(state)
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            restored = ckptr.restore(
                path, ocp.args.Composite(params=ocp.args.StandardRestore(target))
            )["params"]
        nnx.replace_by_pure_dict(state, restored)
        model = nnx.merge(graphdef, state)
    except CheckpointError:
        raise
    except Exception as e:  # orbax/tensorstore raise many types for a damaged directory
        raise CorruptCheckpointError(
            f"predictor checkpoint {path} is corrupted or incomplete ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:300]}); {_FIX}"
        ) from e
    try:
        score = float(meta.get("min_score", 0.0) if min_score is None else min_score)
        hedged = int(meta.get("hedge", 0) if hedge is None else hedge)
        return MLPPredictor(model, config, min_score=score, hedge=hedged)
    except Exception as e:
        raise CorruptCheckpointError(
            f"predictor checkpoint {path} has unusable settings ({type(e).__name__}: {e}); {_FIX}"
        ) from e
