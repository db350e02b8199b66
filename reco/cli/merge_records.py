"""python -m reco.cli.merge_records DIR/latencies.csv N: merge the records collected from N Locust workers'
machines into the one a single process would have written (reco.loadtest.distributed.merge_records), and
print the quantiles and every worker's CPU and send lag against loadtest.loadgen.
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
