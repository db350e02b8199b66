"""The gate, decided on confidence intervals so that noise cannot flip it.

- **Accuracy**: the relative ΔAUC vs the baseline (DeLong CI on the same test rows) against the limit
  `-max_auc_drop`: PASS when the CI's lower bound is >= -limit, FAIL when its upper bound is below,
  INCONCLUSIVE when it straddles the limit.
- **Latency**: the pooled e2e p99 CI at the common load against the SLO (reco.stats.verdict_at_most);
  INVALID when no valid run exists, FAIL when the error rate exceeds the cap. Where those windows cannot
  decide it (a fast variant's p99 needs more requests than the common load's few req/s send in the
  budget: its upper bound is open), a capacity step of the same variant that PASSED the same SLO at a
  rate >= the common load decides it PASS: it bounded the p99 from above, at its Bonferroni confidence,
  under more load. That rests on latency not falling as the offered load rises, which the reason states;
  a FAIL at the common load is never overruled. Else the baseline's p99 there, bounded within the SLO
  (its own closed CI at the common load, else its capacity step as above), over the variant's paired
  p99 speed-up there (baseline / variant, from the blocks both ran in) bounds the variant's p99 from
  above: PASS where baseline bound / speed-up's lower bound is within the SLO. The bound is one-sided
  97.5 %, the speed-up's lower bound one-sided 99.5 % (PAIRED_BOUND_CONF), so the claim holds at >= 95 %
  (Bonferroni), as the gate's own CI does; the pairing cancels the drift both variants shared, which
  keeps a few hundred requests' own p99 open.
- **What users see**: the measure with ground truth where the data has one -- on data with a planted
  click model (and quality.users > 0), the relative Δ expected clicks@k of the served top-k vs the
  baseline's for the same requests (paired bootstrap CI over requests, reco.stats.graded) against
  `-max_clicks_drop` -- else the relative ΔGAUC on the test split (paired bootstrap over users,
  reco.stats.gauc) against `-max_gauc_drop`; decided like the accuracy part, the reason naming the
  measure. Logged NDCG@k is reported, never gating: its relevance is exposure x click, so a popularity
  tilt that no user would notice moves it by ±10 % (issue 44). A variant can pass on AUC and fail here:
  pointwise AUC does not see the order of the few items a user is shown.
- **Overall**: the worst of the parts, FAIL > INVALID > INCONCLUSIVE > PASS. A figure that was not
  measured never passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from reco.loadtest.outcome import QUANTILES, Capacity, CapacityStep
from reco.report.context import StudyContext
from reco.report.figures import VariantFigures, paired_blocks
from reco.report.fmt import est, one_line, scaled
from reco.stats import Estimate, Verdict, verdict_at_least, verdict_at_most
from reco.stats.paired import paired_ratio

# The paired p99 speed-up's level where it bounds a variant's p99 (latency_gate): at the common load's 3
# blocks of 130 requests its 95 % interval's lower bound lay above the true ratio in up to 8.3 % of
# simulated studies at 70 % utilisation (nominal 2.5 %), its 99 % interval's in at most 1.3 % (nominal 0.5 %)
# (experiments/interval_coverage/README.md#a-paired-speed-up-as-a-bound)
PAIRED_BOUND_CONF = 0.99
SEVERITY = {Verdict.PASS: 0, Verdict.INCONCLUSIVE: 1, Verdict.INVALID: 2, Verdict.FAIL: 3}


def worst(*verdicts: Verdict | None) -> Verdict:
    """The most severe of the verdicts given (None = not applicable); PASS when none applies."""
    return max((v for v in verdicts if v is not None), key=SEVERITY.__getitem__, default=Verdict.PASS)


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str  # the figure with its CI against the limit


@dataclass(frozen=True)
class Gate:
    accuracy: Decision
    latency: Decision | None  # None: no SLO (no load test), the gate checks accuracy only
    quality: Decision | None = None  # None: the served top-k is not compared (quality.users = 0)

    @property
    def parts(self) -> list[Decision]:
        return [d for d in (self.accuracy, self.quality, self.latency) if d is not None]

    @property
    def overall(self) -> Verdict:
        return worst(*(d.verdict for d in self.parts))

    @property
    def reason(self) -> str:
        """Why not PASS: the reasons of the parts that did not pass ('' when it passed)."""
        parts = [d for d in self.parts if d.verdict != Verdict.PASS]
        return "; ".join(
            dict.fromkeys(f"{d.verdict}: {d.reason}" for d in parts)
        )  # a failed variant fails both


def accuracy_gate(f: VariantFigures, ctx: StudyContext) -> Decision:
    """Relative ΔAUC CI vs -ctx.max_auc_drop.

    Args:
        f: the variant's figures (its result carries auc_delta).
        ctx: the limit and the baseline's name.
    Returns:
        Decision with the figure and CI in the reason.
    """
    if not f.ok:
        return Decision(Verdict.FAIL, "variant failed (see its status)")
    if f.is_baseline:
        return Decision(Verdict.PASS, "the reference")
    if f.result.auc_delta is None:
        return Decision(Verdict.INCONCLUSIVE, "no ΔAUC vs the baseline measured")
    rel = f.result.auc_delta[1]
    limit = -ctx.max_auc_drop
    v = verdict_at_least(rel, limit)
    relation = {Verdict.PASS: "above", Verdict.FAIL: "below"}.get(v, "straddles")
    return Decision(v, f"ΔAUC {est(scaled(rel, 100), '+.2f', '%')} {relation} the limit {limit:+.2%}")


def quality_gate(f: VariantFigures, ctx: StudyContext) -> Decision | None:
    """Δexpected clicks@k vs -ctx.max_clicks_drop where the data has a planted click model, else ΔGAUC
    vs -ctx.max_gauc_drop; None when neither gates."""
    truth = ctx.planted and ctx.max_clicks_drop is not None
    if not truth and ctx.max_gauc_drop is None:
        return None
    if not f.ok:
        return Decision(Verdict.FAIL, "variant failed (see its status)")
    if f.is_baseline:
        return Decision(Verdict.PASS, "the reference")
    if truth:
        g = f.result.graded
        name = f"Δexpected clicks@{g.k if g else ''} (graded by the planted P(click), the ground truth)"
        return _relative(name, g.clicks_delta if g else None, ctx.max_clicks_drop)
    gauc = f.result.gauc
    return _relative(
        "ΔGAUC (no planted click probabilities here)", gauc.delta if gauc else None, ctx.max_gauc_drop
    )


def _relative(name: str, delta: Estimate | None, max_drop: float) -> Decision:
    """A relative Δ's CI against -max_drop, the reason naming the measure."""
    if delta is None:
        return Decision(Verdict.INCONCLUSIVE, f"{name}: not measured against the baseline")
    if not delta.supported:
        return Decision(
            Verdict.INCONCLUSIVE, f"{name} n/a: the baseline's figure is 0 in the sample or a resample"
        )
    limit = -max_drop
    v = verdict_at_least(delta, limit)
    relation = {Verdict.PASS: "above", Verdict.FAIL: "below"}.get(v, "straddles")
    return Decision(v, f"{name} {est(scaled(delta, 100), '+.2f', '%')} {relation} the limit {limit:+.2%}")


def latency_gate(f: VariantFigures, ctx: StudyContext, ref: VariantFigures | None = None) -> Decision | None:
    """Pooled e2e p99 CI at the common load vs the SLO (module docstring: where it cannot decide, a
    capacity step of the variant, else the reference `ref`'s bound over the paired speed-up); None when
    the study has no SLO."""
    slo = ctx.slo_p99_ms
    if slo is None:
        return None
    if not f.ok:
        return Decision(Verdict.FAIL, "variant failed (see its status)")
    load = f.result.load
    if load is None:
        return Decision(Verdict.INVALID, "not load-tested")
    if load.error:
        return Decision(Verdict.INVALID, f"load test failed: {one_line(load.error)[:200]}")
    common = f.latency.get("common")
    step = _passed_above(load.capacity, ctx.common_rate_qps)
    if common is None:
        if step is not None:  # the budget skipped the common load: the step is the evidence there is
            return _by_step(step, "no run at the common load (time budget)", ctx)
        return Decision(Verdict.INVALID, "no run at the common load")
    if not common.valid:
        reasons = "; ".join(sorted(set(common.invalid_reasons())))
        return Decision(Verdict.INVALID, f"every run at the common load is invalid ({reasons})")
    if common.error_rate > ctx.max_error_rate:
        return Decision(Verdict.FAIL, f"error rate {common.error_rate:.2%} > cap {ctx.max_error_rate:.2%}")
    p99 = common.quantiles["p99"]
    v = verdict_at_most(p99, slo)
    why = f"e2e p99 {est(p99, unit=' ms')} at the common load cannot decide it"
    if v == Verdict.INCONCLUSIVE and step is not None:
        return _by_step(step, why, ctx)
    if v == Verdict.INCONCLUSIVE and (paired := _by_reference(f, ref, ctx, why)) is not None:
        return paired
    if not p99.supported:
        return Decision(v, f"e2e p99 {est(p99)}: too few requests for a p99 CI")
    relation = {Verdict.PASS: "within", Verdict.FAIL: "above"}.get(v, "straddles")
    return Decision(v, f"e2e p99 {est(p99, unit=' ms')} {relation} the SLO {slo:g} ms")


def _by_step(step: CapacityStep, why: str, ctx: StudyContext) -> Decision:
    return Decision(
        Verdict.PASS,
        f"{why}, but a capacity step at {step.rate:.3g} req/s (>= the common load "
        f"{ctx.common_rate_qps:.3g}) kept p99 {est(step.run.quantiles['p99'], unit=' ms')} within the SLO "
        f"{ctx.slo_p99_ms:g} ms (latency assumed not to fall as the load rises)",
    )


def _reference_bound(ref: VariantFigures, ctx: StudyContext) -> tuple[float, str] | None:
    """(ms, where from) of an upper bound on the reference's p99 at the common load within the SLO: its
    own CI there where closed, else the CI of its capacity step that passed at or above that load
    (the SLO itself where that step passed on its exceedance bound); None when neither bounds it."""
    slo, common = ctx.slo_p99_ms, ref.latency.get("common")
    p99 = common.quantiles["p99"] if common is not None and common.valid else None
    if p99 is not None and p99.supported and p99.hi is not None and p99.hi <= slo:
        return p99.hi, f"its e2e p99 there {est(p99, unit=' ms')}"
    step = _passed_above(ref.capacity, ctx.common_rate_qps)
    if step is None:
        return None
    q = step.run.quantiles["p99"]
    bound = q.hi if q.supported and q.hi is not None and q.hi <= slo else slo
    return bound, (
        f"its capacity step at {step.rate:.3g} req/s kept p99 {est(q, unit=' ms')} within the SLO, latency "
        "assumed not to fall as the load rises"
    )


def _by_reference(
    f: VariantFigures, ref: VariantFigures | None, ctx: StudyContext, why: str
) -> Decision | None:
    """PASS where the reference's p99 bound at the common load over the variant's paired p99 speed-up
    there (lower bound) is within the SLO (module docstring); None where that does not decide it."""
    if ref is None or f.is_baseline or "common" not in ref.latency or "common" not in f.latency:
        return None
    a, b = paired_blocks(ref.latency["common"], f.latency["common"])
    bound = _reference_bound(ref, ctx)
    if len(a) < 2 or bound is None:  # before the bootstrap: nothing it finds could decide then
        return None
    ms, source = bound
    r = paired_ratio(a, b, QUANTILES["p99"], conf=PAIRED_BOUND_CONF)
    if not r.supported or not r.lo > 0 or ms / r.lo > ctx.slo_p99_ms:
        return None
    return Decision(
        Verdict.PASS,
        f"{why}, but the baseline's p99 there is at most {ms:.3g} ms ({source}) and this variant's paired "
        f"p99 speed-up there is {r.fmt('.2f', '×')} at {PAIRED_BOUND_CONF:.0%}: its p99 at most {ms:.3g} / "
        f"{r.lo:.2f} = {ms / r.lo:.3g} ms, within the SLO {ctx.slo_p99_ms:g} ms",
    )


def _passed_above(searches: list[Capacity], rate: float | None) -> CapacityStep | None:
    """The lowest-rate capacity step that PASSED at `rate` req/s or more (None: none, or no rate)."""
    steps = [s for c in searches for s in c.steps if s.verdict == Verdict.PASS]
    above = [s for s in steps if rate is not None and s.rate >= rate]
    return min(above, key=lambda s: s.rate, default=None)


def gate(f: VariantFigures, ctx: StudyContext, ref: VariantFigures | None = None) -> Gate:
    """Every part of the gate for one variant; `ref`: the baseline's figures (latency_gate)."""
    return Gate(accuracy_gate(f, ctx), latency_gate(f, ctx, ref), quality_gate(f, ctx))


def study_gates(figs: list[VariantFigures], ctx: StudyContext) -> dict[str, Gate]:
    """gate() of every variant, keyed by name, each judged with the baseline's figures beside it."""
    ref = next((f for f in figs if f.is_baseline), None)
    return {f.name: gate(f, ctx, ref) for f in figs}
