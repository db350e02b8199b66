"""End to end: `run.py experiment=smoke` in a subprocess, then the MLflow store and the report are read."""

import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from conftest import premade_store
from mlflow.tracking import MlflowClient

from reco.cli.compose import compose
from reco.config import ConfigError, resolve_config
from reco.graph import plan
from reco.steps.registry import plain
from reco.tracking import Tracker
from reco.tracking_server import wait_ready

ROOT = Path(__file__).resolve().parents[1]
# Unrecorded traffic before each load-test window (the smoke preset's 0.5 s): 0.2 s, as the study tests
# use; no assertion reads a window's first requests.
SHORT_WARMUP = ("loadtest.warmup_s=0.2", "loadtest.capacity.step_warmup_s=0.2")
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


@contextmanager
def served_mlflow(tmp_path: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    """A real `mlflow server` started as `make mlflow-server` starts it, on a free port, stores in tmp_path:
    (its URL, a function that kills it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    premade_store(tmp_path / "server")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "reco.cli.tracking_server",
            f"tracking.server.port={port}",
            f"tracking.server.backend_store_uri=sqlite:///{tmp_path}/server/mlflow.db",
            f"tracking.server.artifacts_destination={tmp_path}/server/artifacts",
            "tracking.server.workers=1",
        ],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def kill() -> None:  # its graceful shutdown takes ~20 s; nothing here needs it
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    try:
        wait_ready(url, timeout_s=120, alive=lambda: proc.poll() is None)
        kids = [" ".join(c.cmdline()) for c in psutil.Process(proc.pid).children(recursive=True)]
        assert not [k for k in kids if "huey" in k], kids  # tracking.server.job_execution: false
        yield url, kill
    finally:
        kill()


@dataclass(frozen=True)
class MlflowServer:
    url: str
    root: Path  # its sqlite store (root/server/mlflow.db) and artifacts (root/server/artifacts)
    kill: Callable[[], None]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[MlflowServer]:
    """One tracking server for this module's tests that log over HTTP: its start (two processes importing
    MLflow's server, 9-25 s) is paid once. The server-down test kills it, so it comes last in the file;
    each test logs to its own experiment."""
    root = tmp_path_factory.mktemp("mlflow_server")
    with served_mlflow(root) as (url, kill):
        yield MlflowServer(url, root, kill)


def run_py(tmp_path: Path, *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    args = [
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"tracking.artifact_root={tmp_path}/artifacts",
        f"cache_dir={tmp_path}/cache",
        f"report_dir={tmp_path}/report",
        f"hydra.run.dir={tmp_path}/out",
        *overrides,
    ]
    return subprocess.run(
        [sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_plans(preset):
    nodes = plan(resolve_config(compose([f"experiment={preset}"])))
    assert nodes[0].step == "train"
    names = [n.name for n in nodes]
    for n in nodes:  # parents first
        assert n.parent is None or names.index(n.parent) < names.index(n.name)


def graph(variants: dict) -> dict:
    return {**resolve_config(compose()), "variants": variants}


def test_bad_variant_graph_names_the_field():
    with pytest.raises(ConfigError, match=r"variants\.p\.parent: 'nope' is not a variant"):
        plan(graph({"b": {"step": "train"}, "p": {"step": "prune", "parent": "nope"}}))
    with pytest.raises(ConfigError, match=r"variants\.b\.step: expected one of"):
        plan(graph({"b": {"step": "fly"}}))
    with pytest.raises(ConfigError, match=r"variants\.p: .*amount"):
        plan(graph({"b": {"step": "train"}, "p": {"step": "prune", "parent": "b", "amount": "lots"}}))
    with pytest.raises(ConfigError, match=r"variants: cycle"):
        plan(graph({"a": {"step": "prune", "parent": "c"}, "c": {"step": "prune", "parent": "a"}}))


def test_settings_that_must_agree_follow_each_other():
    """The README's `model.embedding_dim=32` alone gives a valid model (bottom's last layer follows)."""
    cfg = compose(["model.embedding_dim=32"])
    assert cfg.model.bottom[-1] == 32
    assert compose(["distill.student.embedding_dim=8"]).distill.student.bottom[-1] == 8
    assert compose(["serve.batching.max_queue_delay_ms=7"]).export.triton.max_queue_delay_ms == 7


def test_presets_share_one_variant_graph():
    """batching_gain reuses the case study's variants from the cache only if their configs agree."""
    a = plan(resolve_config(compose(["experiment=ecommerce_case_study"])))
    b = plan(resolve_config(compose(["experiment=batching_gain"])))
    assert [(n.name, n.step, n.parent, plain(n.config)) for n in a] == [
        (n.name, n.step, n.parent, plain(n.config)) for n in b
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_experiment_end_to_end(tmp_path, mlflow_server):
    """The smoke preset as `make smoke` runs it, logging over HTTP to a real tracking server (the
    embedded store is exercised end to end by tests/test_chaos.py, whose re-run also checks that every
    finished variant is reused), less the settling traffic before the load study (~1.4 s a variant,
    nothing checked here reads it; tests/test_loadtest_study.py covers it) and with 0.2 s of unrecorded
    traffic before each window instead of 0.5 (15 windows)."""
    url = mlflow_server.url
    over = ("experiment=smoke", f"tracking.uri={url}", "loadtest.study.settle_s=0", *SHORT_WARMUP)
    proc = run_py(tmp_path, *over, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    client = MlflowClient(tracking_uri=url)
    exp = client.get_experiment_by_name("smoke")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["variant"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert set(children) == {
        "baseline",
        "pruned",
        "distilled",
        "distilled_onnx_int8",
        "distilled_onnx_int8_batched",
    }
    base = children["baseline"].data.metrics
    assert base["auc"] > 0.6, base  # planted signal: clearly above chance
    assert base["oracle_auc"] >= base["auc"] - 0.02
    for name, run in children.items():
        m = run.data.metrics
        assert run.info.status == "FINISHED", (name, run.data.tags.get("error"))
        for key in (
            "auc",
            "logloss",
            "params",
            "size_mb",
            "rank_p50_ms",
            "e2e_p50_ms",
            "qps",
            "max_qps_at_slo",
        ):
            assert key in m, (name, key, run.data.tags.get("error"), proc.stdout[-3000:])
        # failures count as +inf: with >= 1 % (50 %) failed requests (a busy machine) the pooled p99 (p50) is
        # +inf, which the SQL store keeps as the largest float; a window short of 368 requests has no p99
        p99 = m.get("e2e_p99_ms", math.inf)
        assert p99 >= m["e2e_p50_ms"] > 0, (name, m)
        assert p99 < 1e300 or m["n_failures"] / m["n_requests"] >= 0.01 or m["n_requests"] < 368, (name, m)
        assert run.data.tags["parent_variant"] == (
            "" if name == "baseline" else run.data.tags["parent_variant"]
        )
    # the printed link's view lists them by this tag (reco.pipeline.study_view): the report's row order
    by_row = sorted(children, key=lambda name: children[name].data.tags["reco.row"])
    assert by_row == ["baseline", "pruned", "distilled", "distilled_onnx_int8", "distilled_onnx_int8_batched"]
    assert children["pruned"].data.metrics["params"] < 0.75 * base["params"]
    assert children["distilled_onnx_int8"].data.params["backend"] == "onnxruntime"
    # artifacts went through the server's proxied store, not to a path on this side
    assert not (tmp_path / "artifacts").exists()
    manifest = client.download_artifacts(
        children["distilled"].info.run_id, "variant/variant.json", str(tmp_path)
    )
    assert '"sha256"' in Path(manifest).read_text()
    assert list((mlflow_server.root / "server" / "artifacts").rglob("variant.json"))
    report = (tmp_path / "report" / "report.md").read_text()
    assert "distilled_onnx_int8" in report and "SLO" in report
    # What users see: every variant's served top-k, with its CI, beside the AUC; logged to its run.
    users_see = report.split("## What users see")[1].split("\n## ")[0]
    assert all(f"`{name}`" in users_see for name in children), users_see
    assert all("ndcg_at_10" in r.data.metrics and "gate_quality" in r.data.metrics for r in children.values())
    assert "rbo_at_10" in children["pruned"].data.metrics and "rbo_at_10" not in base
    # the profile table's FLOP floor names the GEMM peak it divides by (measured where the variant was built)
    assert children["distilled"].data.metrics["gemm_peak_gflops"] > 0
    assert "GFLOP/s" in report and "(– GFLOP/s" not in report


def test_unreachable_tracking_server_fails_before_training(tmp_path):
    proc = run_py(tmp_path, "experiment=smoke", "tracking.uri=http://127.0.0.1:9", timeout=120)
    assert proc.returncode != 0
    assert "cannot reach MLflow tracking server" in proc.stderr + proc.stdout
    assert "[variant" not in proc.stdout


@pytest.mark.timeout(300)
def test_a_tracking_server_that_goes_down_mid_run_does_not_stop_the_run(tmp_path, mlflow_server):
    """Issue 47's bad input: the server is up when the run starts and gone before its end (killed as soon
    as the parent run exists). The run still ends (exit 0, its report written), says what it did not log,
    and its last MLflow line says the UI is not reachable and how to start it. MLflow's client alone would
    retry each call for ~4 min (7 retries with backoff). The module's server: this test ends it."""
    url, kill, experiment = mlflow_server.url, mlflow_server.kill, "server_down"
    port = url.rsplit(":", 1)[1]
    args = [
        "experiment=smoke", f"experiment_name={experiment}", "variants=baseline", "loadtest.enabled=false",
        "profile.enabled=false", "quality.users=0", "trainer.epochs=1", "trainer.max_rows_per_epoch=5000",
        f"tracking.uri={url}", f"cache_dir={tmp_path}/cache", f"report_dir={tmp_path}/report",
        f"hydra.run.dir={tmp_path}/out",
    ]  # fmt: skip
    # The call in flight when the server dies is MLflow's to retry (7 times with backoff, ~4 min);
    # the calls after it are the run's (test_tracking's lost-server test covers those with the default).
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    with (tmp_path / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "run.py", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "parent run" in line:
                kill()
        rc = proc.wait(timeout=60)
    out = "\n".join(lines)
    assert rc == 0, out[-3000:] + (tmp_path / "stderr.txt").read_text()[-3000:]
    assert "`baseline`" in (tmp_path / "report" / "report.md").read_text()
    assert f"MLflow: the tracking server {url} stopped answering" in out
    unlogged = (tmp_path / "out" / "mlflow_unlogged.txt").read_text().splitlines()
    assert any(w.endswith("as FINISHED") and w.startswith("end of run") for w in unlogged), unlogged
    assert any(w.startswith("artifact ") and "report.md" in w for w in unlogged), unlogged
    assert f"{len(unlogged)} calls not logged" in out
    ui = [line for line in lines if line.startswith("MLflow UI at")]
    assert ui == [ui[-1]] and ui[0].startswith(f"MLflow UI at {url} is not reachable (")
    assert f"python -m reco.cli.tracking_server tracking.server.port={port}" in ui[0]
    assert f"then open {url}/#/experiments/" in ui[0]
    assert not [line for line in lines if line.startswith("MLflow runs table")]
    # what the note promises: the next run on that store closes the runs left RUNNING
    store = f"sqlite:///{mlflow_server.root}/server/mlflow.db"
    closed = Tracker(store, experiment, artifact_root=str(tmp_path / "a")).close_orphans()
    assert closed and all(
        r.info.status == "KILLED"
        for r in MlflowClient(store).search_runs(
            [MlflowClient(store).get_experiment_by_name(experiment).experiment_id]
        )
    )
