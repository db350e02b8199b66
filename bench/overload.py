"""Overload benchmark: a variant offered a multiple of its capacity sheds load instead of collapsing.

    python -m bench.overload --variant DIR --dataset DATA.pt --capacity 300 --slo-ms 20 [--factor 2] \
        [max_wait_ms=80] [queue_limit=24]

Open-loop (Poisson) load at `factor` x the given capacity (e.g. the study's max QPS at SLO) against the
served variant. The server answers 503 + Retry-After at once, without a model call, to a request beyond
`serve.queue_limit` admitted at once or -- with `serve.max_wait_ms` -- already older than that when it
is admitted or when its model call would start (age from the generator's X-Request-Start stamp: the
request's scheduled send time; reco/serve/admission.py). Printed: the share shed (503) and by which
guard, other errors, and the admitted requests' p50/p99 with their 95 % CIs against 2 x the SLO. Serve
settings are `key=value` overrides of conf/serve (e.g. max_wait_ms=80 queue_limit=16).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from reco.cli.compose import compose
from reco.loadtest.config import LoadMode, loadtest_config
from reco.loadtest.requests import write_requests
from reco.loadtest.runner import plan_cpus, run_load, scrape, with_settings
from reco.serve.config import serve_config
from reco.serve.process import start_server
from reco.stats import quantile_ci, verdict_at_most


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--capacity", type=float, required=True, help="req/s the variant sustains within the SLO")
    ap.add_argument("--factor", type=float, default=2.0, help="offered load = factor x capacity")
    ap.add_argument("--slo-ms", type=float, required=True, help="the SLO p99 the capacity was measured at")
    ap.add_argument("--requests", type=int, default=4000, help="requests in the measured window")
    ap.add_argument("overrides", nargs="*", help="serve settings, key=value")
    args = ap.parse_args(argv)
    cfg = compose([f"serve.{o}" for o in args.overrides])
    server_cpus, gen_cpus = plan_cpus()
    work = Path(tempfile.mkdtemp(prefix="reco-overload-"))
    requests = write_requests(args.dataset, work / "requests.jsonl", n=5000, k=10, seed=0)
    rate = args.factor * args.capacity
    lt = with_settings(
        loadtest_config(cfg.loadtest), mode=LoadMode.open, rate=rate, window_requests=args.requests
    )
    serve = serve_config(cfg.serve)
    with start_server(args.variant, args.dataset, serve, cpus=server_cpus, work_dir=work) as server:
        run = run_load(server.url, lt, work / "overload", requests, gen_cpus)
        by_reason = _shed_by_reason(scrape(server.url))
    lat = run.latencies_ms
    admitted = lat[np.isfinite(lat)]
    status = _statuses(work / "overload")  # every recorded request, warm-up included: same offered rate
    shed = status.count(503) / max(len(status), 1)
    p50, p99 = quantile_ci(admitted, 0.5), quantile_ci(admitted, 0.99)
    limit = 2 * args.slo_ms
    print(f"offered {rate:.0f} req/s = {args.factor:g} x capacity {args.capacity:g}; window n={run.n:,}")
    print(f"serve: max_wait_ms={serve.max_wait_ms} queue_limit={serve.queue_limit}")
    print("| figure | value |\n|---|---|")
    print(f"| shed (503 + Retry-After) | {shed:.1%} of {len(status):,} |")
    reasons = ", ".join(f"{r} {n:,.0f}" for r, n in by_reason.items()) or "n/a"
    print(f"| shed by guard (whole run, warm-up included) | {reasons} |")
    print(f"| failed in the window (shed, timeouts, errors) | {run.error_rate:.1%} |")
    print(f"| admitted throughput | {run.qps:.0f} req/s |")
    print(f"| admitted p50 | {p50.fmt('.2f', ' ms')} |")
    print(f"| admitted p99 | {p99.fmt('.2f', ' ms')} |")
    print(f"| admitted p99 <= 2 x SLO ({limit:g} ms) | {verdict_at_most(p99, limit).value} |")
    print(f"| generator valid | {run.valid} {run.invalid_reason} |")


def _shed_by_reason(metrics_text: str) -> dict[str, float]:
    """reco_shed_total by reason from a /metrics scrape (empty when the server did not answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == "reco_shed":
            out.update({s.labels["reason"]: s.value for s in fam.samples if s.name == "reco_shed_total"})
    return out


def _statuses(out_dir: Path) -> list[int]:
    """HTTP status of every request of the window (latencies.csv, column `status`)."""
    rows = (out_dir / "latencies.csv").read_text().splitlines()[1:]
    return [int(float(r.split(",")[3])) for r in rows if r]


if __name__ == "__main__":
    main()
