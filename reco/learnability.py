"""How much of the synthetic data's planted click model a model can learn, and where a model falls short.

    python -m reco.cli.learnability [--scores VARIANT_DIR/test_scores.npy] [data overrides ...]

The oracle AUC (true click probabilities) is the ceiling no model reaches, because part of the planted
logit is a per-user latent vector dotted with the item's, learnable only from that user's own rows.
This prints, on the test split: the AUC of the true logit with the per-user terms left out (what a
model that learned everything else would reach), and, bucketed by how many training impressions the
row's user has, the oracle, that ceiling and (with --scores) the model's AUC. Dropping a term from the
logit is not the Bayes-optimal score without it, but the terms are independent of the rest and centred,
so it is close; the figures are point estimates on ~100k rows (an AUC's sampling error there is ~2e-3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reco.data.schema import time_split
from reco.data.synthetic import Simulation
from reco.train.metrics import auc

# Terms of the planted logit that depend on the individual user's latent vector (reco/data/synthetic.py);
# everything else is a function of ids and features every user shares (items, categories, segments, context).
PER_USER_TERMS = ("user_x_item", "user_x_category")
HISTORY_EDGES = (0, 1, 4, 16, 64)  # buckets of training impressions per user: 0, 1-3, 4-15, 16-63, 64+


@dataclass(frozen=True)
class Bucket:
    label: str
    rows: int
    oracle_auc: float | None
    shared_auc: float | None  # the true logit without the per-user terms
    model_auc: float | None


def _auc_or_none(labels: np.ndarray, scores: np.ndarray) -> float | None:
    return auc(labels, scores) if 0 < labels.sum() < labels.size else None


def ceilings(sim: Simulation) -> dict[str, float]:
    """Test-split AUC of the true logit, with each per-user term and with both left out."""
    test = time_split(len(sim.users))[2]
    labels = sim.dataset.test.labels.numpy()
    full = sum(sim.terms.values())[test]
    out = {"oracle (every term)": auc(labels, full)}
    for name in PER_USER_TERMS:
        out[f"without {name}"] = auc(labels, full - sim.terms[name][test])
    out["without every per-user term"] = auc(labels, _shared_logit(sim)[test])
    return out


def _shared_logit(sim: Simulation) -> np.ndarray:
    return sum(v for k, v in sim.terms.items() if k not in PER_USER_TERMS)


def by_user_history(sim: Simulation, scores: np.ndarray | None = None) -> list[Bucket]:
    """The test rows bucketed by their user's number of training impressions (HISTORY_EDGES)."""
    train, _, test = time_split(len(sim.users))
    history = np.bincount(sim.users[train], minlength=int(sim.users.max()) + 1)[sim.users[test]]
    labels = sim.dataset.test.labels.numpy()
    full, shared = sum(sim.terms.values())[test], _shared_logit(sim)[test]
    edges = [*HISTORY_EDGES, np.inf]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        rows = (history >= lo) & (history < hi)
        label = f"{lo}" if hi == lo + 1 else (f"{lo}+" if hi == np.inf else f"{lo}-{int(hi) - 1}")
        y = labels[rows]
        out.append(
            Bucket(
                label,
                int(rows.sum()),
                _auc_or_none(y, full[rows]),
                _auc_or_none(y, shared[rows]),
                None if scores is None else _auc_or_none(y, scores[rows]),
            )
        )
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def report(sim: Simulation, scores: np.ndarray | None) -> str:
    lines = ["| test-split AUC of the true logit | AUC |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" for k, v in ceilings(sim).items()]
    if scores is not None:
        lines.append(f"| the model (--scores) | {auc(sim.dataset.test.labels.numpy(), scores):.4f} |")
    n = len(sim.dataset.test.labels)
    lines += [
        "",
        "| user's training impressions | test rows | share | oracle AUC | without per-user terms | model AUC |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {b.label} | {b.rows:,} | {b.rows / n:.1%} | {_fmt(b.oracle_auc)} | {_fmt(b.shared_auc)} "
        f"| {_fmt(b.model_auc)} |"
        for b in by_user_history(sim, scores)
    ]
    return "\n".join(lines)


def load_scores(path: Path, n: int) -> np.ndarray:
    """A variant's test_scores.npy (test-split order), checked against the split's length."""
    scores = np.load(path, allow_pickle=False).reshape(-1)
    if scores.shape[0] != n:
        raise ValueError(f"--scores {path}: {scores.shape[0]:,} scores, the test split has {n:,} rows")
    return scores
