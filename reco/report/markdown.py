"""report.md: setup, the table, the fastest passing variant, targets met or missed, what each step bought."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import TYPE_CHECKING

from reco.report.table import DASH, markdown_table, metric, ms, one_line, ratio

if TYPE_CHECKING:
    from reco.report import StudyContext, VariantResult


def fastest_passing(rows: list[dict]) -> dict | None:
    """The passing variant with the lowest e2e p99 at the common load."""
    ok = [r for r in rows if r["gate"] == "pass" and r["e2e_p99_ms"] is not None]
    return min(ok, key=lambda r: r["e2e_p99_ms"]) if ok else None


def _f(x: float | None, spec: str) -> str:
    return DASH if x is None else format(x, spec)


def headline(rows: list[dict], ctx: StudyContext) -> str:
    best = fastest_passing(rows)
    if best is None:
        return "**No variant passes the gate** at the common load (see the gate column for why)."
    load = f" at {ctx.common_rate_qps:g} qps" if ctx.common_rate_qps else ""
    return (
        f"**Fastest passing variant: `{best['variant']}`** — e2e p99 {ms(best['e2e_p99_ms'])} ms{load}, "
        f"{_f(best['speedup'], '.2f')}× faster than the baseline at p99, AUC {_f(best['auc'], '.4f')} "
        f"({_f(best['d_auc_pct'], '+.2f')}% vs baseline), max QPS at SLO {_f(best['max_qps_at_slo'], '.0f')}."
    )


def _step_best(rows, results, step: str, compute, fallback_key: str):
    """Best (max) figure over ok variants of `step`: computed from lineage, else the step's own metric."""
    by_name = {r["variant"]: r for r in rows}
    res = {r.variant.name: r for r in results}
    found = []
    for row in rows:
        if row["step"] != step or row["status"] != "ok":
            continue
        parent = by_name.get(row["parent"])
        x = compute(row, parent) if parent else None
        x = x if x is not None else metric(res[row["variant"]], fallback_key)
        if x is not None:
            found.append((x, row, parent))
    return max(found, key=lambda t: t[0]) if found else None


def _pruned_pct(row, parent):
    r = ratio(row["params"], parent["params"])
    return None if r is None else (1 - r) * 100


def _size_ratio(row, parent):
    return ratio(parent["size_mb"], row["size_mb"])


def targets(rows: list[dict], results: list[VariantResult], ctx: StudyContext) -> list[str]:
    """One line per target: MET / MISSED with the measured figure; unmeasurable counts as MISSED."""
    best = fastest_passing(rows)
    base = next(r for r in rows if r["variant"] == ctx.baseline)
    lines = []
    for key, goal in ctx.targets.items():
        if not isinstance(goal, int | float):
            raise ValueError(f"StudyContext.targets[{key!r}] = {goal!r}: expected a number")
        met, text = False, ""
        if key == "e2e_speedup":
            what = f"e2e p99 speed-up vs baseline ≥ {goal:g}×"
            if best is None or best["speedup"] is None:
                text = f"{what}: not measured (no passing variant with an e2e p99 and a baseline p99)"
            else:
                met = best["speedup"] >= goal
                text = (
                    f"{what}: measured {best['speedup']:.2f}× (`{best['variant']}` {ms(best['e2e_p99_ms'])} ms "
                    f"vs baseline {ms(base['e2e_p99_ms'])} ms)"
                )
        elif key == "qps_gain":
            what = f"max-QPS-at-SLO gain vs baseline ≥ {goal:g}×"
            ok = [r for r in rows if r["gate"] == "pass" and r["qps_gain"] is not None]
            if not ok:
                text = f"{what}: not measured (no passing variant with a max QPS at the SLO)"
            else:
                top = max(ok, key=lambda r: r["qps_gain"])
                met = top["qps_gain"] >= goal
                text = (
                    f"{what}: measured {top['qps_gain']:.2f}× (`{top['variant']}` {top['max_qps_at_slo']:.0f} "
                    f"vs baseline {_f(base['max_qps_at_slo'], '.0f')} QPS)"
                )
        elif key == "prune_params_pct":
            what = f"pruning removes ≥ {goal:g}% of parameters"
            found = _step_best(rows, results, "prune", _pruned_pct, "params_removed_pct")
            if found is None:
                text = f"{what}: not measured (no successful prune variant)"
            else:
                met = found[0] >= goal
                text = f"{what}: measured {found[0]:.1f}% (`{found[1]['variant']}`)"
        elif key == "distill_size_ratio":
            what = f"distilled student ≥ {goal:g}× smaller than its teacher"
            found = _step_best(rows, results, "distill", _size_ratio, "size_ratio")
            if found is None:
                text = f"{what}: not measured (no successful distill variant)"
            else:
                met = found[0] >= goal
                text = f"{what}: measured {found[0]:.2f}× (`{found[1]['variant']}`)"
        elif key == "max_auc_drop_pct":
            what = f"AUC drop of the fastest passing variant ≤ {goal:g}%"
            if best is None or best["d_auc_pct"] is None:
                text = f"{what}: not measured (no passing variant with an AUC)"
            else:
                met = -best["d_auc_pct"] <= goal
                text = f"{what}: measured {-best['d_auc_pct']:.2f}% (`{best['variant']}`)"
        else:
            lines.append(f"- **NOT EVALUATED** — unknown target `{key}` = {goal!r}")
            continue
        lines.append(f"- **{'MET' if met else 'MISSED'}** — {text}.")
    return lines


def attribution(rows: list[dict]) -> list[str]:
    """Parent -> child ratios per step: what the step bought in latency and cost in AUC."""
    by_name = {r["variant"]: r for r in rows}
    out = [
        "| step | parent → variant | e2e p99 ms | p99 speed-up | ΔAUC vs parent % | size × smaller | QPS gain |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        parent = by_name.get(row["parent"])
        if parent is None or row["status"] != "ok" or parent["status"] != "ok":
            continue
        p99 = f"{_f(parent['e2e_p99_ms'], '.1f')} → {_f(row['e2e_p99_ms'], '.1f')}"
        d_auc = ratio(row["auc"], parent["auc"])
        cells = [
            row["step"],
            f"`{parent['variant']}` → `{row['variant']}`",
            p99,
            _f(ratio(parent["e2e_p99_ms"], row["e2e_p99_ms"]), ".2f"),
            _f(None if d_auc is None else (d_auc - 1) * 100, "+.2f"),
            _f(ratio(parent["size_mb"], row["size_mb"]), ".2f"),
            _f(ratio(row["max_qps_at_slo"], parent["max_qps_at_slo"]), ".2f"),
        ]
        out.append("| " + " | ".join(cells) + " |")
    if len(out) == 2:
        return ["No variant with a successful parent to compare against."]
    return [
        "Ratios are parent / child for latency and size (> 1: the step helped) and child / parent for QPS.",
        "",
        *out,
    ]


def report(
    rows: list[dict], results: list[VariantResult], ctx: StudyContext, images: dict[str, Path], out_dir: Path
) -> str:
    base = next(r for r in rows if r["variant"] == ctx.baseline)
    base_res = next(r for r in results if r.variant.name == ctx.baseline)
    now = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    base_auc = base["auc"] if base["status"] == "ok" else None  # a failed baseline is no reference
    gate_auc = f" = {ctx.auc_keep * base_auc:.4f}" if base_auc is not None else ": baseline AUC missing"
    slo = (
        f"e2e p99 ≤ {ctx.slo_p99_ms:g} ms"
        if ctx.slo_p99_ms is not None
        else "none (the gate checks AUC only)"
    )
    load = f"{ctx.common_rate_qps:g} qps offered" if ctx.common_rate_qps else "not set (no load test)"
    lines = [
        f"# {ctx.experiment}: variant comparison",
        "",
        f"Machine: {one_line(ctx.machine) or 'not recorded'}  ",
        f"Report written: {now}",
        "",
        "## Setup",
        "",
        f"- Baseline: `{ctx.baseline}` (status {base['status']})",
        f"- Common load: {load}; every e2e figure, the latency CDF and the gate use this load.",
        f"- Latency SLO: {slo}",
        f"- Quality gate: AUC ≥ {ctx.auc_keep:g} × baseline AUC ({_f(base_auc, '.4f')}){gate_auc}",
        f"- Error-rate cap: {ctx.max_error_rate:.1%} of requests",
    ]
    oracle = metric(base_res, "oracle_auc")
    if oracle is not None:
        lines.append(f"- Oracle AUC (true click probabilities, the ceiling): {oracle:.4f}")
    lines += ["", "## Results", "", markdown_table(rows), "", headline(rows, ctx), ""]
    if ctx.targets:
        lines += ["## Targets", "", *targets(rows, results, ctx), ""]
    lines += ["## What each step bought", "", *attribution(rows), ""]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["## Failed variants", ""]
        lines += [f"- `{r['variant']}` FAILED: {one_line(r['error']) or 'no error message'}" for r in failed]
        lines += ["", "Failed variants are left out of the plots.", ""]
    lines += ["## Plots", ""]
    for caption, path in images.items():
        lines += [f"![{caption}]({path.relative_to(out_dir).as_posix()})", ""]
    missing = {"latency_cdf", "auc_vs_p99", "qps_vs_p99", "server_stages"} - {p.stem for p in images.values()}
    if missing:
        lines += [f"Not drawn (no data): {', '.join(sorted(missing))}.", ""]
    return "\n".join(lines)
