"""The `train` step: a fresh model of the configured architecture (conf/model/, chosen by its
`_target_`; see reco.models.protocol) trained on the dataset -> the baseline Variant (a root)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from reco.data.schema import Dataset
from reco.models.protocol import ModelSettings, RankingModel, resolve
from reco.steps.registry import StepError, StepRun, child_variant, register
from reco.train.launch import DistributedResult, train_distributed
from reco.train.loop import TrainConfig, train
from reco.variant import Variant


@register("train", ModelSettings, config_key="model", root=True, trains=True)
def run(parent: Variant | None, data: Dataset, cfg: ModelSettings, ctx: StepRun) -> Variant:
    """Train the model `cfg` describes on `data` (early stopping on validation AUC, per ctx.trainer).

    Args:
        cfg: the model's settings, typed by the schema of the class `cfg._target_` names.
    With trainer.distributed.nproc > 1 (or nnodes > 1) the model trains over that many processes (TorchRec's
    DistributedModelParallel, reco.train.launch); the variant is the same plain model, plus its sharding
    plan (artifact `sharding_plan`, sharding_plan.json) and per-rank table bytes in its metrics.

    Returns:
        The baseline variant: torch weights, its learning curve, best_epoch and best_val_auc.
    """
    model = fresh_model(data, cfg, ctx.trainer)
    dist = None
    if ctx.trainer.distributed.world > 1:
        dist = train_distributed(model, data, ctx.trainer, checkpoint_dir(ctx.trainer, ctx.out_dir))
        assert dist is not None, "trainer.distributed.node_rank > 0 joins through join(), not the step"
        result = dist.train
        if ctx.on_epoch:  # the ranks cannot call back into this process: replay the curve
            for epoch, row in enumerate(result.history):
                ctx.on_epoch(epoch, row)
    else:
        result = train(model, data, ctx.trainer, on_epoch=ctx.on_epoch, desc=ctx.name)
    v = child_variant(None, data, cfg, ctx, "train", "torch")
    v.save_torch(model)
    if dist is not None:
        record_distributed(v, dist)
    v.learning_curve = result.history
    v.metrics.update(
        best_epoch=float(result.best_epoch), best_val_auc=result.best_val_auc, train_seconds=result.seconds
    )
    return v


def fresh_model(data: Dataset, cfg: ModelSettings, trainer: TrainConfig) -> RankingModel:
    """The untrained model `cfg` describes, its initial weights drawn from trainer.seed."""
    cls = resolve(cfg._target_, "model._target_")
    # The initial weights come from the global RNG: seed it here, or they depend on whatever drew from
    # it earlier in the process (the loop seeds only after the model exists).
    torch.manual_seed(trainer.seed)
    try:
        return cls.from_settings(data.schema, cfg)
    except ValueError as e:
        raise StepError(f"train: model {cfg.name!r} ({cfg._target_}): {e}") from None


def checkpoint_dir(trainer: TrainConfig, out_dir: str | Path) -> str:
    return trainer.checkpoint_dir or str(Path(out_dir) / "checkpoints")


def join(data: Dataset, cfg: ModelSettings, trainer: TrainConfig, out_dir: str | Path) -> None:
    """A host with trainer.distributed.node_rank > 0: train this host's ranks of the model node 0's train
    step trains (the same `cfg`, data and seed), and return once they are done; the trained variant is
    node 0's. `out_dir` is where node 0 builds the variant (the shared cache), for its checkpoint."""
    train_distributed(fresh_model(data, cfg, trainer), data, trainer, checkpoint_dir(trainer, out_dir))


def record_distributed(v: Variant, dist: DistributedResult) -> None:
    """The sharding plan as artifact `sharding_plan` (sharding_plan.json) and, per rank, the table bytes
    it placed there and the rank's peak resident memory, as metrics."""
    (v.path / "sharding_plan.json").write_text(json.dumps([asdict(r) for r in dist.plan], indent=2))
    v.add_artifact("sharding_plan", "sharding_plan.json")
    for k in sorted({k for r in dist.plan for k in r.bytes_per_rank}):
        v.metrics[f"table_bytes_rank{k}"] = float(sum(r.bytes_per_rank.get(k, 0) for r in dist.plan))
    for k, b in enumerate(dist.peak_rss_bytes):
        v.metrics[f"peak_rss_mb_rank{k}"] = b / 2**20
    v.metrics["nproc"] = float(len(dist.peak_rss_bytes))
