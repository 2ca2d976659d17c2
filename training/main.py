"""``python -m training.main LOG... --out DIR``: train the predictor MLP (thin; see train.py).

Same options as ``cacheflow train``, which runs this script. Prints a table of the evaluation,
or with ``--json`` ``{"eval": {"mlp": {"precision", "recall"}, "last_successor": ...,
"markov": ..., "stride": ...}, "selected": {"min_score", "hedge", "source"}, "train_seconds",
"predict_us", "outputs", ...}``. Bad input prints one line and exits with status 2, before any
work; Ctrl-C prints ``cacheflow train: interrupted`` and exits with 130.
"""

from __future__ import annotations

import _thread
import argparse
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

_NAMES = ("mlp", "last_successor", "markov", "stride")
_PROG = "cacheflow train"
DESCRIPTION = (
    "Train the predictor MLP (Flax NNX, Optax AdamW with warm-up and cosine decay) on access "
    "logs. Each log is split by time: the model is fit on the head, its serving settings "
    "(min_score, hedge) are chosen on a validation slice, and it is evaluated, with the "
    "last-successor, Markov and stride baselines, on the held-out tail. Writes OUT/checkpoint "
    "(orbax), OUT/metrics.json and OUT/loss.png. See docs/predictor.md."
)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (no usage dump), exit status 2, as the rest of ``cacheflow``."""

    def error(self, message: str) -> NoReturn:
        """Prints ``cacheflow train: error: <message> (see cacheflow train --help)``, exits 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the training options (shared with ``cacheflow train``) to ``p``."""
    from training.config import TrainConfig

    d = TrainConfig
    p.add_argument("logs", nargs="+", metavar="LOG", help="access logs (v1 or Mooncake JSONL)")
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output directory: checkpoint/, metrics.json, loss.png",
    )
    p.add_argument(
        "--history",
        type=int,
        default=d.history,
        metavar="K",
        help=f"keys of context whose successors are candidates (default {d.history})",
    )
    p.add_argument(
        "--lookahead",
        type=int,
        default=d.lookahead,
        metavar="W",
        help=f"prediction window in accesses (default {d.lookahead})",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=d.top_k,
        metavar="K",
        help=f"keys proposed per access in the evaluation (default {d.top_k})",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=d.epochs,
        metavar="N",
        help=f"passes over the training examples (default {d.epochs})",
    )
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=d.eval_fraction,
        metavar="F",
        help=f"held-out tail of each log, by time (default {d.eval_fraction})",
    )
    p.add_argument(
        "--eval-log",
        action="append",
        default=[],
        metavar="LOG",
        help="also evaluate the trained model, unchanged, on LOG's tail (repeatable)",
    )
    p.add_argument("--seed", type=int, default=d.seed, metavar="S", help="seed (default 0)")
    grid_m = ", ".join(map(str, d.min_score_grid))
    grid_h = ", ".join(map(str, d.hedge_grid))
    p.add_argument(
        "--min-score",
        type=float,
        default=None,
        metavar="P",
        help="lowest probability of a confident proposal (default: chosen from "
        f"{{{grid_m}}} on the validation slice, the last {d.val_fraction:g} of the training "
        "part; see docs/predictor.md)",
    )
    p.add_argument(
        "--hedge",
        type=int,
        default=None,
        metavar="N",
        help=f"successor proposals added below --min-score (default: chosen from {{{grid_h}}} "
        "on the validation slice)",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def config_from_args(args: argparse.Namespace) -> Any:
    """The `training.config.TrainConfig` the parsed options ask for.

    Raises:
      ValueError: a setting out of range.
    """
    from training.config import config

    return config(
        args.logs,
        args.out,
        eval_logs=args.eval_log,
        history=args.history,
        lookahead=args.lookahead,
        top_k=args.top_k,
        epochs=args.epochs,
        eval_fraction=args.eval_fraction,
        seed=args.seed,
        min_score=args.min_score,
        hedge=args.hedge,
        progress=not args.no_progress,
    )


def format_metrics(metrics: dict[str, Any]) -> str:
    """The evaluation as a table: one row per predictor, a column pair per evaluated set."""
    sets = [("eval", metrics["eval"])] + [
        (f"cross: {p}", m) for p, m in metrics.get("cross_eval", {}).items()
    ]
    lines = []
    for title, table in sets:
        lines.append(title)
        lines.append(f"  {'predictor':<15} {'precision':>9} {'recall':>7}")
        for name in _NAMES:
            row = table[name]
            lines.append(f"  {name:<15} {row['precision']:>9.4f} {row['recall']:>7.4f}")
    sel = metrics.get("selected")
    if sel:
        lines.append(
            f"selected min_score {sel['min_score']} hedge {sel['hedge']} ({sel['source']})"
        )
    us = metrics.get("predict_us")
    outputs = metrics.get("outputs") or [metrics.get("checkpoint", "-")]
    lines.append(
        f"train_seconds {metrics['train_seconds']:.1f}, predict_us "
        f"{'-' if us is None else f'{us:.0f}'}; wrote {', '.join(outputs)}"
    )
    return "\n".join(lines)


def unraisable_hook(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """An unraisable-exception hook that raises Ctrl-C again in the main thread.

    A KeyboardInterrupt that lands in a garbage-collector callback (JAX installs one) or a
    ``__del__`` would be printed as "Exception ignored" and training would go on; this raises it
    again where ``main`` catches it (the same rule as ``cacheflow_jax.cli.interrupts_reach_main``:
    this script does not import the library's CLI).
    """

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # From another thread, a moment later: raised in this hook, it would be "ignored"
            # once more.
            threading.Timer(0.01, _thread.interrupt_main).start()
            return
        previous(unraisable)

    return hook


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the options, trains, prints the evaluation; returns the exit status."""
    previous = sys.unraisablehook
    sys.unraisablehook = unraisable_hook(previous)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`| head`): end quietly, like cat
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        return 141
    finally:
        sys.unraisablehook = previous


def _main(argv: Sequence[str] | None) -> int:
    parser = _Parser(prog=_PROG, description=DESCRIPTION)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    from training.train import run

    try:
        metrics = run(config_from_args(args), log=lambda line: print(line, file=sys.stderr))
    except (ValueError, OSError) as err:  # bad input: one line, status 2
        print(f"{_PROG}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, indent=1) if args.json else format_metrics(metrics))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
