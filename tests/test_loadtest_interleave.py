"""Request-interleaved unloaded blocks (loadtest.study.unloaded_interleave=request, reco.loadtest.interleave):
one real Locust window whose one user sends to several servers on 127.0.0.1 in cycles, split back into one
LoadRun per server with that server's own record, request bodies and server-side figures."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from conftest import make_variant

from reco.cli.compose import compose
from reco.config import ConfigError
from reco.loadtest.config import LoadMode, UnloadedInterleave, loadtest_config
from reco.loadtest.histogram import read_latencies
from reco.loadtest.interleave import Target, run_interleaved
from reco.loadtest.locust_pool import LocustPool
from reco.loadtest.outcome import LoadOutcome
from reco.loadtest.requests import write_requests
from reco.loadtest.runner import run_load, with_settings
from reco.loadtest.study import _Study, _unloaded_rounds
from reco.serve.config import serve_config
from reco.serve.process import start_server, stop_servers

pytestmark = pytest.mark.timeout(300)
ANSWER = {"items": [{"item_id": 1, "score": 0.5}], "model": "stub"}


class Recorder:
    """A server on 127.0.0.1 that answers every request at once and keeps the bodies it got; its own
    figures say each request took `ms`: reco's /metrics (one stage histogram) or, with `triton`, KServe v2
    infer answers and Triton's statistics of model "m"."""

    def __init__(self, ms: float, triton: bool) -> None:
        self.ms, self.triton = ms, triton
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def figures(self) -> bytes:
        n = len(self.bodies)
        if self.triton:
            success = {"count": n, "ns": n * round(self.ms * 1e6)}
            stats = {"inference_stats": {"success": success}, "execution_count": n, "inference_count": n}
            return json.dumps({"model_stats": [stats]}).encode()
        sum_s = n * self.ms / 1000
        return (
            "# TYPE reco_stage_seconds histogram\n"
            f'reco_stage_seconds_bucket{{stage="total",le="1.0"}} {n}\n'
            f'reco_stage_seconds_bucket{{stage="total",le="+Inf"}} {n}\n'
            f'reco_stage_seconds_sum{{stage="total"}} {sum_s}\n'
            f'reco_stage_seconds_count{{stage="total"}} {n}\n'
        ).encode()


def _handler(rec: Recorder):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            want = "/v2/models/m/infer" if rec.triton else "/recommend"
            if self.path != want:
                self._send(404, b"{}")
                return
            if rec.triton:
                body = json.loads(body["inputs"][0]["data"][0])
                out = {"name": "response", "datatype": "BYTES", "shape": [1], "data": [json.dumps(ANSWER)]}
                answer = json.dumps({"outputs": [out]}).encode()
            else:
                answer = json.dumps(ANSWER).encode()
            with rec.lock:
                rec.bodies.append(body)
            self._send(200, answer)

        def do_GET(self) -> None:
            want = "/v2/models/m/stats" if rec.triton else "/metrics"
            with rec.lock:
                self._send(200, rec.figures()) if self.path == want else self._send(404, b"{}")

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return H


def settings(**over):
    c = loadtest_config(compose([]).loadtest)
    # the mechanism is under test, not the machine: a busy CI machine must not void a window
    lg = dataclasses.replace(c.loadgen, keep_warm=False, max_cpu_pct=1000, max_lag_ms=1000)
    base = {"mode": LoadMode.closed, "users": 1, "workers": 1, "warmup_s": 0, "drain_s": 2, "loadgen": lg}
    return with_settings(c, **{**base, **over})


def payloads(out: Path) -> list[int]:
    """Which request-file rows a window sent this server, in order (recorded with score_every=1)."""
    lines = (out / "latencies.csv.scores.jsonl").read_text().splitlines()
    return [json.loads(ln)["payload"] for ln in lines]


@pytest.fixture(scope="module")
def requests(tiny_data, tmp_path_factory) -> Path:
    return write_requests(tiny_data, tmp_path_factory.mktemp("req") / "requests.jsonl", n=500, k=10, seed=0)


def test_one_window_over_a_reco_and_a_triton_server_splits_into_their_own_runs(requests, tmp_path):
    """Each server gets its n, the bodies a window of its own would send it (in its own protocol), its
    own record, and the figures of its own /metrics or Triton statistics; the requests go in cycles."""
    reco_, triton = Recorder(ms=7.0, triton=False), Recorder(ms=3.0, triton=True)
    c = settings(window_requests=40, score_every=1)
    alone = run_load(reco_.url, c, tmp_path / "alone", requests, reports=False)
    reco_.bodies.clear()
    targets = [Target("r", reco_.url, tmp_path / "r"), Target("t", triton.url, tmp_path / "t", "m")]
    runs = run_interleaved(targets, c, requests, None, kind="unloaded", seed=3)

    assert set(runs) == {"r", "t"} and [runs[k].n for k in "rt"] == [40, 40]
    assert all(r.valid and r.n_failed == 0 and r.kind == "unloaded" for r in runs.values())
    # each its share of the window's time, so its qps reads as in a window of its own
    assert all(r.window_s > 0 and r.qps == pytest.approx(40 / r.window_s) for r in runs.values())
    # the bodies of a window of its own, in order, whichever protocol carried them
    assert payloads(tmp_path / "r") == payloads(tmp_path / "t") == payloads(tmp_path / "alone")
    rows = [json.loads(ln) for ln in requests.read_text().splitlines()]
    sent = [rows[i] for i in payloads(tmp_path / "alone")]
    assert reco_.bodies == triton.bodies == sent  # no warm-up: every request is in the window
    # each run's server figures are its own server's (7 ms vs 3 ms a request, by their own account)
    assert runs["r"].server_stages["server_total_mean_ms"] == pytest.approx(7.0)
    assert runs["t"].server_stages["server_total_mean_ms"] == pytest.approx(3.0)
    assert runs["t"].server_stages["server_batch_requests_mean"] == 1.0
    assert alone.server_stages["server_total_mean_ms"] == pytest.approx(7.0)
    # in cycles: sorted by send time, every consecutive pair is one request to each server
    lat = {k: read_latencies(tmp_path / k / "latencies.csv") for k in "rt"}
    order = np.concatenate([np.full(40, 0), np.full(40, 1)])[np.argsort(np.concatenate([lat["r"].start_s, lat["t"].start_s]))]  # fmt: skip
    assert (order.reshape(-1, 2).sum(axis=1) == 1).all()
    assert len({tuple(p) for p in order.reshape(-1, 2)}) == 2  # and not always in the same order
    for k in "rt":
        summary = json.loads((tmp_path / k / "latencies.csv.summary.json").read_text())
        assert summary["n_window"] == summary["n_recorded"] == 40 and summary["unanswered"] == 0
    assert (tmp_path / "r" / "locust_report.html").exists()  # Locust's own reports: the first target's


@pytest.fixture(scope="module")
def servers(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("interleave")
    vdir, dpath = make_variant(tiny_data, root, onnx=True)
    serve = serve_config(compose(["serve.n_candidates=50", "serve.keep_warm=false"]).serve)
    hs = [start_server(vdir, dpath, serve, work_dir=root / f"s{i}", wait=False) for i in range(3)]
    try:
        yield [h.wait_ready() for h in hs]
    finally:
        stop_servers(hs)


def study(tmp_path: Path, handles, requests: Path, pool: LocustPool, **st) -> _Study:
    c = settings(seed=5)
    c = dataclasses.replace(
        c, study=dataclasses.replace(c.study, **{"unloaded_interleave": UnloadedInterleave.request, **st})
    )
    s = _Study(c, serve_config(compose([]).serve), tmp_path, log=None)
    names = ["a", "b", "c"][: len(handles)]
    s.outcomes = {n: LoadOutcome(n) for n in names}
    s.servers = dict(zip(names, handles, strict=True))
    s.requests, s.gen_cpus, s.pool = requests, None, pool
    return s


def test_a_study_block_is_one_window_and_gives_every_variant_a_run_of_that_block(servers, requests, tmp_path):
    with LocustPool(tmp_path / "pool") as pool:
        s = study(tmp_path, servers, requests, pool, unloaded_requests=100, unloaded_warmup_s=0.3)
        _unloaded_rounds(s, [0, 0], ["start"], 0)
        (kept,) = pool.kept.values()
        assert kept.tests == 2 and kept.key[-1] is True  # one window a block, in a process of its own
    for n in ("a", "b", "c"):
        o = s.outcomes[n]
        assert o.error == "" and [r.block for r in o.unloaded] == [0, 1]
        assert all(r.n == 100 and r.valid and r.n_failed == 0 for r in o.unloaded)
        # the real server's stage figures, from its own /metrics
        assert all(r.server_stages["server_rank_mean_ms"] > 0 for r in o.unloaded)
        assert (tmp_path / n / "unloaded" / "r1" / "latencies.csv").exists()
    # the variants of a block share its one window, so they share its clock
    for r in (0, 1):
        t0 = {json.loads((tmp_path / n / "unloaded" / f"r{r}" / "latencies.csv.summary.json").read_text())["t0_epoch"] for n in "abc"}  # fmt: skip
        assert len(t0) == 1
    assert set(s.seconds["unloaded"]) == {"a", "b", "c"} and min(s.seconds["unloaded"].values()) > 0


def test_a_server_dying_mid_block_voids_the_block_for_every_variant(tiny_data, requests, tmp_path):
    root = tmp_path / "srv"
    root.mkdir()
    vdir, dpath = make_variant(tiny_data, root, onnx=True)
    serve = serve_config(compose(["serve.n_candidates=50", "serve.keep_warm=false"]).serve)
    hs = [start_server(vdir, dpath, serve, work_dir=root / f"s{i}") for i in range(2)]
    try:
        s = study(tmp_path, hs, requests, None, unloaded_requests=100, unloaded_warmup_s=2.0)
        started = tmp_path / "a" / "unloaded" / "r1" / "latencies.csv.started"
        if s.block_order("unloaded", 1)[0] == "b":
            started = tmp_path / "b" / "unloaded" / "r1" / "latencies.csv.started"

        def kill_b_in_block_1() -> None:  # during its warm-up: the window cannot have ended yet
            deadline = time.time() + 120
            while not started.exists() and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)
            hs[1].proc.kill()

        _unloaded_rounds(s, [0, 1], ["start", "end"], 0)
        killer = threading.Thread(target=kill_b_in_block_1)
        killer.start()
        _unloaded_rounds(s, [0, 1], ["start", "end"], 1)
        killer.join()
    finally:
        stop_servers(hs)
    a, b = s.outcomes["a"], s.outcomes["b"]
    assert [r.valid for r in a.unloaded] == [True, False] and [r.block for r in a.unloaded] == [0, 1]
    assert [r.valid for r in b.unloaded] == [True, False]
    for o in (a, b):
        assert (
            "unloaded block 1 void: the server of b (exit code -9) exited during it"
            in o.unloaded[-1].invalid_reason
        )
    assert a.unloaded[-1].n == b.unloaded[-1].n == 100  # kept whole, listed as invalid: never a shorter block
    assert "b" not in s.servers and "a" in s.servers and a.error == "" and "block 1 void" in b.error


def test_a_sized_unloaded_window_fills_its_seconds_at_the_variants_pace(servers, requests, tmp_path):
    """study.unloaded_window_s: a variant's unloaded windows hold the requests that fill that many seconds
    at its pace (never fewer than unloaded_requests): its settling run's, else its first window's."""
    with LocustPool(tmp_path / "pool") as pool:
        s = study(
            tmp_path, servers[:2], requests, pool, unloaded_interleave=UnloadedInterleave.window,
            unloaded_requests=100, unloaded_warmup_s=0.2, unloaded_window_s=0.6, settle_s=1.0,
        )  # fmt: skip
        s.settle("b")  # b settles first, a does not
        for r in range(3):
            s.unloaded("a", r)
            s.unloaded("b", r)
    a, b = s.outcomes["a"].unloaded, s.outcomes["b"].unloaded
    assert s.outcomes["a"].error == s.outcomes["b"].error == "" and a[0].n == 100
    want = {n: max(100, int(0.6 / s.pace[n])) for n in "ab"}
    assert s.pace["a"] == a[0].window_s / a[0].n  # the first window's pace
    assert [u.n for u in a] == [100, want["a"], want["a"]] and [u.n for u in b] == [want["b"]] * 3
    assert min(want.values()) > 100  # a 50-candidate tiny model: ~1-3 ms a request
    assert s.unloaded_s("a") == pytest.approx(want["a"] * s.pace["a"])  # the budget prices it as sized


def test_sized_unloaded_windows_need_one_window_per_variant():
    lt = dict(compose().loadtest)
    lt["study"] = {**lt["study"], "unloaded_window_s": 1.0, "unloaded_interleave": "request"}
    with pytest.raises(
        ConfigError, match=r"study.unloaded_window_s: .*unloaded_interleave=window \(got request\)"
    ):
        loadtest_config(lt)
    lt["study"] = {**lt["study"], "unloaded_window_s": 0.0, "unloaded_interleave": "window"}
    with pytest.raises(ConfigError, match=r"study.unloaded_window_s: expected > 0 s or null, got 0.0"):
        loadtest_config(lt)


def test_an_unknown_interleave_names_the_key_and_the_choices():
    assert loadtest_config(compose([]).loadtest).study.unloaded_interleave == UnloadedInterleave.window
    lt = dict(compose().loadtest)
    lt["study"] = {**lt["study"], "unloaded_interleave": "cycles"}
    with pytest.raises(ConfigError, match=r"study.unloaded_interleave.*'cycles'.*\[window, request\]"):
        loadtest_config(lt)
    # as a command-line override, the message names the full key
    with pytest.raises(ConfigError, match=r"loadtest.study.unloaded_interleave: Invalid value 'cycles', expected one of \[window, request\]"):  # fmt: skip
        compose(["loadtest.study.unloaded_interleave=cycles"])


def test_an_interleaved_window_is_one_closed_loop_user(tmp_path):
    t = [Target("a", "http://127.0.0.1:1", tmp_path / "a")]
    for bad in ({"mode": LoadMode.open}, {"users": 2}, {"window_requests": None}):
        c = settings(**{"window_requests": 10, **bad})
        with pytest.raises(ValueError, match="unloaded_interleave=request"):
            run_interleaved(t, c, None, None, kind="unloaded", seed=0)
    with pytest.raises(ValueError, match="distinct names"):
        run_interleaved(t + t, settings(window_requests=10), None, None, kind="unloaded", seed=0)
