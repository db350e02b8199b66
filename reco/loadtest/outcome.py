"""Typed results of load tests: what the study hands to tracking and the report (nobody mutates them).

::

    LoadRun       one Locust run (a window of requests): latency quantiles with CIs, errors, validity
    CapacityStep  one rate of the capacity search and its verdict
    Capacity      one capacity search: the bracket [highest pass, lowest fail] and its steps
    LoadOutcome   everything measured on one variant (repeats of each kind of run)
    StudyOutcome  the study's yardsticks (SLO, common load) and every variant's LoadOutcome
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from reco.stats import Estimate, Verdict

QUANTILES = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99, "p999": 0.999}


@dataclass
class LoadRun:
    """One measured window. Latencies include failed/shed/timed-out requests as +inf."""

    kind: str  # "unloaded" | "common" | "equal_util" | "capacity"
    offered_qps: float | None  # open loop: the target rate; closed loop: None
    n: int  # requests in the window (failures included)
    n_failed: int
    error_rate: float
    qps: float  # successful requests per second of window
    quantiles: dict[str, Estimate]  # QUANTILES keys -> e2e latency ms with CI
    mean_ms: float  # successful requests only
    valid: bool  # False: the generator may have been the bottleneck (CPU, lag) or nothing succeeded
    invalid_reason: str
    loadgen_cpu_pct: float
    server_stages: dict[str, float]  # server_<stage>_mean_ms / _p99_ms (Prometheus buckets, window only)
    latencies_ms: np.ndarray = field(repr=False)  # [n] every request of the window, +inf = failed
    artifacts: list[Path] = field(default_factory=list, repr=False)
    window_s: float = 0.0  # length of the measured window (qps = successes / window_s)
    lag_p99_ms: float = 0.0  # open loop: p99 of actual minus scheduled send time
    n_unsent: int = 0  # open loop: arrivals not sent (max_inflight outstanding); in n_failed
    windows: int = 1  # windows pooled into this run (an extended capacity step has several)
    block: int | None = None  # the study's round (block) it ran in: runs of one block pair up across variants
    params: dict[str, object] = field(default_factory=dict, repr=False)  # the load settings, for MLflow
    steal_pct: float = 0.0  # the hypervisor's steal over the window, % of one core (Samples.steal_pct)


@dataclass
class CapacityStep:
    rate: float  # offered open-loop rate, req/s
    run: LoadRun
    verdict: Verdict  # p99 CI vs the SLO and errors; INVALID when run.valid is False
    reason: str  # why not PASS ("" when PASS)
    budget_cut: bool = False  # left undecided because an extension would have ended past the time budget


@dataclass
class Capacity:
    slo_p99_ms: float
    highest_pass: float  # req/s; 0.0 when no rate passed
    # req/s: the lowest rate above the highest pass that FAILed; None when none did (max_rate passed, or
    # only undecided rates lie above: the capacity may be past them)
    lowest_fail: float | None
    steps: list[CapacityStep]
    lowest_invalid: float | None = None  # req/s; lowest rate the generator could not vouch for (INVALID)
    conf: float = 0.95  # the confidence each step's p99 interval was judged at (Bonferroni over its looks)
    # the study's time budget stopped the search (a step not started, or one not extended) before it was done
    stopped_by_budget: bool = False

    @property
    def decided(self) -> bool:
        """Whether the search located the capacity: a rate passed, or the search ended on its own (nothing
        down to min_rate passed: a capacity of 0 is a result). A search the budget stopped before any rate
        passed decided nothing, and is left out of every median (decided_searches)."""
        return self.highest_pass > 0 or not self.stopped_by_budget

    def budget_note(self) -> str:
        """'' for a search that ended on its own; else what the budget's stop means for its bracket."""
        if not self.stopped_by_budget:
            return ""
        return "stopped by the time budget" + ("" if self.decided else " before any rate passed: no capacity")

    @property
    def undecided(self) -> list[float]:
        """Rates inside the bracket (above the highest pass, below the lowest fail) whose step stayed
        INCONCLUSIVE: the capacity may lie on either side of them."""
        top = math.inf if self.lowest_fail is None else self.lowest_fail
        return sorted(
            s.rate
            for s in self.steps
            if s.verdict == Verdict.INCONCLUSIVE and self.highest_pass < s.rate < top
        )

    @property
    def resolution(self) -> float | None:
        """(lowest fail - highest pass) / lowest fail; None when the bracket is open."""
        if self.lowest_fail is None or self.highest_pass <= 0:
            return None
        return (self.lowest_fail - self.highest_pass) / self.lowest_fail


def decided_searches(caps: list[Capacity]) -> list[Capacity]:
    """The capacity searches that located a capacity (Capacity.decided): the ones medians are taken over."""
    return [c for c in caps if c.decided]


def searched_above(caps: list[Capacity]) -> list[Capacity]:
    """The searches whose upper side counts: each that found a failing rate or ended on its own. A search
    the budget stopped before any rate failed (a repeat that passed where the first search did and had no
    time for the next rate) did not look there, so while another search did its missing fail says
    nothing; when none did, that side is open (all of them are returned)."""
    return [c for c in caps if c.lowest_fail is not None or not c.stopped_by_budget] or caps


# allowed |served - offline| of a runtime that is not batch-invariant = max(tolerance, BATCH_MARGIN x
# batch_spread): reco.loadtest.correctness says why
BATCH_MARGIN = 2.0


@dataclass
class CorrectnessCheck:
    """Scores returned under load vs the same variant's offline scores (MLPerf TEST01's idea)."""

    n_requests: int
    max_abs_diff: float
    tolerance: float  # loadtest.study.correctness.tolerance
    passed: bool
    # A batched serving: the widest |scores in a batch with other requests - scores alone| measured offline
    # (dynamic INT8 scales activations per call); `allowed` widens the tolerance to cover it.
    batch_spread: float = 0.0
    # The runtime scores a row the same whatever else is in its call (reco.runtime.batch_invariant: fp32,
    # static INT8): held to `tolerance` however it was batched; its batch_spread is still measured.
    batch_invariant: bool = True

    @property
    def allowed(self) -> float:
        """The |served - offline| bound applied: `tolerance` for a batch-invariant runtime, else
        max(tolerance, BATCH_MARGIN x batch_spread)."""
        if self.batch_invariant:
            return self.tolerance
        return max(self.tolerance, BATCH_MARGIN * self.batch_spread)


@dataclass
class LoadOutcome:
    variant: str
    unloaded: list[LoadRun] = field(default_factory=list)  # repeats, one closed-loop user
    common: list[LoadRun] = field(default_factory=list)  # repeats at the study's common offered load
    equal_util: list[LoadRun] = field(default_factory=list)  # at a fraction of its own capacity
    capacity: list[Capacity] = field(default_factory=list)  # repeats
    correctness: CorrectnessCheck | None = None
    error: str = ""  # why the load test failed ("" when it did not)


@dataclass
class StudyOutcome:
    slo_p99_ms: float | None
    slo_source: str  # e.g. "fixed in the preset" or "3.0 x median of 5 unloaded p99"
    common_rate_qps: float | None
    keep_warm: bool
    outcomes: dict[str, LoadOutcome] = field(default_factory=dict)
    reference: str = ""  # the variant behind a relative SLO and the common load
    common_source: str = ""  # how the common load was set (e.g. "65% of the reference's median capacity")
    settle_s: float = 0.0  # unrecorded traffic per variant before the first measured window
    # Where the study's time went: kind of run -> variant -> wall seconds (time_spent formats it).
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    budget: str = ""  # the time budget, what it ran and skipped (reco.loadtest.budget.summary)
    server_cores: int = 0  # cores each server was pinned to (0: not pinned, it could use any)


def time_spent(seconds: dict[str, dict[str, float]]) -> str:
    """'capacity 310 s (baseline 250, pruned 40, ...), common 90 s (...), ...': where a study's time went,
    largest first -- what to cut when a study is too slow."""
    parts = []
    for kind, by in sorted(seconds.items(), key=lambda kv: -sum(kv[1].values())):
        top = sorted(by.items(), key=lambda kv: -kv[1])
        each = "" if list(by) == ["all"] else " (" + ", ".join(f"{n} {t:.0f}" for n, t in top) + ")"
        parts.append(f"{kind} {sum(by.values()):.0f} s{each}")
    return ", ".join(parts)
