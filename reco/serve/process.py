"""Start and stop the service as its own process (the pipeline and the tests use this).

    handle = start_server(variant_dir, dataset_path, settings, port=None, cpus=[1])
    ... handle.url ...
    handle.stop()

`settings` is a ServeConfig (a `serve` section is typed once, where it is read: serve_config); the
process gets it as one JSON file (`--settings`, reco.serve.config.write_settings) and types it once, so
it runs with exactly these settings. It writes its output to `server-{port}.log` in `work_dir` (a fresh temporary directory by default); a server that
exits or does not answer GET /healthz in time raises ServerStartError with the log's tail.

serve.backend=triton starts `python -m reco.cli.triton_server` with serve.triton.python (the
interpreter of `.venv-triton`, `make triton-venv`) instead; it is ready when Triton reports the model
ready (GET /v2/models/<serve.triton.model_name>/ready), and `handle.triton_model` names the model.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
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

import psutil

from reco.children import die_with_parent
from reco.serve.config import ServeBackend, ServeConfig, write_settings

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class ServerStartError(RuntimeError):
    """The server process exited or did not answer /healthz in time (the message holds its log tail)."""


_GIVEN: collections.deque[int] = collections.deque(maxlen=256)  # ports this process handed out lately


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the OS picks it) and not handed out lately by this process: servers started
    side by side bind theirs moments later, and the OS may offer a port twice before any of them has
    (two servers of one test fixture once got the same port).

    Args:
        host: the address to probe.
    Returns:
        The port number.
    """
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            break
    _GIVEN.append(port)
    return port


def log_tail(path: str | Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file ("" when it cannot be read).

    Args:
        path: the log file.
        lines: how many lines from its end.
    Returns:
        Those lines joined with newlines.
    """
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class ServerHandle:
    """A running `python -m reco.cli.serve` process started by start_server."""

    url: str
    pid: int
    proc: subprocess.Popen = field(repr=False)
    log_path: Path
    settings: ServeConfig = field(repr=False)

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the server's log."""
        return log_tail(self.log_path, lines)

    @property
    def triton_model(self) -> str | None:
        """The Triton model serving the variant (POST /v2/models/<it>/infer); None for reco's server."""
        return self.settings.triton.model_name if self.settings.backend == ServeBackend.triton else None

    def health(self, timeout_s: float = 2.0) -> dict:
        """GET /healthz of whichever worker answers the new connection, as a dict (Triton: its model's
        ready endpoint, answered as {"status": "ok", "model", "pid"})."""
        if self.triton_model is not None:
            url = f"{self.url}/v2/models/{self.triton_model}/ready"
            with urllib.request.urlopen(url, timeout=timeout_s):  # non-200: HTTPError (a URLError)
                return {"status": "ok", "model": self.triton_model, "pid": self.pid}
        with urllib.request.urlopen(self.url + "/healthz", timeout=timeout_s) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout_s: float = 120.0) -> ServerHandle:
        """Block until GET /healthz answers 200 from every worker; raise if the process dies or time runs out.

        Each health check is a new connection, which SO_REUSEPORT hashes to some worker, so all workers
        answer sooner or later once their model is loaded and their socket bound.

        Args:
            timeout_s: how long to wait.
        Returns:
            self; ServerStartError (with the log's tail) otherwise.
        """
        deadline = time.monotonic() + timeout_s
        workers = self.settings.workers if self.triton_model is None else 1
        seen: set[int] = set()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server for {self.url} exited with code {self.proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                pid = self.health(timeout_s=1.0)["pid"]
                if pid not in self._own_pids():
                    self.stop()
                    raise ServerStartError(
                        f"{self.url}: /healthz answered by pid {pid}, not by this server (pid {self.pid}) or its "
                        "workers: another process serves the same port with SO_REUSEPORT (a parallel sweep job "
                        "whose server took the same free port); the port's traffic would be split between them"
                    )
                seen.add(pid)
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

    def _own_pids(self) -> set[int]:
        """This server's process and its worker processes."""
        try:
            return {self.pid} | {c.pid for c in psutil.Process(self.pid).children(recursive=True)}
        except psutil.Error:
            return {self.pid}

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (uvicorn drains and stops its workers), SIGKILL to the process group after timeout_s.

        Returns:
            The process's exit code (0 after a clean stop).
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                # its own process group: only the server and its workers
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout_s)
        return self.proc.returncode

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_servers(handles: list[ServerHandle], timeout_s: float = 10.0) -> None:
    """Stop several servers side by side: SIGTERM to all, then ServerHandle.stop each (one after another,
    every server's shutdown -- ~2 s of interpreter teardown after torch -- would be waited out in turn).

    Args:
        handles: the servers.
        timeout_s: how long each may take after the SIGTERM before its process group is SIGKILLed.
    """
    for h in handles:
        if h.proc.poll() is None:
            h.proc.send_signal(signal.SIGTERM)
    for h in handles:
        try:
            h.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(h.proc.pid, signal.SIGKILL)
        h.stop(timeout_s)


def start_server(
    variant_dir: str | Path,
    dataset_path: str | Path,
    settings: ServeConfig,
    port: int | None = None,
    cpus: list[int] | None = None,
    *,
    wait: bool = True,
    timeout_s: float = 120.0,
    work_dir: str | Path | None = None,
) -> ServerHandle:
    """Run `python -m reco.cli.serve` with `settings` on 127.0.0.1:`port`.

    Args:
        variant_dir: the variant directory.
        dataset_path: the Dataset file.
        settings: the typed serve settings (a config section is typed once, where it is read:
            reco.serve.config.serve_config).
        port: the port; None = a free one.
        cpus: cores to pin the server to (overrides settings.cpu_affinity).
        wait: False returns at once (call handle.wait_ready()), so several servers can start side by side.
        timeout_s: how long wait_ready waits.
        work_dir: where the log goes (a fresh temporary directory by default).
    Returns:
        The handle (a context manager that stops the server).
    """
    if not isinstance(settings, ServeConfig):
        raise TypeError(
            f"start_server: settings must be a ServeConfig, got {type(settings).__name__} "
            "(type a `serve` section once with reco.serve.config.serve_config)"
        )
    cfg = dataclasses.replace(settings, port=port or free_port(settings.host))
    if cpus:
        cfg = dataclasses.replace(cfg, cpu_affinity=[int(c) for c in cpus])
    python, module = (
        (str(triton_python(cfg)), "reco.cli.triton_server")
        if cfg.backend == ServeBackend.triton
        else (sys.executable, "reco.cli.serve")
    )
    wd = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="reco-serve-"))
    wd.mkdir(parents=True, exist_ok=True)
    log_path = wd / f"server-{cfg.port}.log"
    settings_path = write_settings(cfg, wd / f"server-{cfg.port}.settings.json")  # every key: one file
    cmd = [
        python,
        "-m",
        module,
        "--variant",
        str(variant_dir),
        "--dataset",
        str(dataset_path),
        "--settings",
        str(settings_path),
    ]
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Ctrl-C in the caller's terminal is the caller's to handle: a process group of its own; not a
            # session of its own, whose autogroup would share the core with the caller's keep-warm spinner
            # fairly, SCHED_IDLE or not (reco/serve/keepwarm.py)
            process_group=0,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),  # ... and SIGKILL takes it along
        )
    handle = ServerHandle(f"http://{cfg.host}:{cfg.port}", proc.pid, proc, log_path, cfg)
    atexit.register(handle.stop)  # never leave a server behind if the caller crashes
    if wait:
        handle.wait_ready(timeout_s)
    return handle


def triton_python(cfg: ServeConfig) -> Path:
    """The interpreter serve.backend=triton runs (serve.triton.python; relative: to the project root).

    Args:
        cfg: the serve settings.
    Returns:
        Its path; ServerStartError naming the setting and `make triton-venv` when it does not exist.
    """
    path = Path(cfg.triton.python)
    path = path if path.is_absolute() else PROJECT_ROOT / path
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ServerStartError(
            f"serve.backend=triton: serve.triton.python={cfg.triton.python} ({path}) is not an executable; "
            "build it with `make triton-venv` (a venv of /usr/bin/python3.11 with nvidia-pytriton: PyTriton "
            "loads models only under the system interpreter) or point serve.triton.python at one"
        )
    return path
