"""Cross-check Locust's maximum throughput against an independent generator (wrk).

    python -m bench.crosscheck --variant DIR --dataset DATA.pt [--connections 8] [--seconds 15]
    (make crosscheck runs it on the case study's distilled INT8 variant; needs Debian's wrk)

Both generators run closed loop with the same number of connections against the same server (pinned
to its own core, the generator to the other), back to back; the table prints both throughputs and
their ratio. Locust's figure comes from reco's exact per-request record, wrk's from its own summary.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from reco.cli.compose import compose
from reco.loadtest.config import LoadMode, loadtest_config
from reco.loadtest.requests import write_requests
from reco.loadtest.runner import plan_cpus, run_load, with_settings
from reco.serve.config import serve_config
from reco.serve.process import start_server

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class WrkResult:
    """wrk's own summary of one closed-loop run."""

    qps: float  # Requests/sec
    n: int  # requests completed
    percentiles_ms: dict[str, float]  # "p50", "p75", "p90", "p99" (wrk's --latency distribution)
    mean_ms: float  # exact mean latency (loadtest/wrk_requests.lua's `done`)


_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def wrk_run(
    url: str,
    requests: Path,
    connections: int,
    seconds: int,
    cpus: list[int] | None,
    threads: int = 1,
    think_ms: float | None = None,
) -> WrkResult:
    """wrk closed loop: `connections` connections over `threads` threads for `seconds`, replaying the
    request file (loadtest/wrk_requests.lua), pinned to `cpus`; with `think_ms`, each connection waits an
    exponential time of that mean before each request (bench.outside's light load). Exits on any non-2xx
    answer."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install wrk (Debian) or run `make crosscheck`")
    cmd = [
        "wrk",
        f"-t{threads}",
        f"-c{connections}",
        f"-d{seconds}s",
        "--latency",
        "-s",
        str(ROOT / "loadtest" / "wrk_requests.lua"),
        url,
    ]
    if cpus:
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
    env = {**os.environ, "RECO_REQUESTS": str(requests)}
    if think_ms is not None:
        env["RECO_THINK_MS"] = f"{think_ms:g}"
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non2xx:
        raise SystemExit(f"wrk saw {non2xx.group(1)} error responses:\n{out}")
    pcts = {
        f"p{q}": float(v) * _UNIT_MS[u]
        for q, v, u in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M)
    }
    return WrkResult(
        qps=float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        n=int(re.search(r"(\d+) requests in", out).group(1)),
        percentiles_ms=pcts,
        mean_ms=float(re.search(r"^mean_us ([\d.]+)", out, re.M).group(1)) / 1e3,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=15)
    args = ap.parse_args()
    server_cpus, gen_cpus = plan_cpus()
    work = Path(tempfile.mkdtemp(prefix="reco-crosscheck-"))
    requests = write_requests(args.dataset, work / "requests.jsonl", n=2000, k=10, seed=0)
    cfg = compose()
    lt = with_settings(
        loadtest_config(cfg.loadtest), mode=LoadMode.closed, users=args.connections, window_requests=None
    )
    with start_server(
        args.variant, args.dataset, serve_config(cfg.serve), cpus=server_cpus, work_dir=work
    ) as server:
        run_load(server.url, with_settings(lt, duration_s=3), work / "warm", requests, gen_cpus)
        locust = run_load(
            server.url, with_settings(lt, duration_s=args.seconds), work / "locust", requests, gen_cpus
        ).qps
        wrk = wrk_run(server.url, requests, args.connections, args.seconds, gen_cpus).qps
    print("| generator | connections | seconds | req/s |\n|---|---|---|---|")
    print(f"| Locust (reco) | {args.connections} | {args.seconds} | {locust:.1f} |")
    print(f"| wrk | {args.connections} | {args.seconds} | {wrk:.1f} |")
    diff = abs(locust - wrk) / wrk * 100
    print(
        f"\nLocust / wrk = {locust / wrk:.3f} ({diff:.1f}% apart; target within 10%: {'MET' if diff <= 10 else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
