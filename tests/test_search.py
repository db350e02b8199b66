"""Accuracy-budget search (reco/search/, conf/experiment/search.yaml): the objective on hand-made metrics,
the search-space check, and real 2-trial Optuna sweeps of `run.py -m experiment=search` at toy size."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import premade_store
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from reco.cli.compose import compose
from reco.config import ConfigError, typed
from reco.search import (
    NO_VARIANT,
    TRIAL_FILE,
    Candidate,
    FrontLoad,
    SearchConfig,
    Trial,
    check_space,
    front,
    objective,
)
from reco.search.summary import SUMMARY_FILE, summarize

ROOT = Path(__file__).resolve().parents[1]
# Smaller than the smoke preset: a baseline trains in seconds; loadtest and profile are off in the preset.
TOY = [
    "experiment=search",
    "data.params={n_rows: 8000, n_users: 800, n_items: 500, n_categories: 20, n_brands: 50, latent_dim: 4,"
    " max_recent: 4}",
    "model.embedding_dim=16",
    "model.bottom=[32,16]",
    "model.top=[64,32]",
    "trainer.epochs=1",
    "trainer.eval_rows=null",
    "prune.finetune_rows=null",
    "prune.embeddings.min_rows=50",
    "prune.taylor_batches=1",
    "distill.epochs=1",
    "distill.rows_per_epoch=null",
    "distill.student.top=[16,8]",
    "distill.student.min_rows=50",
    "accelerate.tune.repeats=3",
    "accelerate.tune.warmup=1",
    "rank_latency.repeats=5",
    "rank_latency.warmup=1",
    "hydra.sweeper.n_trials=2",
    # The toy teacher is 16 wide: a student as wide is not smaller (distill refuses it), and one 4 wide
    # cannot hold int2 rows (FBGEMM needs dim % 8 == 0): 8, so every lever builds in both trials. The
    # toy's noisy val AUC gets a loose whole-variant embedding budget for the same reason.
    "distill.student.embedding_dim=choice(8)",  # a sweep override: replaces the preset's range
    "embed_quant.budget=0.05",
]


def table(md: str) -> list[dict[str, str]]:
    """The rows of the summary's Markdown table, each as {column: cell}."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| trial |"))
    header = [h.strip() for h in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)))
    return rows


def by_variant(md: str) -> dict[tuple[str, str], dict[str, str]]:
    """The summary table's rows by (trial, variant) cells."""
    return {(r["trial"], r["variant"]): r for r in table(md)}


def test_objective_is_the_fastest_variant_within_the_budget():
    cands = [
        Candidate("pruned", rank_p50_ms=4.0, val_delta_rel=-0.0005),  # -0.05 %: within 0.1 %
        Candidate("distilled", rank_p50_ms=1.0, val_delta_rel=-0.002),  # faster, but -0.2 %
        Candidate("pruned_int8", rank_p50_ms=2.0, val_delta_rel=-0.0009),
    ]
    s = objective(cands, max_auc_drop_pct=0.1)
    assert s.within_budget and s.best == "pruned_int8"
    assert s.objective == pytest.approx(500.0)  # 1000 / 2 ms
    loose = objective(cands, max_auc_drop_pct=0.5)
    assert loose.best == "distilled" and loose.objective == pytest.approx(1000.0)


def test_a_trial_missing_the_budget_is_penalised_below_every_feasible_trial():
    cands = [Candidate("a", 1.0, -0.004), Candidate("b", 0.5, -0.003)]  # -0.4 %, -0.3 %
    s = objective(cands, max_auc_drop_pct=0.1)
    assert not s.within_budget and s.best == "b"
    assert s.objective == pytest.approx(-0.2)  # 0.3 % drop is 0.2 points over the budget
    assert objective([Candidate("c", 1.0, -0.0035)], 0.1).objective < s.objective  # nearer scores higher
    assert objective([], 0.1) == type(s)(NO_VARIANT, False, None)


def test_a_batched_copy_is_not_screened_but_load_tested_with_its_parent(tmp_path):
    """The screen cannot tell a batched variant from its parent (same model): it never decides a trial's
    objective or the front, and it joins the front's load test exactly when its parent is on the front."""
    fast_batched = Candidate("onnx_batched", rank_p50_ms=0.5, val_delta_rel=0.0, batched_from="onnx")
    s = objective([Candidate("onnx", 2.0, 0.0), fast_batched], max_auc_drop_pct=0.1)
    assert s.best == "onnx" and s.objective == pytest.approx(500.0)
    assert objective([fast_batched], 0.1).objective == NO_VARIANT

    def trial(n: int, ms: float) -> Trial:
        cands = [Candidate("onnx", ms, -0.0005), Candidate("onnx_batched", 0.1, -0.0005, batched_from="onnx")]
        return Trial(n, [f"batching.max_queue_delay_ms={n + 0.123456789}"], max_auc_drop_pct=0.1,
                     objective=1000 / ms, within_budget=True, best="onnx", candidates=cands)  # fmt: skip

    trials = [trial(0, 1.0), trial(1, 3.0)]  # trial 1's onnx is dominated (slower, same ΔAUC)
    assert [(t.trial, c.name) for t, c in front(trials)] == [(0, "onnx"), (0, "onnx_batched")]
    load = FrontLoad("by hand", "baseline", {"t0_onnx": 50.0, "t0_onnx_batched": 80.0, "baseline": 90.0},
                     {"t0_onnx": 31.0, "t0_onnx_batched": None, "baseline": float("inf")})  # fmt: skip
    md, winner, files = summarize(trials, tmp_path, load)
    # the winner is the front's best; the reference (faster here) is shown, never chosen
    assert winner is not None and (winner.trial.trial, winner.cand.name) == (0, "onnx_batched")
    rows = by_variant(md)
    load_cols = ("Pareto", "max QPS @ SLO", "e2e p99 ms @ common load")
    assert [rows["0", "onnx_batched"][k] for k in load_cols] == ["with onnx", "80", "n/a"]
    assert [rows["1", "onnx_batched"][k] for k in load_cols] == ["not screened", "", ""]
    assert [rows["0", "onnx"][k] for k in load_cols] == ["yes", "50", "31.0"]
    ref = rows["", "baseline (reference)"]  # > 1% failed: p99 not finite
    assert {k: v for k, v in ref.items() if v} == {
        "variant": "baseline (reference)", "val ΔAUC [95% CI]": "0", "max QPS @ SLO": "90",
        "e2e p99 ms @ common load": "inf",
    }  # fmt: skip
    assert [f.name for f in files] == [SUMMARY_FILE, "search_pareto.png", "search_front_load.png"]
    assert rows["0", "onnx"]["overrides"] == "batching.max_queue_delay_ms=0.1235"  # 4 significant digits


def test_the_size_objective_picks_the_smallest_file_within_the_budget(tmp_path):
    """search.objective=size: a trial returns the baseline's file size over its smallest budget-meeting
    variant's, the front is size vs ΔAUC, and the winner stays the smallest even when the front's load test
    finds a bigger variant faster (the load test shows what the small one costs, it does not decide)."""
    cands = [
        Candidate("onnx_int8", rank_p50_ms=1.0, val_delta_rel=-0.0002, size_mb=10.0),
        Candidate("emb_int4", rank_p50_ms=3.0, val_delta_rel=-0.0008, size_mb=4.0),  # smaller, slower
        Candidate("emb_int2", rank_p50_ms=3.0, val_delta_rel=-0.003, size_mb=2.0),  # smallest, over budget
    ]
    s = objective(cands, 0.1, "size", base_size_mb=40.0)
    assert s.within_budget and s.best == "emb_int4" and s.objective == pytest.approx(10.0)
    assert objective(cands, 0.1, "throughput").best == "onnx_int8"

    trial = Trial(0, ["embed_quant.table_budget=0.001"], max_auc_drop_pct=0.1, objective_kind="size",
                  baseline_size_mb=40.0, objective=s.objective, within_budget=True, best=s.best,
                  candidates=cands)  # fmt: skip
    # on the size front: both budget-meeting variants (neither dominates the other); emb_int2 is on the
    # front too but over the budget, so it is not load-tested
    assert [c.name for _, c in front([trial])] == ["onnx_int8", "emb_int4"]
    load = FrontLoad("by hand", "baseline", {"t0_onnx_int8": 300.0, "t0_emb_int4": 120.0, "baseline": 20.0},
                     {"t0_onnx_int8": 10.0, "t0_emb_int4": 25.0, "baseline": 90.0})  # fmt: skip
    md, winner, files = summarize([trial], tmp_path, load)
    assert winner is not None and winner.cand.name == "emb_int4" and winner.max_qps == 120.0
    assert "`search.objective=size`" in md and "size_mb vs val ΔAUC" in md
    assert "model file 4.00 MB (10.00x smaller than the baseline's)" in md
    assert "within the 0.1% budget by its point estimate, CI verdict PASS" in md
    row = by_variant(md)["0", "emb_int4"]
    assert (row["size MB"], row["val ΔAUC [95% CI]"]) == ("4.00", "-0.080%")
    with pytest.raises(ConfigError, match=r"search.objective: expected one of \['size', 'throughput'\]"):
        typed(compose(["experiment=search", "search.objective=memory"]).search, SearchConfig, "search")


def test_budget_test_ci_counts_a_variant_only_when_its_whole_ci_is_within(tmp_path):
    """search.budget_test=ci: the CI's worst end is held against the budget, so a variant whose point
    estimate is within but whose CI straddles the budget (INCONCLUSIVE) does not count; with `point` it
    does, and the summary labels it INCONCLUSIVE either way."""
    tight = Candidate(
        "onnx", rank_p50_ms=2.0, val_delta_rel=0.0002, val_delta_lo=-0.0005, val_delta_hi=0.0009
    )
    noisy = Candidate(
        "emb", rank_p50_ms=1.0, val_delta_rel=-0.0006, val_delta_lo=-0.0015, val_delta_hi=0.0003
    )
    assert objective([tight, noisy], 0.1, test="point").best == "emb"
    s = objective([tight, noisy], 0.1, test="ci")
    assert s.best == "onnx" and s.objective == pytest.approx(500.0)
    off = objective([noisy], 0.1, test="ci")  # penalised by the CI's excess: 0.15 % - 0.1 %
    assert not off.within_budget and off.objective == pytest.approx(-0.05)

    def record(test: str) -> Trial:
        return Trial(0, [], max_auc_drop_pct=0.1, budget_test=test, objective=1.0, within_budget=True,
                     best="onnx", candidates=[tight, noisy])  # fmt: skip

    def within(md: str) -> dict[str, str]:
        return {r["variant"]: r["within budget (CI verdict)"] for r in table(md)}

    assert [c.name for _, c in front([record("ci")])] == ["onnx"]
    assert [c.name for _, c in front([record("point")])] == ["onnx", "emb"]
    md, _, _ = summarize([record("ci")], tmp_path)
    assert within(md) == {"onnx": "yes (PASS)", "emb": "no (INCONCLUSIVE)"}
    assert "`search.budget_test=ci`" in md
    md, _, _ = summarize([record("point")], tmp_path)
    assert within(md) == {"onnx": "yes (PASS)", "emb": "yes (INCONCLUSIVE)"}
    bad = Candidate("x", 1.0, -0.003, val_delta_lo=-0.004, val_delta_hi=-0.002)
    md, _, _ = summarize(
        [replace(record("point"), candidates=[bad], best="x", within_budget=False)], tmp_path
    )
    assert within(md) == {"x": "no (FAIL)"}
    with pytest.raises(ConfigError, match=r"search.budget_test: expected one of \('point', 'ci'\)"):
        typed(compose(["experiment=search", "search.budget_test=strict"]).search, SearchConfig, "search")


def test_summary_without_a_winner_names_the_best_delta_seen(tmp_path):
    pruned = Candidate("pruned", 2.0, -0.003, val_delta_lo=-0.004, val_delta_hi=-0.002, params=10)
    trial = Trial(0, ["prune.amount=0.5"], max_auc_drop_pct=0.1, objective=-0.2, within_budget=False,
                  best="pruned", candidates=[pruned])  # fmt: skip
    md, winner, files = summarize([trial], tmp_path)
    assert winner is None
    assert "No trial met the budget" in md and "Best val ΔAUC seen: -0.300% [-0.400, -0.200] (`pruned`)" in md
    assert by_variant(md)["0", "pruned"]["val ΔAUC [95% CI]"] == "-0.300% [-0.400, -0.200]"
    assert (tmp_path / SUMMARY_FILE).read_text() == md and all(f.exists() for f in files)


def test_a_search_space_key_that_does_not_exist_is_named():
    cfg = compose(["experiment=search"])
    OmegaConf.set_struct(cfg, False)
    cfg.hydra = {"sweeper": {"params": {"prune.amount": "interval(0.1, 0.2)", "prune.amout": "choice(1)"}}}
    with pytest.raises(ConfigError, match=r"hydra\.sweeper\.params\.prune\.amout"):
        check_space(cfg)
    cfg.hydra.sweeper.params = {"prune.amount": "interval(0.1, 0.2)"}
    check_space(cfg)


def test_search_budget_is_typed():
    with pytest.raises(ConfigError, match="search.max_auc_drop_pct"):
        compose(["experiment=search", "search.max_auc_drop_pct=a lot"])


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("search")
    premade_store(store)
    return store


def sweep(store: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = store / name
    args = [
        *TOY,
        f"tracking.uri=sqlite:///{store}/mlflow.db",
        f"tracking.artifact_root={store}/artifacts",
        f"cache_dir={store}/cache",
        f"hydra.sweep.dir={name}",  # relative to cwd=store, as a user's multirun/... is
        *extra,
    ]
    p = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "-m", *args],
        cwd=store,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return p, out


def trial_runs(store: Path, sweep_dir: Path) -> list:
    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    exp = client.get_experiment_by_name("search")
    runs = client.search_runs([exp.experiment_id], f"tags.`multirun.sweep_dir` = '{sweep_dir}'")
    return runs


# The smoke preset's load test, cut down further: one repeat, one capacity step, short windows at 150 req/s
# after 0.2 s of warm-up, no settling traffic and no unloaded runs (~1 s and ~1.5 s a served variant, 5 of
# them; the front's summary reads capacity and the common load only; tests/test_loadtest_study.py and
# test_pipeline cover both)
# (what the summary shows is under test, not the figures: an overloaded baseline's p99 of +inf is fine).
TOY_LOAD = [
    "loadtest.warmup_s=0.2",
    "loadtest.drain_s=1",
    "loadtest.requests.n=500",
    "loadtest.capacity={slo_p99_ms: 100.0, start_rate: 150, min_rate: 150, max_rate: 150, steps: 1,"
    " step_requests: 368, max_step_requests: 368, step_warmup_s: 0.2}",
    "loadtest.study={repeats: 1, common_rate: 150, equal_util_fraction: 0, unloaded_requests: 100, settle_s: 0,"
    " unloaded_repeats: 0, load_requests: 368}",
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_trial_sweep_load_tests_the_front_and_names_a_winner_within_the_budget(store):
    """Both fidelities in one sweep (one subprocess keeps make test short): trials screened in process, then
    the budget-meeting front load-tested beside the baseline. A budget no trial meets is covered by
    test_summary_without_a_winner_names_the_best_delta_seen and the penalty test above."""
    p, out = sweep(store, "ok", "search.max_auc_drop_pct=50", *TOY_LOAD)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    trials = [Trial.load(f) for f in sorted(out.glob(f"*/{TRIAL_FILE}"))]
    assert len(trials) == 2
    runs = trial_runs(store, out)
    parents = [
        r for r in runs if "mlflow.parentRunId" not in r.data.tags and "search.summary" not in r.data.tags
    ]
    assert len(parents) == 2  # each trial is an MLflow run
    assert {r.info.run_id for r in parents} == {t.parent_run for t in trials}
    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    cached = []
    for r in parents:
        assert r.data.tags["search.within_budget"] in ("true", "false")
        kids = client.search_runs([r.info.experiment_id], f"tags.mlflow.parentRunId = '{r.info.run_id}'")
        cached += [k.data.tags["cached"] for k in kids if k.data.tags.get("variant") == "baseline"]
    assert sorted(cached) == ["False", "True"]  # the baseline was built once, reused by the second trial
    # main's return value reached Optuna: the sweeper's best value is the best trial objective
    best = OmegaConf.load(out / "optimization_results.yaml").best_value
    assert best == pytest.approx(max(t.objective for t in trials))
    md = (out / SUMMARY_FILE).read_text()
    shown = {r["trial"]: r["trial objective"] for r in table(md) if r["trial"]}  # not the reference
    assert shown == {str(t.trial): f"{t.objective:.4g}" for t in trials}
    for t in trials:  # every lever of the space built a variant; the batched one is known as such
        built = {c.name: c.batched_from for c in t.candidates}
        assert built == {"pruned": "", "distilled": "", "distilled_onnx": "", "distilled_emb": "",
                         "distilled_onnx_batched": "distilled_onnx"}, t  # fmt: skip
        assert t.best != "distilled_onnx_batched"
        # what the size objective and the budget test read: every file's size, the sweep's settings
        assert t.objective_kind == "throughput" and t.budget_test == "point"
        assert t.baseline_size_mb > max(c.size_mb for c in t.candidates) > 0
    for t in trials:  # the objective is the in-process throughput of the trial's best variant in budget
        if t.within_budget:
            c = t.candidate(t.best)
            assert -c.val_delta_rel * 100 <= 50 and t.objective == pytest.approx(1000 / c.rank_p50_ms)
    # the second fidelity: the front within the budget served beside the baseline and load-tested
    assert "capacity at p99 ≤ 100.0 ms" in md and "common load 150.0 req/s" in md
    front_load = json.loads((out / "front_load.json").read_text())
    assert front_load["reference"] == "baseline"
    assert (out / "search_front_load.png").exists()
    assert (out / "front_load" / "requests.jsonl").exists()
    served = {d.name for d in (out / "front_load").iterdir() if d.is_dir()}
    names = {f"t{t.trial}_{c.name}" for t in trials for c in t.candidates}
    assert "baseline" in served and served - {"baseline"} and served - {"baseline"} <= names
    (summary,) = [r for r in runs if r.data.tags.get("search.summary") == "true"]
    qps = {k: v for k, v in summary.data.metrics.items() if k.startswith("front_max_qps_t")}
    assert "front_max_qps_baseline" in summary.data.metrics
    # an overloaded baseline (a busy machine) has no valid common-load round, so no p99, or >= 1 % failed
    # requests, so a p99 of +inf (which the SQL store keeps as the largest float): logged iff measured
    for name, p99 in front_load["p99_ms"].items():
        assert (p99 is not None) == (f"front_e2e_p99_ms_{name}" in summary.data.metrics), (name, p99)
    assert any(k.startswith("front_e2e_p99_ms_") for k in summary.data.metrics), summary.data.metrics
    assert qps, summary.data.metrics
    winner = summary.data.tags["search.winner_trial"]
    if winner != "none":
        assert f"**Winner: trial {winner}**" in md
        assert summary.data.metrics["search_winner_max_qps"] == max(qps.values())


def test_a_sweep_over_an_unknown_key_stops_before_any_trial(store):
    p, out = sweep(store, "bad", '+hydra.sweeper.params={prune.amout: "interval(0.1,0.2)"}')
    assert p.returncode != 0
    assert "ConfigError: hydra.sweeper.params.prune.amout" in p.stderr
    assert not list(out.glob(f"*/{TRIAL_FILE}"))
