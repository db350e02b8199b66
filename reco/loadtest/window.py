"""One load-test window, whichever generator runs it: what it is (Window), the generator protocol, the
window judge, and the LoadRun every generator hands back.

    w = plan_window(url, c, out_dir, requests_path, cpus, kind="common", reports=True, triton_model=None)
    run = generator.run_window(w)          # a LoadGenerator: reco.loadtest.runner.HeadlessLocust,
                                           # reco.loadtest.locust_pool.PooledLocust,
                                           # reco.loadtest.distributed.DistributedLocust

Every generator leaves the same files in the window's directory (latencies.csv + .started, .window_end,
.summary.json, .scores.jsonl; locust.log; Locust's reports when asked) and ends in finish_run, so the
LoadRun's fields and artifacts do not depend on which one ran. judge_window is the one place a window's
validity is decided: a generator process whose CPU over the window is above loadgen.max_cpu_pct of one
core, or, in open loop, whose sends lag their schedule by more than loadgen.max_lag_ms at p99, voids it
(each process judged on its own: one saturated worker voids a distributed window); unanswered and unsent
requests count as failed (+inf); make_run adds "no request succeeded".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from reco.loadtest.config import LoadgenConfig, LoadMode, LoadtestConfig
from reco.loadtest.histogram import Latencies, plot_cdf, read_latencies
from reco.loadtest.outcome import LoadRun
from reco.loadtest.records import worker_file
from reco.loadtest.runs import make_run
from reco.loadtest.scrape import ServerProbe

RECORD_SUFFIXES = ("", ".started", ".window_end", ".summary.json", ".scores.jsonl")


class LoadTestError(RuntimeError):
    pass


@dataclass(frozen=True)
class Window:
    """One window's settings as the runner resolved them (every path absolute: Locust has its own cwd)."""

    url: str
    c: LoadtestConfig
    out: Path  # the window's directory
    requests: Path | None  # the request file, resolved; None: random users
    requests_arg: str | Path | None  # as the caller gave it (the run's params name it so)
    cpus: list[int] | None  # the generator's cores
    kind: str  # LoadRun.kind
    reports: bool  # also Locust's CSV/HTML/JSON reports and the CDF plot
    triton_model: str | None  # KServe v2 requests to this Triton model; None: reco's /recommend
    users: int  # Locust users (open loop: one Poisson scheduler per process)
    run_time: int  # Locust's run time, s: a safety net, the locustfile ends the test itself
    opts: dict[str, object] = field(repr=False)  # the locustfile's options by dest name
    # a request-interleaved window (reco.loadtest.interleave): every server's own window, this one's
    # first; () for a window of one server
    targets: tuple[Window, ...] = field(default=(), repr=False)

    @property
    def latency_file(self) -> Path:
        return self.out / "latencies.csv"

    @property
    def log(self) -> Path:
        return self.out / "locust.log"

    @property
    def records(self) -> list[Path]:
        """Each generator process's latency file (one per worker when loadtest.workers > 1)."""
        return _records(self.latency_file, self.c.workers)

    def files(self, suffix: str) -> list[Path]:
        """Each record's `suffix` file (".started", ".window_end", ".summary.json")."""
        return [Path(f"{r}{suffix}") for r in self.records]

    @property
    def served(self) -> tuple[Window, ...]:
        """The windows of the servers this window sends to (its own alone unless interleaved)."""
        return self.targets or (self,)

    @property
    def cap_s(self) -> float:
        return window_cap_s(self.c)

    @property
    def probe(self) -> ServerProbe:
        return ServerProbe(self.triton_model)


class LoadGenerator(Protocol):
    """Runs one window against the server and returns its LoadRun (finish_run); raises LoadTestError
    when the generator does not start, writes no record, or loses a process mid-window."""

    def run_window(self, w: Window) -> LoadRun: ...


def plan_window(
    url: str,
    c: LoadtestConfig,
    out_dir: str | Path,
    requests_path: str | Path | None,
    cpus: list[int] | None,
    *,
    kind: str,
    reports: bool,
    triton_model: str | None,
) -> Window:
    """The Window of run_load's arguments: its directory made and cleared of an earlier window's
    records, the request file and the settings checked before any process starts."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    lat = out / "latencies.csv"
    records = {lat, *_records(lat, c.workers)}
    for stale in [f"{lat}.failed"] + [f"{r}{s}" for r in records for s in RECORD_SUFFIXES]:
        Path(stale).unlink(missing_ok=True)
    (out / "latency_cdf.png").unlink(missing_ok=True)
    if requests_path is not None and not Path(requests_path).exists():
        raise FileNotFoundError(
            f"{requests_path}: request file not found (write one with python -m reco.cli.requests)"
        )
    req = Path(requests_path).resolve() if requests_path else None
    users, run_time, opts = window_options(c, lat)
    return Window(url, c, out, req, requests_path, cpus, kind, reports, triton_model, users, run_time, opts)


def _records(latency_file: Path, workers: int) -> list[Path]:
    return [latency_file] if workers == 1 else [worker_file(latency_file, i) for i in range(workers)]


def window_cap_s(c: LoadtestConfig) -> float:
    return float(c.max_window_s if c.window_requests else c.duration_s)


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
    run_time = math.ceil(c.warmup_s + window_cap_s(c) + c.drain_s + 30)
    opts: dict[str, object] = {
        "load_mode": c.mode.value,
        "rate": float(c.rate),
        "max_inflight": int(c.max_inflight),
        "think_time_s": float(c.think_time_s),
        "warmup_s": float(c.warmup_s),
        "duration_s": window_cap_s(c),
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


@dataclass(frozen=True)
class Samples:
    """What the runner sampled at the window's open (a) and close (b): the CPU seconds of the generator's
    main process (None: it had exited) and the server's figures (ServerProbe.read)."""

    cpu_a: float | None
    wall_a: float
    before: str
    cpu_b: float | None
    wall_b: float
    after: str
    steal_a: float = 0.0  # the machine's steal seconds (every CPU) at a and b: time the hypervisor ran
    steal_b: float = 0.0  # something else on our vCPUs, which no pairing inside the guest can see
    # every served server's (before, after) in Window.served's order (the first is before/after)
    servers: tuple[tuple[str, str], ...] = ()

    def steal_pct(self) -> float:
        """Steal over the window, % of one core (summed over the machine's CPUs)."""
        return 100.0 * max(self.steal_b - self.steal_a, 0.0) / max(self.wall_b - self.wall_a, 1e-9)

    def cpu_pct(self) -> float:
        """The main process's CPU over the window, % of one core (both samples taken)."""
        assert self.cpu_a is not None and self.cpu_b is not None
        return 100.0 * (self.cpu_b - self.cpu_a) / max(self.wall_b - self.wall_a, 1e-9)


@dataclass(frozen=True)
class Judgement:
    """What the window judge decided."""

    latencies_ms: np.ndarray  # every request of the window: +inf for failed / unsent / unanswered
    reasons: list[str]  # why the generator cannot vouch for the window ([]: it can)
    cpu_pct: float  # the busiest generator process's CPU over the window, % of one core
    lag_p99_ms: float  # the largest open-loop send lag p99 of any process
    n_unsent: int  # open loop: arrivals never sent (max_inflight outstanding); failed


def judge_window(
    lg: LoadgenConfig,
    lat: Latencies,
    summary: Mapping[str, Any],
    cpu_by: Mapping[str, float],
    lag_by: Mapping[str, float],
) -> Judgement:
    """Whether the generator can vouch for a window (see the module docstring): the one judge of all
    generators.

    Args:
        lg: loadtest.loadgen (max_cpu_pct, max_lag_ms).
        lat: the window's recorded requests (latencies.csv).
        summary: the window's summary (latencies.csv.summary.json): its unanswered and unsent counts.
        cpu_by: " on <process>" (or "" for a single process) -> its CPU % of one core over the window.
        lag_by: the same keys -> its open-loop send lag p99 ms (0.0 in closed loop).
    """
    reasons = [
        f"load generator CPU {pct:.0f}%{who} > loadtest.loadgen.max_cpu_pct={lg.max_cpu_pct:g}"
        for who, pct in cpu_by.items()
        if pct > lg.max_cpu_pct
    ]
    reasons += [
        f"open-loop send lag p99 {ms:.1f} ms{who} > loadtest.loadgen.max_lag_ms={lg.max_lag_ms:g}"
        for who, ms in lag_by.items()
        if ms > lg.max_lag_ms
    ]
    return Judgement(
        latencies_ms=lat.window_ms(int(summary.get("unanswered", 0))),
        reasons=reasons,
        cpu_pct=max(cpu_by.values()),
        lag_p99_ms=max(lag_by.values()),
        n_unsent=int((summary.get("open") or {}).get("overflow", 0)),
    )


def finish_single_process(w: Window, s: Samples) -> LoadRun:
    """finish_run of a one-process generator's window: its own record's summary, judged on the CPU the
    runner sampled and the send lag it recorded."""
    summary = json.loads(w.files(".summary.json")[0].read_text())
    lag = float((summary.get("open") or {}).get("lag_p99_ms", 0.0))
    return finish_run(w, summary, s, {"": s.cpu_pct()}, {"": lag})


def finish_run(
    w: Window,
    summary: Mapping[str, Any],
    s: Samples,
    cpu_by: Mapping[str, float],
    lag_by: Mapping[str, float],
    extra_artifacts: Sequence[Path] = (),
) -> LoadRun:
    """The window's LoadRun from its record (judged by judge_window) and the server's figures between
    the samples, with the CDF plot when reports are asked for and every non-empty file of the window as
    an artifact."""
    c = w.c
    judged = judge_window(c.loadgen, read_latencies(w.latency_file), summary, cpu_by, lag_by)
    window_start = summary["t0_epoch"] + c.warmup_s
    window_end = summary.get("window_end_epoch") or (window_start + w.cap_s)
    run = make_run(
        judged.latencies_ms,
        kind=w.kind,
        offered_qps=float(c.rate) if c.mode == LoadMode.open else None,
        window_s=max(window_end - window_start, 1e-9),
        loadgen_cpu_pct=judged.cpu_pct,
        invalid_reasons=judged.reasons,
        server_stages=w.probe.stages(s.before, s.after),
        lag_p99_ms=judged.lag_p99_ms,
        n_unsent=judged.n_unsent,
        params=_params(c, w.cpus, w.requests_arg),
        steal_pct=s.steal_pct(),
    )
    load = f"{c.users} users" if c.mode == LoadMode.closed else f"{c.rate:g} req/s Poisson"
    # the conditions beside the window's latencies.csv, so a slow block can be matched to its machine
    machine = w.out / "machine.json"
    machine.write_text(json.dumps({"steal_pct": run.steal_pct, "loadgen_cpu_pct": run.loadgen_cpu_pct}))
    cdf = w.out / "latency_cdf.png"
    if w.reports:
        plot_cdf({f"{c.mode.value} loop": run.latencies_ms}, cdf, title=f"{w.kind}: {load}")
    files = ("locust_stats.csv", "locust_stats_history.csv", "locust_failures.csv", "locust_exceptions.csv")
    run.artifacts = [
        p
        for p in (
            *(w.out / f for f in files),
            w.out / "locust_report.html",
            w.out / "locust_stats.json",
            w.latency_file,
            Path(f"{w.latency_file}.summary.json"),
            Path(f"{w.latency_file}.scores.jsonl"),
            cdf,
            machine,
            w.log,
            *extra_artifacts,
        )
        if p.exists() and p.stat().st_size > 0
    ]
    return run


def _params(c: LoadtestConfig, cpus: list[int] | None, requests_path: str | Path | None) -> dict[str, object]:
    keys = ("users", "spawn_rate", "rate", "window_requests", "duration_s", "warmup_s", "think_time_s")
    p: dict[str, object] = {f"loadtest.{k}": getattr(c, k) for k in (*keys, "seed", "workers")}
    p["loadtest.mode"] = c.mode.value
    p["loadtest.cpus"] = ",".join(map(str, cpus)) if cpus else "any"
    p["loadtest.requests_file"] = str(requests_path) if requests_path else "random users"
    return p
