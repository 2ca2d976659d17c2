"""What ``cacheflow demo`` can be told (`DemoSettings`), and the error its settings raise."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from cacheflow_jax.cli.demo_model import MoEConfig

MiB = 2**20


class DemoError(ValueError):
    """The demo's settings are invalid, or a step of it failed; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """Everything ``cacheflow demo`` can be told.

    Attributes:
      workdir: where the model checkpoint and the run's files live (default: `default_workdir`).
      requests: measured steps per pass.
      warmup: unmeasured steps before each pass (jit compilation, first reads).
      record: warm-up steps whose access log trains the MLP and primes the predictors.
      seed: seeds the model weights.
      layers: MoE layers.
      experts: experts per layer.
      expert_mb: MiB per expert (both matrices); sets the expert hidden width.
      d_model: width of the residual stream.
      top_k: experts per layer per step.
      tokens: bytes of text per step.
      device_bytes: L1 budget (default: a sixth of the experts' bytes).
      host_bytes: L2 budget (default: three quarters of the experts' bytes: as in MoE offloading,
        host memory holds most experts and the device a few).
      access_log: where to write the ``cacheflow`` pass's access log, if anywhere.
      predictor: an MLP predictor checkpoint (``cacheflow train ... --out OUT`` writes
        ``OUT/checkpoint``) to serve ``cacheflow+mlp`` with instead of training one.
      plot: where to save the latency CDF (default: ``latency_cdf.png`` in the run directory).
      prefetch_k: keys asked of each predictor per prediction (default: twice ``top_k``, the
        next layer's experts and as many hedges).
      progress: show a progress bar on stderr.
    """

    workdir: Path | None = None
    requests: int = 200
    warmup: int = 5
    record: int = 300
    seed: int = 0
    layers: int = 8
    experts: int = 8
    expert_mb: float = 2.0
    d_model: int = 512
    top_k: int = 2
    tokens: int = 64
    device_bytes: int | None = None
    host_bytes: int | None = None
    access_log: Path | None = None
    predictor: Path | None = None
    plot: Path | None = None
    prefetch_k: int | None = None
    progress: bool = True

    def model_config(self) -> MoEConfig:
        """The model size these settings ask for.

        Raises:
          DemoError: a size is out of range.
        """
        for name in ("requests", "record", "layers", "experts", "d_model", "top_k", "tokens"):
            if getattr(self, name) < 1:
                raise DemoError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.warmup < 0:
            raise DemoError(f"--warmup must be >= 0, got {self.warmup}")
        if self.top_k > self.experts:
            raise DemoError(f"--top-k {self.top_k} is more than --experts {self.experts}")
        if self.prefetch_k is not None and self.prefetch_k < 1:
            raise DemoError(f"--prefetch-k must be at least 1, got {self.prefetch_k}")
        if not self.expert_mb > 0:
            raise DemoError(f"--expert-mb must be > 0, got {self.expert_mb}")
        d_ff = round(self.expert_mb * MiB / (2 * self.d_model * 4))
        if d_ff < 1:
            raise DemoError(
                f"--expert-mb {self.expert_mb} is too small for --d-model {self.d_model}: an "
                "expert needs at least one hidden unit"
            )
        return MoEConfig(layers=self.layers, experts=self.experts, d_model=self.d_model, d_ff=d_ff)


def default_workdir() -> Path:
    """``$XDG_CACHE_HOME/cacheflow-jax/demo``, else ``~/.cache/cacheflow-jax/demo``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cacheflow-jax" / "demo"
