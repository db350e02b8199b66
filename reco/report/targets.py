"""The experiment's targets (`targets:` in the preset), each MET / MISSED / INCONCLUSIVE decided on the CI.

One table, TARGETS: a target names what it measures, the direction of its goal and how to measure it.
A figure with sampling error (latency, throughput, ΔAUC) is MET only when its whole CI is on the right
side of the goal; an exact figure (parameter count, file size) is compared as is. A target that cannot
be measured is MISSED, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from reco.report.context import StudyContext
from reco.report.figures import VariantFigures
from reco.report.fmt import short
from reco.report.gate import Gate
from reco.report.table import metric
from reco.stats import Estimate, Verdict, verdict_at_least, verdict_at_most

WORD = {Verdict.PASS: "MET", Verdict.FAIL: "MISSED", Verdict.INCONCLUSIVE: "INCONCLUSIVE"}


@dataclass(frozen=True)
class Measured:
    figure: Estimate  # exact figures have lo = hi = value
    text: str  # the figure as shown, with the variant it comes from


# A measure returns the figure, or the reason it could not be measured.
Measure = Callable[[list[VariantFigures], dict[str, Gate], StudyContext], Measured | str]


def exact(x: float) -> Estimate:
    """A figure without sampling error."""
    return Estimate(x, x, x, 1)


def fastest_passing(figs: list[VariantFigures], gates: dict[str, Gate]) -> VariantFigures | None:
    """The variant whose gate PASSed with the lowest pooled e2e p99 at the common load."""
    ok = [f for f in figs if gates[f.name].overall == Verdict.PASS and f.p99() and f.p99().supported]
    return min(ok, key=lambda f: f.p99().value) if ok else None


def _speedup(figs, gates, ctx) -> Measured | str:
    best = fastest_passing(figs, gates)
    if best is None or ("common", "p99") not in best.speedup:
        return "no passing variant with an e2e p99 at the common load"
    r = best.speedup[("common", "p99")].pooled
    if not r.supported:
        return f"`{best.name}`: p99 not supported by n"
    like = [
        f"{label} {short(best.speedup[(kind, 'p99')].pooled, '.2f', '×')}"
        for kind, label in (("unloaded", "unloaded"), ("equal_util", "equal utilisation"))
        if (kind, "p99") in best.speedup
    ]
    extra = f"; like for like: {', '.join(like)}" if like else ""
    return Measured(r, f"{short(r, '.2f', '×')} at the common load (`{best.name}`{extra})")


def _qps_gain(figs, gates, ctx) -> Measured | str:
    ok = [f for f in figs if gates[f.name].overall == Verdict.PASS and f.qps_gain is not None]
    if not ok:
        return "no passing variant with a capacity at the SLO"
    top = max(ok, key=lambda f: f.qps_gain.value)
    return Measured(
        top.qps_gain,
        f"{short(top.qps_gain, '.2f', '×')} (`{top.name}`; interval from the capacity brackets and repeats)",
    )


def _lineage_best(
    step: str, compute: Callable[[VariantFigures, VariantFigures], float | None], fallback: str, unit: str
) -> Measure:
    """Best figure over successful variants of `step`: from the parent's figures, else the step's own metric
    `fallback` (when the parent is not in the study)."""

    def measure(figs, gates, ctx) -> Measured | str:
        best = _best_of(figs, step, compute, fallback)
        if best is None:
            return f"no successful {step} variant"
        x, f = best
        return Measured(exact(x), f"{x:.2f}{unit} (`{f.name}`, exact)")

    return measure


def _best_of(
    figs: list[VariantFigures],
    step: str,
    compute: Callable[[VariantFigures, VariantFigures], float | None],
    fallback: str,
) -> tuple[float, VariantFigures] | None:
    """(figure, variant) with the highest figure over successful variants of `step`; None when none has one."""
    by_name = {f.name: f for f in figs}
    found = []
    for f in figs:
        if f.result.variant.step != step or not f.ok:
            continue
        parent = by_name.get(f.result.variant.parent or "")
        x = compute(f, parent) if parent is not None and parent.ok else None
        x = x if x is not None else metric(f, fallback)
        if x is not None:
            found.append((x, f))
    return max(found, key=lambda t: t[0]) if found else None


def _pruned_pct(f: VariantFigures, parent: VariantFigures) -> float | None:
    a, b = f.result.variant.params, parent.result.variant.params
    return (1 - a / b) * 100 if a and b else None


def _size_ratio(f: VariantFigures, parent: VariantFigures) -> float | None:
    a, b = f.result.variant.size_mb, parent.result.variant.size_mb
    return b / a if a and b else None


def _drop_of(f: VariantFigures, which: str) -> Measured | str:
    """f's relative AUC drop vs the baseline in % (test split, paired CI)."""
    if f.is_baseline:
        return Measured(exact(0.0), f"0 (`{f.name}` is the baseline)")
    rel = f.result.auc_delta[1] if f.result.auc_delta else None
    if rel is None or not rel.supported:
        return f"`{f.name}` has no ΔAUC CI"
    drop = Estimate(-rel.value * 100, -rel.hi * 100, -rel.lo * 100, rel.n)
    return Measured(drop, f"{short(drop, '.2f', '%')} (`{f.name}`, {which})")


def _auc_drop(figs, gates, ctx) -> Measured | str:
    best = fastest_passing(figs, gates)
    return "no passing variant" if best is None else _drop_of(best, "the fastest passing variant")


def _embed_auc_drop(figs, gates, ctx) -> Measured | str:
    """The drop of the variant the size target measured (the most compressed embed_quant variant)."""
    best = _best_of(figs, "embed_quant", _size_ratio, "model_size_ratio")
    if best is None:
        return "no successful embed_quant variant"
    return _drop_of(best[1], "the most compressed embed_quant variant")


@dataclass(frozen=True)
class Target:
    what: str  # with {goal}
    at_least: bool  # goal is a floor (else a ceiling)
    measure: Measure


TARGETS: dict[str, Target] = {
    "e2e_speedup": Target("e2e p99 speed-up vs baseline ≥ {goal:g}×", True, _speedup),
    "qps_gain": Target("max-QPS-at-SLO gain vs baseline ≥ {goal:g}×", True, _qps_gain),
    "prune_params_pct": Target(
        "pruning removes ≥ {goal:g}% of parameters",
        True,
        _lineage_best("prune", _pruned_pct, "params_removed_pct", "%"),
    ),
    "distill_size_ratio": Target(
        "distilled student ≥ {goal:g}× smaller than its teacher",
        True,
        _lineage_best("distill", _size_ratio, "size_ratio", "×"),
    ),
    "max_auc_drop_pct": Target("AUC drop of the fastest passing variant ≤ {goal:g}%", False, _auc_drop),
    "embed_size_ratio": Target(
        "embedding compression shrinks its parent's model file ≥ {goal:g}×",
        True,
        _lineage_best("embed_quant", _size_ratio, "model_size_ratio", "×"),
    ),
    "embed_max_auc_drop_pct": Target(
        "AUC drop of the embedding-compressed variant ≤ {goal:g}%", False, _embed_auc_drop
    ),
}


def target_lines(figs: list[VariantFigures], gates: dict[str, Gate], ctx: StudyContext) -> list[str]:
    """One Markdown line per target in ctx.targets: '- **MET** — what: measured figure [CI]'.

    Raises ValueError when a goal is not a number.
    """
    lines = []
    for key, goal in ctx.targets.items():
        if not isinstance(goal, int | float):
            raise ValueError(f"StudyContext.targets[{key!r}] = {goal!r}: expected a number")
        target = TARGETS.get(key)
        if target is None:
            lines.append(
                f"- **NOT EVALUATED** — unknown target `{key}` = {goal!r} (known: {', '.join(TARGETS)})"
            )
            continue
        what = target.what.format(goal=goal)
        got = target.measure(figs, gates, ctx)
        if isinstance(got, str):
            lines.append(f"- **MISSED** — {what}: not measured ({got}).")
            continue
        v = (verdict_at_least if target.at_least else verdict_at_most)(got.figure, goal)
        lines.append(f"- **{WORD[v]}** — {what}: measured {got.text}.")
    return lines
