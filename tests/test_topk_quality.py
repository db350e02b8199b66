"""What users see: the served top-k's figures (ir-measures' NDCG/recall, overlap, RBO), their intervals'
coverage by simulation, the requests and lists the pipeline stores, and the report's quality gate."""

from __future__ import annotations

import dataclasses
import math
import shutil

import numpy as np
import pytest
from conftest import make_variant
from test_report import context, delta, variant

from reco.cli.compose import compose
from reco.config import ConfigError, typed
from reco.experiment import experiment_config
from reco.pipeline import TopK
from reco.report import VariantResult, write_report
from reco.report.figures import study_figures
from reco.report.gate import gate
from reco.report.metrics import study_metrics
from reco.runtime import load_scorer
from reco.serve.config import serve_config
from reco.serve.features import FeatureStore
from reco.serve.quality import QualityConfig, quality_requests, served_topk
from reco.serve.recommend import top_k
from reco.stats import Estimate, Verdict
from reco.stats.graded import GradedQuality
from reco.stats.topk import (
    MIN_DISCORDANT,
    B,
    TopKQuality,
    ir_per_user,
    mean_ci,
    overlap_at_k,
    paired_relative_delta,
    rbo_at_k,
    resampled_means,
    topk_quality,
)
from reco.variant import Variant


def test_ndcg_and_recall_are_the_textbook_values():
    top = np.array([[5, 7, 9], [1, 2, 3], [4, -1, -1]])
    relevant = [np.array([7]), np.array([1, 3, 8]), np.array([6])]
    got = ir_per_user(top, relevant, 3)
    # user 0: its one relevant item at rank 2 -> DCG 1/log2(3), ideal 1
    # user 1: ranks 1 and 3 of 3 relevant -> DCG 1 + 1/2, ideal 1 + 1/log2(3) + 1/2; recall 2/3
    ideal = 1 + 1 / math.log2(3) + 0.5
    np.testing.assert_allclose(got["ndcg"], [1 / math.log2(3), 1.5 / ideal, 0.0], rtol=1e-4)
    np.testing.assert_allclose(got["recall"], [1.0, 2 / 3, 0.0], rtol=1e-4)


def test_overlap_and_rbo():
    a = np.array([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, -1]])
    b = np.array([[1, 2, 3], [4, 5, 6], [2, 1, 3], [1, 2, -1]])
    np.testing.assert_allclose(overlap_at_k(a, b), [1, 0, 1, 2 / 3])
    # [1,2,3] vs [2,1,3] at p=0.9: agreement 0, 1, 1 at depths 1-3, weights .1 .09 .081
    w = np.array([0.1, 0.09, 0.081])
    want_swap = (w @ [0, 1, 1]) / w.sum()
    want_short = (w @ [1, 1, 2 / 3]) / w.sum()  # the padding never matches
    np.testing.assert_allclose(rbo_at_k(a, b, 0.9), [1, 0, want_swap, want_short])


@pytest.mark.parametrize(
    ("hit", "kept", "users", "bootstrapped"),
    [(0.05, 0.9, 400, 0.0), (0.3, 0.8, 400, 0.8), (0.3, 0.7, 1000, 1.0)],
)
def test_bootstrap_intervals_cover_the_true_mean_and_ratio(hit, kept, users, bootstrapped):
    """Users are i.i.d.; per-user NDCG is mostly 0 with a few hits (zero-inflated, skewed), and the
    variant loses `1 - kept` of the baseline's hits. The mean's and the paired relative Δ's 95 % intervals
    must cover the true values >= 92 % of the time, whether the Δ is bootstrapped (enough users differ)
    or bounded (too few do: the paired bootstrap alone covered 0.84 at hit 0.05, kept 0.9, 400 users)."""
    rng = np.random.default_rng(1)
    sims = 300
    cover_mean = cover_rel = boot = 0
    for s in range(sims):
        latent = rng.random(users)
        base = np.where(latent < hit, rng.uniform(0.3, 1, users), 0.0)  # E = hit * 0.65
        var = np.where(latent < hit * kept, base, 0.0)  # the same users, fewer hits: ratio kept
        m = mean_ci(base, seed=s)
        cover_mean += m.lo <= hit * 0.65 <= m.hi
        r = paired_relative_delta(var, base, seed=s)
        # a sample too thin for the ratio (a resample without a hit) claims nothing: counted as a miss
        cover_rel += r.supported and r.lo <= kept - 1 <= r.hi
        boot += (var != base).sum() >= MIN_DISCORDANT
    assert cover_mean / sims >= 0.92 and cover_rel / sims >= 0.92, (cover_mean / sims, cover_rel / sims)
    assert boot / sims == pytest.approx(bootstrapped, abs=0.2)  # both paths are exercised


def test_a_ratio_without_a_baseline_figure_is_not_supported():
    base = np.zeros(50)
    base[0] = 1.0  # most resamples leave it out: the ratio is undefined there, never silently dropped
    assert not paired_relative_delta(np.ones(50), base).supported
    assert not paired_relative_delta(np.ones(50), np.zeros(50)).supported


def test_every_figure_resamples_the_same_users_drawn_once():
    """A bootstrap draw is made once per (users, seed) and every figure's resampled means come from it: the
    means a [B, n] gather of those draws gives, so the intervals are what they were. The baseline's
    ir-measures figures are kept by content and handed out as copies: a caller's change cannot reach the
    next variant's, and other lists or other relevant items are computed afresh."""
    x = np.random.default_rng(5).random(700)
    gathered = x[np.random.default_rng(3).integers(0, 700, (B, 700))].mean(axis=1)
    np.testing.assert_allclose(resampled_means(x, 3), gathered, rtol=1e-12)
    ci = mean_ci(x, 3)
    assert (ci.lo, ci.hi) == pytest.approx(tuple(np.quantile(gathered, [0.025, 0.975])), rel=1e-12)

    top = np.array([[5, 7, 9], [1, 2, 3]])
    relevant = [np.array([7]), np.array([1, 3, 8])]
    first = ir_per_user(top, relevant, 3)
    first["ndcg"][:] = -1.0
    again = ir_per_user(top, relevant, 3)
    np.testing.assert_allclose(again["ndcg"], [1 / math.log2(3), 1.5 / (1.5 + 1 / math.log2(3))], rtol=1e-4)
    assert ir_per_user(top, [np.array([5]), np.array([2])], 3)["ndcg"][0] == pytest.approx(1.0)


def test_quality_settings_are_checked():
    with pytest.raises(ConfigError, match=r"quality: expected users >= 0, k >= 1 and 0 < rbo_p < 1"):
        typed(
            {"users": 10, "k": 10, "rbo_p": 1.0, "looks": [], "look_confidence": 0.999},
            QualityConfig,
            "quality",
        )
    for looks in ([5, 5], [0], [10], [6, 4]):
        with pytest.raises(
            ConfigError, match=r"quality\.looks: expected rising request counts above 0 and below users=10"
        ):
            typed(
                {"users": 10, "k": 10, "rbo_p": 0.9, "looks": looks, "look_confidence": 0.999},
                QualityConfig,
                "quality",
            )
    with pytest.raises(
        ConfigError, match=r"quality\.look_confidence: expected a level in \(0\.5, 1\); got 1"
    ):
        typed(
            {"users": 10, "k": 10, "rbo_p": 0.9, "looks": [5], "look_confidence": 1}, QualityConfig, "quality"
        )
    assert typed(compose([]).quality, QualityConfig, "quality").k == 10


def test_requests_and_served_lists(tiny_data, tmp_path):
    reqs = quality_requests(tiny_data, 60, seed=3)
    s, t = tiny_data.schema, tiny_data.test
    users, items, labels = (t.ids[:, s.index(s.user_key), 0].numpy(), t.ids[:, s.index(s.item_key), 0].numpy(),
                            t.labels.numpy())  # fmt: skip
    assert len(reqs.users) == 60 and len(set(reqs.users.tolist())) == 60 and (reqs.users > 0).all()
    for u, row, rel in zip(reqs.users, reqs.rows, reqs.relevant, strict=True):
        assert users[row] == u and labels[row] == 1
        assert sorted(rel.tolist()) == sorted(items[(users == u) & (labels == 1)].tolist())
    assert quality_requests(tiny_data, 60, seed=3).users.tolist() == reqs.users.tolist()  # seeded
    assert set(quality_requests(tiny_data, 30, seed=3).users) <= set(reqs.users)  # a smaller draw: a subset

    vdir, _ = make_variant(tiny_data, tmp_path)
    scorer = load_scorer(Variant.load(vdir))
    serve = serve_config(compose(["serve.n_candidates=40"]).serve)
    store = FeatureStore(tiny_data, serve.retrieval)
    got = served_topk(scorer, store, tiny_data, reqs, serve, k=5, per_call=7)
    # One request at a time, as the server answers it: the same lists (batching users changes nothing).
    mask = t.mask().numpy()
    for u in range(0, 60, 6):
        row, urow = reqs.rows[u], store.user_row(int(reqs.users[u]))
        ctx = type("Ctx", (), {})()
        ctx.context_ids, ctx.context_mask = t.ids.numpy()[row, store.ctx_cols], mask[row, store.ctx_cols]
        ctx.context_dense = t.dense.numpy()[row, store.ctx_dense_cols]
        cands = store.candidates(urow, 40)
        want, _ = top_k("x", cands, scorer(*store.assemble(urow, ctx, cands)), 5)
        assert got[u].tolist() == want.tolist()
    q = topk_quality(got, reqs.relevant, None, 0.9)
    assert q.ndcg.n == 60 and 0 <= q.ndcg.lo <= q.ndcg.value <= q.ndcg.hi <= 1 and q.overlap is None
    same = topk_quality(got, reqs.relevant, got, 0.9)
    assert same.rbo.value == pytest.approx(1.0) and same.overlap.value == 1.0
    assert same.ndcg_delta is None or same.ndcg_delta.value in (None, 0.0)


def _q(delta_rel: float, half: float, rbo: float = 0.8) -> TopKQuality:
    e = Estimate(0.1, 0.09, 0.11, 500)
    return TopKQuality(10, e, e, e, Estimate(rbo, rbo - 0.05, rbo + 0.05, 500),
                       Estimate(delta_rel, delta_rel - half, delta_rel + half, 500))  # fmt: skip


def _g(delta_rel: float, half: float) -> GradedQuality:
    e, d = Estimate(1.0, 0.9, 1.1, 500), Estimate(delta_rel, delta_rel - half, delta_rel + half, 500)
    return GradedQuality(10, e, e, d, d)


def test_the_quality_gate_flags_a_pass_on_auc_that_users_would_see(tmp_path):
    """AUC within its limit, but the served top-k's expected clicks@10 drop 8 % [-10, -6]: FAIL overall,
    flagged; logged NDCG@10 is reported beside it and decides nothing."""
    e = Estimate(0.1, 0.09, 0.11, 500)
    results = [
        VariantResult(variant("base", "train", None), quality=TopKQuality(10, e, e), graded=_g(0, 0)),
        VariantResult(
            variant("same", "prune", "base"),
            auc_delta=delta(-0.001, 0.001),
            quality=_q(-0.5, 0.01),  # logged NDCG halves: no verdict from it
            graded=_g(-0.005, 0.004),
        ),
        VariantResult(
            variant("worse", "prune", "base"),
            auc_delta=delta(-0.001, 0.001),
            quality=_q(+0.08, 0.02),
            graded=_g(-0.08, 0.02),
        ),
        VariantResult(
            variant("unsure", "prune", "base"),
            auc_delta=delta(-0.001, 0.001),
            quality=_q(-0.02, 0.03),
            graded=_g(-0.01, 0.03),
        ),
        VariantResult(variant("none", "prune", "base"), auc_delta=delta(-0.001, 0.001)),
    ]
    ctx = dataclasses.replace(context(results, None), planted=True, max_clicks_drop=0.01)
    gates = {f.name: gate(f, ctx) for f in study_figures(results, ctx)}
    assert {n: g.quality.verdict for n, g in gates.items()} == {
        "base": Verdict.PASS,
        "same": Verdict.PASS,
        "worse": Verdict.FAIL,
        "unsure": Verdict.INCONCLUSIVE,
        "none": Verdict.INCONCLUSIVE,
    }
    assert gates["worse"].accuracy.verdict == Verdict.PASS and gates["worse"].overall == Verdict.FAIL
    assert (
        "Δexpected clicks@10 (graded by the planted P(click), the ground truth) -8.00% [-10.00, -6.00]"
        in (gates["worse"].reason)
    )
    write_report(results, ctx, tmp_path)
    md = (tmp_path / "report.md").read_text()
    section = md.split("## What users see")[1].split("\n## ")[0]
    assert "`worse`" in section and "passes on AUC, fails on what users see" in section
    assert section.count("passes on AUC, fails on what users see") == 1
    m = study_metrics(results, ctx)
    assert m["worse"]["ndcg_at_10_delta_rel"] == 0.08 and m["worse"]["gate_quality"] == 0.0
    assert m["base"]["ndcg_at_10"] == 0.1 and "rbo_at_10" not in m["base"] and m["same"]["rbo_at_10"] == 0.8
    # Off (quality.users=0): no part, no column verdict.
    off = gate(study_figures(results, context(results, None))[2], context(results, None))
    assert off.quality is None and off.overall == Verdict.PASS


def test_a_runtime_that_moves_with_its_batch_mates_is_measured_one_request_a_call(
    untuned_int8, data, tmp_path
):
    """Dynamic INT8 quantizes every call with that call's own scale, so a request's scores depend on what
    shares its call, and its server is not batched: what users see is then its lists scored one request a
    call, kept under their own name; a batch-invariant variant keeps the lists scored 8 a call."""
    exp = experiment_config(compose(["quality.users=60", "serve.n_candidates=40"]))
    dynamic = Variant.load(shutil.copytree(untuned_int8.path, tmp_path / "dynamic"))
    static_dir, _ = make_variant(data, tmp_path, onnx=True)
    fp32 = Variant.load(static_dir)
    topk = TopK(exp, data)
    for v in (dynamic, fp32):
        topk.measure(v)
    assert topk.alone_file in dynamic.artifacts and topk.file not in dynamic.artifacts
    assert topk.file in fp32.artifacts and topk.alone_file not in fp32.artifacts
    scorer = load_scorer(dynamic, shared=data.schema.shared_columns)
    alone, eight = (
        served_topk(scorer, topk.store, data, topk.requests, exp.serve, exp.quality.k, per_call=n)
        for n in (1, 8)
    )
    np.testing.assert_array_equal(topk.load(dynamic), alone)
    assert (eight != alone).any(axis=1).sum() > 0  # 8 a call would have measured other lists


def test_looks_without_a_planted_click_model_say_so_and_answer_every_request(data, tmp_path, capsys):
    """A look is judged by Δexpected clicks, which needs the planted click model: without it (this tiny
    data is not the preset's) quality.looks says so and every variant answers all the requests."""
    exp = experiment_config(compose(["quality.users=60", "quality.looks=[20,40]", "serve.n_candidates=40"]))
    vdir, _ = make_variant(data, tmp_path)
    base, other = Variant.load(vdir), Variant.load(shutil.copytree(vdir, tmp_path / "other"))
    topk = TopK(exp, data)
    topk.measure(base)
    topk.measure(other, base)
    assert topk.truth is None and len(topk.load(other)) == len(topk.load(base)) == 60
    assert "quality.looks: no planted click model" in capsys.readouterr().out
