"""Distributed load generation (loadtest.workers): a real Locust master + 2 workers on 127.0.0.1 against
the tiny real HTTP server of test_loadtest_generator; merged records, every worker judged, lost workers."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pytest
from test_loadtest_generator import _alive, _descendants, lt, stub  # noqa: F401 (fixtures)

from reco.cli.compose import compose
from reco.loadtest.config import LoadMode
from reco.loadtest.distributed import merge_records, window_share, worker_file
from reco.loadtest.histogram import read_latencies
from reco.loadtest.runner import LoadTestError, plan_cpus, run_load, with_settings

pytestmark = pytest.mark.timeout(300)


def _summaries(out: Path, n: int) -> list[dict]:
    return [
        json.loads(Path(f"{worker_file(out / 'latencies.csv', i)}.summary.json").read_text())
        for i in range(n)
    ]


def test_two_workers_merge_into_one_exact_record(stub, lt, tmp_path):  # noqa: F811
    s = with_settings(lt, workers=2, mode=LoadMode.open, rate=200.0, window_requests=301)
    run = run_load(stub.url, s, tmp_path / "open", kind="workers", reports=False)
    assert run.n == 301 and run.n_failed == 0  # (valid: tested below; a busy CI machine may lag)
    assert stub.count >= 301 and run.params["loadtest.workers"] == 2
    w = _summaries(tmp_path / "open", 2)
    # Two processes, each its share of the window at half the rate; the merge holds every request.
    assert [x["index"] for x in w] == [0, 1] and w[0]["pid"] != w[1]["pid"]
    assert [x["n_window"] for x in w] == [151, 150] and [x["open"]["rate"] for x in w] == [100.0, 100.0]
    parts = [read_latencies(worker_file(tmp_path / "open" / "latencies.csv", i)) for i in range(2)]
    merged = read_latencies(tmp_path / "open" / "latencies.csv")
    assert len(merged) == sum(len(p) for p in parts) == 301
    both = np.sort(np.concatenate([p.latency_ms for p in parts]))
    assert np.allclose(np.sort(merged.latency_ms), both, atol=1e-4)  # exact values, not buckets
    assert np.all(np.diff(merged.start_s) >= 0)
    # Each worker's own schedule (scheduled send times, not timings) runs at rate/2 (mean gap 10 ms;
    # +-33% is > 4 standard errors at n=150).
    gaps = [np.diff(np.sort(p.start_s)) for p in parts]
    assert all(1 / 133 < g.mean() < 1 / 75 for g in gaps), [g.mean() for g in gaps]

    # Closed loop: the users split across the workers; the window is still exactly n requests.
    s = with_settings(lt, workers=2, mode=LoadMode.closed, users=4, window_requests=200)
    run = run_load(stub.url, s, tmp_path / "closed", kind="workers", reports=False)
    assert run.n == 200 and [x["n_window"] for x in _summaries(tmp_path / "closed", 2)] == [100, 100]


def test_every_worker_is_held_to_the_generator_budget(stub, lt, tmp_path):  # noqa: F811
    budget = replace(lt.loadgen, max_cpu_pct=0.0, max_lag_ms=0.0)
    s = with_settings(lt, workers=2, mode=LoadMode.open, rate=200.0, window_requests=200, loadgen=budget)
    run = run_load(stub.url, s, tmp_path, reports=False)
    assert not run.valid
    for i in (0, 1):
        assert re.search(
            rf"CPU \d+% on Locust worker index {i} \(pid \d+\) > loadtest.loadgen.max_cpu_pct=0",
            run.invalid_reason,
        )
        assert re.search(
            rf"lag p99 [\d.]+ ms on Locust worker index {i} .* > loadtest.loadgen.max_lag_ms=0",
            run.invalid_reason,
        )
    assert run.loadgen_cpu_pct >= max(x["cpu_pct"] for x in _summaries(tmp_path, 2)) > 0


def _worker_pids(root: int) -> list[int]:
    return [p.pid for p in psutil.Process(root).children(recursive=True) if "--worker" in p.cmdline()]


def _window_ran_its_course(out: Path, i: int, length_s: float) -> bool:
    """Whether worker i closed its window on schedule: its record of the window's end (written when the
    window closes, on time or when the test is stopped) lies `length_s` or more after its start."""
    rec = worker_file(out / "latencies.csv", i)
    end = Path(f"{rec}.window_end")
    text = end.read_text().strip() if end.exists() else ""  # empty: killed as it wrote, mid-window
    return bool(text) and float(text) - float(Path(f"{rec}.started").read_text()) >= length_s


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_worker_fails_the_run_and_leaves_nothing_running(stub, lt, tmp_path, how):  # noqa: F811
    """SIGKILL: the runner sees the worker exit. SIGSTOP (a hung or unreachable worker, as on another
    machine): the master misses its heartbeats and ends the test itself, naming it. Either way the run
    stops then, mid-window, not when the 60 s window would have ended."""
    s = with_settings(
        lt, workers=2, mode=LoadMode.closed, users=2, window_requests=None, duration_s=60.0, warmup_s=0.0
    )
    victim: list[int] = []

    def strike() -> None:
        deadline = time.monotonic() + 120  # bounds the polls below; an unmet one leaves no victim
        records = [worker_file(tmp_path / "latencies.csv", i) for i in (0, 1)]
        while not all(Path(f"{r}.started").exists() for r in records):  # no warm-up: the window is open
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        answered = stub.count
        while stub.count < answered + 20:  # ... and load is flowing in it
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        pid = _worker_pids(os.getpid())[0]
        victim.append(pid)
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)

    before = _descendants()
    t = threading.Thread(target=strike, daemon=True)
    t.start()
    with pytest.raises(LoadTestError) as e:
        run_load(stub.url, s, tmp_path, reports=False)
    t.join(5)
    assert victim
    # Stopped before the window ended: no worker's record shows a window that ran its 60 s.
    assert not [i for i in (0, 1) if _window_ran_its_course(tmp_path, i, s.duration_s)]
    msg = str(e.value)
    if how == "killed":
        assert re.search(rf"Locust worker \d of 2 \(pid {victim[0]}\) exited with code -9", msg), msg
    else:
        assert re.search(r"Locust worker\(s\) \[\d\] lost mid-run .*reported by the Locust master", msg), msg
    assert "not counted" in msg
    assert not [p for p in _descendants() - before if _alive(p)]


def test_workers_config_is_checked(lt, tmp_path):  # noqa: F811
    assert compose(["loadtest.workers=2"]).loadtest.workers == 2
    with pytest.raises(Exception, match="workers"):
        compose(["loadtest.workers=two"])
    bad = with_settings(lt, workers=2, mode=LoadMode.closed, users=3, window_requests=10)
    with pytest.raises(ValueError, match=r"loadtest.users=3 with loadtest.workers=2: .* multiple of 2"):
        run_load("http://127.0.0.1:9", bad, tmp_path, reports=False)
    with pytest.raises(ValueError, match="loadtest.workers: expected >= 1"):
        run_load("http://127.0.0.1:9", with_settings(lt, workers=0), tmp_path, reports=False)
    server, gen = plan_cpus(2)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 3:
        assert gen == cores[:2] and server == cores[2:]
    elif len(cores) == 2:  # not enough cores: the server keeps one of its own
        assert gen == cores[:1] and server == cores[1:]


def test_merge_rebases_times_and_sums_counts(tmp_path):
    lat = tmp_path / "latencies.csv"
    for i, (t0, rows) in enumerate(
        [(100.0, ["0.5,1.0,1,200", "0.7,2.0,0,503"]), (100.25, ["0.3,3.0,1,200"])]
    ):
        w = worker_file(lat, i)
        w.write_text("start_s,latency_ms,ok,status\n" + "\n".join(rows) + "\n")
        s = {"index": i, "pid": i, "cpu_pct": 10.0, "mode": "open", "t0_epoch": t0, "window_end_epoch": t0 + 1,
             "warmup_s": 0.0, "duration_s": 0.0, "payloads": 5, "window_requests": len(rows),
             "n_window": len(rows), "n_recorded": len(rows), "unanswered": i, "n_all": 9,
             "open": {"rate": 50.0, "overflow": 0, "lag_p99_ms": 1.0 + i, "lag_max_ms": 4.0}}  # fmt: skip
        Path(f"{w}.summary.json").write_text(json.dumps(s))
    m = merge_records(lat, 2)
    merged = read_latencies(lat)
    assert merged.start_s.tolist() == [0.5, 0.55, 0.7] and merged.latency_ms.tolist() == [1.0, 3.0, 2.0]
    assert m["t0_epoch"] == 100.0 and m["window_end_epoch"] == 101.25 and m["n_window"] == 3
    assert m["unanswered"] == 1 and m["open"]["rate"] == 100.0 and m["open"]["lag_p99_ms"] == 2.0
    assert [window_share(301, i, 2) for i in (0, 1)] == [151, 150] and window_share(0, 1, 2) == 0
    Path(f"{worker_file(lat, 1)}.summary.json").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"latencies.w1.csv.summary.json: Locust worker 1 wrote no record"
    ):
        merge_records(lat, 2)
