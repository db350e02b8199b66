"""Stopping `python -m reco.cli.serve`: SIGINT/SIGTERM stop everything it started; SIGKILL of the supervisor
leaves no worker behind, and a process SIGKILLed just after starting keep-warm spinners leaves no spinner.
Real processes, checked with psutil; and the server's main loop, which naps a second between ticks, is
woken by a stop at once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid

import psutil
import pytest
import uvicorn
from conftest import make_variant, marked_alive, marked_env
from test_serve import Client, serve_settings

from reco.serve.process import start_server
from reco.serve.workers import QuietServer

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def variant(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("shutdown")
    return make_variant(tiny_data, root, onnx=True)


def _answering(url: str) -> bool:
    c = Client(url)
    status, _, resp = c.recommend({"user_id": 3, "k": 2, "candidates": [5, 17]})
    c.close()
    return status == 200 and sorted(it["item_id"] for it in resp["items"]) == [5, 17]


def _children(pid: int, workers: int, keep_warm_cores: int) -> list[psutil.Process]:
    kids = psutil.Process(pid).children(recursive=True)
    # the spinners (one per core), and the worker processes when there are several
    assert len(kids) >= keep_warm_cores + (workers if workers > 1 else 0), kids
    return kids


@pytest.mark.parametrize(
    "workers, sig",
    [(1, signal.SIGTERM), (1, signal.SIGINT), (2, signal.SIGINT)],
    ids=["1-TERM", "1-INT", "2-INT"],
)
def test_signal_stops_server_workers_and_spinners(variant, tmp_path, workers, sig):
    vdir, dpath = variant
    h = start_server(vdir, dpath, serve_settings(f"workers={workers}", "keep_warm=true"), work_dir=tmp_path)
    assert _answering(h.url)
    kids = _children(h.pid, workers, len(psutil.Process(h.pid).cpu_affinity()))
    h.proc.send_signal(sig)
    assert h.proc.wait(timeout=60) == 0, h.log_tail()
    _, alive = psutil.wait_procs(kids, timeout=30)
    assert not [k for k in alive if k.status() != psutil.STATUS_ZOMBIE], alive
    assert "Traceback" not in h.log_path.read_text()


def test_workers_exit_when_the_supervisor_is_killed(variant, tmp_path):
    vdir, dpath = variant
    h = start_server(vdir, dpath, serve_settings("workers=2", "keep_warm=true"), work_dir=tmp_path)
    assert _answering(h.url)
    kids = _children(h.pid, 2, len(psutil.Process(h.pid).cpu_affinity()))
    h.proc.send_signal(signal.SIGKILL)  # no chance to pass anything on
    h.proc.wait(timeout=30)
    _, alive = psutil.wait_procs(kids, timeout=60)
    try:
        assert not [k for k in alive if k.status() != psutil.STATUS_ZOMBIE], alive
    finally:
        for k in alive:  # never leave a stray worker behind, even when the test fails
            k.kill()


def test_a_server_shares_its_callers_session_in_a_process_group_of_its_own(variant, tmp_path):
    """With autogroups each session is a scheduling group and a keep-warm spinner (SCHED_IDLE) yields only
    within its own, so a server in a session of its own lost up to 40 % of its core to the study's spinner
    (reco/serve/keepwarm.py). Its own process group keeps the terminal's Ctrl-C from it."""
    vdir, dpath = variant
    with start_server(vdir, dpath, serve_settings("keep_warm=false"), work_dir=tmp_path) as h:
        assert os.getsid(h.pid) == os.getsid(0)
        assert os.getpgid(h.pid) == h.pid != os.getpgid(0)


KILLED_AT_ONCE = """
import os, signal
from reco.serve.keepwarm import start_keep_warm
start_keep_warm(sorted(os.sched_getaffinity(0)))
os.kill(os.getpid(), signal.SIGKILL)  # the spinners' Python has not even started yet
"""


def test_spinners_die_with_a_parent_killed_right_after_starting_them():
    """PR_SET_PDEATHSIG must be set before the spinner's interpreter starts, or it outlives its parent."""
    mark = uuid.uuid4().hex
    for _ in range(3):
        subprocess.run([sys.executable, "-c", KILLED_AT_ONCE], env=marked_env(mark), timeout=60)
    assert not marked_alive(mark, within_s=10.0)


async def _bare_app(scope, receive, send) -> None:  # main_loop never calls it
    raise AssertionError(scope)


def test_quiet_server_ticks_seldom_and_a_signal_wakes_it_at_once():
    """An idle server's main loop wakes once a tick (1 s; uvicorn's wakes ten times a second), each tick
    refreshing the Date header; SIGTERM's handler cuts the nap short instead of waiting for the tick."""
    config = uvicorn.Config(_bare_app, log_level="warning")
    config.load()
    server = QuietServer(config)
    server.TICK_S = 3600.0  # only a signal can end the nap now
    ticks: list[int] = []
    on_tick = server.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(counter)
        return await on_tick(counter)

    server.on_tick = counted

    async def stop_while_napping() -> None:
        loop = asyncio.get_running_loop()
        task = loop.create_task(server.main_loop())
        while server._nap is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # uvicorn's loop would have ticked three more times
        assert ticks == [0]
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.wait_for(task, 60)

    asyncio.run(stop_while_napping())
    assert ticks == [0, 10]  # the second tick: a whole second for on_tick, so it renews the Date header
    assert server.server_state.default_headers[0][0] == b"date"
