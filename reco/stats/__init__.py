"""The statistics every decision in reco rests on: quantile CIs, verdicts, ratio CIs, paired ΔAUC.

One package, shared by the load test, the capacity search, the study and the report, so a p99 means the
same thing everywhere:

- **Quantiles** are nearest-rank (a latency some request really had) with a distribution-free 95 %
  confidence interval from order statistics: the number of samples below the true q-quantile is
  Binomial(n, q), so [x_(l), x_(u)] with l, u from that binomial's 2.5 % / 97.5 % points covers it with
  >= 95 % probability whatever the latency distribution. When n is too small for the upper bound to be
  an observed sample (p99 needs n >= 368, p999 n >= 3,688), the quantile is *not supported*: reported
  as "n/a (n=...)", never as the maximum.
- **Failures count as +inf**: a request that failed, was shed or timed out is slower than any SLO, so
  dropping it can never improve a verdict.
- **Under load** requests are not independent: reco.stats.dependent widens these intervals for the
  dependence between requests and the drift between repeated windows; the load test uses it.
- **Verdicts** against a limit are PASS only when the whole CI is within it, FAIL when the whole CI is
  beyond it, INCONCLUSIVE otherwise.
- **ΔAUC** between two models scored on the same rows uses DeLong's paired variance (fast, exact
  for the Mann-Whitney AUC, no resampling).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

CONF = 0.95


class Verdict(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"
    INVALID = "INVALID"  # the measurement itself cannot vouch (e.g. a saturated load generator)


@dataclass(frozen=True)
class Estimate:
    """A figure with its two-sided confidence interval and the sample size behind it.

    `value` is None when n cannot support the figure (then lo/hi are None too).
    """

    value: float | None
    lo: float | None
    hi: float | None
    n: int

    @property
    def supported(self) -> bool:
        return self.value is not None

    def fmt(self, spec: str = ".1f", unit: str = "") -> str:
        """'12.3 [11.9, 13.0] (n=4,000)', '12.3 [11.9, inf) (n=400)' or 'n/a (n=120)'."""
        if self.value is None:
            return f"n/a (n={self.n:,})"
        return f"{_num(self.value, spec)}{unit} {self.interval(spec)} (n={self.n:,})"

    def interval(self, spec: str = ".1f") -> str:
        """'[11.9, 13.0]', or '[11.9, inf)' for an interval open above (a bound past every measured value)."""
        close = "inf)" if math.isinf(self.hi) else f"{_num(self.hi, spec)}]"
        return f"[{_num(self.lo, spec)}, {close}"

    def to_dict(self) -> dict:
        return {"value": self.value, "lo": self.lo, "hi": self.hi, "n": self.n}


def _num(x: float | None, spec: str) -> str:
    if x is None:
        return "n/a"
    return "inf" if math.isinf(x) else format(x, spec)


def min_n_for_quantile(q: float, conf: float = CONF) -> int:
    """Smallest n whose upper confidence bound for the q-quantile is an observed sample."""
    # P(all n samples below the q-quantile) = q^n must be <= (1 - conf) / 2.
    return int(math.ceil(math.log((1 - conf) / 2) / math.log(q)))


def quantile_ci(x: np.ndarray, q: float, conf: float = CONF) -> Estimate:
    """Nearest-rank q-quantile of `x` with a distribution-free order-statistic CI.

    Args:
        x: [n] samples; +inf allowed (failed requests), NaN not.
        q: quantile in (0, 1), e.g. 0.99.
    Returns:
        Estimate(value, lo, hi, n); value None when n < min_n_for_quantile(q) (either side).
    """
    x = np.asarray(x, dtype=np.float64)
    assert not np.isnan(x).any(), "quantile_ci: NaN latencies (failures must be +inf)"
    n = len(x)
    if n == 0:
        return Estimate(None, None, None, 0)
    lo_k, hi_k = _order_bounds(n, q, conf)
    if lo_k < 1 or hi_k > n:
        return Estimate(None, None, None, n)
    s = np.sort(x)
    return Estimate(nearest_rank(s, q), float(s[lo_k - 1]), float(s[hi_k - 1]), n)


# scipy's ppf costs ~0.15 ms a call in argument checks, and a capacity search or a report asks the same few
# (level, df, n) points thousands of times (most of bench.coverage's simulated steps went there): cached.
@functools.lru_cache(maxsize=65536)
def norm_ppf(p: float) -> float:
    """The standard normal's p-quantile."""
    from scipy import stats as sps  # not at the top: scipy takes ~0.3 s to import, most callers never need it

    return float(sps.norm.ppf(p))


@functools.lru_cache(maxsize=65536)
def t_ppf(p: float, df: int) -> float:
    """Student t's p-quantile on df degrees of freedom."""
    from scipy import stats as sps

    return float(sps.t.ppf(p, df))


@functools.lru_cache(maxsize=65536)
def _order_bounds(n: int, q: float, conf: float) -> tuple[int, int]:
    """1-based order-statistic indices (lo, hi) of the two-sided `conf` CI of the q-quantile of n samples."""
    from scipy import stats as sps

    a = (1 - conf) / 2
    # B = #samples below the true quantile ~ Binomial(n, q); x_(l) <= Q <= x_(u) when l <= B < u.
    return int(sps.binom.ppf(a, n, q)), int(sps.binom.ppf(1 - a, n, q)) + 1


def verdict_at_most(est: Estimate, limit: float) -> Verdict:
    """PASS when the CI lies within `limit` (upper bound <= limit), FAIL when beyond, else INCONCLUSIVE."""
    if est.value is None:
        return Verdict.INCONCLUSIVE
    if est.hi <= limit:
        return Verdict.PASS
    if est.lo > limit:
        return Verdict.FAIL
    return Verdict.INCONCLUSIVE


def verdict_at_least(est: Estimate, limit: float) -> Verdict:
    """PASS when the CI lies at or above `limit`, FAIL when wholly below, else INCONCLUSIVE."""
    if est.value is None:
        return Verdict.INCONCLUSIVE
    if est.lo >= limit:
        return Verdict.PASS
    if est.hi < limit:
        return Verdict.FAIL
    return Verdict.INCONCLUSIVE


def with_failures(ok_latency_ms: np.ndarray, n_failed: int) -> np.ndarray:
    """Latencies of successful requests plus `n_failed` +inf entries (see the module docstring)."""
    return np.concatenate([np.asarray(ok_latency_ms, np.float64), np.full(int(n_failed), np.inf)])


def ratio_range(num: Sequence[float], den: Sequence[float]) -> Estimate:
    """Ratio of the medians of repeated measurements (e.g. per-repeat p99s) with lo/hi the RANGE of the
    pairwise ratios: a description of how far repeats disagree, not a confidence interval (with 3 repeats
    none can be stated without a model); n = the fewer repeats. Unsupported (value None) when either side
    has no finite value."""
    a, b = np.asarray(num, float), np.asarray(den, float)
    a, b = a[np.isfinite(a)], b[np.isfinite(b) & (b > 0)]
    if len(a) == 0 or len(b) == 0:
        return Estimate(None, None, None, min(len(a), len(b)))
    ratios = (a[:, None] / b[None, :]).ravel()
    return Estimate(
        float(np.median(a) / np.median(b)), float(ratios.min()), float(ratios.max()), min(len(a), len(b))
    )


def _midrank(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x with ties given their average rank."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x))
    # boundaries of runs of equal values
    starts = np.r_[0, np.flatnonzero(np.diff(xs)) + 1]
    ends = np.r_[starts[1:], len(xs)]
    avg = (starts + ends + 1) / 2.0  # mean of 1-based ranks start+1 .. end
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def delong(labels: np.ndarray, scores: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """AUCs of k score vectors on the same rows and their DeLong covariance matrix.

    Args:
        labels: [n] 0/1.
        scores: k arrays [n].
    Returns:
        (aucs [k], cov [k, k]).
    """
    y = np.asarray(labels).astype(bool)
    m, n = int(y.sum()), int((~y).sum())
    if m == 0 or n == 0:
        raise ValueError("delong: need both positive and negative labels")
    k = len(scores)
    v01 = np.empty((k, m))
    v10 = np.empty((k, n))
    aucs = np.empty(k)
    for i, s in enumerate(scores):
        s = np.asarray(s, np.float64)
        pos, neg = s[y], s[~y]
        tz = _midrank(np.concatenate([pos, neg]))
        tx, ty = _midrank(pos), _midrank(neg)
        aucs[i] = (tz[:m].sum() / m - (m + 1) / 2) / n
        v01[i] = (tz[:m] - tx) / n
        v10[i] = 1.0 - (tz[m:] - ty) / m
    cov = np.atleast_2d(np.cov(v01)) / m + np.atleast_2d(np.cov(v10)) / n
    return aucs, cov


def auc_delta(
    labels: np.ndarray, base_scores: np.ndarray, scores: np.ndarray, conf: float = CONF
) -> tuple[Estimate, Estimate]:
    """Paired AUC difference of `scores` against `base_scores` on the same rows (DeLong).

    Returns:
        (absolute ΔAUC = auc - base_auc, relative ΔAUC = ΔAUC / base_auc), each with its CI; the
        relative CI treats the base AUC as fixed (its own error is in the paired variance).
    """
    aucs, cov = delong(labels, [base_scores, scores])
    d = float(aucs[1] - aucs[0])
    se = math.sqrt(max(cov[0, 0] + cov[1, 1] - 2 * cov[0, 1], 0.0))
    z = norm_ppf(1 - (1 - conf) / 2)
    n = len(labels)
    absolute = Estimate(d, d - z * se, d + z * se, n)
    b = float(aucs[0])
    relative = Estimate(d / b, (d - z * se) / b, (d + z * se) / b, n)
    return absolute, relative


def auc_ci(labels: np.ndarray, scores: np.ndarray, conf: float = CONF) -> Estimate:
    """One model's AUC with its DeLong CI (n = rows); Estimate(None, ...) when one class is missing."""
    try:
        aucs, cov = delong(labels, [scores])
    except ValueError:
        return Estimate(None, None, None, len(labels))
    z = norm_ppf(1 - (1 - conf) / 2)
    se = math.sqrt(max(float(cov[0, 0]), 0.0))
    a = float(aucs[0])
    return Estimate(a, a - z * se, a + z * se, len(labels))


def nearest_rank(x: np.ndarray, q: float) -> float:
    """Nearest-rank q-quantile of `x` (the point quantile_ci reports), by partial sort.

    Args:
        x: [n] samples, n >= 1; +inf allowed.
        q: quantile in (0, 1).
    """
    k = max(int(math.ceil(q * len(x))), 1) - 1
    return float(np.partition(np.asarray(x, np.float64), k)[k])
