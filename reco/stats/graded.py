"""Served top-k lists graded by a known click probability (data with a planted click model).

Logged NDCG counts an item relevant when it was shown *and* clicked, so a list of popular items scores
well whether or not users would click them more. With the true P(click) of every candidate known, a
list is graded by what it would earn:

- **expected clicks@k** = Σ over the k served items of their true P(click);
- **oracle NDCG@k** = DCG@k with gain = true P(click) (discount 1 / log2(rank + 1)) over the ideal
  DCG@k among the same request's candidates (the oracle's own list scores 1).

Every request has a positive gain, so none scores 0 by construction (logged NDCG gives 0 to every
request without a clicked candidate). Intervals as reco.stats.topk: bootstrap over requests, paired
against the baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reco.stats import CONF, Estimate
from reco.stats.topk import mean_ci, paired_relative_delta


def discounts(k: int) -> np.ndarray:
    """[k] DCG's rank discounts 1 / log2(rank + 1), rank 1..k."""
    return 1 / np.log2(np.arange(2, k + 2))


def graded_per_request(top_gain: np.ndarray, cand_gain: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Expected clicks and oracle NDCG of each request's served list.

    Args:
        top_gain: [U, k] true P(click) of the served items, best first (0 where a short list is padded).
        cand_gain: per request, the true P(click) of all its candidates (the ideal list's pool).
    Returns:
        {"clicks": [U], "ndcg": [U]}; ndcg in [0, 1].
    """
    k = top_gain.shape[1]
    d = discounts(k)
    ideal = np.array([np.sort(g)[::-1][:k] @ d[: min(k, len(g))] for g in cand_gain])
    dcg = top_gain @ d
    # a request without candidates (ideal 0) serves nothing: 0, not a division by zero
    ndcg = np.divide(dcg, ideal, out=np.zeros_like(dcg), where=ideal > 0)
    return {"clicks": top_gain.sum(axis=1), "ndcg": ndcg}


@dataclass(frozen=True)
class GradedQuality:
    """One ranking's served top-k graded by the true P(click); Δ relative to the baseline's, paired over
    the same requests (None for the baseline itself)."""

    k: int
    clicks: Estimate  # expected clicks of the top-k, mean over requests
    ndcg: Estimate  # oracle-graded NDCG@k
    clicks_delta: Estimate | None = None
    ndcg_delta: Estimate | None = None


def graded_quality(
    top_gain: np.ndarray, cand_gain: Sequence[np.ndarray], base_gain: np.ndarray | None, seed: int = 0
) -> GradedQuality:
    """The figures of GradedQuality; `base_gain`: the baseline's [U, k] gains for the same requests."""
    k = top_gain.shape[1]
    x = graded_per_request(top_gain, cand_gain)
    q = GradedQuality(k, mean_ci(x["clicks"], seed), mean_ci(x["ndcg"], seed))
    if base_gain is None:
        return q
    b = graded_per_request(base_gain, cand_gain)
    return GradedQuality(
        k,
        q.clicks,
        q.ndcg,
        clicks_delta(x["clicks"], b["clicks"], k, seed),
        paired_relative_delta(x["ndcg"], b["ndcg"], seed),
    )


def clicks_delta(x: np.ndarray, base: np.ndarray, k: int, seed: int = 0, conf: float = CONF) -> Estimate:
    """Δexpected clicks@k relative to the baseline's: per-request expected clicks `x` and `base` over the
    same requests (graded_per_request), with a paired bootstrap CI at `conf` (the gate's, or a look's)."""
    # a request's expected clicks differ by at most k (k items, each P <= 1)
    return paired_relative_delta(x, base, seed, conf=conf, bound=float(k))
