"""The server's own cost per request, beside its model call's: CPU time, not wall time.

    python -m bench.overhead --variant DIR --dataset DATA.pt [--code before=/tmp/old --code after=.]
        [--connections 4] [--seconds 8] [--rounds 2] [--set key=value ...] [--rate 14 --idle-seconds 5]

A real server (reco.serve.process.start_server) on one core, driven closed loop by `--connections`
keep-alive connections from this process on the other core (a raw-socket client, so the generator's own
cost stays off the server's core), or with `--rate R` open loop: Poisson arrivals at R req/s, as the case
study's common load (~14 req/s: one request at a time, the server idle in between), with keep_warm's
spinners on both cores, started by this process as the study starts them (`--companions N`: N more
servers of the same code idle on the server core, as the study's other variants); the measure is the server process's CPU seconds
(/proc schedstat: every thread, ns resolution) over the measured seconds / the requests answered there. The
other helpers on the machine cannot inflate it the way they inflate wall time.

The split of one request's server CPU (from the server's own /metrics, reco_cpu_seconds{stage}, read
before and after the measured seconds): parse (body read, JSON decode, validation: the event loop's
thread), retrieval (candidates), features (model input assembly), rank (the model calls' CPU,
reco_model_cpu_seconds: each call once, where the server exports it), serialize (top-k, JSON body,
Server-Timing, the stage metrics), and the rest = total - those: HTTP parsing, the ASGI/Starlette
layers, the hand-off to the model's thread and back, writing the answer. A server whose code has no stage CPU metrics (an older commit) shows the total and rank only.

In process, before the servers: the per-request bookkeeping's CPU (Prometheus + Server-Timing) and the
model call's hand-off alone (handoff_us: the old executor path, reco's rank threads, the inline call).

Floors on the same stack (uvicorn, uvloop, reco's httptools protocol with serve.http's limits, the
same request bodies): `asgi`, a bare ASGI callable answering a fixed body; `starlette`, a one-route
Starlette app doing the same. Both run in a process this module starts (`python -m bench.overhead
--floor KIND --port P`).

`--with "NAME=key=value;key=value"` adds a server of this checkout with those serve keys on top of `--set`, e.g.
the network off the model's core: `--with split=model_cpu_affinity=[0]` (the event loop on the server
core, the model's thread on the generator's) or `--with "split=cpu_affinity=[0];model_cpu_affinity=[1]"`
(a `cpu_affinity` given there replaces the server core).

`--code NAME=DIR` serves from another checkout (its PYTHONPATH; e.g. `git worktree add /tmp/old
<commit>`), so a change's before and after run side by side, interleaved round by round.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import orjson
import psutil
from scipy import stats

from reco.cli.compose import compose
from reco.loadtest.requests import request_bodies
from reco.loadtest.runner import plan_cpus
from reco.loadtest.scrape import parse_scrape, scrape
from reco.serve.config import serve_config
from reco.serve.keepwarm import start_keep_warm, stop_keep_warm
from reco.serve.process import ServerHandle, free_port, start_server, stop_servers

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ("parse", "retrieval", "features", "rank", "serialize")  # reco_cpu_seconds{stage}
FLOORS = ("asgi", "starlette")


@dataclass
class Load:
    """One measured stretch of closed-loop load on one server."""

    requests: int
    seconds: float
    server_cpu_s: float
    loop_cpu_s: float  # the event loop thread's share
    errors: int
    stage_cpu_s: dict[str, float] = field(default_factory=dict)  # summed over the requests
    rank_on_loop: bool = False  # serve.rank_threads=0: the model calls run on the event loop's thread
    idle_ms_per_s: float | None = None  # server CPU ms per second without requests (timers, wake-ups)

    @property
    def cpu_ms(self) -> float:
        """Server CPU ms per answered request."""
        return self.server_cpu_s / self.requests * 1e3

    @property
    def per_cpu_s(self) -> float:
        """Requests answered per server CPU-second."""
        return self.requests / self.server_cpu_s

    def split_ms(self) -> dict[str, float]:
        """Stage CPU ms per request, and `rest` (total - stages) when every stage was reported."""
        out = {s: v / self.requests * 1e3 for s, v in self.stage_cpu_s.items()}
        loop_ms = self.loop_cpu_s / self.requests * 1e3
        if all(s in out for s in SPLIT):
            out["rest"] = self.cpu_ms - sum(out[s] for s in SPLIT)
            on_loop = [s for s in SPLIT if s != "rank" or self.rank_on_loop]
            out["loop rest"] = loop_ms - sum(out[s] for s in on_loop)
            # inline: the other threads' CPU (no rank thread; the runtime's own, if any)
            out["model thread rest"] = self.cpu_ms - loop_ms - (0.0 if self.rank_on_loop else out["rank"])
        return out


def http_request(path: str, body: bytes) -> bytes:
    """A keep-alive POST as the load generators send it."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def read_response(sock: socket.socket, buf: bytearray) -> int:
    """Read one response (Content-Length framed) off `sock`; `buf` holds bytes already received.
    Returns its status code."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        buf += chunk
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end]).lower()
    status = int(head[9:12])
    at = head.index(b"content-length:") + len(b"content-length:")
    length = int(head[at : head.index(b"\r\n", at)])
    while len(buf) < end + length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        buf += chunk
    del buf[: end + length]
    return status


class Driver:
    """`connections` client threads, each one keep-alive connection. Closed loop (`rate` None): each
    sends the next request as soon as the previous answer is in. Open loop: Poisson arrivals at `rate`
    req/s, each sent at its scheduled time by the first free connection (the case study's common load:
    at ~14 req/s one request at a time, the server idle in between); the request carries the load
    generator's X-Request-Start stamp. Counts answers while `counting` is set."""

    def __init__(self, port: int, requests: list[bytes], connections: int, rate: float | None = None) -> None:
        self.port, self.requests, self.connections, self.rate = port, requests, connections, rate
        self.counting = threading.Event()
        self.stop = threading.Event()
        self.ok = [0] * connections
        self.errors = [0] * connections
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(connections)
        ]
        self._lock = threading.Lock()
        self._next = time.perf_counter()
        self._rng = np.random.default_rng(0)

    def _arrival(self) -> float:
        """The next Poisson arrival's perf_counter time (open loop), taken by the connection that sends it."""
        with self._lock:
            self._next += float(self._rng.exponential(1.0 / self.rate))
            return self._next

    def _send(self, sock: socket.socket, n: int) -> None:
        if self.rate is None:
            sock.sendall(self.requests[n % len(self.requests)])
            return
        at = self._arrival()
        if (wait := at - time.perf_counter()) > 0:
            time.sleep(wait)
        stamp = f"X-Request-Start: t={int(time.time() * 1e6)}\r\n".encode()
        req = self.requests[n % len(self.requests)]
        sock.sendall(req.replace(b"\r\n", b"\r\n" + stamp, 1))

    def _run(self, i: int) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        n = i
        with sock:
            while not self.stop.is_set():
                self._send(sock, n)
                n += self.connections
                status = read_response(sock, buf)
                if self.counting.is_set():
                    if status == 200:
                        self.ok[i] += 1
                    else:
                        self.errors[i] += 1

    def __enter__(self) -> Driver:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def _thread_cpu_s(pid: int, tid: int) -> float:
    """A thread's time on CPU in ns resolution (/proc schedstat: the scheduler's own sum, what
    time.process_time adds up), where psutil's user + system count 10 ms clock ticks: 0 or 20 ms for a
    few seconds of an idle server."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    except (FileNotFoundError, ProcessLookupError):
        return 0.0  # the thread ended between the listing and the read


def server_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of `pid` and its worker processes, every live thread: (all of them, the main thread
    of `pid`: the event loop of a one-process server)."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    total = sum(_thread_cpu_s(p.pid, t.id) for p in procs for t in p.threads())
    return total, _thread_cpu_s(pid, pid)


def stage_cpu_sums(port: int) -> dict[str, float]:
    """reco_cpu_seconds{stage} sums from the server's /metrics ({} when it has none: a floor server)."""
    parsed = parse_scrape(scrape(f"http://127.0.0.1:{port}"))  # once: a pass costs ~50 ms
    sums = {s: h["sum"] for s, h in parsed.histograms.get("reco_cpu_seconds", {}).items()}
    model = parsed.scalars.get("reco_model_cpu_seconds")
    if model is not None:  # each model call once: the rank histogram repeats a batched call's CPU per request
        sums["rank"] = model
    return sums


@dataclass(frozen=True)
class Drive:
    """How a server is driven: closed loop (`rate` None) or open loop at `rate` req/s, over `seconds`
    after 2 s of warm-up; then `idle_s` seconds without requests, the server's idle CPU (its timers)."""

    connections: int
    seconds: float
    rate: float | None = None
    idle_s: float = 0.0


def measure(port: int, pid: int, requests: list[bytes], drive: Drive, cpus, metrics: bool) -> Load:
    """Warm up for 2 s, then `drive.seconds` of load counted against the server's CPU time (and, with
    `metrics`, the server's stage CPU from its /metrics); then the idle seconds."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    with Driver(port, requests, drive.connections, drive.rate) as d:
        time.sleep(2.0)
        stages0, (cpu0, loop0), t0 = (
            stage_cpu_sums(port) if metrics else {},
            server_cpu_s(pid),
            time.perf_counter(),
        )
        d.counting.set()
        time.sleep(drive.seconds)
        d.counting.clear()
        (cpu1, loop1), t1 = server_cpu_s(pid), time.perf_counter()
        ok, errors = sum(d.ok), sum(d.errors)
    stages1 = stage_cpu_sums(port) if metrics else {}
    split = {s: stages1[s] - stages0.get(s, 0.0) for s in stages1}
    load = Load(ok, t1 - t0, cpu1 - cpu0, loop1 - loop0, errors, split)
    if drive.idle_s > 0:
        time.sleep(0.5)  # the last answers and the scrape settle
        c0 = server_cpu_s(pid)[0]
        time.sleep(drive.idle_s)
        load.idle_ms_per_s = (server_cpu_s(pid)[0] - c0) / drive.idle_s * 1e3
    return load


# ---- floors: the same stack answering a fixed body ---------------------------------------------------

FIXED = orjson.dumps({"items": [{"item_id": i, "score": 0.5} for i in range(10)], "model": "floor"})


async def asgi_floor(scope, receive, send) -> None:
    """A bare ASGI app: read the body, answer FIXED."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(FIXED)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": FIXED})


def starlette_floor():
    """A one-route Starlette app: read the body, answer FIXED."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def recommend(request):
        await request.body()
        return Response(FIXED, 200, media_type="application/json")

    return Starlette(routes=[Route("/recommend", recommend, methods=["POST"])])


def serve_floor(kind: str, port: int) -> None:
    """Run a floor server (uvicorn with reco's protocol and options) until SIGTERM."""
    import uvicorn

    from reco.serve.workers import uvicorn_options

    cfg = serve_config(compose().serve)
    app = asgi_floor if kind == "asgi" else starlette_floor()
    uvicorn.run(app, host="127.0.0.1", port=port, **uvicorn_options(cfg))


def start_floor(kind: str, cpus: list[int] | None) -> tuple[subprocess.Popen, int]:
    """A floor server process on a free port, ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.overhead", "--floor", kind, "--port", str(port)]
    if cpus:
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"floor server {kind} did not listen on {port} within 60 s")


def bookkeeping_us(n: int = 20000) -> float:
    """CPU µs per request of the server's per-request bookkeeping, in this process: the Prometheus
    updates a 200 answer makes (stage wall times, the four loop CPU stages and rank CPU, the batch
    figures, the status counter, the in-flight gauges) and its Server-Timing header."""
    from reco.serve.metrics import STAGES, ServeMetrics

    m = ServeMetrics()
    times = {s: 0.0005 * (i + 1) for i, s in enumerate(STAGES)}

    def one() -> str:
        m.inflight.inc()
        m.inflight_max.set(3)
        m.observe(times)
        m.rank_cpu.observe(0.001)
        m.model_cpu.inc(0.001)
        m.batch_rows.observe(500)  # a direct call reports its batch too: one request, its rows
        m.batch_requests.observe(1)
        for h in m.loop_cpu.values():
            h.observe(0.0001)
        m.inflight.dec()
        m.answered(200)
        return ", ".join(f"{s};dur={times[s] * 1000:.3f}" for s in STAGES)

    for _ in range(1000):
        one()
    c = time.thread_time()
    for _ in range(n):
        one()
    return (time.thread_time() - c) / n * 1e6


def handoff_us(n: int = 5000) -> dict[str, float]:
    """CPU µs per model call of the hand-off alone, in this process (uvloop, a scorer that does nothing,
    one call at a time, every thread on one core as the server's): the old path (a ThreadPoolExecutor
    through run_in_executor, awaited under asyncio.wait_for), reco's rank threads (RankThreads under
    asyncio.timeout) and the event loop calling the model itself (InlineRanker, serve.rank_threads=0)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import uvloop

    from reco.serve.batcher import DirectRanker, InlineRanker
    from reco.serve.rank_threads import RankThreads

    block = (np.zeros((1, 1), np.float32), np.zeros((1, 1, 1), np.int64), np.ones((1, 1, 1), np.float32))

    def scorer(dense, ids, mask, sizes=None) -> np.ndarray:
        return np.zeros(len(dense), dtype=np.float32)

    async def per_call(ranker, wait_for: bool) -> float:
        for i in range(n + 500):  # the first 500 warm up
            if i == 500:
                c = time.process_time()
            if wait_for:
                await asyncio.wait_for(ranker.score(*block), 10.0)
            else:
                async with asyncio.timeout(10.0):
                    await ranker.score(*block)
        return (time.process_time() - c) / n * 1e6

    pool, threads = ThreadPoolExecutor(1), RankThreads(1, "rank")
    try:
        return {
            "ThreadPoolExecutor + wait_for": uvloop.run(per_call(DirectRanker(scorer, pool), True)),
            "RankThreads + timeout": uvloop.run(per_call(DirectRanker(scorer, threads), False)),
            "inline (rank_threads=0)": uvloop.run(per_call(InlineRanker(scorer), False)),
        }
    finally:
        pool.shutdown()
        threads.shutdown()


# ---- the study ---------------------------------------------------------------------------------------


def start_reco(
    code: Path, variant: str, dataset: str, settings, cpus, companions: int = 0
) -> tuple[ServerHandle, list[ServerHandle]]:
    """reco's server from the checkout at `code`: its PYTHONPATH and working directory (`python -m` puts
    the working directory first on sys.path) for the server process only; and `companions` more servers
    of the same code on the same cores, left idle (the case study serves every variant side by side on
    the server core: their timers and wake-ups run between the measured server's requests)."""
    old, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = str(code.resolve())
    os.chdir(code)
    try:
        args = (Path(variant).resolve(), Path(dataset).resolve(), settings)
        started = [start_server(*args, cpus=cpus, wait=False) for _ in range(1 + companions)]
        try:
            for h in started:
                h.wait_ready()
        except BaseException:
            stop_servers(started)
            raise
        return started[0], started[1:]
    finally:
        os.chdir(cwd)
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


def row(name: str, load: Load) -> str:
    split = load.split_ms()
    cells = [
        f"{split[s]:.3f}" if s in split else "–" for s in (*SPLIT, "rest", "loop rest", "model thread rest")
    ]
    ratio = f"{load.cpu_ms / split['rank']:.2f}" if split.get("rank") else "–"
    idle = "–" if load.idle_ms_per_s is None else f"{load.idle_ms_per_s:.2f}"
    return (
        f"| {name} | {load.requests} | {load.requests / load.seconds:.1f} | {load.cpu_ms:.3f} | "
        f"{load.per_cpu_s:.0f} | {' | '.join(cells)} | {ratio} | {idle} | {load.errors} |"
    )


HEADER = (
    "| server | requests | req/s | CPU ms / request | requests / CPU-s | parse | retrieval | features | "
    "rank (model) | serialize | rest | rest: event loop thread (HTTP, ASGI, hand-off) | rest: model "
    "thread (hand-off, GIL) | CPU / model CPU | idle CPU ms / s | errors |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def paired(ratios: list[float]) -> str:
    """Geometric mean of per-round ratios with a 95 % Student t interval over their logs."""
    logs = np.log(ratios)
    mid = float(np.exp(logs.mean()))
    if len(logs) < 2:
        return f"{mid:.3f} (1 round)"
    half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs))
    return f"{mid:.3f} [{np.exp(logs.mean() - half):.3f}, {np.exp(logs.mean() + half):.3f}]"


def summary(loads: dict[str, list[Load]], codes: list[str]) -> str:
    """Each reco server against the first, paired round by round (the load from other processes on the
    machine changes between rounds and inflates every CPU figure of a round alike): the ratio of CPU per
    request and of the non-model CPU per request (total - the model call's), n rounds, 95 % intervals;
    and the median CPU / model CPU of each."""
    if not codes:
        return ""
    first = codes[0]
    lines = [
        "",
        f"| server | rounds | CPU / request vs {first} | non-model CPU / request vs {first} | "
        "median CPU / model CPU | median requests / CPU-s |",
        "|---|---|---|---|---|---|",
    ]
    for name in codes:
        a, b = loads[first], loads[name]

        def non_model(x: Load) -> float:
            return x.cpu_ms - x.stage_cpu_s["rank"] / x.requests * 1e3

        ratio = np.median([x.cpu_ms / (x.stage_cpu_s["rank"] / x.requests * 1e3) for x in b])
        lines.append(
            f"| {name} | {len(b)} | {paired([y.cpu_ms / x.cpu_ms for x, y in zip(a, b, strict=True)])} | "
            f"{paired([non_model(y) / non_model(x) for x, y in zip(a, b, strict=True)])} | {ratio:.2f} | "
            f"{np.median([x.per_cpu_s for x in b]):.0f} |"
        )
    return "\n".join(lines)


def warm_default(args) -> bool:
    """--keep-warm as given, else on for the open loop (the case study's common load) only."""
    return args.rate is not None if args.keep_warm is None else args.keep_warm


def run_one(name: str, args, code: Path | None, bodies: list[bytes], cpus, extra: list[str]) -> Load:
    """One server measured. keep_warm's spinners (default: on with --rate; `--with NAME=keep_warm=...`
    per server) are started here, as the case study starts them, never by the server: its spinners are its
    children, whose CPU server_cpu_s would count as the server's."""
    server_cpus, gen_cpus = cpus
    drive = Drive(args.connections, args.seconds, args.rate, args.idle_seconds)
    keys = [f"keep_warm={str(warm_default(args)).lower()}", *args.set, *extra]
    settings = serve_config(compose([f"serve.{o}" for o in keys]).serve)
    spinners = (
        start_keep_warm(sorted({*(server_cpus or []), *(gen_cpus or [])})) if settings.keep_warm else []
    )
    try:
        if code is None:
            return measure_floor(name, server_cpus, bodies, drive, gen_cpus)
        placed = any(o.startswith("cpu_affinity=") for o in extra)  # its own server cores, not the plan's
        h, idle = start_reco(
            code,
            args.variant,
            args.dataset,
            replace(settings, keep_warm=False),
            None if placed else server_cpus,
            args.companions,
        )
        try:
            load = measure(int(h.url.rsplit(":", 1)[1]), h.pid, bodies, drive, gen_cpus, True)
            load.rank_on_loop = settings.rank_threads == 0
            return load
        finally:
            stop_servers([h, *idle])
    finally:
        stop_keep_warm(spinners)


def measure_floor(kind: str, server_cpus, bodies: list[bytes], drive: Drive, gen_cpus) -> Load:
    proc, port = start_floor(kind, server_cpus)
    try:
        return measure(port, proc.pid, bodies, drive, gen_cpus, False)
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant")
    ap.add_argument("--dataset")
    ap.add_argument("--code", action="append", default=[], help="NAME=DIR: serve from that checkout")
    ap.add_argument("--floors", default=",".join(FLOORS), help="floor servers to run (comma list, or '')")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument(
        "--rate", type=float, help="open loop: Poisson arrivals at this many req/s (default: closed loop)"
    )
    ap.add_argument(
        "--keep-warm",
        action=argparse.BooleanOptionalAction,
        help="SCHED_IDLE spinners on the server's and the client's cores, started by this process as the "
        "case study starts them (their CPU is not the server's); default: on with --rate; per server: "
        "--with NAME=keep_warm=false",
    )
    ap.add_argument(
        "--companions", type=int, default=0, help="idle servers of the same code beside each measured one"
    )
    ap.add_argument(
        "--idle-seconds", type=float, default=0.0, help="after each load: the server's CPU this long idle"
    )
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2000, help="distinct request bodies replayed")
    ap.add_argument("--set", action="append", default=[], help="serve key=value for reco's servers")
    ap.add_argument(
        "--with",
        dest="with_",
        action="append",
        default=[],
        help="NAME=key=value;key=value: a server of this checkout with these serve keys too",
    )
    ap.add_argument("--floor", choices=FLOORS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.floor:
        serve_floor(args.floor, args.port)
        return
    if not (args.variant and args.dataset):
        ap.error("--variant and --dataset are required")
    from reco.data.schema import Dataset

    ds = Dataset.load(args.dataset)
    bodies = [http_request("/recommend", orjson.dumps(b)) for b in request_bodies(ds, args.requests, 10, 0)]
    codes = dict(c.split("=", 1) for c in args.code) or {"reco": str(ROOT)}
    runs: list[tuple[str, Path | None]] = [(n, Path(d)) for n, d in codes.items()]
    extras = {n: [] for n in codes}
    for w in args.with_:
        name, keys = w.split("=", 1)
        runs.append((name, ROOT))
        extras[name] = keys.split(";")
    runs += [(f, None) for f in args.floors.split(",") if f]
    cpus = plan_cpus()
    load = "closed loop" if args.rate is None else f"open loop, Poisson {args.rate:g} req/s"
    warm = warm_default(args)
    print(
        f"# {len(bodies)} bodies, {args.connections} connections, {load}, {args.seconds:g} s per run, "
        f"cores {cpus}, keep_warm {'on' if warm else 'off'}"
    )
    print(
        f"# per-request bookkeeping (Prometheus + Server-Timing), in process: {bookkeeping_us():.1f} µs CPU"
    )
    mine = os.sched_getaffinity(0)
    if cpus[0]:
        os.sched_setaffinity(0, cpus[0])  # the hand-off measured on one core, as in the server
    hand = ", ".join(f"{k} {v:.1f}" for k, v in handoff_us().items())
    print(f"# model call hand-off alone, in process (µs CPU per call): {hand}")
    os.sched_setaffinity(0, mine)
    print(HEADER)
    loads: dict[str, list[Load]] = {name: [] for name, _ in runs}
    for r in range(args.rounds):
        for name, code in runs:
            load = run_one(name, args, code, bodies, cpus, extras.get(name, []))
            loads[name].append(load)
            print(row(f"{name} (round {r + 1})", load), flush=True)
    print(summary(loads, [n for n, c in runs if c is not None]))


if __name__ == "__main__":
    main()
