"""Where a capacity search should start: the rate a queue of the variant's own unloaded latencies could
carry at the SLO.

Each capacity step at a slow variant's few requests per second costs minutes (>= 477 requests), so a
search that starts far too high (0.6 / in-process rank p50 put the eager baseline's first step at 2.7x
its capacity: experiments/ecommerce_case_study/README.md#capacity-search-start) spends several of them
walking down.
Here the unloaded latencies measured at the start of the study stand in for the service time of a
single-server FCFS queue with Poisson arrivals (M/G/1, the service times resampled from them), simulated
with Lindley's recursion (W' = max(0, W + S - A)); the start is the rate whose simulated p99 sojourn
time equals the SLO, found by bisection. It is a starting point, never a figure: the search measures
from there. It errs both ways: client-side time inside an unloaded latency makes the service look longer
than it is, a server that overlaps requests (threads, batching) carries more than one queue would, and
a server under load runs slower than an idle one answering one request at a time (predicted against found
capacities: experiments/ecommerce_case_study/README.md#capacity-search-start).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

CHAINS = 64  # independent simulated queues per rate
WARMUP = 300  # requests each chain runs before it is recorded
LENGTH = 600  # recorded requests per chain: 38,400 sojourn times per rate
ITERATIONS = 25  # bisection steps: the bracket shrinks 2^25-fold


def sojourn_quantile(service_ms: np.ndarray, rate: float, q: float, rng: np.random.Generator) -> float:
    """The q-quantile of the simulated sojourn time (ms) at `rate` req/s, service resampled from `service_ms`."""
    wait = np.zeros(CHAINS)
    out = np.empty((LENGTH, CHAINS))
    mean_gap_ms = 1000.0 / rate
    for t in range(WARMUP + LENGTH):
        serve = rng.choice(service_ms, CHAINS)
        if t >= WARMUP:
            out[t - WARMUP] = wait + serve
        wait = np.maximum(wait + serve - rng.exponential(mean_gap_ms, CHAINS), 0.0)
    return float(np.quantile(out, q))


def predicted_capacity(
    unloaded_ms: Sequence[float], slo_ms: float, q: float = 0.99, seed: int = 0
) -> float | None:
    """Highest Poisson rate (req/s) at which an M/G/1 queue with these service times keeps its q-quantile
    sojourn within slo_ms; None when even an idle queue misses it (the unloaded quantile is past the SLO)
    or there is nothing to resample (no finite latency)."""
    s = np.asarray([v for v in unloaded_ms if math.isfinite(v) and v > 0], np.float64)
    if len(s) == 0 or float(np.quantile(s, q)) > slo_ms:
        return None
    lo, hi = 0.0, 1000.0 / float(s.mean())  # utilisation 1: no queue keeps a finite p99 past it
    for _ in range(ITERATIONS):
        mid = (lo + hi) / 2
        # the same random stream at every rate, so the bisection sees a monotone curve
        if sojourn_quantile(s, mid, q, np.random.default_rng(seed)) <= slo_ms:
            lo = mid
        else:
            hi = mid
    return lo if lo > 0 else None
