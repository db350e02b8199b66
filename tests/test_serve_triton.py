"""serve.backend=triton: a real Triton Inference Server (PyTriton) on 127.0.0.1 serving a tiny real variant.

Answers over KServe v2 are checked against reco's own server and against offline scoring; a real Locust
window runs against it; a taken port, a missing interpreter and the wrong interpreter are refused with
messages naming the setting. The server runs in .venv-triton; when it is missing the module builds it
with `make triton-venv` (~30 s, see README "Serving with Triton").
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import make_variant

from reco.cli.compose import compose
from reco.data.schema import Dataset
from reco.loadtest.config import LoadMode, loadtest_config
from reco.loadtest.interleave import Target, run_interleaved
from reco.loadtest.requests import write_requests
from reco.loadtest.runner import run_load, with_settings
from reco.loadtest.triton_stats import scrape_stats, stats_summary
from reco.runtime import load_scorer
from reco.serve.config import ServeConfig, serve_config
from reco.serve.features import FeatureStore
from reco.serve.process import ServerStartError, free_port, start_server, stop_servers
from reco.serve.request import parse_request
from reco.variant import Variant

ROOT = Path(__file__).resolve().parents[1]
# Building .venv-triton the first time (make triton-venv) takes ~30 s; every test after that, seconds.
pytestmark = pytest.mark.timeout(1500)


def serve_settings(*overrides: str) -> ServeConfig:
    """The project's serve settings with `key=value` overrides (keys relative to `serve`)."""
    return serve_config(compose([f"serve.{o}" for o in overrides]).serve)


TRITON = ("backend=triton", "keep_warm=false", "n_candidates=50")


@pytest.fixture(scope="module")
def triton_venv() -> Path:
    """.venv-triton, built with the Makefile's own target when it is missing (CI: a fresh clone)."""
    if not (ROOT / ".venv-triton" / ".installed").exists():
        r = subprocess.run(
            ["make", "triton-venv"], cwd=ROOT, capture_output=True, text=True, timeout=1400, check=False
        )
        assert r.returncode == 0, f"make triton-venv failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return ROOT / ".venv-triton" / "bin" / "python"


@pytest.fixture(scope="module")
def served(triton_venv, tiny_data, tmp_path_factory):
    """reco's server and two Triton servers (plain; dynamic batching with 2 instances) side by side."""
    root = tmp_path_factory.mktemp("triton")
    vdir, dpath = make_variant(tiny_data, root)
    specs = {
        "reco": serve_settings("keep_warm=false", "n_candidates=50"),
        "triton": serve_settings(*TRITON),
        "batched": serve_settings(
            *TRITON,
            "triton.model_name=reco_batched",
            "triton.instances=2",
            "triton.max_batch_size=8",
            "triton.preferred_batch_sizes=[2,4]",
            "batching.enabled=true",
            "batching.max_queue_delay_ms=20.0",
        ),
    }
    handles = {n: start_server(vdir, dpath, s, wait=False, work_dir=root / n) for n, s in specs.items()}
    try:
        for h in handles.values():
            h.wait_ready(timeout_s=240)
        yield {"handles": handles, "vdir": vdir, "dpath": dpath, "root": root}
    finally:
        stop_servers(list(handles.values()))


def post(url: str, body: bytes, timeout_s: float = 30.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def triton_infer(handle, bodies: list[dict]) -> list[dict]:
    """One KServe v2 infer request carrying `bodies` (a batch of len(bodies)); the decoded answers."""
    payload = {
        "inputs": [
            {
                "name": "request",
                "shape": [len(bodies), 1],
                "datatype": "BYTES",
                "data": [json.dumps(b) for b in bodies],
            }
        ]
    }
    status, out = post(f"{handle.url}/v2/models/{handle.triton_model}/infer", json.dumps(payload).encode())
    assert status == 200, out
    (resp,) = [o for o in out["outputs"] if o["name"] == "response"]
    assert resp["shape"] == [len(bodies), 1] and resp["datatype"] == "BYTES"
    return [json.loads(d) for d in resp["data"]]


BODIES = [
    {"user_id": 3, "k": 5},
    {"user_id": 17, "k": 10, "context": {"hour": 9, "device": 1}},
    {"user_id": 999_999, "k": 3},  # cold start
    {"user_id": 5, "k": 4, "candidates": [1, 2, 3, 4, 5, 6, 7, 8, 9]},
]


def offline_top(vdir: Path, data: Dataset, cfg: ServeConfig, body: dict) -> list[tuple[int, float]]:
    """The body's answer computed without any server: feature store, scorer, full sort."""
    store = FeatureStore(data, cfg.retrieval)
    req = parse_request(json.dumps(body).encode(), store, cfg.max_k, cfg.max_candidates)
    urow = store.user_row(req.user_id)
    items = req.candidates if req.candidates is not None else store.candidates(urow, cfg.n_candidates)
    probs = load_scorer(Variant.load(str(vdir)))(*store.assemble(urow, req, items))
    order = np.argsort(-probs, kind="stable")[: req.k]
    return [(int(items[i]), float(probs[i])) for i in order]


def pairs(answer: dict) -> list[tuple[int, float]]:
    return [(i["item_id"], i["score"]) for i in answer["items"]]


def assert_same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> None:
    """Same scores rank by rank (float tolerance), and the same items but where two scores tie within it:
    the batch a server ran a request in changes the last bits of a score, which may swap a near-tie."""
    np.testing.assert_allclose([s for _, s in a], [s for _, s in b], rtol=1e-5, atol=1e-6)
    score_b = dict(b)
    for (ia, sa), (ib, _) in zip(a, b, strict=True):
        if ia != ib:  # a swapped near-tie: b holds ia too (unless the tie sat at the cut-off), at ia's score
            assert ia not in score_b or np.isclose(score_b[ia], sa, rtol=1e-5, atol=1e-6), (ia, ib, a, b)


def test_kserve_answers_equal_reco_server_and_offline_scores(served, tiny_data):
    h = served["handles"]
    cfg = serve_settings(*TRITON)
    answers = triton_infer(h["triton"], BODIES)  # one request with 4 bodies: one model call for all
    for body, got in zip(BODIES, answers, strict=True):
        status, ref = post(f"{h['reco'].url}/recommend", json.dumps(body).encode())
        assert status == 200 and got["model"] == ref["model"] == "tiny"
        assert_same(pairs(got), pairs(ref))
        assert_same(pairs(got), offline_top(served["vdir"], tiny_data, cfg, body))
        assert len(got["items"]) == body["k"]
    # One body per request, as Locust sends them: the same answers.
    for body, got in zip(BODIES, answers, strict=True):
        assert_same(pairs(triton_infer(h["triton"], [body])[0]), pairs(got))


def test_refused_body_answers_reco_error_without_failing_its_batch(served):
    good, bad = BODIES[0], {"user_id": 3, "k": 0}
    a_good, a_bad, a_junk = triton_infer(served["handles"]["triton"], [good, bad, "not an object"])
    assert a_good["items"] and a_bad["status"] == 422 and a_bad["field"] == "k" and "k:" in a_bad["error"]
    assert a_junk["status"] == 422 and a_junk["field"] == "body"


def test_dynamic_batcher_and_instances_from_config(served):
    h = served["handles"]["batched"]
    with urllib.request.urlopen(f"{h.url}/v2/models/{h.triton_model}/config", timeout=10) as r:
        config = json.loads(r.read())
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"]["preferred_batch_size"] == [2, 4]
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 20_000
    assert [g["count"] for g in config["instance_group"]] == [2]
    # Concurrent requests through the batcher and both instances: each gets its own answer.
    before = scrape_stats(h.url, h.triton_model)
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda b: triton_infer(h, [b])[0], BODIES * 4))
    ref = triton_infer(served["handles"]["triton"], BODIES)
    for i, g in enumerate(got):
        assert_same(pairs(g), pairs(ref[i % len(BODIES)]))
    stats = stats_summary(before, scrape_stats(h.url, h.triton_model))
    assert stats["server_failed_requests"] == 0 and stats["server_batch_requests_mean"] >= 1
    assert stats["server_total_mean_ms"] >= stats["server_queue_mean_ms"] > 0


def test_locust_window_over_kserve(served, tiny_data, tmp_path):
    h = served["handles"]["triton"]
    requests = write_requests(tiny_data, tmp_path / "requests.jsonl", n=200, k=10, seed=0)
    c = loadtest_config(compose([]).loadtest)
    settings = with_settings(
        c,
        mode=LoadMode.closed,
        users=2,
        window_requests=120,
        warmup_s=1,
        drain_s=2,
        score_every=10,
        loadgen=dataclasses.replace(c.loadgen, keep_warm=False),
    )
    run = run_load(h.url, settings, tmp_path / "lt", requests, triton_model=h.triton_model)
    assert run.n == 120 and run.n_failed == 0 and np.isfinite(run.latencies_ms).all()
    st = run.server_stages
    assert st["server_total_mean_ms"] > 0 and st["server_compute_infer_mean_ms"] > 0
    assert "server_queue_mean_ms" in st and st["server_failed_requests"] == 0
    # The scores Locust recorded are the variant's: equal to reco's server for the same bodies.
    bodies = [json.loads(ln) for ln in requests.read_text().splitlines()]
    recorded = [
        json.loads(ln) for ln in (tmp_path / "lt" / "latencies.csv.scores.jsonl").read_text().splitlines()
    ]
    assert len(recorded) == 12
    for rec in recorded[:4]:
        status, ref = post(
            f"{served['handles']['reco'].url}/recommend", json.dumps(bodies[rec["payload"]]).encode()
        )
        assert status == 200
        assert_same([tuple(p) for p in rec["items"]], pairs(ref))


def test_request_interleaved_window_over_reco_and_triton(served, tiny_data, tmp_path):
    """loadtest.study.unloaded_interleave=request with a Triton-served variant in the block: one window,
    each server spoken to in its own protocol, each run with its own server's figures."""
    reco_, triton = served["handles"]["reco"], served["handles"]["triton"]
    requests = write_requests(tiny_data, tmp_path / "requests.jsonl", n=200, k=10, seed=0)
    c = loadtest_config(compose([]).loadtest)
    lg = dataclasses.replace(c.loadgen, keep_warm=False, max_cpu_pct=1000)
    settings = with_settings(
        c,
        mode=LoadMode.closed,
        users=1,
        window_requests=60,
        warmup_s=0.5,
        drain_s=2,
        score_every=1,
        loadgen=lg,
    )
    targets = [
        Target("triton", triton.url, tmp_path / "t", triton.triton_model),
        Target("reco", reco_.url, tmp_path / "r"),
    ]
    runs = run_interleaved(targets, settings, requests, None, kind="unloaded", seed=1)
    assert [runs[k].n for k in ("triton", "reco")] == [60, 60]
    assert all(r.n_failed == 0 and np.isfinite(r.latencies_ms).all() for r in runs.values())
    # Triton's own statistics for its run (no rank stage there), reco's /metrics for the other
    assert runs["triton"].server_stages["server_compute_infer_mean_ms"] > 0
    assert "server_rank_mean_ms" not in runs["triton"].server_stages
    assert runs["reco"].server_stages["server_rank_mean_ms"] > 0
    # the same bodies in the same order to both, answered alike by the one model behind both servers
    rec = {
        k: [json.loads(ln) for ln in (tmp_path / k / "latencies.csv.scores.jsonl").read_text().splitlines()]
        for k in "tr"
    }
    assert [x["payload"] for x in rec["t"]] == [x["payload"] for x in rec["r"]] and len(rec["t"]) == 60
    for a, b in zip(rec["t"][:5], rec["r"][:5], strict=True):
        assert_same([tuple(p) for p in a["items"]], [tuple(p) for p in b["items"]])


def test_bad_triton_body_counts_as_failed_request(served, tmp_path):
    h = served["handles"]["triton"]
    requests = tmp_path / "bad.jsonl"
    requests.write_text(json.dumps({"user_id": 1, "k": 0}) + "\n")
    c = loadtest_config(compose([]).loadtest)
    settings = with_settings(
        c, mode=LoadMode.closed, users=1, window_requests=5, warmup_s=0, drain_s=2,
        loadgen=dataclasses.replace(c.loadgen, keep_warm=False),
    )  # fmt: skip
    run = run_load(h.url, settings, tmp_path / "lt", requests, triton_model=h.triton_model, reports=False)
    assert run.n == 5 and run.n_failed == 5 and not run.valid  # nothing succeeded: not a valid result
    rows = (tmp_path / "lt" / "latencies.csv").read_text().splitlines()[1:]
    assert {r.split(",")[3] for r in rows} == {"422"}  # the status inside Triton's 200


PROXY_WAITS = """
from pytriton.models.model import Model
from reco.serve.triton_backend import patient_handshake
fake = type("M", (), {"model_version": 1, "SCRIPT_FILES_TO_COPY": Model.SCRIPT_FILES_TO_COPY})()
before = Model.get_proxy_model_files(fake)["file:1/communication.py"]
patient_handshake()
after = Model.get_proxy_model_files(fake)["file:1/communication.py"]
print(b"timeout_s: float = 1.0)" in before, b"timeout_s: float = 60.0)" in after, len(after) - len(before))
ns = {}
exec(compile(after, "communication.py", "exec"), ns)  # the shipped code still compiles, and it retries:
print(b"except ConnectionRefusedError" in after, "get_config_from_handshake_server" in ns)
"""


def test_shipped_proxy_waits_for_the_first_instance(triton_venv):
    """A model's later instances wait 60 s (not PyTriton's hard-coded 1 s) for the first one's handshake, and retry a refused connect:
    the 1 s failed a CI run's batched (2-instance) model on a busy machine."""
    r = subprocess.run(
        [str(triton_venv), "-c", PROXY_WAITS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    waits, longer, grew, retries, compiles = r.stdout.split()
    assert (waits, longer, retries, compiles) == ("True", "True", "True", "True") and int(grew) > 0, r.stdout


def test_port_taken_names_serve_port(triton_venv, tiny_data, tmp_path):
    vdir, dpath = make_variant(tiny_data, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(ServerStartError) as e:
            start_server(vdir, dpath, serve_settings(*TRITON), port=port, work_dir=tmp_path, timeout_s=120)
    assert f"serve.port={port}" in str(e.value) and "already in use" in str(e.value)


def test_missing_interpreter_names_setting_and_make_target(tiny_data, tmp_path):
    cfg = serve_settings(*TRITON, f"triton.python={tmp_path / 'nowhere' / 'python'}")
    with pytest.raises(ServerStartError) as e:
        start_server(tmp_path, tmp_path / "data.pt", cfg, work_dir=tmp_path)
    assert "serve.triton.python=" in str(e.value) and "make triton-venv" in str(e.value)


def test_wrong_interpreter_is_refused_before_loading(tiny_data, tmp_path):
    # This test's own interpreter: not the system one (pyenv's here), or one without PyTriton.
    vdir, dpath = make_variant(tiny_data, tmp_path)
    cfg = serve_settings(*TRITON, f"triton.python={sys.executable}")
    with pytest.raises(ServerStartError) as e:
        start_server(vdir, dpath, cfg, port=free_port(), work_dir=tmp_path, timeout_s=120)
    msg = str(e.value)
    assert "exited with code 2" in msg and "serve.triton.python=" in msg and "make triton-venv" in msg
