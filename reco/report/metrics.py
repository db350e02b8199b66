"""Flat per-variant metrics with CI bounds: what the pipeline logs to each MLflow child run and the CSV holds.

Names extend the README's metric contract (`e2e_p99_ms`, `max_qps_at_slo`, ...) with `_lo` / `_hi` for
the bounds of an interval and `_min` / `_max` (or `_rep_min` / `_rep_max`) for a range over repeats, which
is not an interval. These are the only load-test figures a variant's run gets (the study logs raw files
only), so each name has one meaning and one value. Figures at the common load are pooled over the valid
repeats. A quantile the sample cannot support is left out (never logged as its maximum). Verdicts are coded PASS 1, INCONCLUSIVE 0.5,
FAIL 0, INVALID -1 (VERDICT_CODE).
"""

from __future__ import annotations

from reco.loadtest.outcome import QUANTILES
from reco.report.context import StudyContext, VariantResult
from reco.report.figures import SLO_FACTORS, Latency, VariantFigures, study_figures
from reco.report.gate import Gate, study_gates
from reco.serve.metrics import LOOP_CPU_STAGES
from reco.stats import Estimate, Verdict

VERDICT_CODE = {Verdict.PASS: 1.0, Verdict.INCONCLUSIVE: 0.5, Verdict.FAIL: 0.0, Verdict.INVALID: -1.0}
PREFIX = {"common": "", "unloaded": "unloaded_", "equal_util": "equal_util_"}  # README: unloaded_e2e_p99_ms


def with_ci(name: str, e: Estimate | None) -> dict[str, float]:
    """{name, name_lo, name_hi} when the figure is supported, else {}."""
    if e is None or not e.supported:
        return {}
    return {name: e.value, f"{name}_lo": e.lo, f"{name}_hi": e.hi}


def with_range(name: str, e: Estimate | None) -> dict[str, float]:
    """{name, name_min, name_max} for a median of repeats with their range (reco.report.figures.range_estimate),
    else {}: named apart from with_ci's bounds because a range over 3 repeats is not a confidence interval."""
    if e is None or not e.supported:
        return {}
    return {name: e.value, f"{name}_min": e.lo, f"{name}_max": e.hi}


def outside_handler(lat: Latency) -> dict[str, float]:
    """Client e2e minus the server's handler total, for the mean and p99 (time in accept/parse/backlog)."""
    stages, out = lat.stages(), {}
    if lat.mean_ms is not None and "server_total_mean_ms" in stages:
        out["outside_handler_mean_ms"] = lat.mean_ms - stages["server_total_mean_ms"]
    p99 = lat.quantiles["p99"]
    if p99.supported and "server_total_p99_ms" in stages:
        out["outside_handler_p99_ms"] = p99.value - stages["server_total_p99_ms"]
    return out


CPU_PARTS = ("model", *LOOP_CPU_STAGES)  # cpu_per_request_<part>_ms (reco.loadtest.scrape.cpu_split)


def server_cpu_split(lat: Latency) -> dict[str, float]:
    """A request's server CPU split (reco.loadtest.scrape.cpu_split), medians over the repeats, with the
    rest recomputed as the median total - the median parts (so a row adds up), the non-model share and
    the ratio of the server CPU to the model calls' (issue 45's goal: <= 1.5) with its range over the
    repeats (_rep_min / _rep_max, not an interval); {} when not exported."""
    st = lat.stages()
    parts = {p: st.get(f"cpu_per_request_{p}_ms") for p in CPU_PARTS}
    total = st.get("cpu_per_request_ms")
    if total is None or None in parts.values() or not parts["model"]:
        return {}
    out = {f"cpu_per_request_{p}_ms": v for p, v in parts.items()}
    out["cpu_per_request_rest_ms"] = total - sum(parts.values())
    out["cpu_non_model_share"] = (total - parts["model"]) / total
    out["cpu_over_model_cpu"] = total / parts["model"]
    ratios = [
        r.server_stages["cpu_per_request_ms"] / r.server_stages["cpu_per_request_model_ms"]
        for r in lat.used
        if r.server_stages.get("cpu_per_request_model_ms") and "cpu_per_request_ms" in r.server_stages
    ]
    out |= {"cpu_over_model_cpu_rep_min": min(ratios), "cpu_over_model_cpu_rep_max": max(ratios)}
    out["cpu_split_n_repeats"] = float(len(ratios))
    return out


def _latency(kind: str, lat: Latency) -> dict[str, float]:
    pre = PREFIX[kind]
    m: dict[str, float] = {}
    for key in QUANTILES:
        m |= with_ci(f"{pre}e2e_{key}_ms", lat.quantiles[key])
    m |= {f"{pre}n_requests": lat.n, f"{pre}n_failures": lat.n_failed, f"{pre}error_rate": lat.error_rate}
    m |= {f"{pre}qps": lat.qps, f"{pre}loadgen_cpu_pct": lat.loadgen_cpu_pct, f"{pre}valid": float(lat.valid)}
    m |= {f"{pre}n_repeats": len(lat.runs), f"{pre}n_invalid_runs": lat.n_invalid}
    m |= {f"{pre}n_unsent": sum(r.n_unsent for r in lat.used)}
    if lat.mean_ms is not None:
        m[f"{pre}e2e_mean_ms"] = lat.mean_ms
    if lat.offered_qps is not None:  # open loop: the offered rate and the worst lag behind the schedule
        m[f"{pre}offered_qps"] = lat.offered_qps
        m[f"{pre}loadgen_lag_p99_ms"] = max(r.lag_p99_ms for r in lat.used)
    spread = lat.spread("p99")
    if spread is not None:
        m |= {f"{pre}e2e_p99_ms_rep_median": spread.value, f"{pre}e2e_p99_ms_rep_min": spread.lo}
        m[f"{pre}e2e_p99_ms_rep_max"] = spread.hi
    if kind == "common":
        m |= lat.stages() | outside_handler(lat) | server_cpu_split(lat)
    return m


def variant_metrics(f: VariantFigures, g: Gate, ctx: StudyContext) -> dict[str, float]:
    """Every figure of one variant as MLflow metrics (name -> float).

    Args:
        f: the variant's figures (reco.report.figures.study_figures).
        g: its gate (reco.report.gate.gate).
        ctx: the study (SLO and common load are repeated on every child run for MLflow's compare view).
    Returns:
        flat dict; figures that were not measured or not supported are absent.
    """
    m = _gate_metrics(g) | _quality_metrics(f)
    if ctx.slo_p99_ms is not None:
        m["slo_p99_ms"] = ctx.slo_p99_ms
    if ctx.common_rate_qps is not None:
        m["common_rate_qps"] = ctx.common_rate_qps
    if f.result.auc_delta is not None:
        m |= with_ci("auc_delta", f.result.auc_delta[0]) | with_ci("auc_delta_rel", f.result.auc_delta[1])
    for kind, lat in f.latency.items():
        m |= _latency(kind, lat)
        util = f.utilisation(kind)
        if util is not None:
            m[f"{PREFIX[kind] or 'common_'}utilisation"] = util
    for (kind, key), ratio in f.speedup.items():
        m |= with_ci(f"speedup_{key}_{kind}", ratio.pooled)
    return m | _capacity_metrics(f) | _correctness_metrics(f)


def _gate_metrics(g: Gate) -> dict[str, float]:
    m = {"gate": VERDICT_CODE[g.overall], "gate_accuracy": VERDICT_CODE[g.accuracy.verdict]}
    if g.latency is not None:
        m["gate_latency"] = VERDICT_CODE[g.latency.verdict]
    if g.quality is not None:
        m["gate_quality"] = VERDICT_CODE[g.quality.verdict]
    return m


def _quality_metrics(f: VariantFigures) -> dict[str, float]:
    m: dict[str, float] = {}
    if f.result.gauc is not None:
        m |= with_ci("gauc", f.result.gauc.value) | with_ci("gauc_delta_rel", f.result.gauc.delta)
    g = f.result.graded
    if g is not None:  # graded by the planted P(click)
        m |= (
            with_ci(f"expected_clicks_at_{g.k}", g.clicks)
            | with_ci(f"expected_clicks_at_{g.k}_delta_rel", g.clicks_delta)
            | with_ci(f"oracle_ndcg_at_{g.k}", g.ndcg)
            | with_ci(f"oracle_ndcg_at_{g.k}_delta_rel", g.ndcg_delta)
        )
    q = f.result.quality
    if q is None:
        return m
    # names carry k: NDCG@10 and NDCG@20 are different figures
    return m | (
        with_ci(f"ndcg_at_{q.k}", q.ndcg)
        | with_ci(f"recall_at_{q.k}", q.recall)
        | with_ci(f"ndcg_at_{q.k}_delta_rel", q.ndcg_delta)
        | with_ci(f"overlap_at_{q.k}", q.overlap)
        | with_ci(f"rbo_at_{q.k}", q.rbo)
    )


def _capacity_metrics(f: VariantFigures) -> dict[str, float]:
    m = with_range("max_qps_at_slo", f.max_qps) | with_ci("qps_gain", f.qps_gain)
    b = f.bracket  # the report's bracket, so MLflow's figure and the report's are one
    if b is not None and b.lowest_fail is not None:
        m["lowest_fail_qps"] = b.lowest_fail
    for factor in SLO_FACTORS:
        if factor != 1.0:
            m |= with_range(f"max_qps_at_slo_x{factor:g}", f.max_qps_at[factor])
            m |= with_ci(f"qps_gain_at_slo_x{factor:g}", f.qps_gain_at[factor])
    return m


def _correctness_metrics(f: VariantFigures) -> dict[str, float]:
    check = f.result.load.correctness if f.result.load else None
    if check is None:
        return {}
    m = {"correctness_n": check.n_requests, "correctness_max_abs_diff": check.max_abs_diff}
    m["correctness_passed"] = float(check.passed)
    if check.batch_spread:
        m |= {"correctness_batch_spread": check.batch_spread, "correctness_allowed": check.allowed}
    return m


def study_metrics(results: list[VariantResult], ctx: StudyContext) -> dict[str, dict[str, float]]:
    """variant_metrics() of every variant, keyed by variant name, for the pipeline to log to its child runs.

    Args:
        results: one per variant, the baseline among them.
        ctx: the study's yardsticks.
    Returns:
        {variant name: {metric name: value}}.
    """
    figs = study_figures(results, ctx)
    gates = study_gates(figs, ctx)
    return {f.name: variant_metrics(f, gates[f.name], ctx) for f in figs}
