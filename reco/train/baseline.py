"""The `train` step: a fresh TorchRec DLRM trained on the dataset -> the baseline Variant."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from reco.data.schema import Dataset
from reco.models.dlrm import DLRM, DLRMConfig
from reco.train.loop import TrainConfig, train
from reco.variant import Variant


def run(
    data: Dataset,
    model_cfg: dict,
    out_dir: Path,
    trainer: TrainConfig,
    name: str = "baseline",
    on_epoch: Callable[[int, dict[str, float]], None] | None = None,
) -> Variant:
    cfg = DLRMConfig.from_schema(
        data.schema, model_cfg["embedding_dim"], model_cfg["bottom"], model_cfg["top"]
    )
    model = DLRM(cfg)
    result = train(model, data, trainer, on_epoch=on_epoch, desc=name)
    v = Variant(
        name=name, step="train", parent=None, backend="torch", model_config=cfg.to_dict(), dir=str(out_dir)
    )
    v.step_config = dict(model_cfg)
    v.save_torch(model)
    v.metrics.update(
        best_epoch=float(result.best_epoch), best_val_auc=result.best_val_auc, train_seconds=result.seconds
    )
    v.save()
    return v
