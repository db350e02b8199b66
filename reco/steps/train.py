"""The `train` step: a fresh TorchRec DLRM trained on the dataset -> the baseline Variant (a root)."""

from __future__ import annotations

from reco.data.schema import Dataset
from reco.models.dlrm import DLRM, DLRMConfig, ModelConfig
from reco.steps.registry import StepRun, child_variant, register
from reco.train.loop import train
from reco.variant import Variant


@register("train", ModelConfig, config_key="model", root=True, trains=True)
def run(parent: Variant | None, data: Dataset, cfg: ModelConfig, ctx: StepRun) -> Variant:
    """Train the model `cfg` describes on `data` (early stopping on validation AUC, per ctx.trainer).

    Returns:
        The baseline variant: torch weights, learning curve metrics (best_epoch, best_val_auc).
    """
    try:
        model_cfg = DLRMConfig.from_schema(data.schema, cfg.embedding_dim, cfg.bottom, cfg.top)
    except ValueError as e:
        raise ValueError(f"train: {e}") from None
    model = DLRM(model_cfg)
    result = train(model, data, ctx.trainer, on_epoch=ctx.on_epoch, desc=ctx.name)
    v = child_variant(None, data, cfg, ctx, "train", "torch")
    v.save_torch(model)
    v.metrics.update(
        best_epoch=float(result.best_epoch), best_val_auc=result.best_val_auc, train_seconds=result.seconds
    )
    return v
