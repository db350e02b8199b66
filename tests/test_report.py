"""The comparison report on a study built from synthetic latency arrays.

Every LoadRun below is built the way the load test builds one: from an array of per-request latencies
(failures as +inf) through reco.loadtest.histogram.quantiles, so the report reads real figures with real CIs.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import math
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import premade_store

from reco.cli.compose import compose
from reco.config import ConfigError
from reco.experiment import experiment_config
from reco.loadtest.histogram import quantiles
from reco.loadtest.outcome import (
    Capacity,
    CapacityStep,
    CorrectnessCheck,
    LoadOutcome,
    LoadRun,
    StudyOutcome,
)
from reco.pipeline import _log_variant, log_report_metrics
from reco.report import Machine, StudyContext, VariantResult, sections, study_metrics, write_report
from reco.report.figures import bracket, bracket_at, capacity_gain, highest_pass_at, pool, study_figures
from reco.report.gate import gate, worst
from reco.report.markdown import headline
from reco.report.plots import (
    _colors,
    capacity_curve,
    draw_latency_percentiles,
    draw_qps_vs_p99,
    pareto_front,
    qps_vs_p99,
)
from reco.report.table import open_p99_note
from reco.report.targets import Basis, Outcome, evaluate, target_line
from reco.stats import Estimate, Verdict, verdict_at_least, verdict_at_most
from reco.stats.dependent import dependent_quantile_ci
from reco.tracking import Tracker
from reco.variant import Variant

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SLO = 150.0
GRID = (0.25, 0.45, 0.75, 0.9, 1.1, 1.5, 1.9)  # capacity rates, x the variant's nominal knee
KNEE_REPEATS = (1.0, 1.2, 0.85)  # each repeat's true knee, x nominal: drift between repeats


# Builders: real latency arrays -> the typed outcomes the load test produces ----------------------------
def load_run(kind, ok_ms, *, n_failed=0, offered=None, valid=True, reason="", stages=None):
    """A window of `ok_ms` in send order with `n_failed` failures spread evenly through it."""
    ok_ms = np.asarray(ok_ms, np.float64)
    lat = np.insert(ok_ms, np.linspace(0, len(ok_ms), n_failed, endpoint=False).astype(int), np.inf)
    window_s = len(lat) / (0.98 * offered) if offered else 60.0  # open loop: about the offered rate
    return LoadRun(
        kind=kind,
        offered_qps=offered,
        n=len(lat),
        n_failed=n_failed,
        error_rate=n_failed / len(lat),
        qps=(len(lat) - n_failed) / window_s,
        quantiles=quantiles(lat),
        mean_ms=float(np.mean(ok_ms)),
        valid=valid,
        invalid_reason=reason,
        loadgen_cpu_pct=97.0 if not valid else 30.0,
        server_stages=stages or {},
        latencies_ms=lat,
        steal_pct=len(lat) % 5,  # a figure per window the Setup line summarises
    )


def lognormal(p50, n, seed, sigma=0.4):
    return np.random.default_rng(seed).lognormal(np.log(p50), sigma, n)


def capacity(knee: float, seed: int, knee_repeat: float = 1.0, slo: float = SLO) -> Capacity:
    """A capacity search whose p99 grows linearly with the rate: p99(rate) ~ slo * rate / (knee x repeat)."""
    rng = np.random.default_rng(seed)
    steps = []
    for rate in (g * knee for g in GRID):
        target = slo * rate / (knee * knee_repeat)
        run = load_run("capacity", target * rng.uniform(0.5, 1.0, 1000), offered=rate)
        v = verdict_at_most(run.quantiles["p99"], slo)
        steps.append(CapacityStep(rate, run, v, "" if v == Verdict.PASS else f"p99 vs SLO: {v}"))
    passed = [s.rate for s in steps if s.verdict == Verdict.PASS]
    failed = [s.rate for s in steps if s.verdict == Verdict.FAIL]
    return Capacity(slo, max(passed, default=0.0), min(failed, default=None), steps)


def outcome(name, p50, knee, seed, *, common_repeats=3, extra_common=(), correctness=None) -> LoadOutcome:
    def stages(p):
        return {
            "server_parse_mean_ms": 0.05 * p,
            "server_rank_mean_ms": 0.5 * p,
            "server_total_mean_ms": 0.8 * p,
            "server_total_p99_ms": 1.5 * p,
            "cpu_per_request_ms": 0.4 * p,
            # its split (reco.loadtest.scrape.cpu_split): the parts add up to it
            "cpu_per_request_model_ms": 0.25 * p,
            "cpu_per_request_parse_ms": 0.02 * p,
            "cpu_per_request_retrieval_ms": 0.01 * p,
            "cpu_per_request_features_ms": 0.03 * p,
            "cpu_per_request_serialize_ms": 0.04 * p,
            "cpu_per_request_rest_ms": 0.05 * p,
        }

    return LoadOutcome(
        variant=name,
        unloaded=[load_run("unloaded", lognormal(p50, 1200, seed + i)) for i in range(3)],
        common=[
            load_run("common", lognormal(2 * p50, 1200, seed + 10 + i), offered=10.0, stages=stages(2 * p50))
            for i in range(common_repeats)
        ]
        + list(extra_common),
        equal_util=[
            load_run("equal_util", lognormal(1.5 * p50, 1200, seed + 20 + i), offered=0.5 * knee)
            for i in range(3)
        ],
        capacity=[capacity(knee, seed + 30 + i, k) for i, k in enumerate(KNEE_REPEATS)],
        correctness=correctness,
    )


def delta(rel: float, half: float, n: int = 100_000, base_auc: float = 0.8) -> tuple[Estimate, Estimate]:
    """(absolute, relative) ΔAUC as reco.stats.auc_delta returns them."""
    a = Estimate(rel * base_auc, (rel - half) * base_auc, (rel + half) * base_auc, n)
    return a, Estimate(rel, rel - half, rel + half, n)


def variant(name, step, parent, *, auc=0.8, params=100_000, size_mb=4.0, backend="torch", **metrics):
    v = Variant(name=name, step=step, parent=parent, backend=backend, model_config={})
    v.params, v.size_mb, v.flops_per_candidate = params, size_mb, 2 * params
    v.metrics = {"auc": auc, **metrics}
    return v


def context(results, study, **kw) -> StudyContext:
    machine = Machine("Test CPU @ 2 GHz", 2, {"python": "3.11", "torch": "2.13"})
    kw = {"targets": {}, **kw}
    return StudyContext("unit_study", "base", 0.005, 0.01, study, machine, "abc1234", **kw)


def make_study():
    slow = [
        load_run(
            "common", lognormal(240, 1200, 99), offered=10.0, valid=False, reason="loadgen CPU 97% > 90%"
        )
    ]
    results = [
        VariantResult(
            variant("base", "train", None, oracle_auc=0.82, rank_p50_ms=9.0, rank_floor_ms=3.0,
                    profile_rank_ms=10.0, profile_embedding_ms=2.0,
                    profile_interaction_ms=1.0, profile_mlp_ms=6.5, profile_other_ms=0.5),
            outcome("base", 20, 20, 0),
        ),
        # 30 % fewer params, ΔAUC CI [-0.2 %, 0 %]: passes; a 4th, invalid and slow run must be excluded
        VariantResult(
            variant("pruned", "prune", "base", params=70_000, size_mb=3.0),
            outcome("pruned", 20 / 3.4, 45, 100, extra_common=slow, correctness=CorrectnessCheck(200, 3e-7, 1e-5, True)),
            delta(-0.001, 0.001),
        ),
        # fast but ΔAUC CI [-1.2 %, -0.8 %] wholly below -0.5 %: accuracy FAIL; 4 repeats: p999 supported
        VariantResult(
            variant("student", "distill", "pruned", params=10_000, size_mb=0.75, size_ratio=7.0,
                    teacher_val_auc=0.8, student_val_auc=0.79, control_val_auc=0.785, kd_gain_val_auc=0.005,
                    kd_gain_val_auc_lo=0.002, kd_gain_val_auc_hi=0.008),
            outcome("student", 3, 150, 200, common_repeats=4),
            delta(-0.010, 0.002),
        ),
        # ΔAUC CI straddles -0.5 %: INCONCLUSIVE; common p99 ~ 200 ms > SLO: latency FAIL
        VariantResult(
            variant("ort", "accelerate", "pruned", backend="onnxruntime"),
            outcome("ort", 40, 18, 300),
            delta(-0.005, 0.003),
        ),
        # not load-tested: the latency gate cannot vouch
        VariantResult(variant("noload", "accelerate", "pruned"), None, delta(-0.0005, 0.001)),
        VariantResult(variant("broken", "accelerate", "pruned"), status="failed", error="ORT | bad graph\nline 2"),
    ]  # fmt: skip
    results[0].variant.learning_curve = [
        {"train_loss": 0.52, "val_auc": 0.79, "val_logloss": 0.50},
        {"train_loss": 0.45, "val_auc": 0.81, "val_logloss": 0.48},
        {"train_loss": 0.40, "val_auc": 0.805, "val_logloss": 0.49},
    ]
    study = StudyOutcome(SLO, "fixed in the preset (3 x median unloaded p99)", 10.0, True, settle_s=10.0)
    study.outcomes = {r.variant.name: r.load for r in results if r.load}
    targets = {"e2e_speedup": 3.4, "qps_gain": 1.1, "prune_params_pct": 30, "distill_size_ratio": 6,
               "max_auc_drop_pct": 0.5, "bogus": 1}  # fmt: skip
    return results, context(results, study, targets=targets)


@pytest.fixture(scope="module")
def study():
    return make_study()


@pytest.fixture(scope="module")
def figs(study):
    results, ctx = study
    return {f.name: f for f in study_figures(results, ctx)}


@pytest.fixture(scope="module")
def written(study, tmp_path_factory):
    results, ctx = study
    out = tmp_path_factory.mktemp("report")
    return out, write_report(results, ctx, out)


# Reading the written report as data: sections by heading, Markdown tables as cells, CSV rows ------------
def md_sections(md: str) -> dict[str, str]:
    """report.md split at its '## ' / '### ' headings: heading -> the text under it, in order."""
    out: dict[str, list[str]] = {}
    head = None
    for line in md.splitlines():
        m = re.fullmatch(r"#{2,3} (.+)", line)
        if m:
            head = m.group(1)
            assert head not in out, f"heading {head!r} twice"
            out[head] = []
        elif head is not None:
            out[head].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]


def md_tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in `text` as rows of {header: cell}."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            header, rule, *body = block
            assert set(rule) <= set("|-"), rule
            heads = _cells(header)
            rows = [_cells(b) for b in body]
            assert all(len(r) == len(heads) for r in rows), block
            tables.append([dict(zip(heads, r, strict=True)) for r in rows])
            block = []
    return tables


def md_table(text: str) -> list[dict[str, str]]:
    (t,) = md_tables(text)
    return t


def by_variant(rows: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    return {r["variant"].strip("`"): r for r in rows}


def numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?|inf", cell.replace(",", ""))]


def bullets(text: str) -> dict[str, str]:
    """'- Key: value' lines as {key: value}."""
    return dict(ln[2:].split(": ", 1) for ln in text.splitlines() if ln.startswith("- ") and ": " in ln)


def images(text: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)


TARGET_LINE = re.compile(r"- \*\*(?P<word>[A-Z ]+)\*\* `(?P<key>\w+)` — ")


def target_words(md: str) -> dict[str, str]:
    """The Targets section as {target key: its rendered verdict word}."""
    lines = md_sections(md)["Targets"].splitlines()
    return {m["key"]: m["word"] for m in map(TARGET_LINE.match, lines) if m}


def read_csv(path) -> dict[str, dict[str, str]]:
    with open(path) as fh:
        return {r["variant"]: r for r in csv.DictReader(fh)}


def csv_ci(row: dict[str, str], key: str) -> tuple[float, float, float] | None:
    cells = [row[key], row[f"{key}_lo"], row[f"{key}_hi"]]
    return None if "" in cells else tuple(float(c) for c in cells)


# Gate -------------------------------------------------------------------------------------------------
def test_gate_verdicts(study, figs):
    results, ctx = study
    g = {name: gate(f, ctx) for name, f in figs.items()}
    assert (g["base"].accuracy.verdict, g["base"].latency.verdict, g["base"].overall) == (
        "PASS",
        "PASS",
        "PASS",
    )
    assert g["pruned"].overall == Verdict.PASS
    assert g["student"].accuracy.verdict == Verdict.FAIL and g["student"].latency.verdict == Verdict.PASS
    assert g["student"].overall == Verdict.FAIL
    # CI [-0.8 %, -0.2 %] straddles the -0.5 % limit
    assert g["ort"].accuracy.verdict == Verdict.INCONCLUSIVE and g["ort"].reason
    assert g["ort"].latency.verdict == Verdict.FAIL and g["ort"].overall == Verdict.FAIL
    assert g["noload"].accuracy.verdict == Verdict.PASS and g["noload"].latency.verdict == Verdict.INVALID
    assert g["noload"].overall == Verdict.INVALID
    assert g["broken"].overall == Verdict.FAIL
    assert g["base"].reason == ""  # a PASS has nothing to explain


@pytest.mark.parametrize(
    ("rel", "half", "expected"),
    [(-0.004, 0.0009, "PASS"), (-0.004, 0.0011, "INCONCLUSIVE"), (-0.007, 0.0019, "FAIL"), (-0.007, 0.0021, "INCONCLUSIVE")],
)  # fmt: skip
def test_accuracy_gate_decided_on_the_ci(study, rel, half, expected):
    """Same point estimate, wider CI: the verdict turns INCONCLUSIVE once the CI reaches the limit."""
    results, ctx = study
    r = VariantResult(variant("x", "prune", "base"), None, delta(rel, half))
    f = study_figures([results[0], r], ctx)[1]
    assert gate(f, ctx).accuracy.verdict == expected


def test_worst():
    assert worst(Verdict.PASS, Verdict.INCONCLUSIVE) == Verdict.INCONCLUSIVE
    assert worst(Verdict.INVALID, Verdict.INCONCLUSIVE) == Verdict.INVALID
    assert worst(Verdict.INVALID, Verdict.FAIL) == Verdict.FAIL
    assert worst(Verdict.PASS, None) == Verdict.PASS


def one_variant_study(common: list[LoadRun], max_error_rate: float = 0.01, searches=()):
    base = VariantResult(
        variant("base", "train", None), LoadOutcome("base", common=common, capacity=list(searches))
    )
    study = StudyOutcome(SLO, "fixed", 10.0, False, {"base": base.load})
    ctx = StudyContext("s", "base", 0.005, max_error_rate, study)
    (f,) = study_figures([base], ctx)
    return f, gate(f, ctx)


def test_an_open_common_load_p99_is_priced_in_requests_of_the_right_order():
    """3 repeats of 130 requests (the case study's common load) leave a p99 open above; the note names the
    requests it would need. An estimate from 3 repeats (the drift term's own spread is wide): of 20 draws
    from the same service, 3 repeats of that many close it in most, of a third as many in few."""

    def common(n, seed):
        return pool(
            "common", [load_run("common", lognormal(10.0, n, seed + i), offered=20.0) for i in range(3)]
        )

    short = common(130, 0)
    assert math.isinf(short.quantiles["p99"].hi)
    need = short.requests_to_close("p99")
    assert need is not None and need > 3 * 130
    fig = dataclasses.replace(study_figures(*make_study())[0], latency={"common": short})
    (note,) = [ln for ln in open_p99_note([fig]) if ln]
    assert f"`{fig.name}` ~{need:,} (has 390)" in note and "loadtest.study.load_requests" in note

    def draws(n):
        return [common(math.ceil(n / 3), 1000 + 10 * s) for s in range(20)]

    at_need = draws(need)
    assert sum(math.isfinite(p.quantiles["p99"].hi) for p in at_need) >= 10
    assert sum(math.isfinite(p.quantiles["p99"].hi) for p in draws(need / 3)) <= 4
    long = next(p for p in at_need if math.isfinite(p.quantiles["p99"].hi))
    assert long.requests_to_close("p99") is None
    assert open_p99_note([dataclasses.replace(fig, latency={"common": long})]) == []
    # open because of failures: more requests would not close it, so none is priced
    failing = pool("common", [load_run("common", lognormal(10.0, 130, 0), n_failed=3, offered=20.0)] * 3)
    assert math.isinf(failing.quantiles["p99"].hi) and failing.requests_to_close("p99") is None


def test_a_capacity_step_that_passed_above_the_common_load_decides_an_open_p99():
    """3 x 60 requests at the common load (10 req/s) cannot bound a p99; a step that passed the same SLO
    at >= 10 req/s can, stated with its assumption. One below the common load cannot; nor is a FAIL at
    the common load ever overruled."""
    few = [load_run("common", lognormal(10, 60, s), offered=10.0) for s in range(3)]
    _, alone = one_variant_study(few)
    assert alone.latency.verdict == Verdict.INCONCLUSIVE

    def search(rate):
        run = load_run("capacity", lognormal(20, 600, 9), offered=rate)
        assert verdict_at_most(run.quantiles["p99"], SLO) == Verdict.PASS
        return Capacity(SLO, rate, None, [CapacityStep(rate, run, Verdict.PASS, "")])

    _, g = one_variant_study(few, searches=[search(8.0), search(40.0), search(25.0)])
    assert g.latency.verdict == Verdict.PASS and "capacity step at 25 req/s" in g.latency.reason
    assert "assumed not to fall" in g.latency.reason
    _, g = one_variant_study(few, searches=[search(8.0)])
    assert g.latency.verdict == Verdict.INCONCLUSIVE
    _, g = one_variant_study([], searches=[search(40.0)])  # the budget skipped every common-load window
    assert g.latency.verdict == Verdict.PASS and "no run at the common load (time budget)" in g.latency.reason
    _, g = one_variant_study([], searches=[search(8.0)])
    assert g.latency.verdict == Verdict.INVALID
    slow = [load_run("common", lognormal(400, 400, s), offered=10.0) for s in range(3)]
    _, g = one_variant_study(slow, searches=[search(40.0)])
    assert g.latency.verdict == Verdict.FAIL


def test_the_baselines_bound_over_a_paired_speedup_decides_an_open_p99():
    """Issue 43: a variant's own p99 at the common load open (3 blocks of 130 requests), its paired p99
    speed-up there (from the same blocks, at PAIRED_BOUND_CONF) closed: the baseline's p99 bound there over
    the speed-up's lower bound bounds it from above. PASS within the SLO, from the baseline's closed CI
    or, where that is open, from its capacity step at or above the common load; not where the quotient
    is past the SLO, nor without a bound or blocks to pair; a FAIL at the common load is never overruled."""
    results, ctx = make_study()
    figs = {f.name: f for f in study_figures(results, ctx)}

    def blocks(p50, n, seed, block=True):
        runs = [load_run("common", lognormal(p50, n, seed + i), offered=10.0) for i in range(3)]
        return pool(
            "common", [dataclasses.replace(r, block=i if block else None) for i, r in enumerate(runs)]
        )

    def with_common(f, lat, steps=True):
        load = f.result.load if steps else dataclasses.replace(f.result.load, capacity=[])
        return dataclasses.replace(
            f, result=dataclasses.replace(f.result, load=load), latency={**f.latency, "common": lat},
            capacity=f.capacity if steps else [],
        )  # fmt: skip

    base = with_common(figs["base"], blocks(40.0, 400, 0))
    ref_hi = base.p99().hi
    assert ref_hi <= SLO  # the baseline's own CI at the common load bounds it
    fast = with_common(figs["pruned"], blocks(10.0, 130, 10), steps=False)  # its own steps would decide first
    assert math.isinf(fast.p99().hi)
    g = gate(fast, ctx, base).latency
    assert g.verdict == Verdict.PASS and "paired p99 speed-up" in g.reason and "at 99%" in g.reason, g.reason
    assert f"at most {ref_hi:.3g} ms (its e2e p99 there" in g.reason, g.reason
    assert gate(fast, ctx).latency.verdict == Verdict.INCONCLUSIVE  # no baseline beside it
    # a variant about as slow as the baseline: its bound over a speed-up's lower bound below 1 is past the SLO
    slow = with_common(figs["pruned"], blocks(35.0, 130, 20), steps=False)
    assert gate(slow, ctx, base).latency.verdict == Verdict.INCONCLUSIVE
    # the baseline's own p99 open too: its capacity step at or above the common load bounds it
    open_base = with_common(figs["base"], blocks(40.0, 130, 30))
    assert math.isinf(open_base.p99().hi)
    g = gate(fast, ctx, open_base).latency
    assert g.verdict == Verdict.PASS and "its capacity step at" in g.reason, g.reason
    no_step = with_common(figs["base"], blocks(40.0, 130, 30), steps=False)
    assert gate(fast, ctx, no_step).latency.verdict == Verdict.INCONCLUSIVE
    # runs that ran in no block pair up with nothing
    unpaired = with_common(figs["pruned"], blocks(10.0, 130, 10, block=False), steps=False)
    assert gate(unpaired, ctx, base).latency.verdict == Verdict.INCONCLUSIVE
    # a variant whose own p99 at the common load is past the SLO stays FAIL
    over = with_common(figs["pruned"], blocks(200.0, 400, 80), steps=False)
    assert gate(over, ctx, base).latency.verdict == Verdict.FAIL


def test_failures_count_as_inf_and_flip_the_latency_verdict():
    ok = lognormal(10, 2000, 1)  # p99 ~ 25 ms, far within the SLO
    _, g = one_variant_study([load_run("common", ok)], max_error_rate=0.05)
    assert g.latency.verdict == Verdict.PASS
    # 2.4 % of requests failed: under this error cap, but as +inf they push p99 past any SLO
    f, g = one_variant_study([load_run("common", ok, n_failed=50)], max_error_rate=0.05)
    assert f.p99() == Estimate(math.inf, math.inf, math.inf, 2050) and g.latency.verdict == Verdict.FAIL


def test_invalid_runs_are_excluded(figs, written):
    pruned = figs["pruned"].latency["common"]
    assert len(pruned.runs) == 4 and pruned.n_invalid == 1 and pruned.n == 3 * 1200
    valid_only = [r.latencies_ms for r in pruned.runs if r.valid]
    assert pruned.quantiles["p99"] == dependent_quantile_ci(valid_only, 0.99)
    row = read_csv(written[0] / "comparison.csv")["pruned"]
    assert (row["n_repeats"], row["n_invalid_runs"], row["n_requests"]) == ("4", "1", "3600")
    # the report lists that run, with the generator's own reason, under its own heading
    listed = md_sections((written[0] / "report.md").read_text())["Invalid runs (excluded)"]
    (line,) = [ln for ln in listed.splitlines() if ln.startswith("- `")]
    assert line.startswith("- `pruned`") and pruned.invalid_reasons() == ["loadgen CPU 97% > 90%"]
    assert pruned.invalid_reasons()[0] in line

    # every run invalid: the figures are shown, the verdict is INVALID however good they look
    fast = lognormal(5, 1000, 2)
    f, g = one_variant_study([load_run("common", fast, valid=False, reason="generator lagged 40 ms")])
    assert f.p99().value < SLO and g.latency.verdict == Verdict.INVALID and g.overall == Verdict.INVALID
    assert "generator lagged 40 ms" in g.latency.reason  # the run's own reason is carried, not dropped


# Figures ----------------------------------------------------------------------------------------------
def test_p999_is_na_when_n_cannot_support_it(figs, written):
    base, student = figs["base"].latency["common"], figs["student"].latency["common"]
    assert base.n == 3600 and not base.quantiles["p999"].supported  # p999 needs n >= 3,688
    assert student.n == 4800 and student.quantiles["p999"].supported
    table = by_variant(md_table((written[0] / "comparison.md").read_text()))
    assert table["base"]["e2e p999 ms [CI]"] == "n/a (n=3,600)"
    assert numbers(table["student"]["e2e p999 ms [CI]"])[0] > 0
    rows = read_csv(written[0] / "comparison.csv")
    assert rows["base"]["e2e_p999_ms"] == "" and float(rows["student"]["e2e_p999_ms"]) > 0
    lo, value, hi = (float(rows["base"][k]) for k in ("e2e_p99_ms_lo", "e2e_p99_ms", "e2e_p99_ms_hi"))
    assert lo < value < hi


def test_three_latency_ratios(figs):
    """pruned's latencies are the baseline's distribution / 3.4; each ratio's CI covers 3.4."""
    pruned = figs["pruned"]
    for kind in ("unloaded", "common", "equal_util"):
        r = pruned.speedup[(kind, "p99")]
        assert r.pooled.lo < 3.4 < r.pooled.hi, (kind, r)
        # 3 repeats of 1,200 requests a side: the interval allows for drift between the repeats (Student
        # t with 2 df), so its upper end may be open, but its lower end is a useful claim.
        assert r.pooled.lo > 3.4 / 1.5
        assert r.repeats.n == 3 and r.repeats.lo <= r.repeats.value <= r.repeats.hi
    assert ("unloaded", "p99") not in figs["noload"].speedup


def test_capacity_gain_and_slo_sensitivity(figs):
    base, pruned = figs["base"], figs["pruned"]
    # highest passes per repeat: 0.9, 1.1, 0.75 x the nominal knee (20 req/s)
    assert [c.highest_pass for c in base.capacity] == pytest.approx([18, 22, 15])
    assert (base.max_qps.value, base.max_qps.lo, base.max_qps.hi) == pytest.approx((18, 15, 22))
    assert pruned.qps_gain.value == pytest.approx(45 / 20)
    # The interval covers the spread across repeats and each search's resolution (its bracket).
    pairs = [(c, b) for c in pruned.capacity for b in base.capacity]
    lo = min(c.highest_pass / b.lowest_fail for c, b in pairs)
    hi = max(c.lowest_fail / b.highest_pass for c, b in pairs)
    assert (pruned.qps_gain.lo, pruned.qps_gain.hi) == pytest.approx((lo, hi))
    assert pruned.qps_gain.lo <= 0.75 * 45 / 22 and pruned.qps_gain.hi >= 1.1 * 45 / 15
    # re-judged at 1x the SLO, the recorded steps give back the search's own result
    assert base.max_qps_at[1.0] == base.max_qps
    # at 0.5x: 0.45, 0.45, 0.25 x knee; at 2x: 1.9, 1.9, 1.5 x knee
    assert base.max_qps_at[0.5].value == pytest.approx(0.45 * 20) and base.max_qps_at[
        0.5
    ].lo == pytest.approx(5)
    assert base.max_qps_at[2.0].value == pytest.approx(1.9 * 20) and base.max_qps_at[2.0].lo == pytest.approx(
        30
    )
    assert pruned.qps_gain_at[2.0].value == pytest.approx(45 / 20)


def test_each_step_states_its_qps_gain_over_its_parent_with_the_brackets_range(figs, written):
    """A serving or a step is judged against its parent (serving_backends' batcher against the plain
    server): the same rule as the QPS gain vs the baseline, the range over the two rows' brackets."""
    base, pruned, student = figs["base"], figs["pruned"], figs["student"]
    assert capacity_gain(pruned, base) == pruned.qps_gain
    g = capacity_gain(student, pruned)
    assert g.value == pytest.approx(150 / 45) and g.lo < g.value < g.hi and g.n == 3
    section = md_sections((written[0] / "report.md").read_text())["What each step bought"]
    (row,) = [ln for ln in section.splitlines() if "`pruned` → `student`" in ln]
    assert f"{g.value:.2f}× [{g.lo:.2f}, {g.hi:.2f}]" in row


def test_invalid_capacity_steps_never_pass():
    cap = capacity(20, 0)
    assert highest_pass_at(cap, SLO, 0.01) == pytest.approx(18)
    top = next(s for s in cap.steps if s.rate == pytest.approx(18))
    top.run.valid = False
    assert highest_pass_at(cap, SLO, 0.01) == pytest.approx(15)
    # errors above the cap fail a step whose p99 (failures as +inf, 0.2 % of requests) is still within the SLO
    cap = capacity(20, 0)
    top = next(s for s in cap.steps if s.rate == pytest.approx(18))
    top.run = load_run("capacity", np.full(2000, 0.5 * SLO), n_failed=4, offered=18)
    assert verdict_at_most(top.run.quantiles["p99"], SLO) == Verdict.PASS
    assert highest_pass_at(cap, SLO, 0.01) == pytest.approx(18)
    assert highest_pass_at(cap, SLO, 0.001) == pytest.approx(15)


def test_capacity_bracket_counts_an_open_search_as_failing_at_inf():
    def cap(highest_pass, lowest_fail):
        return Capacity(SLO, highest_pass, lowest_fail, [])

    assert bracket([]) is None
    b = bracket([cap(10, 20), cap(12, None), cap(11, 25)])
    assert (b.highest_pass, b.lowest_fail, b.n) == (11, 25, 3)  # medians, the open search above 25
    assert bracket([cap(10, 20), cap(100, None), cap(100, None)]).lowest_fail is None  # mostly open


def test_a_repeat_the_budget_stopped_before_any_rate_failed_leaves_the_upper_side_to_the_others():
    """Issue 43 (case study run 49): the headline's first search bracketed [400, 480); its repeat passed
    400 and had no time for 480. Its missing fail was never looked for, so it does not open the bracket or
    the QPS gain while another search measured that side; a search that ended on its own with every rate
    passing does, and so do budget-stopped repeats when no search measured the side."""
    results, ctx = make_study()
    figs = {f.name: f for f in study_figures(results, ctx)}
    name = next(n for n, f in figs.items() if not f.is_baseline and f.bracket and f.bracket.lowest_fail)
    caps = next(r for r in results if r.variant.name == name).load.capacity
    before = figs[name]
    cut = Capacity(SLO, before.bracket.highest_pass, None, [], stopped_by_budget=True)
    caps += [cut] * len(caps)  # as many budget-stopped repeats as measured ones: their median would be inf
    after = next(f for f in study_figures(results, ctx) if f.name == name)
    assert after.bracket.lowest_fail == before.bracket.lowest_fail
    assert after.qps_gain.hi == before.qps_gain.hi and math.isfinite(after.qps_gain.hi)
    cut.stopped_by_budget = False  # every rate up to max_rate passed: the capacity lies above, open
    after = next(f for f in study_figures(results, ctx) if f.name == name)
    assert after.bracket.lowest_fail is None and after.qps_gain.hi == math.inf
    assert "lowest_fail_qps" not in study_metrics(results, ctx)[name]  # MLflow logs the report's bracket
    cut.stopped_by_budget = True
    del caps[: len(caps) // 2]  # only budget-stopped searches: nobody looked above, the side is open
    after = next(f for f in study_figures(results, ctx) if f.name == name)
    assert after.bracket.lowest_fail is None and after.qps_gain.hi == math.inf


def test_a_search_the_budget_stopped_before_any_pass_enters_no_median():
    """Such a search located nothing (with more time it might have passed): counted as a capacity of 0 it
    would drag the median and the gain's lower end to 0. Shown as undecided; every figure as without it."""
    results, ctx = make_study()
    figures = {f.name: (f.max_qps, f.qps_gain, f.qps_gain_at, f.bracket) for f in study_figures(results, ctx)}
    cut = [Capacity(SLO, 0.0, 30.0, [], stopped_by_budget=True) for _ in results]
    for r, c in zip(results, cut, strict=True):
        if r.load and r.load.capacity:
            r.load.capacity.append(c)
    after = study_figures(results, ctx)
    assert {f.name: (f.max_qps, f.qps_gain, f.qps_gain_at, f.bracket) for f in after} == figures
    assert "undecided (time budget)" in "\n".join(sections.throughput(after, ctx))
    for c in cut:  # the same searches ended on their own (nothing down to min_rate passed): capacity 0
        c.stopped_by_budget = False
    base = next(f for f in study_figures(results, ctx) if f.name == "base")
    assert base.max_qps.lo == 0.0 and base.max_qps.n == 4


def test_a_baseline_that_only_failed_bounds_the_qps_gain_from_below():
    """The budget stopped every baseline search before a rate passed, but each FAILed one: its capacity lies
    below that rate, so the headline's gain is at least its lowest pass / the highest such FAIL, a one-sided
    range that can meet a goal. A baseline search without a FAIL leaves it unbounded: NOT MEASURED."""
    results, ctx = make_study()
    base = next(r for r in results if r.variant.name == "base")
    fail = dataclasses.replace(base.load.capacity[0].steps[-1], verdict=Verdict.FAIL, reason="p99 vs SLO")
    unsure = dataclasses.replace(fail, rate=0.5 * fail.rate, verdict=Verdict.INCONCLUSIVE)
    base.load.capacity = [Capacity(SLO, 0.0, unsure.rate, [unsure, fail], stopped_by_budget=True)] * 2
    ctx = dataclasses.replace(ctx, headline="pruned")
    fl = study_figures(results, ctx)
    pruned = next(f for f in fl if f.name == "pruned")
    assert pruned.qps_gain is None  # no capacity of the baseline: no two-sided gain
    floor = min(c.highest_pass for c in pruned.capacity) / fail.rate

    def judged(goal):
        c = dataclasses.replace(ctx, targets={"qps_gain": goal})
        figs = study_figures(results, c)
        return {t.key: t for t in evaluate(figs, {f.name: gate(f, c) for f in figs}, c)}["qps_gain"]

    met = judged(0.9 * floor)
    assert met.outcome == Outcome.MET and met.measured.figure.lo == pytest.approx(floor)
    assert "one-sided" in met.measured.text and f"{fail.rate:.1f} req/s" in met.measured.text
    assert judged(1.1 * floor).outcome == Outcome.INCONCLUSIVE  # the gain may still be above it
    summary = headline(fl, {f.name: gate(f, ctx) for f in fl}, ctx)  # the Summary says what the target says
    assert f"gain > {floor:.2f}× (one-sided" in summary and f"failed at {fail.rate:.1f} req/s" in summary, (
        summary
    )
    base.load.capacity = [
        base.load.capacity[0],
        Capacity(SLO, 0.0, unsure.rate, [unsure], stopped_by_budget=True),
    ]
    assert judged(0.9 * floor).outcome == Outcome.NOT_MEASURED


def test_qps_plot_sorts_steps_by_offered_rate_and_marks_each_bracket():
    """A search visits rates out of order and an overloaded step achieves far less than it was offered:
    drawn against the offered rate and sorted by it, every search is one line left to right."""
    results, ctx = make_study()
    rng = random.Random(0)
    for r in results:
        for cap in r.load.capacity if r.load else []:
            rng.shuffle(cap.steps)
            top = max(cap.steps, key=lambda s: s.rate)
            top.run.qps = 0.3 * top.rate
    fl = study_figures(results, ctx)
    fig = draw_qps_vs_p99(fl, ctx, _colors(fl))
    lines: dict[str, list] = {}
    panel: dict[str, set] = {}  # variant -> the panels its lines are in
    for i, ax in enumerate(fig.axes):
        for ln in ax.get_lines():
            if ln.get_gid():
                lines.setdefault(ln.get_gid(), []).append(ln)
                panel.setdefault(ln.get_gid().split(":")[1], set()).add(i)
    drawn = [f for f in fl if f.ok and f.capacity]
    assert [f.name for f in drawn] == ["base", "pruned", "student", "ort"]
    assert set(lines) == {f"{kind}:{f.name}" for f in drawn for kind in ("steps", "bracket")}
    assert panel == {f.name: {i} for i, f in enumerate(drawn)}  # one panel per variant (issue 47)
    for ax, f in zip(fig.axes, drawn, strict=True):
        bracket_text = f"[{f.bracket.highest_pass:.3g}, {f.bracket.lowest_fail:.3g}) req/s"
        assert ax.get_title() == f"{f.name}\ncapacity {bracket_text}"  # readable without the table
    for f in drawn:
        curves = lines[f"steps:{f.name}"]
        assert [list(ln.get_xdata()) for ln in curves] == [
            sorted(s.rate for s in c.steps) for c in f.capacity
        ]
        assert [len(c.steps) for c in f.capacity] == [len(capacity_curve(c)) for c in f.capacity] == [7] * 3
        (bar,) = lines[f"bracket:{f.name}"]
        assert list(bar.get_xdata()) == [f.bracket.highest_pass, f.bracket.lowest_fail]
        assert list(bar.get_ydata()) == [SLO, SLO]  # on the SLO line
    assert draw_qps_vs_p99([fl[4]], ctx, _colors(fl)) is None  # not load-tested: nothing to draw


def _labels(axis) -> list[str]:
    """The tick labels a reader sees on `axis` (drawn first: formatters run at draw time)."""
    return [t.get_text() for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]


def test_plots_read_without_the_table(study, figs):
    """Issue 47: the latency tail squeezed into a CDF's top line, colliding log-axis labels ('3×10¹4×10¹'),
    a legend over the points, `12.3464 req/s` in a title."""
    from reco.report.fmt import rounded

    assert [rounded(x) for x in (12.3464, 4.20684, 107.6613, 1234.5, 150.0, 0.5)] == [
        "12.3", "4.21", "108", "1230", "150", "0.5"]  # fmt: skip
    results, ctx = study
    fl = list(figs.values())
    fig = draw_latency_percentiles(fl, ctx, _colors(fl))
    fig.canvas.draw()
    (ax,) = fig.axes
    # x = 1 / (1 - q): each nine of the tail as wide as the last, labelled as percentiles
    assert _labels(ax.xaxis) == ["50%", "90%", "99%", "99.9%"]
    ys = _labels(ax.yaxis)
    assert len(ys) >= 3 and all(re.fullmatch(r"\d+(\.\d+)?", y) for y in ys), ys  # plain numbers only
    legend = ax.get_legend()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # right of the data, not over it
    texts = [t.get_text() for t in legend.get_texts()]
    p99 = figs["pruned"].p99()
    assert f"pruned: p99 {p99.value:.1f} [{p99.lo:.1f}, {p99.hi:.1f}] ms, n=3,600" in texts
    assert f"at {rounded(ctx.common_rate_qps)} req/s offered" in fig.get_suptitle()

    fig = draw_qps_vs_p99(fl, ctx, _colors(fl))
    fig.canvas.draw()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = _labels(axis)
            assert all(re.fullmatch(r"\d+(\.\d+)?", t) for t in labels), labels  # no '3×10¹' minor labels
    assert len(_labels(fig.axes[0].yaxis)) >= 3
    (legend,) = fig.legends
    assert legend.get_window_extent().y1 <= min(ax.get_window_extent().y0 for ax in fig.axes)  # below them


def test_variant_metrics(study, figs):
    results, ctx = study
    m = study_metrics(results, ctx)
    base, pruned = m["base"], m["pruned"]
    p99 = figs["pruned"].p99()
    assert (pruned["e2e_p99_ms"], pruned["e2e_p99_ms_lo"], pruned["e2e_p99_ms_hi"]) == (
        p99.value,
        p99.lo,
        p99.hi,
    )
    assert "e2e_p999_ms" not in base and "e2e_p999_ms" in m["student"]  # never the maximum in its place
    assert (pruned["auc_delta_rel"], pruned["auc_delta_rel_lo"], pruned["auc_delta_rel_hi"]) == pytest.approx(
        (-0.001, -0.002, 0.0)
    )
    # capacity: the median of 3 repeats with their range, named a range (_min/_max), never as CI bounds
    assert (base["max_qps_at_slo"], base["max_qps_at_slo_min"], base["max_qps_at_slo_max"]) == pytest.approx(
        (18, 15, 22)
    )
    assert not {k for k in base if k.startswith("max_qps_at_slo") and k.endswith(("_lo", "_hi"))}
    # the lowest fail MLflow logs is the report's bracket (one name, one meaning)
    for name, f in figs.items():
        b = f.bracket
        assert m[name].get("lowest_fail_qps") == (b.lowest_fail if b else None), name
    un = figs["base"].latency["unloaded"].quantiles["p99"]
    assert (base["unloaded_e2e_p99_ms"], base["unloaded_e2e_p99_ms_lo"]) == (un.value, un.lo)
    assert pruned["n_requests"] == 3600 and pruned["n_invalid_runs"] == 1 and pruned["valid"] == 1.0
    assert (base["gate"], m["ort"]["gate"], m["noload"]["gate"]) == (1.0, 0.0, -1.0)
    assert m["ort"]["gate_accuracy"] == 0.5
    common = figs["base"].latency["common"]
    assert base["outside_handler_mean_ms"] == pytest.approx(
        common.mean_ms - common.stages()["server_total_mean_ms"]
    )
    assert base["outside_handler_mean_ms"] > 0 and pruned["correctness_passed"] == 1.0
    # the server's CPU split beside it: parts adding up to the CPU per request, the goal's ratio as a range
    parts = ("model", "parse", "retrieval", "features", "serialize", "rest")
    assert sum(base[f"cpu_per_request_{k}_ms"] for k in parts) == pytest.approx(base["cpu_per_request_ms"])
    assert (base["cpu_over_model_cpu"], base["cpu_over_model_cpu_rep_max"]) == pytest.approx((1.6, 1.6))
    assert base["cpu_non_model_share"] == pytest.approx(0.375) and base["cpu_split_n_repeats"] == 3
    assert (pruned["correctness_n"], pruned["offered_qps"], pruned["n_unsent"]) == (200, 10.0, 0)
    assert base["slo_p99_ms"] == SLO and all(isinstance(v, float | int) for v in base.values())


def test_each_metric_is_logged_once_to_a_variant_run(study, tmp_path):
    """A variant's MLflow run as the pipeline fills it (its own metrics, then the report's figures): every
    name holds one value, so no figure is overwritten by another of the same name and another meaning."""
    results, ctx = study
    tracker = Tracker(f"sqlite:///{premade_store(tmp_path)}", "once", str(tmp_path / "artifacts"))
    parent = tracker.start_run("study")
    run_ids = {r.variant.name: tracker.start_run(r.variant.name, parent_id=parent) for r in results}
    for r in results:
        _log_variant(tracker, run_ids[r.variant.name], r.variant, log_models=False)
    per_variant = study_metrics(results, ctx)
    log_report_metrics(tracker, run_ids, per_variant)
    # MLflow keeps a re-logged equal value once: names must not be shared at all, not only differ in value
    assert not [(r.variant.name, set(r.variant.metrics) & set(per_variant.get(r.variant.name, {}))) for r in results
                if set(r.variant.metrics) & set(per_variant.get(r.variant.name, {}))]  # fmt: skip
    for name, run_id in run_ids.items():
        logged = tracker.client.get_run(run_id).data.metrics
        history = {k: len(tracker.client.get_metric_history(run_id, k)) for k in logged}
        assert history == dict.fromkeys(logged, 1), name
    pruned = tracker.client.get_run(run_ids["pruned"]).data.metrics
    assert pruned["e2e_p99_ms"] == pytest.approx(per_variant["pruned"]["e2e_p99_ms"])


# The written report -----------------------------------------------------------------------------------
def test_write_report_files(written):
    out, paths = written
    pngs = {"latency_cdf.png", "auc_vs_p99.png", "qps_vs_p99.png", "server_stages.png"}
    assert {p.name for p in paths} == {"comparison.csv", "comparison.md", "report.md"} | pngs
    for name in pngs:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    rows = read_csv(out / "comparison.csv")
    assert list(rows) == ["base", "pruned", "student", "ort", "noload", "broken"]
    assert rows["pruned"]["n_requests"] == "3600" and rows["pruned"]["loadgen_cpu_pct"] == "97.0"
    assert rows["pruned"]["valid"] == "1.0" and rows["noload"]["valid"] == ""
    assert rows["ort"]["gate"] == "FAIL" and rows["ort"]["gate_accuracy"] == "INCONCLUSIVE"
    assert rows["broken"]["status"] == "FAILED" and "bad graph" in rows["broken"]["error"]
    table = md_table((out / "comparison.md").read_text())
    assert len(table[0]) == 19 and list(by_variant(table)) == list(rows)


def test_learning_curve_says_whether_training_converged(figs, written):
    sec = md_sections((written[0] / "report.md").read_text())["Baseline training"]
    rows = md_table(sec)
    curve = figs["base"].result.variant.learning_curve
    assert [r["epoch"] for r in rows] == ["1", "2 (kept)", "3"]  # best val AUC at 2, then one worse epoch
    assert [numbers(r["val AUC"])[0] for r in rows] == [e["val_auc"] for e in curve]
    assert "0.8200" in sec  # the oracle's AUC, the ceiling the gap is measured against
    rising = copy.deepcopy(figs["base"])
    rising.result.variant.learning_curve = rising.result.variant.learning_curve[:2]
    rows = md_table("\n".join(sections.learning_curve([rising])))
    assert [r["epoch"] for r in rows] == ["1", "2 (kept)"]  # the last epoch kept: convergence not shown
    rising.result.variant.learning_curve = []
    assert md_tables("\n".join(sections.learning_curve([rising]))) == []
    # the last epoch stopped at its early check (trainer.stop_check_fraction)
    cut = copy.deepcopy(figs["base"])
    cut.result.variant.learning_curve[2]["epoch_fraction"] = 0.05
    text = "\n".join(sections.learning_curve([cut]))
    assert [r["epoch"] for r in md_table(text)] == ["1", "2 (kept)", "3 (stopped 5% in)"]
    assert "stopped after 5% of its rows" in text and "`trainer.stop_check_margin`" in text


def test_distillation_section_reads_the_control(figs, written):
    sec = md_sections((written[0] / "report.md").read_text())["What the teacher adds"]
    rows = by_variant(md_table(sec))
    assert list(rows) == ["student"]  # the only distill step
    m = figs["student"].result.variant.metrics
    row = rows["student"]
    assert numbers(row["KD gain [95% CI]"]) == [
        m["kd_gain_val_auc"],
        m["kd_gain_val_auc_lo"],
        m["kd_gain_val_auc_hi"],
    ]
    assert numbers(row["control val AUC"]) == [m["control_val_auc"]]
    assert row["what the teacher adds"].startswith("**gain**")  # its CI lies above 0


def test_targets_decided_on_the_ci(study, figs, written):
    results, ctx = study
    fl = list(figs.values())
    got = {t.key: t for t in evaluate(fl, {f.name: gate(f, ctx) for f in fl}, ctx)}
    assert {k: t.outcome for k, t in got.items()} == {
        "e2e_speedup": Outcome.INCONCLUSIVE,  # pruned is 3.4x faster by construction: its CI straddles 3.4x
        # the gain's range over brackets and repeats, [1.12, 4.50], lies above 1.1, but no headline is
        # declared: pruned was selected as the best of the passing variants, so not confirmed
        "qps_gain": Outcome.INCONCLUSIVE,
        "prune_params_pct": Outcome.MET,  # exactly 30 %
        "distill_size_ratio": Outcome.MISSED,  # 4x, goal 6x
        "max_auc_drop_pct": Outcome.MET,  # drop CI [0, 0.2] %
        "bogus": Outcome.NOT_EVALUATED,
    }
    assert (
        got["e2e_speedup"].measured.figure == figs["pruned"].speedup[("unloaded", "p99")].pooled
    )  # like for like
    assert got["distill_size_ratio"].measured.figure.value == pytest.approx(4.0)
    assert got["bogus"].measured is None and "e2e_speedup" in got["bogus"].reason  # lists the known ones
    assert target_words((written[0] / "report.md").read_text()) == {k: str(t.outcome) for k, t in got.items()}


def test_no_load_test(tmp_path):
    """Load testing disabled: the gate checks accuracy only and the report still renders."""
    results = [
        VariantResult(variant("base", "train", None, rank_p50_ms=2.5)),
        VariantResult(variant("pruned", "prune", "base", rank_p50_ms=1.25), auc_delta=delta(-0.02, 0.002)),
        VariantResult(variant("bad", "prune", "base"), status="failed"),
    ]
    ctx = context(results, None, targets={"e2e_speedup": 2})
    paths = write_report(results, ctx, tmp_path)
    assert {p.name for p in paths} == {"comparison.csv", "comparison.md", "report.md"}
    secs = md_sections((tmp_path / "report.md").read_text())
    assert bullets(secs["Setup"])["Load test"].startswith("none")
    summary = by_variant(md_table(secs["Summary"]))
    speedup = "p99 speed-up like for like (not measured) [CI]"
    assert [(r[speedup], r["max QPS @SLO [pass, fail)"]) for r in summary.values()] == [
        ("1 (reference)", "–"),
        ("–", "–"),
        ("–", "–"),
    ]
    assert [r["gate"] for r in summary.values()] == ["**PASS**", "**FAIL**", "**FAIL**"]
    assert images(secs["Summary"]) == [] and images(secs["Plots"]) == []
    (not_drawn,) = [ln for ln in secs["Plots"].splitlines() if ln.startswith("Not drawn (no data): ")]
    assert set(not_drawn.removeprefix("Not drawn (no data): ").rstrip(".").split(", ")) == {
        "auc_vs_p99", "latency_cdf", "qps_vs_p99", "server_stages"}  # fmt: skip
    assert target_words("\n".join(f"## {k}\n{v}" for k, v in secs.items())) == {"e2e_speedup": "NOT MEASURED"}
    table = by_variant(md_table((tmp_path / "comparison.md").read_text()))
    assert [table[n]["rank p50 ms in-process"] for n in ("base", "pruned")] == ["2.50", "1.25"]
    assert table["bad"]["status"].startswith("FAILED")
    m = study_metrics(results, ctx)
    assert m["pruned"]["auc_delta_rel_lo"] == pytest.approx(-0.022) and "e2e_p99_ms" not in m["pruned"]
    assert m["pruned"]["gate"] == 0.0 and "gate_latency" not in m["pruned"]
    gates = {f.name: gate(f, ctx) for f in study_figures(results, ctx)}
    assert gates["base"].overall == Verdict.PASS and gates["base"].latency is None
    assert gates["pruned"].overall == Verdict.FAIL


def test_embedding_compression_section_and_targets(tmp_path):
    """Per-table precision and sensitivity from the step's metrics; the size target from the files, the
    accuracy target decided on the ΔAUC CI (one variant meets it, one straddles it)."""
    emb = {"emb_size_ratio": 7.0, "model_size_ratio": 5.0, "emb_fp32_mb": 70.0, "emb_mb": 10.0,
           "emb_tables_val_auc_rel_drop": 0.0002, "emb_val_auc_rel_drop": 0.0004, "rank_p50_ms": 1.5,
           "emb_user_bits": 4.0, "emb_user_val_auc_drop": 0.0003, "emb_item_bits": 8.0,
           "emb_item_val_auc_drop": 0.0001}  # fmt: skip
    results = [
        VariantResult(variant("base", "train", None, size_mb=80.0, rank_p50_ms=2.5)),
        VariantResult(
            variant("q", "embed_quant", "base", size_mb=16.0, backend="onnxruntime", **emb),
            auc_delta=delta(-0.0005, 0.0004),
        ),
    ]
    ctx = context(results, None, targets={"embed_size_ratio": 3.5, "embed_max_auc_drop_pct": 0.1})
    write_report(results, ctx, tmp_path)
    sec = md_sections((tmp_path / "report.md").read_text())["Embedding compression"]
    # the block's figures, each from the step's metrics: sizes, size ratios, validation drops, rank p50s
    for shown in ("70.0", "10.0", "7.00×", "5.00×", "0.020%", "0.040%", "2.50", "1.50"):
        assert shown in sec, shown
    rows = {r["table"]: r for r in md_table(sec)}
    assert {t: (numbers(r["bits"]), numbers(r[list(r)[2]])) for t, r in rows.items()} == {
        "`item`": ([8], [0.01]),
        "`user`": ([4], [0.03]),
    }

    def verdicts():
        fl = study_figures(results, ctx)
        return {t.key: t for t in evaluate(fl, {f.name: gate(f, ctx) for f in fl}, ctx)}

    got = verdicts()
    assert got["embed_size_ratio"].outcome == Outcome.MET  # 80 / 16 = 5x
    assert got["embed_size_ratio"].measured.figure.value == 5.0
    assert got["embed_max_auc_drop_pct"].outcome == Outcome.MET  # drop [0.01, 0.09] %
    assert target_words((tmp_path / "report.md").read_text()) == {k: str(t.outcome) for k, t in got.items()}
    results[1].auc_delta = delta(-0.0008, 0.0004)  # drop [0.04, 0.12] %: straddles 0.1 %
    assert verdicts()["embed_max_auc_drop_pct"].outcome == Outcome.INCONCLUSIVE
    write_report(results, ctx, tmp_path)
    assert target_words((tmp_path / "report.md").read_text())["embed_max_auc_drop_pct"] == "INCONCLUSIVE"


def test_report_without_embed_quant_says_so(written):
    sec = md_sections((written[0] / "report.md").read_text())["Embedding compression"]
    assert sec.strip() and md_tables(sec) == []  # a line saying so, no table


SUMMARY_HEADER = ["variant", "ΔAUC % [CI]", "p99 speed-up unloaded [CI]", "max QPS @SLO [pass, fail)", "gate"]


def approx_ci(ci: tuple[float, ...] | None, k: float = 1.0, digits: int = 2):
    """A CSV figure with its CI as shown in a table: [] when absent, else its numbers to `digits`."""
    return [] if ci is None else pytest.approx([k * x for x in ci], abs=0.6 * 10**-digits)


def test_summary_opens_the_report_with_the_seeds_comparison(study, figs, written):
    """The first section: five columns whose every figure is the CSV's, one picture, the targets' tally."""
    results, ctx = study
    out, _ = written
    secs = md_sections((out / "report.md").read_text())
    assert list(secs)[:4] == ["Summary", "Results", "Setup", "Gate"]  # the full table right below
    rows = md_table(secs["Summary"])
    assert list(rows[0]) == SUMMARY_HEADER
    csv_rows = read_csv(out / "comparison.csv")
    table = by_variant(rows)
    assert list(table) == list(csv_rows)
    for name, row in table.items():
        c, f = csv_rows[name], figs[name]
        assert row["gate"] == f"**{c['gate']}**"
        if f.is_baseline:
            assert (row["ΔAUC % [CI]"], row["p99 speed-up unloaded [CI]"]) == (
                "0 (reference)",
                "1 (reference)",
            )
        else:
            assert numbers(row["ΔAUC % [CI]"]) == approx_ci(csv_ci(c, "auc_delta_rel"), 100)
            assert numbers(row["p99 speed-up unloaded [CI]"]) == approx_ci(csv_ci(c, "speedup_p99_unloaded"))
        b = f.bracket
        assert numbers(row["max QPS @SLO [pass, fail)"]) == ([] if b is None else pytest.approx(
            [b.highest_pass, b.lowest_fail], abs=0.5))  # fmt: skip
        if b is not None:  # the bracket's lower end is the CSV's max QPS at the SLO
            assert float(c["max_qps_at_slo"]) == b.highest_pass
    assert images(secs["Summary"]) == ["qps_vs_p99.png"] and (out / "qps_vs_p99.png").exists()
    tally = {w: int(n) for n, w in re.findall(r"\*\*(\d+) ([A-Z ]+)\*\*", secs["Summary"])}
    fl = list(figs.values())
    verdicts = evaluate(fl, {f.name: gate(f, ctx) for f in fl}, ctx)
    assert tally == Counter(str(t.outcome) for t in verdicts) and sum(tally.values()) == len(ctx.targets)


def test_summary_speedup_falls_back_to_equal_utilisation_and_says_so(tmp_path):
    results, ctx = make_study()
    for r in results:
        if r.load:
            r.load.unloaded = []
    write_report(results, ctx, tmp_path)
    rows = md_table(md_sections((tmp_path / "report.md").read_text())["Summary"])
    header = list(rows[0])[2]
    assert header == "p99 speed-up at equal utilisation [CI]"
    pruned = read_csv(tmp_path / "comparison.csv")["pruned"]
    assert "speedup_p99_unloaded" not in pruned
    assert numbers(by_variant(rows)["pruned"][header]) == approx_ci(csv_ci(pruned, "speedup_p99_equal_util"))


def test_report_setup(study, figs, written):
    results, ctx = study
    setup = bullets(md_sections((written[0] / "report.md").read_text())["Setup"])
    assert setup["keep_warm"].startswith("on") and numbers(setup["keep_warm"])[0] == ctx.study.settle_s
    slo = re.search(r"≤ ([\d.]+) ms", setup["Latency SLO"])
    assert float(slo[1]) == SLO and ctx.study.slo_source in setup["Latency SLO"]
    assert setup["Commit"] == "abc1234" and setup["Machine"] == ctx.machine.line()
    assert setup["Repeats per variant"] == "unloaded ×3, common ×4, equal_util ×3, capacity ×3"
    steal = [
        r.steal_pct for f in figs.values() if "unloaded" in f.latency for r in f.latency["unloaded"].runs
    ]
    assert setup["Hypervisor steal"].startswith(
        f"unloaded median {np.median(steal):.1f} %, max {max(steal):.1f} % ({len(steal)} windows)"
    )
    assert numbers(setup["Common load"])[:2] == [10, round(100 * 10 / 18)]  # 10 req/s = 56% of 18 req/s


def test_report_gate_table_is_the_gate(study, figs, written):
    results, ctx = study
    rows = by_variant(md_table(md_sections((written[0] / "report.md").read_text())["Gate"]))
    assert list(rows) == list(figs)
    for name, f in figs.items():
        g = gate(f, ctx)
        got = (rows[name]["accuracy"], rows[name]["latency"], rows[name]["overall"])
        assert got == (g.accuracy.verdict, g.latency.verdict, f"**{g.overall}**")


def test_report_comparison_sections(figs, written):
    secs = md_sections((written[0] / "report.md").read_text())
    loaded = ["base", "pruned", "student", "ort"]
    like = md_table(secs["Latency, like for like"])
    assert {"speed-up p99 unloaded", "speed-up p99 equal util.", "speed-up p99 common load"} <= set(like[0])
    assert list(by_variant(like)) == loaded
    for row in like:  # where each variant's unloaded p99 sits: "r<block>: k of n", or a dash without one
        cell = row["p99's heaviest block"]
        assert cell == "–" or re.fullmatch(r"r\d+: \d+ of \d+", cell), cell
    caps, sens = md_tables(secs["Throughput at the SLO"]) + md_tables(secs["SLO sensitivity"])
    for name, row in by_variant(caps).items():  # each repeat's [highest pass, lowest fail)
        expected = [x for c in figs[name].capacity for x in (c.highest_pass, c.lowest_fail)]
        assert numbers(row["brackets per repeat"]) == pytest.approx(expected, abs=0.5)
    assert list(sens[0])[1:] == ["0.5× SLO (75 ms)", "1× SLO (150 ms)", "2× SLO (300 ms)"]
    (checked,) = md_table(secs["Correctness under load"])
    assert (checked["variant"], checked["requests checked"], checked["verdict"]) == (
        "`pruned`",
        "200",
        "PASS",
    )
    (failed,) = [ln for ln in secs["Failed variants"].splitlines() if ln.startswith("- `")]
    assert failed.startswith("- `broken`") and "bad graph line 2" in failed  # the error on one line
    assert images(secs["Plots"]) == [
        "latency_cdf.png",
        "auc_vs_p99.png",
        "qps_vs_p99.png",
        "server_stages.png",
    ]
    profiled = by_variant(md_table(secs["Inside one ranking call"]))
    assert list(profiled) == ["base"]  # the others were not profiled: no row
    cells = [profiled["base"][k] for k in ("call ms", "embedding", "interaction", "mlp", "other")]
    assert [numbers(c) for c in cells] == [[10.0], [2.0, 20], [1.0, 10], [6.5, 65], [0.5, 5]]
    cost, split = map(by_variant, md_tables(secs["Cost per request"]))
    assert list(cost) == list(split) == loaded
    for name, row in cost.items():  # 0.4 x the common-load p50 (2 x the variant's); per core: unpinned
        p = 2 * {"base": 20, "pruned": 20 / 3.4, "student": 3, "ort": 40}[name]
        assert numbers(row["server CPU ms / request"]) == pytest.approx([0.4 * p], rel=0.01)
        assert numbers(row["requests per CPU-second"]) == pytest.approx([1000 / (0.4 * p)], abs=0.5)
        assert row["max QPS @SLO per core"] == "–"
        # the overhead table: the same CPU per request, split (model 0.25, assembly 0.04, parse + encode
        # 0.06, rest 0.05 of p), its non-model share and ratio to the model's CPU over every repeat
        s = split[name]
        cells = ["server CPU ms / request", "model calls", "candidates + features", "parse + encode",
                 "rest (HTTP, event loop)"]  # fmt: skip
        got = [numbers(s[c])[0] for c in cells]
        assert got == pytest.approx([0.4 * p, 0.25 * p, 0.04 * p, 0.06 * p, 0.05 * p], rel=0.01)
        assert sum(got[1:]) == pytest.approx(got[0], rel=0.01)
        repeats = len(figs[name].latency["common"].used)
        assert s["non-model share"] == "38%"
        assert s["server CPU / model CPU (goal ≤ 1.5)"] == f"1.60 (1.60–1.60, {repeats} runs)"
    assert [split["base"][c] for c in ("rank p50 ms in-process", "FLOP floor ms")] == ["9.00", "3.00"]
    assert split["student"]["rank p50 ms in-process"] == "–"


def test_report_appendix_lists_every_capacity_step(figs, written):
    secs = md_sections((written[0] / "report.md").read_text())
    names = list(secs)
    appendix = names[names.index("Appendix: every capacity step") + 1 :]
    assert appendix == [f"`{n}`" for n in ("base", "pruned", "student", "ort")]
    for head in appendix:
        f = figs[head.strip("`")]
        rows = md_table(secs[head])
        for i, cap in enumerate(f.capacity, 1):
            rates = [float(r["rate"]) for r in rows if r["repeat"] == str(i)]
            assert rates == pytest.approx(sorted(s.rate for s in cap.steps), rel=1e-3)
        assert len(rows) == sum(len(c.steps) for c in f.capacity) == 3 * 7


def test_targets_not_measured_without_the_load_test(tmp_path):
    """Load test off: no latency or capacity figure exists, so their targets are NOT MEASURED, never MISSED;
    a target that needs no load test is still decided."""
    results = [
        VariantResult(variant("base", "train", None)),
        VariantResult(variant("pruned", "prune", "base", params=70_000), auc_delta=delta(-0.001, 0.001)),
    ]
    goals = {"e2e_speedup": 2, "qps_gain": 2, "max_auc_drop_pct": 0.5, "prune_params_pct": 20}
    ctx = context(results, None, targets=goals)
    fl = study_figures(results, ctx)
    gates = {f.name: gate(f, ctx) for f in fl}
    assert gates["pruned"].overall == Verdict.PASS  # the accuracy-only gate passes it: eligible, not measured
    got = {t.key: t for t in evaluate(fl, gates, ctx)}
    assert {k: t.outcome for k, t in got.items()} == {
        "e2e_speedup": Outcome.NOT_MEASURED,
        "qps_gain": Outcome.NOT_MEASURED,
        "max_auc_drop_pct": Outcome.NOT_MEASURED,  # "the fastest" needs a latency
        "prune_params_pct": Outcome.MET,
    }
    assert all(got[k].measured is None and got[k].reason for k in ("e2e_speedup", "qps_gain"))
    write_report(results, ctx, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert target_words(md) == {k: str(t.outcome) for k, t in got.items()}
    assert re.findall(r"\*\*(\d+) ([A-Z ]+)\*\*", md_sections(md)["Summary"]) == [
        ("1", "MET"),
        ("3", "NOT MEASURED"),
    ]


def headline_targets(headline: str | None, goals: dict[str, float], drop_unloaded: bool = False):
    """evaluate() on the unit study with `headline` declared (None: selected) -> {key: TargetResult}, figs."""
    results, ctx = make_study()
    if drop_unloaded:
        for r in results:
            if r.load:
                r.load.unloaded = []
    ctx = dataclasses.replace(ctx, headline=headline, targets=goals)
    fl = study_figures(results, ctx)
    return {t.key: t for t in evaluate(fl, {f.name: gate(f, ctx) for f in fl}, ctx)}, {f.name: f for f in fl}


def test_e2e_target_is_judged_like_for_like():
    """The e2e speed-up target reads the unloaded p99 ratio, else the equal-utilisation one; never the
    common-load ratio (each variant at another utilisation), which is only reported beside it."""
    got, figs = headline_targets("pruned", {"e2e_speedup": 3.4})
    t = got["e2e_speedup"]
    assert t.measured.figure == figs["pruned"].speedup[("unloaded", "p99")].pooled
    assert t.measured.figure != figs["pruned"].speedup[("common", "p99")].pooled
    assert t.measured.basis == Basis.INTERVAL and t.measured.confirmatory
    expected = {
        Verdict.PASS: Outcome.MET,
        Verdict.FAIL: Outcome.MISSED,
        Verdict.INCONCLUSIVE: Outcome.INCONCLUSIVE,
    }
    assert t.outcome == expected[verdict_at_least(t.measured.figure, 3.4)]
    low, _ = headline_targets("pruned", {"e2e_speedup": 0.5 * t.measured.figure.lo})
    assert low["e2e_speedup"].outcome == Outcome.MET  # the whole interval above the goal: decided
    got, figs = headline_targets("pruned", {"e2e_speedup": 3.4}, drop_unloaded=True)
    assert got["e2e_speedup"].measured.figure == figs["pruned"].speedup[("equal_util", "p99")].pooled


def test_headline_is_declared_or_the_selected_one_is_never_confirmed():
    goals = {"qps_gain": 1.1, "e2e_speedup": 0.5, "max_auc_drop_pct": 0.5}
    declared, figs = headline_targets("pruned", goals)
    selected, _ = headline_targets(None, goals)
    # the same variant and figures: declared, the goal is confirmed; selected among the passing, it is not
    for key in ("qps_gain", "e2e_speedup"):
        assert declared[key].measured.figure == selected[key].measured.figure
        assert (declared[key].measured.confirmatory, selected[key].measured.confirmatory) == (True, False)
        assert (declared[key].outcome, selected[key].outcome) == (Outcome.MET, Outcome.INCONCLUSIVE)
    assert declared["qps_gain"].measured.figure == figs["pruned"].qps_gain
    # a selected figure can still miss: its upper bound below the goal
    high, _ = headline_targets(None, {"qps_gain": 1e6})  # the gain's range is closed above here
    assert high["qps_gain"].outcome == Outcome.MISSED
    # a declared headline is judged even when it is not the fastest, and one failing the gate misses
    ort, _ = headline_targets("ort", goals)
    assert {k: t.outcome for k, t in ort.items()} == {
        "qps_gain": Outcome.MISSED, "e2e_speedup": Outcome.MISSED, "max_auc_drop_pct": Outcome.INCONCLUSIVE}  # fmt: skip
    assert ort["max_auc_drop_pct"].measured.figure.hi == pytest.approx(0.8)  # ort's ΔAUC, not pruned's
    with pytest.raises(ValueError, match=r"headline='nope'.*'base', 'pruned', 'student', 'ort'"):
        headline_targets("nope", goals)


def test_a_range_over_repeats_decides_only_when_every_repeat_agrees():
    """The QPS gain's bounds span the repeats' capacity brackets: a range, MET / MISSED only when it lies
    wholly on one side of the goal (the line says 'all repeats'), else INCONCLUSIVE."""
    _, figs = headline_targets("pruned", {})
    g = figs["pruned"].qps_gain
    for goal, outcome in (
        (0.9 * g.lo, Outcome.MET),
        (g.value, Outcome.INCONCLUSIVE),
        (1.1 * g.hi, Outcome.MISSED),
    ):
        got, _ = headline_targets("pruned", {"qps_gain": goal})
        t = got["qps_gain"]
        assert (t.measured.basis, t.outcome) == (Basis.RANGE, outcome), goal
        assert target_line(t).endswith("all repeats.") == (outcome != Outcome.INCONCLUSIVE)


def test_unknown_headline_in_the_preset_names_the_key_and_the_rows():
    cfg = compose(["experiment=smoke", "headline=nope"])
    with pytest.raises(ConfigError, match=r"headline='nope'.*'distilled_onnx_int8_batched'"):
        experiment_config(cfg)
    assert experiment_config(compose(["experiment=ecommerce_case_study"])).headline == "distilled_onnx_int8"


def test_target_without_its_figure_is_not_measured_and_without_a_passing_variant_is_missed():
    results, ctx = make_study()
    for r in results:
        if r.load:
            r.load.capacity = []  # load-tested, but no capacity search: no QPS gain anywhere
    fl = study_figures(results, ctx)
    got = {t.key: t.outcome for t in evaluate(fl, {f.name: gate(f, ctx) for f in fl}, ctx)}
    assert got["qps_gain"] == Outcome.NOT_MEASURED and got["e2e_speedup"] == Outcome.INCONCLUSIVE

    # A limit no variant's ΔAUC CI clears: only the baseline passes. The figures exist, so the targets on
    # "a passing variant" are missed, not unmeasured.
    results, ctx = make_study()
    ctx.max_auc_drop = 1e-5
    fl = study_figures(results, ctx)
    gates = {f.name: gate(f, ctx) for f in fl}
    assert [f.name for f in fl if gates[f.name].overall == Verdict.PASS] == ["base"]
    got = {t.key: t for t in evaluate(fl, gates, ctx)}
    assert got["qps_gain"].outcome == Outcome.MISSED and got["qps_gain"].measured is None
    assert got["e2e_speedup"].outcome == Outcome.MISSED  # the baseline is the fastest passing: 1x
    assert got["e2e_speedup"].measured.figure.value == 1.0


def test_unknown_baseline_is_a_clear_error(tmp_path):
    results, ctx = make_study()
    ctx.baseline = "nope"
    with pytest.raises(ValueError, match="baseline='nope' is not among"):
        write_report(results, ctx, tmp_path)


def test_failed_baseline_is_no_reference():
    results, ctx = make_study()
    results[0].status, results[0].error = "failed", "server crashed"
    figs = {f.name: f for f in study_figures(results, ctx)}
    assert figs["pruned"].speedup == {} and figs["pruned"].qps_gain is None
    assert gate(figs["base"], ctx).overall == Verdict.FAIL


def test_pareto_front():
    pts = [(10, 0.78), (20, 0.80), (15, 0.77), (30, 0.79), (5, 0.70)]
    assert pareto_front(pts) == [(5, 0.70), (10, 0.78), (20, 0.80)]


def test_machine_from_environment_tags():
    tags = {
        "machine.cpu": "AMD EPYC 7B13",
        "machine.cores": "2",
        "machine.python": "3.11.7",
        "git.commit": "x",
    }
    m = Machine.from_tags(tags)
    assert (m.cpu, m.cores, m.versions) == ("AMD EPYC 7B13", 2, {"python": "3.11.7"})
    assert m.line() == "AMD EPYC 7B13 · 2 cores · python 3.11.7"


def _comparison_csv(path, rows, experiment="case_study", common_rate=None):
    """A comparison.csv as write_csv lays it out: variant, experiment, then each figure with its _lo/_hi
    (and, given a common_rate, the common load on every row)."""
    keys = ["speedup_p99_unloaded", "speedup_p50_unloaded", "qps_gain"]
    fields = ["variant", "experiment"] + [k + s for k in keys for s in ("", "_lo", "_hi")]
    fields += ["common_rate_qps"] if common_rate is not None else []
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, restval="")
        w.writeheader()
        for name, cis in rows.items():
            w.writerow(
                {
                    "variant": name,
                    "experiment": experiment,
                    **({"common_rate_qps": common_rate} if common_rate is not None else {}),
                    **{
                        k + s: x for k, ci in cis.items() for s, x in zip(("", "_lo", "_hi"), ci, strict=True)
                    },
                }
            )
    return path


def test_agree_notes_when_the_runs_common_loads_differ(tmp_path, capsys):
    """Each run sets its common load from its own reference's capacity: two runs 1.23x apart compare their
    variants at different loads at the common load, and agree says so (not within 5 %, nor without it)."""
    from reco.cli import agree as agree_cli
    from reco.report.agree import load_note

    rows = {"base": {}, "s": {"speedup_p50_unloaded": (3.0, 2.9, 3.1)}}
    a, b, c = (
        _comparison_csv(tmp_path / f"{x}.csv", rows, common_rate=r)
        for x, r in zip("abc", (30.5, 24.8, 30.0), strict=True)
    )
    bare = _comparison_csv(tmp_path / "bare.csv", rows)
    names = ("run 72", "run 73")
    assert "30.5 req/s in run 72 and 24.8 in run 73 (1.23x apart)" in load_note(a, b, names)
    assert load_note(a, c, names) == "" and load_note(a, bare, names) == ""
    agree_cli.main([str(a), str(b), "--names", *names])
    assert "common-load ratios compare different loads" in capsys.readouterr().out


def test_agree_by_an_interval_on_the_ratio_missing_and_exit_code(tmp_path, capsys):
    from reco.cli import agree as agree_cli
    from reco.report import agree
    from reco.report.agree import Verdict as V

    a = _comparison_csv(
        tmp_path / "a.csv",
        {
            "baseline": {},
            "student": {"speedup_p99_unloaded": (4.0, 3.0, 6.5), "qps_gain": (39.0, 24.0, 41.0)},
            "pruned": {"speedup_p99_unloaded": (1.6, 1.4, 1.97)},
            "int8": {"speedup_p99_unloaded": (2.0, 1.9, 2.1)},
        },
    )
    b = _comparison_csv(
        tmp_path / "b.csv",
        {
            "baseline": {},
            "student": {
                "speedup_p99_unloaded": (5.9, 4.9, 8.3),
                "qps_gain": (65.0, 41.0, 88.0),
            },  # the intervals touch at 41, yet run a / run b is 0.60 [0.34, 0.95]: they differ
            "pruned": {"speedup_p99_unloaded": (2.4, 2.0, 2.5), "qps_gain": (14.0, 8.0, 15.0)},
            "int8": {"speedup_p99_unloaded": (2.1, 2.0, 2.2)},
            "triton": {"qps_gain": (27.0, 11.0, 55.0)},  # only in run b: listed, not dropped
        },
    )
    c = agree.compare(a, b)
    ps = {(p.variant, p.figure): p.verdict(c.max_width) for p in c.pairs}
    assert ps == {
        ("student", "speedup_p99_unloaded"): V.UNDECIDED,  # 0.68 [0.43, 1.14] holds 1 but is 2.6x wide
        ("student", "qps_gain"): V.DIFFER,  # overlapping intervals, but the ratio's interval excludes 1
        ("pruned", "speedup_p99_unloaded"): V.DIFFER,  # [1.4, 1.97] vs [2.0, 2.5]
        ("pruned", "qps_gain"): V.MISSING,  # run a lacks it: not counted as consistent
        ("int8", "speedup_p99_unloaded"): V.CONSISTENT,  # 0.95 [0.87, 1.05]: narrow, holds 1
        ("triton", "qps_gain"): V.MISSING,
    }
    ratio = {(p.variant, p.figure): p.ratio for p in c.pairs}[("student", "qps_gain")]
    assert ratio.value == pytest.approx(39 / 65) and ratio.lo < ratio.value < ratio.hi < 1.0
    assert agree_cli.main([str(a), str(b), "--names", "r7", "r8"]) == 1  # a decided difference wins
    out = capsys.readouterr().out
    rows = md_table(out.split("\n\n")[0])
    assert list(rows[0]) == ["variant", "figure", "r7", "r8", "r7 / r8 [95 % CI]", "verdict"]
    shown = {(r["variant"].strip("`"), r["figure"]): r["verdict"] for r in rows}
    assert shown[("student", agree.FIGURES["speedup_p99_unloaded"])] == "undecided (2.6× wide)"
    assert shown[("student", agree.FIGURES["qps_gain"])] == "**differ**"
    assert shown[("int8", agree.FIGURES["speedup_p99_unloaded"])] == "consistent"
    assert shown[("triton", agree.FIGURES["qps_gain"])] == "– (missing in a run)"
    last = out.strip().splitlines()[-1]
    assert last.startswith(
        "differ: 3 of 4 figures decidable; 1 consistent (run-ratio 95 % interval holds 1, "
    )
    assert (
        "2 differ (it excludes 1), 1 undecided (it holds 1 but is open or wider than 2×); 2 missing" in last
    )
    # a run against itself: every ratio is 1, but two of its intervals are wider than 2x (their runs' own
    # intervals are wide), so it cannot vouch for them; a wider allowance decides them
    assert agree_cli.main([str(a), str(a)]) == 3
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("undecided: 2 of 4 figures decidable")
    assert agree_cli.main([str(a), str(a), "--max-width", "4"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("consistent: 4 of 4 figures decidable")


def test_agree_says_undecided_when_every_interval_is_open(tmp_path, capsys):
    """Issue 47: two runs whose ratios are all [0, inf) were '12 of 12 consistent', exit 0."""
    from reco.cli import agree as agree_cli

    inf = float("inf")
    a = _comparison_csv(
        tmp_path / "run20.csv",
        {"pruned": {"speedup_p99_unloaded": (1.73, 0.0, inf)}, "distilled": {"qps_gain": (3.7, 2.1, inf)}},
    )
    b = _comparison_csv(
        tmp_path / "run21.csv",
        {"pruned": {"speedup_p99_unloaded": (2.6, 0.0, inf)}, "distilled": {"qps_gain": (5.6, 0.0, 9.0)}},
    )
    assert agree_cli.main([str(a), str(b)]) == 3
    out = capsys.readouterr().out
    verdicts = [r["verdict"] for r in md_table(out.split("\n\n")[0])]
    assert verdicts == ["undecided (open interval)"] * 2
    assert out.strip().splitlines()[-1].startswith("undecided: 0 of 2 figures decidable; 0 consistent")
    # a wider --max-width never turns an open interval into "consistent"
    assert agree_cli.main([str(a), str(b), "--max-width", "1000"]) == 3
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # argparse's usage error
        agree_cli.main([str(a), str(b), "--max-width", "1"])
    assert e.value.code == 2
    assert "--max-width: expected a factor above 1 (hi / lo), got '1'" in capsys.readouterr().err


def test_agree_bad_input_names_file_and_column(tmp_path, capsys):
    """Bad input exits 2 (not 1, which says the runs differ) with the file and the column named."""
    from reco.cli import agree as agree_cli

    def refused(a, b) -> str:
        assert agree_cli.main([str(a), str(b)]) == 2
        return capsys.readouterr().err

    ok = _comparison_csv(tmp_path / "ok.csv", {"student": {"qps_gain": (39.0, 24.0, 41.0)}})
    not_csv = tmp_path / "report.md"
    not_csv.write_text("# a report, not comparison.csv\n")
    assert "report.md: expected a study's comparison.csv with a 'variant' column" in refused(not_csv, not_csv)
    bad = _comparison_csv(tmp_path / "bad.csv", {"student": {"qps_gain": ("many", 1, 2)}})
    assert "bad.csv: variant 'student', column 'qps_gain': expected numbers" in refused(bad, bad)
    assert "missing.csv: cannot read" in refused(tmp_path / "missing.csv", bad)

    other = _comparison_csv(tmp_path / "other.csv", {"student": {"qps_gain": (39.0, 24.0, 41.0)}}, "batching")
    assert "other.csv: column 'experiment' is 'batching' where " in refused(ok, other)
    strangers = _comparison_csv(tmp_path / "strangers.csv", {"bert": {"qps_gain": (2.0, 1.0, 3.0)}}, "")
    assert "strangers.csv: column 'variant' has none of " in refused(ok, strangers)

    no_figures = tmp_path / "kd_trials.csv"  # an accuracy-only study: nothing to compare
    no_figures.write_text("variant,experiment,auc\nstudent,case_study,0.71\n")
    assert "kd_trials.csv: none of the columns speedup_p99_unloaded, " in refused(ok, no_figures)
    no_interval = tmp_path / "old.csv"  # a figure without its interval
    no_interval.write_text("variant,experiment,qps_gain\nstudent,case_study,2.0\n")
    assert "old.csv: column 'qps_gain' without qps_gain_lo and qps_gain_hi" in refused(ok, no_interval)


def test_slo_sensitivity_rejudges_each_step_at_the_searchs_own_confidence():
    """At the search's own SLO the re-judged bracket is the search's: a step INCONCLUSIVE at the search's
    98.3 % (Bonferroni) must not pass because its 95 % interval would (seen in a case-study run: the
    baseline's 1x SLO column read 12 req/s where its search had bracketed [8, 12))."""
    from reco.loadtest.capacity import step_verdict

    run = load_run("capacity", lognormal(50, 2000, 7), offered=10.0)
    lo95 = step_verdict(run, 1e9, 0.01, 0.95)[2]
    lo983 = step_verdict(run, 1e9, 0.01, 1 - 0.05 / 3)[2]
    assert lo95.hi < lo983.hi
    slo = (lo95.hi + lo983.hi) / 2  # within the 95 % bound, not the 98.3 % one
    v = step_verdict(run, slo, 0.01, 1 - 0.05 / 3)[0]
    assert v == Verdict.INCONCLUSIVE
    cap = Capacity(slo, 0.0, None, [CapacityStep(10.0, run, v, "straddles")], conf=1 - 0.05 / 3)
    assert bracket_at(cap, slo, 0.01) == (0.0, None)  # undecided: neither end
    loose = dataclasses.replace(cap, conf=0.95)  # judged at 95 %, the same step passes
    assert bracket_at(loose, slo, 0.01) == (10.0, None)


def test_small_data_is_flagged_in_the_summarys_first_line(tmp_path):
    """Issue 47 (finding 5): a baseline whose own test AUC CI holds 0.5 (Taobao's 0.445 on a sample), or a
    test split too small for the intervals, opens the Summary with a plumbing-check line; real data do not.
    The AUC CI is DeLong's on the test rows (reco.stats.auc_ci)."""
    from reco.stats import auc_ci

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 400)
    chance = auc_ci(labels, rng.random(400))
    assert chance.lo <= 0.5 <= chance.hi and chance.n == 400
    signal = rng.normal(0, 1, 20_000)
    good = auc_ci((signal + rng.normal(0, 1, 20_000) > 0).astype(int), signal)
    assert good.lo > 0.5 and good.n == 20_000
    results = [VariantResult(variant("base", "train", None))]
    for auc, flagged in ((chance, True), (good, False)):
        write_report(results, context(results, None, baseline_auc=auc), tmp_path)
        first = md_sections((tmp_path / "report.md").read_text())["Summary"].strip().splitlines()[0]
        assert first.startswith("**Small data: a plumbing check, not a result**") is flagged, first
        if flagged:
            assert "does not exclude 0.5" in first and "400 rows" in first


def test_qps_plot_draws_when_no_step_has_a_finite_p99(tmp_path):
    """Every step failed with its p99 n/a or infinite (a busy machine in a smoke run): the panels keep
    matplotlib's log ticks rather than raising on a view with nothing positive in it."""
    results, ctx = make_study()
    for r in results:
        for cap in r.load.capacity if r.load else []:
            for i, s in enumerate(cap.steps):
                e = s.run.quantiles["p99"]
                s.run.quantiles["p99"] = Estimate(None if i % 2 else math.inf, None, None, e.n)
                s.verdict = Verdict.FAIL
    fl = study_figures(results, ctx)
    assert qps_vs_p99(fl, ctx, _colors(fl), tmp_path / "qps_vs_p99.png").stat().st_size > 0


def _planted_pairs(tmp_path: Path, n: int, key: str, seed: int) -> list[tuple[Path, Path]]:
    """n pairs of comparison.csv files of 12 variants: each run's log `key` moves by N(0, 0.08) around the
    truth, each interval +-2 % (with a QPS gain range beside it)."""
    from reco.report.agree import Z95

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        rows: list[dict] = [{}, {}]
        for v in range(12):
            for side in rows:
                x = 5.0 * math.exp(rng.normal(0, 0.08) + rng.normal(0, 0.02 / Z95))
                side[f"v{v}"] = {
                    key: (x, x / math.exp(0.02), x * math.exp(0.02)),
                    "qps_gain": (9.0, 6.0, 12.0),
                }
        out.append(tuple(_comparison_csv(tmp_path / f"p{i}{j}.csv", {"base": {}, **rows[j]}) for j in (0, 1)))
    return out


def test_agree_allows_for_what_moves_between_runs_and_estimates_it_from_pairs(tmp_path, capsys):
    """Two runs whose tight intervals sit 10 % apart differ by their own intervals; with a between-run sd
    of 5 % (what runs of one commit have moved by) they are consistent, and a 40 % move still differs.
    The sd is estimated from pairs of runs where it was planted, and a bad file is named."""
    import json

    from reco.cli import agree as agree_cli
    from reco.cli import between_runs as between_cli
    from reco.report.agree import BetweenRuns, Verdict, compare

    key = "speedup_p50_unloaded"
    a = _comparison_csv(
        tmp_path / "a.csv", {"base": {}, "s": {key: (11.0, 10.8, 11.2)}, "t": {key: (3.0, 2.95, 3.05)}}
    )
    b = _comparison_csv(
        tmp_path / "b.csv", {"base": {}, "s": {key: (10.0, 9.8, 10.2)}, "t": {key: (2.1, 2.07, 2.13)}}
    )
    tau = BetweenRuns({key: 0.05}, {key: 0.02}, {key: 0.07}, {key: 24}, [["r1", "r2"]])
    before = {p.variant: p.verdict() for p in compare(a, b).pairs}
    after = {p.variant: (p.verdict(), p.ratio) for p in compare(a, b, between=tau).pairs}
    assert before == {"s": Verdict.DIFFER, "t": Verdict.DIFFER}
    assert after["s"][0] is Verdict.CONSISTENT and after["t"][0] is Verdict.DIFFER
    r = after["s"][1]  # 1.1 x exp(+-hypot(within, 1.96 sqrt(2) 0.05)): about +-14 %
    assert r.value == pytest.approx(1.1) and 1.3 < r.hi / r.lo < 1.35
    tau.save(tmp_path / "between.json")
    assert agree_cli.main([str(a), str(b), "--between-runs", str(tmp_path / "between.json")]) == 1
    out = capsys.readouterr().out
    assert "widened by the between-run sd" in out and "p50 speed-up unloaded 5.0 % [2.0, 7.0] (n=24)" in out

    # planted: each run's log figure moves by N(0, 0.08) around the truth, each interval +-2 %
    pairs = [str(f) for pair in _planted_pairs(tmp_path, 4, key, seed=1) for f in pair]
    argv = [x for i in range(4) for x in ("--pair", pairs[2 * i], pairs[2 * i + 1])]
    assert between_cli.main([*argv, "--out", str(tmp_path / "est.json")]) == 0
    est = json.loads((tmp_path / "est.json").read_text())
    assert 0.06 < est["sd"][key] < 0.10 and est["n"][key] == 48
    assert est["lo"][key] < est["sd"][key] < est["hi"][key]
    assert "qps_gain" not in est["sd"]  # a bracket range has no within-run variance to take out
    capsys.readouterr()

    (tmp_path / "bad.json").write_text(json.dumps({**est, "sd": {"p50": 0.05}}))
    assert agree_cli.main([str(a), str(b), "--between-runs", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "bad.json: field 'sd' has {'p50': 0.05}: expected figures of" in err


def test_the_between_run_sd_is_not_hidden_by_wide_conservative_intervals():
    """Paule and Mandel's estimator: differences d ~ N(0, v + 2 tau^2), half of them with intervals 30x wider
    than the spread they hold (a conservative dependent-request p99, the common load's). The method of
    moments, mean(d^2 - v) / 2, is pulled to 0 by them (the case study's common load read 0 % while its
    same-commit pairs differed in 18 % of figures); the weighted estimator finds most of the planted sd
    (0.046-0.063 of 0.08 over 200 seeds: the wide ones still weigh a little), all of it where the intervals
    are right, exactly 0 where nothing moves, and grows with the spread."""
    from reco.report.agree import paule_mandel

    rng = np.random.default_rng(3)
    tau, se = 0.08, 0.02
    true_v = se * se * 2
    d = rng.normal(0, math.sqrt(true_v + 2 * tau * tau), 400)
    v = np.where(np.arange(400) % 2 == 0, true_v, 900 * true_v)  # every other interval 30x too wide
    dv = list(zip(d.tolist(), v.tolist(), strict=True))
    moments = math.sqrt(max(0.0, float(np.mean(d * d - v))) / 2)
    assert moments == 0.0
    assert 0.04 < paule_mandel(dv) < 0.07
    narrow = [x for i, x in enumerate(dv) if i % 2 == 0]
    assert 0.065 < paule_mandel(narrow) < 0.095  # accurate intervals: the planted sd
    assert paule_mandel([(0.0, true_v)] * 10) == 0.0 and paule_mandel([]) == 0.0
    assert paule_mandel([(2 * x, y) for x, y in narrow]) > 1.9 * paule_mandel(narrow)


def test_between_runs_checks_its_sd_on_each_pair_left_out(tmp_path, capsys):
    """From three pairs on, the between_runs CLI judges each pair with the sd of the others and prints how
    often it reads DIFFER; runs that moved by a planted 8 % with +-2 % intervals read it in few figures."""
    from reco.cli import between_runs as between_cli
    from reco.report.agree import Verdict, leave_one_out

    key = "speedup_p50_unloaded"
    files = _planted_pairs(tmp_path, 6, key, seed=5)
    counts = leave_one_out(files)[key]
    judged = counts[Verdict.CONSISTENT] + counts[Verdict.DIFFER] + counts[Verdict.UNDECIDED]
    assert judged == 72 and counts[Verdict.DIFFER] <= 10
    argv = [x for a, b in files for x in ("--pair", str(a), str(b))]
    assert between_cli.main([*argv, "--out", str(tmp_path / "est.json")]) == 0
    out = capsys.readouterr().out
    assert f"p50 speed-up unloaded {counts[Verdict.DIFFER]} of 72 differ" in out


def test_the_like_for_like_table_names_the_block_an_unloaded_p99_rests_on():
    """The report's *p99's heaviest block*: a variant whose unloaded p99 sits in one stretched block says
    which block and how many of its slow requests that block holds; runs without a block give a dash."""
    from reco.report.figures import pool
    from reco.report.sections import _tail_block

    runs = [
        dataclasses.replace(load_run("unloaded", lognormal(10.0, 100, seed=b, sigma=0.1)), block=b)
        for b in range(12)
    ]
    runs[7] = dataclasses.replace(
        load_run("unloaded", 1.7 * lognormal(10.0, 100, seed=7, sigma=0.1)), block=7
    )
    assert _tail_block(pool("unloaded", runs)) == "r7: 12 of 12"  # 1,200 requests: 12 over the 1,188th
    assert _tail_block(pool("unloaded", [dataclasses.replace(r, block=None) for r in runs])) == "–"
