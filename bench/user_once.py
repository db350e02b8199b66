"""What embedding the user and the context once per request buys, against the FLOP floor of the call.

    python -m bench.user_once --variant .cache/variants/distilled-<key> --dataset .cache/data/<data>.pt
    python -m bench.user_once --variant DIR --variant DIR2 ... --onnx-int8    # also an ONNX INT8 build of each

For each variant (and, with --onnx-int8, an ONNX Runtime INT8 build of each torch variant made here by the
accelerate step with its default settings, so its request graph exists), one ranking call of `--n`
candidates for one request is timed two ways, interleaved in rounds: per candidate (every row embeds
its user and context) and once per request (reco.runtime with the schema's shared columns, what the
service runs). The blocks are validation rows cut into requests (reco.models.protocol.as_requests).

Printed per variant: both p50s (median over rounds of each round's median), the speed-up with a 95 %
interval (Student t over the rounds' log ratios: rounds are minutes apart, calls within one are not
independent), the FLOP floor (flops_per_candidate x n / this machine's one-thread fp32 GEMM peak, measured
here on a 512^3 matmul) and each p50 as a multiple of it. The floor is fp32's; an INT8 graph's MLP could
go below it. One intra-op thread, as the server runs.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from reco.cli.compose import compose
from reco.config import typed
from reco.data.schema import Dataset
from reco.measure import gemm_peak_gflops
from reco.models.protocol import as_requests
from reco.runtime import load_scorer
from reco.steps import StepRun, accelerate
from reco.steps.accelerate import AccelerateConfig
from reco.steps.accelerate.export import real_batch
from reco.train.loop import TrainConfig
from reco.variant import Variant


def timed(scorer, blocks: list, sizes: list[int] | None, calls: int) -> float:
    """Median ms of `calls` calls, cycling through `blocks`."""
    out = []
    for i in range(calls):
        t = time.perf_counter()
        scorer(*blocks[i % len(blocks)], sizes)
        out.append(time.perf_counter() - t)
    return float(np.median(out)) * 1e3


def speedup_ci(per: list[float], once: list[float]) -> tuple[float, float, float]:
    """Ratio of medians (per / once) and a 95 % Student t interval over the rounds' log ratios."""
    logs = np.log(np.asarray(per) / np.asarray(once))
    half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / math.sqrt(len(logs))
    mid = float(np.median(per) / np.median(once))
    return mid, float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))


def onnx_int8(parent: Variant, data: Dataset, out: Path) -> Variant:
    cfg = typed(compose(["accelerate.mode=onnx_int8"]).accelerate, AccelerateConfig, "accelerate")
    trainer = typed(compose([]).trainer, TrainConfig, "trainer")
    trainer.threads = 1
    return accelerate.run(parent, data, cfg, StepRun(f"{parent.name}_onnx_int8", out, trainer))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.user_once", description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", required=True, help="a variant directory (repeatable)")
    p.add_argument("--dataset", required=True, help="the Dataset .pt file the variants were built on")
    p.add_argument("--onnx-int8", action="store_true", help="also an ONNX INT8 build of each torch variant")
    p.add_argument("--n", type=int, default=500, help="candidates per request (serve.n_candidates)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--calls", type=int, default=40, help="timed calls per form and round")
    args = p.parse_args(argv)
    data = Dataset.load(args.dataset)
    shared = data.schema.shared_columns
    variants = [Variant.load(v) for v in args.variant]
    tmp = tempfile.TemporaryDirectory(prefix="user_once_")
    if args.onnx_int8:
        for v in list(variants):
            if v.backend == "torch":
                print(
                    f"building an ONNX INT8 graph of {v.name} (accelerate step, default settings)...",
                    flush=True,
                )
                variants.append(onnx_int8(v, data, Path(tmp.name) / v.name))
    peak = gemm_peak_gflops()
    rng = np.random.default_rng(0)
    blocks = []
    for _ in range(8):  # 8 requests of validation rows, each row taking its request's user and context
        rows = real_batch(data.val.take(torch.from_numpy(rng.integers(0, len(data.val), args.n))), args.n)
        blocks.append(as_requests(rows, shared, [args.n]))
    print(
        f"\nOne request of {args.n} candidates, 1 thread; {args.rounds} rounds x {args.calls} calls per form; "
        f"fp32 GEMM peak {peak:.1f} GFLOP/s (one thread, 512^3)"
    )
    print(
        "| variant | backend | per candidate p50 ms | once per request p50 ms | speed-up [95% CI] "
        "| FLOP floor ms | per candidate / floor | once / floor |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        per_c, once_c = load_scorer(v, threads=1), load_scorer(v, threads=1, shared=shared)
        timed(per_c, blocks, None, 5)  # warm-up
        timed(once_c, blocks, [args.n], 5)
        per, once = [], []
        for _ in range(args.rounds):
            per.append(timed(per_c, blocks, None, args.calls))
            once.append(timed(once_c, blocks, [args.n], args.calls))
        mid, lo, hi = speedup_ci(per, once)
        floor = v.flops_per_candidate * args.n / (peak * 1e9) * 1e3
        p50, o50 = float(np.median(per)), float(np.median(once))
        print(
            f"| `{v.name}` | {v.backend} | {p50:.3f} | {o50:.3f} | {mid:.2f}x [{lo:.2f}, {hi:.2f}] | "
            f"{floor:.3f} | {p50 / floor:.1f}x | {o50 / floor:.1f}x |",
            flush=True,
        )
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
