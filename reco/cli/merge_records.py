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

import argparse
import sys
from pathlib import Path

from reco.cli.compose import compose
from reco.loadtest.distributed import merge_records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("latency_file", type=Path, help="the master's --latency-file, workers' records beside it")
    ap.add_argument("workers", type=int, help="how many workers took part (--expect-workers)")
    args = ap.parse_args(argv)
    from reco.loadtest.config import loadtest_config
    from reco.loadtest.histogram import quantiles, read_latencies

    lg = loadtest_config(compose().loadtest).loadgen
    summary = merge_records(args.latency_file, args.workers)
    lat = read_latencies(args.latency_file)
    x = lat.window_ms(int(summary["unanswered"]))
    print(f"{args.latency_file}: {len(x):,} requests, {len(x) - len(lat.ok_ms):,} failed")
    for name, e in quantiles(x).items():
        print(f"  {name} ms {e.fmt('.2f')}")
    for w in summary["workers"]:
        lag = (w["open"] or {}).get("lag_p99_ms", 0.0)
        bad = w["cpu_pct"] > lg.max_cpu_pct or lag > lg.max_lag_ms
        print(
            f"  worker {w['index']} (pid {w['pid']}): n {w['n_window']:,}, CPU {w['cpu_pct']:.0f}%, lag p99 "
            f"{lag:.1f} ms{'  SATURATED: the window is not valid' if bad else ''}"
        )


if __name__ == "__main__":
    sys.exit(main())
