"""Coverage harness: do reco's 95 % intervals hold for requests under load, and how often does a
capacity step PASS at exactly the true capacity?

    python -m bench.coverage                 # the full table (experiments/interval_coverage/README.md)
    python -m bench.coverage --runs 200 --models mm1 --utilisations 0.5 0.85

Simulated single-server FCFS queues with Poisson arrivals (Lindley's recursion, every chain warmed up
into its steady state first): M/M/1, M/D/1 and M/LN/1 (log-normal service, sigma 1: heavy-tailed), at
30/50/70/85 % utilisation, each also with drift between windows (a window's service times scaled by a
factor whose max/min over windows is 1 + drift, uniform on the log scale, as a VM whose speed moves
between repeats minutes apart). The truth is the latency quantile of the steady state (with drift: of
the mixture over the drift), from closed forms for M/M/1 and from 20 million simulated requests
otherwise.

Printed per setting: the empirical coverage of the i.i.d. order-statistic interval (what reco used
before) and of reco's dependent-data interval (reco.stats.dependent) for the p50 and p99 of W windows of
n requests, with the number of simulated runs; and the capacity search's false-PASS rate: one step
(reco.loadtest.capacity.run_step, with its screening and extensions) run at the rate whose true p99
equals the SLO, where a valid 95 % interval passes at most ~2.5 % of the time. Impossible settings
(utilisation >= 1, drift < 0) stop with the flag to change. Other tables instead: --tau (what a step
costs), --paired (speed-ups of the study's blocks), --step-power (steps below the SLO), --brackets
(whole capacity searches: does the bracket hold the true capacity?).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reco.loadtest.capacity import (
    CONFIRM_LOOKS,
    FUTILE_LOOKS,
    find_capacity,
    futility,
    run_step,
    step_verdict,
)
from reco.loadtest.config import CapacityConfig
from reco.loadtest.runs import make_run
from reco.stats import Verdict, quantile_ci
from reco.stats.dependent import EXCEEDANCE_POWER, dependent_quantile_ci, ratio_ci

MODELS = ("mm1", "md1", "mln1")
QS = {"p50": 0.5, "p99": 0.99}
WARMUP = 2000  # requests every chain runs before it is recorded: past the transient even at 85 %
LN_SIGMA = 1.0  # log-normal service: sd of log service time (squared coefficient of variation 1.72)


@dataclass(frozen=True)
class Setting:
    model: str  # mm1 | md1 | mln1
    utilisation: float  # arrival rate x mean service time (mean service = 1 time unit)
    drift: float  # max/min of the windows' service-time scale - 1 (0: none)


def check(utilisations: list[float], drifts: list[float], models: list[str]) -> None:
    """Stop with the flag to change when a setting cannot be simulated."""
    for u in utilisations:
        if not 0 < u < 1:
            raise SystemExit(
                f"--utilisations: expected values in (0, 1) (a queue at >= 1 never settles), got {u}"
            )
    for d in drifts:
        if d < 0:
            raise SystemExit(f"--drifts: expected values >= 0, got {d}")
        for u in utilisations:
            if u * math.sqrt(1 + d) >= 1:
                raise SystemExit(
                    f"--drifts {d} at --utilisations {u}: the slowest window would run at "
                    f"{u * math.sqrt(1 + d):.2f} utilisation (>= 1); lower one of them"
                )
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--models: expected some of {', '.join(MODELS)}, got {m!r}")


def _service(model: str, rng: np.random.Generator, size: int) -> np.ndarray:
    if model == "mm1":
        return rng.exponential(1.0, size)
    if model == "md1":
        return np.ones(size)
    return rng.lognormal(-(LN_SIGMA**2) / 2, LN_SIGMA, size)  # mean 1


def simulate(s: Setting, chains: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """[chains, n] time-ordered sojourn times (wait + service) of independent steady-state windows, each
    with its own drift factor."""
    a = math.log1p(s.drift) / 2
    scale = np.exp(rng.uniform(-a, a, chains)) if s.drift else np.ones(chains)
    rate = s.utilisation  # mean service 1
    wait = np.zeros(chains)
    out = np.empty((chains, n))
    for t in range(WARMUP + n):
        serve = _service(s.model, rng, chains) * scale
        if t >= WARMUP:
            out[:, t - WARMUP] = wait + serve
        wait = np.maximum(wait + serve - rng.exponential(1.0 / rate, chains), 0.0)
    return out


def truth(s: Setting, q: float, rng: np.random.Generator) -> float:
    """The steady-state q-quantile of the sojourn time (closed form for M/M/1 without drift)."""
    if s.model == "mm1" and s.drift == 0:
        return -math.log(1 - q) / (1 - s.utilisation)
    return float(np.quantile(simulate(s, 2000, 10_000, rng), q))


def coverage(
    s: Setting, windows: int, n: int, runs: int, rng: np.random.Generator
) -> dict[tuple[str, str], float]:
    """(method, quantile) -> share of `runs` simulated runs of `windows` x `n` requests whose interval
    holds the truth; methods 'iid' (pooled order statistics) and 'dependent' (reco.stats.dependent).
    Beside them ('open', quantile): the share of reco's intervals open above (or unsupported), and
    ('width', quantile): their median hi/lo among the closed ones -- an interval that is always open
    always covers, so coverage alone says nothing."""
    truths = {k: truth(s, q, rng) for k, q in QS.items()}
    x = simulate(s, runs * windows, n, rng).reshape(runs, windows, n)
    hits = {(m, k): 0 for m in ("iid", "dependent") for k in QS}
    widths: dict[str, list[float]] = {k: [] for k in QS}
    for r in range(runs):
        for k, q in QS.items():
            iid = quantile_ci(x[r].ravel(), q)
            dep = dependent_quantile_ci(list(x[r]), q)
            hits["iid", k] += iid.lo <= truths[k] <= iid.hi
            hits["dependent", k] += dep.lo <= truths[k] <= dep.hi
            if dep.supported and math.isfinite(dep.hi) and dep.lo > 0:
                widths[k].append(dep.hi / dep.lo)
    out = {key: v / runs for key, v in hits.items()}
    for k in QS:
        out["open", k] = 1 - len(widths[k]) / runs
        out["width", k] = float(np.median(widths[k])) if widths[k] else math.inf
    return out


def false_pass(s: Setting, runs: int, rng: np.random.Generator, c: CapacityConfig) -> float:
    """Share of `runs` capacity steps at the rate whose true p99 is the SLO that PASS (each step: screening,
    first window, extensions, as reco.loadtest.capacity.run_step runs them)."""
    slo = truth(s, 0.99, rng)
    passes = 0
    for _ in range(runs):

        def measure(rate: float, n: int, out_dir: Path) -> object:
            lat = simulate(s, 1, n, rng)[0]
            return make_run(lat, kind="capacity", offered_qps=rate, window_s=n / rate)

        step = run_step(measure, s.utilisation, slo, c, Path("/nonexistent"))
        passes += step.verdict == Verdict.PASS
    return passes / runs


def settings(models: list[str], utilisations: list[float], drifts: list[float]) -> Iterator[Setting]:
    for m in models:
        for d in drifts:
            for u in utilisations:
                yield Setting(m, u, d)


def step_config() -> CapacityConfig:
    """The capacity step of conf/loadtest/default.yaml (step_requests 500, extended to 2000: 3 looks; no
    screening: a simulated rate is in requests per time unit)."""
    return CapacityConfig(
        enabled=True, slo_p99_ms=None, slo_factor=2.0, reference_repeats=5, max_error_rate=0.01,
        start_rate=None, growth=2.0, undecided_step_down=None, min_rate=0.01, max_rate=1.0, steps=12, tolerance=0.05,
        step_requests=500, max_step_requests=2000, max_step_s=None, step_warmup_s=0.0, screen_s=0.0,
    )  # fmt: skip


def table(
    models: list[str],
    utilisations: list[float],
    drifts: list[float],
    windows: int,
    n: int,
    runs: int,
    seed: int,
    capacity: bool = True,
) -> list[dict]:
    """One row per setting: coverage of both methods for p50 / p99 and (capacity, no drift) the step's
    false-PASS rate."""
    rng = np.random.default_rng(seed)
    rows = []
    c = step_config()
    todo = list(settings(models, utilisations, drifts))
    for i, s in enumerate(todo):
        cov = coverage(s, windows, n, runs, rng)
        fp = false_pass(s, runs, rng, c) if capacity and s.drift == 0 else None
        row = {"setting": s, "windows": windows, "n": n, "runs": runs, "coverage": cov, "false_pass": fp}
        rows.append(row)
        print(f"[{i + 1}/{len(todo)}] {_line(row)}", file=sys.stderr, flush=True)
    return rows


def _line(row: dict) -> str:
    s, cov, fp = row["setting"], row["coverage"], row["false_pass"]
    cells = [s.model, f"{s.utilisation:.0%}", f"{s.drift:.0%}", f"{row['windows']} x {row['n']}"]
    cells += [f"{cov[m, k]:.3f}" for k in QS for m in ("iid", "dependent")]
    cells += [f"{cov['open', k]:.2f} / {cov['width', k]:.2f}" for k in QS]
    cells += ["–" if fp is None else f"{fp:.3f}", str(row["runs"])]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| service | utilisation | drift | windows x n | p50 iid | p50 reco | p99 iid | p99 reco | "
    "p50 reco open / hi/lo | p99 reco open / hi/lo | false PASS at capacity | runs |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


# -- paired comparisons (issue 43): the study's blocks --------------------------------------------------
# Two variants, each run once per block (reco.stats.paired), blocks minutes apart on a drifting machine:
# a drift SHARED by every variant of a block (the VM's speed) and a part of each variant's OWN. Calibrated
# to what the case study measured: window p50s of one variant 1.1-1.7x apart (shared max/min 1.6 here),
# and up to 10 % of its own. Service shapes: tight (log-normal sigma 0.15, an eager model), heavy
# (log-normal sigma 0.5), exp (0.3 + exponential: a floor and a tail), bimodal (3 % of requests 4x slower:
# stalls). Unloaded blocks are one closed-loop user (i.i.d. service times); loaded ones a queue at the
# given utilisation (Lindley's recursion, vectorised).
PAIR_SHAPES = {
    "tight": lambda rng, n: rng.lognormal(0.0, 0.15, n),
    "heavy": lambda rng, n: rng.lognormal(0.0, 0.5, n),
    "exp": lambda rng, n: 0.3 + rng.exponential(0.7, n),
    "bimodal": lambda rng, n: np.where(rng.random(n) < 0.03, 4.0, 1.0) * rng.lognormal(0.0, 0.1, n),
}
PAIRS = (("tight", "heavy"), ("exp", "tight"), ("heavy", "exp"), ("bimodal", "tight"))


@dataclass(frozen=True)
class PairSetting:
    a: str  # the slower variant's service shape (PAIR_SHAPES); 10x the other's scale
    b: str
    utilisation: float  # 0: unloaded (closed loop, one user); else each block a queue at this utilisation
    shared: float  # max/min - 1 of the drift every variant of a block shares
    own: float  # max/min - 1 of each variant's own drift


def _block(shape: str, u: float, scale: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """[len(scale), n] latencies: service of `shape` x scale (per block); with u > 0, the sojourn in a
    queue at utilisation u (arrivals Poisson at u per mean service time), warmed up to its steady state."""
    warm = 0 if u == 0 else WARMUP
    s = PAIR_SHAPES[shape](rng, (len(scale), warm + n)) * scale[:, None]
    if u == 0:
        return s
    gaps = rng.exponential(1.0 / u, s.shape) * scale[:, None]  # the rate follows the speed: same utilisation
    return sojourn(s, gaps)[:, warm:]


def sojourn(service: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """Wait + service of a FCFS queue starting empty, along the last axis: Lindley's recursion
    W_t = max(W_(t-1) + S_(t-1) - A_t, 0) in closed form, W_t = C_t - min(0, C_1..C_t) with C the running
    sum of S - A (vectorised; `simulate` keeps its loop so its seeded draws, and the committed tables,
    stay as they were)."""
    c = np.cumsum(service - gaps, axis=-1)
    c = np.concatenate([np.zeros_like(c[..., :1]), c[..., :-1]], axis=-1)
    return c - np.minimum.accumulate(np.minimum(c, 0.0), axis=-1) + service


def _drift(d: float, size: int, rng: np.random.Generator) -> np.ndarray:
    return np.exp(rng.uniform(-0.5, 0.5, size) * math.log1p(d)) if d else np.ones(size)


def _pair(p: PairSetting, blocks: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    shared = _drift(p.shared, blocks, rng)
    a = _block(p.a, p.utilisation, 10.0 * shared * _drift(p.own, blocks, rng), n, rng)
    b = _block(p.b, p.utilisation, shared * _drift(p.own, blocks, rng), n, rng)
    return a, b


def paired_coverage(p: PairSetting, blocks: int, n: int, runs: int, rng: np.random.Generator) -> dict:
    """Per quantile: coverage of the CLOSED paired-ratio intervals, their open share and their median
    hi/lo, over `runs` simulated studies of `blocks` x `n`; beside it the MOVER interval from the two
    pooled intervals (reco.stats.dependent) for comparison. The estimator is the report's: unloaded
    (utilisation 0) with >= SIGN_MIN_BLOCKS blocks the median block (reco.stats.paired.
    median_block_ratio), whose truth is the ratio at one state of the machine (the shapes' quantiles
    without drift: a shared drift scales both alike); else the pooled blocks (paired_ratio), whose truth
    is the ratio of the two variants' quantiles over the drift (their mixtures). Truths from 4,000
    simulated blocks."""
    from reco.stats.paired import SIGN_MIN_BLOCKS, median_block_ratio, paired_ratio

    median = p.utilisation == 0 and blocks >= SIGN_MIN_BLOCKS
    ta, tb = _pair(dataclasses.replace(p, shared=0.0, own=0.0) if median else p, 4000, n, rng)
    out = {}
    for key, q in QS.items():
        truth = float(np.quantile(ta, q) / np.quantile(tb, q))
        hits = closed = 0
        widths, mover_open = [], 0
        for _ in range(runs):
            a, b = _pair(p, blocks, n, rng)
            e = median_block_ratio(list(a), list(b), q) if median else paired_ratio(list(a), list(b), q)
            if e.supported and 0 < e.lo and math.isfinite(e.hi):
                closed += 1
                hits += e.lo <= truth <= e.hi
                widths.append(e.hi / e.lo)
            m = ratio_ci(dependent_quantile_ci(list(a), q), dependent_quantile_ci(list(b), q))
            mover_open += not (m.supported and m.lo > 0 and math.isfinite(m.hi))
        out[key] = {
            "coverage": hits / closed if closed else math.nan,
            "open": 1 - closed / runs,
            "width": float(np.median(widths)) if widths else math.inf,
            "mover_open": mover_open / runs,
        }
    return out


PAIR_HEADER = (
    "| pair (slower / faster) | utilisation | shared / own drift | blocks x n | p50 coverage | p50 open | "
    "p50 hi/lo | p99 coverage | p99 open | p99 hi/lo | p99 open, MOVER | runs |\n" + "|---" * 12 + "|"
)


def _pair_line(p: PairSetting, blocks: int, n: int, runs: int, r: dict) -> str:
    cells = [f"{p.a} / {p.b}", f"{p.utilisation:.0%}", f"{p.shared:.0%} / {p.own:.0%}", f"{blocks} x {n}"]
    for key in QS:
        cells += [f"{r[key]['coverage']:.3f}", f"{r[key]['open']:.2f}", f"{r[key]['width']:.2f}"]
    cells += [f"{r['p99']['mover_open']:.2f}", str(runs)]
    return "| " + " | ".join(cells) + " |"


def paired_table(blocks: int, n: int, runs: int, seed: int, utilisations: list[float]) -> list[str]:
    """The study's shape (blocks x n per variant) for every pair of shapes, unloaded and loaded."""
    rng = np.random.default_rng(seed)
    lines = [PAIR_HEADER]
    for u in utilisations:
        for a, b in PAIRS:
            p = PairSetting(a, b, u, 0.6, 0.1)
            lines.append(_pair_line(p, blocks, n, runs, paired_coverage(p, blocks, n, runs, rng)))
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def paired_lower_table(
    blocks: int, n: int, runs: int, seed: int, utilisations: list[float], confs: list[float]
) -> list[str]:
    """How often the pooled-blocks p99 speed-up's LOWER bound lies above the true ratio (slower / faster,
    both orders of every pair): where the report's latency gate divides the baseline's p99 bound by it
    (reco.report.gate.PAIRED_BOUND_CONF), that share is the bound's own error rate (nominal
    (1 - conf) / 2), and the other side's beside it. Every level judges the same simulated studies."""
    from reco.stats.paired import paired_ratio

    rng = np.random.default_rng(seed)
    head = "| pair (slower / faster) | utilisation | " + " | ".join(
        f"lower bound above the truth at {c:.0%} (nominal {(1 - c) / 2:.1%}) | upper below" for c in confs
    )
    lines = [head + " | runs |", "|---" * (3 + 2 * len(confs)) + "|"]
    for u in utilisations:
        for a, b in PAIRS:
            for slow, fast in ((a, b), (b, a)):
                p = PairSetting(slow, fast, u, 0.6, 0.1)
                ta, tb = _pair(p, 4000, n, rng)
                truth = float(np.quantile(ta, 0.99) / np.quantile(tb, 0.99))
                above, below, closed = np.zeros(len(confs)), np.zeros(len(confs)), np.zeros(len(confs))
                for _ in range(runs):
                    x, y = _pair(p, blocks, n, rng)
                    for i, c in enumerate(confs):
                        e = paired_ratio(list(x), list(y), 0.99, conf=c)
                        if e.supported and e.lo > 0:
                            closed[i] += 1
                            above[i] += e.lo > truth
                            below[i] += e.hi < truth
                cells = [
                    f"{above[i] / closed[i]:.3f} | {below[i] / closed[i]:.3f}" for i in range(len(confs))
                ]
                lines.append(f"| {slow} / {fast} | {u:.0%} | " + " | ".join(cells) + f" | {runs} |")
                print(lines[-1], file=sys.stderr, flush=True)
    return lines


# -- a capacity step's power (issue 43): does a step far below the SLO PASS? -------------------------------
# One step as the case study runs it (loadtest.capacity: 600 requests, doubled up to 8,000: 5 looks at 99 %)
# on one continuous chain (the server keeps running between a step's windows), judged at each look by
# reco.loadtest.capacity.step_verdict, with and without the exceedance bound (exponent k). The SLO is a
# multiple of the chain's true p99: at 1x a PASS is false (a valid step PASSes at most ~5 %), above it a
# PASS is the right answer and its share is the step's power (the case study's fast variants' steps sit
# at 5-20x). Queues as above plus "stall" (exponential service, and one request in 1,000 a stall 20 mean
# services long: the bursts of slow requests the case study's fast variants show), each with a drift
# within the step (the service's speed redrawn every 600 requests, max/min 1 + drift: the case study's
# windows of one step differed up to 2x in p99).
STEP_MODELS = (*MODELS, "stall")
STEP_LOOKS = (600, 1200, 2400, 4800, 8000)


def _step_service(model: str, rng: np.random.Generator, size: tuple[int, int]) -> np.ndarray:
    if model == "stall":
        return np.where(rng.random(size) < 1e-3, 20.0, rng.exponential(0.98 / 0.999, size))  # mean 1
    return _service(model, rng, size)


def _step_chains(model: str, u: float, drift: float, chains: int, rng: np.random.Generator) -> np.ndarray:
    """[chains, STEP_LOOKS[-1]] latencies of a queue at utilisation u whose speed moves every 600 requests."""
    n = WARMUP + STEP_LOOKS[-1]
    scale = np.repeat(_drift(drift, chains * (n // 600 + 1), rng).reshape(chains, -1), 600, axis=1)[:, :n]
    serve = _step_service(model, rng, (chains, n)) * scale
    return sojourn(serve, rng.exponential(1.0 / u, (chains, n)))[:, WARMUP:]


def step_power(
    model: str, u: float, drift: float, factors: tuple[float, ...], powers: tuple[int, ...], runs: int, rng
) -> dict[tuple[float, int], float]:
    """(SLO / true p99, k) -> share of `runs` steps that PASS (k = 0: the p99's interval alone). With the
    bound (k > 0) a step also stops as run_step stops it, when FUTILE_LOOKS looks in a row find it
    hopeless (reco.loadtest.capacity.futility)."""
    truth_p99 = float(np.quantile(_step_chains(model, u, drift, 400, rng), 0.99))
    x = _step_chains(model, u, drift, runs, rng)
    c = dataclasses.replace(step_config(), step_requests=STEP_LOOKS[0], max_step_requests=STEP_LOOKS[-1])
    out = {}
    for f in factors:
        for k in powers:
            passes = 0
            for r in range(runs):
                windows, streak = [], 0
                for lo, n in zip((0, *STEP_LOOKS[:-1]), STEP_LOOKS, strict=True):
                    windows.append(
                        make_run(x[r, lo:n], kind="capacity", offered_qps=u, window_s=(n - lo) / u)
                    )
                    run = make_run(x[r, :n], kind="capacity", offered_qps=u, window_s=n / u)
                    v = step_verdict(run, f * truth_p99, c.max_error_rate, c.step_conf, power=k)[0]
                    if v != Verdict.INCONCLUSIVE:
                        passes += v == Verdict.PASS
                        break
                    if k and n < STEP_LOOKS[-1]:
                        hopeless = futility(windows, run, f * truth_p99, STEP_LOOKS[-1], c.step_conf)
                        streak = streak + 1 if hopeless else 0
                        if streak >= FUTILE_LOOKS:
                            break
            out[f, k] = passes / runs
    return out


def step_power_table(
    models: list[str],
    utilisations: list[float],
    drifts: list[float],
    runs: int,
    seed: int,
    factors: tuple[float, ...] = (1.0, 3.0, 6.0, 12.0),
    powers: tuple[int, ...] = (0, EXCEEDANCE_POWER),
) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = [
        "| service | utilisation | drift in step | "
        + " | ".join(
            f"SLO {f:g}x p99: {'p99 CI only' if k == 0 else f'with bound (k={k})'}"
            for f in factors
            for k in powers
        )
        + " | runs |",
        "|---" * (4 + len(factors) * len(powers)) + "|",
    ]
    for m in models:
        for d in drifts:
            for u in utilisations:
                p = step_power(m, u, d, factors, powers, runs, rng)
                cells = [f"{p[f, k]:.2f}" for f in factors for k in powers]
                lines.append(f"| {m} | {u:.0%} | {d:.0%} | " + " | ".join(cells) + f" | {runs} |")
                print(lines[-1], file=sys.stderr, flush=True)
    return lines


# -- where whole capacity searches put the true capacity ---------------------------------------------------
def _window(model: str, u: float, drift: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n latencies of one window at utilisation u (mean service 1: the rate is the utilisation), warmed
    up first, the speed moving every 600 requests as in _step_chains; past u = 1 the queue grows."""
    total = WARMUP + n
    scale = np.repeat(_drift(drift, total // 600 + 1, rng), 600)[:total]
    serve = _step_service(model, rng, (1, total))[0] * scale
    return sojourn(serve, rng.exponential(1.0 / u, total))[WARMUP:]


def bracket_coverage(
    model: str,
    capacity: float,
    drift: float,
    runs: int,
    rng: np.random.Generator,
    tolerance: float = 0.35,
    confirm_looks: int = CONFIRM_LOOKS,
    max_requests: int = STEP_LOOKS[-1],
    step_down: float | None = None,
) -> dict:
    """Whole capacity searches (reco.loadtest.capacity.find_capacity, the case study's growth 1.5 and
    600-8,000-request steps; `tolerance` 0.35 for most variants, 0.2 for the QPS gain's two; a FAIL on
    `confirm_looks` looks in a row) on a queue whose true p99 meets the SLO at utilisation `capacity`,
    each started log-uniformly within 1.5x of it. Returns the share of searches whose bracket
    [highest PASS, lowest FAIL) holds the true capacity ('covered'), the same for the rule before it, whose
    upper end was the lowest rate that did not pass, undecided ones included ('covered_old'), the median
    hi/lo of the closed brackets both ways, the share with undecided rates inside ('undecided') and the
    share whose lowest FAIL lies at or below the true capacity ('false_fail'), and the median requests a
    search spent ('requests') and the time (requests / rate summed, in mean service times: 'time').
    `max_requests`: what an undecided step may pool (max_step_requests); `step_down`: the factor down after
    an undecided step while none has passed (undecided_step_down; None: growth)."""
    slo = float(np.quantile(_step_chains(model, capacity, drift, 400, rng), 0.99))
    c = dataclasses.replace(
        step_config(), growth=1.5, tolerance=tolerance, steps=8, min_rate=0.02, max_rate=5.0,
        step_requests=STEP_LOOKS[0], max_step_requests=max_requests, undecided_step_down=step_down,
    )  # fmt: skip

    def measure(rate: float, n: int, out_dir: Path) -> object:
        return make_run(
            _window(model, rate, drift, n, rng), kind="capacity", offered_qps=rate, window_s=n / rate
        )

    hits = {"covered": 0, "covered_old": 0, "undecided": 0, "false_fail": 0}
    widths: dict[str, list[float]] = {"width": [], "width_old": []}
    spent: list[int] = []
    took: list[float] = []
    for _ in range(runs):
        start = capacity * 1.5 ** rng.uniform(-1.0, 1.0)
        cfg = dataclasses.replace(c, start_rate=start)
        cap = find_capacity(measure, slo, cfg, Path("/nonexistent"), confirm_looks=confirm_looks)
        best = cap.highest_pass
        old = min((s.rate for s in cap.steps if s.verdict != Verdict.PASS and s.rate > best), default=None)
        for key, end in (("", cap.lowest_fail), ("_old", old)):
            hits[f"covered{key}"] += best <= capacity < (math.inf if end is None else end)
            if end is not None and best > 0:
                widths[f"width{key}"].append(end / best)
        hits["undecided"] += bool(cap.undecided)
        hits["false_fail"] += cap.lowest_fail is not None and cap.lowest_fail <= capacity
        spent.append(sum(s.run.n for s in cap.steps))
        took.append(sum(s.run.n / s.rate for s in cap.steps))
    out: dict = {k: v / runs for k, v in hits.items()}
    out |= {k: float(np.median(v)) if v else math.inf for k, v in widths.items()}
    return out | {"requests": float(np.median(spent)), "time": float(np.median(took))}


def bracket_table(
    models: list[str],
    drifts: list[float],
    capacity: float,
    runs: int,
    seed: int,
    tolerances: list[float],
    confirm_looks: int = CONFIRM_LOOKS,
    max_requests: int = STEP_LOOKS[-1],
    step_down: float | None = None,
) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = [
        "| service | drift in step | tolerance | searches | true capacity in [pass, fail) "
        "| in [pass, lowest non-pass) (before) | median hi/lo | before | searches with undecided rates "
        "| a FAIL at or below the true capacity | median requests per search "
        "| median time per search (mean service times) |",
        "|---" * 12 + "|",
    ]
    for m, d, tol in itertools.product(models, drifts, tolerances):
        r = bracket_coverage(m, capacity, d, runs, rng, tol, confirm_looks, max_requests, step_down)
        lines.append(
            f"| {m} | {d:.0%} | {tol:g} | {runs} | {r['covered']:.2f} | {r['covered_old']:.2f} "
            f"| {r['width']:.2f} | {r['width_old']:.2f} | {r['undecided']:.2f} | {r['false_fail']:.2f} "
            f"| {r['requests']:,.0f} | {r['time']:,.0f} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


# -- how many requests a capacity step needs (issue 43, finding 4) ---------------------------------------
def tau_table(models: list[str], utilisations: list[float], n: int, seed: int) -> list[str]:
    """The dependence factor tau of the indicator 1{latency > its q-quantile} (its variance over the
    Bernoulli one, from batch means of 20,000 requests over one chain of n) by queue and utilisation, and
    what it costs a capacity step: a step PASSes only when its p99's upper bound is a request it saw, which
    with 5 looks at 99 % needs n >= ~660 tau requests (z 2.576: n >= z^2 x 0.99 / 0.01 x tau); a count of
    requests over the SLO needs >= ~530 tau with none over it (0 of n / tau at 99.5 % one-sided)."""
    rng = np.random.default_rng(seed)
    qs = (0.9, 0.99, 0.998)
    lines = [
        "| service | utilisation | "
        + " | ".join(f"tau at q{q}" for q in qs)
        + " | requests a PASS needs (660 tau at q0.99) |",
        "|---" * (3 + len(qs)) + "|",
    ]
    for m in models:
        for u in utilisations:
            serve = _service(m, rng, WARMUP + n)
            x = sojourn(serve, rng.exponential(1.0 / u, WARMUP + n))[WARMUP:]
            taus = []
            for q in qs:
                ind = (x > np.quantile(x, q)).astype(np.float64)
                p, b = ind.mean(), ind[: len(ind) // 20_000 * 20_000].reshape(-1, 20_000).mean(1)
                taus.append(float(b.var(ddof=1) * 20_000 / (p * (1 - p))))
            lines.append(
                f"| {m} | {u:.0%} | "
                + " | ".join(f"{t:.1f}" for t in taus)
                + f" | {660 * max(taus[1], 1):,.0f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--utilisations", nargs="+", type=float, default=[0.3, 0.5, 0.7, 0.85])
    ap.add_argument("--drifts", nargs="+", type=float, default=[0.0, 0.3])
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=["3x1000", "1x500"],
        help="WINDOWSxN: repeats pooled into one figure x requests per window (the study's common load: "
        "3x1000; one capacity step's first look: 1x500)",
    )
    ap.add_argument("--runs", type=int, default=400, help="simulated runs per setting")
    ap.add_argument(
        "--tau",
        type=int,
        default=0,
        metavar="N",
        help="instead: the dependence factor of the p99 indicator per queue and utilisation (one chain of N "
        "requests, e.g. 4000000) and the requests a capacity step's PASS needs",
    )
    ap.add_argument(
        "--paired",
        default=None,
        metavar="BLOCKSxN",
        help="instead: the paired speed-up intervals of the study's blocks (e.g. 12x100), unloaded and at "
        "--utilisations",
    )
    ap.add_argument(
        "--paired-lower",
        default=None,
        metavar="BLOCKSxN",
        help="instead: how often the paired p99 speed-up's lower bound lies above the truth at each of "
        "--confs (the latency gate's bound; the common load: 3x130), at --utilisations",
    )
    ap.add_argument("--confs", nargs="+", type=float, default=[0.95, 0.99], help="--paired-lower: levels")
    ap.add_argument(
        "--step-power",
        action="store_true",
        help="instead: how often one capacity step as the case study runs it PASSes at the true capacity and "
        "below it, with and without the exceedance bound (--models may add 'stall')",
    )
    ap.add_argument(
        "--brackets",
        type=float,
        default=None,
        metavar="UTILISATION",
        help="instead: whole capacity searches on a queue whose true capacity is at this utilisation: how "
        "often their bracket holds it, now and with undecided rates as the upper end (--models may add "
        "'stall')",
    )
    ap.add_argument(
        "--tolerances",
        nargs="+",
        type=float,
        default=[0.35],
        help="--brackets: the searches' tolerances (the case study: 0.35, and 0.2 for the QPS gain's two)",
    )
    ap.add_argument(
        "--confirm-looks",
        type=int,
        default=CONFIRM_LOOKS,
        help="--brackets: looks in a row a FAIL on the p99's lower bound needs (1: the rule before "
        "reco.loadtest.capacity.CONFIRM_LOOKS)",
    )
    ap.add_argument(
        "--max-step-requests",
        type=int,
        default=STEP_LOOKS[-1],
        help="--brackets: the requests an undecided step may pool (loadtest.capacity.max_step_requests)",
    )
    ap.add_argument(
        "--undecided-step-down",
        type=float,
        default=None,
        help="--brackets: the factor a search steps down by after an undecided step while none has passed "
        "(loadtest.capacity.undecided_step_down; default: growth)",
    )
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.brackets is not None:
        check([a.brackets], [0.0], [m for m in a.models if m != "stall"])
        table = bracket_table(
            a.models,
            a.drifts,
            a.brackets,
            a.runs,
            a.seed,
            a.tolerances,
            a.confirm_looks,
            a.max_step_requests,
            a.undecided_step_down,
        )
        print("\n".join(table))
        return
    if a.step_power:
        check(a.utilisations, [0.0], [m for m in a.models if m != "stall"])
        print("\n".join(step_power_table(a.models, a.utilisations, a.drifts, a.runs, a.seed)))
        return
    check(a.utilisations, a.drifts, a.models)
    if a.tau:
        print("\n".join(tau_table(a.models, a.utilisations, a.tau, a.seed)))
        return
    if a.paired_lower:
        blocks, n = parse_shape(a.paired_lower)
        print("\n".join(paired_lower_table(blocks, n, a.runs, a.seed, a.utilisations, a.confs)))
        return
    if a.paired:
        blocks, n = parse_shape(a.paired)
        print("\n".join(paired_table(blocks, n, a.runs, a.seed, [0.0, *a.utilisations])))
        return
    shapes = [parse_shape(s) for s in a.shapes]
    if a.runs < 1:
        raise SystemExit(f"--runs: expected >= 1, got {a.runs}")
    rows = [
        row
        for i, (w, n) in enumerate(shapes)
        # One window's interval is about that window's regime: drift BETWEEN windows is a question for
        # pooled repeats only, so a one-window shape is simulated without it.
        for row in table(
            a.models, a.utilisations, a.drifts if w > 1 else [0.0], w, n, a.runs, a.seed + i, capacity=i == 0
        )
    ]
    print(HEADER)
    for row in rows:
        print(_line(row))


def parse_shape(text: str) -> tuple[int, int]:
    """'3x1000' -> (3, 1000); stops naming --shapes otherwise."""
    try:
        w, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        w = n = 0
    if w < 1 or n < 1:
        raise SystemExit(f"--shapes: expected WINDOWSxN with both >= 1 (e.g. 3x1000), got {text!r}")
    return w, n


if __name__ == "__main__":
    main()
