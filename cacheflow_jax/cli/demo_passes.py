"""The demo's passes: the model as they serve it, and a row's serving, a segment at a time."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from cacheflow_jax.cli.demo_model import MoEConfig, embed, experts_layer, route
from cacheflow_jax.orbax import LazyArray, restore_lazy

if TYPE_CHECKING:
    from cacheflow_jax.cache.tiered import TieredCache


@dataclasses.dataclass
class DemoModel:
    """What every pass serves: the dense weights on the device and each expert's leaf.

    Attributes:
      config: the model size.
      step_dir: the checkpoint.
      table: the byte embedding, on the device.
      norms: each layer's norm scale, on the device.
      routers: each layer's router, on the device.
      experts: ``experts[l][e]``: expert ``e`` of layer ``l`` (its block keys and `assemble`).
      expert_keys: every expert block key, layer by layer.
      largest: the largest expert block, in bytes.
    """

    config: MoEConfig
    step_dir: Path
    table: jax.Array
    norms: list[jax.Array]
    routers: list[jax.Array]
    experts: list[list[LazyArray]]
    expert_keys: list[str]
    largest: int


def open_model(step_dir: Path, config: MoEConfig) -> DemoModel:
    """Opens the checkpoint lazily and puts the dense weights on the device."""
    # A cache only for this: the dense leaves are read through it; the passes use their own.
    tree = restore_lazy(step_dir, device_bytes=config.weight_bytes, host_bytes=0)
    layers = [tree["layers"][str(i)] for i in range(config.layers)]
    experts = [[node["experts"][str(e)]["w"] for e in range(config.experts)] for node in layers]
    keys = [k for row in experts for leaf in row for k in leaf.keys]
    cache = tree["embed"]["embedding"].cache
    largest = max(cache.info(k).nbytes for k in keys)

    def dense(leaf: LazyArray) -> jax.Array:
        return jax.device_put(np.asarray(leaf))

    return DemoModel(
        config=config,
        step_dir=step_dir,
        table=dense(tree["embed"]["embedding"]),
        norms=[dense(node["norm"]["scale"]) for node in layers],
        routers=[dense(node["router"]) for node in layers],
        experts=experts,
        expert_keys=keys,
        largest=largest,
    )


@dataclasses.dataclass
class PassResult:
    """One pass: the measured steps' latencies (s), a digest of every step's output, the routes."""

    latencies: list[float]
    digest: str
    routes: np.ndarray  # (steps, layers, top_k) int32


class ServedPass:
    """One row's serving, a segment of steps at a time: per layer, route, ``fetch`` the routed
    experts, compute. The demo runs its rows' segments in turn (`SEGMENT`), so that a slow spell
    of the machine falls on every row alike.

    Args:
      model: the model.
      tokens: one device array of byte tokens per step.
      fetch: returns the blocks of the given keys on the device, in order.
      warmup: leading steps that are not measured.
      top_k: experts per layer and step.
      on_measure: called once, before the first measured step.
      tick: called after each step.
    """

    def __init__(
        self,
        model: DemoModel,
        tokens: Sequence[jax.Array],
        fetch: Callable[[list[str]], list[jax.Array]],
        *,
        warmup: int,
        top_k: int,
        on_measure: Callable[[], None] = lambda: None,
        tick: Callable[[], None] = lambda: None,
    ) -> None:
        self.model, self.tokens, self.fetch = model, tokens, fetch
        self.warmup, self.top_k = warmup, top_k
        self.on_measure, self.tick = on_measure, tick
        self.latencies: list[float] = []
        self.routes = np.empty((len(tokens), model.config.layers, top_k), np.int32)
        self.next = 0  # the next step to serve
        self.active = 0.0  # seconds spent serving so far (the pass's own clock)
        self._since: float | None = None  # when the running segment started
        self._digest = hashlib.blake2b(digest_size=16)

    @property
    def done(self) -> bool:
        return self.next >= len(self.tokens)

    def elapsed(self) -> float:
        """Seconds this pass has been serving: its cache's clock, which stands still while the
        other rows run (the predictors' time features see one stream)."""
        since = self._since
        return self.active + (0.0 if since is None else time.monotonic() - since)

    def run(self, steps: int) -> None:
        """Serves the next ``steps`` steps (fewer at the end)."""
        model, top_k, fetch = self.model, self.top_k, self.fetch
        layers = list(zip(model.norms, model.routers, model.experts))
        self._since = time.monotonic()
        try:
            for i in range(self.next, min(self.next + steps, len(self.tokens))):
                if i == self.warmup:
                    self.on_measure()
                t0 = time.perf_counter()
                x = embed(model.table, self.tokens[i])
                for j, (norm, router, experts) in enumerate(layers):
                    h, selected, gates = route(x, norm, router, top_k=top_k)
                    ids = np.asarray(selected)  # waits for the layer before: routing needs it
                    leaves = [experts[e] for e in ids]
                    blocks = iter(fetch([k for leaf in leaves for k in leaf.keys]))
                    w = tuple(leaf.assemble([next(blocks) for _ in leaf.keys]) for leaf in leaves)
                    x = experts_layer(x, h, gates, w)
                    self.routes[i, j] = ids
                x.block_until_ready()
                if i >= self.warmup:
                    self.latencies.append(time.perf_counter() - t0)
                self._digest.update(np.asarray(x).tobytes())
                self.next = i + 1
                self.tick()
        finally:
            self.active += time.monotonic() - self._since
            self._since = None

    def result(self) -> PassResult:
        """The measured steps' latencies, the outputs' digest and the routes."""
        return PassResult(self.latencies, self._digest.hexdigest(), self.routes)


def serve_pass(
    model: DemoModel,
    tokens: Sequence[jax.Array],
    fetch: Callable[[list[str]], list[jax.Array]],
    **options: Any,
) -> PassResult:
    """Serves every step of ``tokens`` in one go; ``options`` are `ServedPass`'s keywords
    (``warmup`` and ``top_k`` required). Only the measured steps' latencies are kept."""
    served = ServedPass(model, tokens, fetch, **options)
    served.run(len(tokens))
    return served.result()


def quiet(cache: TieredCache, timeout: float = 1.0) -> None:
    """Waits (up to ``timeout`` s) until the cache's prefetch work is settled, so that it does
    not run into the next row's turn."""
    end = time.monotonic() + timeout
    while not cache.prefetch_settled() and time.monotonic() < end:
        time.sleep(0.0005)
