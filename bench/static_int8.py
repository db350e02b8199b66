"""Static vs dynamic INT8 (ONNX Runtime): validation AUC and batch invariance of each quantization setting.

    python -m bench.static_int8 --variant .cache/variants/baseline-<key> --variant .cache/variants/distilled-<key> \\
        --dataset .cache/data/<data>.pt

For each torch variant the plain and the request graph (reco.steps.accelerate.export) are exported once in
fp32, then quantized as the accelerate step does (conf/step/accelerate.yaml's quantize settings) with each
SETTINGS row's overrides; static rows are calibrated on the first calibration_batches x
calibration_batch_size rows of the validation split (what the step uses). Per setting:

- validation AUC with its DeLong 95 % interval (n = validation rows), the paired ΔAUC against the fp32
  graph (reco.stats.auc_delta) and the max |score - fp32 score|, every row scored per candidate (the plain
  graph);
- batch spread: the widest |score of a request inside a call with 1-7 other requests - its score alone|
  over --requests requests of --n validation rows (reco.models.protocol.as_requests) x --compositions
  calls each, through the request graph the server runs (reco.loadtest.correctness.batch_spread);
- with --users U (data with a planted click model): the served top-10's expected clicks@10 of U
  validation users (reco.serve.quality: the service's own candidates and ranking, graded by the true
  P(click), what the report's gate judges), relative to the fp32 graph's, paired over the users;
- p50 ms of one call of one request of --n candidates, and of 8 such requests in one call, timed
  interleaved over --rounds rounds (median of the rounds' medians), one intra-op thread; and the time
  of each against dynamic INT8's as a ratio of medians with a 95 % Student t interval over the rounds'
  log ratios (bench.user_once.speedup_ci).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.user_once import speedup_ci
from reco.cli.compose import compose
from reco.config import typed
from reco.data.schema import Dataset
from reco.experiment import ExperimentConfig, experiment_config
from reco.loadtest.correctness import batch_spread
from reco.measure import predict
from reco.models.protocol import as_requests
from reco.pipeline import ground_truth
from reco.runtime import ort_scorer
from reco.serve.features import FeatureStore
from reco.serve.quality import quality_requests, served_topk
from reco.stats import Estimate, auc_ci, auc_delta
from reco.steps.accelerate import AccelerateConfig
from reco.steps.accelerate.export import export_onnx, real_batch
from reco.steps.accelerate.quantize import quantize
from reco.variant import Variant

# label -> accelerate.quantize overrides (None: the fp32 graph itself)
SETTINGS: dict[str, dict | None] = {
    "fp32": None,
    "dynamic": {"static": False},
    "static MinMax, 8-bit outputs": {
        "static": True,
        "calibration_method": "MinMax",
        "quantize_outputs": True,
    },
    "static MinMax": {"static": True, "calibration_method": "MinMax", "quantize_outputs": False},
    "static MinMax per-channel": {
        "static": True,
        "calibration_method": "MinMax",
        "quantize_outputs": False,
        "per_channel": True,
    },
    "static Percentile": {"static": True, "calibration_method": "Percentile", "quantize_outputs": False},
    "static Entropy": {"static": True, "calibration_method": "Entropy", "quantize_outputs": False},
}


def build(parent: Variant, data: Dataset, ac: AccelerateConfig, out: Path) -> dict[str, object]:
    """Label -> scorer (plain graph, request graph for sized blocks) of every SETTINGS row."""
    model = parent.load_torch()
    example = data.val.take(slice(0, 8))
    plain, request = out / "fp32.onnx", out / "request_fp32.onnx"
    export_onnx(model, plain, example, ac.opset, ac.exporter.value)
    export_onnx(model, request, example, ac.opset, ac.exporter.value, data.schema.shared_columns)
    scorers: dict[str, object] = {}
    for label, over in SETTINGS.items():
        if over is None:
            scorers[label] = ort_scorer(plain, {}, 1, request=request)
            continue
        qc = dataclasses.replace(ac.quantize, **over)
        d = out / label.replace(" ", "_")
        d.mkdir()
        quantize(plain, d / "model.onnx", qc, data.val, d)
        quantize(request, d / "request.onnx", qc, data.val, d)
        scorers[label] = ort_scorer(d / "model.onnx", {}, 1, request=d / "request.onnx")
    return scorers


def clicks_delta(scorers: dict, data: Dataset, exp: ExperimentConfig, users: int) -> dict[str, Estimate]:
    """Label -> relative Δ of the served top-10's expected clicks@10 against the first scorer's (fp32),
    paired over `users` validation users, as the report's gate grades it (reco.pipeline.ground_truth);
    {} when the data has no planted click model."""
    if not users:
        return {}
    store, reqs = FeatureStore(data, exp.serve.retrieval), quality_requests(data, users, exp.seed, "val")
    truth = ground_truth(exp, data, store, reqs)
    if truth is None:
        return {}
    tops = {label: served_topk(s, store, data, reqs, exp.serve, 10) for label, s in scorers.items()}
    ref_gain = truth.gains_of(next(iter(tops.values())))
    return {label: truth.graded(top, ref_gain, exp.seed).clicks_delta for label, top in tops.items()}


def timed(scorer, block, sizes: list[int], calls: int) -> float:
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        scorer(*block, sizes)
        out.append(time.perf_counter() - t)
    return float(np.median(out)) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.static_int8", description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", required=True, help="a torch variant directory (repeatable)")
    p.add_argument("--dataset", required=True, help="the Dataset .pt file the variants were built on")
    p.add_argument("--n", type=int, default=50, help="candidates per request")
    p.add_argument("--requests", type=int, default=64, help="requests whose batch spread is measured")
    p.add_argument("--compositions", type=int, default=8, help="offline batches per request")
    p.add_argument(
        "--users", type=int, default=0, help="validation users whose served top-10 is graded (0: skip)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40, help="timed calls per setting, shape and round")
    p.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. accelerate.quantize.calibration_batches=16"
    )
    args = p.parse_args(argv)
    if args.requests < 8:
        p.error(f"--requests {args.requests}: expected >= 8 (the 8-request call is timed on the first 8)")
    torch.set_num_threads(1)
    data = Dataset.load(args.dataset)
    cfg = compose(["accelerate.mode=onnx_int8", *args.overrides])
    ac = typed(cfg.accelerate, AccelerateConfig, "accelerate")
    ac.check()
    shared = data.schema.shared_columns
    labels = data.val.labels.numpy()
    rng = np.random.default_rng(0)
    blocks = [
        as_requests(real_batch(data.val.take(torch.from_numpy(rng.integers(0, len(data.val), args.n))), args.n),
                    shared, [args.n])
        for _ in range(args.requests)
    ]  # fmt: skip
    eight = tuple(np.concatenate([b[k] for b in blocks[:8]]) for k in range(3))
    print(f"quantize settings: {dataclasses.asdict(ac.quantize)}; validation rows n = {len(labels)}")
    print(
        f"| variant | setting | val AUC [95% CI] | ΔAUC vs fp32 [95% CI] | max abs Δ score vs fp32 | batch spread ({args.requests} req x "
        f"{args.compositions}) | Δexpected clicks@10 vs fp32 % [95% CI] ({args.users} val users) | p50 ms 1 x {args.n} | / dynamic [95% CI] | p50 ms 8 x {args.n} | / dynamic [95% CI] |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    exp = experiment_config(cfg)
    for path in args.variant:
        parent = Variant.load(path)
        with tempfile.TemporaryDirectory(prefix="static_int8_") as tmp:
            scorers = build(parent, data, ac, Path(tmp))
            times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in scorers}
            for _ in range(args.rounds):  # interleaved: drift hits every setting alike
                for label, s in scorers.items():
                    times[label][0].append(timed(s, blocks[0], [args.n], args.calls))
                    times[label][1].append(timed(s, eight, [args.n] * 8, args.calls))
            clicks = clicks_delta(scorers, data, exp, args.users)
            ref = None
            for label, s in scorers.items():
                probs = predict(s, data.val)
                ref = probs if ref is None else ref
                a = auc_ci(labels, probs)
                d, _ = auc_delta(labels, ref, probs)
                r = np.random.default_rng(1)
                spread = max(
                    batch_spread(b, blocks.__getitem__, len(blocks), s, 4096, r, args.compositions)
                    for b in blocks
                )
                t1, t8 = (float(np.median(x)) for x in times[label])
                r1, r8 = (speedup_ci(times[label][k], times["dynamic"][k]) for k in (0, 1))
                c = clicks.get(label)
                ctext = "–" if c is None else f"{100 * c.value:+.2f} [{100 * c.lo:+.2f}, {100 * c.hi:+.2f}]"
                print(
                    f"| {parent.name} | {label} | {a.value:.5f} [{a.lo:.5f}, {a.hi:.5f}] | {d.value:+.5f} "
                    f"[{d.lo:+.5f}, {d.hi:+.5f}] | {np.abs(probs - ref).max():.1e} | {spread:.2e} | {ctext} | {t1:.3f} | "
                    f"{r1[0]:.2f} [{r1[1]:.2f}, {r1[2]:.2f}] | {t8:.3f} | {r8[0]:.2f} [{r8[1]:.2f}, {r8[2]:.2f}] |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
