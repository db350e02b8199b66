"""The experiment's targets (`targets:` in the preset): MET / MISSED / INCONCLUSIVE decided on the CI, or
NOT MEASURED.

One table, TARGETS: a target names what it measures, the direction of its goal and how to measure it.
A figure with sampling error (latency, throughput, ΔAUC) is MET only when its whole CI is on the right
side of the goal; an exact figure (parameter count, file size) is compared as is. A target whose figure
does not exist (load test off, no such step in the study, too few requests) is NOT MEASURED, with the
reason; one whose figure exists but on no variant that passes the gate is MISSED. evaluate() returns
the verdicts as TargetResult objects; target_lines() renders them.

What a figure's bounds mean decides what its verdict may say (Measured.basis):
- **The headline variant is declared** (`headline` in the preset, StudyContext.headline): the e2e
  speed-up, QPS gain and AUC-drop targets are judged on it, a confirmatory test. Without one the best
  point estimate among the N passing variants is picked and judged on its own interval, which selection
  biases upwards: such a verdict is at most INCONCLUSIVE (a FAIL stands), and the text says it was
  selected among N. (Simpler and more honest than a Bonferroni widening, which would still rank on the
  same noisy points.)
- **The e2e speed-up is judged like for like**: the unloaded p99 ratio, else the one at equal
  utilisation; the common-load ratio (each variant at a different utilisation) is reported beside it.
- **Ranges are called ranges**: the QPS gain's bounds span the repeats' capacity brackets, a range and
  not a confidence interval; it is MET / MISSED only when the whole range is on one side of the goal,
  and the text says "all repeats". When the budget stopped the baseline's searches before any rate
  passed but each FAILed one, the range is one-sided (_gain_floor): it can be MET, never MISSED.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from reco.report.context import StudyContext
from reco.report.figures import VariantFigures
from reco.report.fmt import short
from reco.report.gate import Gate
from reco.report.table import metric
from reco.stats import Estimate, Verdict, verdict_at_least, verdict_at_most


class Outcome(StrEnum):
    MET = "MET"
    MISSED = "MISSED"
    INCONCLUSIVE = "INCONCLUSIVE"
    NOT_MEASURED = "NOT MEASURED"  # the figure does not exist: nothing to hold against the goal
    NOT_EVALUATED = "NOT EVALUATED"  # a key TARGETS does not know


WORD = {Verdict.PASS: Outcome.MET, Verdict.FAIL: Outcome.MISSED, Verdict.INCONCLUSIVE: Outcome.INCONCLUSIVE}


class Basis(StrEnum):
    """What a Measured figure's lo / hi are."""

    INTERVAL = "interval"  # a 95 % confidence interval
    RANGE = "range"  # the range over repeats (or their brackets): decided only when all repeats agree
    EXACT = "exact"  # no sampling error (lo = hi = value)


@dataclass(frozen=True)
class Measured:
    figure: Estimate  # exact figures have lo = hi = value
    text: str  # the figure as shown, with the variant it comes from
    basis: Basis = Basis.INTERVAL
    # False: the variant was selected as the best of several, so its own interval cannot confirm the goal
    # (a PASS is reported INCONCLUSIVE; see the module docstring)
    confirmatory: bool = True


@dataclass(frozen=True)
class Unmeasured:
    reason: str
    # True: the figure exists, but on no variant the target may count (none passes the gate): a miss
    missed: bool = False


# A measure returns the figure, or why there is none.
Measure = Callable[[list[VariantFigures], dict[str, Gate], StudyContext], Measured | Unmeasured]


@dataclass(frozen=True)
class Pick:
    """The variant a headline target is judged on."""

    figs: VariantFigures
    declared: bool  # True: the preset's `headline`; False: the best point estimate among `among`
    among: int  # passing variants it was picked from (1 when declared)

    def note(self) -> str:
        if self.declared:
            return "the declared headline"
        return f"selected as the best of {self.among} passing variants: not a confirmatory test; declare `headline`"


def declared_headline(figs: list[VariantFigures], ctx: StudyContext) -> VariantFigures | None:
    """The preset's headline variant; None when none is declared. Raises ValueError naming `headline` and
    the variants available when it is not among them."""
    if ctx.headline is None:
        return None
    for f in figs:
        if f.name == ctx.headline:
            return f
    raise ValueError(
        f"headline={ctx.headline!r}: expected one of the study's variants {[f.name for f in figs]}"
    )


def pick(
    figs: list[VariantFigures],
    gates: dict[str, Gate],
    ctx: StudyContext,
    has: Callable[[VariantFigures], bool],
    score: Callable[[VariantFigures], float],
) -> Pick | None:
    """The declared headline, else the passing variant with figure `has` whose `score` is highest; None
    when no headline is declared and no passing variant has the figure."""
    declared = declared_headline(figs, ctx)
    if declared is not None:
        return Pick(declared, True, 1)
    ok = [f for f in figs if gates[f.name].overall == Verdict.PASS and has(f)]
    return Pick(max(ok, key=score), False, len(ok)) if ok else None


def _gate_blocks(p: Pick, gates: dict[str, Gate]) -> Unmeasured | None:
    """A declared headline that does not pass the gate cannot meet a target: MISSED on a FAIL, else not
    measured (INCONCLUSIVE / INVALID gate: nothing to hold the goal against yet)."""
    v = gates[p.figs.name].overall
    if not p.declared or v == Verdict.PASS:
        return None
    return Unmeasured(f"the headline `{p.figs.name}` does not pass the gate ({v})", missed=v == Verdict.FAIL)


def exact(x: float) -> Estimate:
    """A figure without sampling error."""
    return Estimate(x, x, x, 1)


def fastest_passing(figs: list[VariantFigures], gates: dict[str, Gate]) -> VariantFigures | None:
    """The variant whose gate PASSed with the lowest pooled e2e p99 at the common load."""
    ok = [f for f in figs if gates[f.name].overall == Verdict.PASS and f.p99() and f.p99().supported]
    return min(ok, key=lambda f: f.p99().value) if ok else None


def _no_passing(figs: list[VariantFigures], has: Callable[[VariantFigures], bool], what: str) -> Unmeasured:
    """No variant that passes the gate has the figure: a miss when some variant has it, else not measured."""
    if any(has(f) for f in figs):
        return Unmeasured(f"no variant that passes the gate has {what}", missed=True)
    return Unmeasured(f"no variant has {what}")


LIKE_FOR_LIKE = (("unloaded", "unloaded"), ("equal_util", "at equal utilisation"))


def like_for_like(f: VariantFigures) -> tuple[str, Estimate] | None:
    """(label, p99 speed-up) of the first like-for-like kind of run the variant has a supported ratio for:
    unloaded, else equal utilisation; None when neither."""
    for kind, label in LIKE_FOR_LIKE:
        r = f.speedup.get((kind, "p99"))
        if r is not None and r.pooled.supported:
            return label, r.pooled
    return None


def _speedup(figs, gates, ctx) -> Measured | Unmeasured:
    """The like-for-like p99 speed-up of the headline variant, the common-load ratio beside it."""
    p = pick(figs, gates, ctx, _has_lfl, _lfl_value)
    what = "a like-for-like (unloaded or equal-utilisation) e2e p99 speed-up"
    if p is None:
        return _no_passing(figs, lambda f: like_for_like(f) is not None, what)
    if (blocked := _gate_blocks(p, gates)) is not None:
        return blocked
    if p.figs.is_baseline:
        return Measured(
            exact(1.0), f"1× (`{p.figs.name}`, the baseline; {p.note()})", Basis.EXACT, p.declared
        )
    found = like_for_like(p.figs)
    if found is None:
        return Unmeasured(f"`{p.figs.name}` has no {what}")
    label, r = found
    common = p.figs.speedup.get(("common", "p99"))
    beside = f"; at the common load {short(common.pooled, '.2f', '×')}, not like for like" if common else ""
    text = f"{short(r, '.2f', '×')} {label} (`{p.figs.name}`, {p.note()}{beside})"
    return Measured(r, text, Basis.INTERVAL, p.declared)


def _has_lfl(f: VariantFigures) -> bool:
    """A like-for-like speed-up, or the baseline load-tested (its speed-up over itself is 1)."""
    return like_for_like(f) is not None or (f.is_baseline and bool(f.latency))


def _lfl_value(f: VariantFigures) -> float:
    found = like_for_like(f)
    return 1.0 if found is None else found[1].value


def _qps_gain(figs, gates, ctx) -> Measured | Unmeasured:
    p = pick(figs, gates, ctx, lambda f: f.qps_gain is not None, lambda f: f.qps_gain.value)
    if p is None:
        return _no_passing(figs, lambda f: f.qps_gain is not None, "a QPS gain at the SLO")
    if (blocked := _gate_blocks(p, gates)) is not None:
        return blocked
    g = p.figs.qps_gain
    if g is None:
        floor = gain_floor(p.figs, figs)
        if floor is None:
            return Unmeasured(f"`{p.figs.name}` has no QPS gain at the SLO")
        passed, base_fail = floor
        gain = passed / base_fail
        text = (
            f"> {gain:.2f}× (`{p.figs.name}`, {p.note()}; one-sided: no rate of the baseline passed before the "
            f"time budget, but it failed the SLO at {base_fail:.1f} req/s, so its capacity lies below that, "
            f"while `{p.figs.name}` passed at {passed:.0f} req/s; a range over the repeats, not a CI)"
        )
        return Measured(Estimate(gain, gain, math.inf, len(p.figs.capacity)), text, Basis.RANGE, p.declared)
    text = f"{short(g, '.2f', '×')} (`{p.figs.name}`, {p.note()}; a range over the repeats' capacity brackets, not a CI)"
    return Measured(g, text, Basis.RANGE, p.declared)


def gain_floor(f: VariantFigures, figs: list[VariantFigures]) -> tuple[float, float] | None:
    """(f's lowest passing rate over its repeats, the baseline's rate above its capacity) when the
    baseline's (among `figs`) capacity is bounded only from above: none of its searches located one, but every search
    that ran a step FAILed one, so its capacity lies below the highest of their lowest FAILs (latency
    assumed not to fall as the load rises, as the gate assumes); the ratio bounds f's QPS gain from
    below. None when f passed no rate, or a baseline search that ran steps failed none."""
    passes = [c.highest_pass for c in f.capacity if c.decided and c.highest_pass > 0]
    base = next((b for b in figs if b.is_baseline), None)
    if base is None or not passes or any(c.decided for c in base.capacity):
        return None
    ran = [c for c in base.capacity if c.steps]
    failed = [[s.rate for s in c.steps if s.verdict == Verdict.FAIL] for c in ran]
    fails = [min(r) for r in failed if r]
    if not ran or len(fails) < len(ran):
        return None
    return min(passes), max(fails)


def _lineage_best(
    step: str, compute: Callable[[VariantFigures, VariantFigures], float | None], fallback: str, unit: str
) -> Measure:
    """Best figure over successful variants of `step`: from the parent's figures, else the step's own metric
    `fallback` (when the parent is not in the study)."""

    def measure(figs, gates, ctx) -> Measured | Unmeasured:
        best = _best_of(figs, step, compute, fallback)
        if best is None:
            return Unmeasured(f"no successful {step} variant with the figure")
        x, f = best
        return Measured(exact(x), f"{x:.2f}{unit} (`{f.name}`, exact)", Basis.EXACT)

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


def _drop_of(f: VariantFigures, which: str) -> Measured | Unmeasured:
    """f's relative AUC drop vs the baseline in % (test split, paired CI)."""
    if f.is_baseline:
        return Measured(exact(0.0), f"0 (`{f.name}` is the baseline)", Basis.EXACT)
    rel = f.result.auc_delta[1] if f.result.auc_delta else None
    if rel is None or not rel.supported:
        return Unmeasured(f"`{f.name}` has no ΔAUC CI")
    drop = Estimate(-rel.value * 100, -rel.hi * 100, -rel.lo * 100, rel.n)
    return Measured(drop, f"{short(drop, '.2f', '%')} (`{f.name}`, {which})")


def _has_p99(f: VariantFigures) -> bool:
    return f.p99() is not None and f.p99().supported


def _auc_drop(figs, gates, ctx) -> Measured | Unmeasured:
    declared = declared_headline(figs, ctx)
    if declared is not None:  # ranked by latency, not by AUC: no selection bias on the drop either way
        return _drop_of(declared, "the declared headline")
    best = fastest_passing(figs, gates)
    if best is None:  # "fastest" needs an e2e p99: without one there is no variant to hold to the goal
        return _no_passing(figs, _has_p99, "an e2e p99 at the common load to rank it by")
    return _drop_of(best, "the fastest passing variant")


def _embed_auc_drop(figs, gates, ctx) -> Measured | Unmeasured:
    """The drop of the variant the size target measured (the most compressed embed_quant variant)."""
    best = _best_of(figs, "embed_quant", _size_ratio, "model_size_ratio")
    if best is None:
        return Unmeasured("no successful embed_quant variant")
    return _drop_of(best[1], "the most compressed embed_quant variant")


@dataclass(frozen=True)
class Target:
    what: str  # with {goal}
    at_least: bool  # goal is a floor (else a ceiling)
    measure: Measure


TARGETS: dict[str, Target] = {
    "e2e_speedup": Target("like-for-like e2e p99 speed-up vs baseline ≥ {goal:g}×", True, _speedup),
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
    "max_auc_drop_pct": Target(
        "AUC drop of the headline (else the fastest passing) variant ≤ {goal:g}%", False, _auc_drop
    ),
    "embed_size_ratio": Target(
        "embedding compression shrinks its parent's model file ≥ {goal:g}×",
        True,
        _lineage_best("embed_quant", _size_ratio, "model_size_ratio", "×"),
    ),
    "embed_max_auc_drop_pct": Target(
        "AUC drop of the embedding-compressed variant ≤ {goal:g}%", False, _embed_auc_drop
    ),
}


@dataclass(frozen=True)
class TargetResult:
    """One target's verdict with what it was decided on."""

    key: str  # its name under `targets:`
    goal: float
    what: str  # the target in words, goal filled in ('' for an unknown key)
    outcome: Outcome
    measured: Measured | None  # None unless MET / MISSED / INCONCLUSIVE on a figure
    reason: str = ""  # why there is no figure (NOT MEASURED, a MISSED without one, NOT EVALUATED)


def evaluate_one(
    key: str, goal: float, figs: list[VariantFigures], gates: dict[str, Gate], ctx: StudyContext
) -> TargetResult:
    """The verdict on one target. Raises ValueError when the goal is not a number."""
    if isinstance(goal, bool) or not isinstance(goal, int | float):
        raise ValueError(f"StudyContext.targets[{key!r}] = {goal!r}: expected a number")
    target = TARGETS.get(key)
    if target is None:
        return TargetResult(key, goal, "", Outcome.NOT_EVALUATED, None, f"known: {', '.join(TARGETS)}")
    what = target.what.format(goal=goal)
    got = target.measure(figs, gates, ctx)
    if isinstance(got, Unmeasured):
        outcome = Outcome.MISSED if got.missed else Outcome.NOT_MEASURED
        return TargetResult(key, goal, what, outcome, None, got.reason)
    v = (verdict_at_least if target.at_least else verdict_at_most)(got.figure, goal)
    if v == Verdict.PASS and not got.confirmatory:
        v = Verdict.INCONCLUSIVE  # a selected variant's own interval cannot confirm the goal
    return TargetResult(key, goal, what, WORD[v], got)


def evaluate(figs: list[VariantFigures], gates: dict[str, Gate], ctx: StudyContext) -> list[TargetResult]:
    """Every target in ctx.targets, in its order. Raises ValueError when a goal is not a number."""
    return [evaluate_one(key, goal, figs, gates, ctx) for key, goal in ctx.targets.items()]


def target_line(t: TargetResult) -> str:
    """'- **MET** `e2e_speedup` — what: measured figure [CI].'"""
    head = f"- **{t.outcome}** `{t.key}` — "
    if t.outcome == Outcome.NOT_EVALUATED:
        return f"{head}unknown target = {t.goal!r} ({t.reason})"
    if t.measured is None:
        return f"{head}{t.what}: {t.reason}."
    decided = t.outcome in (Outcome.MET, Outcome.MISSED)
    every = " — all repeats" if t.measured.basis == Basis.RANGE and decided else ""
    return f"{head}{t.what}: measured {t.measured.text}{every}."


def target_lines(results: list[TargetResult]) -> list[str]:
    """One Markdown line per target."""
    return [target_line(t) for t in results]
