"""Run one load test: Locust in its own process, exact quantiles with CIs, server stage times.

    run = run_load(url, c, out_dir, requests_path, cpus=[0], kind="common")   # -> LoadRun
    run.quantiles["p99"].fmt()  -> '12.3 [11.9, 13.0] (n=1,000)' or 'n/a (n=120)'
    run_metrics(run)            -> the flat MLflow metrics (reco.loadtest.runs)

    server_cpus, loadgen_cpus = plan_cpus()   # e.g. ([1], [0]) on two cores

run_load is a facade: it resolves the window (reco.loadtest.window.plan_window) and hands it to one of
three load generators (reco.loadtest.window.LoadGenerator), each in the module of its job:

    HeadlessLocust     (here) one headless Locust process per window
    PooledLocust       (reco.loadtest.locust_pool, what a study uses) a web-mode process kept across
                       windows, each window a POST /swarm
    DistributedLocust  (reco.loadtest.distributed) loadtest.workers > 1: a Locust master and N workers

A window leaves the same files whichever ran it (but Locust's stats-history CSV, headless only) and is
judged by the one window judge (reco.loadtest.window.judge_window). `c` is the typed `loadtest` config
(an entry point types its raw group once: reco.loadtest.config.loadtest_config). The window ends after
`window_requests` requests (capped at `max_window_s`) or after `duration_s` (see loadtest/locustfile.py).
The generator is pinned to `cpus` (give it cores the server is not on). The server's /metrics is scraped
when the window opens and when it closes (reco.loadtest.scrape; the generator writes both times), so
warm-up requests are in neither the client's nor the server's figures.

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
import os
from pathlib import Path
from typing import Any

from reco.config import typed
from reco.loadtest.config import LoadtestConfig
from reco.loadtest.distributed import DistributedLocust
from reco.loadtest.locust_pool import LocustPool, PooledLocust
from reco.loadtest.locust_proc import (
    LOCUSTFILE,
    check_record,
    generator_session,
    kill,
    locust_command,
    measure,
    spawn_gen,
    stop_on_signals,
)
from reco.loadtest.outcome import LoadRun
from reco.loadtest.scrape import scrape
from reco.loadtest.window import (
    LoadGenerator,
    LoadTestError,
    Samples,
    Window,
    finish_single_process,
    plan_window,
)
from reco.serve.process import free_port

__all__ = [  # what callers import from here (study, capacity, bench/, tests, reco.cli.errors)
    "LOCUSTFILE",
    "LoadTestError",
    "free_port",
    "plan_cpus",
    "run_load",
    "scrape",
    "stop_on_signals",
    "with_settings",
]


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


class HeadlessLocust:
    """One headless Locust process for this window alone (pays Python's and Locust's start-up each time;
    the only generator that also writes Locust's stats-history CSV)."""

    def run_window(self, w: Window) -> LoadRun:
        return finish_single_process(w, self.collect(w))

    def collect(self, w: Window) -> Samples:
        """Run the window; what was sampled at its edges (every served server's scrapes included)."""
        cmd = locust_command(w)
        with generator_session(w) as base:
            gens = [spawn_gen("Locust", cmd, w.log, w.out, w.cpus)]
            try:
                samples = measure(w, gens)
                gens[0].proc.wait(timeout=w.c.drain_s + 60)
                samples = base.complete(samples)
            finally:
                kill(gens)
        check_record(w, gens)
        return samples


def generator(c: LoadtestConfig, pool: LocustPool | None = None) -> LoadGenerator:
    """The generator of a window: Locust's master and workers when loadtest.workers > 1, else the pool's
    kept process when a pool is given, else a headless process of its own."""
    if c.workers > 1:
        return DistributedLocust()
    return HeadlessLocust() if pool is None else PooledLocust(pool)


def run_load(
    url: str,
    c: LoadtestConfig,
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
        c: the `loadtest` config; mode, rate, users, window_requests/duration_s, warmup_s, drain_s,
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
    w = plan_window(
        url, c, out_dir, requests_path, cpus, kind=kind, reports=reports, triton_model=triton_model
    )
    return generator(w.c, pool).run_window(w)


def with_settings(c: LoadtestConfig, **changes: Any) -> LoadtestConfig:
    """A copy of the loadtest config with top-level fields replaced (e.g. mode=LoadMode.open, rate=50),
    range-checked again (the schemas' check hooks), since a replaced section skipped compose time."""
    return typed(dataclasses.replace(c, **changes), LoadtestConfig, "loadtest")
