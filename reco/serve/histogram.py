"""A Prometheus histogram whose observe costs one bisection (reco.serve.metrics' stage histograms).

Its own module, imported when the metrics are built: prometheus_client must not be imported before
PROMETHEUS_MULTIPROC_DIR is set (reco.serve.workers sets it in the supervisor, before the workers start).
"""

from __future__ import annotations

import bisect

from prometheus_client import Histogram


class BisectHistogram(Histogram):
    """prometheus_client's Histogram with its bucket found by bisection: the stock observe scans the bounds
    one by one in Python (~25 steps for a 1 ms value on BUCKETS), and a request makes a dozen observations
    on the model's core (bench.overhead prints the bookkeeping's CPU). Same buckets, same exposition, both
    value kinds (one process, multiprocess files)."""

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar is not None:  # not used here; the stock path keeps its checks
            super().observe(amount, exemplar)
            return
        self._raise_if_not_observable()
        self._sum.inc(amount)
        # the first bound >= amount, as the stock scan's `amount <= bound` (the last bound is +inf)
        self._buckets[bisect.bisect_left(self._upper_bounds, amount)].inc(1)
