"""Comparisons measured as comparisons: the ratio of two variants' quantiles from paired blocks.

**Paired ratios (RMIT).** A study runs every variant once per *block*, in random order, blocks spread
over the study on servers that all stay up (randomized multiple interleaved trials: Abedi & Brecht,
ICPE 2017). Drift of the machine between blocks minutes apart (window p50s 1.1-1.7x apart on these VMs)
hits both variants of a block alike, so it cancels in their ratio, where two pooled intervals combined
by MOVER (reco.stats.dependent.ratio_ci) carry it twice. The ratio of two variants' q-quantiles:

- point: the ratio of their quantiles pooled over the paired blocks (a consistent estimate; a block's
  own p99 of 100 requests is its 2nd-largest, a biased estimate whose bias differs between shapes);
- interval: that point times exp(+-t_{B-1} se), se the standard error of the log of that ratio from a
  paired block bootstrap (blocks resampled, both variants' blocks together, so shared drift stays
  paired out), with Student t on B - 1 df for the few blocks. The blocks are the independent units.
  A per-block t on the blocks' own ratios (RMIT's paired t) centres on the blocks' p99s, each a
  100-request estimate biased by its shape: it covered 0.87-0.91 where this covers 0.93-0.97
  (p99, 12 x 100, experiments/interval_coverage/README.md).

A block needs enough requests for its own quantile not to be its maximum (block_min_n: 100 for a p99),
and >= 2 blocks; otherwise the ratio is not supported, as it is when a variant's pooled quantile is a
failure (+inf): the caller then falls back to the two pooled intervals, which bound it on one side.
Failures past the quantile in some bootstrap replicates make that side of the interval open. Coverage and width of this interval under the study's shapes (queues,
shared and own drift): bench/coverage.py, experiments/interval_coverage/README.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from reco.stats import CONF, Estimate, nearest_rank

BOOTSTRAP = 400  # paired block bootstrap replicates (the interval's standard error)


def block_min_n(q: float) -> int:
    """Fewest requests a block needs for its nearest-rank q-quantile not to be its largest (or smallest)
    request: 100 for a p99, 2 for a p50."""
    return math.ceil(1.0 / min(q, 1.0 - q) - 1e-9)


def paired_ratio(
    num: Sequence[np.ndarray], den: Sequence[np.ndarray], q: float, conf: float = CONF, seed: int = 0
) -> Estimate:
    """num's q-quantile / den's, from blocks paired by position (num[i] and den[i] ran in one block).

    Args:
        num, den: [B] blocks of latencies (ms, +inf = failed), paired by index; B >= 2.
        q: the quantile, e.g. 0.99.
        seed: the bootstrap's (the same data give the same interval).
    Returns:
        Estimate(point, lo, hi, n = the fewer pooled requests); value None when a block is too small for
        its quantile (block_min_n) or there are fewer than 2 blocks.
    """
    from scipy import stats as sps  # slow to import (see reco.stats)

    a = [np.asarray(x, np.float64).ravel() for x in num]
    b = [np.asarray(x, np.float64).ravel() for x in den]
    assert len(a) == len(b), "paired_ratio: blocks must pair up"
    n = min(sum(len(x) for x in a), sum(len(x) for x in b))
    if len(a) < 2 or any(len(x) < block_min_n(q) for x in a + b):
        return Estimate(None, None, None, n)
    pa, pb = nearest_rank(np.concatenate(a), q), nearest_rank(np.concatenate(b), q)
    if math.isinf(pa) or math.isinf(pb) or pb == 0:
        # a side failing past its quantile: nothing finite to pair; the one-sided interval from the two
        # pooled intervals (reco.stats.dependent.ratio_ci) says what can be said
        return Estimate(None, None, None, n)
    point = pa / pb
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
    half = float(sps.t.ppf(1 - a_, len(a) - 1)) * float(np.std(logs, ddof=1))
    return Estimate(point, point * math.exp(-half), point * math.exp(half), n)


def heaviest_block(blocks: Sequence[np.ndarray], q: float) -> tuple[int, int, int] | None:
    """Where a pooled q-quantile's tail sits: (index of the block holding the most requests slower than the
    pooled quantile, how many it holds, how many all blocks hold); None with fewer than 2 blocks, no
    finite quantile or nothing slower. One block holding most of them is one slow stretch of the host
    (experiments/platform/README.md), and every paired ratio with that quantile rests on it."""
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
