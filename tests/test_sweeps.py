"""Parallel jobs sharing one machine: the variant cache (two real `run.py` processes, and a real joblib
multirun sweep), a fresh sqlite MLflow store, and a server port.

The runs use the smoke preset cut down to what the cache and the tracking store see (small data, one
epoch, no load test), writing to one sqlite MLflow store and one cache directory at the same time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import make_variant
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from reco.claim import claim, lock_path
from reco.cli.compose import compose
from reco.cli.parallel_jobs import POLICY, ParallelJobs
from reco.serve.config import serve_config
from reco.serve.process import ServerStartError, start_server

ROOT = Path(__file__).resolve().parents[1]
# The smoke preset at the size where a baseline still takes seconds to build (so the jobs overlap).
SMALL = ["experiment=smoke", "loadtest.enabled=false", "data.params.n_rows=20000", "trainer.epochs=1"]


def store_args(tmp_path: Path) -> list[str]:
    return [
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"tracking.artifact_root={tmp_path}/artifacts",
        f"cache_dir={tmp_path}/cache",
    ]


@pytest.mark.timeout(120)
def test_jobs_opening_a_new_sqlite_store_at_once_share_it(tmp_path):
    """MLflow creates a fresh sqlite store's tables without a lock of its own: two jobs opening it at once
    failed here ('duplicate column name', 'table ... already exists') until Tracker claimed the store."""
    for attempt in range(2):  # the race does not fire every time; two fresh stores make a miss unlikely
        uri = f"sqlite:///{tmp_path}/{attempt}/mlflow.db"
        code = f"from reco.tracking import Tracker; print('experiment', Tracker({uri!r}, 'x').experiment_id)"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=100)[0] for p in procs]
        for p, out in zip(procs, outs, strict=True):
            assert p.returncode == 0, out[-3000:]
        ids = {
            line.split()[-1] for out in outs for line in out.splitlines() if line.startswith("experiment ")
        }
        assert len(ids) == 1, outs


HOLDER = """
import sys
import threading
import time
from pathlib import Path
from reco.claim import claim
with claim(Path(sys.argv[1]), "entry"):
    print("holding", flush=True)
    sys.stdin.read()
"""


@pytest.mark.timeout(60)
def test_a_claim_held_by_a_killed_job_is_released(tmp_path, capsys):
    """The waiter names the holder's pid; SIGKILL on the holder (no clean-up code runs) frees the claim."""
    entry = tmp_path / "variants" / "baseline-0123"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(entry)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        acquired = threading.Event()

        def wait_for_it() -> None:
            with claim(entry, "variant 'baseline'"):
                acquired.set()

        waiter = threading.Thread(target=wait_for_it, daemon=True)
        waiter.start()
        out, deadline = "", time.monotonic() + 30
        while "waiting for variant 'baseline'" not in out:  # found the claim held: it blocks from here on
            assert not acquired.is_set(), f"claimed while pid {holder.pid} held it: {out}"
            assert time.monotonic() < deadline, f"the waiter never said it was waiting: {out}"
            time.sleep(0.02)
            out += capsys.readouterr().out
        assert not acquired.is_set()  # the holder is alive: no claim for the waiter
        holder.kill()
        holder.wait(10)
        assert acquired.wait(30)
        waiter.join(10)
    finally:
        if holder.poll() is None:
            holder.kill()
    out += capsys.readouterr().out
    assert f"waiting for variant 'baseline', held by pid {holder.pid} on " in out, out
    assert lock_path(entry).exists()  # left in place (see reco/claim.py)


def child_runs(tmp_path: Path, variant: str) -> list:
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("smoke")
    return client.search_runs([exp.experiment_id], f"tags.variant = '{variant}'")


def recorded_sha256(tmp_path: Path, run_id: str) -> dict[str, str]:
    """The artifact digests in the variant.json the run logged (what that job served and reported)."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    path = client.download_artifacts(run_id, "variant/variant.json", str(tmp_path / "dl" / run_id))
    return json.loads(Path(path).read_text())["sha256"]


def built_dirs(tmp_path: Path, name: str) -> list[Path]:
    return [p for p in (tmp_path / "cache" / "variants").glob(f"{name}-*") if p.is_dir()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_joblib_sweep_runs_jobs_in_parallel_and_shares_the_baseline(tmp_path):
    """The README's sweep: two prune amounts as two parallel joblib jobs on a fresh store, one baseline
    between them: one job builds it while the other waits on its claim and then reuses the finished variant
    (same files, same SHA-256). Without the claim both jobs build it and remove each other's files. (The
    waiting message itself is checked by test_a_claim_held_by_a_killed_job_is_released.)"""
    proc = subprocess.run(
        [
            sys.executable,
            "run.py",
            "-m",
            *SMALL,
            "variants=prune_sweep",
            "prune.amount=0.2,0.4",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            *store_args(tmp_path),
            f"hydra.sweep.dir={tmp_path}/multirun",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        # the environment of a user's shell, not the one conftest gives every test process
        env={k: v for k, v in os.environ.items() if k != POLICY},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"{POLICY}=PASSIVE" in proc.stdout  # the launching process set it (reco.cli.parallel_jobs) ...

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("smoke")
    parents = client.search_runs([exp.experiment_id], "tags.`mlflow.parentRunId` IS NULL")
    assert sorted(r.data.params["prune.amount"] for r in parents) == ["0.2", "0.4"]
    assert all(r.info.status == "FINISHED" for r in parents)
    assert {r.data.tags["env.OMP_WAIT_POLICY"] for r in parents} == {"PASSIVE"}  # ... and each job got it
    # In parallel: separate worker processes, and each job started before the other ended.
    assert len({r.data.tags["reco.owner"] for r in parents}) == 2
    a, b = parents
    assert a.info.start_time < b.info.end_time and b.info.start_time < a.info.end_time

    base = child_runs(tmp_path, "baseline")
    assert sorted(r.data.tags["cached"] for r in base) == ["False", "True"]
    assert all(r.info.status == "FINISHED" for r in base)
    assert len(built_dirs(tmp_path, "baseline")) == 1
    sha = [recorded_sha256(tmp_path, r.info.run_id) for r in base]
    assert sha[0] == sha[1] and sha[0]["torch"]
    pruned = child_runs(tmp_path, "pruned")
    assert sorted(r.data.params["step_config.amount"] for r in pruned) == ["0.2", "0.4"]
    assert all(r.info.status == "FINISHED" and r.data.tags["cached"] == "False" for r in pruned)
    assert len(built_dirs(tmp_path, "pruned")) == 2
    assert pruned[0].data.metrics["params"] != pruned[1].data.metrics["params"]
    for job in (0, 1):  # each job's own report, inside its own sweep directory
        assert (tmp_path / "multirun" / str(job) / "report" / "report.md").exists()


# Another job's server on a port: answers /healthz with its own pid, its socket bound with SO_REUSEPORT
# (as reco's workers bind theirs), until its stdin closes.
FOREIGN_SERVER = """
import json, os, socket, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"pid": os.getpid()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

class Server(HTTPServer):
    def server_bind(self):
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

s = Server(("127.0.0.1", 0), Health)
print(s.server_address[1], flush=True)
threading.Thread(target=s.serve_forever, daemon=True).start()
sys.stdin.read()
"""


@pytest.mark.timeout(120)
def test_a_port_another_process_serves_is_refused_not_measured(tiny_data, tmp_path):
    """Two jobs' servers on one port (the OS handed both the same free port): the one that finds the
    other answering its /healthz stops with a message naming that pid, instead of reporting ready and
    having the other server's latency measured as its own."""
    foreign = subprocess.Popen(
        [sys.executable, "-c", FOREIGN_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(foreign.stdout.readline())
        vdir, dpath = make_variant(tiny_data, tmp_path, onnx=True)
        settings = serve_config(compose(["serve.keep_warm=false"]).serve)
        with pytest.raises(ServerStartError, match=rf"answered by pid {foreign.pid}, not by this server"):
            start_server(vdir, dpath, settings, port=port, work_dir=tmp_path / "server")
    finally:
        foreign.stdin.close()
        foreign.wait(10)


JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"  # hydra/launcher=joblib


@pytest.mark.parametrize(
    ("launcher", "user_value", "expected"),
    [
        ({"_target_": JOBLIB, "n_jobs": 2}, None, "PASSIVE"),
        ({"_target_": JOBLIB, "n_jobs": -1}, None, "PASSIVE"),
        ({"_target_": JOBLIB, "n_jobs": 1}, None, None),
        ({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}, None, None),
        ({"_target_": JOBLIB, "n_jobs": 2}, "ACTIVE", "ACTIVE"),
    ],
)
def test_passive_openmp_waiting_only_for_jobs_side_by_side(monkeypatch, launcher, user_value, expected):
    monkeypatch.delenv(POLICY, raising=False)
    if user_value:
        monkeypatch.setenv(POLICY, user_value)
    ParallelJobs().on_multirun_start(OmegaConf.create({"hydra": {"launcher": launcher}}))
    assert os.environ.get(POLICY) == expected
