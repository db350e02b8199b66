"""Ranking-quality metrics: AUC (ties averaged), log loss, calibration."""

from __future__ import annotations

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve via the Mann-Whitney U statistic, tied scores get average ranks."""
    labels = np.asarray(labels, dtype=np.float64)
    scores = np.asarray(scores, dtype=np.float64)
    n_pos = labels.sum()
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty_like(s)
    # average rank per run of equal scores
    starts = np.r_[0, np.flatnonzero(np.diff(s)) + 1]
    ends = np.r_[starts[1:], s.size]
    avg = (starts + ends + 1) / 2.0
    ranks[:] = np.repeat(avg, ends - starts)
    r = np.empty_like(ranks)
    r[order] = ranks
    return float((r[labels == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def logloss(labels: np.ndarray, probs: np.ndarray, eps: float = 1e-7) -> float:
    p = np.clip(np.asarray(probs, dtype=np.float64), eps, 1 - eps)
    y = np.asarray(labels, dtype=np.float64)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def classification_metrics(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """auc, logloss, mean predicted CTR, observed CTR and their ratio (calibration, 1 = perfect)."""
    pred, obs = float(np.mean(probs)), float(np.mean(labels))
    return {
        "auc": auc(labels, probs),
        "logloss": logloss(labels, probs),
        "pred_ctr": pred,
        "obs_ctr": obs,
        "calibration": pred / obs if obs > 0 else float("nan"),
    }
