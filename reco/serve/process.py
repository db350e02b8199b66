"""Start and stop the service as its own process (the pipeline and the tests use this).

    handle = start_server(variant_dir, dataset_path, settings, port=None, cpus=[1])
    ... handle.url ...
    handle.stop()

The process writes its output to `server.log` beside the settings file it was started with; a server
that exits or does not answer GET /healthz in time raises ServerStartError with the log's tail.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


class ServerStartError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the OS picks it); the server binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    url: str
    pid: int
    proc: subprocess.Popen = field(repr=False)
    log_path: Path
    settings: dict = field(repr=False, default_factory=dict)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def health(self, timeout_s: float = 2.0) -> dict:
        with urllib.request.urlopen(self.url + "/healthz", timeout=timeout_s) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout_s: float = 120.0) -> ServerHandle:
        """Block until GET /healthz answers 200 from every worker; raise if the process dies or time runs out.

        Each health check is a new connection, which SO_REUSEPORT hashes to some worker, so all workers
        answer sooner or later once their model is loaded and their socket bound.
        """
        deadline = time.monotonic() + timeout_s
        workers, seen = int(self.settings.get("workers", 1)), set()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server for {self.url} exited with code {self.proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                seen.add(self.health(timeout_s=1.0)["pid"])
                if len(seen) >= workers:
                    return self
                time.sleep(0.02)
                continue
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                time.sleep(0.1)
        self.stop()
        raise ServerStartError(
            f"server for {self.url} did not answer /healthz within {timeout_s:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (uvicorn drains and stops its workers), SIGKILL to the process group after timeout_s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only the server and its workers
                self.proc.wait(timeout_s)
        return self.proc.returncode

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    variant_dir: str | Path,
    dataset_path: str | Path,
    settings: dict,
    port: int | None = None,
    cpus: list[int] | None = None,
    *,
    wait: bool = True,
    timeout_s: float = 120.0,
    work_dir: str | Path | None = None,
) -> ServerHandle:
    """Run `python -m reco.serve` with the resolved serve `settings` on 127.0.0.1:`port` (free port if None).

    cpus: cores to pin the server to (overrides settings["cpu_affinity"]). wait=False returns at once
    (call handle.wait_ready()), so several servers can start side by side.
    """
    host = settings.get("host", "127.0.0.1")
    port = port or free_port(host)
    settings = {**settings, "host": host, "port": port}
    if cpus:
        settings["cpu_affinity"] = [int(c) for c in cpus]
    wd = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="reco-serve-"))
    wd.mkdir(parents=True, exist_ok=True)
    cfg_path = wd / f"serve-{port}.json"
    cfg_path.write_text(json.dumps(settings, indent=2))
    log_path = wd / f"server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "reco.serve",
        "--variant",
        str(variant_dir),
        "--dataset",
        str(dataset_path),
        "--config",
        str(cfg_path),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    handle = ServerHandle(f"http://{host}:{port}", proc.pid, proc, log_path, settings)
    atexit.register(handle.stop)  # never leave a server behind if the caller crashes
    if wait:
        handle.wait_ready(timeout_s)
    return handle
