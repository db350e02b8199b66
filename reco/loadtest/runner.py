"""Run one load test: Locust in its own process, exact quantiles with CIs, server stage times.

    run = run_load(url, cfg, out_dir, requests_path, cpus=[0], kind="common")   # -> LoadRun
    run.quantiles["p99"].fmt()  -> '12.3 [11.9, 13.0] (n=1,000)' or 'n/a (n=120)'
    run_metrics(run)            -> the flat MLflow metrics (reco.loadtest.runs)

    server_cpus, loadgen_cpus = plan_cpus()   # e.g. ([1], [0]) on two cores

Locust runs headless, one process per window, or, given a LocustPool (reco.loadtest.locust_pool, what a
study uses), in a web-mode process kept across windows, each window a POST /swarm; a window leaves the
same files either way (but Locust's stats-history CSV, headless only). `cfg` is the `loadtest` config
(LoadtestConfig, or its dict). The window ends after `window_requests` requests (capped at
`max_window_s`) or after `duration_s` (see loadtest/locustfile.py). The generator is
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

With loadtest.workers = N > 1 the generator is Locust's own distributed engine on this machine: a
master (`--master --expect-workers N`, bound to 127.0.0.1) and N worker processes, worker i pinned to
cpus[i % len(cpus)]; the rate, users and window split across them (reco.loadtest.distributed), their
exact records are merged into latencies.csv, and the validity check covers every worker (its own CPU
over its window and its send lag) and the master. A worker or master that exits before every worker
has finished its window raises LoadTestError naming it; every process is then stopped.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from reco.loadtest.config import LoadMode, LoadtestConfig, loadtest_config
from reco.loadtest.distributed import merge_records, worker_file
from reco.loadtest.histogram import plot_cdf, read_latencies
from reco.loadtest.locust_pool import LOCUSTFILE, LocustPool, spawn_locust
from reco.loadtest.outcome import LoadRun
from reco.loadtest.runs import make_run
from reco.loadtest.triton_stats import scrape_stats, stats_summary
from reco.serve.keepwarm import start_keep_warm, stop_keep_warm
from reco.serve.process import free_port, log_tail


class LoadTestError(RuntimeError):
    pass


def plan_cpus(workers: int = 1) -> tuple[list[int] | None, list[int] | None]:
    """(server cores, load generator cores): the generator on cores of its own (one per Locust worker
    while at least one core is left for the server), the server on the rest, so neither steals the
    other's CPU; (None, None) on a single core.

    Args:
        workers: loadtest.workers; with fewer spare cores than workers, workers share the generator's.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    k = max(1, min(workers, len(cores) - 1))
    return cores[k:], cores[:k]


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
    users, run_time, opts = window_options(c, out_dir / "latencies.csv")
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
        "-u", str(users), "-r", str(c.spawn_rate), "-t", f"{run_time}s", "--only-summary",
        "--loglevel", "WARNING", "--exit-code-on-error", "0",
    ]  # fmt: skip
    for k, v in opts.items():
        cmd += ["--" + k.replace("_", "-"), str(v)]
    if requests_path is not None:
        cmd += ["--requests-file", str(requests_path)]
    if triton_model:
        cmd += ["--triton-model", triton_model]
    if reports:
        cmd += ["--csv", str(out_dir / "locust"), "--html", str(out_dir / "locust_report.html")]
        cmd += ["--json-file", str(out_dir / "locust_stats")]
    return cmd


def window_options(c: LoadtestConfig, latency_file: Path) -> tuple[int, int, dict[str, object]]:
    """(users, run time s, the locustfile's options by dest name) of one window: the headless command's
    flags and the kept process's /swarm form (reco.loadtest.locust_pool) carry the same values."""
    if c.window_requests is None and c.duration_s <= 0:
        raise ValueError(
            f"loadtest.duration_s: expected > 0 when window_requests is null, got {c.duration_s}"
        )
    if c.window_requests is not None and c.window_requests < 1:
        raise ValueError(f"loadtest.window_requests: expected >= 1 or null, got {c.window_requests}")
    _check_workers(c)
    # Open loop: one Poisson scheduler per process (Locust gives each worker one user).
    users = int(c.users) if c.mode == LoadMode.closed else c.workers
    # A safety net only: the locustfile stops the test itself once the window has drained.
    run_time = math.ceil(c.warmup_s + _window_cap_s(c) + c.drain_s + 30)
    opts: dict[str, object] = {
        "load_mode": c.mode.value,
        "rate": float(c.rate),
        "max_inflight": int(c.max_inflight),
        "think_time_s": float(c.think_time_s),
        "warmup_s": float(c.warmup_s),
        "duration_s": _window_cap_s(c),
        "window_requests": int(c.window_requests or 0),
        "drain_s": float(c.drain_s),
        "score_every": int(c.score_every),
        "latency_file": str(latency_file),
        "seed": int(c.seed),
    }
    return users, run_time, opts


def _check_workers(c: LoadtestConfig) -> None:
    if c.workers < 1:
        raise ValueError(f"loadtest.workers: expected >= 1, got {c.workers}")
    if c.workers > 1 and c.mode == LoadMode.closed and c.users % c.workers:
        raise ValueError(
            f"loadtest.users={c.users} with loadtest.workers={c.workers}: closed-loop users must split "
            f"evenly across the workers (a multiple of {c.workers})"
        )
    if c.window_requests is not None and c.window_requests < c.workers:
        raise ValueError(
            f"loadtest.window_requests={c.window_requests}: expected >= loadtest.workers={c.workers}"
        )


def master_command(cmd: list[str], workers: int, port: int) -> list[str]:
    """`cmd` (locust_command's) as the master of `workers` local workers, on 127.0.0.1:`port`."""
    return [
        *cmd, "--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
        "--expect-workers", str(workers),
    ]  # fmt: skip


def worker_command(
    c: LoadtestConfig, requests_path: Path | None, port: int, triton_model: str | None = None
) -> list[str]:
    """A Locust worker of the master on 127.0.0.1:`port`. Only what its init reads is given here; the
    test's options (rate, window, files) arrive from the master."""
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker",
        "--master-host", "127.0.0.1", "--master-port", str(port),
        "--loglevel", "WARNING", "--seed", str(int(c.seed)),
    ]  # fmt: skip
    if requests_path is not None:
        cmd += ["--requests-file", str(requests_path)]
    if triton_model:  # read at the worker's init, like the request file
        cmd += ["--triton-model", triton_model]
    return cmd


@dataclass
class _Gen:
    """One load generator process."""

    name: str  # "Locust", "Locust master", "Locust worker 2 of 2"
    proc: subprocess.Popen
    log: Path


def _spawn(name: str, cmd: list[str], log_path: Path, cwd: Path, cpus: list[int] | None) -> _Gen:
    return _Gen(name, spawn_locust(cmd, log_path, cwd, cpus), log_path)


def _check_alive(gens: list[_Gen], done: list[Path], failed: Path) -> None:
    """Distributed: any generator process gone before every worker's record exists fails the run."""
    if len(gens) < 2 or all(p.exists() for p in done):
        return
    for g in gens:
        if g.proc.poll() is None:
            continue
        if failed.exists():  # the master saw a worker go (missed heartbeats, a remote worker) first
            raise LoadTestError(
                f"{failed.read_text().strip()} (reported by the Locust master); the window is not "
                f"counted. {gens[0].log}:\n{log_tail(gens[0].log)}"
            )
        raise LoadTestError(
            f"{g.name} (pid {g.proc.pid}) exited with code {g.proc.returncode} before every worker had "
            f"finished its window; the window is not counted. {g.log}:\n{log_tail(g.log)}"
        )


def _wait_for(paths: list[Path], gens: list[_Gen], deadline: float, check=lambda: None) -> bool:
    """Until every path exists (True), the first process exits or the deadline passes (False);
    `check()` runs on every poll (it may raise)."""
    while not all(p.exists() for p in paths):
        check()
        if gens[0].proc.poll() is not None or time.time() > deadline:
            return all(p.exists() for p in paths)
        time.sleep(0.02)
    return True


def _sleep_until(t_epoch: float, proc: subprocess.Popen, check=lambda: None) -> None:
    while (left := t_epoch - time.time()) > 0 and proc.poll() is None:
        check()
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
    pool: LocustPool | None = None,
) -> LoadRun:
    """One load test of the server at `url` (see the module docstring).

    Args:
        cfg: the `loadtest` config; mode, rate, users, window_requests/duration_s, warmup_s, drain_s,
            score_every, workers and loadgen are read.
        out_dir: Locust's files, latencies.csv (+ .summary.json, .scores.jsonl), the CDF plot, the log.
        requests_path: JSONL of /recommend bodies; None: random users.
        cpus: cores for the generator (and its keep-warm spinners).
        kind: LoadRun.kind ("unloaded", "common", "equal_util", "capacity", ...).
        reports: also Locust's CSV/HTML/JSON reports and the CDF plot (~2 s; capacity windows skip them).
        triton_model: the server is Triton serving this model (ServerHandle.triton_model); None: reco's.
        pool: run the window in a Locust process kept across windows (a single-process generator);
            None: a headless Locust process for this window alone.
    Returns:
        The LoadRun of the measured window. Raises LoadTestError when Locust does not start, writes no
        latency file, or (workers > 1) a worker or the master exits before every window is done.
    """
    c = loadtest_config(cfg)
    out = Path(out_dir).resolve()  # Locust runs with its own cwd: every path it is handed is absolute
    out.mkdir(parents=True, exist_ok=True)
    lat_path = out / "latencies.csv"
    n = c.workers
    records = [lat_path] if n == 1 else [worker_file(lat_path, i) for i in range(n)]
    suffixes = ("", ".started", ".window_end", ".summary.json", ".scores.jsonl")
    for stale in [f"{lat_path}.failed"] + [f"{r}{s}" for r in {lat_path, *records} for s in suffixes]:
        Path(stale).unlink(missing_ok=True)
    (out / "latency_cdf.png").unlink(missing_ok=True)
    if requests_path is not None and not Path(requests_path).exists():
        raise FileNotFoundError(f"{requests_path}: request file not found (see reco.loadtest.requests)")
    req = Path(requests_path).resolve() if requests_path else None
    users, run_time, opts = window_options(c, lat_path)  # checks the settings before any process starts
    kept = pool.get(url, req, triton_model, cpus, c.seed) if pool is not None and n == 1 else None
    cmd = locust_command(url, c, out, req, reports, triton_model) if kept is None else []
    figures = functools.partial(scrape_stats, model=triton_model) if triton_model else scrape
    log_path = out / "locust.log"
    lg = c.loadgen
    done = [Path(f"{r}.summary.json") for r in records]

    spinners: list[subprocess.Popen] = []
    gens: list[_Gen] = []
    kept_log_at, finished = (kept.log.stat().st_size if kept else 0), False
    with stop_on_signals():
        try:
            if lg.keep_warm:
                spinners = start_keep_warm(cpus or sorted(os.sched_getaffinity(0)))
            children_cpu0, wall0 = _children_cpu_s(), time.time()
            if kept is not None:
                gens.append(_Gen("Locust", kept.proc, kept.log))
                form = {"user_count": users, "spawn_rate": c.spawn_rate, "host": url, "run_time": run_time}
                kept.swarm(form | opts)
            elif n == 1:
                gens.append(_spawn("Locust", cmd, log_path, out, cpus))
            else:
                port = free_port()
                gens.append(_spawn("Locust master", master_command(cmd, n, port), log_path, out, cpus))
                for i in range(n):
                    gens.append(
                        _spawn(
                            f"Locust worker {i + 1} of {n}", worker_command(c, req, port, triton_model),
                            out / f"locust.worker{i + 1}.log", out, [cpus[i % len(cpus)]] if cpus else None,
                        )
                    )  # fmt: skip
            proc = gens[0].proc
            check = functools.partial(_check_alive, gens, done, Path(f"{lat_path}.failed"))
            started = [Path(f"{r}.started") for r in records]
            if not _wait_for(started, gens, time.time() + float(lg.startup_timeout_s), check):
                why = f"exit code {proc.returncode}" if proc.poll() is not None else "timeout"
                raise LoadTestError(
                    f"Locust did not start the test ({why}); {gens[0].log}:\n{log_tail(gens[0].log)}"
                )
            time.sleep(0.05)  # the file is written in one call; let it land
            t0 = max(float(p.read_text()) for p in started)
            ps = psutil.Process(proc.pid)
            _sleep_until(t0 + c.warmup_s, proc, check)
            cpu_a, wall_a, before = _cpu_s(ps), time.time(), figures(url)
            window_end = [Path(f"{r}.window_end") for r in records]
            _wait_for(window_end, gens, t0 + c.warmup_s + _window_cap_s(c) + 30, check)
            cpu_b, wall_b, after = _cpu_s(ps), time.time(), figures(url)
            if n > 1 and not _wait_for(done, gens, time.time() + c.drain_s + 60, check):
                check()
                raise LoadTestError(f"Locust workers did not finish their windows in time; {log_path}")
            if kept is not None:
                kept.wait_stopped(time.time() + c.drain_s + 60)
                if reports:
                    kept.write_reports()
            else:
                proc.wait(timeout=c.drain_s + 60)
            for g in gens[1:]:
                g.proc.wait(timeout=30)
            if cpu_a is None or cpu_b is None:
                # Locust ended before a window sample (a starved runner overslept): fall back to its CPU
                # over its whole life, taken from the reaped children's rusage.
                cpu_a, wall_a, cpu_b, wall_b = 0.0, wall0, _children_cpu_s() - children_cpu0, time.time()
            finished = True
        finally:
            if kept is not None:
                _copy_tail(kept.log, kept_log_at, log_path)  # this window's part of the kept log
                if not finished:  # mid-test, or gone: a fresh process for the next window
                    pool.discard(kept.key)
            for g in gens if kept is None else []:
                if g.proc.poll() is None:
                    g.proc.kill()
                    g.proc.wait()
            stop_keep_warm(spinners)
    if not all(p.exists() for p in done):
        raise LoadTestError(
            f"Locust exited (code {proc.returncode}) without writing {lat_path}:\n{log_tail(log_path)}"
        )

    summary = merge_records(lat_path, n) if n > 1 else json.loads(done[0].read_text())
    lat = read_latencies(lat_path)
    open_ = summary.get("open") or {}
    window_start = summary["t0_epoch"] + c.warmup_s
    window_end = summary.get("window_end_epoch") or (window_start + _window_cap_s(c))
    cpu_pct = 100.0 * (cpu_b - cpu_a) / max(wall_b - wall_a, 1e-9)
    lag = float(open_.get("lag_p99_ms", 0.0))
    # Every generator process is judged on its own: one saturated worker voids the window.
    cpus_by: dict[str, float] = {"": cpu_pct}  # " on <process>" -> its CPU %, of one core
    lags_by: dict[str, float] = {"": lag}  # " on <worker>" -> its send lag p99 ms
    if n > 1:
        cpus_by = {f" on {gens[0].name}": cpu_pct}
        workers = {f" on Locust worker index {w['index']} (pid {w['pid']})": w for w in summary["workers"]}
        cpus_by |= {who: float(w["cpu_pct"]) for who, w in workers.items()}
        lags_by = {who: float((w["open"] or {}).get("lag_p99_ms", 0.0)) for who, w in workers.items()}
    reasons = [
        f"load generator CPU {pct:.0f}%{who} > loadtest.loadgen.max_cpu_pct={lg.max_cpu_pct:g}"
        for who, pct in cpus_by.items()
        if pct > lg.max_cpu_pct
    ]
    reasons += [
        f"open-loop send lag p99 {ms:.1f} ms{who} > loadtest.loadgen.max_lag_ms={lg.max_lag_ms:g}"
        for who, ms in lags_by.items()
        if ms > lg.max_lag_ms
    ]
    cpu_pct, lag = max(cpus_by.values()), max(lags_by.values())
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
            *(out / f"locust.worker{i + 1}.log" for i in range(n) if n > 1),
        )
        if p.exists() and p.stat().st_size > 0
    ]
    return run


def _copy_tail(src: Path, offset: int, dst: Path) -> None:
    with open(src, "rb") as f:
        f.seek(offset)
        dst.write_bytes(f.read())


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
            "workers",
        )
    }
    p["loadtest.mode"] = c.mode.value
    p["loadtest.cpus"] = ",".join(map(str, cpus)) if cpus else "any"
    p["loadtest.requests_file"] = str(requests_path) if requests_path else "random users"
    return p


def with_settings(cfg: LoadtestConfig | Mapping, **changes: Any) -> LoadtestConfig:
    """A copy of the loadtest config with top-level fields replaced (e.g. mode=LoadMode.open, rate=50)."""
    return dataclasses.replace(loadtest_config(cfg), **changes)
