"""A LoadRun from a window's latencies, several windows pooled into one, and a run's MLflow metrics.

Every figure is over ALL requests of the window, failures as +inf (reco.stats.with_failures), each
quantile with its CI for dependent requests (reco.stats.dependent); a quantile n cannot support is None (reco.loadtest.histogram).
"""

from __future__ import annotations

import math

import numpy as np

from reco.loadtest.histogram import quantiles
from reco.loadtest.outcome import QUANTILES, LoadRun


def make_run(
    latencies_ms: np.ndarray,
    *,
    kind: str,
    offered_qps: float | None,
    window_s: float,
    loadgen_cpu_pct: float = 0.0,
    invalid_reasons: list[str] | tuple[str, ...] = (),
    server_stages: dict[str, float] | None = None,
    lag_p99_ms: float = 0.0,
    n_unsent: int = 0,
    windows: int = 1,
    params: dict[str, object] | None = None,
    steal_pct: float = 0.0,
) -> LoadRun:
    """A LoadRun from every request's latency of a window.

    Args:
        latencies_ms: [n] ms; +inf for a failed / shed / timed-out / unsent / unanswered request.
        window_s: length of the window (qps = successes / window_s).
        invalid_reasons: why the generator cannot vouch for the figures ("no request succeeded" is added
            here when it applies).
    """
    x = np.asarray(latencies_ms, dtype=np.float64)
    ok = np.isfinite(x)
    n, n_ok = len(x), int(ok.sum())
    reasons = list(invalid_reasons) + ([] if n_ok else ["no request succeeded"])
    return LoadRun(
        kind=kind,
        offered_qps=offered_qps,
        n=n,
        n_failed=n - n_ok,
        error_rate=(n - n_ok) / n if n else 1.0,
        qps=n_ok / window_s,
        quantiles=quantiles(x),
        mean_ms=float(x[ok].mean()) if n_ok else math.nan,
        valid=not reasons,
        invalid_reason="; ".join(reasons),
        loadgen_cpu_pct=float(loadgen_cpu_pct),
        server_stages=dict(server_stages or {}),
        latencies_ms=x,
        window_s=float(window_s),
        lag_p99_ms=float(lag_p99_ms),
        n_unsent=int(n_unsent),
        windows=windows,
        params=dict(params or {}),
        steal_pct=float(steal_pct),
    )


def windows_of(runs: list[LoadRun]) -> list[np.ndarray]:
    """Each run's latencies in send order (+inf = failed): the time-ordered windows reco.stats.dependent
    reads."""
    return [np.asarray(r.latencies_ms, np.float64).ravel() for r in runs]


def pool_runs(runs: list[LoadRun]) -> LoadRun:
    """Successive windows of one setting as one run: their requests together (a capacity step extended
    with more windows). Valid only when every window is; CPU and lag are the worst window's."""
    if len(runs) == 1:
        return runs[0]
    n = sum(r.n for r in runs)
    stages = {k: sum(r.server_stages.get(k, 0.0) * r.n for r in runs) / n for k in runs[-1].server_stages}
    pooled = make_run(
        np.concatenate([r.latencies_ms for r in runs]),
        kind=runs[0].kind,
        offered_qps=runs[0].offered_qps,
        window_s=sum(r.window_s for r in runs),
        loadgen_cpu_pct=max(r.loadgen_cpu_pct for r in runs),
        invalid_reasons=[
            r.invalid_reason for r in runs if r.invalid_reason and r.invalid_reason != "no request succeeded"
        ],
        server_stages=stages,  # n-weighted means of the windows' figures (p99s: an approximation)
        lag_p99_ms=max(r.lag_p99_ms for r in runs),
        n_unsent=sum(r.n_unsent for r in runs),
        windows=sum(r.windows for r in runs),
        params=runs[0].params,
        steal_pct=sum(r.steal_pct * r.window_s for r in runs) / max(sum(r.window_s for r in runs), 1e-9),
    )
    pooled.artifacts = [p for r in runs for p in r.artifacts]
    return pooled


def run_metrics(run: LoadRun, prefix: str = "") -> dict[str, float]:
    """The flat MLflow metrics of a run: e2e_<q>_ms (README names) with e2e_<q>_ms_lo / _hi (95 % CI),
    qps, error_rate, n_requests, n_failures, loadgen_cpu_pct, valid, machine_steal_pct, server_<stage>_*; open loop adds
    offered_qps, loadgen_lag_p99_ms, n_unsent.

    A quantile n cannot support is left out (MLflow rejects None; its absence is the "n/a"); an +inf
    quantile (more failures than 1 - q) is logged as inf, which MLflow's SQL store keeps as the largest float.
    """
    m: dict[str, float] = {}
    for name in QUANTILES:
        e = run.quantiles[name]
        if e.value is not None:
            m.update({f"e2e_{name}_ms": e.value, f"e2e_{name}_ms_lo": e.lo, f"e2e_{name}_ms_hi": e.hi})
    if math.isfinite(run.mean_ms):
        m["e2e_mean_ms"] = run.mean_ms
    m.update(
        qps=run.qps,
        error_rate=run.error_rate,
        n_requests=float(run.n),
        n_failures=float(run.n_failed),
        loadgen_cpu_pct=run.loadgen_cpu_pct,
        valid=float(run.valid),
        machine_steal_pct=run.steal_pct,
    )
    if run.offered_qps is not None:
        m.update(offered_qps=run.offered_qps, loadgen_lag_p99_ms=run.lag_p99_ms, n_unsent=float(run.n_unsent))
    m.update(run.server_stages)
    return {f"{prefix}{k}": float(v) for k, v in m.items()}
