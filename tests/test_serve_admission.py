"""Admission by age (serve.max_wait_ms) on real servers over real HTTP, and the generator's X-Request-Start.

A request already older than max_wait_ms when admitted -- by its X-Request-Start stamp, or counted from
handler entry -- or when its model call would start is answered 503 + Retry-After without a model
call. The slow model comes from serve.faults (test-only settings, 0 in conf/serve).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from conftest import make_variant
from prometheus_client.parser import text_string_to_metric_families
from test_serve import Client, running_servers, serve_settings

from reco.cli.compose import compose
from reco.config import ConfigError
from reco.loadtest.config import LoadMode, loadtest_config
from reco.loadtest.histogram import read_latencies
from reco.loadtest.runner import run_load, with_settings
from reco.serve.admission import Overdue, WorkGate, request_age_s, request_start_epoch
from reco.serve.batcher import DirectRanker
from reco.serve.faults import SLOW_CALL_STARTED
from reco.serve.process import ServerHandle

pytestmark = pytest.mark.timeout(240)

BODY = {"user_id": 7, "k": 3, "candidates": [5, 17, 300, 999, 42]}
DELAY_S, MAX_WAIT_S = 4.0, 0.5  # requests queued behind the slowed call wait ~8x max_wait: no timing race
SLOW = [f"max_wait_ms={MAX_WAIT_S * 1000:g}", f"faults.model_delay_s={DELAY_S}", "faults.slow_calls=1"]


@pytest.fixture(scope="module")
def servers(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("admission")
    vdir, dpath = make_variant(tiny_data, root, onnx=True)
    specs = {
        "aged": ["max_wait_ms=100"],
        "slow": SLOW,
        "slow_batched": [*SLOW, "batching.enabled=true"],
        "off": [f"faults.model_delay_s={DELAY_S}", "faults.slow_calls=1"],  # max_wait_ms null: no shedding
    }
    yield from running_servers(vdir, dpath, {n: ["keep_warm=false", *o] for n, o in specs.items()}, root)


def _stamp(age_s: float, unit: float = 1e6) -> str:
    """An X-Request-Start value `age_s` ago (negative: in the future), in `unit` per second."""
    return f"t={round((time.time() - age_s) * unit)}"


def _post(c: Client, stamp: str | None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if stamp is not None:
        headers["X-Request-Start"] = stamp
    status, h, data = c.request("POST", "/recommend", json.dumps(BODY).encode(), headers)
    return status, h, json.loads(data)


def _counts(c: Client) -> tuple[dict[str, float], float]:
    """(reco_shed_total by reason, model calls answered) from /metrics."""
    text = c.request("GET", "/metrics")[2].decode()
    shed, calls = {}, 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == "reco_shed":
            shed = {s.labels["reason"]: s.value for s in fam.samples if s.name == "reco_shed_total"}
        elif fam.name == "reco_batch_rows":
            calls = next(s.value for s in fam.samples if s.name.endswith("_count"))
    return shed, calls


def test_old_request_is_shed_without_a_model_call_fresh_one_served(servers):
    c = Client(servers["aged"].url)
    shed0, calls0 = _counts(c)
    assert shed0 == {"queue_limit": 0, "age_at_admission": 0, "wait_before_model": 0}
    # 10 s old in every unit the header is written in (us: this project's generator; s: nginx; ms: Heroku).
    old = [_stamp(10.0), _stamp(10.0, 1.0), f"t={time.time() - 10:.3f}", _stamp(10.0, 1e3), _stamp(10.0, 1e9)]
    for stamp in old:
        status, headers, resp = _post(c, stamp)
        assert status == 503 and headers["retry-after"] == "1", (stamp, resp)
        assert "max_wait_ms 100" in resp["error"] and resp["field"] == "", resp
    shed1, calls1 = _counts(c)
    assert shed1["age_at_admission"] == len(old) and calls1 == calls0  # no model call for any of them
    status, _, resp = _post(c, _stamp(0.0))
    assert status == 200 and len(resp["items"]) == 3, resp
    assert {it["item_id"] for it in resp["items"]} <= set(BODY["candidates"])
    assert _counts(c)[1] == calls1 + 1
    c.close()


@pytest.mark.parametrize(
    "stamp",
    ["garbage", "t=", "t=nan", "t=inf", "t=-5", "t=0", "t=1e400", "t=" + "9" * 200, "t=1.2.3", "", None],
)
def test_malformed_or_missing_stamp_is_ignored(servers, stamp):
    """Never a 4xx/5xx because of the header: without a usable stamp only the in-server wait counts."""
    c = Client(servers["aged"].url)
    status, _, resp = _post(c, stamp)
    assert status == 200 and len(resp["items"]) == 3, resp
    c.close()


def _ignored(c: Client) -> dict[str, float]:
    """reco_request_start_ignored_total by reason, from /metrics."""
    text = c.request("GET", "/metrics")[2].decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "reco_request_start_ignored":
            return {s.labels["reason"]: s.value for s in fam.samples if s.name.endswith("_total")}
    raise AssertionError("reco_request_start_ignored_total not exported")


def test_stamp_slightly_ahead_is_age_zero_implausible_stamps_are_ignored_and_counted(servers):
    """Within request_start_max_ahead_s (1 s) a stamp ahead is clock skew: age 0. Further ahead, or older
    than request_start_max_age_s (60 s), it is not trusted: served as without the header, and counted
    (issue 48: t=1 was shed as "waited 1796417980784 ms", a stamp an hour ahead skipped the age check)."""
    c = Client(servers["aged"].url)
    shed0, ignored0 = _counts(c)[0], _ignored(c)
    status, _, resp = _post(c, _stamp(-0.5))
    assert status == 200, resp
    assert _ignored(c) == ignored0
    for stamp, reason in [
        (_stamp(-3600.0), "future"),
        ("t=1", "too_old"),
        (_stamp(61.0), "too_old"),
        (_stamp(3600.0 * 24 * 365, 1.0), "too_old"),
    ]:
        before = _ignored(c)
        status, _, resp = _post(c, stamp)
        assert status == 200 and len(resp["items"]) == 3, (stamp, resp)
        assert _ignored(c)[reason] == before[reason] + 1, stamp
    assert _counts(c)[0] == shed0
    c.close()


def test_request_age_bounds():
    now = time.time()
    t0 = time.perf_counter()
    for stamp, ignored in [(now - 5, None), (now + 0.5, None), (now + 5, "future"), (now - 100, "too_old")]:
        age, why = request_age_s(f"t={stamp * 1e6:.0f}", t0, t0 + 0.25, 60.0, 1.0)
        assert why == ignored, stamp
        assert age == (0.25 if ignored else pytest.approx(max(0.0, now - stamp), abs=1.0))
    assert request_age_s(None, t0, t0 + 0.25, 60.0, 1.0) == (0.25, None)


def test_request_start_spellings():
    now = time.time()
    for v in (
        f"t={now * 1e6:.0f}",
        f"{now * 1e6:.0f}",
        f"t={now:.3f}",
        f"t={now * 1e3:.0f}",
        f"T={now * 1e9:.0f}",
    ):
        assert request_start_epoch(v) == pytest.approx(now, abs=1e-3), v
    for v in ("t=abc", "t=", "t=-1", "t=nan", "t=1e30", " ", None):
        assert request_start_epoch(v) is None, v


def _concurrently(url: str, n: int) -> list[tuple[int, dict, dict, float]]:
    """n requests at once: (status, headers, body, perf_counter time answered) each."""
    out: list = [None] * n
    gate = threading.Barrier(n)

    def send(i: int) -> None:
        c = Client(url)
        gate.wait()
        out[i] = (*_post(c, None), time.perf_counter())
        c.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _slow_calls_started(h: ServerHandle) -> int:
    return h.log_path.read_text(errors="replace").count(SLOW_CALL_STARTED)


def _first_then_queued(h: ServerHandle, n: int) -> tuple[tuple, list[tuple]]:
    """One request (its model call is the slowed one), then, once that call has started (the server
    logs it; its batch is closed by then), n more at once; (status, headers, body, time answered) of
    each."""
    first: list = [None]
    started = _slow_calls_started(h)

    def send_first() -> None:
        c = Client(h.url)
        first[0] = (*_post(c, None), time.perf_counter())
        c.close()

    t = threading.Thread(target=send_first)
    t.start()
    deadline = time.monotonic() + 60
    while _slow_calls_started(h) == started:  # a poll for the server's line, bounded, not an ordering
        assert first[0] is None, f"answered {first[0][:3]} without a slowed model call"
        assert time.monotonic() < deadline, f"no {SLOW_CALL_STARTED!r} in {h.log_path}"
        time.sleep(0.01)
    rest = _concurrently(h.url, n)
    t.join()
    return first[0], rest


@pytest.mark.parametrize("name", ["slow", "slow_batched"])
def test_requests_stuck_behind_a_slow_model_call_are_shed_not_queued(servers, name):
    """The slowed call holds the model for DELAY_S; requests admitted meanwhile (no X-Request-Start:
    their age counts from handler entry) pass max_wait_ms waiting for it and are shed instead of being
    served late. Unbatched, the work gate has rank_threads + 1 = 2 slots: the first of the three takes
    the second slot (its work has started: it is served once the slowed call ends), the other two wait at
    the gate and are shed as soon as their deadline passes, without waiting for the slowed call. Batched,
    all three are shed when the next batch is formed."""
    c = Client(servers[name].url)
    shed0, calls0 = _counts(c)
    first, rest = _first_then_queued(servers[name], 3)
    assert first[0] == 200, first
    shed = [r for r in rest if r[0] == 503]
    for _, headers, resp, _ in shed:
        assert headers["retry-after"] == "1" and "max_wait_ms 500" in resp["error"], resp
    served = 1 if name == "slow" else 0
    assert len(shed) == 3 - served and sum(r[0] == 200 for r in rest) == served, [r[:3] for r in rest]
    if name == "slow":  # shed at the gate, not after the slowed call (which ends ~2.5 s after their deadline)
        assert all(t < first[3] for *_, t in shed)
    shed1, calls1 = _counts(c)
    assert shed1["wait_before_model"] - shed0["wait_before_model"] == 3 - served
    assert calls1 - calls0 == 1 + served  # no model call for a shed request
    assert _post(c, None)[0] == 200  # the model is free again: a fresh request is served
    assert "Traceback" not in servers[name].log_path.read_text()
    c.close()


def test_direct_ranker_does_not_score_a_block_past_its_deadline():
    calls = []

    def scorer(dense: np.ndarray, ids: np.ndarray, mask: np.ndarray, sizes=None) -> np.ndarray:
        calls.append(len(dense))
        return np.zeros(len(dense), dtype=np.float32)

    async def scenario() -> tuple[float, type]:
        with ThreadPoolExecutor(1) as pool:
            ranker = DirectRanker(scorer, pool)
            block = (
                np.zeros((4, 3), np.float32),
                np.zeros((4, 2, 1), np.int64),
                np.ones((4, 2, 1), np.float32),
            )
            ok = await ranker.score(*block, time.perf_counter() + 60)
            try:
                await ranker.score(*block, time.perf_counter() - 1)
            except Overdue as e:
                return float(ok.probs.sum()), type(e)
        raise AssertionError("a block past its deadline was scored")

    assert asyncio.run(scenario()) == (0.0, Overdue) and calls == [4]


def test_without_max_wait_the_same_requests_queue_and_are_served_late(servers):
    """The control: max_wait_ms null (the default) -- the same requests all wait and get 200."""
    first, rest = _first_then_queued(servers["off"], 3)
    assert first[0] == 200 and [r[0] for r in rest] == [200, 200, 200]
    assert _counts(Client(servers["off"].url))[0] == {
        "queue_limit": 0,
        "age_at_admission": 0,
        "wait_before_model": 0,
    }


def test_work_gate_is_fifo_expires_waiters_and_never_leaks_a_slot():
    async def scenario() -> list[str]:
        gate, log = WorkGate(1), []
        await gate.enter(math.inf)  # the one slot, held until released below

        async def waiter(name: str, deadline: float) -> None:
            try:
                await gate.enter(deadline)
            except Overdue:
                log.append(f"{name} overdue")
                return
            log.append(f"{name} in")
            gate.leave()

        # The first in line has a deadline that passes while it waits; the others' never comes.
        now = time.perf_counter()
        expired = asyncio.create_task(waiter("expired", now + 0.05))
        patient = [asyncio.create_task(waiter(f"w{i}", now + 3600)) for i in range(3)]
        cancelled = asyncio.create_task(waiter("cancelled", now + 3600))
        # Its deadline passed while the slot was held (bounded: a gate that never expires it fails here).
        assert (await asyncio.wait({expired}, timeout=60))[0], "a waiter past its deadline was kept waiting"
        # ...and every later waiter had queued by then (all started before the expiry's timer fired).
        assert len(gate.waiters) == 5 and gate.free == 0
        cancelled.cancel()
        gate.leave()
        await asyncio.gather(expired, *patient, return_exceptions=True)
        await asyncio.gather(cancelled, return_exceptions=True)
        log.append(f"free {gate.free}")
        return log

    assert asyncio.run(scenario()) == ["expired overdue", "w0 in", "w1 in", "w2 in", "free 1"]


def test_max_wait_ms_is_checked():
    with pytest.raises(ConfigError, match=r"serve\.max_wait_ms: expected > 0 ms or null"):
        serve_settings("max_wait_ms=0")
    assert serve_settings().max_wait_ms is None  # off unless asked for (conf/serve/default.yaml)


# The generator's stamp ------------------------------------------------------------------------------


class _Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    stamps: list[str | None] = []

    def log_message(self, *a) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).stamps.append(self.headers.get("X-Request-Start"))
        body = json.dumps({"items": [{"item_id": 1, "score": 0.5}], "model": "stub"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.mark.parametrize("mode", [LoadMode.open, LoadMode.closed])
def test_generator_stamps_each_request_with_the_time_its_latency_counts_from(tmp_path, mode):
    """Open loop: the scheduled send time; closed loop: the send time -- the same origin as the latency
    in latencies.csv (start_s), to the microsecond of the stamp."""
    _Recorder.stamps = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        c = loadtest_config(compose([]).loadtest)
        lt = with_settings(
            c, mode=mode, rate=100.0, users=1, window_requests=100, warmup_s=0.3,
            loadgen=replace(c.loadgen, keep_warm=False),
        )  # fmt: skip
        run = run_load(f"http://127.0.0.1:{srv.server_address[1]}", lt, tmp_path, kind="stamp", reports=False)
    finally:
        srv.shutdown()
        srv.server_close()
    assert run.n == 100 and run.n_failed == 0
    assert _Recorder.stamps and all(s is not None and s.startswith("t=") for s in _Recorder.stamps)
    sent = np.sort(np.array([int(s[2:]) for s in _Recorder.stamps], dtype=np.int64))
    t0 = float((tmp_path / "latencies.csv.started").read_text())
    window = np.round((t0 + read_latencies(tmp_path / "latencies.csv").start_s) * 1e6).astype(np.int64)
    nearest = sent[np.clip(np.searchsorted(sent, window), 0, len(sent) - 1)]
    before = sent[np.clip(np.searchsorted(sent, window) - 1, 0, len(sent) - 1)]
    # Every window request's latency origin is a stamp the server received (the CSV keeps start_s to 1 us).
    assert np.all(np.minimum(np.abs(nearest - window), np.abs(before - window)) <= 2)
