"""The time outside the handler, split: what the load generator adds and what the server adds.

    python -m bench.outside --variant DIR --dataset DATA.pt [--rate 14] [--seconds 30] [--rounds 5]
    (make outside VARIANT=... DATASET=... installs Debian's wrk first)

The case study's *outside the handler* is the client's e2e mean minus the server's handler total mean
(reco.report.metrics.outside_handler): accept, HTTP parsing, the event loop's backlog, writing the body,
loopback TCP, and the load generator's own time between its clock and its socket. Here one reco server
(the study's serve settings, on the server core, keep_warm's spinners on both cores as the study starts
them) answers the same light load from three clients in turn, each round in a random order:

  locust  reco's load generator as the study runs it (reco.loadtest.runner.run_load, open loop, Poisson)
  wrk     Debian's wrk (C, epoll), one connection, exponential think time (loadtest/wrk_requests.lua)
  socket  a raw-socket Python client in this process, one connection, the same think time

At a few percent utilisation all three give the server one request at a time with idle gaps, the
common load's shape. Each window's handler total comes from the server's own /metrics read before and
after it (reco.loadtest.scrape.stage_summary: the exact sum over the same requests), so each client's
outside = its e2e mean - the server's total mean. wrk's outside is the server's (plus wrk's few µs and
the loopback); the generator's share = locust's outside - wrk's, paired round by round (the machine's
other load moves every figure of a round together), 95 % Student t over the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats

from bench.crosscheck import wrk_run
from bench.overhead import http_request, read_response
from reco.cli.compose import compose
from reco.loadtest.config import LoadMode, LoadtestConfig, loadtest_config
from reco.loadtest.requests import write_requests
from reco.loadtest.runner import plan_cpus, run_load, with_settings
from reco.loadtest.scrape import scrape, stage_summary
from reco.serve.config import serve_config
from reco.serve.keepwarm import start_keep_warm, stop_keep_warm
from reco.serve.process import start_server

CLIENTS = ("locust", "wrk", "socket")


@dataclass(frozen=True)
class Window:
    """One client's measured window: its e2e mean and the server's handler total mean over it (ms)."""

    client: str
    n: int
    e2e_mean_ms: float
    server_total_mean_ms: float

    @property
    def outside_ms(self) -> float:
        return self.e2e_mean_ms - self.server_total_mean_ms


def server_total(before: str, after: str) -> float:
    """The handler total's mean (ms) over the requests answered between two /metrics scrapes."""
    st = stage_summary(before, after)
    if "server_total_mean_ms" not in st:
        raise SystemExit("the server's /metrics had no reco_stage_seconds{stage=total} over the window")
    return st["server_total_mean_ms"]


def socket_window(
    port: int, bodies: list[bytes], seconds: float, think_ms: float, seed: int
) -> tuple[float, int]:
    """One keep-alive connection from this process: send, read the whole answer, think; (mean ms, n)."""
    rng = np.random.default_rng(seed)
    took: list[float] = []
    buf = bytearray()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        end = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            sock.sendall(bodies[i % len(bodies)])
            if read_response(sock, buf) != 200:
                raise SystemExit("the server answered a request with an error")
            took.append(time.perf_counter() - t0)
            i += 1
            time.sleep(float(rng.exponential(think_ms / 1e3)))
    return float(np.mean(took)) * 1e3, len(took)


Cores = tuple[list[int] | None, list[int] | None]  # (server's, generator's): reco.loadtest.runner.plan_cpus


def measure(
    client: str,
    url: str,
    lt: LoadtestConfig,
    requests: Path,
    bodies: list[bytes],
    args: argparse.Namespace,
    cpus: Cores,
    seed: int,
) -> Window:
    """One window of `client` at the light load, with its warm-up; the server's total from /metrics."""
    gen = cpus[1]
    think_ms = 1000.0 / args.rate
    port = int(url.rsplit(":", 1)[1])
    if client == "locust":  # run_load reads /metrics around its own window (warm-up excluded)
        n = max(round(args.rate * args.seconds), 1)
        s = with_settings(lt, mode=LoadMode.open, rate=args.rate, window_requests=n)
        run = run_load(url, s, args.work / f"locust_{seed}", requests, gen, kind="common", reports=False)
        st = run.server_stages
        return Window(client, run.n, run.mean_ms, st["server_total_mean_ms"])
    mine = os.sched_getaffinity(0)
    if gen:
        os.sched_setaffinity(0, gen)
    try:
        if client == "wrk":  # wrk counts whole seconds
            wrk_run(url, requests, 1, max(round(lt.warmup_s), 1), gen, think_ms=think_ms)
            before = scrape(url)
            w = wrk_run(url, requests, 1, max(round(args.seconds), 1), gen, think_ms=think_ms)
            mean, n = w.mean_ms, w.n
        else:
            socket_window(port, bodies, lt.warmup_s, think_ms, seed + 1000)
            before = scrape(url)
            mean, n = socket_window(port, bodies, args.seconds, think_ms, seed)
        after = scrape(url)
    finally:
        os.sched_setaffinity(0, mine)
    return Window(client, n, mean, server_total(before, after))


def paired_ms(diffs: list[float]) -> str:
    """Mean of per-round differences (ms) with a 95 % Student t interval over the rounds."""
    d = np.asarray(diffs)
    if len(d) < 2:
        return f"{d.mean():.3f} (1 round)"
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    return f"{d.mean():.3f} [{d.mean() - half:.3f}, {d.mean() + half:.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--variant", required=True, help="a built variant directory (.cache/variants/<name>-<key>)"
    )
    ap.add_argument("--dataset", required=True, help="its dataset (.cache/data/<name>-<key>.pt)")
    ap.add_argument(
        "--rate", type=float, default=14.0, help="req/s of every client (the common load's order)"
    )
    ap.add_argument("--seconds", type=float, default=30.0, help="measured seconds per window")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], help="serve key=value on top of conf/serve")
    args = ap.parse_args()
    if args.rounds < 1 or args.seconds < 1 or not args.rate > 0:
        ap.error("--rounds and --seconds must be >= 1 and --rate > 0")
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install wrk (Debian), or run `make outside`")
    args.work = Path(tempfile.mkdtemp(prefix="reco-outside-"))
    from reco.data.schema import Dataset

    ds = Dataset.load(args.dataset)
    requests = write_requests(ds, args.work / "requests.jsonl", n=2000, k=10, seed=0)
    bodies = [http_request("/recommend", line.encode()) for line in requests.read_text().splitlines()]
    cfg = compose([f"serve.{o}" for o in args.set])
    lt = loadtest_config(cfg.loadtest)
    settings = serve_config(cfg.serve)
    cpus = plan_cpus()
    spinners = start_keep_warm(sorted({*(cpus[0] or []), *(cpus[1] or [])})) if settings.keep_warm else []
    print(
        f"# {args.rate:g} req/s, {args.seconds:g} s windows, {args.rounds} rounds, cores {cpus}, "
        f"keep_warm {'on' if settings.keep_warm else 'off'}, variant {Path(args.variant).name}"
    )
    print(
        "| round | client | n | e2e mean ms | server total mean ms | outside ms |\n|---|---|---|---|---|---|"
    )
    windows: dict[str, list[Window]] = {c: [] for c in CLIENTS}
    rng = random.Random(0)
    try:
        # the spinners are this process's, as the study's are: a server-started one would be its child
        served = dataclasses.replace(settings, keep_warm=False)
        with start_server(args.variant, args.dataset, served, cpus=cpus[0], work_dir=args.work) as server:
            for r in range(args.rounds):
                order = list(CLIENTS)
                rng.shuffle(order)
                for c in order:
                    w = measure(c, server.url, lt, requests, bodies, args, cpus, seed=r)
                    windows[c].append(w)
                    print(
                        f"| {r + 1} | {c} | {w.n} | {w.e2e_mean_ms:.3f} | {w.server_total_mean_ms:.3f} | "
                        f"{w.outside_ms:.3f} |",
                        flush=True,
                    )
    finally:
        stop_keep_warm(spinners)
    print("\n| client | median outside ms | outside − wrk's, paired [95 % CI] |\n|---|---|---|")
    for c in CLIENTS:
        diff = [a.outside_ms - b.outside_ms for a, b in zip(windows[c], windows["wrk"], strict=True)]
        vs = "0 (reference)" if c == "wrk" else paired_ms(diff)
        print(f"| {c} | {np.median([w.outside_ms for w in windows[c]]):.3f} | {vs} |")


if __name__ == "__main__":
    main()
