"""Load tests end to end: a real server process, real headless Locust processes, a real MLflow store."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import make_variant
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from reco.config import compose
from reco.loadtest.capacity import _next_rate, find_capacity, resolve_slo, slo_from_reference
from reco.loadtest.histogram import percentiles, read_latencies
from reco.loadtest.requests import request_bodies, write_requests
from reco.loadtest.runner import LoadTestError, plan_cpus, run_load
from reco.serve.process import start_server
from reco.tracking import log_to_run

pytestmark = pytest.mark.timeout(300)

METRICS = (
    "e2e_p50_ms",
    "e2e_p90_ms",
    "e2e_p95_ms",
    "e2e_p99_ms",
    "e2e_p999_ms",
    "qps",
    "error_rate",
    "n_requests",
    "n_failures",
    "loadgen_cpu_pct",
    "valid",
)


def load_settings_for_test(**over) -> dict:
    s = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "conf/loadtest/default.yaml"))
    s.update(warmup_s=1, drain_s=1, **over)
    return s


@pytest.fixture(scope="module")
def server(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("lt")
    vdir, dpath = make_variant(tiny_data, root)
    requests = write_requests(dpath, root / "requests.jsonl", n=2000, k=10, seed=0)
    h = start_server(vdir, dpath, compose(["serve.n_candidates=200"]).serve, work_dir=root / "server")
    try:
        yield {"url": h.url, "requests": requests, "data": tiny_data}
    finally:
        h.stop()


def test_request_file_replays_test_rows(tiny_data, tmp_path):
    path = write_requests(tiny_data, tmp_path / "r.jsonl", n=500, k=7, seed=1)
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert len(lines) == 500 and all(set(b) == {"user_id", "context", "k"} and b["k"] == 7 for b in lines)
    s, te = tiny_data.schema, tiny_data.test
    rows = {
        (int(r[s.index("user_id"), 0]), int(r[s.index("hour"), 0]), int(r[s.index("device"), 0]))
        for r in te.ids
    }
    assert all((b["user_id"], b["context"]["hour"], b["context"]["device"]) in rows for b in lines)
    # Heavy users come back, as in the log (not one repeated request, not uniform users).
    users = [b["user_id"] for b in lines]
    assert 1 < len(set(users)) < len(users)
    assert request_bodies(tiny_data, 5, 7, 1) == lines[:5]  # seeded: reproducible


def test_closed_loop_exact_percentiles_land_in_mlflow(server, tmp_path):
    settings = load_settings_for_test(mode="closed", users=2, duration_s=7)
    res = run_load(server["url"], settings, tmp_path / "closed", server["requests"], cpus=None)
    m = res.metrics
    assert set(METRICS) <= set(m)
    assert m["n_requests"] > 100 and m["n_failures"] == 0 and m["error_rate"] == 0.0
    assert m["e2e_p50_ms"] <= m["e2e_p90_ms"] <= m["e2e_p95_ms"] <= m["e2e_p99_ms"] <= m["e2e_p999_ms"]
    assert m["valid"] in (0.0, 1.0) and 0 < m["loadgen_cpu_pct"] < 200
    for stage in ("features", "retrieval", "rank", "queue", "total"):
        assert m[f"server_{stage}_mean_ms"] > 0 and m[f"server_{stage}_p99_ms"] > 0

    # Exact: the percentiles are observed latencies of the raw file (nearest rank), recomputed here.
    lat_file = tmp_path / "closed" / "latencies.csv"
    with open(lat_file) as f:
        raw = sorted(float(r["latency_ms"]) for r in csv.DictReader(f) if r["ok"] == "1")
    assert len(raw) == m["n_requests"]
    for name, p in (("p50", 50), ("p99", 99), ("p999", 99.9)):
        assert m[f"e2e_{name}_ms"] == raw[math.ceil(p / 100 * len(raw)) - 1]
    # Every request Locust counted (its final stats) was recorded by the hook, warm-up and drain included.
    summary = json.loads(Path(f"{lat_file}.summary.json").read_text())
    final = json.loads((tmp_path / "closed" / "locust_stats.json").read_text())
    assert summary["n_all"] == sum(e["num_requests"] for e in final)
    names = {p.name for p in res.artifacts}
    assert {"locust_stats.csv", "locust_report.html", "latencies.csv", "latency_cdf.png"} <= names
    assert all(p.exists() and p.stat().st_size > 0 for p in res.artifacts)

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("lt", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(exp).info.run_id
    log_to_run(run_id, res.metrics, res.params, res.artifacts, uri, subdir="loadtest")
    logged = client.get_run(run_id).data
    for name in METRICS:
        assert logged.metrics[name] == pytest.approx(m[name], rel=1e-12)
    assert logged.params["loadtest.mode"] == "closed"
    arts = {a.path for a in client.list_artifacts(run_id, "loadtest")}
    assert "loadtest/latency_cdf.png" in arts and "loadtest/latencies.csv" in arts


def test_open_loop_poisson_arrivals_timed_from_schedule(server, tmp_path):
    settings = load_settings_for_test(mode="open", rate=40.0, duration_s=4)
    res = run_load(server["url"], settings, tmp_path / "open", server["requests"])
    m = res.metrics
    # 4 s at 40 req/s: Poisson count 160 +- 13; far outside this range means the schedule is wrong.
    assert 100 <= m["n_requests"] <= 220 and m["error_rate"] == 0.0
    assert m["offered_qps"] == 40.0 and m["loadgen_overflow"] == 0
    summary = json.loads((tmp_path / "open" / "latencies.csv.summary.json").read_text())
    assert summary["open"]["scheduled"] == m["n_requests"]  # every scheduled arrival was answered
    lat = read_latencies(tmp_path / "open" / "latencies.csv")
    gaps = np.diff(np.sort(lat.start_s))
    # Exponential inter-arrival times: coefficient of variation ~1 (a fixed-rate loop would give ~0).
    assert 0.6 < gaps.std() / gaps.mean() < 1.5
    assert percentiles(lat.ok_ms)["p99"] == m["e2e_p99_ms"]


def test_capacity_search_returns_a_finite_rate(server, tmp_path):
    cap = {
        **load_settings_for_test()["capacity"],
        "start_rate": 20,
        "growth": 2.0,
        "max_rate": 40,
        "steps": 3,
        "step_duration_s": 2,
        "step_warmup_s": 1,
    }
    # Only the search is under test here: a busy CI machine must not void its steps.
    settings = load_settings_for_test(capacity=cap)
    settings["loadgen"] = {**settings["loadgen"], "max_cpu_pct": 1000, "max_lag_ms": 1000}
    res = find_capacity(
        server["url"],
        settings,
        slo_p99_ms=5_000.0,
        out_dir=tmp_path / "cap",
        requests_path=server["requests"],
    )
    assert math.isfinite(res.max_qps_at_slo) and res.max_qps_at_slo == 40.0
    assert [s["rate"] for s in res.steps] == [20.0, 40.0] and all(s["passed"] for s in res.steps)
    assert res.achieved_qps > 0 and "| 1 | 40.0 |" in res.table()


def test_capacity_search_logic_brackets_then_bisects():
    """The rate sequence against a server that meets the SLO up to 300 req/s."""
    limit, best, fail, rate, seen = 300.0, 0.0, math.inf, 50.0, []
    for _ in range(12):
        ok = rate <= limit
        seen.append(rate)
        best, fail = (max(best, rate), fail) if ok else (best, min(fail, rate))
        nxt = _next_rate(rate, ok, best, fail, 2.0, 5.0, 5000.0, 0.05)
        if nxt is None:
            break
        rate = nxt
    assert seen[:4] == [50.0, 100.0, 200.0, 400.0]
    assert best <= limit < fail and (fail - best) / fail <= 0.05
    # Nothing passes: halves down to min_rate, then stops with 0.
    best, fail, rate, n = 0.0, math.inf, 50.0, 0
    while rate is not None and n < 12:
        fail, n = min(fail, rate), n + 1
        rate = _next_rate(rate, False, best, fail, 2.0, 5.0, 5000.0, 0.05)
    assert best == 0.0 and fail == 5.0


def test_slo_resolution():
    assert slo_from_reference(12.5, 2.0) == 25.0
    assert resolve_slo({"slo_p99_ms": 40, "slo_factor": 2.0}, None) == 40.0
    assert resolve_slo({"slo_p99_ms": None, "slo_factor": 3.0}, 10.0) == 30.0
    with pytest.raises(ValueError, match="slo_p99_ms is null"):
        resolve_slo({"slo_p99_ms": None, "slo_factor": 2.0}, None)


def test_plan_cpus_separates_server_and_generator():
    server, loadgen = plan_cpus()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        assert (server, loadgen) == (None, None)
    else:
        assert loadgen and server and not set(loadgen) & set(server) and sorted(loadgen + server) == cores


def test_locust_failure_is_reported_with_its_log(tmp_path):
    with pytest.raises(FileNotFoundError, match="request file"):
        run_load("http://127.0.0.1:9", load_settings_for_test(), tmp_path, tmp_path / "missing.jsonl")
    bad = tmp_path / "empty.jsonl"
    bad.write_text("\n")
    with pytest.raises(LoadTestError, match="no requests in the file"):
        run_load("http://127.0.0.1:9", load_settings_for_test(), tmp_path, bad)
