"""Validation AUC of a preset's baseline inside the epoch after its first: where trainer.stop_check_fraction
can stop training (reco.train.loop).

    python -m bench.epoch_curve                                  # experiment=ecommerce_case_study, 20 points
    python -m bench.epoch_curve --points 10 cache_dir=.cache data.params.n_users=20000

The baseline (the preset's root variant, its seed and trainer settings) trains one epoch as the train step
does, then the next epoch in `--points` equal parts of whole optimizer steps, the validation rows
(trainer.eval_rows) scored after each. Printed per point: the share of the epoch trained, val AUC and its
fall from the end of the first epoch, and the seconds the part and its validation took. Training is the
same sequence of steps as trainer.epochs=2 (the same permutations, the same batches).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from reco.cli.compose import compose
from reco.data import load_dataset
from reco.experiment import experiment_config
from reco.steps.train import fresh_model
from reco.train.loop import _epoch, bce_loss, epoch_rows, make_optimizer, val_metrics, val_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experiment", default="ecommerce_case_study")
    ap.add_argument("--points", type=int, default=20, help="validations inside the second epoch")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as run.py takes them")
    a = ap.parse_args()
    exp = experiment_config(compose([f"experiment={a.experiment}", *a.overrides]))
    data, _ = load_dataset(exp.data, exp.cache_dir / "data")
    cfg, root = exp.trainer, exp.variants[0]
    model = fresh_model(data, root.config, cfg)
    torch.manual_seed(cfg.seed)  # as reco.train.loop.train seeds before its first epoch
    torch.set_num_threads(cfg.threads)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = make_optimizer(model.named_parameters(), cfg)
    val, n = val_rows(cfg, data), epoch_rows(cfg, data)
    step = cfg.batch_size * cfg.grad_accum

    def val_auc() -> tuple[float, float]:
        t = time.perf_counter()
        auc = val_metrics(model, val)["auc"]
        model.train()
        return auc, time.perf_counter() - t

    t0 = time.perf_counter()
    model.train()
    _epoch(model, data, torch.randperm(len(data.train), generator=gen)[:n], opt, cfg, bce_loss, "epoch 1")
    best, v_s = val_auc()
    print(
        f"{root.name}: epoch 1 {time.perf_counter() - t0:.0f} s, val AUC {best:.4f} ({len(val):,} rows, {v_s:.1f} s)"
    )
    print("| epoch 2 trained | val AUC | fall from epoch 1 | part s | validation s |\n|---|---|---|---|---|")
    perm = torch.randperm(len(data.train), generator=gen)[:n]
    ends = sorted({min(n, math.ceil(i * n / a.points / step) * step) for i in range(1, a.points + 1)})
    lo = 0
    for hi in ends:
        t = time.perf_counter()
        _epoch(model, data, perm[lo:hi], opt, cfg, bce_loss, f"epoch 2 to {hi / n:.0%}")
        part_s = time.perf_counter() - t
        auc, v_s = val_auc()
        print(f"| {hi / n:.1%} | {auc:.4f} | {best - auc:+.4f} | {part_s:.1f} | {v_s:.1f} |", flush=True)
        lo = hi


if __name__ == "__main__":
    main()
