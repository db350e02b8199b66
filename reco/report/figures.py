"""The report's figures, derived once from the typed load outcomes: pooled latencies, ratios, gains.

- **Pooling**: a variant's repeats of one kind of run (unloaded, common load, equal utilisation) are
  pooled over its *valid* repeats; a run whose generator could not vouch for it (`valid=False`) is shown
  but never feeds a figure a verdict reads. When no repeat is valid the figures come from the invalid
  ones, marked, and every verdict on them is INVALID.
- **Pooled quantiles** carry an interval that holds for dependent requests and drift between repeats
  (reco.stats.dependent: the repeats are the windows, each read in send order).
- **Latency ratios** (baseline / variant, > 1: the variant is faster) come from the study's paired
  blocks where both variants ran in >= 2 of them (reco.stats.paired): unloaded, from SIGN_MIN_BLOCKS
  blocks on, the median block's ratio with a sign-test interval (robust to the host's slow stretches,
  which hit a few windows); else the ratio of pooled quantiles with a paired block-bootstrap interval,
  Student t on blocks - 1 df (under load a short window's own quantile is biased low: its requests
  queue behind each other); with fewer blocks, from the two pooled intervals (MOVER on the log scale,
  reco.stats.dependent.ratio_ci). Beside them the median and RANGE of the per-repeat ratios (a range,
  not a confidence interval).
- **Capacity** is the median of the repeats' highest passing rate with their range, over the *decided*
  repeats: a search the time budget stopped before any rate passed located nothing and is left out
  (reco.loadtest.outcome.Capacity.decided), not counted as a capacity of 0; the QPS gain's
  interval spans every repeat's capacity bracket (_bracket_gain): an open bracket (no failing rate) makes
  it open, [x, +inf). The SLO-sensitivity gains re-judge the recorded steps at each SLO and are bracketed
  the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median

import numpy as np

from reco.loadtest.capacity import step_verdict
from reco.loadtest.outcome import QUANTILES, Capacity, LoadRun, decided_searches, searched_above
from reco.loadtest.runs import windows_of
from reco.report.context import StudyContext, VariantResult
from reco.stats import Estimate, Verdict, ratio_range
from reco.stats.dependent import dependent_quantile_ci, ratio_ci, requests_to_close
from reco.stats.paired import SIGN_MIN_BLOCKS, median_block_ratio, paired_ratio

KINDS = ("unloaded", "common", "equal_util")  # LoadOutcome fields holding repeats of LoadRun
RATIO_QUANTILES = ("p50", "p99")
SLO_FACTORS = (0.5, 1.0, 2.0)  # SLO sensitivity of the QPS gain


@dataclass
class Latency:
    """The repeats of one kind of run on one variant, pooled."""

    kind: str  # "unloaded" | "common" | "equal_util"
    runs: list[LoadRun]  # every repeat, valid or not
    used: list[LoadRun]  # the repeats the figures come from: the valid ones (all of them when none is)
    quantiles: dict[str, Estimate]  # QUANTILES key -> pooled e2e latency ms with CI
    latencies_ms: np.ndarray = field(repr=False)  # [n] pooled over `used`, +inf = failed

    @property
    def valid(self) -> bool:
        return any(r.valid for r in self.runs)

    @property
    def n(self) -> int:
        return len(self.latencies_ms)

    @property
    def n_failed(self) -> int:
        return sum(r.n_failed for r in self.used)

    @property
    def n_invalid(self) -> int:
        return sum(not r.valid for r in self.runs)

    def requests_to_close(self, key: str) -> int | None:
        """Requests the pooled `key` quantile's interval would need before it closes above, over as many
        repeats, at the dependence and the drift between repeats its windows show
        (reco.stats.dependent.requests_to_close); None when it is closed, or open for failed requests
        (more of them do not close it)."""
        e = self.quantiles[key]
        if self.n_failed or (e.supported and math.isfinite(e.hi)):
            return None
        return requests_to_close(windows_of(self.used), QUANTILES[key])

    @property
    def error_rate(self) -> float:
        return self.n_failed / self.n if self.n else 0.0

    @property
    def qps(self) -> float:
        return median(r.qps for r in self.used)

    @property
    def offered_qps(self) -> float | None:
        rates = [r.offered_qps for r in self.used if r.offered_qps is not None]
        return median(rates) if rates else None

    @property
    def mean_ms(self) -> float | None:
        """Mean of the successful requests over the pooled repeats."""
        ok = [(r.mean_ms, r.n - r.n_failed) for r in self.used if r.n > r.n_failed]
        total = sum(w for _, w in ok)
        return sum(m * w for m, w in ok) / total if total else None

    @property
    def loadgen_cpu_pct(self) -> float:
        """The busiest repeat's load-generator CPU (the one closest to saturating it)."""
        return max(r.loadgen_cpu_pct for r in self.runs)

    def repeats(self, key: str) -> list[float]:
        """Per-repeat values of quantile `key` that their run's n supports."""
        return [
            r.quantiles[key].value for r in self.used if key in r.quantiles and r.quantiles[key].supported
        ]

    def spread(self, key: str) -> Estimate | None:
        """Median of the per-repeat `key` with lo/hi = the range over repeats (n = repeats); None when none."""
        return range_estimate(self.repeats(key))

    def stages(self) -> dict[str, float]:
        """server_<stage>_mean_ms / _p99_ms, median over the used repeats that reported them."""
        keys = dict.fromkeys(k for r in self.used for k in r.server_stages)
        return {k: median(r.server_stages[k] for r in self.used if k in r.server_stages) for k in keys}

    def invalid_reasons(self) -> list[str]:
        return [r.invalid_reason or "no reason recorded" for r in self.runs if not r.valid]


def pool(kind: str, runs: list[LoadRun]) -> Latency | None:
    """Pool the repeats of one kind of run.

    Args:
        kind: which LoadOutcome list the runs come from.
        runs: its repeats.
    Returns:
        Latency over the valid repeats (all repeats when none is valid); None when there is no run.
    """
    if not runs:
        return None
    used = [r for r in runs if r.valid] or list(runs)
    windows = windows_of(used)
    lat = np.concatenate(windows)
    quantiles = {k: dependent_quantile_ci(windows, q) for k, q in QUANTILES.items()}
    return Latency(kind, list(runs), used, quantiles, lat)


@dataclass(frozen=True)
class Ratio:
    """A ratio of two variants' figures: a CI (paired blocks where the runs pair up, else the two pooled
    intervals), and the range over repeats."""

    pooled: Estimate  # point from the pooled samples, 95 % CI (paired blocks, else MOVER)
    repeats: Estimate | None  # median ratio of the repeats with lo/hi the RANGE of pairwise ratios
    blocks: int = 0  # paired blocks behind `pooled` (0: MOVER from two independent intervals)
    method: str = "MOVER"  # "median block" | "pooled blocks" | "MOVER"


def paired_blocks(num: Latency, den: Latency) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The two variants' valid runs of the same study blocks, in block order."""
    a = {r.block: r.latencies_ms for r in num.runs if r.valid and r.block is not None}
    b = {r.block: r.latencies_ms for r in den.runs if r.valid and r.block is not None}
    common = sorted(a.keys() & b.keys())
    return [a[k] for k in common], [b[k] for k in common]


def latency_ratio(num: Latency, den: Latency, key: str) -> Ratio:
    """num's quantile `key` / den's (baseline / variant gives a speed-up).

    Where the two ran in >= 2 common blocks (the study's interleaved rounds) the interval comes from
    those pairs (reco.stats.paired: the drift they shared cancels; unloaded with >= SIGN_MIN_BLOCKS
    blocks, the median block's ratio); else from the two pooled intervals (MOVER,
    reco.stats.dependent.ratio_ci), which carries every drift twice.

    Args:
        num, den: pooled latencies of the two variants (same kind of run).
        key: a QUANTILES key, e.g. "p99".
    Returns:
        Ratio; pooled.value None when either quantile is not supported by its n.
    """
    reps = ratio_range(num.repeats(key), den.repeats(key))
    a, b = paired_blocks(num, den)
    reps_ = reps if reps.supported else None
    if num.kind == "unloaded" and len(a) >= SIGN_MIN_BLOCKS:
        mid = median_block_ratio(a, b, QUANTILES[key])
        if mid.supported:
            return Ratio(mid, reps_, len(a), "median block")
    paired = paired_ratio(a, b, QUANTILES[key]) if len(a) >= 2 else None
    if paired is not None and paired.supported:
        return Ratio(paired, reps_, len(a), "pooled blocks")
    return Ratio(ratio_ci(num.quantiles[key], den.quantiles[key]), reps_)


Span = tuple[float, float | None]  # one search's (highest pass, lowest fail; None: no rate above failed)


def bracket_at(cap: Capacity, slo_ms: float, max_error_rate: float) -> Span:
    """One capacity search's bracket re-judged against another SLO: (highest measured rate whose step
    passes `slo_ms`, 0.0 when none; lowest rate above it whose step fails it, None when none). Each step
    is re-judged as the search judged it (reco.loadtest.capacity.step_verdict, at the search's own
    confidence), so at the search's SLO the bracket is the search's; an undecided step is neither end.
    Limited to the rates the search happened to measure: None means open, not unbounded."""
    verdicts = [(s.rate, step_verdict(s.run, slo_ms, max_error_rate, cap.conf)[0]) for s in cap.steps]
    best = max((r for r, v in verdicts if v == Verdict.PASS), default=0.0)
    return best, min((r for r, v in verdicts if v == Verdict.FAIL and r > best), default=None)


def highest_pass_at(cap: Capacity, slo_ms: float, max_error_rate: float) -> float:
    """Highest measured rate of one capacity search whose p99 CI is within `slo_ms` (0.0 when none)."""
    return bracket_at(cap, slo_ms, max_error_rate)[0]


@dataclass(frozen=True)
class Bracket:
    """Where a variant's capacity at the SLO lies, [highest pass, lowest fail) in req/s, medians over the
    capacity repeats. A repeat with no failing rate counts as failing at +inf, so the upper median never
    falls below the lower one; None when that median is open (most repeats found no failing rate)."""

    highest_pass: float
    lowest_fail: float | None
    n: int  # capacity repeats


def bracket(caps: list[Capacity]) -> Bracket | None:
    """The median capacity bracket of a variant's decided searches; None when none was decided."""
    caps = decided_searches(caps)
    if not caps:
        return None
    fail = median(math.inf if c.lowest_fail is None else c.lowest_fail for c in searched_above(caps))
    return Bracket(median(c.highest_pass for c in caps), fail if math.isfinite(fail) else None, len(caps))


def range_estimate(xs: list[float]) -> Estimate | None:
    """Median of repeats with lo/hi = their range (n = repeats); None when empty."""
    return Estimate(median(xs), min(xs), max(xs), len(xs)) if xs else None


@dataclass
class VariantFigures:
    """Every figure the report shows for one variant (gains and ratios vs the baseline)."""

    result: VariantResult
    is_baseline: bool
    latency: dict[str, Latency]  # kind -> pooled repeats (only kinds that were measured)
    capacity: list[Capacity]  # repeats of the capacity search, the undecided ones too (Capacity.decided)
    max_qps: Estimate | None  # median highest pass, lo/hi = range over the decided repeats
    speedup: dict[tuple[str, str], Ratio]  # (kind, quantile) -> baseline / variant latency
    qps_gain: Estimate | None  # median highest pass vs the baseline's; interval: brackets and repeats
    max_qps_at: dict[float, Estimate | None]  # SLO factor -> highest measured passing rate, over repeats
    qps_gain_at: dict[float, Estimate | None]  # SLO factor -> gain vs the baseline at that SLO
    # speedup, qps_gain and qps_gain_at are empty / None for the baseline itself

    @property
    def name(self) -> str:
        return self.result.variant.name

    @property
    def ok(self) -> bool:
        return self.result.status == "ok"

    @property
    def bracket(self) -> Bracket | None:
        return bracket(self.capacity)

    def p99(self, kind: str = "common") -> Estimate | None:
        lat = self.latency.get(kind)
        return lat.quantiles["p99"] if lat else None

    def utilisation(self, kind: str) -> float | None:
        """Offered rate of `kind` / this variant's median capacity at the SLO."""
        lat = self.latency.get(kind)
        if lat is None or lat.offered_qps is None or self.max_qps is None or not self.max_qps.value:
            return None
        return lat.offered_qps / self.max_qps.value


def find_baseline(results: list[VariantResult], ctx: StudyContext) -> VariantResult:
    for r in results:
        if r.variant.name == ctx.baseline:
            return r
    names = [r.variant.name for r in results]
    raise ValueError(f"StudyContext.baseline={ctx.baseline!r} is not among the variant results {names}")


def _latencies(r: VariantResult) -> dict[str, Latency]:
    if r.status != "ok" or r.load is None:
        return {}
    pooled = {kind: pool(kind, getattr(r.load, kind)) for kind in KINDS}
    return {k: v for k, v in pooled.items() if v is not None}


def _spans(caps: list[Capacity]) -> list[Span]:
    return [(c.highest_pass, c.lowest_fail) for c in caps]


def _gain(caps: list[Capacity], base_caps: list[Capacity]) -> Estimate | None:
    """_bracket_gain of two rows' decided searches, each row's upper ends from searched_above."""
    return _bracket_gain(
        _spans(caps), _spans(base_caps), _spans(searched_above(caps)), _spans(searched_above(base_caps))
    )


def _spans_at(caps: list[Capacity], factor: float, max_error_rate: float) -> list[Span]:
    return [bracket_at(c, factor * c.slo_p99_ms, max_error_rate) for c in caps]


def _bracket_gain(
    spans: list[Span],
    base_spans: list[Span],
    above: list[Span] | None = None,
    base_above: list[Span] | None = None,
) -> Estimate | None:
    """QPS gain = median highest pass / the baseline's, with an interval that spans every pair of repeats'
    brackets: from (highest pass / the baseline's lowest fail) to (lowest fail / the baseline's
    highest pass). An open bracket opens that side: a variant whose top rate passed has a gain [x, +inf),
    a baseline that never failed one of [0, x]. A range over the repeats' brackets, not a confidence
    interval (3 repeats cannot give a 95 % one); n = the variant's repeats. `above`, `base_above`: the
    spans whose lowest fail counts (searched_above; default: all). None when the baseline passed no
    rate (no finite gain to state)."""
    base = median(b[0] for b in base_spans) if base_spans else 0.0
    if not spans or base <= 0:
        return None
    point = median(c[0] for c in spans) / base
    above, base_above = above or spans, base_above or base_spans
    lo = min(
        (0.0 if b[1] is None else c[0] / b[1] for c in spans for b in base_above if b[0] > 0), default=0.0
    )
    hi = max(math.inf if c[1] is None else c[1] / b[0] for c in above for b in base_spans if b[0] > 0)
    return Estimate(point, min(lo, point), max(hi, point), len(spans))


def capacity_gain(f: VariantFigures, ref: VariantFigures) -> Estimate | None:
    """f's max QPS at the SLO over ref's, as the QPS gain vs the baseline is (_bracket_gain: the median
    highest passes, with the range over every pair of the two rows' decided brackets); None when either
    has no decided search."""
    return _gain(decided_searches(f.capacity), decided_searches(ref.capacity))


def study_figures(results: list[VariantResult], ctx: StudyContext) -> list[VariantFigures]:
    """Derive every variant's figures, in the order of `results`.

    Args:
        results: one per variant, the baseline among them.
        ctx: the study's yardsticks.
    Returns:
        one VariantFigures per result. Raises ValueError when ctx.baseline is not among the results.
    """
    base_res = find_baseline(results, ctx)
    base_lat = _latencies(base_res)
    base_caps = decided_searches(base_res.load.capacity if base_res.status == "ok" and base_res.load else [])
    base_at = {f: _spans_at(base_caps, f, ctx.max_error_rate) for f in SLO_FACTORS}
    out = []
    for r in results:
        is_base = r is base_res  # the reference: no ratios to itself
        lat = base_lat if is_base else _latencies(r)
        searched = r.load.capacity if r.status == "ok" and r.load else []
        caps = decided_searches(searched)
        at = {f: _spans_at(caps, f, ctx.max_error_rate) for f in SLO_FACTORS}
        speedup = {
            (kind, key): latency_ratio(base_lat[kind], lat[kind], key)
            for kind in KINDS
            if kind in lat and kind in base_lat and not is_base
            for key in RATIO_QUANTILES
        }
        highest = [c.highest_pass for c in caps]
        out.append(
            VariantFigures(
                result=r,
                is_baseline=is_base,
                latency=lat,
                capacity=searched,
                max_qps=range_estimate(highest),
                speedup=speedup,
                qps_gain=None if is_base else _gain(caps, base_caps),
                max_qps_at={f: range_estimate([hp for hp, _ in at[f]]) for f in SLO_FACTORS},
                qps_gain_at={f: None if is_base else _bracket_gain(at[f], base_at[f]) for f in SLO_FACTORS},
            )
        )
    return out
