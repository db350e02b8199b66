"""The load generator against a tiny real HTTP server on 127.0.0.1 whose behaviour the test controls:
stalls (coordinated omission), 503s (failures as +inf), a generator held to an impossible budget
(valid=0), and the generator's processes on errors and signals."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import psutil
import pytest

from reco.cli.compose import compose
from reco.loadtest.capacity import find_capacity, open_loop_measure
from reco.loadtest.config import LoadMode, loadtest_config
from reco.loadtest.histogram import read_latencies
from reco.loadtest.runner import run_load, with_settings
from reco.stats import Verdict

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]


class Stub:
    """Answers POST /recommend after `delay_s`; the `stall_at`-th request stalls every request until
    `stall_s` later; every `fail_every`-th request gets a 503."""

    def __init__(self) -> None:
        self.delay_s, self.stall_at, self.stall_s, self.fail_every = 0.001, 0, 0.0, 0
        self.count = 0
        self.stall: tuple[float, float] | None = None  # (start, end) epoch
        self.lock = threading.Lock()


def _handler(stub: Stub):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, *a) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with stub.lock:
                stub.count += 1
                n, now = stub.count, time.time()
                if n == stub.stall_at:
                    stub.stall = (now, now + stub.stall_s)
                wait = stub.stall[1] - now if stub.stall else 0.0
            time.sleep(max(wait, 0.0) + stub.delay_s)
            if stub.fail_every and n % stub.fail_every == 0:
                self._send(503, b'{"error": "overloaded"}')
            else:
                self._send(
                    200, json.dumps({"items": [{"item_id": 1, "score": 0.5}], "model": "stub"}).encode()
                )

        def do_GET(self) -> None:
            self._send(404, b"{}")

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return H


@pytest.fixture
def stub():
    s = Stub()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(s))
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    s.url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        yield s
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def lt():
    c = loadtest_config(compose([]).loadtest)
    return with_settings(c, warmup_s=0.5, drain_s=2.0, loadgen=replace(c.loadgen, keep_warm=False))


def test_stalled_server_latency_counts_from_the_schedule(stub, lt, tmp_path):
    """Coordinated omission: while the server stalls, the open-loop generator keeps its schedule and
    every request scheduled during the stall is charged the time from its scheduled send."""
    stub.stall_at, stub.stall_s = 60, 1.0  # past the 0.5 s warm-up at 50 req/s
    s = with_settings(lt, mode=LoadMode.open, rate=50.0, window_requests=150)
    run = run_load(stub.url, s, tmp_path, kind="stall", reports=False)
    assert stub.stall is not None and run.n == 150 and run.n_failed == 0
    lat = read_latencies(tmp_path / "latencies.csv")
    t0 = float((tmp_path / "latencies.csv.started").read_text())
    sched = t0 + lat.start_s
    start, end = stub.stall
    during = (sched >= start) & (sched < end)
    # Poisson(50) arrivals in 1 s: ~50 (a closed-loop user would have sent exactly one).
    assert during.sum() >= 20
    # Each waited at least until the stall ended, counted from when it was due (5 ms clock slack).
    assert np.all(lat.latency_ms[during] >= (end - sched[during]) * 1000.0 - 5.0)
    slow_open = int((lat.latency_ms >= 500.0).sum())
    assert slow_open >= 10 and run.quantiles["p90"].value >= 100.0  # the stall is in the tail, not hidden

    # The same stall under a closed loop (one user): it waits with the server, so one request is slow
    # and the ~50 that were due meanwhile are never sent -- the omission the open loop avoids.
    stub.stall_at, stub.stall = stub.count + 100, None
    closed = with_settings(lt, mode=LoadMode.closed, users=1, window_requests=400, warmup_s=0.0)
    run = run_load(stub.url, closed, tmp_path / "closed", kind="stall", reports=False)
    assert stub.stall is not None and run.n == 400
    assert int((read_latencies(tmp_path / "closed" / "latencies.csv").latency_ms >= 500.0).sum()) == 1


@pytest.mark.parametrize(("fail_every", "p99_inf"), [(20, True), (400, False)])
def test_failed_requests_are_inf_in_the_percentiles(stub, lt, tmp_path, fail_every, p99_inf):
    stub.fail_every = fail_every  # 5 % or 0.25 % of requests answered 503
    s = with_settings(lt, mode=LoadMode.closed, users=2, window_requests=800)
    run = run_load(stub.url, s, tmp_path, kind="errors", reports=False)
    lat = read_latencies(tmp_path / "latencies.csv")
    assert run.n == 800 and run.n_failed == int((lat.status == 503).sum()) > 0
    assert run.n_failed == pytest.approx(800 / fail_every, abs=2)
    assert math.isinf(run.quantiles["p99"].value) is p99_inf
    assert math.isfinite(run.quantiles["p50"].value) and run.valid


def test_saturated_generator_gives_valid_0(stub, lt, tmp_path):
    cpu = with_settings(
        lt, mode=LoadMode.closed, users=1, window_requests=200, loadgen=replace(lt.loadgen, max_cpu_pct=0.0)
    )
    run = run_load(stub.url, cpu, tmp_path / "cpu", reports=False)
    assert not run.valid and "loadtest.loadgen.max_cpu_pct=0" in run.invalid_reason
    lag = with_settings(
        lt, mode=LoadMode.open, rate=200.0, window_requests=200, loadgen=replace(lt.loadgen, max_lag_ms=0.0)
    )
    run = run_load(stub.url, lag, tmp_path / "lag", reports=False)
    assert not run.valid and "loadtest.loadgen.max_lag_ms=0" in run.invalid_reason and run.lag_p99_ms > 0
    # In a capacity search such a step is INVALID, not a pass or a fail, and is never extended.
    c = with_settings(
        lag,
        capacity=replace(
            lag.capacity, start_rate=200, min_rate=200, max_rate=200, steps=1, step_warmup_s=0.2
        ),
    )
    cap = find_capacity(open_loop_measure(stub.url, c), 1e6, c.capacity, tmp_path / "cap")
    (step,) = cap.steps
    assert step.verdict == Verdict.INVALID and step.run.windows == 1
    assert cap.highest_pass == 0.0 and cap.lowest_fail is None and cap.lowest_invalid == 200.0


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_spinners_do_not_leak_when_locust_cannot_start(stub, lt, tmp_path):
    (tmp_path / "locust.log").mkdir()  # the log cannot be opened: Popen is never reached
    s = with_settings(lt, loadgen=replace(lt.loadgen, keep_warm=True), window_requests=10)
    before = _descendants()
    with pytest.raises(IsADirectoryError):
        run_load(stub.url, s, tmp_path, reports=False)
    assert not [p for p in _descendants() - before if _alive(p)]


# The config is composed here and handed over pickled: composing imports every step (torch and all).
SCRIPT = textwrap.dedent(
    """
    import pickle, sys
    from reco.loadtest.runner import run_load
    with open(sys.argv[3], "rb") as f:
        c = pickle.load(f)
    run_load(sys.argv[1], c, sys.argv[2], reports=False)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_locust_and_spinners(stub, tmp_path, sig):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    c = with_settings(loadtest_config(compose([]).loadtest), duration_s=60.0, warmup_s=0.0, users=1)
    (tmp_path / "cfg.pkl").write_bytes(pickle.dumps(c))
    args = [sys.executable, "-c", SCRIPT, stub.url, str(tmp_path), str(tmp_path / "cfg.pkl")]
    # SIGINT at its default in the child: a shell's background job (nohup ... &) inherits it ignored
    proc = subprocess.Popen(
        args, env=env, cwd=ROOT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    try:
        deadline = time.time() + 120
        while not (tmp_path / "latencies.csv.started").exists():
            assert proc.poll() is None and time.time() < deadline, "run_load did not start Locust"
            time.sleep(0.05)
        kids = psutil.Process(proc.pid).children(recursive=True)
        cmds = [" ".join(k.cmdline()) for k in kids]
        assert any("locust" in c for c in cmds) and any("SCHED_IDLE" in c for c in cmds)  # keep_warm: on
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=60) != 0
        survivors = [k.pid for k in kids if _alive(k.pid)]
        assert not survivors, f"left running after {sig.name}: {survivors}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
