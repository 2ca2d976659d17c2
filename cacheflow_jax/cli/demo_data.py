"""What the demo serves: its model checkpoint (built once, reused, copied per row) and its text."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np

from cacheflow_jax.cli.demo_model import MoEConfig, build
from cacheflow_jax.cli.demo_settings import DemoError
from cacheflow_jax.store.open import open_store

DEMO_FORMAT = 2


# --------------------------------------------------------------------------------------------
# The checkpoint


def prepare_checkpoint(config: MoEConfig, workdir: Path, *, seed: int) -> tuple[Path, bool]:
    """Returns the step directory of the demo checkpoint, building it unless a valid one exists.

    Args:
      config: the model size.
      workdir: the directory that holds demo checkpoints (one sub-directory per size and seed).
      seed: the weights' seed.

    Returns:
      ``(step directory, whether it was built now)``.

    Raises:
      DemoError: ``workdir`` exists and is not a directory.
    """
    import orbax.checkpoint as ocp

    if workdir.exists() and not workdir.is_dir():
        raise DemoError(f"--workdir {workdir} is a file, not a directory")
    model_dir = workdir / f"{config.name()}-s{seed}"
    manifest = model_dir / "demo.json"
    want = {"format": DEMO_FORMAT, "config": dataclasses.asdict(config), "seed": seed}
    step_dir = model_dir / "ckpt" / "0"
    if _valid(manifest, want, step_dir, config):
        return step_dir, False
    if model_dir.exists():
        shutil.rmtree(model_dir)  # an incomplete or stale build of exactly this configuration
    model_dir.mkdir(parents=True)
    weights = build(config, seed=seed)
    with ocp.CheckpointManager(model_dir / "ckpt") as manager:
        manager.save(0, args=ocp.args.StandardSave(weights))
        manager.wait_until_finished()
    del weights
    manifest.write_text(json.dumps({**want, "step_dir": "ckpt/0"}, indent=1))
    return step_dir, True


def _valid(manifest: Path, want: dict, step_dir: Path, config: MoEConfig) -> bool:
    """True if ``manifest`` describes ``want`` and the checkpoint opens with every array."""
    try:
        have = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    if {k: have.get(k) for k in want} != want:
        return False
    try:
        store = open_store(step_dir)
    except (OSError, ValueError):
        return False
    return len(store.arrays()) == 1 + config.layers * (2 + config.experts)


def drop_page_cache(root: Path) -> None:
    """Flushes and drops the page cache of every file under ``root`` (no root needed)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def row_copy(step_dir: Path, dst: Path) -> Path:
    """A copy of the checkpoint's files for one row (kept while it matches, else made again)."""
    want = sorted(
        (str(f.relative_to(step_dir)), f.stat().st_size) for f in step_dir.rglob("*") if f.is_file()
    )
    if dst.is_dir():
        have = sorted(
            (str(f.relative_to(dst)), f.stat().st_size) for f in dst.rglob("*") if f.is_file()
        )
        if have == want:
            return dst
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(step_dir, dst)
    return dst


# --------------------------------------------------------------------------------------------
# The text


def demo_text() -> bytes:
    """The text the demo serves: Python's help topics (`pydoc_data.topics`) as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


def text_steps(text: bytes, *, start: int, end: int, steps: int, tokens: int) -> np.ndarray:
    """``steps`` consecutive windows of ``tokens`` bytes of ``text[start:end]`` (wrapping around).

    Returns:
      ``(steps, tokens)`` int32 byte values.

    Raises:
      DemoError: the part is shorter than one step.
    """
    part = np.frombuffer(text[start:end], np.uint8)
    if len(part) < tokens:
        raise DemoError(f"--tokens {tokens} is longer than the text part ({len(part)} bytes)")
    idx = (np.arange(steps * tokens) % (len(part) - len(part) % tokens)).reshape(steps, tokens)
    return part[idx].astype(np.int32)
