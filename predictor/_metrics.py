"""Prediction metrics: precision and recall of top-k predictions within a lookahead window.

Definitions (docs/predictor.md): a stream of accesses ``key[0..N)`` is split at ``start``. At each
evaluated position ``i >= start``, after observing ``key[i]``, a predictor gives its top-k keys
``P[i]`` (distinct). A prediction is *correct* if its key is in ``key[i+1 .. i+W]`` (the window is
cut at the end of the stream).

* ``precision`` = correct predictions / predictions made (0 when none were made);
* ``recall`` = among evaluated accesses ``j >= start`` whose key was seen anywhere earlier in the
  stream (``key[j] in key[0..j)``), the share with ``key[j] in P[i]`` for some evaluated ``i`` in
  ``[j-W, j-1]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypedDict

from predictor._protocol import Access, Predictor


class Metrics(TypedDict):
    """What `prediction_metrics` returns."""

    precision: float
    recall: float
    predictions: int  # predictions made
    correct: int  # of which correct
    positions: int  # evaluated positions
    seen_accesses: int  # evaluated accesses to keys seen earlier (recall's denominator)
    predicted_accesses: int  # of which predicted in time (recall's numerator)


def prediction_metrics(
    keys: Sequence[str],
    predictions: Sequence[Iterable[str]],
    *,
    start: int,
    lookahead: int,
) -> Metrics:
    """Precision and recall of ``predictions[i - start]`` made after ``keys[i]``, ``i >= start``.

    Args:
      keys: the whole stream of keys, training part included.
      predictions: one collection of predicted keys per evaluated position ``start..len(keys)``.
      start: the first evaluated position.
      lookahead: W, how many later accesses a prediction may be used by.

    Returns:
      A `Metrics` dict.

    Raises:
      ValueError: ``predictions`` has the wrong length, or ``start``/``lookahead`` is out of range.

    >>> m = prediction_metrics(["a", "b", "a", "b"], [["a"], ["b"], ["c"]], start=1, lookahead=1)
    >>> m["precision"], m["recall"]
    (0.6666666666666666, 1.0)
    """
    n = len(keys)
    if not 0 <= start <= n:
        raise ValueError(f"start={start} must be in [0, {n}] (the stream has {n} accesses)")
    if lookahead < 1:
        raise ValueError(f"lookahead={lookahead} must be >= 1")
    if len(predictions) != n - start:
        raise ValueError(
            f"got {len(predictions)} prediction lists for {n - start} evaluated positions "
            f"({start}..{n}); give one list per position"
        )
    sets = [frozenset(p) for p in predictions]
    made = correct = 0
    for i, pred in enumerate(sets, start):
        if not pred:
            continue
        made += len(pred)
        window = set(keys[i + 1 : i + 1 + lookahead])
        correct += len(pred & window)
    seen = set(keys[:start])
    events = hits = 0
    for j in range(start, n):
        key = keys[j]
        if key in seen:
            events += 1
            lo = max(start, j - lookahead)
            if any(key in sets[i - start] for i in range(lo, j)):
                hits += 1
        else:
            seen.add(key)
    return Metrics(
        precision=correct / made if made else 0.0,
        recall=hits / events if events else 0.0,
        predictions=made,
        correct=correct,
        positions=n - start,
        seen_accesses=events,
        predicted_accesses=hits,
    )


def run_predictor(
    predictor: Predictor, accesses: Sequence[Access], *, start: int, top_k: int
) -> list[list[str]]:
    """Feeds every access to ``predictor`` and collects its top-k keys from ``start`` on.

    Args:
      predictor: any `Predictor`, usually fresh (it is not reset).
      accesses: the whole stream.
      start: the first position whose prediction is collected.
      top_k: keys asked for at each position.

    Returns:
      One list of predicted keys per position ``start..len(accesses)``.
    """
    out: list[list[str]] = []
    observe, predict = predictor.observe, predictor.predict
    for i, access in enumerate(accesses):
        observe(access)
        if i >= start:
            out.append([key for key, _ in predict(top_k)])
    return out
