"""Grouped AUC (GAUC): the AUC within each user, weighted by the user's impressions.

A global AUC also rewards telling users apart (an active user's rows against a quiet one's), which a
served list never does: it orders one user's candidates. GAUC = Σ_u w_u AUC_u / Σ_u w_u over users with
both a positive and a negative row, w_u = the user's rows (Zhou et al. 2018, "Deep Interest Network",
eq. 5). AUC_u is the Mann-Whitney statistic with ties averaged, computed for all users at once from one
sort. Users are the independent draws: the CI is a bootstrap over users, and the Δ against the baseline a
paired one (the same users, whose set depends on the labels only, resampled for both).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

from reco.stats import CONF, Estimate
from reco.stats.topk import B

CHUNK = 100  # resamples per block: B x users indices at once would take GBs on 100k test rows


def per_user_auc(users: np.ndarray, labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(AUC_u, w_u) of the users with both classes, in ascending user id.

    Args:
        users: [N] user ids; labels: [N] in {0, 1}; scores: [N].
    Returns:
        ([G] per-user AUC with ties averaged, [G] the user's row count).
    """
    order = np.lexsort((scores, users))
    u, y, sc = users[order], labels[order] > 0.5, scores[order]
    # ranks within (user, score) ties averaged, then made per-user by subtracting the user's start
    new_user = np.r_[True, u[1:] != u[:-1]]
    key = np.cumsum(np.r_[True, (u[1:] != u[:-1]) | (sc[1:] != sc[:-1])])
    rank = rankdata(key, method="average")
    starts = np.flatnonzero(new_user)
    n = np.diff(np.r_[starts, len(u)])
    rank -= np.repeat(starts, n)
    group = np.cumsum(new_user) - 1
    pos = np.bincount(group, weights=y, minlength=len(starts))
    rank_pos = np.bincount(group, weights=rank * y, minlength=len(starts))
    neg = n - pos
    both = (pos > 0) & (neg > 0)
    auc = (rank_pos[both] - pos[both] * (pos[both] + 1) / 2) / (pos[both] * neg[both])
    return auc, n[both].astype(np.float64)


@dataclass(frozen=True)
class GAUC:
    """A variant's GAUC on the test split; its Δ relative to the baseline's (None for the baseline)."""

    value: Estimate  # n = users with both classes
    delta: Estimate | None = None


def _weighted_means(x: np.ndarray, w: np.ndarray, seed: int) -> np.ndarray:
    """[B] Σ w x / Σ w over bootstrap resamples of the users (the same resamples for the same seed)."""
    rng = np.random.default_rng(seed)
    out = []
    for a in range(0, B, CHUNK):
        idx = rng.integers(0, len(x), (min(CHUNK, B - a), len(x)))
        out.append((x[idx] * w[idx]).sum(axis=1) / w[idx].sum(axis=1))
    return np.concatenate(out)


def gauc(
    users: np.ndarray,
    labels: np.ndarray,
    scores: np.ndarray,
    base_scores: np.ndarray | None = None,
    seed: int = 0,
    conf: float = CONF,
) -> GAUC | None:
    """GAUC with its bootstrap CI; with `base_scores` (the baseline's on the same rows) the relative Δ
    (GAUC - the baseline's) / the baseline's, paired over users. None: no user has both classes."""
    x, w = per_user_auc(users, labels, scores)
    if not len(x):
        return None
    a = (1 - conf) / 2
    point = float(x @ w / w.sum())
    boot = _weighted_means(x, w, seed)
    value = Estimate(point, float(np.quantile(boot, a)), float(np.quantile(boot, 1 - a)), len(x))
    if base_scores is None:
        return GAUC(value)
    b, _ = per_user_auc(users, labels, base_scores)
    base_boot = _weighted_means(b, w, seed)  # the same seed: the same users drawn, paired
    rel = boot / base_boot - 1
    delta = Estimate(
        float(point / (b @ w / w.sum()) - 1),
        float(np.quantile(rel, a)),
        float(np.quantile(rel, 1 - a)),
        len(x),
    )
    return GAUC(value, delta)
