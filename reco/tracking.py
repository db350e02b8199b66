"""MLflow helpers: the one module that knows MLflow's API (writing runs and reading them back).

Layout: one MLflow experiment per Hydra experiment preset; one parent run per execution; one child
run per variant (tag `mlflow.parentRunId`), all children logging the same metric names so MLflow's
compare view lines them up.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

import psutil
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from reco.claim import claim
from reco.cpu import cpu_model

T = TypeVar("T")

# MLflow rejects longer param values.
_MAX_PARAM = 6000
# An error's text as a tag: long enough for a Python traceback's last lines, below MLflow's tag limit.
_MAX_ERROR = 5000
ERROR_TAG = "error"
NOTE_TAG = "mlflow.note.content"  # the run's description, Markdown, shown on its page in MLflow's UI


def failure_note(status: str, error: str) -> str:
    """The run page's description of a run that did not finish: its status and the error, verbatim in a
    code block (a traceback's indentation and underscores must not be read as Markdown)."""
    fence = "~~~~" if "```" in error else "```"
    return f"**{status}**\n\n{fence}\n{error[:_MAX_ERROR]}\n{fence}\n"


class TrackingError(RuntimeError):
    pass


def flatten(d: Mapping, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# What "-dirty" looks at: changed tracked code and config, not the records a run rewrites (experiments/,
# mlruns/) nor untracked files such as its log, which made every committed report read "-dirty"
DIRTY_PATHS = [":(top)", ":(top,exclude)experiments", ":(top,exclude)mlruns"]


def git_commit(cwd: str | None = None) -> str:
    """HEAD's commit, with "-dirty" when tracked files outside the run records differ from it."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True, cwd=cwd
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *DIRTY_PATHS],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=cwd,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _remote(uri: str) -> bool:
    return urlparse(uri).scheme in ("http", "https")


def unreachable(uri: str, timeout_s: float = 5.0) -> str:
    """Why the tracking server a remote `uri` names cannot be reached ("" when it accepts a connection,
    and for a local store, which has no server)."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return ""
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            return ""
    except OSError as e:
        return str(e)


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail before any training when a remote tracking server cannot be reached."""
    if why := unreachable(uri, timeout_s):
        raise TrackingError(
            f"tracking.uri: cannot reach MLflow tracking server {uri!r} ({why}); "
            "start it or use the embedded store (tracking.uri=sqlite:///mlruns/mlflow.db)"
        )
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingError(f"tracking.uri: cannot create the directory for {db} ({e})") from e


EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
# MLflow's UI ("Share" on the runs page) keeps a view of the runs table -- its search filter, sort and
# columns -- as this experiment tag + a key, and opens it from `.../runs?viewStateShareKey=<key>`.
SHARED_VIEW_TAG = "mlflow.sharedViewState."


class Tracker:
    """One MLflow experiment's runs. The store must answer when the Tracker is made (check_reachable);
    a remote server that stops answering later does not stop the run: from then on nothing is sent,
    each call says what it would have logged in `unlogged`, and `lost` says why (see _send)."""

    def __init__(self, uri: str, experiment: str, artifact_root: str | None = None) -> None:
        check_reachable(uri)
        self.uri = uri
        self.lost = ""  # why the tracking server stopped answering mid-run; "" while it answers
        self.unlogged: list[str] = []  # what was not logged since
        # Parallel jobs (a multirun sweep) open one store at once. MLflow creates a fresh sqlite store's
        # tables, and every store's experiment, check-then-create without a lock: so for sqlite the first
        # job does both alone, and a lost create race on a server reads the winner's experiment.
        db = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
        with claim(db, f"MLflow store {db}") if db else nullcontext():
            self.client = MlflowClient(tracking_uri=uri)
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                location = (
                    Path(artifact_root).resolve().as_uri() if artifact_root and not _remote(uri) else None
                )
                try:
                    self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
                except MlflowException:
                    exp = self.client.get_experiment_by_name(experiment)
                    if exp is None:
                        raise
            if exp is not None:
                self.experiment_id = exp.experiment_id
        # MLflow 3's UI opens an untagged experiment in its GenAI overview; this tag makes it open on the
        # runs table ("Training runs"). The sidebar follows the link's `workflowType`, not this tag
        # (reco.pipeline.runs_table_url).
        if exp is None or exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)

    def start_run(
        self, name: str, parent_id: str | None = None, tags: Mapping[str, str] | None = None
    ) -> str:
        # Who owns the run: a later start closes runs whose owner died (see close_orphans).
        all_tags = {"reco.owner": f"{socket.gethostname()}:{os.getpid()}", **(tags or {})}
        if parent_id:
            all_tags["mlflow.parentRunId"] = parent_id
        run = self._send(
            f"run {name!r} (not created)",
            lambda: self.client.create_run(self.experiment_id, run_name=name, tags=all_tags),
        )
        # not created: a name for the list of what was not logged (nothing is sent once the server is lost)
        return run.info.run_id if run is not None else f"<{name}: not created>"

    def _send(self, what: str, call: Callable[[], T]) -> T | None:
        """`call()` against the store, or None with `what` listed in `unlogged` once a remote server has
        stopped answering. Any other error is raised: only an unreachable server is outlived."""
        if not self.lost and (why := unreachable(self.uri, timeout_s=2.0)):
            # A refused connection is known in a millisecond: MLflow's client retries one 7 times with
            # backoff, 247 s per call (MLflow 3.17, measured), which would hold the run for every call left.
            self._lose(why, what)
        if self.lost:
            self.unlogged.append(what)
            return None
        try:
            return call()
        except Exception:
            if not (why := unreachable(self.uri, timeout_s=2.0)):
                raise
            self._lose(why, what)  # it went down during this call
            self.unlogged.append(what)
            return None

    def _lose(self, why: str, what: str) -> None:
        self.lost = why
        print(
            f"MLflow: the tracking server {self.uri} stopped answering ({why}) at: {what}. The run goes on "
            "without it (report and files as usual); what is not logged is listed at the end.",
            flush=True,
        )

    def log(
        self,
        run_id: str,
        metrics: Mapping[str, float] | None = None,
        params: Mapping[str, object] | None = None,
        tags: Mapping[str, str] | None = None,
        step: int = 0,
    ) -> None:
        # +inf is a measurement (a p99 with more than 1 % failed requests): MLflow keeps it (its SQL store
        # as the largest float, read back as inf by latest_variant_runs). NaN is no figure, left out like None.
        ms = [
            Metric(k, float(v), 0, step)
            for k, v in (metrics or {}).items()
            if isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(float(v))
        ]
        ps = [Param(k, str(v)[:_MAX_PARAM]) for k, v in (params or {}).items()]
        ts = [RunTag(k, str(v)[:_MAX_PARAM]) for k, v in (tags or {}).items()]
        for i in range(0, max(len(ms), len(ps), len(ts)), 100):
            m, p, t = ms[i : i + 100], ps[i : i + 100], ts[i : i + 100]
            self._send(
                f"{len(m)} metrics, {len(p)} params, {len(t)} tags of run {run_id}",
                lambda m=m, p=p, t=t: self.client.log_batch(run_id, metrics=m, params=p, tags=t),
            )

    def log_artifacts(self, run_id: str, paths: Iterable[str | Path], subdir: str | None = None) -> None:
        for p in paths:
            p = Path(p)
            what = f"artifact {p} of run {run_id}"
            if p.is_dir():
                self._send(what, lambda p=p: self.client.log_artifacts(run_id, str(p), subdir))
            elif p.exists():
                self._send(what, lambda p=p: self.client.log_artifact(run_id, str(p), subdir))

    def end(self, run_id: str, failed: bool = False, status: str | None = None, error: str = "") -> None:
        """Terminate a run: FINISHED, FAILED, or an explicit MLflow status such as KILLED.

        Args:
            error: why the run did not finish; kept as the tag `error` (searchable: `tags.error LIKE ...`)
                and as the run's description (`mlflow.note.content`), which MLflow's UI shows at the top
                of the run page: a FAILED run that says nothing sends the user to the logs (issue 47).
        """
        status = status or ("FAILED" if failed else "FINISHED")
        if error:
            self.log(run_id, tags={ERROR_TAG: error[:_MAX_ERROR], NOTE_TAG: failure_note(status, error)})
        self._send(f"end of run {run_id} as {status}", lambda: self.client.set_terminated(run_id, status))

    def share_view(self, key: str, view: Mapping[str, object]) -> None:
        """Store a runs-table view under `key` for the link `?viewStateShareKey=<key>`: `view` as MLflow's
        UI reads it (searchFilter, orderByKey, orderByAsc, selectedColumns ['metrics.`name`', ...])."""
        tag = SHARED_VIEW_TAG + key
        self._send(
            f"runs-table view {key}",
            lambda: self.client.set_experiment_tag(self.experiment_id, tag, json.dumps(dict(view))),
        )

    def close_orphans(self) -> list[str]:
        """End as KILLED every RUNNING run of this experiment whose owning process (on this host) is gone.

        An interrupted run (SIGKILL, power loss) cannot end its own MLflow runs; the next start does,
        with the reason in the tag `reco.end_reason`. Runs owned by a live process are left alone.
        Returns:
            The ids of the runs closed.
        """
        host = socket.gethostname()
        closed = []
        for run in self.client.search_runs([self.experiment_id], "attributes.status = 'RUNNING'"):
            owner = run.data.tags.get("reco.owner", "")
            owner_host, _, pid = owner.rpartition(":")
            if owner_host != host or not pid.isdigit() or _alive(int(pid)):
                continue
            self.client.set_tag(
                run.info.run_id, "reco.end_reason", f"interrupted: owning process {owner} is gone"
            )
            self.client.set_terminated(run.info.run_id, "KILLED")
            closed.append(run.info.run_id)
        return closed


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _unclamp(v: float) -> float:
    """MLflow's SQL store keeps ±inf as ±(largest float): read it back as the inf it was."""
    return math.copysign(math.inf, v) if abs(v) >= sys.float_info.max else v


def latest_variant_runs(uri: str, experiment: str) -> tuple[str, dict[str, dict]]:
    """The newest parent run of `experiment` that has variant child runs.

    Returns:
        (parent run id, {variant name: {metric: value, "parent", "backend", "mode", "status"}}) with the
        variants in the order the pipeline built them.
    """
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise TrackingError(
            f"no MLflow experiment {experiment!r} at {uri}: run `python run.py experiment={experiment}`"
        )
    parents = client.search_runs(
        [exp.experiment_id], "tags.`mlflow.parentRunId` IS NULL", order_by=["start_time DESC"], max_results=20
    )
    for parent in parents:
        children = client.search_runs(
            [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
        )
        children.sort(key=lambda c: c.info.start_time)
        if children:
            rows = {
                c.data.tags.get("variant", c.info.run_name): {
                    **{k: _unclamp(v) for k, v in c.data.metrics.items()},
                    "parent": c.data.tags.get("parent_variant", ""),
                    "backend": c.data.params.get("backend", ""),
                    "mode": c.data.params.get("step_config.mode", ""),  # accelerate steps only
                    "status": c.data.tags.get("status", c.info.status),
                }
                for c in children
            }
            return parent.info.run_id, rows
    raise TrackingError(f"experiment {experiment!r} has no run with variants yet")


def environment_tags() -> dict[str, str]:
    import platform

    import onnxruntime
    import torch

    return {
        "machine.cpu": cpu_model(),
        "machine.cores": str(os.cpu_count()),
        "machine.python": platform.python_version(),
        "machine.torch": torch.__version__,
        "machine.onnxruntime": onnxruntime.__version__,
        "git.commit": git_commit(),
        # OpenMP's waiting (reco/cli/parallel_jobs.py sets it for jobs run side by side): it moves training time
        "env.OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "unset"),
    }
