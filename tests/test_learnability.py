"""reco.learnability: the planted click model's terms, the ceilings drawn from them, the CLI."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY

from reco import learnability
from reco.cli import learnability as learnability_cli
from reco.data.synthetic import generate, simulate


@pytest.fixture(scope="module")
def sim():
    return simulate(TINY)


def test_terms_are_the_click_model_the_labels_were_drawn_from(sim):
    """sigmoid(sum of the terms + offset) is the stored true probability of every row, and the data are
    bit for bit what they were before the terms were exposed (fingerprint taken from that code)."""
    logit = sum(sim.terms.values()) + sim.offset
    prob = 1 / (1 + np.exp(-logit))
    parts = (sim.dataset.train, sim.dataset.val, sim.dataset.test)
    stored = np.concatenate([p.oracle.numpy() for p in parts])
    np.testing.assert_allclose(prob.astype(np.float32), stored, rtol=1e-6)
    assert sim.dataset.fingerprint == generate(TINY).fingerprint == "9cdfa93332fd5f12"


def test_ceilings_drop_without_the_per_user_terms(sim):
    c = learnability.ceilings(sim)
    oracle = c["oracle (every term)"]
    assert c["without every per-user term"] < c["without user_x_item"] < oracle
    assert c["without user_x_category"] < oracle


def test_buckets_cover_the_test_split_and_score_the_model(sim):
    n = len(sim.dataset.test.labels)
    perfect = learnability.by_user_history(sim, sum(sim.terms.values())[-n:])
    assert sum(b.rows for b in perfect) == n
    for b in perfect:  # the true logit as "model" scores: its AUC is the oracle's in every bucket
        assert b.model_auc == b.oracle_auc


def test_cli_rejects_scores_of_another_split_and_other_loaders(tmp_path, capsys):
    bad = tmp_path / "test_scores.npy"
    np.save(bad, np.zeros(7, dtype=np.float32))
    tiny = [f"data.params.{k}={v}" for k, v in vars(TINY).items() if k in ("n_rows", "n_users", "n_items")]
    assert learnability_cli.main(["--scores", str(bad), *tiny]) == 2
    assert "--scores" in capsys.readouterr().err
    assert learnability_cli.main(["data=movielens_100k"]) == 2
    assert "data.loader=movielens" in capsys.readouterr().err
