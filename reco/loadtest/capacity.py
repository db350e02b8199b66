"""Capacity at an SLO: the highest open-loop (Poisson) rate whose p99 meets the SLO with < 1 % errors.

Search as MLPerf's FindPeakPerformance: from `start_rate`, multiply by `growth` until a step fails (or
`max_rate` passes), or divide until one passes (or `min_rate` fails); then bisect between the highest
passing and the lowest failing rate until they are within `tolerance` or `steps` runs are spent. Each
step is a full open-loop load test (reco.loadtest.runner.run_load) of `step_duration_s` after
`step_warmup_s`. A step whose generator was saturated (valid=0) counts as failed: its figures cannot
vouch for the server.

The SLO is either given (capacity.slo_p99_ms) or `slo_factor` x a reference variant's unloaded p99
(one closed-loop user; see unloaded_p99 / slo_from_reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from reco.loadtest.runner import LoadResult, run_load


@dataclass
class CapacityResult:
    max_qps_at_slo: float  # highest passing target rate (0.0: even min_rate failed)
    achieved_qps: float  # measured throughput of that step
    slo_p99_ms: float
    steps: list[dict] = field(default_factory=list)  # one row per step, in run order

    def table(self) -> str:
        """Markdown table of the steps."""
        head = "| step | rate (req/s) | qps | p50 ms | p99 ms | error rate | loadgen CPU % | valid | pass |"
        rows = [head, "|" + "---|" * 9]  # pass column: yes, or the reason the step failed
        for s in self.steps:
            rows.append(
                f"| {s['step']} | {s['rate']:.1f} | {s['qps']:.1f} | {s['e2e_p50_ms']:.2f} | {s['e2e_p99_ms']:.2f} | "
                f"{s['error_rate']:.4f} | {s['loadgen_cpu_pct']:.0f} | {int(s['valid'])} | {'yes' if s['passed'] else 'no: ' + s['fail_reason']} |"
            )
        return "\n".join(rows)


def slo_from_reference(reference_p99_ms: float, factor: float) -> float:
    """SLO = factor x the reference variant's unloaded p99."""
    if not (reference_p99_ms > 0 and math.isfinite(reference_p99_ms)):
        raise ValueError(f"reference unloaded p99 must be a positive number, got {reference_p99_ms}")
    return float(factor) * float(reference_p99_ms)


def resolve_slo(capacity: dict, reference_p99_ms: float | None) -> float:
    """capacity.slo_p99_ms when set, else capacity.slo_factor x the reference p99."""
    if capacity.get("slo_p99_ms") is not None:
        return float(capacity["slo_p99_ms"])
    if reference_p99_ms is None:
        raise ValueError("loadtest.capacity.slo_p99_ms is null: a reference variant's unloaded p99 is needed")
    return slo_from_reference(reference_p99_ms, capacity["slo_factor"])


def unloaded_p99(
    url: str,
    settings: dict,
    out_dir: str | Path,
    requests_path: str | Path | None,
    cpus: list[int] | None = None,
) -> LoadResult:
    """One closed-loop user for capacity.reference_duration_s: the latency with no queueing."""
    s = {**settings, "mode": "closed", "users": 1, "duration_s": settings["capacity"]["reference_duration_s"]}
    return run_load(url, s, out_dir, requests_path, cpus)


def fail_reason(metrics: dict, slo_p99_ms: float, max_error_rate: float) -> str:
    """'' when the step meets the SLO, else why not: loadgen (invalid), errors or p99."""
    if not metrics["valid"]:
        return "loadgen"
    if metrics["error_rate"] >= max_error_rate:
        return "errors"
    p99 = metrics["e2e_p99_ms"]
    return "" if math.isfinite(p99) and p99 <= slo_p99_ms else "p99"


def find_capacity(
    url: str,
    settings: dict,
    slo_p99_ms: float,
    out_dir: str | Path,
    requests_path: str | Path | None = None,
    cpus: list[int] | None = None,
) -> CapacityResult:
    """Search the highest open-loop rate meeting the SLO (see the module docstring).

    settings: the resolved `loadtest` config; its `capacity` block sets the search. Step outputs go to
    out_dir/step_NN_<rate>qps/.
    """
    c = settings["capacity"]
    lo_rate, hi_rate = float(c["min_rate"]), float(c["max_rate"])
    growth, tol, max_err = float(c["growth"]), float(c["tolerance"]), float(c["max_error_rate"])
    if not (0 < lo_rate <= hi_rate) or growth <= 1:
        raise ValueError(
            f"loadtest.capacity: expected 0 < min_rate <= max_rate and growth > 1, "
            f"got min_rate={lo_rate}, max_rate={hi_rate}, growth={growth}"
        )
    rate = min(max(float(c["start_rate"]), lo_rate), hi_rate)
    best: tuple[float, float] = (0.0, 0.0)  # (rate, achieved qps) of the highest passing step
    fail = math.inf  # lowest failing rate
    steps: list[dict] = []
    for i in range(int(c["steps"])):
        step = {
            **settings,
            "mode": "open",
            "rate": rate,
            "duration_s": c["step_duration_s"],
            "warmup_s": c["step_warmup_s"],
        }
        res = run_load(url, step, Path(out_dir) / f"step_{i:02d}_{rate:.0f}qps", requests_path, cpus)
        reason = fail_reason(res.metrics, slo_p99_ms, max_err)
        ok = not reason
        steps.append({"step": i, "rate": rate, "passed": ok, "fail_reason": reason, **res.metrics})
        if ok:
            if rate > best[0]:
                best = (rate, res.metrics["qps"])
        else:
            fail = min(fail, rate)
        nxt = _next_rate(rate, ok, best[0], fail, growth, lo_rate, hi_rate, tol)
        if nxt is None:
            break
        rate = nxt
    return CapacityResult(best[0], best[1], float(slo_p99_ms), steps)


def _next_rate(
    rate: float, ok: bool, best: float, fail: float, growth: float, lo: float, hi: float, tol: float
) -> float | None:
    """Next rate to try, or None when the search is done."""
    if math.isinf(fail):  # bracketing upwards
        return None if rate >= hi else min(rate * growth, hi)
    if best == 0.0:  # bracketing downwards
        return None if rate <= lo else max(rate / growth, lo)
    if (fail - best) / fail <= tol:
        return None
    return (best + fail) / 2
