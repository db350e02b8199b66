"""A local MLflow tracking server (`make mlflow-server`): what a team shares instead of one embedded store.

`python -m reco.cli.tracking_server [tracking.server.port=5001 ...]` runs `mlflow server` with the
`tracking.server` settings (conf/tracking/default.yaml): a sqlite backend store and a proxied artifact
store (clients upload artifacts through the server, so they need no access to its disk), bound to
127.0.0.1. Experiments then log over HTTP with `python run.py ... tracking.uri=http://127.0.0.1:5000`.
The whole `tracking` group's schema lives here too, away from reco.tracking's mlflow imports (see
reco.cli.compose._schemas).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.error import URLError
from urllib.parse import urlparse
from urllib.request import urlopen

from omegaconf import MISSING


class TrackingServerError(RuntimeError):
    pass


@dataclass
class TrackingServerConfig:
    """`tracking.server`: the server `make mlflow-server` starts."""

    host: str = MISSING  # 127.0.0.1: other machines reach it through an SSH tunnel or a proxy, not directly
    port: int = MISSING
    backend_store_uri: str = MISSING  # runs, params, metrics (sqlite here; postgresql://... in production)
    artifacts_destination: str = (
        MISSING  # where the server stores artifacts (a path here; s3://... in production)
    )
    workers: int = MISSING  # server worker processes
    job_execution: bool = MISSING  # MLflow's server-side job runner (huey consumer processes; reco runs none)


@dataclass
class TrackingConfig:
    """The `tracking` config group (conf/tracking/default.yaml)."""

    uri: str = MISSING  # sqlite:///mlruns/mlflow.db (embedded) or http://host:port (a tracking server)
    # where a new experiment's artifacts go with the embedded store; a tracking server keeps them in its
    # own artifact store (tracking.server.artifacts_destination), proxied over HTTP
    artifact_root: str | None = MISSING
    log_models: bool = MISSING  # copy each variant's model files into its MLflow run
    server: TrackingServerConfig = MISSING  # what `make mlflow-server` starts (reco.tracking_server)


def server_command(c: TrackingServerConfig) -> list[str]:
    """The `mlflow server` command line for `c` (run with the interpreter's own mlflow)."""
    dest = c.artifacts_destination
    if "://" not in dest:  # a local path: absolute, so the server's cwd does not matter
        dest = str(Path(dest).resolve())
    return [
        sys.executable, "-m", "mlflow", "server",
        "--host", c.host,
        "--port", str(c.port),
        "--workers", str(c.workers),
        "--backend-store-uri", c.backend_store_uri,
        "--serve-artifacts",
        "--artifacts-destination", dest,
    ]  # fmt: skip


def server_environment(c: TrackingServerConfig) -> dict[str, str]:
    """The server's environment: this one, with MLflow's job runner on or off per `c.job_execution`."""
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": str(c.job_execution).lower()}


def check_port_free(host: str, port: int) -> None:
    """Fail with the setting to change when something already listens on host:port."""
    with socket.socket() as s:
        if s.connect_ex((host, port)) == 0:
            raise TrackingServerError(
                f"tracking.server.port: {host}:{port} is already in use (an MLflow server already running? "
                f"then just use tracking.uri=http://{host}:{port}); choose another with tracking.server.port=N"
            )


def wait_ready(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Block until the server at `url` answers /health, or raise after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise TrackingServerError(f"MLflow server for {url} exited during start-up")
        try:
            with urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (URLError, OSError):
            pass
        time.sleep(0.25)
    raise TrackingServerError(f"MLflow server at {url} did not answer /health within {timeout_s:.0f} s")


EMBEDDED_UI = "http://127.0.0.1:5000"  # where `make mlflow-ui` serves the embedded store (Makefile)


def start_hint(uri: str, c: TrackingServerConfig) -> str:
    """How to start the tracking server `uri` names: this project's command when it is on this machine
    (`make mlflow-server` serves tracking.server's host and port), else where it has to be started."""
    p = urlparse(uri)
    if p.hostname not in ("127.0.0.1", "localhost"):
        return (
            f"start the tracking server on {p.hostname}, or log to the embedded store "
            "(tracking.uri=sqlite:///mlruns/mlflow.db, seen with `make mlflow-ui`)"
        )
    if p.port == c.port:
        return "start it with `make mlflow-server` (python -m reco.cli.tracking_server)"
    return f"start it with `python -m reco.cli.tracking_server tracking.server.port={p.port}`"
