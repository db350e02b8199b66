"""Distributed load generation (loadtest.workers = N > 1): the generator that runs a window on Locust's
master and N workers (DistributedLocust), and the merge of the workers' records into the one record a
single Locust process would have written.

    worker_file("out/latencies.csv", 1)          -> out/latencies.w1.csv (+ .started, .summary.json, ...)
    window_share(301, 0, 2), window_share(301, 1, 2)   -> 151, 150
    summary = merge_records(Path("out/latencies.csv"), 2)   # writes latencies.csv + .summary.json + ...

    python -m reco.cli.merge_records DIR/latencies.csv N   # merge records collected from N workers'
                                                              # machines; print quantiles, every worker's
                                                              # CPU and lag against loadtest.loadgen

Locust's master only dispatches users and collects its rounded statistics; the figures reco reports come
from the workers' own exact records. Every worker (loadtest/locustfile.py) writes its per-request file,
schedule lag and CPU over its window beside the master's --latency-file, named by the index the master
gave it. The merge concatenates the requests (so quantiles over the merged file are exact), rebases
their times on the earliest worker's start and keeps each worker's summary, so the saturation check can
judge every worker on its own (one saturated worker voids the window).

DistributedLocust starts the master (`--master --expect-workers N`, bound to 127.0.0.1) and N workers,
worker i pinned to cpus[i % len(cpus)], for this window alone; the validity check (reco.loadtest.window.
judge_window) covers the master's CPU and every worker's own CPU over its window and send lag. A worker
or the master that exits before every worker has finished its window raises LoadTestError naming it
(the master reports a worker it lost in `<latency file>.failed`); every process is then stopped.

What a worker itself needs (worker_file, window_share, lag_p99) is in reco.loadtest.records, which the
locustfile imports without this module's dependencies.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from reco.loadtest.locust_proc import (
    LOCUSTFILE,
    Check,
    Gen,
    check_record,
    generator_session,
    kill,
    locust_command,
    measure,
    spawn_gen,
    wait_for,
)
from reco.loadtest.outcome import LoadRun
from reco.loadtest.records import HEADER, lag_p99, window_share, worker_file
from reco.loadtest.window import LoadTestError, Samples, Window, finish_run
from reco.serve.process import free_port, log_tail

__all__ = ["HEADER", "DistributedLocust", "lag_p99", "merge_records", "window_share", "worker_file"]


def merge_records(latency_file: Path, workers: int) -> dict[str, Any]:
    """Merge workers 0..workers-1's records into `latency_file` (+ .started, .window_end, .summary.json,
    .scores.jsonl), as one process would have written them.

    Args:
        latency_file: the master's --latency-file; the workers' records are worker_file(latency_file, i).
        workers: how many workers took part.
    Returns:
        The merged summary: counts summed, t0 the earliest start, the window's end the latest, open-loop
        lag p99 the largest worker's (an upper bound of the merged p99), and `workers`: each worker's own
        summary (its CPU over its window, lag, counts). Raises FileNotFoundError naming a missing record.
    """
    sums = []
    for i in range(workers):
        p = Path(f"{worker_file(latency_file, i)}.summary.json")
        if not p.exists():
            raise FileNotFoundError(f"{p}: Locust worker {i} wrote no record (did it finish its window?)")
        sums.append(json.loads(p.read_text()))
    t0 = min(s["t0_epoch"] for s in sums)
    rows = []
    for i, s in enumerate(sums):
        a = np.loadtxt(worker_file(latency_file, i), delimiter=",", skiprows=1, ndmin=2)
        if a.size:
            a[:, 0] += s["t0_epoch"] - t0
            rows.append(a)
    merged = np.concatenate(rows) if rows else np.zeros((0, 4))
    merged = merged[np.argsort(merged[:, 0], kind="stable")]
    with open(latency_file, "w") as f:
        f.write(HEADER + "\n")
        f.writelines(f"{s:.6f},{lat:.4f},{int(ok)},{int(st)}\n" for s, lat, ok, st in merged)
    scores = [Path(f"{worker_file(latency_file, i)}.scores.jsonl") for i in range(workers)]
    if any(p.exists() for p in scores):
        Path(f"{latency_file}.scores.jsonl").write_text("".join(p.read_text() for p in scores if p.exists()))
    ends = [s["window_end_epoch"] for s in sums if s.get("window_end_epoch")]
    summary: dict[str, Any] = {
        **{k: sums[0][k] for k in ("mode", "warmup_s", "duration_s", "payloads")},
        "t0_epoch": t0,
        "window_end_epoch": max(ends) if ends else None,
        "window_requests": sum(s["window_requests"] for s in sums),
        **{k: sum(s[k] for s in sums) for k in ("n_window", "n_recorded", "unanswered", "n_all")},
        "open": None,
        "workers": sums,
    }
    if all(s.get("open") for s in sums):
        summary["open"] = {
            "rate": sum(s["open"]["rate"] for s in sums),
            "overflow": sum(s["open"]["overflow"] for s in sums),
            "lag_p99_ms": max(s["open"]["lag_p99_ms"] for s in sums),
            "lag_max_ms": max(s["open"]["lag_max_ms"] for s in sums),
        }
    Path(f"{latency_file}.summary.json").write_text(json.dumps(summary, indent=2))
    Path(f"{latency_file}.started").write_text(repr(t0))
    if summary["window_end_epoch"] is not None:
        Path(f"{latency_file}.window_end").write_text(repr(summary["window_end_epoch"]))
    return summary


def master_command(cmd: list[str], workers: int, port: int) -> list[str]:
    """`cmd` (locust_command's) as the master of `workers` local workers, on 127.0.0.1:`port`."""
    return [
        *cmd, "--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
        "--expect-workers", str(workers),
    ]  # fmt: skip


def worker_command(w: Window, port: int) -> list[str]:
    """A Locust worker of the master on 127.0.0.1:`port`. Only what its init reads is given here; the
    test's options (rate, window, files) arrive from the master."""
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker",
        "--master-host", "127.0.0.1", "--master-port", str(port),
        "--loglevel", "WARNING", "--seed", str(int(w.c.seed)),
    ]  # fmt: skip
    if w.requests is not None:
        cmd += ["--requests-file", str(w.requests)]
    if w.triton_model:  # read at the worker's init, like the request file
        cmd += ["--triton-model", w.triton_model]
    return cmd


def _check_alive(gens: list[Gen], done: list[Path], failed: Path) -> None:
    """Any generator process gone before every worker's record exists fails the run."""
    if all(p.exists() for p in done):
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


class DistributedLocust:
    """Locust's master and loadtest.workers workers, started for this window alone."""

    def run_window(self, w: Window) -> LoadRun:
        n, done = w.c.workers, w.files(".summary.json")
        with generator_session(w) as base:
            gens: list[Gen] = []
            try:
                _spawn(w, gens)
                check = functools.partial(_check_alive, gens, done, Path(f"{w.latency_file}.failed"))
                samples = base.complete(self._until_done(w, gens, check))
            finally:
                kill(gens)
        check_record(w, gens)
        summary = merge_records(w.latency_file, n)
        logs = [w.out / f"locust.worker{i + 1}.log" for i in range(n)]
        return finish_run(w, summary, samples, *_by_process(summary, gens[0], samples), extra_artifacts=logs)

    @staticmethod
    def _until_done(w: Window, gens: list[Gen], check: Check) -> Samples:
        """The window's samples, once every worker has drained and written its record and every process
        has exited (LoadTestError when a worker does not finish in time or a process is lost)."""
        samples = measure(w, gens, check)
        if not wait_for(w.files(".summary.json"), gens, time.time() + w.c.drain_s + 60, check):
            check()
            raise LoadTestError(f"Locust workers did not finish their windows in time; {w.log}")
        gens[0].proc.wait(timeout=w.c.drain_s + 60)
        for g in gens[1:]:
            g.proc.wait(timeout=30)
        return samples


def _spawn(w: Window, gens: list[Gen]) -> None:
    """Start the master, then its workers, each appended to `gens` as soon as it runs (a start that fails
    leaves the ones before it in `gens`, for the caller to kill)."""
    n, port = w.c.workers, free_port()
    gens.append(spawn_gen("Locust master", master_command(locust_command(w), n, port), w.log, w.out, w.cpus))
    for i in range(n):
        log, cpus = w.out / f"locust.worker{i + 1}.log", [w.cpus[i % len(w.cpus)]] if w.cpus else None
        gens.append(spawn_gen(f"Locust worker {i + 1} of {n}", worker_command(w, port), log, w.out, cpus))


def _by_process(
    summary: dict[str, Any], master: Gen, s: Samples
) -> tuple[dict[str, float], dict[str, float]]:
    """judge_window's cpu_by and lag_by: the master's CPU (sampled by the runner) and every worker's own
    CPU over its window and send lag (from its record), each named, so one saturated worker voids it."""
    workers = {f" on Locust worker index {w['index']} (pid {w['pid']})": w for w in summary["workers"]}
    cpu_by = {f" on {master.name}": s.cpu_pct()} | {who: float(w["cpu_pct"]) for who, w in workers.items()}
    lag_by = {who: float((w["open"] or {}).get("lag_p99_ms", 0.0)) for who, w in workers.items()}
    return cpu_by, lag_by
