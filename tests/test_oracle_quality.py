"""What users see, graded where the data knows the truth (issue 44): the planted click model grades every
served candidate; GAUC orders one user's rows; the gate judges the measure with ground truth."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from conftest import TINY, premade_store
from test_report import context, delta, variant

from reco.cli.compose import compose
from reco.config import ConfigError, typed
from reco.data.synthetic import click_model, simulate
from reco.experiment import GateConfig, experiment_config
from reco.models.dlrm import DLRM, DLRMConfig
from reco.pipeline import Built, TopK, measure_accuracy, write_study_report
from reco.report import VariantResult, write_report
from reco.report.figures import study_figures
from reco.report.gate import gate
from reco.report.metrics import study_metrics
from reco.serve.config import serve_config
from reco.serve.features import FeatureStore
from reco.serve.quality import (
    gains_of,
    planted_gains,
    popularity,
    quality_requests,
    reference_topk,
    reproduces,
    request_candidates,
)
from reco.stats import Estimate, Verdict
from reco.stats.gauc import GAUC, gauc, per_user_auc
from reco.stats.graded import GradedQuality, graded_per_request, graded_quality
from reco.stats.topk import ir_per_user
from reco.tracking import Tracker
from reco.train.metrics import auc
from reco.variant import Variant


@pytest.fixture(scope="module")
def sim():
    return simulate(TINY)


def _ids(ds, name):
    return ds.test.ids[:, ds.schema.index(name), 0].numpy()


def test_the_click_model_gives_the_logged_rows_their_planted_probability(sim):
    ds = sim.dataset
    got = sim.model.prob(*(_ids(ds, c) - 1 for c in ("user_id", "item_id", "hour", "device")))
    np.testing.assert_allclose(got, ds.test.oracle.numpy(), rtol=1e-5)
    assert click_model(TINY).offset == sim.model.offset and reproduces(click_model(TINY), ds)
    # another seed's model is another data set's: its grades are not used
    assert not reproduces(click_model(dataclasses.replace(TINY, seed=1)), ds)


def test_a_popularity_tilt_moves_logged_ndcg_not_expected_clicks(sim):
    """The oracle's own ranking against itself tilted by 0.02 log(popularity): the logged NDCG@10 moves
    > 5 % (it rewards shown-and-clicked, i.e. popular, items); expected clicks and oracle NDCG < 1 %."""
    ds, k = sim.dataset, 10
    serve = serve_config(compose(["serve.n_candidates=100"]).serve)
    reqs = quality_requests(ds, 1000, seed=0)
    cands = request_candidates(FeatureStore(ds, serve.retrieval), reqs, serve.n_candidates)
    gains = planted_gains(sim.model, ds, reqs, cands)
    pop = popularity(ds)
    oracle = reference_topk(cands, gains, k)
    base = graded_per_request(gains_of(oracle, cands, gains), gains)
    assert (base["clicks"] > 0).all() and base["ndcg"] == pytest.approx(1.0)  # no request scores 0
    logged = ir_per_user(oracle, reqs.relevant, k)["ndcg"]
    for tilt in (0.02, -0.02):
        top = reference_topk(
            cands, [g + tilt * np.log(pop[c] + 1) for g, c in zip(gains, cands, strict=True)], k
        )
        moved = ir_per_user(top, reqs.relevant, k)["ndcg"].mean() / logged.mean() - 1
        q = graded_quality(gains_of(top, cands, gains), gains, gains_of(oracle, cands, gains))
        assert abs(moved) > 0.05, tilt
        assert abs(q.clicks_delta.value) < 0.01 and abs(q.ndcg_delta.value) < 0.01, tilt
        assert q.clicks_delta.lo <= q.clicks_delta.value <= q.clicks_delta.hi <= 0  # the oracle is the best


def test_gauc_is_the_per_user_auc_and_ranks_the_oracle_above_popularity(sim):
    ds = sim.dataset
    users, labels, items = _ids(ds, "user_id"), ds.test.labels.numpy(), _ids(ds, "item_id")
    oracle, pop = ds.test.oracle.numpy().astype(np.float64), popularity(ds)[items]
    per_user, w = per_user_auc(users, labels, pop)  # popularity: many ties within a user
    both = [u for u in np.unique(users) if 0 < labels[users == u].sum() < (users == u).sum()]
    want = [auc(labels[users == u], pop[users == u]) for u in both]
    np.testing.assert_allclose(per_user, want)
    assert w.sum() <= len(users)
    g = gauc(users, labels, oracle, pop)
    assert g.value.value > gauc(users, labels, pop).value.value and g.delta.lo > 0
    assert gauc(users, labels, oracle, oracle).delta.value == 0


def _est(v, half=0.0, n=300):
    return Estimate(v, v - half, v + half, n)


def _results(clicks_rel, gauc_rel):
    e = _est(0.1, 0.01)
    base = VariantResult(
        variant("base", "train", None),
        graded=GradedQuality(10, _est(1.2, 0.1), _est(0.8, 0.05)),
        gauc=GAUC(_est(0.7, 0.01)),
    )
    other = VariantResult(
        variant("student", "distill", "base"),
        auc_delta=delta(-0.001, 0.001),
        graded=GradedQuality(10, e, e, _est(clicks_rel, 0.004), _est(clicks_rel, 0.004)),
        gauc=GAUC(_est(0.69, 0.01), _est(gauc_rel, 0.002)),
    )
    return [base, other]


def test_the_gate_judges_expected_clicks_where_the_truth_is_planted_and_gauc_elsewhere(tmp_path):
    """Expected clicks -3 % fails where the click model is planted although ΔGAUC passes; without it
    ΔGAUC decides, and the report says the oracle measures do not apply."""
    results = _results(clicks_rel=-0.03, gauc_rel=-0.001)
    planted = dataclasses.replace(
        context(results, None), planted=True, max_clicks_drop=0.01, max_gauc_drop=0.005
    )
    g = {f.name: gate(f, planted) for f in study_figures(results, planted)}["student"]
    assert g.quality.verdict == Verdict.FAIL and "expected clicks@10" in g.quality.reason
    assert "ground truth" in g.quality.reason and "-3.00%" in g.quality.reason
    logged = dataclasses.replace(planted, planted=False, max_clicks_drop=None)
    g = {f.name: gate(f, logged) for f in study_figures(results, logged)}["student"]
    assert g.quality.verdict == Verdict.PASS and g.quality.reason.startswith("ΔGAUC")
    m = study_metrics(results, planted)["student"]
    assert m["expected_clicks_at_10_delta_rel"] == -0.03 and m["gauc_delta_rel"] == -0.001
    write_report(results, logged, tmp_path)
    section = (tmp_path / "report.md").read_text().split("## What users see")[1].split("\n## ")[0]
    assert "oracle-graded measures do not apply" in section and "expected clicks@10 |" not in section
    write_report(results, planted, tmp_path)
    section = (tmp_path / "report.md").read_text().split("## What users see")[1].split("\n## ")[0]
    assert "do not apply" not in section and "Δexpected clicks@10" in section
    assert "passes on AUC, fails on what users see" in section


@pytest.mark.parametrize("key", ["max_auc_drop_pct", "max_expected_clicks_drop_pct", "max_gauc_drop_pct"])
@pytest.mark.parametrize("bad", [-1.0, 100.0])
def test_gate_limits_are_checked_naming_the_key(key, bad):
    good = typed(compose([]).gate, GateConfig, "gate")
    assert good.max_expected_clicks_drop_pct == 1.0 and good.max_gauc_drop_pct == 0.5
    with pytest.raises(ConfigError, match=rf"gate\.{key}={bad}: expected"):
        typed({**vars(good), key: bad}, GateConfig, "gate")


def _untrained(data, root, seed: int) -> Variant:
    torch.manual_seed(seed)
    model = DLRM(DLRMConfig.from_schema(data.schema, embedding_dim=16, bottom=[32, 16], top=[64, 32]))
    v = Variant(f"untrained{seed}", "train", None, "torch", {}, dir=str(root / f"v{seed}"))
    v.save_torch(model)
    v.save()
    return Variant.load(v.path)


def _planted_exp(*extra: str):
    """The pipeline's settings on the planted tiny data, 150 quality requests of 60 candidates."""
    params = {f.name: getattr(TINY, f.name) for f in dataclasses.fields(TINY)}
    over = [f"data.params.{k}={v}" for k, v in params.items() if k in ("n_rows", "n_users", "n_items",
            "n_categories", "n_brands", "latent_dim", "max_recent")]  # fmt: skip
    return experiment_config(
        compose(
            [
                "data=synthetic_small",
                "variants=chain",
                "seed=0",
                *over,
                "quality.users=150",
                "serve.n_candidates=60",
                *extra,
            ]  # fmt: skip
        )
    )


def test_the_study_report_grades_served_lists_and_adds_the_reference_rows(sim, parent, tmp_path):
    """write_study_report as the pipeline calls it, on the planted tiny data: a trained baseline and an
    untrained variant, their served top-k graded by the planted model, GAUC from their test scores, the
    popularity and oracle rows beside them, the gate on expected clicks, the figures logged to MLflow."""
    ds, exp = sim.dataset, _planted_exp()
    shutil.copytree(parent.path, tmp_path / "base")
    base, other = Variant.load(tmp_path / "base"), _untrained(ds, tmp_path, 1)
    topk = TopK(exp, ds)
    for v in (base, other):
        measure_accuracy(v, ds, threads=1)
        topk.measure(v)
    # another study's settings on the same cached variant (serving_backends' 50 candidates beside the case
    # study's 500): its lists are kept beside these, not in their place, so neither run redoes the other's
    fewer = TopK(dataclasses.replace(exp, serve=dataclasses.replace(exp.serve, n_candidates=30)), ds)
    fewer.measure(base)
    assert fewer.file != topk.file and topk.load(base) is not None and fewer.load(base) is not None
    tracker = Tracker(f"sqlite:///{premade_store(tmp_path)}", "users_see", str(tmp_path / "artifacts"))
    nodes = exp.variants
    base.name, other.name = nodes[0].name, nodes[1].name  # the report's rows are the graph's nodes
    built = [Built(nodes[0], base, "", tracker.start_run("b"), False),
             Built(nodes[1], other, "", tracker.start_run("o"), False)]  # fmt: skip
    write_study_report(exp, built, ds, None, tmp_path / "report", tracker)
    md = (tmp_path / "report" / "report.md").read_text()
    section = md.split("## What users see")[1].split("\n## ")[0]
    assert "*popularity* (reference)" in section and "*oracle* (reference)" in section
    assert "do not apply" not in section and "Δexpected clicks@10" in section
    m = tracker.client.get_run(built[1].run_id).data.metrics
    assert {"expected_clicks_at_10_delta_rel", "oracle_ndcg_at_10", "gauc", "gauc_delta_rel"} <= set(m)
    assert m["gauc_delta_rel"] < 0  # an untrained model orders a user's rows worse than a trained one
    assert "ground truth" in md.split("## Gate")[1].split("\n## ")[0] or "PASS" in section


def test_a_variant_whose_gate_a_look_decides_answers_no_more_requests(sim, parent, tmp_path):
    """quality.looks at 50 and 100 of 150 requests, against a 40 % limit: the untrained variant's 99.9 %
    interval at the first look (about -25 % to +16 %) is already above it, so it answers those 50 requests
    (the lists it would have served them anyway) and no more; a copy of the baseline, whose lists agree
    everywhere, has only the Clopper-Pearson bound on undetected differences (+-57 % at 50, +-30 % at 100)
    and stops at 100. The report pairs each with the baseline's answers to the same requests and says who
    stopped where."""
    looks = ("quality.looks=[50,100]", "gate.max_expected_clicks_drop_pct=40")
    ds, exp = sim.dataset, _planted_exp(*looks)
    full = TopK(_planted_exp(), ds)
    base = Variant.load(shutil.copytree(parent.path, tmp_path / "base"))
    same = Variant.load(shutil.copytree(parent.path, tmp_path / "same"))
    other = _untrained(ds, tmp_path, 1)
    topk = TopK(exp, ds)
    assert topk.file != full.file  # lists stopped at a look are never read as all the requests'
    for v in (base, other, same):
        measure_accuracy(v, ds, threads=1)
        topk.measure(v, None if v is base else base)
        full.measure(v)
    rows = topk.rows(topk.load(other))
    assert len(rows) == 50 and len(set(rows.tolist())) == 50 and (rows != np.arange(50)).any()  # shuffled
    np.testing.assert_array_equal(topk.load(other), full.load(other)[rows])
    rows = topk.rows(topk.load(same))
    assert len(rows) == 100 and set(topk.rows(topk.load(other))) < set(rows)  # the looks are nested
    np.testing.assert_array_equal(topk.load(same), full.load(same)[rows])
    np.testing.assert_array_equal(topk.load(base), full.load(base))
    strict = TopK(_planted_exp("quality.looks=[50,100]"), ds)  # the 1 % limit: no look decides either
    strict.measure(other, base)
    assert len(strict.load(other)) == 150

    tracker = Tracker(f"sqlite:///{premade_store(tmp_path)}", "looks", str(tmp_path / "artifacts"))
    nodes = exp.variants
    base.name, other.name, same.name = nodes[0].name, nodes[1].name, nodes[2].name
    built = [
        Built(n, v, "", tracker.start_run(n.name), False)
        for n, v in zip(nodes[:3], (base, other, same), strict=True)
    ]
    write_study_report(exp, built, ds, None, tmp_path / "report", tracker)
    md = (tmp_path / "report" / "report.md").read_text()
    section = md.split("## What users see")[1].split("\n## ")[0]
    note = section.split("Answered in looks")[1].split("\n")[0]
    assert "99.9% interval of Δexpected clicks" in note
    assert f"`{other.name}` 50, `{same.name}` 100 requests" in note
    row = next(ln for ln in section.splitlines() if ln.startswith(f"| `{other.name}`"))
    assert row.rstrip(" |").endswith("PASS")
    m = tracker.client.get_run(built[1].run_id).data.metrics
    assert m["expected_clicks_at_10_delta_rel"] == pytest.approx(-0.0594, abs=1e-3)  # its 50, paired
