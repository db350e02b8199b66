"""report.md: a one-screen summary (headline, the seed's comparison in five columns, the targets' tally,
one picture), then the full table, setup, gate, targets, the comparison sections and plots."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from statistics import median

from reco.loadtest.outcome import time_spent
from reco.report import sections
from reco.report.context import StudyContext
from reco.report.figures import KINDS, VariantFigures
from reco.report.fmt import DASH, est, one_line, scaled, short, spread, table
from reco.report.gate import Gate
from reco.report.plots import lead
from reco.report.table import like_for_like_kind, markdown_table, metric, summary_columns, variant_table
from reco.report.targets import (
    Outcome,
    TargetResult,
    declared_headline,
    evaluate,
    fastest_passing,
    gain_floor,
    target_lines,
)

PLOTS = ("latency_cdf", "auc_vs_p99", "qps_vs_p99", "server_stages")


def _repeat_counts(figs: list[VariantFigures]) -> str:
    counts = {k: max((len(f.latency[k].runs) for f in figs if k in f.latency), default=0) for k in KINDS}
    counts["capacity"] = max((len(f.capacity) for f in figs), default=0)
    return ", ".join(f"{k} ×{n}" for k, n in counts.items() if n) or "none"


def setup(figs: list[VariantFigures], ctx: StudyContext) -> list[str]:
    """The conditions every figure was measured under."""
    base = next(f for f in figs if f.is_baseline)
    study = ctx.study
    n_rows = next((f.result.auc_delta[1].n for f in figs if f.result.auc_delta), None)
    lines = [
        f"- Baseline: `{ctx.baseline}` (status {base.result.status})",
        f"- Accuracy gate: relative ΔAUC vs the baseline ≥ {-ctx.max_auc_drop:+.2%}, decided on its 95 % CI "
        f"(DeLong, paired on the same {f'{n_rows:,} ' if n_rows else ''}test rows): PASS when the whole CI is "
        "above the limit, FAIL when wholly below, INCONCLUSIVE when it straddles it.",
    ]
    if study is None:
        lines.append("- Load test: none (the gate checks accuracy only)")
    else:
        util = base.utilisation("common")
        of_base = f" = {util:.0%} of the baseline's capacity" if util is not None else ""
        if study.common_source and util is None:  # not a fraction of a measured capacity: say what it is
            of_base = f" ({study.common_source})"
        slo = f"{study.slo_p99_ms:g} ms ({study.slo_source})" if study.slo_p99_ms is not None else "none"
        load = f"{study.common_rate_qps:g} req/s offered{of_base}" if study.common_rate_qps else "not set"
        lines += [
            f"- Latency SLO: e2e p99 ≤ {slo}; the latency gate needs the pooled p99 CI at the common load "
            f"within it (or, where that CI is open, a capacity step that passed at a higher rate, or the "
            f"baseline's p99 bound there over the variant's paired p99 speed-up there) and the "
            f"error rate ≤ {ctx.max_error_rate:.1%}",
            f"- Common load: {load}; open-loop Poisson arrivals, the same for every variant",
            f"- keep_warm: {'on' if study.keep_warm else 'off'}; before the first measured window every "
            f"server got {study.settle_s:g} s of unrecorded traffic (`loadtest.study.settle_s`)",
            f"- Repeats per variant: {_repeat_counts(figs)}",
            f"- Time spent load-testing, largest first: {time_spent(study.seconds) or 'not recorded'}",
            f"- Time budget (`loadtest.study.budget_min`): {study.budget or 'not recorded'}",
            f"- Hypervisor steal: {_steal_note(figs)} (the host running something else on this VM's CPUs: "
            "no pairing inside the VM sees it)",
        ]
    oracle = metric(base, "oracle_auc")
    if oracle is not None:
        lines.append(f"- Oracle AUC (true click probabilities, the ceiling): {oracle:.4f}")
    lines += [
        "- Statistics: every latency is a nearest-rank quantile with a 95 % CI between two order statistics, "
        "widened for requests that are not independent (their dependence in send order, and drift between "
        "repeats: reco.stats.dependent), `value [lo, hi] (n=…)`, or `[lo, inf)` when the interval reaches past "
        "every measured request; a quantile n cannot support (p99 needs n ≥ 368, p999 n ≥ 3,688) reads "
        "`n/a (n=…)`; failed, shed or timed-out requests count as +inf. Coverage checked by simulation "
        "(queues at 30–85 % utilisation, drift between repeats): experiments/interval_coverage/README.md in "
        "the reco repository. Runs whose load generator could not vouch for them (`valid=False`) are marked "
        "and excluded from figures and verdicts. Ratios between variants (speed-ups) are paired: every variant "
        "runs once per block of each kind of run, in a random order, and the ratio comes from the blocks both "
        "ran in (reco.stats.paired), so drift the variants share cancels: unloaded, the median block's ratio "
        "of its two windows' Harrell-Davis quantiles with a sign-test CI (a host slow stretch that hits a few "
        "windows moves it little: the speed-up on the host without its rare stretches); under load, the "
        "ratio of the pooled quantiles with a paired block-bootstrap CI (Student t on blocks - 1 df); "
        f"{_paired_note(figs)}.",
        f"- Machine: {one_line(ctx.machine.line()) if ctx.machine else 'not recorded'}",
        f"- Commit: {ctx.commit or 'not recorded'}",
        f"- Report written: {dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
    ]
    return lines


def headline(figs: list[VariantFigures], gates: dict[str, Gate], ctx: StudyContext) -> str:
    if ctx.study is None:
        return "**No load test**: latency and throughput not measured; the gate checks accuracy only."
    declared = declared_headline(figs, ctx)
    best = declared or fastest_passing(figs, gates)
    if best is None:
        return (
            "**No variant passes the gate** with an e2e p99 at the common load (see the gate table for why)."
        )
    ratios = [
        f"{label} {short(best.speedup[(kind, 'p99')].pooled, '.2f', '×')}"
        for kind, label in (
            ("unloaded", "unloaded"),
            ("equal_util", "at equal utilisation"),
            ("common", "at the common load"),
        )
        if (kind, "p99") in best.speedup
    ]
    d = best.result.auc_delta
    auc = f"ΔAUC {short(scaled(d[1], 100), '+.2f', '%')}" if d else "ΔAUC –"
    gain = short(best.qps_gain, ".2f", "×")
    if best.qps_gain is None and (floor := gain_floor(best, figs)):  # as the qps_gain target reads it
        passed, base_fail = floor
        gain = f"> {passed / base_fail:.2f}× (one-sided: the baseline passed no rate, and failed at {base_fail:.1f} req/s)"
    return (
        f"**{'Headline variant (declared)' if declared else 'Fastest passing variant'}: `{best.name}`** — e2e p99 {est(best.p99(), unit=' ms')} at the common "
        f"load; p99 speed-up vs the baseline {'; '.join(ratios) or DASH}; {auc}; max QPS at the SLO "
        f"{spread(best.max_qps, '.0f')}, gain {gain}."
    )


def _steal_note(figs: list[VariantFigures]) -> str:
    """Steal over the windows of each kind of run: median and largest, % of one core. A window with steal
    had requests delayed by the host: episodes of it widen the paired intervals (blocks spread them)."""
    parts = []
    for kind in KINDS:
        pct = [r.steal_pct for f in figs if kind in f.latency for r in f.latency[kind].runs]
        if pct:
            parts.append(f"{kind} median {median(pct):.1f} %, max {max(pct):.1f} % ({len(pct)} windows)")
    return "; ".join(parts) or "not recorded"


def _paired_note(figs: list[VariantFigures]) -> str:
    """How many blocks the speed-ups rest on, and how, per kind of run: 'unloaded 28 blocks (median
    block), common 3 blocks (pooled blocks)'."""
    most: dict[str, tuple[int, str]] = {}
    for f in figs:
        for (kind, _), r in f.speedup.items():
            most[kind] = max(most.get(kind, (0, r.method)), (r.blocks, r.method))
    parts = [
        f"{kind} {b} blocks ({how})" if b else f"{kind} unpaired (MOVER from the two pooled intervals)"
        for kind, (b, how) in most.items()
    ]
    return "paired blocks per kind of run: " + (", ".join(parts) or "none")


def summary_note(figs: list[VariantFigures], ctx: StudyContext) -> str:
    """What the summary's columns hold (the speed-up's kind of run is in its header)."""
    kind = like_for_like_kind(figs)
    speedup = (
        "baseline p99 / variant p99 in the same kind of run (95 % CI from the blocks both ran in, paired: "
        "see Statistics); the common-load ratio, not like for like, is in the table below"
        if kind
        else "not measured (no unloaded or equal-utilisation runs of both the baseline and a variant)"
    )
    capacity = (
        f"the capacity bracket at the {ctx.slo_p99_ms:g} ms p99 SLO, medians over the capacity repeats: the "
        "highest offered rate that passed and the lowest that failed (req/s)"
        if ctx.slo_p99_ms is not None
        else "not measured (no SLO)"
    )
    gate = "accuracy and latency, see Gate" if ctx.study else "accuracy only (no load test)"
    return (
        f"ΔAUC: relative to the baseline, % (DeLong 95 % CI). Speed-up: {speedup}. Max QPS: {capacity}. "
        f"Gate: {gate}."
    )


def tally(targets: list[TargetResult]) -> str:
    """'3 MET, 1 INCONCLUSIVE, 1 NOT MEASURED', in Outcome's order."""
    counts = {o: sum(t.outcome == o for t in targets) for o in Outcome}
    return ", ".join(f"**{n} {o}**" for o, n in counts.items() if n)


MIN_TEST_ROWS = 1_000  # below this a ΔAUC's DeLong CI spans several tenths of a percent at best


def small_data(ctx: StudyContext) -> str:
    """The Summary's first line when the data cannot carry a result: the baseline's own test AUC CI holds
    0.5 (it ranks no better than chance here), or the test split is too small for the intervals below
    to decide anything; '' otherwise."""
    auc = ctx.baseline_auc
    if auc is None or auc.value is None:
        return ""
    why = []
    if auc.lo <= 0.5 <= auc.hi:
        why.append(f"the baseline's test AUC {auc.fmt('.3f')} does not exclude 0.5 (chance)")
    if auc.n < MIN_TEST_ROWS:
        why.append(f"the test split has {auc.n:,} rows (< {MIN_TEST_ROWS:,})")
    if not why:
        return ""
    return (
        f"**Small data: a plumbing check, not a result** — {'; '.join(why)}, so the comparisons below say the "
        "pipeline runs, not how the variants compare."
    )


def summary(
    figs: list[VariantFigures],
    gates: dict[str, Gate],
    ctx: StudyContext,
    targets: list[TargetResult],
    images: dict[str, Path],
    out_dir: Path,
) -> list[str]:
    """The one screen: headline, the seed's comparison, the targets' tally and the lead picture."""
    lines = [warning, ""] if (warning := small_data(ctx)) else []
    lines += [headline(figs, gates, ctx), "", *variant_table(figs, gates, summary_columns(figs)), ""]
    lines += [summary_note(figs, ctx), ""]
    if targets:
        lines += [f"Targets: {tally(targets)} (see Targets).", ""]
    picture = lead(images)
    if picture is None:
        lines += ["No plot drawn (no data).", ""]
    else:
        caption, path = picture
        lines += [f"![{caption}]({path.relative_to(out_dir).as_posix()})", ""]
    return lines


def gate_table(figs: list[VariantFigures], gates: dict[str, Gate]) -> list[str]:
    rows = [
        [
            f"`{f.name}`",
            str(g.accuracy.verdict),
            str(g.quality.verdict) if g.quality else "n/a (off)",
            str(g.latency.verdict) if g.latency else "n/a (no SLO)",
            f"**{g.overall}**",
            g.reason or "; ".join(d.reason for d in g.parts),
        ]
        for f in figs
        for g in [gates[f.name]]
    ]
    return table(["variant", "accuracy", "what users see", "latency", "overall", "why"], rows)


def report(
    figs: list[VariantFigures],
    gates: dict[str, Gate],
    ctx: StudyContext,
    images: dict[str, Path],
    out_dir: Path,
) -> str:
    """The whole report.md.

    Args:
        figs: every variant's figures (reco.report.figures.study_figures), baseline included.
        gates: variant name -> its gate.
        ctx: the study.
        images: caption -> PNG path of every plot drawn.
        out_dir: where report.md goes (images are linked relative to it).
    Returns:
        Markdown text.
    """
    targets = evaluate(figs, gates, ctx)
    lines = [f"# {ctx.experiment}: variant comparison", ""]
    lines += ["## Summary", "", *summary(figs, gates, ctx, targets, images, out_dir)]
    lines += ["## Results", "", markdown_table(figs, gates), ""]
    lines += ["## Setup", "", *setup(figs, ctx), ""]
    lines += ["## Gate", "", *gate_table(figs, gates), ""]
    if targets:
        lines += ["## Targets", "", *target_lines(targets), ""]
    lines += ["## What users see", "", *sections.served_topk(figs, gates, ctx), ""]
    lines += ["## Baseline training", "", *sections.learning_curve(figs), ""]
    lines += ["## Latency, like for like", "", *sections.like_for_like(figs, ctx), ""]
    lines += ["## Throughput at the SLO", "", *sections.throughput(figs, ctx), ""]
    lines += ["## What each step bought", "", *sections.attribution(figs), ""]
    lines += ["### What the teacher adds", "", *sections.distillation(figs), ""]
    lines += ["### Embedding compression", "", *sections.embedding_compression(figs), ""]
    lines += ["## Repeats", "", *sections.repeats(figs), ""]
    lines += ["## Where the time goes", "", *sections.stages(figs), ""]
    lines += ["### Inside one ranking call", "", *sections.rank_profile(figs), ""]
    lines += ["### Retrieval", "", *sections.retrieval(ctx), ""]
    lines += ["### Cost per request", "", *sections.cost(figs, ctx), "", *sections.overhead(figs), ""]
    lines += ["## Correctness under load", "", *sections.correctness(figs), ""]
    invalid = sections.invalid_runs(figs)
    if invalid:
        lines += ["## Invalid runs (excluded)", "", *invalid, ""]
    failed = [f for f in figs if not f.ok]
    if failed:
        lines += ["## Failed variants", ""]
        lines += [f"- `{f.name}` FAILED: {one_line(f.result.error) or 'no error message'}" for f in failed]
        lines += ["", "Failed variants are left out of the plots.", ""]
    lines += ["## Plots", ""]
    for caption, path in images.items():
        lines += [f"![{caption}]({path.relative_to(out_dir).as_posix()})", ""]
    missing = set(PLOTS) - {p.stem for p in images.values()}
    if missing:
        lines += [f"Not drawn (no data): {', '.join(sorted(missing))}.", ""]
    lines += ["## Appendix: every capacity step", "", *sections.capacity_steps(figs)]
    return "\n".join(lines) + "\n"
