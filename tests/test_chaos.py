"""Kills: `run.py experiment=smoke` SIGKILLed at random points, then SIGTERMed, then run to the end.

After every kill no process it started survives (servers, their workers, Locust, keep-warm spinners);
the next run reuses every variant that had finished, rebuilds what had not, and closes the MLflow runs the
killed process left RUNNING (status KILLED, reason in the tag `reco.end_reason`).

Each kill lands a random time after a phase of the run began (training, a step, the last step or the
servers' start, Locust running), so every trial hits a different kind of work (pruning is not a trial of
its own: an in-process step like distilling, and each trial costs a run.py start); the smoke pipeline is
made smaller (less data, one epoch, two variants load-tested) so that every phase comes within seconds.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import marked_alive, marked_env, premade_store
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
SMALLER = [
    "data.params.n_rows=8000",
    "trainer.epochs=1",
    "loadtest.study.variants=[baseline,distilled_onnx_int8_batched]",
    "loadtest.study.common_rate=150",
    "quality.users=0",  # what users see is tested end to end in test_pipeline; here it would only cost time
    # Neither is a phase a kill aims at, and each re-run would redo them: the profile of every variant
    # (4 runs reach it) and the unrecorded settling traffic before the load study's first window.
    "profile.enabled=false",
    "loadtest.study.settle_s=0",
    # The load-test windows' unrecorded start (the preset's 0.5 s): a kill aims at Locust running, not at it.
    "loadtest.warmup_s=0.2",
    "loadtest.capacity.step_warmup_s=0.2",
]
VARIANTS = 4  # the smoke preset's chain (its batched row is a serving, not a variant)
# (line that starts a phase, longest random wait after it): one SIGKILL trial each, then the SIGTERM one.
KILLS = [
    ("[variant 1/4]", 3.0),  # training the baseline
    ("[variant 3/4]", 2.0),  # a step in process: distilling (or the steps after it)
    ("[variant 4/4]", 5.0),  # the last step, or the load study starting its servers
    ("[load] unloaded", 3.0),  # Locust running against a server
]
TERM = ("[load] capacity", 2.0)  # Locust stepping through a capacity search
pytestmark = pytest.mark.timeout(900)


def start(tmp: Path, mark: str, *extra: str) -> subprocess.Popen:
    args = [
        "experiment=smoke",
        *SMALLER,
        *extra,
        f"tracking.uri=sqlite:///{tmp}/mlflow.db",
        f"tracking.artifact_root={tmp}/artifacts",
        f"cache_dir={tmp}/cache",
        f"report_dir={tmp}/report",
        f"hydra.run.dir={tmp}/out",
    ]
    log = open(tmp / "run.log", "ab")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [sys.executable, "run.py", *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=marked_env(mark),
    )


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


def kill_in_phase(tmp: Path, phase: str, wait_s: float, sig: int) -> tuple[set[str], list[str]]:
    """Start run.py, send `sig` `wait_s` after the line `phase` appears in its log; return (variants
    finished before the signal, processes it started that outlived it)."""
    log, offset = tmp / "run.log", (tmp / "run.log").stat().st_size if (tmp / "run.log").exists() else 0
    mark = uuid.uuid4().hex
    proc = start(tmp, mark)
    seen: dict[int, psutil.Process] = {}
    t_end = time.time() + 600
    while time.time() < t_end and proc.poll() is None:
        for p in descendants(proc):  # every child ever started (also found by its mark below)
            seen.setdefault(p.pid, p)
        if phase in log.read_text(errors="replace")[offset:]:
            t_end = min(t_end, time.time() + wait_s)
        time.sleep(0.1)
    assert proc.poll() is None, f"run.py ended before {phase!r} + {wait_s:.1f} s:\n{log.read_text()[-3000:]}"
    done_before = finished_variants(tmp)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    # A process that shuts down gracefully (Locust, a server draining) may take a while; none may stay.
    return done_before, survivors(list(seen.values()), within_s=30.0) + marked_alive(mark, within_s=5.0)


@pytest.mark.slow
def test_kills_leave_no_orphans_and_the_rerun_completes(tmp_path):
    premade_store(tmp_path)  # the kills are under test, not MLflow making its tables
    rng = random.Random(0)
    for phase, most in KILLS:
        t = rng.uniform(0, most)
        done, alive = kill_in_phase(tmp_path, phase, t, signal.SIGKILL)
        assert not alive, f"SIGKILL {t:.1f} s after {phase!r} left {alive}"
    phase, most = TERM
    done, alive = kill_in_phase(tmp_path, phase, rng.uniform(0, most), signal.SIGTERM)
    assert not alive, f"SIGTERM after {phase!r} left {alive}"
    assert len(done) == VARIANTS, done  # the last kills came during the load study

    log_start = (tmp_path / "run.log").stat().st_size
    proc = start(tmp_path, uuid.uuid4().hex, "loadtest.enabled=false")  # the load study was killed above
    assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    out = (tmp_path / "run.log").read_text()[log_start:]
    for name in done:  # everything that had finished is reused, not rebuilt
        assert f"reusing finished variant {tmp_path}/cache/variants/{name}" in out, name
    assert out.count("reusing finished variant") == VARIANTS

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert not [r.info.run_id for r in runs if r.info.status == "RUNNING"]
    killed = [r for r in runs if r.info.status == "KILLED"]
    assert killed and all("interrupted" in r.data.tags.get("reco.end_reason", "") for r in killed)
