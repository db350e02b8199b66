"""Faults inside the service, on real servers: a slow model call, a dying batcher, a model scoring NaN.

The slow model and the dying batcher come from serve.faults (test-only settings, 0 in conf/serve); the
NaN model is a real variant whose weights are NaN.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import make_variant
from test_serve import Client, expected_scores, scores, serve_settings

from reco.serve.process import start_server, stop_servers
from reco.variant import Variant

pytestmark = pytest.mark.timeout(240)

BODY = {"user_id": 7, "k": 10, "candidates": [5, 17, 300, 999, 42]}
DELAY_S, TIMEOUT_S = 6.0, 1.5  # a slowed call takes 4x the timeout: no timing race in the assertions


@pytest.fixture(scope="module")
def faulty(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    vdir, dpath = make_variant(tiny_data, root)
    nan_root = root / "nan"
    nan_root.mkdir()
    nan_vdir, _ = make_variant(tiny_data, nan_root)
    v = Variant.load(nan_vdir)
    model = v.load_torch()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    v.save_torch(model)
    v.save()
    slow = [f"model_timeout_s={TIMEOUT_S}", f"faults.model_delay_s={DELAY_S}", "faults.slow_calls=1"]
    specs = {
        "slow": (vdir, slow),
        "batcher": (vdir, [*slow, "batching.enabled=true", "faults.batcher_crashes=1"]),
        "nan": (nan_vdir, []),
    }
    handles = {
        name: start_server(v, dpath, serve_settings("keep_warm=false", *o), wait=False, work_dir=root / name)
        for name, (v, o) in specs.items()
    }
    try:
        for h in handles.values():
            h.wait_ready(timeout_s=180)
        yield {"handles": handles, "vdir": vdir, "data": tiny_data, "cfg": serve_settings()}
    finally:
        stop_servers(list(handles.values()))


def _until_ok(c: Client, body: dict, attempts: int = 60) -> tuple[list[int], dict]:
    """Send `body` until it is answered 200 (bounded); the statuses seen and the 200 answer."""
    seen = []
    for _ in range(attempts):
        status, _, resp = c.recommend(body)
        seen.append(status)
        if status == 200:
            return seen, resp
        time.sleep(0.2)
    raise AssertionError(f"no 200 in {attempts} attempts: {seen}")


def test_slow_model_call_is_a_504_and_the_server_recovers(faulty):
    h = faulty["handles"]["slow"]
    c = Client(h.url)
    status, _, resp = c.recommend(BODY)  # the slowed call
    assert status == 504 and "model_timeout_s" in resp["error"], resp
    seen, resp = _until_ok(c, BODY)  # calls queued behind the stuck one may time out too, then 200
    assert set(seen) <= {504, 200}
    want = expected_scores(faulty["vdir"], faulty["data"], faulty["cfg"], BODY)
    got = scores(resp)
    assert got.keys() == want.keys() and all(abs(got[i] - want[i]) < 1e-5 for i in want)
    assert all(c.recommend(BODY)[0] == 200 for _ in range(5))
    assert "Traceback" not in h.log_path.read_text()
    c.close()


def test_dead_batcher_fails_its_requests_fast_and_is_restarted(faulty):
    """The batcher task dies on its first batch: that request gets 503 at once (it used to wait forever,
    and so did every later one); the restarted batcher serves the rest."""
    h = faulty["handles"]["batcher"]
    c = Client(h.url)
    status, headers, resp = c.recommend(BODY)
    assert status == 503 and "batcher failed" in resp["error"] and headers["retry-after"] == "1", resp
    status, _, resp = c.recommend(BODY)  # the restarted batcher's first call is the slowed one
    assert status == 504, resp
    seen, resp = _until_ok(c, BODY)
    assert set(seen) <= {504, 200}
    want = expected_scores(faulty["vdir"], faulty["data"], faulty["cfg"], BODY)
    got = scores(resp)
    assert got.keys() == want.keys() and all(abs(got[i] - want[i]) < 1e-5 for i in want)
    assert h.health()["batcher_restarts"] == 1
    log = h.log_path.read_text()
    assert log.count("dynamic batcher died") == 1 and log.count("Traceback") <= 1
    c.close()


def test_non_finite_scores_are_a_generic_500_with_one_log_line(faulty):
    """orjson writes NaN as null: the NaN model's answers were 200 with "score": null."""
    h = faulty["handles"]["nan"]
    c = Client(h.url)
    for _ in range(3):
        status, _, resp = c.recommend(BODY)
        assert status == 500 and resp == {"error": "internal error (logged by the server)", "field": ""}
    log = h.log_path.read_text()
    assert log.count("recommend failed: RuntimeError: model tiny returned non-finite scores") == 3
    assert "Traceback" not in log
    assert c.request("GET", "/healthz")[0] == 200
    c.close()
