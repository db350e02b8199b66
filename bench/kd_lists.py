"""Distillation arms chosen on validation: each arm's student, per seed, graded on what validation users see.

    python -m bench.kd_lists --dataset .cache/data/<data>.pt --teacher .cache/variants/pruned-<hash> \\
        --arm "pointwise=list_loss=none" --arm "listwise=list_weight=2" --seeds 0 1 2 --out kd.npz  # train
    python -m bench.kd_lists ... --measure-baseline --out base.npz   # the baseline's row (the gate's reference)
    python -m bench.kd_lists --dataset ... --table kd.npz other.npz                            # the table

An arm is `name=` followed by space-separated `distill.<key>` overrides on top of the experiment's
(`--experiment`, default ecommerce_case_study); the no-teacher control is `alpha=1 list_loss=none`. The students train as
the distill step trains them (reco.steps.distill.train_student), with `--seed` as their trainer seed; the
data set and the teacher are fixed. Every figure is on the validation split, never the test split:
AUC, GAUC (per-user AUC of the val rows) and expected clicks@10 of the service's top-10 for `--users` val
users with a positive (their own candidates, the context of their first positive val row; graded by the
planted P(click), so only on synthetic data). Intervals: percentile bootstrap over requests (users) and
over the seeds of each arm (reco.stats.topk.seeded_relative_delta), so they include training-seed noise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from reco.cli.compose import compose
from reco.config import typed
from reco.data.schema import Dataset
from reco.data.synthetic import SyntheticConfig, click_model
from reco.measure import predict
from reco.models.protocol import RankingModel, count_params
from reco.serve.config import serve_config
from reco.serve.features import FeatureStore
from reco.serve.quality import gains_of, planted_gains, quality_requests, request_candidates, served_topk
from reco.stats.gauc import per_user_auc
from reco.stats.graded import graded_per_request
from reco.stats.topk import rbo_at_k, seeded_relative_delta
from reco.steps.distill import DistillConfig, torch_scorer, train_student
from reco.train.loop import TrainConfig
from reco.train.metrics import auc
from reco.variant import Variant

K = 10


class ValQuality:
    """The validation requests, their candidates' planted P(click) and what each arm is graded on."""

    def __init__(self, data: Dataset, exp_cfg, users: int, seed: int) -> None:
        self.data, self.serve = data, serve_config(exp_cfg.serve)
        self.store = FeatureStore(data, self.serve.retrieval)
        self.reqs = quality_requests(data, users, seed, split="val")
        model = click_model(typed(exp_cfg.data.params, SyntheticConfig, "data.params"))
        self.cands = request_candidates(self.store, self.reqs, self.serve.n_candidates)
        self.gains = planted_gains(model, data, self.reqs, self.cands)
        s = data.schema
        self.users = data.val.ids[:, s.index(s.user_key), 0].numpy()
        self.labels = data.val.labels.numpy()

    def measure(self, model: RankingModel) -> dict[str, np.ndarray]:
        """{"scores": [val rows], "top": [U, K], "clicks": [U] expected clicks@K}."""
        score = torch_scorer(model)
        top = served_topk(
            lambda d, i, m, sizes=None: score(d, i, m), self.store, self.data, self.reqs, self.serve, K
        )
        clicks = graded_per_request(gains_of(top, self.cands, self.gains), self.gains)["clicks"]
        return {"scores": predict(score, self.data.val), "top": top, "clicks": clicks}


def _train(args, data: Dataset, teacher: RankingModel, q: ValQuality, out: dict) -> None:
    for arm in args.arm:
        name, _, overrides = arm.partition("=")
        cfg = compose([f"experiment={args.experiment}", *(f"distill.{o}" for o in overrides.split())])
        dc = typed(cfg.distill, DistillConfig, "distill")
        dc.check()
        dc.control = False
        for seed in args.seeds:
            trainer = typed(cfg.trainer, TrainConfig, "trainer")
            trainer.seed, trainer.threads, trainer.progress = seed, args.threads, False
            t0 = time.time()
            student, _ = train_student(teacher, data, dc, trainer, name, what="bench teacher")
            got = q.measure(student)
            got["size_ratio"] = np.array(args.baseline_params / count_params(student))
            for key, val in got.items():
                out[f"{name}/{seed}/{key}"] = val
            print(
                f"{name} seed {seed}: val AUC {auc(q.labels, got['scores']):.4f}, expected clicks@{K} "
                f"{got['clicks'].mean():.4f}, {time.time() - t0:.0f} s",
                flush=True,
            )
            np.savez(args.out, **out)


def _gauc(q_users: np.ndarray, labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
    x, w = per_user_auc(q_users, labels, scores)
    return x * w / w.mean()  # per-user terms whose mean is the GAUC (users fixed by the labels)


def _table(files: list[str], reference: str, control: str) -> None:
    runs: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    meta = {}
    for f in files:
        z = np.load(f)
        for key in z.files:
            if key.startswith("_"):
                meta[key] = z[key]
                continue
            arm, seed, what = key.split("/")
            runs.setdefault(arm, {}).setdefault(int(seed), {})[what] = z[key]
    users, labels, teacher_top = meta["_users"], meta["_labels"], meta["_teacher_top"]

    def stack(arm: str, what: str, fn=lambda x: x) -> np.ndarray:
        return np.stack([fn(r[what]) for _, r in sorted(runs[arm].items())])

    per = {
        arm: {
            "auc": stack(arm, "scores", lambda s: np.array([auc(labels, s)])),
            "gauc": stack(arm, "scores", lambda s: _gauc(users, labels, s)),
            "clicks": stack(arm, "clicks"),
            "rbo": stack(arm, "top", lambda t: rbo_at_k(t, teacher_top, 0.9)),
        }
        for arm in runs
    }
    bases = [b for b in (reference, control, "baseline") if b in per]
    print(
        f"Validation: {len(labels):,} rows, {per[reference]['clicks'].shape[1]:,} requests (users with a val positive)\n"
    )
    head = "".join(f" Δ clicks vs {b} [CI] |" for b in bases) + "".join(
        f" ΔGAUC vs {b} [CI] |" for b in bases
    )
    print(
        f"| arm | seeds | size ratio (vs baseline) | val AUC (seed range) | val GAUC | val expected clicks@{K} |{head} RBO vs teacher |"
    )
    print("|---" * (7 + 2 * len(bases)) + "|")
    for arm, m in per.items():
        ratio = float(stack(arm, "size_ratio", np.atleast_1d)[0, 0])
        a = m["auc"][:, 0]
        cells = [
            seeded_relative_delta(m[what], per[b][what]).fmt("+.2%") if arm != b else "--"
            for what in ("clicks", "gauc")
            for b in bases
        ]
        print(
            f"| {arm} | {len(a)} | {ratio:.1f}x | {a.mean():.4f} ({a.min():.4f}-{a.max():.4f}) "
            f"| {m['gauc'].mean():.4f} | {m['clicks'].mean():.4f} | {' | '.join(cells)} | {m['rbo'].mean():.3f} |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.kd_lists", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", help="a Dataset .pt file (.cache/data/<data>.pt)")
    p.add_argument("--teacher", help="the teacher variant's directory (.cache/variants/pruned-<hash>)")
    p.add_argument("--baseline", help="the baseline variant's directory: the size ratio's numerator")
    p.add_argument("--measure-baseline", action="store_true", help="also grade the baseline (a row)")
    p.add_argument("--arm", action="append", default=[], help="'name=key=value key=value' distill overrides")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--users", type=int, default=1000, help="validation users with a positive")
    p.add_argument("--experiment", default="ecommerce_case_study")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="where the arms' validation figures are saved (.npz)")
    p.add_argument("--table", nargs="+", help="saved .npz files: print the table, train nothing")
    p.add_argument("--reference", default="pointwise", help="the arm the others are compared with")
    p.add_argument("--control", default="control", help="the no-teacher arm")
    args = p.parse_args(argv)
    if args.table:
        _table(args.table, args.reference, args.control)
        return 0
    torch.set_num_threads(args.threads)
    data = Dataset.load(args.dataset)
    teacher = Variant.load(Path(args.teacher)).load_torch()
    for t in teacher.parameters():
        t.requires_grad_(False)
    args.baseline_params = Variant.load(Path(args.baseline)).params
    exp_cfg = compose([f"experiment={args.experiment}"])
    q = ValQuality(data, exp_cfg, args.users, int(exp_cfg.seed))
    ref = q.measure(teacher)
    out = {"_users": q.users, "_labels": q.labels, "_teacher_top": ref["top"]}
    ref["size_ratio"] = np.array(args.baseline_params / count_params(teacher))
    out.update({f"teacher/0/{key}": val for key, val in ref.items()})
    if args.measure_baseline:  # the gate's reference: the case study compares every variant with it
        base = Variant.load(Path(args.baseline)).load_torch()
        got = q.measure(base)
        got["size_ratio"] = np.array(1.0)
        out.update({f"baseline/0/{key}": val for key, val in got.items()})
        print(
            f"baseline: val AUC {auc(q.labels, got['scores']):.4f}, expected clicks@{K} {got['clicks'].mean():.4f}"
        )
        np.savez(args.out, **out)
    print(
        f"teacher: val AUC {auc(q.labels, ref['scores']):.4f}, expected clicks@{K} {ref['clicks'].mean():.4f}"
    )
    _train(args, data, teacher, q, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
