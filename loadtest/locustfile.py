"""Locust user for the reco service; runs on its own with Locust's web UI or headless.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --web-host 127.0.0.1 --requests-file requests.jsonl
    locust -f loadtest/locustfile.py --host ... --headless -u 1 -t 60s --load-mode open --rate 200 --window-requests 1000

(--web-host 127.0.0.1 keeps Locust's web UI on loopback; it listens on every interface by default.)

Two load models:
  closed  each Locust user sends a request, waits for the answer (and --think-time-s), repeats.
  open    Poisson arrivals at --rate requests/s in total (split evenly across users; a sum of Poisson
          processes is Poisson), each sent from its own greenlet whatever is still outstanding, as
          MLPerf's Server scenario. Latency is measured from each request's SCHEDULED send time (or
          its actual send, when the timer let it go up to WAKE_EARLY_S before its schedule), so a
          queue in the server or in the generator (coordinated omission) shows up in the percentiles.

The measured window starts after --warmup-s and ends after --window-requests requests (open loop: that
many scheduled arrivals, so every variant is judged on the same n whatever its speed; closed loop: that
many sent), or after --duration-s when --window-requests is 0 (with a count, --duration-s caps the
window). Which requests belong to the window is decided when each is sent. When the window closes the
generator stops sending, waits up to --drain-s for the window's outstanding requests (those still
unanswered then count as failed) and stops the test itself.

Every request's latency is recorded exactly (float ms, not Locust's rounded buckets) through the request
event hook and written at test stop to --latency-file as CSV `start_s,latency_ms,ok,status` (start_s
relative to the test start; a row with status -1 is an arrival the generator could not send because
--max-inflight requests were outstanding). Beside it: `<file>.started` (the test-start epoch time,
written at test start), `<file>.window_end` (epoch time the window closed; the runner aligns its
/metrics scrapes and CPU samples to these), `<file>.summary.json` (counts, unanswered requests, open-loop
schedule lag) and, with --score-every N, `<file>.scores.jsonl`: the items and scores returned for every
Nth request of the window, with the index of its body in --requests-file (the study checks them against
the variant's offline scores).

Every request carries `X-Request-Start: t=<epoch microseconds>` (the Heroku / New Relic convention): the
time it was scheduled to be sent (open loop) or sent (closed loop), the origin its latency is timed from.
A server with serve.max_wait_ms sheds requests already older than that (reco/serve/admission.py), so
time lost in the generator, the network or the accept backlog counts against their budget too.

Requests come from --requests-file (JSON lines of /recommend bodies, see reco.loadtest.requests); without
one, random user ids in [1, --random-users] with k=10 and no context.

With --triton-model NAME (serve.backend=triton, reco/serve/triton_backend.py) every body is sent in Triton's
HTTP/REST (KServe v2) protocol instead: POST /v2/models/NAME/infer with the body as the one element of the
BYTES input "request"; an answer whose "response" holds an error counts as failed with the status in it.

Distributed (--master / --worker, reco.loadtest.distributed; a worker's share: reco.loadtest.records):
the master only dispatches users and ends the test; each worker is one Poisson scheduler at
--rate / (users x workers) per user (open loop; the superposition of independent Poisson processes is
Poisson at --rate), owns its share of
--window-requests and writes its own record, named by its worker index, beside --latency-file
(`latencies.w<i>.csv`, ...; its summary adds its CPU over its window). When it has drained, it tells
the master ("reco_done"); once all --expect-workers have, the master quits. A worker lost before then
ends the test with an error (and `<latency file>.failed`): the window is not valid.

Request-interleaved (--targets, reco.loadtest.interleave): one closed-loop user sends to several
servers in one window, in cycles -- each cycle every server once, in a fresh seeded random order -- so a
slow stretch of the host lands on all of them alike. The window is whole cycles (a cycle's first request
decides whether the cycle is in it), --window-requests per server; each server gets the request bodies
a window of its own would send (its own stream, seeded as the one user's) and its own record (latency
file, summary, scores) at the path --targets names for it; --latency-file is the first server's (its
`.started` and `.window_end` are the window's, its summary is written last).

Web UI: a "reco" tab shows the exact end-to-end percentiles of the running test with their 95 % CIs
and n (reco.stats; failures count as +inf) and the server's per-stage times scraped from its /metrics
since the test started (reco.loadtest.scrape, the runner's reader too) -- the figures the study
records. Two routes serve a driver that keeps this process running across tests
(reco.loadtest.locust_pool; each test a POST /swarm with its options):
GET /reco/state (the runner's state, read now) and POST /reco/reports (Locust's CSV/HTML/JSON reports of
the stopped test, written beside its --latency-file).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import gevent
from locust import FastHttpUser, events, task
from locust.runners import STATE_MISSING, MasterRunner, WorkerRunner

from reco.loadtest.records import lag_p99, window_share, worker_file
from reco.loadtest.scrape import scrape, stage_summary

JSON_HEADERS = {"Content-Type": "application/json"}


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    g = parser.add_argument_group("reco")
    g.add_argument("--requests-file", env_var="RECO_REQUESTS", default="", help="JSONL of /recommend bodies")
    g.add_argument(
        "--load-mode",
        env_var="RECO_LOAD_MODE",
        default="closed",
        choices=["closed", "open"],
        help="load model",
    )
    g.add_argument(
        "--rate", env_var="RECO_RATE", type=float, default=50.0, help="open loop: arrivals/s in total"
    )
    g.add_argument("--warmup-s", env_var="RECO_WARMUP_S", type=float, default=0.0, help="not recorded")
    g.add_argument(
        "--duration-s",
        env_var="RECO_DURATION_S",
        type=float,
        default=0.0,
        help="measured window after the warm-up (0: until stopped); with --window-requests its cap",
    )
    g.add_argument(
        "--window-requests",
        env_var="RECO_WINDOW_REQUESTS",
        type=int,
        default=0,
        help="the window ends after this many requests (0: after --duration-s)",
    )
    g.add_argument(
        "--drain-s", env_var="RECO_DRAIN_S", type=float, default=2.0, help="wait for outstanding requests"
    )
    g.add_argument(
        "--latency-file", env_var="RECO_LATENCY_FILE", default="reco_latencies.csv", help="per-request CSV"
    )
    g.add_argument(
        "--max-inflight", env_var="RECO_MAX_INFLIGHT", type=int, default=512, help="open loop, per user"
    )
    g.add_argument("--think-time-s", env_var="RECO_THINK_TIME_S", type=float, default=0.0, help="closed loop")
    g.add_argument(
        "--score-every", env_var="RECO_SCORE_EVERY", type=int, default=0, help="record every Nth response"
    )
    g.add_argument(
        "--random-users", env_var="RECO_RANDOM_USERS", type=int, default=1000, help="fallback users"
    )
    g.add_argument("--seed", env_var="RECO_SEED", type=int, default=0)
    g.add_argument(
        "--triton-model",
        env_var="RECO_TRITON_MODEL",
        default="",
        help="speak KServe v2 to this Triton model (serve.backend=triton); empty: POST /recommend",
    )
    g.add_argument(
        "--targets",
        env_var="RECO_TARGETS",
        default="",
        help='JSON {"seed": int, "targets": [{"url", "latency_file", "triton_model"}, ...]}: one closed-loop '
        "window over these servers, in cycles (reco.loadtest.interleave); empty: --host alone",
    )


class Recorder:
    """Exact per-request record of the current test (module-level: one per Locust process)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.t0_epoch = time.time()
        self.t0_perf = time.perf_counter()
        self.rows: list[tuple[float, float, int, int]] = []  # window only: start_s, latency_ms, ok, status
        self.all_rows: list[tuple[float, int]] = []  # every request of the test: latency_ms, ok (web UI)
        self.n_all = 0  # every answered request, warm-up and drain included
        self.lags_ms: list[float] = []  # open loop: actual send - scheduled send, in the window
        self.n_window = 0  # requests assigned to the window (sent or not)
        self.window_closed = False
        self.window_end_epoch: float | None = None
        self.outstanding: dict[int, bool] = {}  # token -> in the window; sent, not yet answered
        self.target_of: dict[int, int] = {}  # token -> its server's index in TARGETS (--targets only)
        self.scores: list[dict] = []
        self.tokens = itertools.count()
        self.window_requests = 0  # this process's share of --window-requests (0: window by duration)
        self.n_workers = 1  # processes sharing the load (--expect-workers on a Locust worker)
        self.index = -1  # Locust worker index (-1: not a worker)
        self.path = ""  # where this process writes its record
        self.written = False
        self.cpu0 = self.cpu1 = (_cpu_s(), self.t0_perf)  # (CPU s, perf s) at the window's open / close

    def assign(self, now_perf: float, opts) -> bool:
        """Whether a request sent (open loop: scheduled) at `now_perf` belongs to the window; counts it."""
        if self.window_closed:
            return False
        rel = now_perf - self.t0_perf
        if rel < opts.warmup_s:
            return False
        if opts.duration_s > 0 and rel >= opts.warmup_s + opts.duration_s:
            self.close_window()
            return False
        self.n_window += 1
        if self.window_requests > 0 and self.n_window >= self.window_requests:
            self.close_window()
        return True

    def register(self, in_window: bool, target: int | None = None) -> int:
        """A new outstanding request's token (`target`: its index in TARGETS, in a multi-server window)."""
        token = next(self.tokens)
        self.outstanding[token] = in_window
        if target is not None:
            self.target_of[token] = target
        return token

    def close_window(self) -> None:
        if not self.window_closed:
            self.window_closed = True
            self.window_end_epoch = time.time()
            self.cpu1 = (_cpu_s(), time.perf_counter())

    def cpu_pct(self) -> float:
        """This process's CPU over the window, % of one core (every thread: gevent's and ZeroMQ's)."""
        return 100.0 * (self.cpu1[0] - self.cpu0[0]) / max(self.cpu1[1] - self.cpu0[1], 1e-9)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class Target:
    """One server of a request-interleaved window (--targets): where its requests go and its own record."""

    url: str  # absolute URL of its request path (/recommend, or its Triton model's infer)
    payloads: list[bytes]  # the request file's bodies, as this server's protocol wants them
    triton: bool
    latency_file: str
    rows: list[tuple[float, float, int, int]] = field(default_factory=list)  # as Recorder.rows
    scores: list[dict] = field(default_factory=list)
    n_all: int = 0  # its answered requests, warm-up included
    n_window: int = 0  # its requests assigned to the window


REC = Recorder()
TARGETS: list[Target] = []  # --targets of the current test (empty: --host alone)
CYCLE_RNG = [random.Random(0)]  # the order of each cycle over TARGETS
TRITON_PAYLOADS: dict[str, list[bytes]] = {}  # Triton model -> PAYLOADS as its infer requests
PAYLOADS: list[bytes] = []
PATH = ["/recommend"]  # where bodies go (a Triton model's infer endpoint with --triton-model)
USER_SEQ = [0]  # users draw payloads from their own seeded stream (reproducible request mix)
METRICS_AT_START = [""]  # the server's /metrics when the test started (web UI: stage times since then)
DONE: set[int] = set()  # master: indices of the workers whose window has drained ("reco_done")


@events.init.add_listener
def _init(environment, **_kw) -> None:
    o = environment.parsed_options
    if o is None:
        return
    rng = random.Random(o.seed)
    if o.requests_file:
        path = Path(o.requests_file)
        if not path.exists():
            raise SystemExit(
                f"--requests-file {path}: file not found (write one with reco.loadtest.requests)"
            )
        lines = enumerate(path.read_text().splitlines(), 1)
        PAYLOADS[:] = [_compact(ln, path, i) for i, ln in lines if ln.strip()]
        if not PAYLOADS:
            raise SystemExit(f"--requests-file {path}: no requests in the file")
    else:
        PAYLOADS[:] = [
            json.dumps({"user_id": rng.randint(1, o.random_users), "k": 10}).encode() for _ in range(10_000)
        ]
    if o.triton_model:
        PATH[0] = f"/v2/models/{o.triton_model}/infer"
        PAYLOADS[:] = [triton_request(p) for p in PAYLOADS]
    if environment.web_ui is not None:
        _extend_web_ui(environment)
    if isinstance(environment.runner, MasterRunner):
        environment.runner.register_message("reco_done", lambda msg, **_kw: DONE.add(int(msg.data["index"])))


def triton_request(body: bytes) -> bytes:
    """A /recommend body as a KServe v2 infer request of reco's Triton model (its BYTES input "request")."""
    inp = {"name": "request", "shape": [1, 1], "datatype": "BYTES", "data": [body.decode()]}
    return json.dumps({"inputs": [inp]}, separators=(",", ":")).encode()


def answer(content: bytes, triton: bool | None = None) -> dict:
    """The /recommend answer in a response body (a Triton infer response: the "response" output's element);
    `triton` None: as this process speaks (--triton-model)."""
    obj = json.loads(content)
    if PATH[0] != "/recommend" if triton is None else triton:
        obj = json.loads(next(o for o in obj["outputs"] if o["name"] == "response")["data"][0])
    return obj


def _check_triton(response) -> None:
    """Fail a Triton answer (HTTP 200) whose "response" is reco's error (its status: triton_status)."""
    if response.status_code == 200 and b'\\"error\\":' in (response.content or b""):
        response.failure(f"{triton_status(response)} {response.content[:200]!r}")


def triton_status(response) -> int:
    """The HTTP status reco's server would have answered for a Triton answer holding its error (0: unreadable)."""
    try:
        return int(answer(response.content, triton=True).get("status", 0))
    except (ValueError, KeyError, TypeError, StopIteration):
        return 0


def _compact(line: str, path: Path, lineno: int) -> bytes:
    try:
        return json.dumps(json.loads(line), separators=(",", ":")).encode()
    except json.JSONDecodeError as e:
        raise SystemExit(f"--requests-file {path}:{lineno}: not a JSON request body ({e})") from None


@events.test_start.add_listener
def _test_start(environment, **_kw) -> None:
    REC.reset()
    USER_SEQ[0] = 0  # a kept-running process draws the same request streams in every test
    o = environment.parsed_options
    if o is None:
        return
    if isinstance(environment.runner, MasterRunner):
        DONE.clear()
        if o.latency_file:
            Path(o.latency_file + ".failed").unlink(missing_ok=True)
        gevent.spawn(_master_watch, environment, o)
        return
    REC.window_requests, REC.path = o.window_requests, o.latency_file
    if isinstance(environment.runner, WorkerRunner):
        # Custom options (ours) arrive from the master: every worker holds the master's values.
        REC.index, REC.n_workers = environment.runner.worker_index, max(1, o.expect_workers)
        REC.window_requests = window_share(o.window_requests, REC.index, REC.n_workers)
        if o.window_requests > 0 and REC.window_requests == 0:  # more workers than requests
            REC.close_window()
        if o.latency_file:
            REC.path = str(worker_file(o.latency_file, REC.index))
    # One connection per outstanding request in open loop; users are created after this event, and
    # FastHttpUser reads it then (the web UI can switch --load-mode between runs).
    RecoUser.concurrency = max(1, o.max_inflight) if o.load_mode == "open" else 1
    if environment.web_ui is not None and environment.host:
        METRICS_AT_START[0] = scrape(environment.host, timeout_s=2.0)
    _set_targets(o)
    if REC.path:
        Path(REC.path).parent.mkdir(parents=True, exist_ok=True)
        for suffix in (".window_end", ".summary.json", ".scores.jsonl"):
            Path(REC.path + suffix).unlink(missing_ok=True)
        Path(REC.path + ".started").write_text(repr(REC.t0_epoch))
    if o.duration_s > 0 or o.window_requests > 0:
        gevent.spawn(_end_window, environment, o)


def _set_targets(o) -> None:
    """TARGETS from --targets (none when it is empty); the window then counts every server's requests."""
    TARGETS.clear()
    if not o.targets:
        return
    if o.load_mode != "closed" or o.triton_model or REC.index >= 0:
        # the runner checks this first (reco.loadtest.interleave); a hand-made command gets told here
        raise ValueError(
            "--targets: one closed-loop process without --triton-model (each target names its own)"
        )
    spec = json.loads(o.targets)
    CYCLE_RNG[0] = random.Random(f"{spec['seed']}/cycles")
    for t in spec["targets"]:
        model = t.get("triton_model") or ""
        path = f"/v2/models/{model}/infer" if model else "/recommend"
        if model and model not in TRITON_PAYLOADS:
            TRITON_PAYLOADS[model] = [triton_request(p) for p in PAYLOADS]
        bodies = TRITON_PAYLOADS[model] if model else PAYLOADS
        TARGETS.append(Target(t["url"].rstrip("/") + path, bodies, bool(model), t["latency_file"]))
    REC.window_requests = o.window_requests * len(TARGETS)


def _end_window(environment, o) -> None:
    """Close the window on time (duration, or the cap), let its requests drain, then stop the test."""
    end = REC.t0_perf + o.warmup_s + o.duration_s if o.duration_s > 0 else math.inf
    opened = False
    while not REC.window_closed:
        now = time.perf_counter()
        if not opened and now >= REC.t0_perf + o.warmup_s:
            REC.cpu0, opened = (_cpu_s(), now), True
        if now >= end:
            REC.close_window()
            break
        gevent.sleep(0.005)
    if REC.path:
        Path(REC.path + ".window_end").write_text(repr(REC.window_end_epoch))
    deadline = time.perf_counter() + o.drain_s
    while any(REC.outstanding.values()) and time.perf_counter() < deadline:
        gevent.sleep(0.005)
    if isinstance(environment.runner, WorkerRunner):  # the master ends the test once every worker is done
        _write_record(o)
        environment.runner.send_message("reco_done", {"index": REC.index})
        return
    if o.headless:
        environment.runner.quit()
    else:
        environment.runner.stop()


@events.request.add_listener
def _on_request(request_type, name, response_time, response_length, response=None, context=None, exception=None, **_kw) -> None:  # fmt: skip
    ctx = context or {}
    if "token" not in ctx:  # not one of ours (e.g. a request made by another locustfile's user)
        return
    now = time.perf_counter()
    latency_ms = (now - ctx["start"]) * 1000.0  # open loop: the scheduled send, or the send if earlier
    status = int(getattr(response, "status_code", 0) or 0)
    to = TARGETS[REC.target_of.pop(ctx["token"])] if ctx["token"] in REC.target_of else None
    triton = PATH[0] != "/recommend" if to is None else to.triton
    if exception is not None and status == 200 and triton:
        status = triton_status(response)  # reco's error inside Triton's 200: its own status in the CSV
    ok = int(exception is None)
    in_window = REC.outstanding.pop(ctx["token"], False)
    REC.n_all += 1
    REC.all_rows.append((latency_ms, ok))
    if to is not None:
        to.n_all += 1
    if not in_window:
        return
    rows, scores = (REC.rows, REC.scores) if to is None else (to.rows, to.scores)
    rows.append((ctx["start"] - REC.t0_perf, latency_ms, ok, status))
    every = ctx.get("score_every", 0)
    if every and ok and ctx["seq"] % every == 0:
        try:
            items = answer(response.content, triton)["items"]
            scores.append({"payload": ctx["payload"], "items": [[i["item_id"], i["score"]] for i in items]})
        except (ValueError, KeyError, TypeError, StopIteration):
            scores.append({"payload": ctx["payload"], "items": None})  # an unreadable answer: a mismatch


def _master_watch(environment, o) -> None:
    """Master: end the test once every expected worker's window has drained; a worker lost before
    then (killed, hung, disconnected) fails the test, naming it, so no partial window passes as valid."""
    runner = environment.runner
    expected = max(1, o.expect_workers)
    while len(DONE) < expected:
        gevent.sleep(0.05)
        live = {runner.get_worker_index(c.id) for c in runner.clients.all if c.state != STATE_MISSING}
        lost = sorted(set(range(expected)) - live - DONE)
        if lost:
            msg = (
                f"Locust worker(s) {lost} lost mid-run ({len(live)} of {expected} still connected, "
                f"finished: {sorted(DONE)}): the window is incomplete and not valid"
            )
            logging.error(msg)
            if o.latency_file:
                Path(o.latency_file + ".failed").write_text(msg + "\n")
            environment.process_exit_code = 1
            break
    if o.headless:
        runner.quit()
    else:
        runner.stop()


@events.test_stop.add_listener
def _test_stop(environment, **_kw) -> None:
    o = environment.parsed_options
    REC.close_window()
    if o is None or isinstance(environment.runner, MasterRunner) or REC.written:
        return
    _write_record(o)


def _write_record(o) -> None:
    """This process's record of the window: the latency file, its summary and the recorded scores (one
    of each per server with --targets)."""
    REC.close_window()
    REC.written = True
    if not REC.path:
        return
    if TARGETS:
        # the first server's last: the runner takes its summary as the sign that every record is written
        for t in sorted(TARGETS, key=lambda t: t.latency_file == REC.path):
            _write_target(o, t)
        return
    _write_rows(o, REC.path, REC.rows, REC.scores)
    lags = sorted(REC.lags_ms)
    summary = {
        **_process_summary(o),
        "window_requests": REC.window_requests,
        "n_window": REC.n_window,  # assigned to the window: recorded rows + unanswered
        "n_recorded": len(REC.rows),
        "unanswered": sum(REC.outstanding.values()),  # sent in the window, no answer when the test stopped
        "n_all": REC.n_all,
        "payloads": len(PAYLOADS),
        "open": {
            "rate": o.rate / REC.n_workers,
            "overflow": sum(1 for r in REC.rows if r[3] == -1),
            "lag_p99_ms": lag_p99(lags),
            "lag_max_ms": lags[-1] if lags else 0.0,
        }
        if o.load_mode == "open"
        else None,
    }
    Path(REC.path + ".summary.json").write_text(json.dumps(summary, indent=2))


def _process_summary(o) -> dict:
    """The fields of a record's summary that are this process's and its window's, whoever the record is for."""
    return {
        "index": REC.index,  # Locust worker index (-1: a single process)
        "pid": os.getpid(),
        "cpu_pct": REC.cpu_pct(),
        "mode": o.load_mode,
        "t0_epoch": REC.t0_epoch,
        "window_end_epoch": REC.window_end_epoch,
        "warmup_s": o.warmup_s,
        "duration_s": o.duration_s,
    }


def _write_rows(o, path: str, rows: list[tuple[float, float, int, int]], scores: list[dict]) -> None:
    with open(path, "w") as f:
        f.write("start_s,latency_ms,ok,status\n")
        f.writelines(f"{s:.6f},{lat:.4f},{ok},{st}\n" for s, lat, ok, st in rows)
    if o.score_every:
        with open(path + ".scores.jsonl", "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in scores)


def _write_target(o, t: Target) -> None:
    """One server's record of a request-interleaved window, in the fields a window of its own writes (the
    process's CPU and the window's times are the whole window's)."""
    _write_rows(o, t.latency_file, t.rows, t.scores)
    mine = [tok for tok, i in REC.target_of.items() if TARGETS[i] is t]
    unanswered = sum(REC.outstanding.get(tok, False) for tok in mine)
    summary = {
        **_process_summary(o),
        "window_requests": o.window_requests,
        "n_window": t.n_window,
        "n_recorded": len(t.rows),
        "unanswered": unanswered,
        "n_all": t.n_all,
        "payloads": len(t.payloads),
        "open": None,
        "target": t.url,
        "interleaved_with": [u.url for u in TARGETS if u is not t],
    }
    Path(t.latency_file + ".summary.json").write_text(json.dumps(summary, indent=2))


# gevent's loop (libev, epoll) waits in whole milliseconds rounded up, so a sleep ends 0.6-0.7 ms past
# its time on average; timed from the schedule, that lateness read as the server's (at the case study's
# light load it was most of what Locust added to the time outside the handler beside wrk's:
# experiments/serve_overhead/README.md#what-the-load-generator-adds). So each arrival's timer fires this
# much before its schedule and a request the timer let go early is timed from its actual send (never
# later than its schedule: lateness still counts, so coordinated omission stays visible); the Poisson
# schedule moves by under a millisecond.
WAKE_EARLY_S = 0.001


class RecoUser(FastHttpUser):
    network_timeout = 30.0
    connection_timeout = 10.0

    def wait_time(self) -> float:
        return self.environment.parsed_options.think_time_s if self.environment.parsed_options else 0.0

    def on_start(self) -> None:
        USER_SEQ[0] += 1
        seed = self.environment.parsed_options.seed if self.environment.parsed_options else 0
        stream = seed * 1_000_003 + USER_SEQ[0]
        # Workers draw independent streams (identical ones would send the same schedule twice).
        key = stream if REC.index < 0 else f"{stream}/w{REC.index}"
        self.rng = random.Random(key)
        # each server of a multi-server window draws the stream a window of its own would send it
        self.target_rngs = [random.Random(key) for _ in TARGETS]

    def post(self, start: float, in_window: bool, seq: int, token: int, to: int | None = None) -> None:
        """One /recommend request; `start` is its send time (open loop: its scheduled send time, or its
        send if that came first), `seq` its number in the window, `token` its key in REC.outstanding
        (registered by the caller, before a spawned request runs, so the drain cannot miss it); `to`: the
        index of its server in TARGETS (None: --host)."""
        o = self.environment.parsed_options
        rng, path, bodies = (self.rng, PATH[0], PAYLOADS) if to is None else (
            self.target_rngs[to], TARGETS[to].url, TARGETS[to].payloads
        )  # fmt: skip
        idx = rng.randrange(len(bodies))
        ctx = {"token": token, "start": start, "payload": idx, "seq": seq}
        if in_window and o is not None and o.score_every:
            ctx["score_every"] = o.score_every
        stamp_us = round((REC.t0_epoch + (start - REC.t0_perf)) * 1e6)  # `start` on the epoch clock
        headers = {**JSON_HEADERS, "X-Request-Start": f"t={stamp_us}"}
        if not (PATH[0] != "/recommend" if to is None else TARGETS[to].triton):
            self.client.post(path, data=bodies[idx], headers=headers, context=ctx)
            return
        with self.client.post(path, data=bodies[idx], headers=headers, context=ctx, catch_response=True) as r:
            _check_triton(r)

    def cycle(self, o) -> None:
        """One request to every server of --targets, in a fresh random order. The cycle's first request
        decides whether the whole cycle is in the window, so the window is whole cycles and every server
        gets the same n however the warm-up ends."""
        cycle_in: bool | None = None
        for k, i in enumerate(CYCLE_RNG[0].sample(range(len(TARGETS)), len(TARGETS))):
            if REC.window_closed:
                return
            if k and o.think_time_s:
                gevent.sleep(o.think_time_s)
            now = time.perf_counter()
            in_window = REC.assign(now, o) if cycle_in is not False else False
            cycle_in = in_window if cycle_in is None else cycle_in
            TARGETS[i].n_window += in_window
            self.post(now, in_window, TARGETS[i].n_window, REC.register(in_window, i), i)

    @task
    def recommend(self) -> None:
        o = self.environment.parsed_options
        if o is not None and o.load_mode == "open":
            self.open_loop(o)
        elif REC.window_closed:
            gevent.sleep(0.05)  # the window is over: nothing more to measure; the test stops once drained
        elif TARGETS:
            self.cycle(o)
        else:
            now = time.perf_counter()
            in_window = REC.assign(now, o) if o is not None else False
            self.post(now, in_window, REC.n_window, REC.register(in_window))

    def open_loop(self, o) -> None:
        """Schedule Poisson arrivals; each request in its own greenlet, timed from its scheduled send (or
        from its send, when the timer let it go before its schedule: WAKE_EARLY_S)."""
        runner = self.environment.runner
        n_users = max(1, int(getattr(runner, "target_user_count", 0) or 1))  # on a worker: its own users
        rate = o.rate / (n_users * REC.n_workers)
        if rate <= 0:
            raise SystemExit(f"--rate must be > 0 in open loop, got {o.rate}")
        t = time.perf_counter()
        mine: set[gevent.Greenlet] = set()
        while not REC.window_closed:
            t += self.rng.expovariate(rate)
            delay = t - time.perf_counter() - WAKE_EARLY_S
            if delay > 0:
                gevent.sleep(delay)
            now = time.perf_counter()
            in_window = REC.assign(t, o)
            if in_window:
                REC.lags_ms.append(max(now - t, 0.0) * 1000.0)
            mine = {g for g in mine if not g.dead}
            if len(mine) >= o.max_inflight:  # the server is this far behind: count it, never queue here
                if in_window:
                    REC.rows.append((t - REC.t0_perf, math.nan, 0, -1))
                continue
            start = min(t, now)
            mine.add(gevent.spawn(self.post, start, in_window, REC.n_window, REC.register(in_window)))
        gevent.joinall(list(mine))
        while True:  # window over: idle until the test stops
            gevent.sleep(1.0)


def reco_tab_rows(host: str | None) -> list[dict]:
    """Rows of the web UI's "reco" tab: exact e2e quantiles with CIs of every request so far (failures
    +inf), the error rate, and the server's stage times since the test started."""
    import numpy as np

    from reco.loadtest.histogram import quantiles
    from reco.stats import with_failures

    lat = np.array([r[0] for r in REC.all_rows if r[1]], dtype=np.float64)
    failed = sum(1 for r in REC.all_rows if not r[1])
    x = with_failures(lat, failed)
    rows = [{"figure": f"e2e {k} ms", "value": e.fmt(".2f")} for k, e in quantiles(x).items()]
    rows.append(
        {"figure": "error rate", "value": f"{failed / len(x):.4f} (n={len(x):,})" if len(x) else "n/a"}
    )
    after = scrape(host, timeout_s=2.0) if host else ""
    if after and METRICS_AT_START[0]:
        for k, v in stage_summary(METRICS_AT_START[0], after).items():
            rows.append({"figure": k, "value": f"{v:.3f}"})
    return rows


def _extend_web_ui(environment) -> None:
    """Add the "reco" tab: its table is filled from `extended_stats` of every /stats/requests poll."""
    from flask import request

    web_ui = environment.web_ui
    web_ui.template_args["extended_tabs"] = [{"title": "reco", "key": "reco"}]
    web_ui.template_args["extended_tables"] = [
        {
            "key": "reco",
            "structure": [
                {"key": "figure", "title": "figure"},
                {"key": "value", "title": "value [95% CI] (n)"},
            ],
        }
    ]

    @web_ui.app.route("/reco/state")
    def _reco_state():
        # Unlike /stats/requests (cached for 2 s), read now: a driver waits on it between tests.
        return {"state": environment.runner.state}

    @web_ui.app.route("/reco/reports", methods=["POST"])
    def _reco_reports():
        return {"written": [str(p) for p in write_reports(environment)]}

    @web_ui.app.after_request
    def _reco_stats(response):
        if request.path != "/stats/requests" or response.status_code != 200:
            return response
        data = response.get_json()
        data["extended_stats"] = [{"key": "reco", "data": reco_tab_rows(environment.host)}]
        response.set_data(json.dumps(data))
        return response


def write_reports(environment) -> list[Path]:
    """Locust's own reports of the test that just stopped, beside its --latency-file (the names and
    formats headless --csv/--html/--json-file give): what a driver that keeps this process running across
    tests (reco.loadtest.locust_pool) keeps per test. No path is taken from the request."""
    import csv

    from locust.html import get_html_report

    if environment.runner.state not in ("stopped", "ready"):
        raise RuntimeError(
            f"reports are written once the test has stopped (state {environment.runner.state})"
        )
    base = Path(environment.parsed_options.latency_file).parent / "locust"
    writer = environment.web_ui.stats_csv_writer
    out = []
    for suffix, fill in (
        ("_stats.csv", writer.requests_csv),
        ("_failures.csv", writer.failures_csv),
        ("_exceptions.csv", writer.exceptions_csv),
    ):
        with open(f"{base}{suffix}", "w", newline="") as f:
            fill(csv.writer(f))
        out.append(Path(f"{base}{suffix}"))
    Path(f"{base}_report.html").write_text(get_html_report(environment, show_download_link=False))
    Path(f"{base}_stats.json").write_text(json.dumps(environment.runner.stats.serialize_stats(), indent=4))
    return [*out, Path(f"{base}_report.html"), Path(f"{base}_stats.json")]
