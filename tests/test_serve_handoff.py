"""The request path's per-request machinery, in process: the bisecting histogram (reco/serve/histogram.py)
behind the stage metrics."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from reco.serve.histogram import BisectHistogram
from reco.serve.metrics import BUCKETS


def test_bisect_histogram_exposes_what_the_stock_histogram_does():
    """Values on the bounds (le is inclusive), between them, below the first and beyond the last finite
    one land in the same buckets as prometheus_client's own scan puts them."""
    values = [0.0, 1e-6, *BUCKETS[:-1:7], *(b * 1.0001 for b in BUCKETS[3:-1:11]), 1e-3, 0.0123, 60.0, 1e6]
    texts = []
    for cls in (Histogram, BisectHistogram):
        reg = CollectorRegistry()
        h = cls("t_seconds", "test", ["stage"], buckets=BUCKETS, registry=reg)
        for v in values:
            h.labels(stage="rank").observe(v)
        texts.append(generate_latest(reg).decode().replace("BisectHistogram", "Histogram"))
    assert texts[0] == texts[1]
    assert "t_seconds_count" in texts[0] and math.isinf(BUCKETS[-1])
