"""What one Locust process needs to write its record of a window: where (worker_file), how many requests
are its share (window_share) and its open-loop send lag p99 (lag_p99).

    worker_file("out/latencies.csv", 1)   -> out/latencies.w1.csv (+ .started, .summary.json, ...)
    window_share(301, 0, 2), window_share(301, 1, 2)   -> 151, 150

Imported by loadtest/locustfile.py in every Locust process (a distributed window's workers included), so
standard library only: a worker pays for nothing it does not use at start-up. The runner's side of a
distributed window (merging the workers' records, judging each worker) is reco.loadtest.distributed.
"""

from __future__ import annotations

import math
from pathlib import Path

HEADER = "start_s,latency_ms,ok,status"  # the per-request latency file's header


def worker_file(latency_file: str | Path, index: int) -> Path:
    """Where worker `index` writes its record: `<stem>.w<index><suffix>` beside `latency_file`."""
    p = Path(latency_file)
    return p.with_name(f"{p.stem}.w{index}{p.suffix}")


def window_share(total: int, index: int, workers: int) -> int:
    """Worker `index`'s share of a window of `total` requests (0: no count) split as evenly as can be."""
    if total <= 0:
        return 0
    return total // workers + int(index < total % workers)


def lag_p99(lags_ms: list[float]) -> float:
    """Nearest-rank p99 of the open-loop schedule lags (0.0 when there are none)."""
    lags = sorted(lags_ms)
    return lags[min(len(lags) - 1, math.ceil(0.99 * len(lags)) - 1)] if lags else 0.0
