"""The quality of served top-k lists, per user, and intervals over users.

- **NDCG@k and recall@k** against each user's relevant items come from ir-measures (the TREC
  evaluation tool's measures through pytrec_eval), not from formulas of our own: binary relevance,
  one query per user.
- **Agreement with the baseline's list** for the same request: overlap@k = |A ∩ B| / k, and rank-biased
  overlap (Webber, Moffat & Zobel 2010, "A similarity measure for indefinite rankings", eq. 7 truncated
  at depth k: RBO@k = (1 - p) Σ_{d=1..k} p^(d-1) |A_:d ∩ B_:d| / d). Truncated, it is a lower bound of the
  full RBO that two identical lists of length k reach at 1 - p^k, so it is reported normalised by that
  (identical lists: 1.0). Neither is in ir-measures; both are a few lines.
- **Intervals**: users are independent draws (each appears once), so a figure's mean over users gets a
  percentile bootstrap CI over users (Efron & Tibshirani 1993, ch. 13), and a difference against the
  baseline a *paired* bootstrap (the same users resampled for both), which cancels the users' own spread.
  Coverage checked by simulation in tests/test_topk_quality.py.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import ir_measures
import numpy as np

from reco.stats import CONF, Estimate

MIN_DISCORDANT = 20  # users whose figures differ, below which a paired bootstrap is not trusted
B = 2000  # bootstrap resamples: the 2.5 % / 97.5 % points move by < 1 % of the CI's width beyond this


def _content_key(arrays: Sequence[np.ndarray]) -> bytes:
    """A digest of the arrays' shapes, types and values: a memo key that cannot confuse two inputs."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.view(np.uint8).ravel())
    return h.digest()


_IR_MEMO: dict[tuple[bytes, bytes, int], dict[str, np.ndarray]] = {}


def ir_per_user(topk: np.ndarray, relevant: Sequence[np.ndarray], k: int) -> dict[str, np.ndarray]:
    """NDCG@k and recall@k of each user's list (ir-measures).

    Every variant is compared with the same baseline lists, whose figures (1 s at 12,000 users) are
    therefore kept for the last few inputs, by content.

    Args:
        topk: [U, k] item ids, best first; -1 pads a list shorter than k.
        relevant: per user, the item ids that count as relevant (at least one each).
    Returns:
        {"ndcg": [U], "recall": [U]} in [0, 1].
    """
    key = (_content_key([topk]), _content_key(relevant), k)
    if key not in _IR_MEMO:
        if len(_IR_MEMO) >= 4:
            del _IR_MEMO[next(iter(_IR_MEMO))]
        _IR_MEMO[key] = _ir_per_user(topk, relevant, k)
    return {m: v.copy() for m, v in _IR_MEMO[key].items()}


def _ir_per_user(topk: np.ndarray, relevant: Sequence[np.ndarray], k: int) -> dict[str, np.ndarray]:
    qrels = [
        ir_measures.Qrel(str(u), str(int(i)), 1) for u, items in enumerate(relevant) for i in np.unique(items)
    ]
    run = [
        ir_measures.ScoredDoc(str(u), str(int(i)), float(k - r))
        for u, row in enumerate(topk)
        for r, i in enumerate(row)
        if i >= 0
    ]
    ndcg, recall = ir_measures.nDCG @ k, ir_measures.R @ k
    out = {"ndcg": np.zeros(len(topk)), "recall": np.zeros(len(topk))}
    for m in ir_measures.iter_calc([ndcg, recall], qrels, run):
        out["ndcg" if m.measure == ndcg else "recall"][int(m.query_id)] = m.value
    return out  # a user whose list holds no relevant item is absent from iter_calc's output: 0


def overlap_at_k(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|A ∩ B| / k per row of two [U, k] lists (-1 padding never matches)."""
    k = a.shape[1]
    return np.array(
        [len(set(x[x >= 0].tolist()) & set(y[y >= 0].tolist())) / k for x, y in zip(a, b, strict=True)]
    )


def rbo_at_k(a: np.ndarray, b: np.ndarray, p: float) -> np.ndarray:
    """Rank-biased overlap of each row of two [U, k] lists, truncated at k and normalised so that identical
    lists score 1 (see the module docstring)."""
    k = a.shape[1]
    w = (1 - p) * p ** np.arange(k)
    out = np.empty(len(a))
    for u, (x, y) in enumerate(zip(a, b, strict=True)):
        seen_x: set[int] = set()
        seen_y: set[int] = set()
        common, agree = 0, np.empty(k)
        for d in range(k):
            xi, yi = int(x[d]), int(y[d])
            if xi == yi and xi >= 0:
                common += 1
            else:
                common += (xi >= 0 and xi in seen_y) + (yi >= 0 and yi in seen_x)
            seen_x.add(xi)
            seen_y.add(yi)
            agree[d] = common / (d + 1)
        out[u] = float(w @ agree)
    return out / w.sum()


@functools.lru_cache(maxsize=2)
def _resample_counts(n: int, seed: int) -> np.ndarray:
    """[B, n] how often each user is drawn in each of the B resamples of `seed`: every figure of a report
    resamples the same users (that is what pairs them), so the draw is made once and each figure's
    resampled means are one matrix product, not a [B, n] gather per figure (0.35 s at 12,000 users)."""
    idx = np.random.default_rng(seed).integers(0, n, (B, n))
    idx += n * np.arange(B)[:, None]  # in place: resample r's draws count into row r
    out = np.bincount(idx.ravel(), minlength=B * n).reshape(B, n).astype(np.float64)
    out.flags.writeable = False
    return out


def resampled_means(x: np.ndarray, seed: int) -> np.ndarray:
    """[B] means of x over the bootstrap resamples of `seed` (the same users for every x of that length)."""
    return _resample_counts(len(x), seed) @ x / len(x)


def mean_ci(x: np.ndarray, seed: int = 0, conf: float = CONF) -> Estimate:
    """Mean over users with its percentile-bootstrap CI."""
    x = np.asarray(x, np.float64)
    means = resampled_means(x, seed)
    a = (1 - conf) / 2
    return Estimate(float(x.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a)), len(x))


def paired_relative_delta(
    x: np.ndarray, base: np.ndarray, seed: int = 0, conf: float = CONF, bound: float = 1.0
) -> Estimate:
    """(mean(x) - mean(base)) / mean(base) over the same users, with a paired bootstrap CI.

    The bootstrap needs users whose figure differs: with fewer than MIN_DISCORDANT of them it would
    shrink to (or to nearly) zero width -- two lists that agree for every sampled user are not shown
    to agree for every user. There the interval is the most the undetected users could move the mean:
    the Clopper-Pearson upper bound on the share of users that differ, times `bound` (the largest
    |x_i - base_i|, 1 for NDCG and recall), divided by mean(base). Not supported (value None) when
    mean(base) is 0 in the sample or in any resample: the ratio is undefined there, and dropping those
    resamples would narrow the interval.
    """
    from scipy.stats import beta

    x, base = np.asarray(x, np.float64), np.asarray(base, np.float64)
    n = len(x)
    mb = resampled_means(base, seed)
    if base.mean() <= 0 or (mb <= 0).any():
        return Estimate(None, None, None, n)
    point = float(x.mean() / base.mean() - 1)
    a = (1 - conf) / 2
    discordant = int((x != base).sum())
    if discordant < MIN_DISCORDANT:
        share = float(beta.ppf(1 - a, discordant + 1, n - discordant)) if discordant < n else 1.0
        w = share * bound / base.mean()
        return Estimate(point, point - w, point + w, n)
    rel = resampled_means(x, seed) / mb - 1
    return Estimate(point, float(np.quantile(rel, a)), float(np.quantile(rel, 1 - a)), n)


def seeded_relative_delta(x: np.ndarray, base: np.ndarray, seed: int = 0, conf: float = CONF) -> Estimate:
    """(mean(x) - mean(base)) / mean(base) of two arms trained with several seeds, graded on the same users.

    Args:
        x: [S, U] a figure per seed (a trained model) and user; base: [S', U] the other arm's, same users.
    Each bootstrap resample draws the users (paired: the same for both arms) and, independently per arm,
    its seeds with replacement, so the interval holds the training-seed spread as well as the users'. With
    one seed per arm it is the paired bootstrap over users; with 3 seeds the seed draw is coarse (10
    distinct multisets), which widens the interval rather than narrowing it.
    """
    x, base = np.atleast_2d(np.asarray(x, np.float64)), np.atleast_2d(np.asarray(base, np.float64))
    rng = np.random.default_rng(seed)
    n = x.shape[1]
    idx = rng.integers(0, n, (B, n))
    sx, sb = rng.integers(0, len(x), (B, len(x))), rng.integers(0, len(base), (B, len(base)))
    # per seed and resample: the mean over the drawn users, then averaged over the drawn seeds
    mx = np.take_along_axis(np.stack([r[idx].mean(axis=1) for r in x], axis=1), sx, axis=1).mean(axis=1)
    mb = np.take_along_axis(np.stack([r[idx].mean(axis=1) for r in base], axis=1), sb, axis=1).mean(axis=1)
    if base.mean() <= 0 or (mb <= 0).any():
        return Estimate(None, None, None, n)
    a = (1 - conf) / 2
    rel = mx / mb - 1
    return Estimate(
        float(x.mean() / base.mean() - 1), float(np.quantile(rel, a)), float(np.quantile(rel, 1 - a)), n
    )


@dataclass(frozen=True)
class TopKQuality:
    """One variant's served top-k over the quality requests; agreement and Δ against the baseline's
    lists (None for the baseline itself)."""

    k: int
    ndcg: Estimate
    recall: Estimate
    overlap: Estimate | None = None
    rbo: Estimate | None = None
    ndcg_delta: Estimate | None = None  # relative: (NDCG@k - the baseline's) / the baseline's, paired


def topk_quality(
    top: np.ndarray, relevant: Sequence[np.ndarray], base: np.ndarray | None, p: float, seed: int = 0
) -> TopKQuality:
    """The figures of `top` [U, k] (see TopKQuality); `base`: the baseline's lists for the same requests,
    None for the baseline. Every interval resamples the same users (same seed), so they are paired."""
    k = top.shape[1]
    ir = ir_per_user(top, relevant, k)
    q = TopKQuality(k, mean_ci(ir["ndcg"], seed), mean_ci(ir["recall"], seed))
    if base is None:
        return q
    base_ndcg = ir_per_user(base, relevant, k)["ndcg"]
    return dataclasses.replace(
        q,
        overlap=mean_ci(overlap_at_k(top, base), seed),
        rbo=mean_ci(rbo_at_k(top, base, p), seed),
        ndcg_delta=paired_relative_delta(ir["ndcg"], base_ndcg, seed),
    )
