"""The comparison report on a hand-built study: files, gate logic, targets, failed variants."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from reco.report import StudyContext, VariantResult, write_report
from reco.report.plots import pareto_front
from reco.report.table import build_rows
from reco.variant import Variant

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def result(name, step, parent, metrics, *, backend="torch", params=100_000, size_mb=4.0, p50=None, **kw):
    v = Variant(name=name, step=step, parent=parent, backend=backend, model_config={})
    v.params, v.size_mb, v.flops_per_candidate, v.metrics = params, size_mb, 2 * params, metrics
    lat = None
    if p50 is not None:  # synthetic lognormal latencies around p50
        lat = np.random.default_rng(len(name)).lognormal(np.log(p50), 0.5, size=5000)
    return VariantResult(variant=v, latencies_ms=lat, **kw)


def load(p50, p99, qps, **extra):
    stages = {f"server_{s}_mean_ms": p50 / 6 for s in ("queue", "features", "retrieval", "rank", "serialize")}
    return {"e2e_p50_ms": p50, "e2e_p95_ms": (p50 + p99) / 2, "e2e_p99_ms": p99, "max_qps_at_slo": qps,
            "error_rate": 0.0, **stages, **extra}  # fmt: skip


def capacity(knee):
    return [{"rate": q, "qps": q * 0.98, "p99_ms": 10 + 400 * max(0, q / knee - 0.7), "error_rate": 0.0}
            for q in (20, 50, 100, 150, 200)]  # fmt: skip


@pytest.fixture
def study():
    results = [
        result("base", "train", None, {"auc": 0.800, "oracle_auc": 0.82, **load(10, 40, 100)},
               p50=10, capacity_steps=capacity(100)),
        # params 30% smaller, AUC within 99.5%: passes
        result("pruned", "prune", "base", {"auc": 0.799, **load(8, 30, 150)}, params=70_000, size_mb=3.0,
               p50=8, capacity_steps=capacity(150)),
        # AUC 0.790 < 0.995 * 0.800 = 0.796: fails on quality
        result("student", "distill", "pruned", {"auc": 0.790, **load(3, 10, 400)}, params=10_000, size_mb=0.75,
               p50=3, capacity_steps=capacity(400)),
        # p99 60 ms > SLO 50 ms: fails on latency
        result("ort", "accelerate", "pruned", {"auc": 0.7985, **load(12, 60, 90)}, backend="onnxruntime",
               p50=12),
        # load testing disabled: only in-process figures
        result("noload", "accelerate", "pruned", {"auc": 0.7990, "rank_p50_ms": 1.5}),
        result("broken", "accelerate", "pruned", {}, status="failed", error="ORT session | invalid graph\nline 2"),
    ]  # fmt: skip
    ctx = StudyContext(
        experiment="unit_study",
        baseline="base",
        slo_p99_ms=50.0,
        common_rate_qps=100.0,
        machine="test CPU, 2 cores",
        targets={"e2e_speedup": 3.4, "qps_gain": 1.4, "prune_params_pct": 30, "distill_size_ratio": 6,
                 "max_auc_drop_pct": 0.5, "bogus": 1},
    )  # fmt: skip
    return results, ctx


def test_gate_logic(study):
    results, ctx = study
    rows = {r["variant"]: r for r in build_rows(results, ctx)}
    assert rows["base"]["gate"] == "pass" and rows["pruned"]["gate"] == "pass"
    assert rows["student"]["gate"] == "fail" and "AUC 0.7900 < 0.995" in rows["student"]["gate_reason"]
    assert rows["ort"]["gate"] == "fail" and "e2e p99 60.0 ms > SLO 50 ms" in rows["ort"]["gate_reason"]
    assert rows["noload"]["gate"] == "fail" and "no e2e p99" in rows["noload"]["gate_reason"]
    assert rows["broken"]["gate"] == "fail" and rows["broken"]["status"] == "FAILED"
    # relative figures and the in-process fallback for rank time
    assert rows["pruned"]["speedup"] == pytest.approx(40 / 30)
    assert rows["pruned"]["qps_gain"] == pytest.approx(1.5)
    assert rows["student"]["d_auc_pct"] == pytest.approx(-1.25)
    assert rows["noload"]["rank_ms"] == 1.5 and rows["noload"]["rank_source"] == "in-process"
    assert rows["noload"]["speedup"] is None

    # too many errors fail the gate even when p99 looks good (errors return fast)
    results[1].variant.metrics["error_rate"] = 0.2
    rows = {r["variant"]: r for r in build_rows(results, ctx)}
    assert rows["pruned"]["gate"] == "fail" and "error rate 20.0%" in rows["pruned"]["gate_reason"]


def test_write_report(study, tmp_path):
    results, ctx = study
    paths = write_report(results, ctx, tmp_path)
    names = {p.name for p in paths}
    pngs = {"latency_cdf.png", "auc_vs_p99.png", "qps_vs_p99.png", "server_stages.png"}
    assert {"comparison.csv", "comparison.md", "report.md"} | pngs == names
    for p in paths:
        assert p.parent == tmp_path and p.stat().st_size > 0
    for name in pngs:
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC

    with open(tmp_path / "comparison.csv") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["base", "pruned", "student", "ort", "noload", "broken"]
    assert rows["student"]["gate"] == "fail" and rows["noload"]["e2e_p99_ms"] == ""
    assert rows["broken"]["status"] == "FAILED" and "invalid graph" in rows["broken"]["error"]

    md = (tmp_path / "report.md").read_text()
    assert "Machine: test CPU, 2 cores" in md
    assert "Fastest passing variant: `pruned`" in md
    lines = md.splitlines()

    def target_line(words: str) -> str:
        (hit,) = [x for x in lines if words in x]
        return hit

    assert target_line("speed-up vs baseline ≥ 3.4×").startswith("- **MISSED**")  # 1.33x measured
    assert "1.33×" in target_line("speed-up vs baseline ≥ 3.4×")
    assert target_line("gain vs baseline ≥ 1.4×").startswith("- **MET**")  # 1.5x
    assert target_line("removes ≥ 30%").startswith("- **MET**")  # exactly 30%
    assert target_line("smaller than its teacher").startswith("- **MISSED**")  # 4x
    assert target_line("AUC drop").startswith("- **MET**")  # 0.125%
    assert "NOT EVALUATED** — unknown target `bogus`" in md
    # failed variant: in the table and its own section, its error kept on one line (pipes escaped)
    (broken,) = [x for x in lines if x.startswith("| `broken`")]
    assert "FAILED: ORT session \\| invalid graph line 2" in broken
    assert "`broken` FAILED" in md
    # attribution: parent -> child ratios
    (step,) = [x for x in lines if x.startswith("| prune |")]
    assert "40.0 → 30.0" in step and "| 1.33 |" in step
    # images referenced relative to report.md, all present
    for name in pngs:
        assert f"]({name})" in md
    assert (tmp_path / "comparison.md").read_text().count("\n| `") == 6


def test_no_load_metrics_no_slo(tmp_path):
    """Load testing disabled: no e2e metrics, no SLO, no latency arrays; the report still renders."""
    results = [
        result("base", "train", None, {"auc": 0.80, "rank_p50_ms": 2.0}),
        result("pruned", "prune", "base", {"auc": 0.70}, params=60_000),
        result("bad", "prune", "base", {}, status="failed"),
    ]
    ctx = StudyContext("smoke", "base", slo_p99_ms=None, common_rate_qps=None, targets={"e2e_speedup": 2})
    paths = write_report(results, ctx, tmp_path)
    assert {p.name for p in paths} == {"comparison.csv", "comparison.md", "report.md"}
    md = (tmp_path / "report.md").read_text()
    assert "none (the gate checks AUC only)" in md
    assert "Fastest passing variant" not in md  # base passes the AUC gate but has no p99 to rank by
    assert "- **MISSED** — e2e p99 speed-up" in md and "not measured" in md
    assert "Not drawn (no data): auc_vs_p99, latency_cdf, qps_vs_p99, server_stages." in md
    assert "FAILED: no error message" in md
    rows = {r["variant"]: r for r in build_rows(results, ctx)}
    assert rows["base"]["gate"] == "pass" and rows["pruned"]["gate"] == "fail"


def test_unknown_baseline_is_a_clear_error(study, tmp_path):
    results, ctx = study
    ctx.baseline = "nope"
    with pytest.raises(ValueError, match="baseline='nope' is not among"):
        write_report(results, ctx, tmp_path)


def test_pareto_front():
    pts = [(10, 0.78), (20, 0.80), (15, 0.77), (30, 0.79), (5, 0.70)]
    assert pareto_front(pts) == [(5, 0.70), (10, 0.78), (20, 0.80)]


def test_failed_baseline_is_no_reference(study):
    results, ctx = study
    results[0].status, results[0].error = "failed", "server crashed"
    rows = {r["variant"]: r for r in build_rows(results, ctx)}
    assert rows["base"]["status"] == "FAILED" and rows["pruned"]["d_auc_pct"] is None
    assert rows["pruned"]["gate"] == "fail" and "baseline 'base' has no AUC" in rows["pruned"]["gate_reason"]
