"""Run one load test: Locust headless in its own process, exact percentiles, server stage times.

    result = run_load(url, settings, out_dir, requests_path, cpus=[0])
    result.metrics  -> e2e_p50_ms ... e2e_p999_ms, qps, error_rate, n_requests, n_failures,
                       loadgen_cpu_pct, valid, server_{stage}_mean_ms / _p99_ms, ...
    result.artifacts -> Locust CSVs, final stats JSON and HTML report, the raw latency CSV, the CDF plot

    server_cpus, loadgen_cpus = plan_cpus()   # e.g. ([1], [0]) on two cores

`settings` is the resolved `loadtest` config (conf/loadtest/default.yaml). The generator is pinned to
`cpus` (give it cores the server is not on). The server's /metrics is scraped when the measured window
opens and when it closes (times aligned to the test start Locust reports), so warm-up requests are in
neither the client's nor the server's figures.

A result is marked valid=0 when the generator itself may have been the bottleneck: its CPU over the
window above loadgen.max_cpu_pct of one core, or, in open loop, sends lagging their schedule by more
than loadgen.max_lag_ms at p99, or no request succeeded.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from reco.loadtest.histogram import Latencies, percentiles, plot_cdf, read_latencies
from reco.serve.keepwarm import start_keep_warm, stop_keep_warm

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtest" / "locustfile.py"


class LoadTestError(RuntimeError):
    pass


@dataclass
class LoadResult:
    metrics: dict[str, float]
    params: dict[str, object]
    artifacts: list[Path]
    latencies_ms: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))  # successful, window


def _need(settings: dict, key: str):
    if key not in settings:
        raise KeyError(
            f"loadtest.{key}: missing from the load test settings (see conf/loadtest/default.yaml)"
        )
    return settings[key]


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


def locust_command(url: str, s: dict, out_dir: Path, requests_path: Path | None) -> list[str]:
    mode = _need(s, "mode")
    if mode not in ("closed", "open"):
        raise ValueError(f"loadtest.mode: expected 'closed' or 'open', got {mode!r}")
    users = int(_need(s, "users")) if mode == "closed" else 1
    run_time = math.ceil(
        float(_need(s, "warmup_s")) + float(_need(s, "duration_s")) + float(_need(s, "drain_s"))
    )
    cmd = [
        sys.executable, "-m", "locust",
        "-f", str(LOCUSTFILE),
        "--headless",
        "--host", url,
        "-u", str(users),
        "-r", str(_need(s, "spawn_rate")),
        "-t", f"{run_time}s",
        "--stop-timeout", str(max(1, math.ceil(float(s["drain_s"])))),
        "--csv", str(out_dir / "locust"),
        "--html", str(out_dir / "locust_report.html"),
        "--json-file", str(out_dir / "locust_stats"),
        "--only-summary",
        "--loglevel", "WARNING",
        "--exit-code-on-error", "0",
        "--load-mode", mode,
        "--rate", str(float(_need(s, "rate"))),
        "--max-inflight", str(int(_need(s, "max_inflight"))),
        "--think-time-s", str(float(_need(s, "think_time_s"))),
        "--warmup-s", str(float(s["warmup_s"])),
        "--duration-s", str(float(s["duration_s"])),
        "--latency-file", str(out_dir / "latencies.csv"),
        "--seed", str(int(_need(s, "seed"))),
    ]  # fmt: skip
    if requests_path is not None:
        cmd += ["--requests-file", str(requests_path)]
    return cmd


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _sleep_until(t_epoch: float, proc: subprocess.Popen) -> None:
    while (left := t_epoch - time.time()) > 0 and proc.poll() is None:
        time.sleep(min(left, 0.05))


def _cpu_s(ps) -> float | None:
    """CPU seconds of the generator so far; None once it has exited."""
    try:
        t = ps.cpu_times()
    except psutil.NoSuchProcess:
        return None
    return t.user + t.system


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_load(
    url: str,
    settings: dict,
    out_dir: str | Path,
    requests_path: str | Path | None = None,
    cpus: list[int] | None = None,
) -> LoadResult:
    """One load test of the server at `url` (see the module docstring). Raises LoadTestError when
    Locust does not start or writes no latency file."""
    s = settings
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lat_path = out / "latencies.csv"
    for stale in (lat_path, Path(f"{lat_path}.started"), Path(f"{lat_path}.summary.json")):
        stale.unlink(missing_ok=True)
    if requests_path is not None and not Path(requests_path).exists():
        raise FileNotFoundError(f"{requests_path}: request file not found (see reco.loadtest.requests)")
    cmd = locust_command(url, s, out, Path(requests_path) if requests_path else None)
    loadgen = _need(s, "loadgen")
    warmup, duration = float(s["warmup_s"]), float(s["duration_s"])
    log_path = out / "locust.log"

    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    spinners = start_keep_warm(cpus or sorted(os.sched_getaffinity(0))) if loadgen["keep_warm"] else []
    children_cpu0, wall0 = _children_cpu_s(), time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=out,
            preexec_fn=pin if cpus else None,
        )  # fmt: skip
    try:
        started = Path(f"{lat_path}.started")
        deadline = time.time() + float(loadgen["startup_timeout_s"])
        while not started.exists():
            if proc.poll() is not None or time.time() > deadline:
                raise LoadTestError(
                    f"Locust did not start the test ({'exit code ' + str(proc.returncode) if proc.poll() is not None else 'timeout'}); "
                    f"{log_path}:\n{_log_tail(log_path)}"
                )
            time.sleep(0.05)
        time.sleep(0.05)  # the file is written in one call; let it land
        t0 = float(started.read_text())
        ps = psutil.Process(proc.pid)
        _sleep_until(t0 + warmup, proc)
        cpu_a, wall_a, before = _cpu_s(ps), time.time(), scrape(url)
        _sleep_until(t0 + warmup + duration, proc)
        cpu_b, wall_b, after = _cpu_s(ps), time.time(), scrape(url)
        proc.wait(timeout=float(s["drain_s"]) + 60)
        if cpu_a is None or cpu_b is None:
            # Locust ended before a window sample (a starved runner overslept the drain): fall back to
            # its CPU over its whole life, taken from the reaped child's rusage.
            cpu_a, wall_a, cpu_b, wall_b = 0.0, wall0, _children_cpu_s() - children_cpu0, time.time()
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    finally:
        stop_keep_warm(spinners)
    if not lat_path.exists():
        raise LoadTestError(
            f"Locust exited (code {proc.returncode}) without writing {lat_path}:\n{_log_tail(log_path)}"
        )

    lat = read_latencies(lat_path)
    summary = json.loads(Path(f"{lat_path}.summary.json").read_text())
    cpu_pct = 100.0 * (cpu_b - cpu_a) / max(wall_b - wall_a, 1e-9)
    metrics = summarize(lat, summary, duration)
    metrics["loadgen_cpu_pct"] = cpu_pct
    lag = (summary.get("open") or {}).get("lag_p99_ms", 0.0)
    metrics["valid"] = float(
        cpu_pct <= float(loadgen["max_cpu_pct"])
        and lag <= float(loadgen["max_lag_ms"])
        and metrics["n_ok"] > 0
    )
    if before and after:
        from reco.serve.metrics import stage_summary

        metrics.update(stage_summary(before, after))

    cdf = plot_cdf({f"{s['mode']} loop": lat.ok_ms}, out / "latency_cdf.png", title=_title(s))
    artifacts = [
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
            cdf,
            log_path,
        )
        if p.exists() and p.stat().st_size > 0
    ]
    params = {
        f"loadtest.{k}": s[k]
        for k in ("mode", "users", "spawn_rate", "rate", "duration_s", "warmup_s", "think_time_s", "seed")
        if k in s
    }
    params["loadtest.cpus"] = ",".join(map(str, cpus)) if cpus else "any"
    params["loadtest.requests_file"] = str(requests_path) if requests_path else "random users"
    return LoadResult(metrics, params, artifacts, lat.ok_ms)


def summarize(lat: Latencies, summary: dict, duration_s: float) -> dict[str, float]:
    """Exact end-to-end metrics of the measured window (see reco.loadtest.histogram)."""
    open_ = summary.get("open") or {}
    incomplete = int(open_.get("incomplete", 0))  # sent in the window, unanswered at the end: failures
    n = len(lat) + incomplete
    n_fail = int((~lat.ok).sum()) + incomplete
    m = {f"e2e_{k}_ms": v for k, v in percentiles(lat.ok_ms).items()}
    m.update(
        {
            "e2e_mean_ms": float(np.mean(lat.ok_ms)) if lat.ok.any() else math.nan,
            "qps": float(lat.ok.sum()) / duration_s,
            "error_rate": n_fail / n if n else 1.0,
            "n_requests": float(n),
            "n_failures": float(n_fail),
            "n_ok": float(lat.ok.sum()),
            "n_503": float((lat.status == 503).sum()),
        }
    )
    if open_:
        m["offered_qps"] = float(open_.get("rate", 0.0))
        m["loadgen_lag_p99_ms"] = float(open_.get("lag_p99_ms", 0.0))
        m["loadgen_overflow"] = float(open_.get("overflow", 0))
    return m


def _title(s: dict) -> str:
    load = f"{s['users']} users" if s["mode"] == "closed" else f"{float(s['rate']):g} req/s Poisson"
    return f"End-to-end latency, {s['mode']} loop, {load}, {float(s['duration_s']):g} s window"
