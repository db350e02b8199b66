"""MLflow helpers: the one module that knows MLflow's API.

Layout: one MLflow experiment per Hydra experiment preset; one parent run per execution; one child
run per variant (tag `mlflow.parentRunId`), all children logging the same metric names so MLflow's
compare view lines them up.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlparse

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

# MLflow rejects longer param values.
_MAX_PARAM = 6000


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


def git_commit() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail before any training when a remote tracking server cannot be reached."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
                pass
        except OSError as e:
            raise TrackingError(
                f"tracking.uri: cannot reach MLflow tracking server {uri!r} ({e}); "
                "start it or use the embedded store (tracking.uri=sqlite:///mlruns/mlflow.db)"
            ) from e
    elif parsed.scheme == "sqlite":
        db = Path(uri.removeprefix("sqlite:///"))
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingError(f"tracking.uri: cannot create the directory for {db} ({e})") from e


class Tracker:
    def __init__(self, uri: str, experiment: str, artifact_root: str | None = None) -> None:
        check_reachable(uri)
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            location = Path(artifact_root).resolve().as_uri() if artifact_root else None
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        else:
            self.experiment_id = exp.experiment_id

    def start_run(
        self, name: str, parent_id: str | None = None, tags: Mapping[str, str] | None = None
    ) -> str:
        all_tags = dict(tags or {})
        if parent_id:
            all_tags["mlflow.parentRunId"] = parent_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return run.info.run_id

    def log(
        self,
        run_id: str,
        metrics: Mapping[str, float] | None = None,
        params: Mapping[str, object] | None = None,
        tags: Mapping[str, str] | None = None,
        step: int = 0,
    ) -> None:
        ms = [
            Metric(k, float(v), 0, step)
            for k, v in (metrics or {}).items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))
        ]
        ps = [Param(k, str(v)[:_MAX_PARAM]) for k, v in (params or {}).items()]
        ts = [RunTag(k, str(v)[:_MAX_PARAM]) for k, v in (tags or {}).items()]
        for i in range(0, max(len(ms), len(ps), len(ts)), 100):
            self.client.log_batch(
                run_id, metrics=ms[i : i + 100], params=ps[i : i + 100], tags=ts[i : i + 100]
            )

    def log_artifacts(self, run_id: str, paths: Iterable[str | Path], subdir: str | None = None) -> None:
        for p in paths:
            p = Path(p)
            if p.is_dir():
                self.client.log_artifacts(run_id, str(p), subdir)
            elif p.exists():
                self.client.log_artifact(run_id, str(p), subdir)

    def end(self, run_id: str, failed: bool = False) -> None:
        self.client.set_terminated(run_id, "FAILED" if failed else "FINISHED")

    def metrics(self, run_id: str) -> dict[str, float]:
        return dict(self.client.get_run(run_id).data.metrics)


def log_to_run(
    run_id: str,
    metrics: Mapping[str, float],
    params: Mapping[str, object],
    artifacts: Iterable[str | Path],
    tracking_uri: str,
    subdir: str | None = None,
) -> None:
    """Log into an existing run (e.g. a variant's run, from a load test)."""
    client = MlflowClient(tracking_uri=tracking_uri)
    t = Tracker(tracking_uri, client.get_experiment(client.get_run(run_id).info.experiment_id).name)
    t.log(run_id, metrics, params)
    t.log_artifacts(run_id, artifacts, subdir)


def environment_tags() -> dict[str, str]:
    import platform

    import onnxruntime
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "machine.cpu": cpu,
        "machine.cores": str(os.cpu_count()),
        "machine.python": platform.python_version(),
        "machine.torch": torch.__version__,
        "machine.onnxruntime": onnxruntime.__version__,
        "git.commit": git_commit(),
    }
