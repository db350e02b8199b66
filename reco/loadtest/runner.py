"""Run one load test: Locust headless in its own process, exact quantiles with CIs, server stage times.

    run = run_load(url, cfg, out_dir, requests_path, cpus=[0], kind="common")   # -> LoadRun
    run.quantiles["p99"].fmt()  -> '12.3 [11.9, 13.0] (n=1,000)' or 'n/a (n=120)'
    run_metrics(run)            -> the flat MLflow metrics (reco.loadtest.runs)

    server_cpus, loadgen_cpus = plan_cpus()   # e.g. ([1], [0]) on two cores

`cfg` is the `loadtest` config (LoadtestConfig, or its dict). The window ends after `window_requests`
requests (capped at `max_window_s`) or after `duration_s` (see loadtest/locustfile.py). The generator is
pinned to `cpus` (give it cores the server is not on). The server's /metrics is scraped when the window
opens and when it closes (the generator writes both times), so warm-up requests are in neither the
client's nor the server's figures.

A Triton server (serve.backend=triton, `triton_model=handle.triton_model`) is sent KServe v2 requests,
and its statistics endpoint is scraped instead of /metrics (reco.loadtest.triton_stats).

Every quantile is over ALL requests of the window, failed / shed / timed-out / unsent / unanswered ones
as +inf (reco.stats.with_failures); a quantile that n cannot support is None. A run is valid=False
(with invalid_reason) when the generator itself may have been the bottleneck: its CPU over the window
above loadgen.max_cpu_pct of one core, or, in open loop, sends lagging their schedule by more than
loadgen.max_lag_ms at p99; or when no request succeeded.

SIGINT / SIGTERM of the calling process while a test runs stop Locust and the keep-warm spinners before
the process exits (and both die with the caller even on SIGKILL: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from reco.children import die_with_parent
from reco.loadtest.config import LoadMode, LoadtestConfig, loadtest_config
from reco.loadtest.histogram import plot_cdf, read_latencies
from reco.loadtest.outcome import LoadRun
from reco.loadtest.runs import make_run
from reco.loadtest.triton_stats import scrape_stats, stats_summary
from reco.serve.keepwarm import start_keep_warm, stop_keep_warm
from reco.serve.process import log_tail

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtest" / "locustfile.py"


class LoadTestError(RuntimeError):
    pass


def plan_cpus() -> tuple[list[int] | None, list[int] | None]:
    """(server cores, load generator cores): the generator on one core of its own, the server on the
    rest, so neither steals the other's CPU; (None, None) on a single core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return cores[1:], cores[:1]


def scrape(url: str, timeout_s: float = 5.0) -> str:
    """GET {url}/metrics as text; empty string when the server does not answer."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            return r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return ""


def _window_cap_s(c: LoadtestConfig) -> float:
    return float(c.max_window_s if c.window_requests else c.duration_s)


def locust_command(
    url: str,
    c: LoadtestConfig,
    out_dir: Path,
    requests_path: Path | None,
    reports: bool = True,
    triton_model: str | None = None,
) -> list[str]:
    """The headless Locust command line of one load test (KServe v2 to `triton_model` when given)."""
    if c.window_requests is None and c.duration_s <= 0:
        raise ValueError(
            f"loadtest.duration_s: expected > 0 when window_requests is null, got {c.duration_s}"
        )
    if c.window_requests is not None and c.window_requests < 1:
        raise ValueError(f"loadtest.window_requests: expected >= 1 or null, got {c.window_requests}")
    users = int(c.users) if c.mode == LoadMode.closed else 1
    # A safety net only: the locustfile stops the test itself once the window has drained.
    run_time = math.ceil(c.warmup_s + _window_cap_s(c) + c.drain_s + 30)
    cmd = [
        sys.executable, "-m", "locust",
        "-f", str(LOCUSTFILE),
        "--headless",
        "--host", url,
        "-u", str(users),
        "-r", str(c.spawn_rate),
        "-t", f"{run_time}s",
        "--only-summary",
        "--loglevel", "WARNING",
        "--exit-code-on-error", "0",
        "--load-mode", c.mode.value,
        "--rate", str(float(c.rate)),
        "--max-inflight", str(int(c.max_inflight)),
        "--think-time-s", str(float(c.think_time_s)),
        "--warmup-s", str(float(c.warmup_s)),
        "--duration-s", str(_window_cap_s(c)),
        "--window-requests", str(int(c.window_requests or 0)),
        "--drain-s", str(float(c.drain_s)),
        "--score-every", str(int(c.score_every)),
        "--latency-file", str(out_dir / "latencies.csv"),
        "--seed", str(int(c.seed)),
    ]  # fmt: skip
    if requests_path is not None:
        cmd += ["--requests-file", str(requests_path)]
    if triton_model:
        cmd += ["--triton-model", triton_model]
    if reports:
        cmd += ["--csv", str(out_dir / "locust"), "--html", str(out_dir / "locust_report.html")]
        cmd += ["--json-file", str(out_dir / "locust_stats")]
    return cmd


def _wait_for(path: Path, proc: subprocess.Popen, deadline: float) -> bool:
    """Until `path` exists (True), the process exits or the deadline passes (False)."""
    while not path.exists():
        if proc.poll() is not None or time.time() > deadline:
            return path.exists()
        time.sleep(0.02)
    return True


def _sleep_until(t_epoch: float, proc: subprocess.Popen) -> None:
    while (left := t_epoch - time.time()) > 0 and proc.poll() is None:
        time.sleep(min(left, 0.05))


def _cpu_s(ps: psutil.Process) -> float | None:
    """CPU seconds of the generator so far; None once it has exited."""
    try:
        t = ps.cpu_times()
    except psutil.NoSuchProcess:
        return None
    return t.user + t.system


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


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


def _child_setup(parent_pid: int, cpus: list[int] | None) -> None:
    """In the Locust child before exec: die with the caller (PR_SET_PDEATHSIG), run on `cpus`."""
    die_with_parent(parent_pid)
    if cpus:
        os.sched_setaffinity(0, cpus)


def run_load(
    url: str,
    cfg: LoadtestConfig | Mapping,
    out_dir: str | Path,
    requests_path: str | Path | None = None,
    cpus: list[int] | None = None,
    *,
    kind: str = "load",
    reports: bool = True,
    triton_model: str | None = None,
) -> LoadRun:
    """One load test of the server at `url` (see the module docstring).

    Args:
        cfg: the `loadtest` config; mode, rate, users, window_requests/duration_s, warmup_s, drain_s,
            score_every and loadgen are read.
        out_dir: Locust's files, latencies.csv (+ .summary.json, .scores.jsonl), the CDF plot, the log.
        requests_path: JSONL of /recommend bodies; None: random users.
        cpus: cores for the generator (and its keep-warm spinners).
        kind: LoadRun.kind ("unloaded", "common", "equal_util", "capacity", ...).
        reports: also Locust's CSV/HTML/JSON reports and the CDF plot (~2 s; capacity windows skip them).
        triton_model: the server is Triton serving this model (ServerHandle.triton_model); None: reco's.
    Returns:
        The LoadRun of the measured window. Raises LoadTestError when Locust does not start or writes no
        latency file.
    """
    c = loadtest_config(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lat_path = out / "latencies.csv"
    for stale in ("", ".started", ".window_end", ".summary.json", ".scores.jsonl"):
        Path(f"{lat_path}{stale}").unlink(missing_ok=True)
    (out / "latency_cdf.png").unlink(missing_ok=True)
    if requests_path is not None and not Path(requests_path).exists():
        raise FileNotFoundError(f"{requests_path}: request file not found (see reco.loadtest.requests)")
    cmd = locust_command(url, c, out, Path(requests_path) if requests_path else None, reports, triton_model)
    figures = functools.partial(scrape_stats, model=triton_model) if triton_model else scrape
    log_path = out / "locust.log"
    lg = c.loadgen

    spinners: list[subprocess.Popen] = []
    proc: subprocess.Popen | None = None
    with stop_on_signals():
        try:
            if lg.keep_warm:
                spinners = start_keep_warm(cpus or sorted(os.sched_getaffinity(0)))
            children_cpu0, wall0 = _children_cpu_s(), time.time()
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=out,
                    preexec_fn=functools.partial(_child_setup, os.getpid(), cpus),
                )  # fmt: skip
            started = Path(f"{lat_path}.started")
            if not _wait_for(started, proc, time.time() + float(lg.startup_timeout_s)):
                why = f"exit code {proc.returncode}" if proc.poll() is not None else "timeout"
                raise LoadTestError(
                    f"Locust did not start the test ({why}); {log_path}:\n{log_tail(log_path)}"
                )
            time.sleep(0.05)  # the file is written in one call; let it land
            t0 = float(started.read_text())
            ps = psutil.Process(proc.pid)
            _sleep_until(t0 + c.warmup_s, proc)
            cpu_a, wall_a, before = _cpu_s(ps), time.time(), figures(url)
            _wait_for(Path(f"{lat_path}.window_end"), proc, t0 + c.warmup_s + _window_cap_s(c) + 30)
            cpu_b, wall_b, after = _cpu_s(ps), time.time(), figures(url)
            proc.wait(timeout=c.drain_s + 60)
            if cpu_a is None or cpu_b is None:
                # Locust ended before a window sample (a starved runner overslept): fall back to its CPU
                # over its whole life, taken from the reaped child's rusage.
                cpu_a, wall_a, cpu_b, wall_b = 0.0, wall0, _children_cpu_s() - children_cpu0, time.time()
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            stop_keep_warm(spinners)
    if not Path(f"{lat_path}.summary.json").exists():
        raise LoadTestError(
            f"Locust exited (code {proc.returncode}) without writing {lat_path}:\n{log_tail(log_path)}"
        )

    lat = read_latencies(lat_path)
    summary = json.loads(Path(f"{lat_path}.summary.json").read_text())
    open_ = summary.get("open") or {}
    window_start = summary["t0_epoch"] + c.warmup_s
    window_end = summary.get("window_end_epoch") or (window_start + _window_cap_s(c))
    cpu_pct = 100.0 * (cpu_b - cpu_a) / max(wall_b - wall_a, 1e-9)
    lag = float(open_.get("lag_p99_ms", 0.0))
    reasons = []
    if cpu_pct > lg.max_cpu_pct:
        reasons.append(f"load generator CPU {cpu_pct:.0f}% > loadtest.loadgen.max_cpu_pct={lg.max_cpu_pct:g}")
    if lag > lg.max_lag_ms:
        reasons.append(f"open-loop send lag p99 {lag:.1f} ms > loadtest.loadgen.max_lag_ms={lg.max_lag_ms:g}")
    stages = {}
    if before and after and triton_model:
        stages = stats_summary(before, after)
    elif before and after:
        from reco.serve.metrics import stage_summary

        stages = stage_summary(before, after)
    run = make_run(
        lat.window_ms(int(summary.get("unanswered", 0))),
        kind=kind,
        offered_qps=float(c.rate) if c.mode == LoadMode.open else None,
        window_s=max(window_end - window_start, 1e-9),
        loadgen_cpu_pct=cpu_pct,
        invalid_reasons=reasons,
        server_stages=stages,
        lag_p99_ms=lag,
        n_unsent=int(open_.get("overflow", 0)),
        params=_params(c, cpus, requests_path),
    )
    load = f"{c.users} users" if c.mode == LoadMode.closed else f"{c.rate:g} req/s Poisson"
    cdf = out / "latency_cdf.png"
    if reports:
        plot_cdf({f"{c.mode.value} loop": run.latencies_ms}, cdf, title=f"{kind}: {load}")
    run.artifacts = [
        p
        for p in (
            out / "locust_stats.csv",
            out / "locust_stats_history.csv",
            out / "locust_failures.csv",
            out / "locust_exceptions.csv",
            out / "locust_report.html",
            out / "locust_stats.json",
            lat_path,
            Path(f"{lat_path}.summary.json"),
            Path(f"{lat_path}.scores.jsonl"),
            cdf,
            log_path,
        )
        if p.exists() and p.stat().st_size > 0
    ]
    return run


def _params(c: LoadtestConfig, cpus: list[int] | None, requests_path: str | Path | None) -> dict[str, object]:
    p: dict[str, object] = {
        f"loadtest.{k}": getattr(c, k)
        for k in (
            "users",
            "spawn_rate",
            "rate",
            "window_requests",
            "duration_s",
            "warmup_s",
            "think_time_s",
            "seed",
        )
    }
    p["loadtest.mode"] = c.mode.value
    p["loadtest.cpus"] = ",".join(map(str, cpus)) if cpus else "any"
    p["loadtest.requests_file"] = str(requests_path) if requests_path else "random users"
    return p


def with_settings(cfg: LoadtestConfig | Mapping, **changes: Any) -> LoadtestConfig:
    """A copy of the loadtest config with top-level fields replaced (e.g. mode=LoadMode.open, rate=50)."""
    return dataclasses.replace(loadtest_config(cfg), **changes)
