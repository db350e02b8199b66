"""One variant served by reco's server and by Triton (serve.backend=triton), measured the same way.

    python -m bench.backends --variant DIR --dataset DATA.pt [--rate 100] [--users 8] [--repeats 2]
        [--requests 2000] [--triton-batched]

Each server is pinned to the server cores and Locust to its own core (plan_cpus); servers run one at a
time (nothing else on the server cores), and the repeats interleave the backends. Per backend and repeat:
  closed  --users users back to back, --requests requests: the throughput (max QPS with that many users)
  open    Poisson arrivals at --rate req/s, --requests requests: p50 / p99 with 95 % CIs
--triton-batched adds Triton with its dynamic batcher (batching.enabled=true) and 2 instances. Prints one
Markdown table; every window's LoadRun files land under --out. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from reco.cli.compose import compose
from reco.loadtest.config import LoadMode, loadtest_config
from reco.loadtest.outcome import LoadRun
from reco.loadtest.requests import write_requests
from reco.loadtest.runner import plan_cpus, run_load, with_settings
from reco.serve.config import serve_config
from reco.serve.process import start_server

SETUPS = {
    "reco": [],
    "triton": ["serve.backend=triton"],
    "triton_batched_x2": ["serve.backend=triton", "serve.batching.enabled=true", "serve.triton.instances=2"],
}


def _row(name: str, closed: list[LoadRun], opened: list[LoadRun]) -> str:
    qps = " / ".join(f"{r.qps:.0f}{'' if r.valid else '*'}" for r in closed)
    p50 = " / ".join(r.quantiles["p50"].fmt(".2f") for r in opened)
    p99 = " / ".join(r.quantiles["p99"].fmt(".2f") for r in opened)
    err = max([r.error_rate for r in closed + opened] or [0.0])
    return f"| {name} | {qps} | {p50} | {p99} | {err:.2%} |"


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and print its table."""
    p = argparse.ArgumentParser(prog="python -m bench.backends", description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True, help="variant directory")
    p.add_argument("--dataset", required=True, help="the variant's Dataset .pt file")
    p.add_argument("--rate", type=float, default=100.0, help="open loop: arrivals/s")
    p.add_argument("--users", type=int, default=8, help="closed loop: concurrent users")
    p.add_argument("--requests", type=int, default=2000, help="requests per window")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats per backend")
    p.add_argument("--triton-batched", action="store_true", help="also Triton with batching and 2 instances")
    p.add_argument("--out", help="where the windows' files go (default: a temporary directory)")
    a = p.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="reco-backends-"))
    requests = write_requests(a.dataset, out / "requests.jsonl", n=5000, k=10, seed=0)
    server_cpus, gen_cpus = plan_cpus()
    names = [n for n in SETUPS if a.triton_batched or n != "triton_batched_x2"]
    closed: dict[str, list[LoadRun]] = {n: [] for n in names}
    opened: dict[str, list[LoadRun]] = {n: [] for n in names}
    for r in range(a.repeats):
        for n in names:
            cfg = compose(SETUPS[n])
            with start_server(
                a.variant, a.dataset, serve_config(cfg.serve), cpus=server_cpus, work_dir=out / n / "server"
            ) as h:
                lt = with_settings(loadtest_config(cfg.loadtest), warmup_s=2, drain_s=5)
                c = with_settings(lt, mode=LoadMode.closed, users=a.users, window_requests=a.requests)
                closed[n].append(
                    run_load(h.url, c, out / n / f"closed{r}", requests, gen_cpus, kind="closed",
                             reports=False, triton_model=h.triton_model)
                )  # fmt: skip
                o = with_settings(lt, mode=LoadMode.open, rate=a.rate, window_requests=a.requests)
                opened[n].append(
                    run_load(h.url, o, out / n / f"open{r}", requests, gen_cpus, kind="common",
                             reports=False, triton_model=h.triton_model)
                )  # fmt: skip
            print(
                f"[{n} r{r}] closed {closed[n][-1].qps:.0f} req/s; open p99 {opened[n][-1].quantiles['p99'].fmt('.2f')}"
            )
    print(
        f"\nvariant {Path(a.variant).name}; {a.requests} requests per window; repeats {a.repeats}; files {out}"
    )
    print(
        f"| server | max QPS, {a.users} users closed loop | p50 ms at {a.rate:g} req/s | p99 ms at {a.rate:g} req/s | worst error rate |"
    )
    print("|---|---|---|---|---|")
    for n in names:
        print(_row(n, closed[n], opened[n]))
    print("(* = window invalid: the load generator may have been the bottleneck)")


if __name__ == "__main__":
    main()
