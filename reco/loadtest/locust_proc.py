"""Locust processes through one window, for every generator (headless, kept, distributed): starting
them, watching the files they write and sampling their CPU and the server at the window's edges.

    with generator_session(w) as base:           # SIGTERM -> SystemExit, keep-warm spinners
        gens = [spawn_gen("Locust", locust_command(w), w.log, w.out, w.cpus)]
        try:
            samples = measure(w, gens)           # started -> warm-up -> window open ... window closed
            gens[0].proc.wait(...)
            samples = base.complete(samples)
        finally:
            kill(gens)

The locustfile writes `<latency file>.started` when the test starts and `.window_end` when the window
closes; the runner samples the generator's CPU and scrapes the server (Window.probe) at the start plus
the warm-up and at the close, so warm-up requests are in neither the client's nor the server's figures.
Every Locust process dies with the caller, even on SIGKILL (PR_SET_PDEATHSIG), and runs on its cores.
"""

from __future__ import annotations

import functools
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from reco.children import die_with_parent
from reco.loadtest.window import LoadTestError, Samples, Window
from reco.serve.keepwarm import start_keep_warm, stop_keep_warm
from reco.serve.process import log_tail

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtest" / "locustfile.py"

Check = Callable[[], None]  # runs on every poll while waiting for the generator; may raise


def _nothing() -> None:
    pass


def locust_command(w: Window) -> list[str]:
    """The headless Locust command line of the window (KServe v2 to w.triton_model when given)."""
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", w.url,
        "-u", str(w.users), "-r", str(w.c.spawn_rate), "-t", f"{w.run_time}s", "--only-summary",
        "--loglevel", "WARNING", "--exit-code-on-error", "0",
    ]  # fmt: skip
    for k, v in w.opts.items():
        cmd += ["--" + k.replace("_", "-"), str(v)]
    if w.requests is not None:
        cmd += ["--requests-file", str(w.requests)]
    if w.triton_model:
        cmd += ["--triton-model", w.triton_model]
    if w.reports:
        cmd += ["--csv", str(w.out / "locust"), "--html", str(w.out / "locust_report.html")]
        cmd += ["--json-file", str(w.out / "locust_stats")]
    return cmd


def _child_setup(parent_pid: int, cpus: list[int] | tuple[int, ...] | None) -> None:
    """In a Locust child before exec: die with the caller (PR_SET_PDEATHSIG), run on `cpus`."""
    die_with_parent(parent_pid)
    if cpus:
        os.sched_setaffinity(0, cpus)


def spawn_locust(
    cmd: list[str], log: Path, cwd: Path, cpus: list[int] | tuple[int, ...] | None
) -> subprocess.Popen:
    """Start a Locust process writing stdout and stderr to `log`; it dies with us and runs on `cpus`."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
            preexec_fn=functools.partial(_child_setup, os.getpid(), cpus),
        )  # fmt: skip


@dataclass
class Gen:
    """One load generator process."""

    name: str  # "Locust", "Locust master", "Locust worker 2 of 2"
    proc: subprocess.Popen
    log: Path


def spawn_gen(name: str, cmd: list[str], log: Path, cwd: Path, cpus: list[int] | None) -> Gen:
    return Gen(name, spawn_locust(cmd, log, cwd, cpus), log)


def kill(gens: list[Gen]) -> None:
    """Kill and reap every generator process still running."""
    for g in gens:
        if g.proc.poll() is None:
            g.proc.kill()
            g.proc.wait()


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM into SystemExit (SIGINT already raises KeyboardInterrupt) while the block runs, so
    `finally` clauses stop child processes before this process exits. Main thread only (elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@dataclass(frozen=True)
class Baseline:
    """The reaped children's CPU seconds and the time when the window's generator was started."""

    children_cpu_s: float
    wall: float

    def complete(self, s: Samples) -> Samples:
        """`s`, or, when Locust ended before a window sample (a starved runner overslept), its CPU over
        its whole life, taken from the reaped children's rusage (call once its processes are reaped)."""
        if s.cpu_a is not None and s.cpu_b is not None:
            return s
        cpu = _children_cpu_s() - self.children_cpu_s
        return replace(s, cpu_a=0.0, wall_a=self.wall, cpu_b=cpu, wall_b=time.time())


@contextmanager
def generator_session(w: Window) -> Iterator[Baseline]:
    """While a window's generator runs: SIGTERM raises SystemExit (so the caller's `finally` stops its
    processes) and, with loadgen.keep_warm, SCHED_IDLE spinners keep the generator's cores awake
    (reco.serve.keepwarm); they are stopped on the way out, whatever happened."""
    spinners: list[subprocess.Popen] = []
    with stop_on_signals():
        try:
            if w.c.loadgen.keep_warm:
                spinners = start_keep_warm(w.cpus or sorted(os.sched_getaffinity(0)))
            yield Baseline(_children_cpu_s(), time.time())
        finally:
            stop_keep_warm(spinners)


def wait_for(paths: list[Path], gens: list[Gen], deadline: float, check: Check = _nothing) -> bool:
    """Until every path exists (True), the first process exits or the deadline passes (False);
    `check()` runs on every poll (it may raise)."""
    while not all(p.exists() for p in paths):
        check()
        if gens[0].proc.poll() is not None or time.time() > deadline:
            return all(p.exists() for p in paths)
        time.sleep(0.02)
    return True


def _sleep_until(t_epoch: float, proc: subprocess.Popen, check: Check) -> None:
    while (left := t_epoch - time.time()) > 0 and proc.poll() is None:
        check()
        time.sleep(min(left, 0.05))


def steal_s() -> float:
    """The machine's steal seconds so far, every CPU (0 where the kernel does not report it)."""
    return float(getattr(psutil.cpu_times(), "steal", 0.0))


def _cpu_s(ps: psutil.Process) -> float | None:
    """CPU seconds of the generator so far; None once it has exited."""
    try:
        t = ps.cpu_times()
    except psutil.NoSuchProcess:
        return None
    return t.user + t.system


# The server's /metrics is read SCRAPE_LEAD_S before the window opens (at most half the warm-up), not at
# its first request: rendering it takes the server's one core for milliseconds, and a scrape at the
# window's edge landed on its first (or last) request, which then set the p99 of a 100-request block
# (experiments/ecommerce_case_study/README.md#metrics-scrapes). The warm-up requests after it are in the
# server's stage figures, which are per request, from the same warm server.
SCRAPE_LEAD_S = 0.2


def measure(w: Window, gens: list[Gen], check: Check = _nothing) -> Samples:
    """From the test's start to the window's close: wait for every record's `.started` (by
    loadgen.startup_timeout_s, else LoadTestError with the first process's log); read the server's
    metrics just before the warm-up ends (SCRAPE_LEAD_S) and again once the window's requests have
    drained (every `.summary.json`), so neither read competes with a measured request; sample the
    generator's CPU at the window's open and close (every `.window_end`, or the window's cap long
    passed). The CPU is gens[0]'s (a distributed window's workers measure their own)."""
    c, proc = w.c, gens[0].proc
    started = w.files(".started")
    if not wait_for(started, gens, time.time() + float(c.loadgen.startup_timeout_s), check):
        why = f"exit code {proc.returncode}" if proc.poll() is not None else "timeout"
        raise LoadTestError(f"Locust did not start the test ({why}); {gens[0].log}:\n{log_tail(gens[0].log)}")
    time.sleep(0.05)  # the file is written in one call; let it land
    t0 = max(float(p.read_text()) for p in started)
    ps = psutil.Process(proc.pid)
    _sleep_until(t0 + c.warmup_s - min(SCRAPE_LEAD_S, c.warmup_s / 2), proc, check)
    before = _read_servers(w)
    _sleep_until(t0 + c.warmup_s, proc, check)
    cpu_a, wall_a, steal_a = _cpu_s(ps), time.time(), steal_s()
    wait_for(w.files(".window_end"), gens, t0 + c.warmup_s + w.cap_s + 30, check)
    cpu_b, wall_b, steal_b = _cpu_s(ps), time.time(), steal_s()
    wait_for(w.files(".summary.json"), gens, wall_b + float(c.drain_s) + 30, check)
    after = _read_servers(w)
    servers = tuple(zip(before, after, strict=True))
    return Samples(cpu_a, wall_a, before[0], cpu_b, wall_b, after[0], steal_a, steal_b, servers)


def _read_servers(w: Window) -> list[str]:
    """One scrape of every server the window sends to (Window.served), in its order."""
    return [t.probe.read(t.url) for t in w.served]


def check_record(w: Window, gens: list[Gen]) -> None:
    """LoadTestError unless every generator process wrote its record's summary (every served server's)."""
    for t in w.served:
        if not all(p.exists() for p in t.files(".summary.json")):
            raise LoadTestError(
                f"Locust exited (code {gens[0].proc.returncode}) without writing {t.latency_file}:\n"
                f"{log_tail(w.log)}"
            )
