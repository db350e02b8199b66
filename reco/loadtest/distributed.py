"""Distributed load generation (loadtest.workers = N > 1): each Locust worker's share and record, and
their merge into the one record a single Locust process would have written.

    worker_file("out/latencies.csv", 1)          -> out/latencies.w1.csv (+ .started, .summary.json, ...)
    window_share(301, 0, 2), window_share(301, 1, 2)   -> 151, 150
    summary = merge_records(Path("out/latencies.csv"), 2)   # writes latencies.csv + .summary.json + ...

    python -m reco.cli.merge_records DIR/latencies.csv N   # merge records collected from N workers'
                                                              # machines; print quantiles, every worker's
                                                              # CPU and lag against loadtest.loadgen

Locust's master only dispatches users and collects its rounded statistics; the figures reco reports come
from the workers' own exact records. Every worker (loadtest/locustfile.py) writes its per-request file,
schedule lag and CPU over its window beside the master's --latency-file, named by the index the master
gave it. The merge concatenates the requests (so quantiles over the merged file are exact), rebases
their times on the earliest worker's start and keeps each worker's summary, so the saturation check can
judge every worker on its own (one saturated worker voids the window).

This module is imported by the locustfile in every worker: standard library and numpy only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

HEADER = "start_s,latency_ms,ok,status"


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


def merge_records(latency_file: Path, workers: int) -> dict[str, Any]:
    """Merge workers 0..workers-1's records into `latency_file` (+ .started, .window_end, .summary.json,
    .scores.jsonl), as one process would have written them.

    Args:
        latency_file: the master's --latency-file; the workers' records are worker_file(latency_file, i).
        workers: how many workers took part.
    Returns:
        The merged summary: counts summed, t0 the earliest start, the window's end the latest, open-loop
        lag p99 the largest worker's (an upper bound of the merged p99), and `workers`: each worker's own
        summary (its CPU over its window, lag, counts). Raises FileNotFoundError naming a missing record.
    """
    sums = []
    for i in range(workers):
        p = Path(f"{worker_file(latency_file, i)}.summary.json")
        if not p.exists():
            raise FileNotFoundError(f"{p}: Locust worker {i} wrote no record (did it finish its window?)")
        sums.append(json.loads(p.read_text()))
    t0 = min(s["t0_epoch"] for s in sums)
    rows = []
    for i, s in enumerate(sums):
        a = np.loadtxt(worker_file(latency_file, i), delimiter=",", skiprows=1, ndmin=2)
        if a.size:
            a[:, 0] += s["t0_epoch"] - t0
            rows.append(a)
    merged = np.concatenate(rows) if rows else np.zeros((0, 4))
    merged = merged[np.argsort(merged[:, 0], kind="stable")]
    with open(latency_file, "w") as f:
        f.write(HEADER + "\n")
        f.writelines(f"{s:.6f},{lat:.4f},{int(ok)},{int(st)}\n" for s, lat, ok, st in merged)
    scores = [Path(f"{worker_file(latency_file, i)}.scores.jsonl") for i in range(workers)]
    if any(p.exists() for p in scores):
        Path(f"{latency_file}.scores.jsonl").write_text("".join(p.read_text() for p in scores if p.exists()))
    ends = [s["window_end_epoch"] for s in sums if s.get("window_end_epoch")]
    summary: dict[str, Any] = {
        **{k: sums[0][k] for k in ("mode", "warmup_s", "duration_s", "payloads")},
        "t0_epoch": t0,
        "window_end_epoch": max(ends) if ends else None,
        "window_requests": sum(s["window_requests"] for s in sums),
        **{k: sum(s[k] for s in sums) for k in ("n_window", "n_recorded", "unanswered", "n_all")},
        "open": None,
        "workers": sums,
    }
    if all(s.get("open") for s in sums):
        summary["open"] = {
            "rate": sum(s["open"]["rate"] for s in sums),
            "overflow": sum(s["open"]["overflow"] for s in sums),
            "lag_p99_ms": max(s["open"]["lag_p99_ms"] for s in sums),
            "lag_max_ms": max(s["open"]["lag_max_ms"] for s in sums),
        }
    Path(f"{latency_file}.summary.json").write_text(json.dumps(summary, indent=2))
    Path(f"{latency_file}.started").write_text(repr(t0))
    if summary["window_end_epoch"] is not None:
        Path(f"{latency_file}.window_end").write_text(repr(summary["window_end_epoch"]))
    return summary
