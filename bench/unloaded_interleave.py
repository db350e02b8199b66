"""Does interleaving by request make an unloaded block's p99 ratio steadier than interleaving by window?

    python -m bench.unloaded_interleave --variant A=DIR --variant B=DIR --dataset DATA.pt
        [--blocks 40] [--requests 100] [--warmup-s 0.5] [--minutes 9] [--set serve.key=value ...] [--out DIR]

Two real servers (reco.serve.process.start_server) pinned to the server core(s) as a study pins them, with
the study's keep-warm spinner, one kept Locust process per design on the other core (reco.loadtest.
locust_pool). 2 x `--blocks` unloaded blocks (one closed-loop user, `--requests` per variant after a
`--warmup-s` warm-up), the designs alternating block by block so both see the same host:

    window   loadtest.study.unloaded_interleave=window: one Locust window per variant, in a random order
    request  =request: one window whose user sends to both servers in cycles (reco.loadtest.interleave)

For each design: the spread (sd, n blocks) of the per-block log-ratio A/B of the p50 and of the p99 (each
block's own nearest-rank quantiles), the sd ratio request/window with a 95 % block-bootstrap interval, and
the paired ratio over all blocks (reco.stats.paired.median_block_ratio, what the report gives for an
unloaded ratio) with its hi/lo.
A host slow stretch (2-10 s, 1.3-1.9x) that hits one variant's window and not the other's moves the
window design's per-block ratio; in the request design it lands on both.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from pathlib import Path

import numpy as np

from reco.cli.compose import compose
from reco.cpu import cpu_model
from reco.data.schema import Dataset
from reco.loadtest.config import LoadMode, loadtest_config
from reco.loadtest.interleave import Target, run_interleaved
from reco.loadtest.locust_pool import LocustPool
from reco.loadtest.requests import write_requests
from reco.loadtest.runner import plan_cpus, run_load, with_settings
from reco.serve.config import serve_config
from reco.serve.keepwarm import start_keep_warm, stop_keep_warm
from reco.serve.process import ServerHandle, start_server, stop_servers
from reco.stats import nearest_rank
from reco.stats.paired import median_block_ratio

DESIGNS = ("window", "request")
QS = {"p50": 0.5, "p99": 0.99}


def one_block(
    design: str,
    b: int,
    servers: dict[str, ServerHandle],
    c,
    requests: Path,
    cpus,
    pool: LocustPool,
    out: Path,
) -> dict[str, np.ndarray]:
    """Block b of `design`: each variant's latencies (ms)."""
    d = out / design / f"b{b}"
    names = list(servers)
    if design == "request":
        targets = [Target(n, servers[n].url, d / n, servers[n].triton_model) for n in names]
        runs = run_interleaved(targets, c, requests, cpus, kind="unloaded", seed=b, reports=False, pool=pool)
    else:
        order = [names[i] for i in np.random.default_rng([c.seed, b]).permutation(len(names))]
        runs = {n: run_load(servers[n].url, c, d / n, requests, cpus, kind="unloaded", reports=False, pool=pool) for n in order}  # fmt: skip
    bad = [f"{n}: {r.invalid_reason}" for n, r in runs.items() if not r.valid]
    if bad:
        print(f"# {design} block {b} invalid (kept out): {'; '.join(bad)}", flush=True)
        return {}
    return {n: runs[n].latencies_ms for n in names}


def sd_ci(x: np.ndarray, y: np.ndarray, reps: int = 2000) -> tuple[float, float, float]:
    """sd(x) / sd(y) with a 95 % bootstrap interval (each sample's blocks resampled on their own)."""
    rng = np.random.default_rng(0)
    boot = [
        np.std(rng.choice(x, len(x)), ddof=1) / np.std(rng.choice(y, len(y)), ddof=1) for _ in range(reps)
    ]
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return float(np.std(x, ddof=1) / np.std(y, ddof=1)), float(lo), float(hi)


def report(blocks: dict[str, list[dict[str, np.ndarray]]], a: str, b: str) -> None:
    print(f"\n| design | blocks | quantile | sd of per-block log({a}/{b}) | paired ratio [95% CI] | hi/lo |")
    print("|---|---|---|---|---|---|")
    logs: dict[tuple[str, str], np.ndarray] = {}
    for design in DESIGNS:
        bl = blocks[design]
        for key, q in QS.items():
            x = np.array([math.log(nearest_rank(k[a], q) / nearest_rank(k[b], q)) for k in bl])
            logs[design, key] = x
            e = median_block_ratio([k[a] for k in bl], [k[b] for k in bl], q)
            span = f"{e.hi / e.lo:.3f}" if e.value is not None and e.lo and e.hi else "n/a"
            print(f"| {design} | {len(bl)} | {key} | {np.std(x, ddof=1):.4f} | {e.fmt('.3f')} | {span} |")
    print("\n| quantile | sd request / sd window [95% CI, block bootstrap] |\n|---|---|")
    for key in QS:
        r, lo, hi = sd_ci(logs["request", key], logs["window", key])
        print(f"| {key} | {r:.3f} [{lo:.3f}, {hi:.3f}] |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, help="NAME=DIR (two of them)")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--blocks", type=int, default=40, help="blocks of each design")
    ap.add_argument("--requests", type=int, default=100, help="requests per variant per block")
    ap.add_argument("--warmup-s", type=float, default=0.5)
    ap.add_argument("--minutes", type=float, default=9.0, help="no new pair of blocks starts after this")
    ap.add_argument("--set", action="append", default=[], help="serve.key=value")
    ap.add_argument("--out", default="/tmp/unloaded_interleave")
    args = ap.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant)
    if len(variants) != 2:
        ap.error("--variant: give exactly two, NAME=DIR")
    cfg = compose(args.set)
    serve = dataclasses.replace(serve_config(cfg.serve), keep_warm=False)
    lt = loadtest_config(cfg.loadtest)
    c = with_settings(lt, mode=LoadMode.closed, users=1, workers=1, window_requests=args.requests, warmup_s=args.warmup_s)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = write_requests(
        Dataset.load(args.dataset), out / "requests.jsonl", lt.requests.n, lt.requests.k, lt.seed
    )
    server_cpus, gen_cpus = plan_cpus()
    cpus = server_cpus or sorted(os.sched_getaffinity(0))
    spinners = start_keep_warm(cpus) if lt.loadgen.keep_warm else []
    hs = {n: start_server(Path(d).resolve(), Path(args.dataset).resolve(), serve, cpus=server_cpus, work_dir=out / n) for n, d in variants.items()}  # fmt: skip
    blocks: dict[str, list[dict[str, np.ndarray]]] = {d: [] for d in DESIGNS}
    t0 = time.time()
    try:
        with LocustPool(out / "pool") as pool:
            settle = with_settings(c, window_requests=None, duration_s=3.0, warmup_s=0.0)
            for n, h in hs.items():  # the servers' start-up out of the first block
                run_load(h.url, settle, out / "settle" / n, requests, gen_cpus, kind="settle", reports=False, pool=pool)  # fmt: skip
            for i in range(2 * args.blocks):
                if i % 2 == 0 and time.time() - t0 > 60 * args.minutes:
                    print(f"# --minutes {args.minutes:g} spent: {i // 2} blocks of each design", flush=True)
                    break
                design = DESIGNS[i % 2]
                got = one_block(design, i // 2, hs, c, requests, gen_cpus, pool, out)
                if got:
                    blocks[design].append(got)
    finally:
        stop_servers(list(hs.values()))
        stop_keep_warm(spinners)
    a, b = list(variants)
    print(
        f"# {cpu_model()}, {os.cpu_count()} CPUs; servers on {server_cpus}, Locust on {gen_cpus}; {time.time() - t0:.0f} s"
    )
    print(
        f"# {args.requests} requests per variant per block after {args.warmup_s:g} s warm-up; serve {args.set}"
    )
    report(blocks, a, b)
    print(f"\n# rerun: python -m bench.unloaded_interleave {' '.join(f'--variant {v}' for v in args.variant)} "
          f"--dataset {args.dataset} --blocks {args.blocks}")  # fmt: skip


if __name__ == "__main__":
    main()
