"""Capacity at an SLO: the highest open-loop (Poisson) rate whose p99 CI lies within the SLO.

**A step** (one rate) is judged on a request COUNT, not a duration, so a 30 ms and a 1 ms variant are
judged with the same statistical power: its first window has `capacity.step_requests` requests (>= 368,
the least n whose p99 CI upper bound is an observed latency). Failed requests count as +inf. Then

    PASS          the p99 CI's upper bound <= SLO and error rate <= max_error_rate; or, where that bound
                  is open, the exceedance bound puts the share of requests at or past the SLO at <= 0.1 %
                  (a tenth of what the SLO allows), or at <= 0.001 % on a smaller effective n
                  (exceedance_passes; from EXCEEDANCE_MIN_N requests on, see below)
    FAIL          the p99 CI's lower bound > SLO at CONFIRM_LOOKS looks in a row (the next one pools the
                  first's requests with as many again) or at the step's last look, or error rate >
                  max_error_rate (at once)
    INVALID       the load generator could not vouch for the window (saturated CPU, send lag): excluded
    otherwise     the step is EXTENDED: another window at the same rate, as many requests again, pooled
                  with the first (the server keeps running; each window has its own short warm-up) --
                  until a verdict or `max_step_requests` (or, with `max_step_s`, rate x max_step_s
                  requests, whichever is fewer), then INCONCLUSIVE; or stopped INCONCLUSIVE sooner when
                  FUTILE_LOOKS looks in a row find neither way to PASS in reach by that cap (futility)

(the spirit of MLPerf LoadGen's early stopping: more samples only where the answer is close). The p99
interval is reco.stats.dependent's (requests under load are not independent). A step looks at its
pooled requests up to `CapacityConfig.looks` times (the first window, then each doubling up to max_step_requests) and
stops at the first look with a verdict, so each look's interval is at confidence 1 - 5 % / looks
(Bonferroni): a step at exactly the true capacity PASSes at most ~2.5 % of the time however many looks
it took (bench/coverage.py measures it). That is why step_requests must be >= the n whose p99 upper
bound exists at that confidence (477 for 3 looks, 436 for 2, 368 for 1).

**Far below the SLO.** Slow requests come in bursts, and a dependent p99's upper bound is a request it
saw only from ~660 x tau requests on (tau: the bursts' length; 20-100 at a fast variant's rates), so a
step whose every request is a tenth of the SLO stayed INCONCLUSIVE at 8,000 and the search bracketed the
capacity there. The second way to PASS asks the question the SLO asks, P(latency >= SLO), of the bound
E[min(latency / SLO, 1)^4] (reco.stats.dependent.exceedance_bound), one-sided at the p99 interval's own
level, and with a tenth of the 1 % as its limit; simulated, a step at the true capacity PASSes no more
often than before (experiments/interval_coverage/README.md#steps-far-below-the-slo).

**Screening.** Where step_requests would take long at the step's rate (a slow variant at a low rate:
400 requests at 8 req/s are 50 s), the step first runs a short window of rate x `screen_s` requests. The
LOWER bound of a p99's CI exists at any n (the upper one needs 368), so a rate far past capacity is shown
to FAIL from that window and a second one like it (pooled, confirming it); otherwise the step goes on to
step_requests in all, as above. A PASS always rests on >= 368 requests.

**The search** (as MLPerf's FindPeakPerformance): from `start_rate`, multiply by `growth` until a step
does not pass (or `max_rate` passes), or divide until one passes (or `min_rate` does not; after an
undecided step, by `undecided_step_down` where set); then bisect
until (lowest FAIL - highest PASS) / lowest FAIL <= `tolerance`, or no gap between the rates tried in that
bracket is wider than `tolerance`, or `steps` rates were tried, or the time budget cut a step short (the
next step's start is priced by its first window only, so it would be cut too:
experiments/ecommerce_case_study/README.md#capacity-time).
An INCONCLUSIVE step is neither end of the bracket: it was not shown to pass, so the search cannot claim
it, nor shown to fail, so the capacity may lie above it (a step at a tenth of the SLO whose bursts keep
its bound open is not a rate past capacity). The search bisects around it, and where only undecided
rates lie above the highest PASS it steps up by `growth` until one FAILs (a rate past capacity fails
fast, often on its screening window). INVALID caps the search (the generator, not the server, is the
limit there) and is no FAIL either. A search started where its first step should PASS (the study's
latency gate) may cap that step at the look a PASS needs (`first_step_requests`): undecided there, it
sits near the capacity and the search steps down. Result: Capacity(highest_pass, lowest_fail,
lowest_invalid, steps), the undecided rates among the steps.

`find_capacity` takes the measurement as a callable (rate, n_requests, out_dir) -> LoadRun, so the
search can be driven by a real server (`open_loop_measure`) or by a deterministic fake in tests.

The SLO is fixed before measuring (capacity.slo_p99_ms), or slo_factor x the MEDIAN unloaded p99 of
>= reference_repeats runs of a reference variant (resolve_slo).
"""

from __future__ import annotations

import csv
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from reco.loadtest.config import CapacityConfig, LoadMode, LoadtestConfig
from reco.loadtest.locust_pool import LocustPool
from reco.loadtest.outcome import Capacity, CapacityStep, LoadRun
from reco.loadtest.runner import run_load, with_settings
from reco.loadtest.runs import pool_runs
from reco.stats import CONF, Estimate, Verdict, min_n_for_quantile, verdict_at_most
from reco.stats.dependent import (
    EXCEEDANCE_POWER,
    dependent_bounds,
    dependent_quantile_ci,
    exceedance_bound,
    requests_to_close,
)

P99_MIN_N = min_n_for_quantile(0.99)  # 368 (one look at 95 %)
SCREEN_MIN_N = 50  # a screening window never shorter: a handful of requests is all warm-up transient
# The exceedance bound PASSes a step only from this many requests and this effective n on, and only at a
# tenth of the share the SLO allows: a shorter stretch can look quiet while the queue it is in grows (an
# open-loop rate past capacity, a slow spell of the VM), its variance is then estimated from less than the
# series' memory, and a slow spell the step did not sample is missing from the bound; the margin asks for
# what no such spell short of the SLO could hide. Simulated (stalls, heavy tails, drift within the step,
# 50-85 % utilisation), a step at the true capacity PASSes no more often than on its p99 interval alone,
# and far below the SLO it PASSes where the interval cannot
# (experiments/interval_coverage/README.md#steps-far-below-the-slo).
EXCEEDANCE_MIN_N = 2000
EXCEEDANCE_MIN_EFFECTIVE_N = 50
EXCEEDANCE_MAX_SHARE = 0.001
# ...and a bound a hundred times further below (0.001 %) from a smaller effective n: it would hold were its
# standard error underestimated a hundredfold. A fast variant's slow spells, hundreds of requests long, keep
# its effective n at 20-50 over 8,000 requests far below the SLO, where the bound reads a few in a million
# and the step would otherwise stay INCONCLUSIVE (experiments/ecommerce_case_study/README.md#capacity-steps).
# Simulated, a step at the true capacity PASSes exactly as often as without this (a quiet stretch of a
# queue AT capacity leaves a bound near the limit, not at a hundredth of it), and far below the SLO far
# more often (experiments/interval_coverage/README.md#steps-far-below-the-slo).
EXCEEDANCE_FAR_SHARE = 0.00001
EXCEEDANCE_FAR_MIN_EFFECTIVE_N = 20


def exceedance_passes(bound: float, n_eff: float) -> bool:
    """Whether an exceedance bound (reco.stats.dependent.exceedance_bound) with this effective n PASSes a
    step: the further below the limit, the fewer effective values it must rest on (see the constants)."""
    return (bound <= EXCEEDANCE_MAX_SHARE and n_eff >= EXCEEDANCE_MIN_EFFECTIVE_N) or (
        bound <= EXCEEDANCE_FAR_SHARE and n_eff >= EXCEEDANCE_FAR_MIN_EFFECTIVE_N
    )


# Looks in a row that must find a step hopeless before it stops (futility). Simulated
# (bench.coverage --step-power), two cost P(PASS) up to 0.28 against no stop (M/D/1 at 3x the SLO, 50 %
# utilisation: 0.94 -> 0.66), three at most 0.04 in every cell, and three still stopped the case study's
# hopeless baseline step at 2,400 of its 6,400 requests
# (experiments/interval_coverage/README.md#steps-far-below-the-slo).
FUTILE_LOOKS = 3
# Looks in a row whose p99 lower bound must lie past the SLO before a step FAILs on it (an error rate
# past max_error_rate FAILs at once). One short look's lower bound misses how long a busy period can last
# (its dependence is estimated from that look alone): simulated whole searches FAILed a rate at or below
# the true capacity in 2-13 % of searches, nearly all on their first 600 requests; confirmed by the next
# look (the same requests and as many again), 0-6 % (experiments/interval_coverage/README.md#capacity-brackets).
CONFIRM_LOOKS = 2
Measure = Callable[[float, int, Path], LoadRun]  # (rate req/s, requests in the window, out dir) -> run
Say = Callable[[str], None]  # progress: one line per window (a slow variant's step takes minutes)


def _quiet(msg: str) -> None:
    pass


def resolve_slo(capacity: CapacityConfig, reference_p99s_ms: Sequence[float | None]) -> tuple[float, str]:
    """(SLO ms, where it came from): capacity.slo_p99_ms when set, else slo_factor x the median of the
    reference's unloaded p99s (at least capacity.reference_repeats of them, each supported by its n).

    Raises ValueError naming the config keys when neither can give an SLO.
    """
    if capacity.slo_p99_ms is not None:
        if not capacity.slo_p99_ms > 0:
            raise ValueError(f"loadtest.capacity.slo_p99_ms: expected > 0 ms, got {capacity.slo_p99_ms}")
        return float(capacity.slo_p99_ms), "fixed in the config (loadtest.capacity.slo_p99_ms)"
    good = [p for p in reference_p99s_ms if p is not None and math.isfinite(p) and p > 0]
    need = max(int(capacity.reference_repeats), 1)
    if len(good) < need:
        raise ValueError(
            f"loadtest.capacity.slo_p99_ms is null and the reference has {len(good)} usable unloaded p99s "
            f"of the {need} needed (loadtest.capacity.reference_repeats; a run's p99 is unusable when it "
            f"failed or its n < 368): set loadtest.capacity.slo_p99_ms"
        )
    med = statistics.median(good)
    return float(capacity.slo_factor) * med, (
        f"{capacity.slo_factor:g} x median unloaded p99 of the reference over {len(good)} runs ({med:.2f} ms)"
    )


def step_cap(rate: float, c: CapacityConfig) -> int:
    """Requests a step at `rate` may pool before it is INCONCLUSIVE: max_step_requests, and with max_step_s
    no more than rate x max_step_s (never fewer than step_requests). Bonferroni's looks
    (CapacityConfig.looks) count the doublings up to max_step_requests, which a time-capped step never
    exceeds: its looks stay covered."""
    cap = int(c.max_step_requests)
    if c.max_step_s is not None:
        cap = min(cap, max(int(c.step_requests), round(rate * float(c.max_step_s))))
    return cap


def step_verdict(
    run: LoadRun, slo_p99_ms: float, max_error_rate: float, conf: float = CONF, power: int = EXCEEDANCE_POWER
) -> tuple[Verdict, str, Estimate]:
    """(verdict, reason, p99) of one step's (pooled) run against the SLO: the p99 with its interval at
    `conf`, the one the verdict rests on (the run's own quantiles are at 95 %); reason is '' for a PASS
    of the p99's interval. Where that interval is open, the step still PASSes when the exceedance bound
    (reco.stats.dependent.exceedance_bound, exponent `power`; 0: not used) puts the share of requests at
    or past the SLO low enough for its effective n (exceedance_passes) at the same confidence; its reason
    says so."""
    p99 = dependent_quantile_ci([run.latencies_ms], 0.99, conf)
    if not run.valid:
        return Verdict.INVALID, f"invalid: {run.invalid_reason}", p99
    if run.error_rate > max_error_rate:
        return Verdict.FAIL, f"error rate {run.error_rate:.4f} > max_error_rate {max_error_rate:g}", p99
    v = verdict_at_most(p99, slo_p99_ms)
    ci = f"p99 {p99.fmt('.2f')} ({conf:.1%} CI)"
    if v == Verdict.PASS:
        return v, "", p99
    if v == Verdict.INCONCLUSIVE and power and run.n >= EXCEEDANCE_MIN_N:
        _, over, n_eff = exceedance_bound([run.latencies_ms], slo_p99_ms, conf, power)
        if exceedance_passes(over, n_eff):
            why = f"{ci} open, but the exceedance bound gives P(latency >= SLO) <= {over:.2g} (n_eff {n_eff:.0f})"
            return Verdict.PASS, why, p99
    if v == Verdict.FAIL:
        return v, f"{ci} > SLO {slo_p99_ms:.2f} ms", p99
    if p99.value is None:
        return v, f"p99 not supported by n={p99.n} at {conf:.1%}", p99
    return v, f"{ci} straddles SLO {slo_p99_ms:.2f} ms", p99


def run_step(
    measure: Measure,
    rate: float,
    slo_p99_ms: float,
    c: CapacityConfig,
    out_dir: Path,
    say: Say = _quiet,
    deadline: float = math.inf,
    clock: Callable[[], float] = time.time,
    confirm_looks: int = CONFIRM_LOOKS,
    max_requests: int | None = None,
) -> CapacityStep:
    """Measure one rate until its verdict is decided or its request cap is reached (step_cap, or
    `max_requests` when that is fewer; module doc); `say` gets one progress line per window. An extension
    that could not finish by `deadline` (epoch seconds of `clock`) is not started: the step stays
    INCONCLUSIVE. A FAIL on the p99's lower bound needs `confirm_looks` looks in a row (1: the rule before
    CONFIRM_LOOKS, for bench.coverage)."""
    runs: list[LoadRun] = []
    screen = screen_requests(rate, c)
    if screen:
        for _ in range(max(confirm_looks, 1)):
            runs.append(measure(rate, screen, out_dir / f"w{len(runs):02d}"))
            pooled = pool_runs(runs)
            lo = dependent_bounds([pooled.latencies_ms], 0.99)[1]
            if not (pooled.valid and lo > slo_p99_ms):
                break
        else:
            reason = f"screening windows: p99 >= {lo:.2f} ms (95% CI lower bound, n={pooled.n}) > SLO"
            say(f"{rate:.1f} req/s: FAIL ({reason} {slo_p99_ms:.2f} ms)")
            return CapacityStep(rate, pooled, Verdict.FAIL, f"{reason} {slo_p99_ms:.2f} ms")
        say(f"{rate:.1f} req/s: screening n={pooled.n:,} not a clear FAIL, measuring on")
    if (first := int(c.step_requests) - sum(r.n for r in runs)) > 0:
        runs.append(measure(rate, first, out_dir / f"w{len(runs):02d}"))
    own, conf = step_cap(rate, c), c.step_conf
    cap = min(own, max_requests or own)
    streak = 0  # looks in a row that found the step hopeless
    fails = 0  # looks in a row that read FAIL
    while True:
        pooled = pool_runs(runs)
        verdict, reason, p99 = step_verdict(pooled, slo_p99_ms, c.max_error_rate, conf)
        fails = fails + 1 if verdict == Verdict.FAIL else 0
        # an error rate past the limit FAILs at once; the p99's lower bound waits for the next look
        if 0 < fails < confirm_looks and pooled.n < cap and pooled.error_rate <= c.max_error_rate:
            verdict = Verdict.INCONCLUSIVE
        done = verdict != Verdict.INCONCLUSIVE or pooled.n >= cap
        if not done and not fails:
            # FUTILE_LOOKS in a row: one look's dependence estimate can be far off (see futility)
            hopeless = futility(runs, pooled, slo_p99_ms, cap, conf)
            streak = streak + 1 if hopeless else 0
            if streak >= FUTILE_LOOKS:
                say(
                    f"{rate:.1f} req/s: p99 {p99.fmt('.2f')} ms at {conf:.1%} -> INCONCLUSIVE, stopped: {hopeless}"
                )
                return CapacityStep(rate, pooled, verdict, f"{reason}; stopped: {hopeless}")
        more = min(pooled.n, cap - pooled.n)
        cut = not done and clock() + window_s(rate, more, c.step_warmup_s) > deadline
        judged = f"p99 {p99.fmt('.2f')} ms at {conf:.1%}"  # the interval the verdict rests on
        then = (
            f": not extended, {more} more requests would end past the time budget" if cut else ", extending"
        )
        how = " (exceedance bound)" if verdict == Verdict.PASS and reason else ""  # the interval is open
        how = " (past the SLO, to confirm)" if fails and verdict == Verdict.INCONCLUSIVE else how
        say(f"{rate:.1f} req/s: {judged} -> {verdict.value}{how}{'' if done else then}")
        if cut:
            return CapacityStep(
                rate, pooled, verdict, f"{reason}; not extended (time budget)", budget_cut=True
            )
        if done and verdict == Verdict.INCONCLUSIVE:
            reason += _why_undecided(runs, p99, conf, cap if cap < own else None)
        if done:
            return CapacityStep(rate, pooled, verdict, reason)
        runs.append(measure(rate, more, out_dir / f"w{len(runs):02d}"))


def _why_undecided(runs: list[LoadRun], p99: Estimate, conf: float, capped_at: int | None) -> str:
    """What an INCONCLUSIVE step's reason adds: the requests its open p99 bound would need, and the cap
    (run_step's max_requests) it stopped at where that was below its own."""
    why = ""
    if p99.value is not None and math.isinf(p99.hi):
        need = requests_to_close([r.latencies_ms for r in runs], 0.99, conf)
        why += f"; its upper bound needs ~{need:,} requests at this dependence (n={p99.n:,})"
    if capped_at is not None:
        why += f"; capped at {capped_at:,} requests (a first step that is to PASS: a lower rate next)"
    return why


def futility(runs: list[LoadRun], pooled: LoadRun, slo_p99_ms: float, cap: int, conf: float) -> str:
    """Why an INCONCLUSIVE step cannot PASS by its cap at what its requests show so far; '' when it may.

    Neither way to PASS is in reach: the p99's upper bound needs more requests than the cap at this
    dependence (reco.stats.dependent.requests_to_close), and the exceedance bound, its margin shrinking as
    1 / sqrt(n) from here, would still not pass at the cap (exceedance_passes: too high for the effective
    n it would rest on). A slow spell of the host at 65 % utilisation (a 1.3-1.9x stretch takes the queue
    past capacity) leaves such a step INCONCLUSIVE at its cap minutes later; stopping it early gives the
    next rate the time (experiments/ecommerce_case_study/README.md#capacity-steps). Stopping never PASSes
    a step, so it cannot add a false PASS, but it costs power where an early look's dependence estimate is
    far off, so run_step stops only when FUTILE_LOOKS looks in a row find the step hopeless."""
    n = pooled.n
    need = requests_to_close([r.latencies_ms for r in runs], 0.99, conf)
    if need <= cap:
        return ""
    est, up, n_eff = exceedance_bound([pooled.latencies_ms], slo_p99_ms, conf, EXCEEDANCE_POWER)
    at_cap = est + (up - est) * math.sqrt(n / cap)
    if exceedance_passes(at_cap, n_eff * cap / n):
        return ""
    return (
        f"futile at n={n:,}: the p99's upper bound needs ~{need:,} requests at this dependence and the "
        f"exceedance bound would read {at_cap:.2g} at the cap of {cap:,} "
        f"(PASS needs <= {EXCEEDANCE_MAX_SHARE:g}, or <= {EXCEEDANCE_FAR_SHARE:g} on a smaller effective n)"
    )


# A window's start and stop beside its warm-up and requests: with the study's Locust processes kept across
# windows (reco.loadtest.locust_pool) the gap between one window's end and the next one's start is
# 0.15-0.31 s (median by kind of run, case study on a 2-vCPU VM); the budget prices every window with it.
WINDOW_OVERHEAD_S = 0.4


def window_s(rate: float, requests: int, warmup_s: float) -> float:
    """Expected wall seconds of one window of `requests` at `rate` req/s, with its warm-up (the budget's
    estimates: a capacity step's, a study window's)."""
    return requests / rate + float(warmup_s) + WINDOW_OVERHEAD_S


def pass_look(rate: float, c: CapacityConfig) -> tuple[int, int]:
    """(requests, windows) of the first look at which a step at `rate` far below the SLO can PASS: there
    its p99 interval stays open and the exceedance bound decides it, from EXCEEDANCE_MIN_N requests on
    (or at the step's cap), counting the screening window where the step has one."""
    n, windows, cap = int(c.step_requests), 1 + (screen_requests(rate, c) > 0), step_cap(rate, c)
    while n < min(EXCEEDANCE_MIN_N, cap):
        n, windows = min(2 * n, cap), windows + 1
    return n, windows


def pass_s(rate: float, c: CapacityConfig) -> float:
    """Expected wall seconds of a step at `rate` that PASSes far below the SLO (pass_look), every window
    with its warm-up (the budget's estimate of a step that settles a latency gate)."""
    n, windows = pass_look(rate, c)
    return n / rate + windows * (float(c.step_warmup_s) + WINDOW_OVERHEAD_S)


def screen_requests(rate: float, c: CapacityConfig) -> int:
    """Requests of a step's screening window: rate x screen_s (>= SCREEN_MIN_N) when that is fewer than
    step_requests, else 0 (no screening: the full window is short anyway)."""
    n = max(SCREEN_MIN_N, round(rate * float(c.screen_s)))
    return n if c.screen_s > 0 and n < c.step_requests else 0


def find_capacity(
    measure: Measure,
    slo_p99_ms: float,
    capacity: CapacityConfig,
    out_dir: str | Path,
    expect_fail: float | None = None,
    say: Say = _quiet,
    deadline: float | Callable[[float], float] = math.inf,
    clock: Callable[[], float] = time.time,
    confirm_looks: int = CONFIRM_LOOKS,
    first_step_requests: int | None = None,
) -> Capacity:
    """Search the highest rate meeting the SLO (see the module docstring).

    Args:
        measure: (rate, n_requests, out_dir) -> LoadRun of one window; see open_loop_measure.
        slo_p99_ms: the SLO.
        capacity: the search settings (loadtest.capacity).
        out_dir: step k's windows go to out_dir/step_KK_<rate>qps/wNN/.
        expect_fail: a rate expected not to pass (an earlier repeat's lowest fail): tried right after a
            passing first step instead of start_rate x growth, so a repeat whose bracket has not moved
            is confirmed at both ends in two steps (undecided rates inside are tried again only where a
            gap is wider than the tolerance). Each step is still measured and judged on its own.
        say: progress, one line per window.
        deadline: epoch seconds (the study's time budget): no step or extension starts that would end
            after it (expected duration: requests / rate + warm-up), and a step it cut short ends the
            search; the bracket stays open on the side the search did not reach. Or a function of the
            lowest rate the search will have measured once the next step runs, giving them: what comes
            after a search may depend on how low it went (the study's common load is a fraction of the
            reference's capacity).
        clock: epoch seconds now (a test hands in a clock its windows move, instead of sleeping).
        confirm_looks: looks in a row a FAIL on the p99's lower bound needs (run_step).
        first_step_requests: the first step's cap when fewer than its own (step_cap): a search started
            where it should PASS (the study's latency gate, reco.loadtest.study._more_searches) stops that
            step undecided at the look a PASS needs (pass_look) and steps down by `growth`, instead of
            extending a step that sits near the capacity.
    Returns:
        Capacity with every step in run order.
    """
    c = capacity
    c.check("loadtest.capacity")  # also at compose time; here for a config built by hand (bench, tests)
    lo, hi, growth, tol = float(c.min_rate), float(c.max_rate), float(c.growth), float(c.tolerance)
    rate = min(max(float(c.start_rate if c.start_rate is not None else lo), lo), hi)
    steps: list[CapacityStep] = []
    stopped = False
    for i in range(int(c.steps)):
        need = window_s(rate, int(c.step_requests), c.step_warmup_s)
        end = deadline(min([rate] + [s.rate for s in steps])) if callable(deadline) else deadline
        if clock() + need > end:
            say(
                f"stopped before step {i}: its {c.step_requests} requests at {rate:.3g} req/s (~{need:.0f} s) "
                "would end past the time budget (loadtest.study.budget_min)"
            )
            stopped = True
            break
        step_dir = Path(out_dir) / f"step_{i:02d}_{rate:.0f}qps"
        first = first_step_requests if i == 0 else None
        step = run_step(measure, rate, slo_p99_ms, c, step_dir, say, end, clock, confirm_looks, first)
        steps.append(step)
        if step.budget_cut:  # a further step, priced by its first window, would be cut the same way
            say(f"stopped after step {i}: the time budget cut it short, and a further step would be cut too")
            stopped = True
            break
        if i == 0 and step.verdict == Verdict.PASS and expect_fail and rate < expect_fail <= hi:
            rate = expect_fail
            continue
        rate = _next_rate(steps, growth, lo, hi, tol, c.undecided_step_down)
        if rate is None:
            break
    best = _highest_pass(steps)
    return Capacity(
        slo_p99_ms=float(slo_p99_ms),
        highest_pass=best,
        lowest_fail=_lowest(steps, best, (Verdict.FAIL,)),
        steps=steps,
        lowest_invalid=_lowest(steps, 0.0, (Verdict.INVALID,)),
        conf=c.step_conf,
        stopped_by_budget=stopped,
    )


def _highest_pass(steps: list[CapacityStep]) -> float:
    return max((s.rate for s in steps if s.verdict == Verdict.PASS), default=0.0)


def _lowest(steps: list[CapacityStep], above: float, verdicts: tuple[Verdict, ...]) -> float | None:
    """The lowest rate above `above` whose step has one of `verdicts`; None when none has."""
    return min((s.rate for s in steps if s.verdict in verdicts and s.rate > above), default=None)


def _next_rate(
    steps: list[CapacityStep], growth: float, lo: float, hi: float, tol: float, down: float | None = None
) -> float | None:
    """Next rate to try after `steps` (in run order), or None when the search is done (module doc); `down`:
    the factor down after an undecided step while nothing has passed (None: growth)."""
    rate, best = steps[-1].rate, _highest_pass(steps)
    above = [s.rate for s in steps if s.verdict != Verdict.PASS and s.rate > best]
    if not above:  # bracketing upwards
        return None if rate >= hi else min(rate * growth, hi)
    if best == 0.0:  # bracketing downwards
        f = down if down and steps[-1].verdict == Verdict.INCONCLUSIVE else growth
        return None if rate <= lo else max(rate / f, lo)
    ceiling = _lowest(steps, best, (Verdict.FAIL, Verdict.INVALID))
    if ceiling is None:  # only undecided rates above the highest pass: look higher for one that fails
        top = max(above)
        return None if top >= hi else min(top * growth, hi)
    if (ceiling - best) / ceiling <= tol:
        return None
    tried = sorted({best, ceiling, *(r for r in above if r < ceiling)})
    a, b = max(itertools.pairwise(tried), key=lambda gap: (gap[1] - gap[0]) / gap[1])
    return None if (b - a) / b <= tol else (a + b) / 2


def open_loop_measure(
    url: str,
    c: LoadtestConfig,
    requests_path: str | Path | None = None,
    cpus: list[int] | None = None,
    kind: str = "capacity",
    triton_model: str | None = None,
    pool: LocustPool | None = None,
) -> Measure:
    """A Measure running one open-loop Locust window of exactly n requests at the rate (run_load),
    after capacity.step_warmup_s of unrecorded traffic, capped at max_window_s (KServe v2 requests to
    `triton_model` when the server is Triton; in a process of `pool` when given)."""

    def measure(rate: float, n: int, out_dir: Path) -> LoadRun:
        s = with_settings(
            c, mode=LoadMode.open, rate=rate, window_requests=n, warmup_s=c.capacity.step_warmup_s
        )
        return run_load(
            url,
            s,
            out_dir,
            requests_path,
            cpus,
            kind=kind,
            reports=False,
            triton_model=triton_model,
            pool=pool,
        )

    return measure


def bracket_text(cap: Capacity) -> str:
    """'[75, 300) req/s (150 undecided)': highest pass, lowest fail ('open': none), the undecided rates."""
    fail = "open" if cap.lowest_fail is None else f"{cap.lowest_fail:.4g}"
    inside = f" ({', '.join(f'{r:.4g}' for r in cap.undecided)} undecided)" if cap.undecided else ""
    return f"[{cap.highest_pass:.4g}, {fail}) req/s{inside}"


def capacity_table(cap: Capacity) -> str:
    """Markdown table of the steps: rate, n, p99 with CI, errors, generator CPU, valid, verdict."""
    rows = [
        f"SLO p99 {cap.slo_p99_ms:.2f} ms; capacity bracket {bracket_text(cap)}"
        + (f"; generator limit from {cap.lowest_invalid:g} req/s" if cap.lowest_invalid else "")
        + (f"; {cap.budget_note()}" if cap.stopped_by_budget else ""),
        "",
        "| step | rate (req/s) | windows | n | qps | p99 ms [95% CI] | error rate | loadgen CPU % | valid | verdict |",
        "|" + "---|" * 10,
    ]
    for i, s in enumerate(cap.steps):
        r = s.run
        rows.append(
            f"| {i} | {s.rate:.1f} | {r.windows} | {r.n} | {r.qps:.1f} | {r.quantiles['p99'].fmt('.2f')} | "
            f"{r.error_rate:.4f} | {r.loadgen_cpu_pct:.0f} | {int(r.valid)} | {s.verdict.value}"
            + (f": {s.reason}" if s.reason else "")
            + " |"
        )
    return "\n".join(rows)


def write_capacity(cap: Capacity, out_dir: Path) -> list[Path]:
    """capacity.md (capacity_table) and capacity.csv (one row per step: rate, windows, n, qps, p99 with
    its CI, error rate, generator CPU, valid, verdict, reason) under out_dir; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, path = out_dir / "capacity.md", out_dir / "capacity.csv"
    md.write_text(capacity_table(cap) + "\n")
    cols = [
        "rate",
        "windows",
        "n",
        "qps",
        "p99_ms",
        "p99_ms_lo",
        "p99_ms_hi",
        "error_rate",
        "loadgen_cpu_pct",
    ]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*cols, "valid", "verdict", "reason"])
        for s in cap.steps:
            r, p99 = s.run, s.run.quantiles["p99"]
            nums = [s.rate, r.windows, r.n, r.qps, p99.value, p99.lo, p99.hi, r.error_rate, r.loadgen_cpu_pct]
            w.writerow(["" if v is None else v for v in nums] + [int(r.valid), s.verdict.value, s.reason])
    return [md, path]
