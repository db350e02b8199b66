"""Paired p50 / p99 ratios under the host's slow stretches: which estimator covers, by `window` or `request`?

    python -m bench.stretch_ratio                    # the table in experiments/unloaded_interleave/README.md
    python -m bench.stretch_ratio --studies 100

Simulated unloaded studies at the case study's shapes (issue 43): B blocks x n requests per variant, two
variants, one closed-loop user (service times i.i.d.). Each block runs on its own stretch of host time
(blocks are minutes apart): slow stretches arrive as a Poisson process, one every STRETCH_EVERY_S on
average, each lasting 1-6 s and multiplying every request that starts inside it by 1.3-1.9
(experiments/platform/README.md, "Slow stretches of the host"). A block's timeline is its requests in the
order the design sends them: `window` = each variant's n in one window, the two windows in random order;
`request` = cycles taking both variants, each in a fresh random order. Request start times come from the
unstretched latencies (a stretch lengthening the block by a few ms is ignored).

Truth: the ratio of the two variants' q-quantiles of the latency distribution INCLUDING the stretches as
they fall under the design, from TRUTH_BLOCKS simulated blocks pooled per variant.

The quiet truth (`no stretches`): the same ratio on a host without stretches, which the report's
unloaded ratio claims (the median block is moved by at most the few blocks a stretch hits).

Estimators of that ratio, each a 95 % interval:
- median: reco.stats.paired.median_block_ratio (what the report gives unloaded: the median block's ratio
  of Harrell-Davis quantiles, sign-test interval), judged against the QUIET truth;
- pooled: reco.stats.paired.paired_ratio (pooled quantiles, paired block bootstrap, t on B - 1 df);
- block-t: the paired t on each block's log(nearest-rank quantile ratio) (RMIT's), t on B - 1 df;
- block-hd: the same t with each block's Harrell-Davis quantile (a beta-weighted mean of all its order
  statistics: smaller bias than the 2nd largest of 100 for a p99);
- pair-hd: the t on blocks pooled two by two (B / 2 units of 2n requests), Harrell-Davis quantile.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from reco.stats.paired import hd_weights, median_block_ratio, paired_ratio

STRETCH_EVERY_S = 90.0  # mean gap between stretches: "every minute or two"
STRETCH_S = (1.0, 6.0)  # a stretch's length, uniform
STRETCH_FACTOR = (1.3, 1.9)  # what it multiplies a request by, uniform
TRUTH_BLOCKS = 20_000
QS = {"p50": 0.5, "p99": 0.99}
DESIGNS = ("window", "request")
ESTIMATORS = ("median", "pooled", "block-t", "block-hd", "pair-hd")
QUIET_TARGET = {"median"}  # estimators judged against the truth without stretches
Shape = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]
# Latency shapes (ms): a log-normal service (the pruned model ~24 ms, the eager baseline ~30 ms, tight)
# and a floor plus an exponential tail (the INT8 student; an M/M/1's sojourn at low utilisation is
# exponential).
SHAPES: dict[str, Shape] = {
    "pruned": lambda rng, size: 24.0 * rng.lognormal(0.0, 0.3, size),
    "eager": lambda rng, size: 30.0 * rng.lognormal(0.0, 0.15, size),
    "student": lambda rng, size: 7.0 * (0.3 + rng.exponential(0.7, size)),
    "student-fast": lambda rng, size: 2.0 * (0.3 + rng.exponential(0.7, size)),
    # the case study's INT8 student as measured unloaded: a tight body (p50 1.7 ms) and ~1.9 % of
    # requests 2.5-7.5 ms slower, isolated, anywhere in a window (experiments/ecommerce_case_study/
    # README.md#unloaded-window): its p99 sits at the knee between the two
    "student-events": lambda rng, size: (
        1.7 * rng.lognormal(0.0, 0.1, size) + (rng.random(size) < 0.019) * rng.uniform(2.5, 7.5, size)
    ),
}
PAIRS = (("pruned", "student"), ("eager", "student-fast"), ("eager", "student-events"))


@dataclass(frozen=True)
class Case:
    num: str  # SHAPES key of the slower variant
    den: str
    design: str  # window | request


def _order(design: str, n: int, blocks: int, rng: np.random.Generator, m: int | None = None) -> np.ndarray:
    """[blocks, n + m] which variant (0 = num, 1 = den) each successive request of a block goes to; m = the
    den's requests a block (n when None; `window` only)."""
    m = n if m is None else m
    if design == "window":
        first = rng.integers(0, 2, (blocks, 1))
        return np.where(np.arange(n + m) < np.where(first == 0, n, m), first, 1 - first)
    assert m == n, "request interleaving takes both variants in cycles: one n"
    first = rng.integers(0, 2, (blocks, n))
    return np.stack([first, 1 - first], axis=-1).reshape(blocks, 2 * n)


def _stretch(start: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[blocks, m] slow-down factor of requests starting at `start` (s, from the block's start), each block
    on its own stretch of host time."""
    blocks = start.shape[0]
    span = float(start.max()) + STRETCH_S[1]
    k = rng.poisson(span / STRETCH_EVERY_S, blocks)  # 0 on a quiet host (inf)
    kmax = max(int(k.max()), 1)
    t0 = rng.uniform(-STRETCH_S[1], start.max(), (blocks, kmax))
    t1 = t0 + rng.uniform(*STRETCH_S, (blocks, kmax))
    f = np.where(np.arange(kmax) < k[:, None], rng.uniform(*STRETCH_FACTOR, (blocks, kmax)), 1.0)
    inside = (start[:, :, None] >= t0[:, None, :]) & (start[:, :, None] < t1[:, None, :])
    return np.where(inside, f[:, None, :], 1.0).max(axis=-1)


def simulate(
    c: Case, blocks: int, n: int, rng: np.random.Generator, stretched: bool = True, m: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """([blocks, n] num's latencies, [blocks, m] den's), stretched as the design lets the host hit them
    (stretched=False: a host without stretches)."""
    who = _order(c.design, n, blocks, rng, m)
    lat = np.where(who == 0, SHAPES[c.num](rng, who.shape), SHAPES[c.den](rng, who.shape))
    start = np.concatenate([np.zeros((blocks, 1)), np.cumsum(lat, axis=1)[:, :-1]], axis=1) / 1000.0
    if stretched:
        lat = lat * _stretch(start, rng)
    # each variant's requests in time order: a stable sort on `who` keeps it
    idx = np.argsort(who, axis=1, kind="stable")
    ordered = np.take_along_axis(lat, idx, axis=1)
    return ordered[:, :n], ordered[:, n:]


def truth(
    c: Case, n: int, rng: np.random.Generator, stretched: bool = True, m: int | None = None
) -> dict[str, float]:
    """Quantile -> the true ratio, from TRUTH_BLOCKS blocks of the design pooled per variant."""
    a, b = simulate(c, TRUTH_BLOCKS, n, rng, stretched, m)
    return {k: float(np.quantile(a, q) / np.quantile(b, q)) for k, q in QS.items()}


def _t_interval(logs: np.ndarray) -> tuple[float, float, float]:
    """(point, lo, hi) of exp(mean) from per-unit log-ratios, Student t on units - 1 df."""
    m, se = float(logs.mean()), float(logs.std(ddof=1)) / math.sqrt(len(logs))
    half = float(sps.t.ppf(0.975, len(logs) - 1)) * se
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def estimates(a: np.ndarray, b: np.ndarray, q: float, seed: int) -> dict[str, tuple[float, float, float]]:
    """Estimator -> (point, lo, hi) of a's q-quantile / b's from [B, n] paired blocks."""
    blocks = a.shape[0]
    sa, sb = np.sort(a, axis=1), np.sort(b, axis=1)
    nr = np.log(sa[:, max(math.ceil(q * a.shape[1]), 1) - 1] / sb[:, max(math.ceil(q * b.shape[1]), 1) - 1])
    hd = np.log((sa @ hd_weights(a.shape[1], q)) / (sb @ hd_weights(b.shape[1], q)))
    half = blocks // 2 * 2
    a2, b2 = (np.sort(x[:half].reshape(half // 2, -1), axis=1) for x in (a, b))
    hd2 = np.log((a2 @ hd_weights(a2.shape[1], q)) / (b2 @ hd_weights(b2.shape[1], q)))
    e = paired_ratio(list(a), list(b), q, seed=seed)
    m = median_block_ratio(list(a), list(b), q)
    return {
        "median": (m.value, m.lo, m.hi),
        "pooled": (e.value, e.lo, e.hi),
        "block-t": _t_interval(nr),
        "block-hd": _t_interval(hd),
        "pair-hd": _t_interval(hd2),
    }


def run(
    c: Case, blocks: int, n: int, studies: int, rng: np.random.Generator, m: int | None = None
) -> dict[tuple[str, str], dict]:
    """(estimator, quantile) -> {'truth', 'coverage', 'open', 'width', 'bias'} over `studies` studies."""
    truths, free = truth(c, n, rng, m=m), truth(c, n, rng, stretched=False, m=m)
    got: dict[tuple[str, str], list[tuple[float, float, float]]] = {
        (e, k): [] for e in ESTIMATORS for k in QS
    }
    for s in range(studies):
        a, b = simulate(c, blocks, n, rng, m=m)
        for k, q in QS.items():
            for e, v in estimates(a, b, q, seed=s).items():
                got[e, k].append(v)
    out = {}
    for (m, k), vals in got.items():
        t = free[k] if m in QUIET_TARGET else truths[k]
        closed = [(p, lo, hi) for p, lo, hi in vals if p is not None and 0 < lo and math.isfinite(hi)]
        out[m, k] = {
            "truth": t,
            "free": free[k],
            "coverage": sum(lo <= t <= hi for _, lo, hi in closed) / len(vals),
            "open": 1 - len(closed) / len(vals),
            "width": float(np.median([hi / lo for _, lo, hi in closed])) if closed else math.inf,
            "bias": float(np.median([p for p, _, _ in closed])) / t if closed else math.nan,
        }
    return out


HEADER = (
    "| pair (num / den) | design (requests a block: num / den) | quantile | truth | no stretches | "
    "median (vs no stretches) cov / hi/lo / med pt/truth | pooled | block-t | block-hd | pair-hd |\n"
    + "|---" * 10
    + "|"
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--studies", type=int, default=400, help="simulated studies per row")
    p.add_argument("--blocks", type=int, default=28)
    p.add_argument("--n", type=int, default=100, help="requests per variant per block")
    p.add_argument(
        "--den-n",
        type=int,
        nargs="*",
        default=[],
        help="also: the faster variant's requests a block (window)",
    )
    p.add_argument("--pairs", nargs="*", default=[f"{a}/{b}" for a, b in PAIRS], help="num/den SHAPES keys")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stretches", action="store_true", help="a quiet host: no slow stretches at all")
    args = p.parse_args(argv)
    global STRETCH_EVERY_S
    if args.no_stretches:
        STRETCH_EVERY_S = math.inf
    if args.studies < 1 or args.blocks < 4 or min([args.n, *args.den_n]) < 100:
        raise SystemExit("--studies >= 1, --blocks >= 4 and --n, --den-n >= 100 (a block's own p99) expected")
    pairs = [tuple(x.split("/")) for x in args.pairs]
    if bad := [x for x in pairs if len(x) != 2 or not set(x) <= set(SHAPES)]:
        raise SystemExit(f"--pairs: expected num/den of {sorted(SHAPES)}, got {bad}")
    rng = np.random.default_rng(args.seed)
    began = time.monotonic()
    print(HEADER)
    for num, den in pairs:
        rows = [(d, args.n) for d in DESIGNS] + [("window", m) for m in args.den_n if m != args.n]
        for design, m in rows:
            res = run(Case(num, den, design), args.blocks, args.n, args.studies, rng, m)
            for k in QS:
                cells = [
                    f"{num} / {den}",
                    f"{design} ({args.n} / {m})",
                    k,
                    f"{res['pooled', k]['truth']:.2f}",
                ]
                cells.append(f"{res['pooled', k]['free']:.2f}")
                for e in ESTIMATORS:
                    r = res[e, k]
                    opened = f" (open {r['open']:.2f})" if r["open"] else ""
                    cells.append(f"{r['coverage']:.3f} / {r['width']:.2f} / {r['bias']:.2f}{opened}")
                print("| " + " | ".join(cells) + " |", flush=True)
    print(
        f"studies {args.studies} per row, {args.blocks} blocks x {args.n} (num) requests, seed {args.seed}, "
        f"{time.monotonic() - began:.0f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
