"""Quantile intervals that hold when requests are not independent, and ratios of two such figures.

Under load a slow request makes the next ones wait, so latencies come in runs (a busy period's requests
are all slow), and a machine drifts between windows minutes apart. The order-statistic CI
(reco.stats.quantile_ci) counts the requests below the quantile as Binomial(n, q), i.e. independent; in a
simulated M/M/1 queue at 70 % utilisation it covers about a quarter of the time (bench/coverage.py).

**The interval.** For a dependent series the fraction of requests at or below the true q-quantile is
still unbiased for q, but its variance is q (1 - q) tau / n, where tau is the long-run variance of the
indicator series 1{x_t <= xi} over q (1 - q) (the Bahadur representation for dependent sequences:
Wu 2005, Ann. Statist. 33(4); Sen 1972). We estimate it three ways and keep the largest:

- **within windows**: the indicator's autocovariances, pooled over the time-ordered windows, summed with
  Politis's flat-top lag window and its data-chosen bandwidth (the lag after which the autocorrelations
  stay below 2 sqrt(log10(n) / n): Politis 2003, J. Nonparam. Stat. 15; Politis & White 2004,
  Econometric Rev. 23); normal quantile;
- **sections** (batch means): each window cut into 5 contiguous sections, as clusters (Student t, 4 df per
  window), where each section expects >= 10 requests past the quantile: a window only a few correlation
  times long hides its dependence from the kernel estimate (its bandwidth cannot reach those lags);
- **between windows** (>= 2 windows): the windows as clusters (the cluster-robust variance of a mean,
  Cameron & Miller 2015, J. Human Resources 50), Student t with W - 1 degrees of freedom, so drift between
  repeats widens the interval instead of being averaged away.

The half-width h in probability widens the exact i.i.d. order-statistic interval by the ranks it adds
over the independent-sample half-width, n (h - z sqrt(q (1 - q) / n)) on each side (rounded): with no
dependence found it IS the exact i.i.d. interval, never narrower. A rank past the last request is +inf: a
one-sided interval [lo, +inf), e.g. when failures (+inf latencies) sit inside it. Coverage is checked by
simulation (M/M/1, M/D/1, heavy tails, drift; 30-85 % utilisation): bench/coverage.py, table in
experiments/interval_coverage/README.md.

**Ratios** (a speed-up: baseline p99 / variant p99) combine the two intervals by MOVER on the log scale
(Zou & Donner 2008, Stat. Med. 27; Donner & Zou 2012, Stat. Methods Med. Res. 21): each side's distance to
its point is squared and summed, so the ratio's interval is asymmetric where its parts are. An infinite
or zero bound makes that side of the ratio open ([x, +inf) or [0, x]); never a zero-width interval. Two
figures measured at the same moments are positively correlated (a slow machine slows both), which MOVER
ignores: it errs wide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from reco.stats import CONF, Estimate, _order_bounds, min_n_for_quantile, norm_ppf, t_ppf


def _autocov(windows: Sequence[np.ndarray], centre: float, max_lag: int) -> np.ndarray:
    """[max_lag + 1] autocovariances at lags 0..max_lag, pooled over windows (pairs within a window only),
    each series centred at the common `centre`, divided by the total length (the biased estimator)."""
    acc = np.zeros(max_lag + 1)
    total = 0
    for w in windows:
        d = np.asarray(w, np.float64) - centre
        n = len(d)
        total += n
        if n == 0:
            continue
        size = 1 << (2 * n - 1).bit_length()
        f = np.fft.rfft(d, size)
        full = np.fft.irfft(f * np.conj(f), size)[: min(n, max_lag + 1)]
        acc[: len(full)] += full
    return acc / max(total, 1)


def flat_top_lrv(windows: Sequence[np.ndarray], centre: float) -> float:
    """Long-run variance of the windows' series around `centre`: Politis's flat-top (trapezoid)
    lag-window estimator with his empirical bandwidth rule (see the module docstring)."""
    n = sum(len(w) for w in windows)
    longest = max((len(w) for w in windows), default=0)
    if n < 2 or longest < 2:
        return 0.0
    max_lag = min(longest - 1, max(n // 4, 1))
    r = _autocov(windows, centre, max_lag)
    if r[0] <= 0:
        return 0.0
    rho = r / r[0]
    bound = 2.0 * math.sqrt(math.log10(n) / n)
    k_n = max(5, math.ceil(math.sqrt(math.log10(n))))
    small = np.abs(rho) < bound
    m_hat = max_lag  # no lag found after which they stay small: the longest the windows allow
    for m in range(0, max_lag - k_n + 1):
        if small[m + 1 : m + 1 + k_n].all():
            m_hat = m
            break
    band = min(2 * m_hat, max_lag)
    if band == 0:
        return float(r[0])
    k = np.arange(1, band + 1)
    t = k / band
    lam = np.where(t <= 0.5, 1.0, 2.0 * (1.0 - t))
    return float(r[0] + 2.0 * np.sum(lam * r[1 : band + 1]))


SECTIONS = 5  # per window: few enough that each section holds several correlation times at 85 % load
SECTION_EVENTS = 10  # expected requests past the quantile per section (_sections)


def _cluster_var(windows: Sequence[np.ndarray], centre: float) -> float:
    """Cluster-robust variance of the pooled mean with the windows as clusters (needs >= 2 windows)."""
    sizes = np.array([len(w) for w in windows], np.float64)
    sums = np.array([np.sum(np.asarray(w, np.float64) - centre) for w in windows])
    k, n = len(windows), sizes.sum()
    return float(k / (k - 1) * np.sum(sums**2) / n**2)


def half_width(indicators: Sequence[np.ndarray], q: float, conf: float = CONF) -> float:
    """Half-width, in probability, of the interval on the fraction of requests at or below the quantile.

    The indicators' dependence is measured as inflation factors over their own Bernoulli variance
    p (1 - p) (p: their mean) and applied to q (1 - q), the variance at the quantile itself: within
    windows (flat-top long-run variance, normal quantile) and between windows (clusters, Student t with
    W - 1 df), the larger wins; never below the independent-sample half-width."""
    n = sum(len(w) for w in indicators)
    p = float(sum(np.sum(w) for w in indicators) / n)
    if not 0 < p < 1:
        return _iid_half_width(n, q, conf)
    a = 1 - (1 - conf) / 2
    bern = p * (1 - p)
    lrv = flat_top_lrv(indicators, p)
    widths = [norm_ppf(a) * math.sqrt(q * (1 - q) * max(lrv / bern, 1.0) / n)]
    for clusters in (indicators, _sections(indicators, q)):
        if len(clusters) >= 2:
            tau = _cluster_var(clusters, p) * n / bern
            widths.append(t_ppf(a, len(clusters) - 1) * math.sqrt(q * (1 - q) * tau / n))
    return max(widths)


def _sections(windows: Sequence[np.ndarray], q: float) -> list[np.ndarray]:
    """Each window cut into SECTIONS contiguous parts (batch means: Schmeiser 1982, Oper. Res. 30): a
    window as long as its correlation time makes the kernel estimate too small (it cannot see lags longer
    than its bandwidth), and the spread of its sections shows it. A section must expect >= SECTION_EVENTS
    requests on the rarer side of the quantile, or its mean is a count of one or two events and the t
    interval over them is noise: a p99 needs 1,000 requests a section, a p50 20 (shorter windows: none)."""
    out = []
    for w in windows:
        if len(w) * min(q, 1 - q) >= SECTIONS * SECTION_EVENTS:  # fewer sections: t with < 4 df is useless
            out += list(np.array_split(np.asarray(w), SECTIONS))
    return out


def _iid_half_width(n: int, q: float, conf: float) -> float:
    return norm_ppf(1 - (1 - conf) / 2) * math.sqrt(q * (1 - q) / n)


def _spread(windows: Sequence[np.ndarray], q: float, conf: float) -> tuple[np.ndarray, float, float]:
    """(pooled samples sorted, nearest-rank q-quantile, half-width h in probability) of non-empty windows.
    h is the wider of the empirical CDF's spreads just below and at the point: where many requests tie at
    it (a service time that hardly varies), the two fractions differ, and so may their spread."""
    parts = [np.asarray(w, np.float64).ravel() for w in windows]
    parts = [w for w in parts if len(w)]
    s = np.sort(np.concatenate(parts))
    point = float(s[max(math.ceil(q * len(s)), 1) - 1])
    h = max(half_width([w <= point for w in parts], q, conf), half_width([w < point for w in parts], q, conf))
    return s, point, h


def _widened_ranks(n: int, q: float, conf: float, h: float) -> tuple[int, int]:
    """1-based ranks (lo, hi) of the exact i.i.d. interval widened on each side by the ranks a half-width of
    h in probability adds over the independent one (module docstring); past 1..n a side is open."""
    lo_iid, hi_iid = _order_bounds(n, q, conf)
    extra = max(round(n * h - n * _iid_half_width(n, q, conf)), 0)
    return lo_iid - extra, hi_iid + extra


def dependent_bounds(
    windows: Sequence[np.ndarray], q: float, conf: float = CONF, floor: float = 0.0
) -> tuple[float, float, float, bool]:
    """(point, lo, hi, supported) of the pooled q-quantile of time-ordered windows (see the module
    docstring). `floor`: the lower bound when the interval reaches below the smallest sample (0 for a
    latency). supported is False when n is too small for the i.i.d. interval's upper bound to be a
    sample (reco.stats.min_n_for_quantile); lo is meaningful either way (a screening window)."""
    n = sum(len(np.ravel(w)) for w in windows)
    if n == 0:
        return math.nan, floor, math.inf, False
    s, point, h = _spread(windows, q, conf)
    r_lo, r_hi = _widened_ranks(n, q, conf, h)
    lo = float(s[r_lo - 1]) if r_lo >= 1 else floor
    hi = float(s[r_hi - 1]) if r_hi <= n else math.inf
    return point, lo, hi, n >= min_n_for_quantile(q, conf)


def requests_to_close(windows: Sequence[np.ndarray], q: float, conf: float = CONF) -> int:
    """Requests the q-quantile's interval needs before its upper bound can be a request it saw, at the
    dependence these windows show: the rank z sqrt(q (1 - q) tau / n) above q n must stay within n, so
    n >= z^2 q tau / (1 - q), tau = (this interval's half-width / the independent one's)^2, and from
    there the least n whose exact upper rank (binomial, widened as dependent_bounds widens it) fits. What
    an INCONCLUSIVE capacity step would need (bench.coverage --tau: tau 3-8 at 30-50 % utilisation,
    30-200 at 70-85 %)."""
    n = sum(len(np.ravel(w)) for w in windows)
    if n == 0:
        return min_n_for_quantile(q, conf)
    iid = _iid_half_width(n, q, conf)
    tau = max(_spread(windows, q, conf)[2] / iid, 1.0) ** 2
    z = norm_ppf(1 - (1 - conf) / 2)
    least = min_n_for_quantile(q, conf)
    first = max(math.ceil(z * z * q * tau / (1 - q)), least)

    # the normal approximation leaves out the exact rank's rounding, a few percent either way near 1,000
    # requests: a count it names can leave the interval open, so the count is the exact one
    def closes(m: int) -> bool:
        return _widened_ranks(m, q, conf, _iid_half_width(m, q, conf) * math.sqrt(tau))[1] <= m

    lo, hi = max(least, int(0.8 * first)) - 1, 2 * first + 100
    if closes(lo):  # the approximation far too high: search from the least any interval needs
        lo = least - 1
    while not closes(hi):  # far too low: at tau fixed the rank fits from z^2 q tau / (1 - q) on
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # bisection: a few dozen exact bounds, where a capacity step's futility asks each look
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if closes(mid) else (mid, hi)
    return hi


def dependent_quantile_ci(
    windows: Sequence[np.ndarray], q: float, conf: float = CONF, floor: float = 0.0
) -> Estimate:
    """Nearest-rank q-quantile of the pooled windows with an interval that holds for dependent,
    drifting requests (module docstring); Estimate(None, ...) when n cannot support it.

    Args:
        windows: each window's samples IN TIME ORDER (+inf = failed request); one window is fine.
        q: quantile in (0, 1).
        floor: the smallest value the quantity can take (0 ms for a latency).
    """
    n = sum(len(w) for w in windows)
    point, lo, hi, supported = dependent_bounds(windows, q, conf, floor)
    return Estimate(point, lo, hi, n) if supported else Estimate(None, None, None, n)


SECTION_MIN_N = 100  # requests per section before a window's sections enter mean_upper


def mean_upper(windows: Sequence[np.ndarray], conf: float = CONF) -> tuple[float, float, float]:
    """(mean, upper bound, effective n) of the pooled mean of time-ordered windows of a dependent series.

    The bound is one-sided at 1 - (1 - conf) / 2, the upper end of a two-sided interval at `conf`. The
    mean's variance is taken three ways as for a quantile (module docstring: flat-top kernel within
    windows, each window's 5 sections, the windows as clusters with Student t) and the widest bound wins.
    Effective n = the series' variance over that bound's squared half-width in standard errors (z): how
    many independent values the bound is worth, Student t's small-sample penalty included; a bound worth
    few of them rests on a variance estimated from a stretch no longer than the series' memory."""
    parts = [np.asarray(w, np.float64).ravel() for w in windows]
    parts = [w for w in parts if len(w)]
    n = sum(len(w) for w in parts)
    if n == 0:
        return math.nan, math.inf, 0.0
    m = float(sum(np.sum(w) for w in parts) / n)
    a = 1 - (1 - conf) / 2
    z = norm_ppf(a)
    widths = [z * math.sqrt(max(flat_top_lrv(parts, m), 0.0) / n)]
    sections = [s for w in parts if len(w) >= SECTIONS * SECTION_MIN_N for s in np.array_split(w, SECTIONS)]
    for clusters in (parts, sections):
        if len(clusters) >= 2:
            widths.append(t_ppf(a, len(clusters) - 1) * math.sqrt(_cluster_var(clusters, m)))
    h = max(widths)
    var = float(sum(np.sum((w - m) ** 2) for w in parts) / n)
    n_eff = var / (h / z) ** 2 if h > 0 else (math.inf if var > 0 else 0.0)
    return m, m + h, n_eff


# k of exceedance_bound: 8 false-PASSed 0.14-0.29 of simulated steps at the true capacity
# (experiments/interval_coverage/README.md#steps-far-below-the-slo)
EXCEEDANCE_POWER = 4


def exceedance_bound(
    windows: Sequence[np.ndarray], threshold: float, conf: float = CONF, power: int = EXCEEDANCE_POWER
) -> tuple[float, float, float]:
    """(estimate, upper bound, effective n) of a bound on P(x >= threshold) that stays informative where no
    request reached the threshold.

    P(x >= s) <= E[min(x / s, 1)^k] for any k > 0 (the function is 1 from s on and >= 0 below: Markov's
    inequality on a bounded, non-decreasing g), so an upper confidence bound on that mean (mean_upper)
    bounds the share of requests at or past s. Unlike a count of requests past s, it has a variance to
    estimate when none got there (a count of 0 has none), and unlike the p99's interval it does not need
    1 / (1 - q) x tau requests before its bound can be a request it saw: a sample whose requests all sit
    far below s is decided from the margin. Near s it is loose (requests just below s count almost
    fully). Failed requests (+inf) count 1. A small effective n means the bound cannot be trusted
    (reco.loadtest.capacity.step_verdict requires enough of it)."""
    g = [np.minimum(np.asarray(w, np.float64) / threshold, 1.0) ** power for w in windows]
    return mean_upper(g, conf)


def ratio_ci(num: Estimate, den: Estimate) -> Estimate:
    """num / den with a MOVER interval on the log scale from the two intervals (module docstring);
    Estimate(None, ...) when either is unsupported. n is the smaller n."""
    n = min(num.n, den.n)
    if num.value is None or den.value is None:
        return Estimate(None, None, None, n)
    if math.isinf(num.value) and math.isinf(den.value) or den.value == 0:
        return Estimate(None, None, None, n)  # both failing (or a zero latency): no ratio to state
    point = num.value / den.value
    parts = (num.value, num.lo, num.hi, den.value, den.lo, den.hi)
    if not all(0 < v < math.inf for v in parts):  # an open or zero bound: the box bounds, one-sided
        lo = 0.0 if math.isinf(den.hi) else num.lo / den.hi
        hi = math.inf if math.isinf(num.hi) or den.lo == 0 else num.hi / den.lo
        return Estimate(point, min(lo, point), max(hi, point), n)
    c = math.log(point)
    down = math.hypot(math.log(num.value / num.lo), math.log(den.hi / den.value))
    up = math.hypot(math.log(num.hi / num.value), math.log(den.value / den.lo))
    return Estimate(point, math.exp(c - down), math.exp(c + up), n)
