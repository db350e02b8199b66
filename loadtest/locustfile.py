"""Locust user for the reco service; runs on its own with Locust's web UI or headless.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --web-host 127.0.0.1 --requests-file requests.jsonl
    locust -f loadtest/locustfile.py --host ... --headless -u 1 -t 20s --load-mode open --rate 200

(--web-host 127.0.0.1 keeps Locust's web UI on loopback; it listens on every interface by default.)

Two load models:
  closed  each Locust user sends a request, waits for the answer (and --think-time-s), repeats.
  open    Poisson arrivals at --rate requests/s in total (split evenly across users; a sum of Poisson
          processes is Poisson), each sent from its own greenlet whatever is still outstanding, as
          MLPerf's Server scenario. Latency is measured from each request's SCHEDULED send time, so a
          queue in the server or in the generator (coordinated omission) shows up in the percentiles.

Every request's latency is recorded exactly (float ms, not Locust's rounded buckets) through the request
event hook and written at test stop to --latency-file as CSV `start_s,latency_ms,ok,status` (start_s
relative to the test start), keeping only requests that started in the measured window
[warmup_s, warmup_s + duration_s). Beside it: `<file>.summary.json` (counts, open-loop schedule lag) and,
at test start, `<file>.started` holding the test-start epoch time (the runner aligns its scrapes to it).

Requests come from --requests-file (JSON lines of /recommend bodies, see reco.loadtest.requests); without
one, random user ids in [1, --random-users] with k=10 and no context.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import gevent
from locust import FastHttpUser, events, task

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
        help="measured window after the warm-up (0: until stopped); open loop stops scheduling after it",
    )
    g.add_argument(
        "--latency-file", env_var="RECO_LATENCY_FILE", default="reco_latencies.csv", help="per-request CSV"
    )
    g.add_argument(
        "--max-inflight", env_var="RECO_MAX_INFLIGHT", type=int, default=512, help="open loop, per user"
    )
    g.add_argument("--think-time-s", env_var="RECO_THINK_TIME_S", type=float, default=0.0, help="closed loop")
    g.add_argument(
        "--random-users", env_var="RECO_RANDOM_USERS", type=int, default=1000, help="fallback users"
    )
    g.add_argument("--seed", env_var="RECO_SEED", type=int, default=0)


class Recorder:
    """Exact per-request latencies of the current test (module-level: one per Locust process)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.t0_epoch = time.time()
        self.t0_perf = time.perf_counter()
        self.rows: list[tuple[float, float, int, int]] = []  # start_s, latency_ms, ok, status
        self.lags_ms: list[float] = []  # open loop: actual send - scheduled send, in the window
        self.scheduled = 0
        self.overflow = 0
        self.outstanding: set[float] = set()  # open loop: scheduled perf times not yet answered

    def in_window(self, start_s: float, opts) -> bool:
        return start_s >= opts.warmup_s and (
            opts.duration_s <= 0 or start_s < opts.warmup_s + opts.duration_s
        )


REC = Recorder()
PAYLOADS: list[bytes] = []
USER_SEQ = [0]  # users draw payloads from their own seeded stream (reproducible request mix)


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


def _compact(line: str, path: Path, lineno: int) -> bytes:
    try:
        return json.dumps(json.loads(line), separators=(",", ":")).encode()
    except json.JSONDecodeError as e:
        raise SystemExit(f"--requests-file {path}:{lineno}: not a JSON request body ({e})") from None


@events.test_start.add_listener
def _test_start(environment, **_kw) -> None:
    REC.reset()
    o = environment.parsed_options
    if o is None:
        return
    # One connection per outstanding request in open loop; users are created after this event, and
    # FastHttpUser reads it then (the web UI can switch --load-mode between runs).
    RecoUser.concurrency = max(1, o.max_inflight) if o.load_mode == "open" else 1
    if o.latency_file:
        Path(o.latency_file).parent.mkdir(parents=True, exist_ok=True)
        Path(o.latency_file + ".started").write_text(repr(REC.t0_epoch))


@events.request.add_listener
def _on_request(
    request_type,
    name,
    response_time,
    response_length,
    response=None,
    context=None,
    exception=None,
    start_time=None,
    **_kw,
) -> None:
    ctx = context or {}
    if "scheduled" in ctx:  # open loop: from the scheduled send time
        start_s = ctx["scheduled"] - REC.t0_perf
        latency_ms = (time.perf_counter() - ctx["scheduled"]) * 1000.0
        REC.outstanding.discard(ctx["scheduled"])
    else:
        start_s = (start_time or time.time()) - REC.t0_epoch
        latency_ms = float(response_time)
    status = int(getattr(response, "status_code", 0) or 0)
    REC.rows.append((start_s, latency_ms, int(exception is None), status))


@events.test_stop.add_listener
def _test_stop(environment, **_kw) -> None:
    o = environment.parsed_options
    if o is None or not o.latency_file:
        return
    rows = [r for r in REC.rows if REC.in_window(r[0], o)]
    out = Path(o.latency_file)
    with open(out, "w") as f:
        f.write("start_s,latency_ms,ok,status\n")
        f.writelines(f"{s:.6f},{lat:.4f},{ok},{st}\n" for s, lat, ok, st in rows)
    lags = sorted(REC.lags_ms)
    incomplete = sum(1 for t in REC.outstanding if REC.in_window(t - REC.t0_perf, o))
    summary = {
        "mode": o.load_mode,
        "t0_epoch": REC.t0_epoch,
        "warmup_s": o.warmup_s,
        "duration_s": o.duration_s,
        "n_recorded": len(rows),
        "n_all": len(REC.rows),
        "payloads": len(PAYLOADS),
        "open": {
            "rate": o.rate,
            "scheduled": REC.scheduled,
            "overflow": REC.overflow,
            "incomplete": incomplete,
            "lag_p99_ms": lags[min(len(lags) - 1, math.ceil(0.99 * len(lags)) - 1)] if lags else 0.0,
            "lag_max_ms": lags[-1] if lags else 0.0,
        }
        if o.load_mode == "open"
        else None,
    }
    Path(o.latency_file + ".summary.json").write_text(json.dumps(summary, indent=2))


class RecoUser(FastHttpUser):
    network_timeout = 30.0
    connection_timeout = 10.0

    def wait_time(self) -> float:
        return self.environment.parsed_options.think_time_s if self.environment.parsed_options else 0.0

    def on_start(self) -> None:
        USER_SEQ[0] += 1
        seed = self.environment.parsed_options.seed if self.environment.parsed_options else 0
        self.rng = random.Random(seed * 1_000_003 + USER_SEQ[0])

    def post(self, context: dict | None = None) -> None:
        body = PAYLOADS[self.rng.randrange(len(PAYLOADS))]
        self.client.post("/recommend", data=body, headers=JSON_HEADERS, context=context or {})

    @task
    def recommend(self) -> None:
        o = self.environment.parsed_options
        if o is not None and o.load_mode == "open":
            self.open_loop(o)
        else:
            self.post()

    def open_loop(self, o) -> None:
        """Schedule Poisson arrivals; each request in its own greenlet, timed from its scheduled send."""
        runner = self.environment.runner
        n_users = max(1, int(getattr(runner, "target_user_count", 0) or 1))
        rate = o.rate / n_users
        if rate <= 0:
            raise SystemExit(f"--rate must be > 0 in open loop, got {o.rate}")
        end = REC.t0_perf + o.warmup_s + o.duration_s if o.duration_s > 0 else math.inf
        t = time.perf_counter()
        mine: set[gevent.Greenlet] = set()
        while True:
            t += self.rng.expovariate(rate)
            if t >= end:
                break
            delay = t - time.perf_counter()
            if delay > 0:
                gevent.sleep(delay)
            in_window = REC.in_window(t - REC.t0_perf, o)
            if in_window:
                REC.scheduled += 1
                REC.lags_ms.append((time.perf_counter() - t) * 1000.0)
            mine = {g for g in mine if not g.dead}
            if len(mine) >= o.max_inflight:  # the server is this far behind: count it, never queue here
                REC.overflow += 1
                REC.rows.append((t - REC.t0_perf, math.nan, 0, -1))
                continue
            REC.outstanding.add(t)
            mine.add(gevent.spawn(self.post, {"scheduled": t}))
        gevent.joinall(list(mine))
        while True:  # window over: idle until Locust stops the test
            gevent.sleep(1.0)
