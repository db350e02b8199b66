"""The MLflow tracker on a real sqlite store."""

from __future__ import annotations

import dataclasses
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from reco.cli.compose import compose
from reco.config import typed
from reco.tracking import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    Tracker,
    git_commit,
    latest_variant_runs,
    unreachable,
)
from reco.tracking_server import TrackingServerConfig, server_command, server_environment

ROOT = Path(__file__).resolve().parents[1]


def test_experiments_open_in_the_model_training_view(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    Tracker(uri, "fresh", artifact_root=str(tmp_path / "a"))
    old = client.create_experiment("made_before", artifact_location=(tmp_path / "b").as_uri())
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(old).tags
    Tracker(uri, "made_before")  # an experiment from before the tag existed is tagged on next use
    for name in ("fresh", "made_before"):
        assert client.get_experiment_by_name(name).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


def test_tracking_server_refuses_a_taken_port_naming_the_setting():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "reco.cli.tracking_server", f"tracking.server.port={port}"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode != 0
    assert f"tracking.server.port: 127.0.0.1:{port} is already in use" in proc.stderr


def test_tracking_server_command_binds_loopback_and_proxies_artifacts():
    c = typed(compose().tracking.server, TrackingServerConfig, "tracking.server")
    cmd = server_command(c)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "--serve-artifacts" in cmd
    assert Path(cmd[cmd.index("--artifacts-destination") + 1]).is_absolute()
    # MLflow's job runner (8 extra processes) is off unless asked for
    assert server_environment(c)["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    on = dataclasses.replace(c, job_execution=True)
    assert server_environment(on)["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "true"


def test_an_infinite_figure_is_logged_and_read_back_as_inf(tmp_path):
    """A p99 with more than 1 % failed requests is +inf: a measurement, kept (the SQL store clamps it to the
    largest float; latest_variant_runs reads it back as inf). NaN (no figure) is left out like None."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Tracker(uri, "inf", artifact_root=str(tmp_path / "a"))
    parent = t.start_run("study")
    child = t.start_run("baseline", parent_id=parent, tags={"variant": "baseline"})
    t.log(child, metrics={"e2e_p99_ms": math.inf, "e2e_p50_ms": 3.5, "no_figure": math.nan, "flag": True})
    _, rows = latest_variant_runs(uri, "inf")
    m = rows["baseline"]
    assert m["e2e_p99_ms"] == math.inf and m["e2e_p50_ms"] == 3.5
    assert "no_figure" not in m and "flag" not in m


def test_a_failed_run_says_why_on_its_mlflow_page(tmp_path):
    """Issue 47: a FAILED run showed no error in the UI. Tracker.end keeps it as the tag `error` and as the
    run's description (`mlflow.note.content`, shown at the top of the run page), verbatim in a code block."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Tracker(uri, "failing", artifact_root=str(tmp_path / "a"))
    error = 'ValueError: model_config.dense_arch: expected a list of ints, got "64x32"\n  at step `prune`'
    failed = t.start_run("pruned")
    t.end(failed, status="FAILED", error=error)
    run = t.client.get_run(failed)
    assert run.info.status == "FAILED" and run.data.tags["error"] == error
    assert run.data.tags["mlflow.note.content"] == f"**FAILED**\n\n```\n{error}\n```\n"
    ok = t.start_run("baseline")
    t.end(ok)
    run = t.client.get_run(ok)
    assert run.info.status == "FINISHED" and not {"error", "mlflow.note.content"} & set(run.data.tags)
    # a long traceback is cut to what MLflow's tag limit takes, not refused (the run must still end)
    long = t.start_run("distilled")
    t.end(long, status="FAILED", error="Traceback (most recent call last):\n" + "  frame\n" * 3000)
    run = t.client.get_run(long)
    assert run.info.status == "FAILED" and len(run.data.tags["error"]) == 5000
    # an error holding a code fence of its own still reads as one block
    fenced = t.start_run("fenced")
    t.end(fenced, status="FAILED", error="bad YAML:\n```\nx: [\n```")
    assert (
        t.client.get_run(fenced).data.tags["mlflow.note.content"].startswith("**FAILED**\n\n~~~~\nbad YAML")
    )


def test_an_experiment_that_fails_leaves_its_error_on_the_parent_run(tmp_path):
    """The pipeline's parent run ends FAILED with the exception that stopped it (here: data not found,
    the first thing after the run starts), and the exception still reaches the user."""
    from reco import pipeline
    from reco.experiment import RunContext, experiment_config

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = compose(["experiment=smoke", "data=movielens", f"data.params.path={tmp_path}/no_such_dir",
                   f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a", f"cache_dir={tmp_path}/cache",
                   f"report_dir={tmp_path}/report"])  # fmt: skip
    exp = experiment_config(cfg)
    with pytest.raises(FileNotFoundError, match="no_such_dir does not exist"):
        pipeline.run(exp, RunContext(out_dir=tmp_path / "out"))
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(exp.experiment_name).experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith("FileNotFoundError: data.params.path: MovieLens directory")
    assert "no_such_dir does not exist" in run.data.tags["mlflow.note.content"]


def test_the_printed_link_opens_one_executions_variants_as_rows(tmp_path):
    """The link a run prints carries `viewStateShareKey`; the view it names (an experiment tag, as MLflow's
    UI "Share" stores one) filters to the execution's variant runs -- the same search the UI sends, run
    here through MLflow's API -- in the report's row order, with the decision columns first. It is not
    sorted by start time, the one sort under which MLflow 3.17's UI folds them under their parent (seen in
    Chromium: experiments/mlflow_view/README.md), and it opens the model-training sidebar."""
    import json

    from reco.pipeline import ROW_TAG, decision_columns, runs_table_url, study_view
    from reco.tracking import SHARED_VIEW_TAG

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Tracker(uri, "view", artifact_root=str(tmp_path / "a"))
    old = t.start_run("study")  # an earlier execution: not in this one's view
    t.start_run("baseline", parent_id=old)
    parent = t.start_run("study")
    names = ["baseline", "distilled", "distilled_batched", "pruned"]  # started in this order
    runs = {name: t.start_run(name, parent_id=parent) for name in names}
    report_order = ["baseline", "pruned", "distilled", "distilled_batched"]  # a serving row after its variant
    for row, name in enumerate(report_order, 1):
        t.log(runs[name], tags={ROW_TAG: f"{row:03d}"})  # as pipeline.run does at the end
    t.share_view(parent, study_view(parent, k=10))
    view = json.loads(t.client.get_experiment(t.experiment_id).tags[SHARED_VIEW_TAG + parent])
    assert view["columnOrder"] == view["selectedColumns"] == decision_columns(10)
    assert view["selectedColumns"][:6] == [
        "metrics.`auc_delta_rel`",
        "metrics.`expected_clicks_at_10_delta_rel`",
        "metrics.`gauc_delta_rel`",
        "metrics.`speedup_p99_common`",
        "metrics.`qps_gain`",
        "metrics.`gate`",
    ]
    assert view["orderByKey"] != "attributes.start_time"  # the UI would nest the rows again
    order = f"{view['orderByKey']} {'ASC' if view['orderByAsc'] else 'DESC'}"
    rows = t.client.search_runs([t.experiment_id], view["searchFilter"], order_by=[order])
    assert [r.info.run_name for r in rows] == report_order  # the parent and the old run left out
    url = runs_table_url(uri, t.experiment_id, view=parent)
    assert url.startswith(
        f"http://127.0.0.1:5000/#/experiments/{t.experiment_id}/runs"
        f"?viewStateShareKey={parent}&workflowType=machine_learning"
    )


@pytest.mark.timeout(120)
def test_a_tracking_server_lost_mid_run_is_outlived_and_what_was_not_logged_is_listed(tmp_path):
    """Issue 47: a real server, up when the Tracker starts, killed between two calls. Every later call
    returns at once -- MLflow's client alone retries a refused connection 7 times with backoff (247 s per
    call, measured), which the timeout would catch -- and lists what it did not log; an error of another
    kind, while the server answers, is still raised."""
    from test_pipeline import served_mlflow

    with served_mlflow(tmp_path) as (url, kill):
        t = Tracker(url, "lost")
        parent = t.start_run("study")
        with pytest.raises(MlflowException):
            t.log("no-such-run", metrics={"auc": 0.7})  # not an unreachable server: raised
        t.log(parent, metrics={"auc": 0.7})
        kill()
        # killed *between* two calls: its workers may hold the port a moment after the main process is
        # reaped, and a call caught in that moment is one in flight (MLflow's retries, the documented limit)
        deadline = time.monotonic() + 30
        while not unreachable(url) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = t.start_run("baseline", parent_id=parent)
        t.log(parent, metrics={"qps": 10.0}, params={"seed": 1})
        (tmp_path / "report.md").write_text("# report\n")
        t.log_artifacts(parent, [tmp_path / "report.md"], "report")
        t.share_view(parent, {"searchFilter": ""})
        t.end(parent, status="FAILED", error="ValueError: x")
    assert child == "<baseline: not created>" and "refused" in t.lost
    assert t.unlogged == [
        "run 'baseline' (not created)",
        f"1 metrics, 1 params, 0 tags of run {parent}",
        f"artifact {tmp_path / 'report.md'} of run {parent}",
        f"runs-table view {parent}",
        f"0 metrics, 0 params, 2 tags of run {parent}",
        f"end of run {parent} as FAILED",
    ]
    run = MlflowClient(f"sqlite:///{tmp_path}/server/mlflow.db").get_run(parent)
    assert run.data.metrics == {"auc": 0.7} and run.info.status == "RUNNING"  # what was logged stays


def test_a_run_records_its_commit_dirty_only_for_changed_code(tmp_path):
    """A report names the commit it came from: the run's own records (experiments/, mlruns/) and untracked
    files such as its log do not make it "-dirty" (every committed report read so); changed code does."""

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "experiments").mkdir()
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "experiments" / "report.md").write_text("run 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    (tmp_path / "experiments" / "report.md").write_text("run 2\n")
    (tmp_path / "run.log").write_text("log\n")
    sub = tmp_path / "experiments"  # from a subdirectory too: the whole tree counts
    assert not git_commit(str(tmp_path)).endswith("-dirty") and not git_commit(str(sub)).endswith("-dirty")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(str(tmp_path)).endswith("-dirty") and git_commit(str(sub)).endswith("-dirty")
