"""Kills: `run.py experiment=smoke` SIGKILLed at random points, then SIGTERMed, then run to the end.

After every kill no process it started survives (servers, their workers, Locust, keep-warm spinners);
the next run reuses every variant that had finished, rebuilds what had not, and closes the MLflow runs the
killed process left RUNNING (status KILLED, reason in the tag `reco.end_reason`).
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
TRIALS = 5
pytestmark = pytest.mark.timeout(900)


def start(tmp: Path, *extra: str) -> subprocess.Popen:
    args = [
        "experiment=smoke",
        *extra,
        f"tracking.uri=sqlite:///{tmp}/mlflow.db",
        f"tracking.artifact_root={tmp}/artifacts",
        f"cache_dir={tmp}/cache",
        f"report_dir={tmp}/report",
        f"hydra.run.dir={tmp}/out",
    ]
    log = open(tmp / "run.log", "ab")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen([sys.executable, "run.py", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def survivors(procs: list[psutil.Process], within_s: float) -> list[str]:
    deadline = time.time() + within_s
    while time.time() < deadline:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return [" ".join(p.cmdline()[:4]) for p in alive]


def finished_variants(tmp: Path) -> set[str]:
    return {p.parent.name for p in (tmp / "cache" / "variants").glob("*/FINISHED")}


def kill_after(tmp: Path, seconds: float, sig: int) -> tuple[set[str], list[str]]:
    """Start run.py, send `sig` after `seconds` (or when it ends), return (finished before, survivors)."""
    proc = start(tmp)
    seen: dict[int, psutil.Process] = {}
    t_end = time.time() + seconds
    while time.time() < t_end and proc.poll() is None:
        for p in descendants(proc):  # remember every child ever started: the kill must take them all
            seen.setdefault(p.pid, p)
        time.sleep(0.1)
    done_before = finished_variants(tmp)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    return done_before, survivors(list(seen.values()), within_s=10.0)


def test_kills_leave_no_orphans_and_the_rerun_completes(tmp_path):
    rng = random.Random(0)
    for t in sorted(rng.uniform(3, 40) for _ in range(TRIALS)):
        done, alive = kill_after(tmp_path, t, signal.SIGKILL)
        assert not alive, f"SIGKILL after {t:.0f} s left {alive}"
    done, alive = kill_after(tmp_path, 25, signal.SIGTERM)
    assert not alive, f"SIGTERM left {alive}"

    log_start = (tmp_path / "run.log").stat().st_size
    proc = start(tmp_path, "loadtest.enabled=false")  # the load study was killed above; this checks the state
    assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    out = (tmp_path / "run.log").read_text()[log_start:]
    for name in done:  # everything that had finished is reused, not rebuilt
        assert f"reusing finished variant {tmp_path}/cache/variants/{name}" in out, name

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert not [r.info.run_id for r in runs if r.info.status == "RUNNING"]
    killed = [r for r in runs if r.info.status == "KILLED"]
    assert killed and all("interrupted" in r.data.tags.get("reco.end_reason", "") for r in killed)
