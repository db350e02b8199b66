"""The load study end to end: real servers (one per variant), real Locust processes, offline rescoring."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
from conftest import make_variant, premade_store

from reco.cli.compose import compose
from reco.loadtest.budget import Budget, BudgetTooSmall, Skipped, summary
from reco.loadtest.config import loadtest_config
from reco.loadtest.correctness import check_scores
from reco.loadtest.outcome import Capacity, LoadOutcome, LoadRun
from reco.loadtest.runs import make_run
from reco.loadtest.study import median_capacity
from reco.pipeline import _log_variant, log_report_metrics, study_log
from reco.report import StudyContext, VariantResult
from reco.report import study_metrics as report_metrics
from reco.serve.config import serve_config
from reco.stats import Verdict
from reco.tracking import Tracker
from reco.variant import Variant

pytestmark = pytest.mark.timeout(600)


def study_cfg(*serve: str, **over) -> dict:
    lt = loadtest_config(compose([]).loadtest)
    r = dataclasses.replace
    # Only the study's bookkeeping is under test: a busy machine must not void its runs.
    # Short windows (a p99 CI needs 368 requests only in the capacity steps) against a fast server.
    lt = r(
        lt,
        warmup_s=0.2,
        drain_s=2.0,
        loadgen=r(lt.loadgen, keep_warm=False, max_cpu_pct=1000, max_lag_ms=1000),
    )
    cap = {"slo_p99_ms": 5000.0, "start_rate": 150, "min_rate": 150, "max_rate": 150, "steps": 1}
    # 1,000 requests a step: at the minimum (368) a p99's upper bound is the last request, and any sign of
    # dependence between requests opens it (reco.stats.dependent)
    cap.update(
        {"step_requests": 1000, "max_step_requests": 1000, "step_warmup_s": 0.2, **over.pop("capacity", {})}
    )
    st = {
        "repeats": 2,
        "common_rate": 150.0,
        "equal_util_fraction": 0.5,
        "unloaded_requests": 100,
        # no settling traffic (~1 s a variant) where it is not under test: the interleaving test asks for it
        "settle_s": 0.0,
    }
    st.update(
        load_requests=100,
        equal_util_requests=100,
        correctness=r(lt.study.correctness, every=10),
        **over.pop("study", {}),
    )
    lt = r(lt, capacity=r(lt.capacity, **cap), study=r(lt.study, **st), **over)
    return {
        "loadtest": lt,
        "serve": serve_config(
            compose(["serve.n_candidates=50", "serve.keep_warm=false", *(f"serve.{o}" for o in serve)]).serve
        ),
    }


@pytest.fixture(scope="module")
def built(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    vdir, dpath = make_variant(tiny_data, root, onnx=True)
    return Variant.load(vdir), dpath


@pytest.mark.slow
def test_study_interleaves_repeats_and_returns_every_measurement(tiny_data, built, tmp_path):
    variant, dpath = built
    before = copy.deepcopy(variant.__dict__)
    calls: list[tuple[str, list[Path], str]] = []
    variants = [("baseline", variant), ("student", variant)]
    tracker, run_ids = mlflow_runs(tmp_path, [n for n, _ in variants])
    # The features come from a Redis the study starts and loads itself (serve.redis.start): the
    # correctness check below then compares scores served from Redis with offline ones from memory.
    cfg = study_cfg("features=redis", study={"settle_s": 0.5})
    out = run_study_logged(variants, tiny_data, dpath, cfg, tmp_path, calls, study_log(tracker, run_ids))

    assert variant.__dict__ == before  # nobody's objects are mutated: everything is in the return value
    assert out.slo_p99_ms == 5000.0 and out.slo_source.startswith("fixed") and out.reference == "baseline"
    assert out.common_rate_qps == 150.0 and out.keep_warm is False
    # Each server got its settling traffic before anything was measured, and none of it is a result.
    for name in ("baseline", "student"):
        assert (tmp_path / name / "settle" / "latencies.csv").stat().st_size > 0
    assert not [d for *_, d in calls if "settle" in d]
    # A real server's p99 over 1,000 requests may stay open above (slow requests come in bursts on a busy
    # machine: reco.stats.dependent), so a step at 150 req/s may PASS or not; equal utilisation runs for
    # the variants with a capacity.
    has_cap = [n for n in ("baseline", "student") if median_capacity(out.outcomes[n])]
    # Interleaved in blocks: every kind of run gives each variant one run per block (A B | B A, never
    # A A B B), in a random order within the block (RMIT). The reference's first capacity search runs
    # before the common load (its capacity sets it), the other variant's after it (a lower priority).
    for sub, names in (("unloaded", None), ("capacity", None), ("common", None), ("equal_util", has_cap)):
        names = names if names is not None else ["baseline", "student"]
        order = [(name, d) for name, _, d in calls if d.startswith(f"loadtest/{sub}/")]
        blocks = [order[i : i + len(names)] for i in range(0, len(order), max(len(names), 1))]
        assert [sorted(n for n, _ in b) for b in blocks] == [sorted(names)] * (2 if names else 0), order
        assert [{d for _, d in b} for b in blocks] == [{f"loadtest/{sub}/r{r}"} for r in range(len(blocks))]
        if sub == "capacity":
            assert [n for n, _ in blocks[0]] == names
    for kind in ("unloaded", "common"):
        for name in ("baseline", "student"):
            assert [r.block for r in getattr(out.outcomes[name], kind)] == [0, 1]
    # Unloaded rounds are spread: with 2 repeats, one before the capacity searches, one after everything.
    at = [d for *_, d in calls]
    assert at.index("loadtest/unloaded/r0") < at.index("loadtest/capacity/r0")
    first = [i for i, (n, _, d) in enumerate(calls) if d == "loadtest/capacity/r0"]
    common = [i for i, (*_, d) in enumerate(calls) if d.startswith("loadtest/common/")]
    assert calls[first[0]][0] == "baseline" and first[0] < min(common) < max(common) < first[-1]
    assert at.index("loadtest/unloaded/r1") > max(
        i for i, d in enumerate(at) if d.startswith(("loadtest/equal_util/", "loadtest/common/"))
    )
    for name in ("baseline", "student"):
        o = out.outcomes[name]
        assert o.error == ""
        n_eq = 2 if name in has_cap else 0
        assert [len(o.unloaded), len(o.capacity), len(o.common), len(o.equal_util)] == [2, 2, 2, n_eq]
        assert all(r.kind == "unloaded" and r.n == 100 and r.offered_qps is None for r in o.unloaded)
        assert all(r.quantiles["p99"].value is None for r in o.unloaded)  # n=100 cannot support a p99
        # Only a PASS at 150 req/s gives a capacity; an INCONCLUSIVE step or a FAIL (a busy CI machine can
        # fail >= 1 % of the requests at 150 req/s: p99 = +inf) gives none.
        for c in o.capacity:
            assert c.highest_pass == (150.0 if c.steps[0].verdict is Verdict.PASS else 0.0), c.steps
        assert all(r.kind == "common" and r.offered_qps == 150.0 and r.n == 100 for r in o.common)
        assert all(r.offered_qps == 0.5 * median_capacity(o) for r in o.equal_util)
        # Every 10th request of both common-load windows, rescored offline: the same scores.
        c = o.correctness
        assert c is not None and c.n_requests == 2 * 100 // 10 and c.passed and c.max_abs_diff <= 1e-5
    for final in pipeline_metrics(out, variants, tracker, run_ids).values():
        assert final["max_qps_at_slo"] in (0.0, 75.0, 150.0) and final["slo_p99_ms"] == 5000.0
        assert final["correctness_passed"] == 1.0 and final["n_repeats"] == 2.0
        # 2 repeats: Student t with 1 df may open the interval above; an open (+inf) bound is not logged
        assert final["e2e_p50_ms_lo"] <= final["e2e_p50_ms"] <= final.get("e2e_p50_ms_hi", math.inf)
        assert "unloaded_e2e_p50_ms" in final and "unloaded_e2e_p99_ms" not in final  # n/a: not logged
    # The servers were stopped, and so was the one Locust process that ran every window.
    left = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
    assert not [c for c in left if "reco.serve" in c or "locust" in c or "redis-server" in c], left
    assert list((tmp_path / "redis").glob("redis-*.log"))  # the study's own Redis ran
    (kept_log,) = tmp_path.glob("locust-*.log")  # one kept process for the 2 x (1 + 2 + 2 + 2 + 2) windows
    # Where the time went, per kind of run and variant (the report's setup section prints it).
    kinds = {"servers' start", "settle", "unloaded", "capacity", "common"} | (
        {"equal_util"} if has_cap else set()
    )
    assert set(out.seconds) == kinds
    assert all(
        set(by) == ({"baseline", "student"} if k != "equal_util" else set(has_cap)) and min(by.values()) > 0
        for k, by in out.seconds.items()
        if k != "servers' start"
    )
    assert json.loads((tmp_path / "time_spent.json").read_text()) == out.seconds

    # The check can fail: one served score off by 1e-3 is caught.
    scores = sorted((tmp_path / "student" / "common").glob("r*/latencies.csv.scores.jsonl"))
    rows = [json.loads(ln) for ln in scores[0].read_text().splitlines()]
    rows[0]["items"][0][1] += 1e-3
    bad = tmp_path / "bad.scores.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    serve = serve_config(study_cfg()["serve"])
    check = check_scores(variant, tiny_data, serve, tmp_path / "requests.jsonl", [bad], 1e-5)
    assert not check.passed and check.max_abs_diff == pytest.approx(1e-3, rel=1e-3)


def test_unloaded_rounds_are_spread_over_the_study():
    from reco.loadtest.study import checkpoints, unloaded_slots

    points = checkpoints(3)
    assert points[0] == "start" and points[-1] == "end" and len(points) == 6
    assert points[3] == "after common-load round 1"
    assert (
        unloaded_slots(1, 6) == [0] and unloaded_slots(2, 6) == [0, 5] and unloaded_slots(3, 6) == [0, 3, 5]
    )
    assert unloaded_slots(6, 6) == [0, 1, 2, 3, 4, 5] and unloaded_slots(0, 6) == []


def test_a_capacity_search_starts_where_a_queue_of_the_unloaded_latencies_meets_the_slo():
    """M/M/1 check of reco.loadtest.predict: exponential service of mean 10 ms has the p99 sojourn
    ln(100) / (mu - lambda), so a 100 ms SLO is met up to lambda = 100 - 46.05 = 53.9 req/s."""
    from reco.loadtest.predict import predicted_capacity

    service = np.random.default_rng(1).exponential(10.0, 20_000)
    assert predicted_capacity(service, 100.0) == pytest.approx(100 - math.log(100) / 0.1, rel=0.1)
    assert predicted_capacity(service, 30.0) is None  # even an idle server's p99 (46 ms) misses it
    assert predicted_capacity([math.inf], 100.0) is None


def test_relative_slo_takes_the_median_of_reference_repeats_run_first(tiny_data, built, tmp_path):
    """repeats=2, reference_repeats=3: the reference's round 0 and two extra runs come before the SLO
    (the median of those 3 p99s), its round 1 at the end, spread like every variant's."""
    variant, dpath = built
    cfg = study_cfg(
        capacity={"slo_p99_ms": None, "slo_factor": 3.0, "reference_repeats": 3, "enabled": False},
        study={"repeats": 2, "unloaded_requests": 368, "equal_util_fraction": 0},
    )
    calls: list = []
    tracker, run_ids = mlflow_runs(tmp_path, ["baseline"])
    forward = study_log(tracker, run_ids)
    out = run_study_logged([("baseline", variant)], tiny_data, dpath, cfg, tmp_path, calls, forward)
    o = out.outcomes["baseline"]
    assert o.error == "" and len(o.unloaded) == 4
    at = [d for *_, d in calls if d.startswith("loadtest/")]
    assert at == [f"loadtest/unloaded/r{r}" for r in (0, 2, 3)] + [
        "loadtest/common/r0",
        "loadtest/common/r1",
        "loadtest/unloaded/r1",
    ]
    p99s = sorted(o.unloaded[i].quantiles["p99"].value for i in (0, 1, 2))  # the runs before the SLO
    assert out.slo_p99_ms == pytest.approx(3.0 * p99s[1]) and "over 3 runs" in out.slo_source
    final = pipeline_metrics(out, [("baseline", variant)], tracker, run_ids)["baseline"]
    assert final["slo_p99_ms"] == pytest.approx(out.slo_p99_ms) and final["n_repeats"] == 2.0


def test_a_reference_with_no_passing_rate_still_gets_the_others_a_common_load(tiny_data, built, tmp_path):
    """An SLO no server can meet: the reference's search passes nothing, yet every variant is measured at
    65 % of the lowest rate the reference was tried at, and the outcome says so; in common_repeats rounds,
    not the capacity's repeats."""
    variant, dpath = built
    # No latency is under 0.01 ms: any window with a p99 (368 requests, not the 1,000 a PASS may need) FAILs.
    # No unloaded runs: nothing here reads them (the fixed SLO does not), and the other tests check them.
    cfg = study_cfg(
        capacity={"slo_p99_ms": 0.01, "step_requests": 368, "max_step_requests": 368},
        study={
            "repeats": 1,
            "common_repeats": 2,
            "common_rate": None,
            "equal_util_fraction": 0,
            "unloaded_repeats": 0,
        },
    )
    out = run_study_logged([("baseline", variant), ("student", variant)], tiny_data, dpath, cfg, tmp_path, [])
    assert [c.highest_pass for c in out.outcomes["baseline"].capacity] == [0.0]
    assert out.common_rate_qps == pytest.approx(0.65 * 150) and "lowest rate" in out.common_source
    assert all(len(o.common) == 2 and not o.error and not o.unloaded for o in out.outcomes.values())


def test_failed_reference_without_a_slo_is_a_clear_error(tiny_data, built, tmp_path):
    variant, dpath = built
    broken = Variant("baseline", "train", None, "torch", {}, dir=str(tmp_path / "no-such-variant"))
    cfg = study_cfg(
        capacity={"slo_p99_ms": None, "reference_repeats": 5}, study={"repeats": 1, "common_rate": None}
    )
    out = run_study_logged([("baseline", broken), ("student", variant)], tiny_data, dpath, cfg, tmp_path, [])
    assert out.slo_p99_ms is None and out.slo_source.startswith("none: the reference 'baseline' failed")
    assert "server did not start" in out.outcomes["baseline"].error
    err = out.outcomes["student"].error
    assert (
        "no SLO" in err and "'baseline' failed its load test" in err and "loadtest.capacity.slo_p99_ms" in err
    )
    assert "no common load" in err and "loadtest.study.common_rate" in err
    s = out.outcomes["student"]
    assert len(s.unloaded) == 1 and not s.capacity and not s.common  # measured what it could, nothing more


def pipeline_metrics(out, variants, tracker, run_ids) -> dict[str, dict[str, float]]:
    """Fill the variants' MLflow runs as the pipeline does after the study (their own metrics, then the
    report's figures, on top of the raw files the study forwarded) and check that every metric holds one
    value (one name, one meaning) and every kind of run's files arrived; returns each run's metrics."""
    results = [VariantResult(dataclasses.replace(v, name=n), out.outcomes[n]) for n, v in variants]
    ctx = StudyContext("unit", variants[0][0], 0.005, 0.01, out)
    for n, v in variants:
        _log_variant(tracker, run_ids[n], v, log_models=False)
    log_report_metrics(tracker, run_ids, report_metrics(results, ctx))
    client, logged = tracker.client, {}
    for name, run_id in run_ids.items():
        m = logged[name] = client.get_run(run_id).data.metrics
        assert {k: len(client.get_metric_history(run_id, k)) for k in m} == dict.fromkeys(m, 1), name
        kinds = {a.path for a in client.list_artifacts(run_id, "loadtest")}
        assert {"loadtest/unloaded", "loadtest/common"} <= kinds, kinds
    return logged


def mlflow_runs(tmp_path: Path, names: list[str]) -> tuple[Tracker, dict[str, str]]:
    """A real MLflow store (sqlite, artifacts on disk) under tmp_path with a parent run and one child run per name."""
    tracker = Tracker(f"sqlite:///{premade_store(tmp_path)}", "study", str(tmp_path / "artifacts"))
    parent = tracker.start_run("study")
    return tracker, {n: tracker.start_run(n, parent_id=parent) for n in names}


def run_study_logged(variants, data, dpath, cfg, out_dir, calls, forward=None, clock=time.time):
    """run_study with every log call recorded in `calls` (and handed on to `forward`, e.g. the pipeline's)."""
    from reco.loadtest.study import run_study

    def log(name: str, paths: list[Path], subdir: str) -> None:
        assert all(p.exists() for p in paths)
        calls.append((name, paths, subdir))
        if forward is not None:
            forward(name, paths, subdir)

    return run_study(variants, data, dpath, cfg["loadtest"], cfg["serve"], out_dir, log, clock=clock)


def test_a_budget_too_small_stops_before_the_first_window(tiny_data, built, tmp_path):
    """No server starts and no window runs: the error names the flag and the minimum it needs."""
    variant, dpath = built
    cfg = study_cfg(study={"budget_min": 0.1})
    with pytest.raises(BudgetTooSmall, match=r"loadtest.study.budget_min=0.1 is too small .* at least 1 min"):
        run_study_logged([("baseline", variant), ("student", variant)], tiny_data, dpath, cfg, tmp_path, [])
    assert not list(tmp_path.rglob("latencies.csv"))
    with pytest.raises(BudgetTooSmall, match="expected > 0 minutes or null"):
        run_study_logged(
            [("baseline", variant)], tiny_data, dpath, study_cfg(study={"budget_min": 0}), tmp_path, []
        )


def test_a_spent_budget_skips_and_lists_windows_never_guesses(tiny_data, built, tmp_path):
    """A budget that runs out during the study: what did not fit is skipped (no LoadRun, no figure), listed
    with its kind, and the summary says how much more time would have run it."""
    variant, dpath = built
    cfg = study_cfg(study={"budget_min": 0.6, "repeats": 3, "settle_s": 0.5, "common_rate": 40.0})
    # 0.6 min is about the least the check before the first window lets through (~30 s of it for the
    # servers' start): on a clock three times as fast as the wall it is spent in ~12 real seconds, as on
    # a machine a third as fast; some windows still run and the rest are skipped
    t0 = time.time()
    out = run_study_logged(
        [("baseline", variant), ("student", variant)],
        tiny_data,
        dpath,
        cfg,
        tmp_path,
        [],
        clock=lambda: t0 + 3.0 * (time.time() - t0),
    )
    assert out.budget.startswith("0.6 min, used") and "skipped" in out.budget, out.budget
    ran = sum(
        len(o.unloaded) + len(o.capacity) + len(o.common) + len(o.equal_util) for o in out.outcomes.values()
    )
    skipped = int(out.budget.split("skipped ")[1].split(" ")[0])
    # every window either ran or is listed, but equal utilisation, which needs a capacity that a search cut
    # short by the budget may not have found
    no_cap = sum(3 for o in out.outcomes.values() if not median_capacity(o))
    assert skipped > 0 and ran + skipped + no_cap >= 2 * 3 * 4 >= ran + skipped
    assert "would have run them" in out.budget, out.budget  # every skipped window has an estimate
    assert all(not o.error for o in out.outcomes.values())  # skipping is not a failure


def test_median_capacity_leaves_out_a_search_the_budget_stopped_before_any_pass():
    def o(*caps):
        return LoadOutcome(
            "v", capacity=[Capacity(100.0, hp, None, [], stopped_by_budget=cut) for hp, cut in caps]
        )

    assert median_capacity(o((95.0, False), (0.0, True))) == 95.0  # not the median of 95 and 0
    assert median_capacity(o((0.0, True))) is None  # nothing decided: no capacity to load at
    assert median_capacity(o((95.0, True), (0.0, False), (0.0, False))) is None  # decided: capacity 0


def test_budget_summary_and_deadline():
    b = Budget(None)
    assert not b.over() and summary(b).startswith("none")
    now = [1000.0]
    b = Budget(1.0, start=now[0], clock=lambda: now[0])
    assert not b.over() and not b.over(reserve_s=59.0) and b.over(reserve_s=61.0)
    now[0] += 120.0
    assert b.over() and b.used_min() == 2.0 and b.more_min() == 0.0
    b.skipped.append(Skipped("v", "common", "common run 2", 30.0))
    assert "skipped 1 windows (1 common)" in summary(b) and "about 2 min would have run them" in summary(b)


def test_a_low_priority_window_must_end_before_the_reserve(tmp_path):
    """An equal-utilisation or common-load window that would run into the time the later phases need is
    skipped and listed, though it could still start before that reserve; a capacity search stops on its
    own deadline between steps, so only the reserve itself holds it back."""
    from types import SimpleNamespace

    from reco.loadtest.study import _Study

    cfg = study_cfg()
    s = _Study(cfg["loadtest"], cfg["serve"], tmp_path, None)
    s.outcomes = {"baseline": LoadOutcome("baseline")}
    s.servers = {"baseline": None}  # never reached: every call below is skipped or returns before it
    s.budget = Budget(1.0, start=0.0, clock=lambda: 30.0)  # 30 s left
    reserve = 10.0  # the last unloaded blocks
    ran: list[str] = []
    for kind, est in (("equal_util", 25.0), ("common", 25.0)):
        assert (
            s.measure("baseline", kind, f"{kind} run 0", lambda h, k=kind: ran.append(k), est, reserve)
            is None
        )
    assert not ran and [k.kind for k in s.budget.skipped] == ["equal_util", "common"]
    assert [k.est_s for k in s.budget.skipped] == [25.0, 25.0]  # listed with what it would have taken
    # the same window that fits before the reserve runs
    s.servers = {"baseline": SimpleNamespace(proc=SimpleNamespace(poll=lambda: None))}  # a live server
    s.measure("baseline", "equal_util", "equal_util run 1", lambda h: ran.append("fits"), 5.0, reserve)
    assert ran == ["fits"]


def test_an_equal_utilisation_block_runs_whole_or_not_at_all(tmp_path):
    """Its ratios pair each variant with the reference in the same block: time left for one variant's
    window but not the block's skips the block, every window listed (one window alone is no figure)."""
    from reco.loadtest.capacity import window_s
    from reco.loadtest.study import _equal_util_phase, _Schedule, _Study

    cfg = study_cfg()  # equal_util_fraction 0.5, 100 requests a window, 2 repeats
    s = _Study(cfg["loadtest"], cfg["serve"], tmp_path, None)
    names = ["baseline", "student"]
    s.outcomes = {n: LoadOutcome(n, capacity=[Capacity(5000.0, 100.0, 150.0, [])]) for n in names}
    s.servers = dict.fromkeys(names)
    one = window_s(50.0, 100, s.lt.warmup_s)
    s.budget = Budget(1.0, start=0.0, clock=lambda: 60.0 - 1.5 * one)  # one window fits, not two
    ran: list[str] = []
    s.loaded = lambda n, *a: ran.append(n)  # type: ignore[method-assign]
    _equal_util_phase(s, _Schedule("baseline", names, None, ["start", "end"], []))
    assert ran == []
    assert sorted((k.variant, k.what, k.est_s) for k in s.budget.skipped) == [
        (n, f"equal_util block {r}", one) for n in names for r in (0, 1)
    ]
    s.budget = Budget(1.0, start=0.0, clock=lambda: 60.0 - 2.5 * one)  # the block fits
    _equal_util_phase(s, _Schedule("baseline", names, None, ["start", "end"], []))
    assert sorted(ran) == sorted(names * 2)


@pytest.mark.parametrize(("common_repeats", "reserved"), [(None, 2), (1, 1), (10, 2)])
def test_the_first_searches_reserve_no_more_common_rounds_than_repeats(tmp_path, common_repeats, reserved):
    """Issue 43: the QPS gain's searches come before the common load, so they leave it at most `repeats`
    rounds; common_repeats past them run on what is left (all 10 reserved stopped a slow reference's
    search before any rate passed)."""
    from reco.loadtest.capacity import window_s
    from reco.loadtest.study import _reserve, _Study

    cfg = study_cfg(study={"repeats": 2, "common_repeats": common_repeats, "common_rate": 10.0})
    s = _Study(cfg["loadtest"], cfg["serve"], tmp_path, None)
    s.outcomes = {n: LoadOutcome(n) for n in ("baseline", "student")}
    s.servers = dict.fromkeys(s.outcomes)
    window = window_s(10.0, cfg["loadtest"].study.load_requests, cfg["loadtest"].warmup_s)
    assert _reserve(s, "baseline", [], 200.0) == pytest.approx(reserved * 2 * window)


def test_the_qps_gains_two_searches_bisect_to_their_own_tolerance(tmp_path):
    """Issue 43: the QPS gain's interval is the product of the headline's and the reference's brackets, so
    each may bisect further than the other variants' searches; unset, a search keeps capacity.tolerance."""
    from reco.loadtest.study import _Study

    cfg = study_cfg(study={"headline_tolerance": 0.2, "reference_tolerance": 0.15})
    s = _Study(cfg["loadtest"], cfg["serve"], tmp_path, None)
    s.headline = "student"
    tol = cfg["loadtest"].capacity.tolerance
    assert {n: s.search_config(n, 5.0).tolerance for n in ("baseline", "student", "other")} == {
        "baseline": 0.15,
        "student": 0.2,
        "other": tol,
    }
    assert s.search_config("other", 7.0).start_rate == 7.0
    cfg = study_cfg()
    assert (
        _Study(cfg["loadtest"], cfg["serve"], tmp_path, None).search_config("baseline", 5.0).tolerance == tol
    )


def test_the_references_steps_stop_at_its_own_request_cap(tmp_path):
    """Issue 43: study.reference_max_step_requests caps the reference's steps alone, its looks (and so each
    look's Bonferroni confidence) counted to that cap; the other variants keep capacity.max_step_requests.
    A step that never decides pools exactly the cap, then is INCONCLUSIVE."""
    from reco.loadtest.capacity import run_step
    from reco.loadtest.study import _Study

    capacity = {"step_requests": 600, "max_step_requests": 8000, "max_step_s": None, "screen_s": 0.0}
    cfg = study_cfg(capacity=capacity, study={"reference_max_step_requests": 4800})
    s = _Study(cfg["loadtest"], cfg["serve"], tmp_path, None)
    s.headline = "student"
    ref, other = s.search_config("baseline", 5.0), s.search_config("student", 5.0)
    assert (ref.max_step_requests, ref.looks, other.max_step_requests, other.looks) == (4800, 4, 8000, 5)
    assert ref.step_conf == pytest.approx(1 - 0.05 / 4) and other.step_conf == pytest.approx(1 - 0.05 / 5)
    rng = np.random.default_rng(0)
    windows: list[int] = []

    def straddling(rate: float, n: int, out: Path) -> LoadRun:
        # 1.1 % of requests just past the SLO: the p99's interval straddles it at every look up to 4,800
        windows.append(n)
        lat = np.where(rng.random(n) < 0.011, 250.0, rng.uniform(50.0, 150.0, n))
        return make_run(lat, kind="capacity", offered_qps=rate, window_s=n / rate)

    step = run_step(straddling, 40.0, 200.0, ref, tmp_path / "ref")
    assert step.verdict == Verdict.INCONCLUSIVE and step.run.n == 4800 and "stopped" not in step.reason
    assert windows == [600, 600, 1200, 2400]


def test_gate_first_searches_start_below_the_prediction_cheapest_first():
    """Issue 43: with study.gate_start_fraction the other variants' first searches start at that fraction of
    their predicted capacity (never below the common load), cheapest first, each with at least the time a
    PASS there takes (pass_s). Their first step is capped at the look a PASS needs (pass_look): undecided
    there, the search steps down. A repeat of a variant that has passed nothing yet is such a search
    again, first in its round, a step below the lowest rate tried; the others repeat as before, each on
    its share of the round's expected time. The searches themselves are recorded here, not run: what is
    under test is the schedule."""
    from reco.loadtest.capacity import pass_look, pass_s
    from reco.loadtest.study import _more_searches, _Schedule, checkpoints

    over = {
        "study": {"gate_start_fraction": 0.5, "repeats": 2},
        "capacity": {"min_rate": 1.0, "max_rate": 1e3},
    }
    lt = study_cfg(**over)["loadtest"]
    predicted = {"base": 10.0, "slow": 30.0, "fast": 400.0, "mid": 100.0, "head": 300.0}
    search_s = {"base": 100.0, "slow": 50.0, "fast": 10.0, "mid": 30.0, "head": 20.0}
    calls: list[tuple] = []
    outcomes = {n: LoadOutcome(n) for n in predicted}

    def searched(name: str, rate: float, passed: bool) -> Capacity:
        return SimpleNamespace(highest_pass=rate if passed else 0.0, steps=[SimpleNamespace(rate=rate)])  # type: ignore[return-value]

    for n in ("base", "head"):  # their first searches (_first_searches) passed
        outcomes[n].capacity.append(searched(n, predicted[n], True))

    class Searches:  # the _Study surface _more_searches uses
        def __init__(self) -> None:
            self.lt = lt
            self.outcomes = outcomes

        def alive(self) -> list[str]:
            return list(predicted)

        def per_window_s(self, name: str, kind: str) -> float:
            return 1.0

        def start_rate(self, name, slo=None, fraction=None, floor=0.0):
            return max(predicted[name] * (1.2 if fraction is None else fraction), floor)

        def search_s(self, name, slo):
            return search_s[name]

        def capacity(self, name, r, slo, reserve_s, share=1.0, start=None, own_s=0.0, first_cap=None):
            calls.append((name, r, start, share, own_s, first_cap))
            if start is not None:  # every gate search but mid's passes its first step
                outcomes[name].capacity.append(searched(name, start, name != "mid"))

    plan = _Schedule("base", list(predicted), "head", checkpoints(2), [0, 4])
    _more_searches(Searches(), 200.0, plan, common=20.0)  # type: ignore[arg-type]
    first = [c for c in calls if c[1] == 0]
    assert [c[0] for c in first] == ["fast", "mid", "slow"]  # cheapest PASS first; not the first searches'
    assert [c[2] for c in first] == [200.0, 50.0, 20.0]  # 0.5 x predicted, the slow one at the common load
    need = [pass_s(c[2], lt.capacity) for c in first]
    assert [c[4] for c in first] == pytest.approx(need)
    assert [c[3] for c in first] == pytest.approx([sum(need[i:]) / need[i] for i in range(3)])
    assert [c[5] for c in first] == [pass_look(c[2], lt.capacity)[0] for c in first]
    again = [c for c in calls if c[1] == 1]
    down = lt.capacity.undecided_step_down or lt.capacity.growth
    assert again[0][0] == "mid" and again[0][2] == pytest.approx(50.0 / down)  # below its undecided 50
    assert again[0][4] == pytest.approx(pass_s(50.0 / down, lt.capacity))
    assert [c[0] for c in again[1:]] == ["base", "slow", "fast", "head"]
    assert all(c[2] is None and c[4] == 0.0 and c[5] is None for c in again[1:])
    need = [again[0][4]] + [search_s[c[0]] for c in again[1:]]
    assert [c[3] for c in again] == pytest.approx([sum(need[i:]) / need[i] for i in range(5)])

    # A variant whose pooled p99 at the common load closed within the SLO has its gate decided: its
    # search (a bracket only) waits for the others'. One whose p99 is open, or past the SLO, does not.
    rng = np.random.default_rng(0)

    def common(scale_ms: float, n: int) -> list:
        return [make_run(rng.exponential(scale_ms, n), kind="common", offered_qps=20.0, window_s=n / 20.0)]

    outcomes["fast"].common = common(2.0, 3000)  # p99 ~9 ms, closed at 3,000 requests: decided
    outcomes["mid"].common = common(2.0, 100)  # p99 cannot close on 100: still open
    outcomes["slow"].common = common(100.0, 3000)  # closed, but past the 200 ms SLO: not a PASS
    calls.clear()
    for n in ("fast", "mid", "slow"):
        outcomes[n].capacity.clear()
    _more_searches(Searches(), 200.0, plan, common=20.0)  # type: ignore[arg-type]
    assert [c[0] for c in calls if c[1] == 0] == ["mid", "slow", "fast"]
