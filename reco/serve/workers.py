"""Several worker processes on one port (serve.workers > 1), and how they stop.

Each worker loads the model and binds its own SO_REUSEPORT listening socket on the same port, so the
kernel spreads connections over them (uvicorn's own workers share one socket, and on an idle-ish server
one worker ends up accepting nearly every connection). /metrics aggregates all workers (prometheus_client
multiprocess mode).

Stopping: SIGTERM/SIGINT to the supervisor is passed on as SIGTERM to every worker (uvicorn finishes
in-flight requests, at most 5 s) and the supervisor waits for them. A worker that finds its supervisor
gone -- killed with SIGKILL, which it cannot pass on -- gets SIGTERM from the kernel (PR_SET_PDEATHSIG)
and exits the same way. A worker dying on its own takes the server down (no silent half capacity).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import uvicorn
from uvicorn.main import STARTUP_FAILURE

from reco.children import die_with_parent
from reco.serve.config import ServeConfig, read_settings, write_settings

GRACEFUL_S = 5  # uvicorn's limit on finishing in-flight requests at shutdown


def uvicorn_options(cfg: ServeConfig, on_refused: Callable[[str], None] | None = None) -> dict:
    """uvicorn.Config keyword arguments shared by the single-process server and the workers.

    Args:
        cfg: the serve settings (log_level, http, retry_after_s).
        on_refused: called with the reason of each connection-level refusal (the app's metric).
    Returns:
        The options (uvloop, httptools with serve.http's limits, no websockets, no access log, graceful
        shutdown limit).
    """
    from reco.serve.connection import protocol_class

    return {
        "loop": "uvloop",
        "http": protocol_class(cfg.http, cfg.retry_after_s, on_refused),
        "timeout_keep_alive": cfg.http.keepalive_timeout_s,
        "ws": "none",  # no websocket routes: an Upgrade request is answered as plain HTTP
        # Nothing reads the client's address, so no X-Forwarded-* rewriting of it per request (a layer of
        # per-request work on the model's core, and headers a client could forge)
        "proxy_headers": False,
        "access_log": False,
        "log_level": cfg.log_level,
        "timeout_graceful_shutdown": GRACEFUL_S,
    }


def _wake(nap: asyncio.Future) -> None:
    if not nap.done():
        nap.set_result(None)


class QuietServer(uvicorn.Server):
    """uvicorn's Server waking once a second between requests, not ten times.

    uvicorn's main loop sleeps 0.1 s at a time to look at `should_exit` and refresh the Date header once a
    second. On an idle core each of those wake-ups costs the server ~0.1 ms of CPU (cold caches), ~1.2 ms a
    second in all: at the case study's ~14 req/s, ~0.09 ms a request (experiments/serve_overhead/README.md
    #light-load). Here the loop wakes once a second (the Date header's own resolution), and a signal wakes
    it at once, so shutdown is as prompt as before.
    """

    TICK_S = 1.0

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._nap: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # on_tick counts tenths of a second; each tick is ten
            self._nap = loop.create_future()
            timer = loop.call_later(self.TICK_S, _wake, self._nap)
            if not self.should_exit:  # a signal between on_tick and here found no nap to cut short
                await self._nap
            timer.cancel()
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._nap is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(_wake, self._nap)


def run_server(config: uvicorn.Config, sockets: list[socket.socket] | None = None) -> None:
    """Serve `config` (QuietServer) until a signal stops it; as uvicorn.run, exit code 3 when the server
    never started."""
    server = QuietServer(config)
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(STARTUP_FAILURE)


def serve_worker(variant: str, dataset: str, settings: Path, parent_pid: int) -> None:
    """One worker process: build the app (model loaded), then bind its own SO_REUSEPORT socket.

    Args:
        variant: the variant directory.
        dataset: the Dataset file.
        settings: the supervisor's settings file (write_settings), typed here once.
        parent_pid: the supervisor's pid (the worker exits when it dies).
    """
    from reco.serve.app import create_app

    die_with_parent(parent_pid)
    cfg = read_settings(settings)
    app = create_app(variant, dataset, cfg)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((cfg.host, cfg.port))
    sock.listen(2048)
    options = uvicorn_options(cfg, app.state.service.metrics.count_refused)
    run_server(uvicorn.Config(app, host=cfg.host, port=cfg.port, **options), sockets=[sock])


def run_workers(variant: str, dataset: str, cfg: ServeConfig) -> int:
    """Start cfg.workers worker processes and supervise them until SIGTERM/SIGINT or one dies.

    Args:
        variant: the variant directory.
        dataset: the Dataset file.
        cfg: the serve settings.
    Returns:
        0 after a requested stop, 1 when a worker died on its own.
    """
    run_dir = Path(tempfile.mkdtemp(prefix="reco-workers-"))
    prom_dir = run_dir / "prometheus"
    prom_dir.mkdir()
    # prometheus_client reads this at its first import, which happens in each (spawned) worker.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prom_dir)
    # The settings as this process resolved them (command-line values included): one file, each worker
    # types it once.
    settings = write_settings(cfg, run_dir / "settings.json")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=serve_worker, args=(variant, dataset, settings, os.getpid()), name=f"reco-serve-{i}"
        )
        for i in range(cfg.workers)
    ]
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.is_alive():
                p.terminate()  # SIGTERM: uvicorn finishes in-flight requests and exits

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for p in procs:
            if stopping:
                break
            p.start()
        while all(p.is_alive() for p in procs if p.pid is not None) and not stopping:
            mp.connection.wait([p.sentinel for p in procs], timeout=1.0)
        crashed = not stopping
        stop(signal.SIGTERM, None)
        for p in procs:
            if p.pid is None:  # never started: the stop came first
                continue
            p.join(GRACEFUL_S + 5)
            if p.is_alive():
                p.kill()
                p.join()
        return 1 if crashed else 0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
