"""How much load the generator itself can make: Locust as one process vs Locust master + workers, and
its percentiles vs wrk's, against a trivial endpoint on 127.0.0.1 (a benchmark, not a test).

    python -m bench.generator_bench [--workers 2] [--connections 32] [--seconds 10]
        [--parity-connections 4] [--parity-delay-ms 5] [--repeats 3]

The endpoint is a minimal asyncio (uvloop) HTTP/1.1 server in its own process answering every POST with
a fixed small JSON body, so the generator and not the server is the bottleneck as long as the server
has a core. Two parts, each repeated and printed as a Markdown table:

  max rate   closed loop, --connections users/connections for --seconds: Locust as one process (on the
             generator core of plan_cpus), Locust with --workers workers (one core each when cores allow,
             else spread over every core, sharing the server's), and wrk on the generator core. Locust's
             figures are reco's exact per-request records (run_load), wrk's its own summary.
  parity     both generators closed loop with --parity-connections connections against the endpoint
             delaying each answer by --parity-delay-ms (asyncio.sleep), a load neither saturates on:
             p50 / p90 / p99 of Locust (one process) vs wrk's --latency distribution.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.crosscheck import wrk_run
from reco.cli.compose import compose
from reco.loadtest.config import LoadMode, loadtest_config
from reco.loadtest.runner import free_port, plan_cpus, run_load, with_settings

ANSWER = b'{"items":[],"model":"trivial"}'
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(ANSWER)).encode()
    + b"\r\n\r\n"
    + ANSWER
)


NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


class _Trivial(asyncio.Protocol):
    """Keep-alive HTTP/1.1: every complete POST (headers + Content-Length body) gets RESPONSE, anything
    else (the runner's GET /metrics) a 404."""

    delay_s = 0.0

    def connection_made(self, transport) -> None:
        self.t, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            m = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", self.buf[:end])
            size = end + 4 + (int(m.group(1)) if m else 0)
            if len(self.buf) < size:
                return
            post, self.buf = self.buf.startswith(b"POST"), self.buf[size:]
            if not post:
                self.t.write(NOT_FOUND)
            elif self.delay_s:
                asyncio.get_running_loop().call_later(self.delay_s, self._answer)
            else:
                self.t.write(RESPONSE)

    def _answer(self) -> None:
        if not self.t.is_closing():
            self.t.write(RESPONSE)


def serve(port: int, delay_ms: float) -> None:
    """Run the trivial endpoint on 127.0.0.1:`port` until killed."""
    import uvloop

    _Trivial.delay_s = delay_ms / 1000.0

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Trivial, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


class _Endpoint:
    """The trivial endpoint as a child process pinned to `cpus`."""

    def __init__(self, delay_ms: float, cpus: list[int] | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", __spec__.name, "--serve", str(self.port), "--delay-ms", str(delay_ms)]
        if cpus:
            cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        deadline = time.time() + 30
        while True:
            try:
                req = urllib.request.Request(self.url + "/recommend", data=b"{}", method="POST")
                urllib.request.urlopen(req, timeout=1).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.close()
                    raise SystemExit(f"the trivial endpoint did not start on {self.url}") from None
                time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> _Endpoint:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def _row(name: str, conns: int, cpus: list[int] | None, n: int, qps: float, pcts: dict, note: str) -> str:
    fmt = " | ".join(f"{pcts[k]:.3f}" if k in pcts else "–" for k in ("p50", "p90", "p99"))
    on = ",".join(map(str, cpus)) if cpus else "any"
    return f"| {name} | {conns} | {on} | {n:,} | {qps:,.0f} | {fmt} | {note} |"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="Locust workers of the distributed runs")
    ap.add_argument("--connections", type=int, default=32, help="max rate: closed-loop users / connections")
    ap.add_argument("--seconds", type=int, default=10, help="measured window of every run")
    ap.add_argument("--parity-connections", type=int, default=4)
    ap.add_argument("--parity-delay-ms", type=float, default=5.0, help="endpoint delay of the parity part")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every run")
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)  # internal: be the endpoint
    ap.add_argument("--delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.delay_ms)
        return
    server_cpus, gen_cpus = plan_cpus()
    cores = sorted(os.sched_getaffinity(0))
    # Workers on cores of their own while the server keeps one; else spread over every core.
    wk_cpus = cores[: args.workers] if len(cores) > args.workers else cores
    work = Path(tempfile.mkdtemp(prefix="reco-genbench-"))
    requests = work / "requests.jsonl"
    requests.write_text("".join(f'{{"user_id":{i % 1000 + 1},"k":10}}\n' for i in range(2000)))
    lt = with_settings(
        loadtest_config(compose().loadtest), mode=LoadMode.closed, window_requests=None, duration_s=float(args.seconds),
        warmup_s=2.0, drain_s=2.0,
    )  # fmt: skip
    # Other work on the machine moves these figures: the load average goes with them.
    print(f"cores {cores}; endpoint on {server_cpus or 'any'}; load average {os.getloadavg()}; {work}\n")
    head = "| generator | conns | cpus | n | req/s | p50 ms | p90 ms | p99 ms | note |\n|---|---|---|---|---|---|---|---|---|"
    rates: dict[str, list[float]] = {"one": [], "workers": [], "wrk": []}
    saturated: list[bool] = []  # the one process was CPU-bound (else other work starved it: not its max)
    print(
        f"max rate, trivial endpoint (closed loop, {args.connections} connections, {args.seconds} s each)\n"
    )
    print(head)
    with _Endpoint(0.0, server_cpus) as ep:
        for r in range(args.repeats):
            one = run_load(ep.url, with_settings(lt, users=args.connections), work / f"one{r}", requests,
                           gen_cpus, kind="bench", reports=False)  # fmt: skip
            rates["one"].append(one.qps)
            saturated.append(one.loadgen_cpu_pct >= lt.loadgen.max_cpu_pct)
            q = {k: e.value for k, e in one.quantiles.items() if e.value is not None}
            print(_row("Locust, 1 process", args.connections, gen_cpus, one.n, one.qps, q,
                       f"r{r}; CPU {one.loadgen_cpu_pct:.0f}%; valid={int(one.valid)}"))  # fmt: skip
            dist = run_load(ep.url, with_settings(lt, users=args.connections, workers=args.workers),
                            work / f"workers{r}", requests, wk_cpus, kind="bench", reports=False)  # fmt: skip
            rates["workers"].append(dist.qps)
            q = {k: e.value for k, e in dist.quantiles.items() if e.value is not None}
            print(_row(f"Locust, {args.workers} workers", args.connections, wk_cpus, dist.n, dist.qps, q,
                       f"r{r}; max CPU {dist.loadgen_cpu_pct:.0f}%; valid={int(dist.valid)}"))  # fmt: skip
            w = wrk_run(ep.url, requests, args.connections, args.seconds, gen_cpus)
            rates["wrk"].append(w.qps)
            print(_row("wrk -t1", args.connections, gen_cpus, w.n, w.qps, w.percentiles_ms, f"r{r}"))
    ratios = [b / a for a, b in zip(rates["one"], rates["workers"], strict=True)]
    fair = sorted(x for x, sat in zip(ratios, saturated, strict=True) if sat)
    print(f"\n{args.workers} workers / 1 process, per repeat: " + ", ".join(f"{x:.2f}x" for x in ratios)
          + f"; load average {os.getloadavg()}")  # fmt: skip
    if fair:
        med = fair[len(fair) // 2]
        print(f"over the {len(fair)} repeat(s) whose one process was CPU-bound (>= "
              f"{lt.loadgen.max_cpu_pct:g}%): median {med:.2f}x (target >= 1.6x: {'MET' if med >= 1.6 else 'MISSED'})")  # fmt: skip
    else:
        print(
            "no repeat had the one process CPU-bound: other work starved it, so no ratio is a max-rate ratio"
        )

    print(
        f"\npercentile parity: closed loop, {args.parity_connections} connections, endpoint delay "
        f"{args.parity_delay_ms:g} ms, {args.seconds} s each\n"
    )
    print(head)
    worst = 0.0
    with _Endpoint(args.parity_delay_ms, server_cpus) as ep:
        for r in range(args.repeats):
            loc = run_load(ep.url, with_settings(lt, users=args.parity_connections), work / f"parity{r}",
                           requests, gen_cpus, kind="bench", reports=False)  # fmt: skip
            q = {k: e.value for k, e in loc.quantiles.items() if e.value is not None}
            w = wrk_run(ep.url, requests, args.parity_connections, args.seconds, gen_cpus)
            diffs = {k: q[k] / w.percentiles_ms[k] - 1 for k in ("p50", "p90", "p99") if k in q}
            worst = max([worst, *map(abs, diffs.values())])
            note = "Locust vs wrk " + ", ".join(f"{k} {v:+.1%}" for k, v in diffs.items())
            print(_row("Locust, 1 process", args.parity_connections, gen_cpus, loc.n, loc.qps, q, f"r{r}"))
            print(
                _row(
                    "wrk -t1",
                    args.parity_connections,
                    gen_cpus,
                    w.n,
                    w.qps,
                    w.percentiles_ms,
                    f"r{r}; {note}",
                )
            )
    print(f"\nlargest percentile gap {worst:.1%} (target within 10%: {'MET' if worst <= 0.10 else 'MISSED'})")


if __name__ == "__main__":
    main()
