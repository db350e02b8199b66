"""Comparisons measured as comparisons: the ratio of two variants' quantiles from paired blocks.

**Paired ratios (RMIT).** A study runs every variant once per *block*, in random order, blocks spread
over the study on servers that all stay up (randomized multiple interleaved trials: Abedi & Brecht,
ICPE 2017). Drift of the machine between blocks minutes apart (window p50s 1.1-1.7x apart on these VMs)
hits both variants of a block alike, so it cancels in their ratio, where two pooled intervals combined
by MOVER (reco.stats.dependent.ratio_ci) carry it twice. The ratio of two variants' q-quantiles:

- **many blocks (the unloaded phase's 28): the median block.** Each block's ratio of the two windows'
  Harrell-Davis q-quantiles (a beta-weighted mean of all order statistics: far less biased than a
  100-request window's nearest-rank p99, its 2nd-largest request), the point the median of those ratios,
  the interval the sign test's order statistics of them (distribution-free: it covers the median block's
  ratio whatever the blocks' spread, given independent blocks). The host's slow stretches (1-6 s at
  1.3-1.9x, one every minute or two: experiments/platform/README.md) hit a few windows of a study; they
  move a pooled p99 ratio by up to 26 % and no resampling of 28 blocks that met ~2 of them shows it
  (coverage 0.68-0.82), while a median block is moved by at most the few blocks they hit. So the figure
  is the speed-up on the host as a block sees it, without its rare stretches (a variant's own pooled
  p99, with them, is reported beside it). What it covers and how wide:
  experiments/unloaded_interleave/README.md#the-median-block-recostatspairedmedian_block_ratio-a-simulation-2026-12-05-code-44b2615.
- **under load, or few blocks (the common load's 3): pooled.** The ratio of the quantiles pooled over
  the blocks, its interval from a paired block bootstrap (blocks resampled, both variants' together)
  with Student t on B - 1 df: a short loaded window's own quantile is biased low (its requests queue
  behind each other), and below SIGN_MIN_BLOCKS the sign test cannot reach 95 % without its extremes.
  reco.report.figures.latency_ratio chooses.

A block needs enough requests for its own quantile not to be its maximum (block_min_n: 100 for a p99),
and >= 2 blocks; otherwise the ratio is not supported, as it is when a variant's pooled quantile is a
failure (+inf): the caller then falls back to the two pooled intervals, which bound it on one side. A
block with failed requests (+inf) takes its nearest-rank quantile (+inf only when failures reach it);
failures past the quantile leave that side of the interval open. Coverage and width under the study's
shapes (queues, shared and own drift, the host's stretches): bench/coverage.py, bench/stretch_ratio.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from reco.stats import CONF, Estimate, nearest_rank, t_ppf

BOOTSTRAP = 400  # paired block bootstrap replicates (the pooled interval's standard error)


def block_min_n(q: float) -> int:
    """Fewest requests a block needs for its nearest-rank q-quantile not to be its largest (or smallest)
    request: 100 for a p99, 2 for a p50."""
    return math.ceil(1.0 / min(q, 1.0 - q) - 1e-9)


def sign_rank(blocks: int, conf: float = CONF) -> int:
    """k such that [k-th smallest, k-th largest] of `blocks` i.i.d. values covers their median with
    probability >= conf (the sign test: P(Binomial(blocks, 1/2) <= k - 1) <= (1 - conf) / 2); 0 when even
    the extremes cannot."""
    k, tail = 0, 0.0  # tail = P(Binomial(blocks, 1/2) <= k)
    while k < blocks // 2 and (tail := tail + math.comb(blocks, k) / 2.0**blocks) <= (1 - conf) / 2:
        k += 1
    return k


SIGN_MIN_BLOCKS = next(b for b in range(2, 100) if sign_rank(b) >= 2)  # 9 at 95 %: not the extremes


@lru_cache(maxsize=256)
def hd_weights(n: int, q: float) -> np.ndarray:
    """Harrell-Davis weights of the n order statistics for the q-quantile (read-only: cached, shared)."""
    from scipy import stats as sps

    w = np.diff(sps.beta.cdf(np.arange(n + 1) / n, (n + 1) * q, (n + 1) * (1 - q)))
    w.setflags(write=False)
    return w


def block_quantile(x: np.ndarray, q: float) -> float:
    """A block's q-quantile: Harrell-Davis (Harrell & Davis, Biometrika 1982) when every request
    succeeded, else nearest-rank (+inf only when failures reach the quantile)."""
    x = np.asarray(x, np.float64).ravel()
    if not np.isfinite(x).all():
        return nearest_rank(x, q)
    return float(np.sort(x) @ hd_weights(len(x), q))


def _paired(
    num: Sequence[np.ndarray], den: Sequence[np.ndarray], q: float
) -> tuple[list[np.ndarray], list[np.ndarray], int, bool]:
    """(num's blocks, den's, n = the fewer pooled requests, whether a finite paired ratio is supported)."""
    a = [np.asarray(x, np.float64).ravel() for x in num]
    b = [np.asarray(x, np.float64).ravel() for x in den]
    assert len(a) == len(b), "paired ratio: blocks must pair up"
    n = min(sum(len(x) for x in a), sum(len(x) for x in b))
    if len(a) < 2 or any(len(x) < block_min_n(q) for x in a + b):
        return a, b, n, False
    pa, pb = nearest_rank(np.concatenate(a), q), nearest_rank(np.concatenate(b), q)
    # a side failing past its quantile: nothing finite to pair; the one-sided interval from the two
    # pooled intervals (reco.stats.dependent.ratio_ci) says what can be said
    return a, b, n, not (math.isinf(pa) or math.isinf(pb) or pb == 0)


def median_block_ratio(
    num: Sequence[np.ndarray], den: Sequence[np.ndarray], q: float, conf: float = CONF
) -> Estimate:
    """num's q-quantile / den's as the median block's ratio, sign-test interval (module docstring).

    Args:
        num, den: [B] blocks of latencies (ms, +inf = failed), paired by index; B >= SIGN_MIN_BLOCKS.
        q: the quantile, e.g. 0.99.
    Returns:
        Estimate(point, lo, hi, n = the fewer pooled requests); value None when unsupported (as
        paired_ratio) or fewer than SIGN_MIN_BLOCKS blocks.
    """
    a, b, n, ok = _paired(num, den, q)
    if not ok or len(a) < SIGN_MIN_BLOCKS:
        return Estimate(None, None, None, n)
    qa, qb = (np.array([block_quantile(x, q) for x in xs]) for xs in (a, b))
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.sort(np.log(qa) - np.log(qb))
    point = float(np.median(logs))  # nan when failures reach both sides' quantile in one block
    if not math.isfinite(point):
        return Estimate(None, None, None, n)
    k = sign_rank(len(logs), conf)
    return Estimate(math.exp(point), math.exp(logs[k - 1]), math.exp(logs[-k]), n)


def paired_ratio(
    num: Sequence[np.ndarray], den: Sequence[np.ndarray], q: float, conf: float = CONF, seed: int = 0
) -> Estimate:
    """num's q-quantile / den's pooled over blocks paired by position (num[i] and den[i] ran in one
    block), the interval from a paired block bootstrap, t on B - 1 df (module docstring).

    Args:
        num, den: [B] blocks of latencies (ms, +inf = failed), paired by index; B >= 2.
        q: the quantile, e.g. 0.99.
        seed: the bootstrap's (the same data give the same interval).
    Returns:
        Estimate(point, lo, hi, n = the fewer pooled requests); value None when a block is too small for
        its quantile (block_min_n), there are fewer than 2 blocks, or a side fails past its quantile.
    """
    a, b, n, ok = _paired(num, den, q)
    if not ok:
        return Estimate(None, None, None, n)
    point = nearest_rank(np.concatenate(a), q) / nearest_rank(np.concatenate(b), q)
    rng = np.random.default_rng(seed)
    logs = np.empty(BOOTSTRAP)
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in range(BOOTSTRAP):
            idx = rng.integers(0, len(a), len(a))
            ra = nearest_rank(np.concatenate([a[j] for j in idx]), q)
            rb = nearest_rank(np.concatenate([b[j] for j in idx]), q)
            logs[i] = (
                math.log(ra / rb)
                if 0 < ra < math.inf and 0 < rb < math.inf
                else (math.inf if ra == math.inf or rb == 0 else -math.inf)
            )
    a_ = (1 - conf) / 2
    if not np.isfinite(logs).all():
        # failures past the quantile in some replicates: no standard error; the replicates' own a / 1 - a
        # quantiles (percentile bootstrap) bound it, an infinite one leaving that side open
        lo = math.exp(float(np.quantile(logs, a_, method="lower")))
        hi = math.exp(float(np.quantile(logs, 1 - a_, method="higher")))
        return Estimate(point, min(lo, point), max(hi, point), n)
    half = t_ppf(1 - a_, len(a) - 1) * float(np.std(logs, ddof=1))
    return Estimate(point, point * math.exp(-half), point * math.exp(half), n)


def heaviest_block(blocks: Sequence[np.ndarray], q: float) -> tuple[int, int, int] | None:
    """Where a pooled q-quantile's tail sits: (index of the block holding the most requests slower than the
        pooled quantile, how many it holds, how many all blocks hold); None with fewer than 2 blocks, no
        finite quantile or nothing slower. One block holding most of them is one slow stretch of the host
        (experiments/platform/README.md): the variant's own pooled quantile rests on it (a paired ratio of many
    blocks, their median, does not)."""
    xs = [np.asarray(b, np.float64).ravel() for b in blocks]
    if len(xs) < 2 or not sum(map(len, xs)):
        return None
    cut = nearest_rank(np.concatenate(xs), q)
    if not math.isfinite(cut):
        return None
    over = [int((x > cut).sum()) for x in xs]
    if not sum(over):
        return None
    i = int(np.argmax(over))
    return i, over[i], sum(over)
