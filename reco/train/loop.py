"""The training loop: mini-batches of KeyedJaggedTensors, early stopping on validation AUC.

Used for the baseline, for fine-tuning after pruning and for distillation (which passes its own loss).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np
import torch
from omegaconf import MISSING
from torch import nn
from tqdm import tqdm

from reco.config import ConfigError
from reco.data.schema import Dataset, Split
from reco.models.protocol import PlainScorer, RankingModel
from reco.train.metrics import classification_metrics
from reco.train.sharding import DistributedConfig


class Optimizer(Enum):
    adamw = "adamw"
    adagrad = "adagrad"


# loss(logits [B], rows of the batch, their row indices into the train split) -> scalar
LossFn = Callable[[torch.Tensor, Split, torch.Tensor], torch.Tensor]


@dataclass
class TrainConfig:
    """The `trainer` config group (conf/trainer/default.yaml); steps that train derive their budget from it."""

    epochs: int = MISSING
    batch_size: int = MISSING
    lr: float = MISSING
    optimizer: Optimizer = MISSING
    weight_decay: float = MISSING
    patience: int = MISSING  # epochs without val AUC gain before stopping
    # An epoch that ends training unless it improves is validated after this fraction of its rows as well,
    # and training stops there when val AUC is already stop_check_margin below the best (None: at epoch
    # ends only). The single-process loop's: the distributed one says so and trains such an epoch to its
    # end, which keeps the same weights (reco.train.launch.train_distributed).
    stop_check_fraction: float | None = MISSING
    stop_check_margin: float = MISSING
    bf16: bool = MISSING  # autocast the forward in bfloat16
    grad_accum: int = MISSING
    seed: int = MISSING
    threads: int = MISSING
    max_rows_per_epoch: int | None = MISSING  # None: the whole train split
    eval_rows: int | None = MISSING  # validation rows scored after each epoch (None: all)
    checkpoint_dir: str | None = MISSING  # best and last state_dicts are written here
    progress: bool = MISSING
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # nproc 1: this loop

    def check(self, where: str) -> None:
        f = self.stop_check_fraction
        if f is not None and not 0 < f < 1:
            raise ConfigError(f"{where}.stop_check_fraction: expected null or 0 < fraction < 1, got {f}")
        if self.stop_check_margin < 0:
            raise ConfigError(f"{where}.stop_check_margin: expected >= 0 (AUC), got {self.stop_check_margin}")
        d = self.distributed
        if d.world == 1:
            return
        # Every trainer.optimizer trains sharded tables (reco.train.distributed.shard: adagrad in FBGEMM's
        # fused kernel inside the backward pass, adamw on TorchRec's dense kernel after it); the
        # distributed loop steps the optimizer after every batch and does not accumulate gradients.
        if self.grad_accum != 1:
            raise ConfigError(
                f"{where}.grad_accum: expected 1 with {d.setting(where + '.distributed')} (the distributed "
                f"loop steps the optimizer after every batch; with adagrad the tables' optimizer steps inside "
                f"every backward pass), got {self.grad_accum}"
            )


@dataclass
class TrainResult:
    best_epoch: int
    best_val_auc: float
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


def bce_loss(logits: torch.Tensor, part: Split, rows: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, part.labels)


@torch.no_grad()
def predict_torch(model: RankingModel, split: Split, batch_size: int = 8192) -> np.ndarray:
    model.eval()
    scorer = PlainScorer(model)
    out = [
        scorer(p.dense, p.ids, p.mask()).numpy()
        for p in (split.take(slice(i, i + batch_size)) for i in range(0, len(split), batch_size))
    ]
    return np.concatenate(out)


OPTIMIZERS: dict[Optimizer, type[torch.optim.Optimizer]] = {
    Optimizer.adamw: torch.optim.AdamW,
    Optimizer.adagrad: torch.optim.Adagrad,
}


def make_optimizer(named: Iterable[tuple[str, nn.Parameter]], cfg: TrainConfig) -> torch.optim.Optimizer:
    """Over a model's (name, parameter) pairs: the embedding tables (`ebc.*`) without weight decay, the
    dense layers with trainer.weight_decay."""
    named = list(named)
    emb = [p for n, p in named if n.startswith("ebc.")]
    dense = [p for n, p in named if not n.startswith("ebc.")]
    groups = [{"params": emb, "weight_decay": 0.0}, {"params": dense, "weight_decay": cfg.weight_decay}]
    return OPTIMIZERS[cfg.optimizer](groups, lr=cfg.lr)


def epoch_rows(cfg: TrainConfig, data: Dataset) -> int:
    """Train rows an epoch draws (trainer.max_rows_per_epoch, else the whole split)."""
    n = len(data.train)
    return n if cfg.max_rows_per_epoch is None else min(n, cfg.max_rows_per_epoch)


def step_budget(trainer: TrainConfig, **settings: object) -> TrainConfig:
    """A step's own training (distillation, fine-tuning after pruning) on the trainer's settings with
    `settings` changed: no checkpoints, and validated at epoch ends only (trainer.stop_check_fraction was
    measured on the baseline, whose next epoch only memorises; the distilled student is best after its
    second: conf/step/distill.yaml)."""
    return dataclasses.replace(trainer, checkpoint_dir=None, stop_check_fraction=None, **settings)


def val_metrics(model: RankingModel, val: Split) -> dict[str, float]:
    """The model's classification metrics on the validation rows (val_rows), as early stopping reads them."""
    return classification_metrics(val.labels.numpy(), predict_torch(model, val))


def check_rows(cfg: TrainConfig, n: int) -> int:
    """Rows before an epoch's early check (trainer.stop_check_fraction of n, whole optimizer steps, so
    that an epoch the check lets go on takes the very steps it would have taken unchecked); n: none."""
    if cfg.stop_check_fraction is None:
        return n
    step = cfg.batch_size * cfg.grad_accum
    return min(n, math.ceil(cfg.stop_check_fraction * n / step) * step)


def val_rows(cfg: TrainConfig, data: Dataset) -> Split:
    """The validation rows scored after each epoch (trainer.eval_rows, else all)."""
    return data.val if cfg.eval_rows is None else data.val.take(slice(0, cfg.eval_rows))


def epoch_row(train_loss: float, val_metrics: dict[str, float]) -> dict[str, float]:
    """One epoch of the learning curve: {"train_loss", "val_auc", "val_logloss", ...}."""
    return {"train_loss": train_loss, **{f"val_{k}": v for k, v in val_metrics.items()}}


@dataclass
class EarlyStop:
    """Early stopping on validation AUC: the best epoch so far, and whether trainer.patience epochs
    without a gain have passed."""

    patience: int
    best_auc: float = -1.0
    best_epoch: int = -1
    stale: int = 0

    def improved(self, epoch: int, auc: float) -> bool:
        """Record epoch's AUC; True when it is the best so far."""
        if auc > self.best_auc:
            self.best_auc, self.best_epoch, self.stale = auc, epoch, 0
            return True
        self.stale += 1
        return False

    @property
    def stop(self) -> bool:
        return self.stale > self.patience


def _epoch(
    model: RankingModel,
    data: Dataset,
    rows_order: torch.Tensor,
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    loss_fn: LossFn,
    desc: str,
) -> float:
    """One pass over `rows_order` (training rows, in order) with gradient accumulation; the mean loss."""
    n = len(rows_order)
    bar = tqdm(
        range(0, n, cfg.batch_size),
        desc=desc,
        disable=not cfg.progress,
        leave=False,
        mininterval=0.2 if sys.stderr.isatty() else 15,  # a log file gets a line every 15 s, not every step
    )
    total, count = 0.0, 0
    opt.zero_grad(set_to_none=True)
    for i, lo in enumerate(bar):
        rows = rows_order[lo : lo + cfg.batch_size]
        part = data.train.take(rows)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = model(part.dense, model.kjt(part.ids, part.lengths)).float()
        loss = loss_fn(logits, part, rows)
        (loss / cfg.grad_accum).backward()
        if (i + 1) % cfg.grad_accum == 0 or lo + cfg.batch_size >= n:
            opt.step()
            opt.zero_grad(set_to_none=True)
        total += loss.item() * len(rows)
        count += len(rows)
        if i % 20 == 0:
            bar.set_postfix(loss=f"{total / count:.4f}")
    return total / max(count, 1)


def _checked_epoch(
    model: RankingModel,
    data: Dataset,
    perm: torch.Tensor,
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    loss_fn: LossFn,
    what: str,
    val: Split,
    best: float | None,
) -> tuple[float, dict[str, float] | None]:
    """One epoch over `perm`: (its mean loss, None). With `best` (the best val AUC, for an epoch whose lack of
    gain ends training) validated after check_rows as well: there, val AUC more than stop_check_margin
    below it ends the epoch, (the loss so far, the curve's row for it with its `epoch_fraction`)."""
    n = len(perm)
    k = n if best is None else check_rows(cfg, n)
    loss = _epoch(model, data, perm[:k], opt, cfg, loss_fn, what)
    if k == n:
        return loss, None
    m = val_metrics(model, val)
    if m["auc"] < best - cfg.stop_check_margin:
        return loss, epoch_row(loss, m) | {"epoch_fraction": k / n}
    model.train()
    return (loss * k + _epoch(model, data, perm[k:], opt, cfg, loss_fn, what) * (n - k)) / n, None


def train(
    model: RankingModel,
    data: Dataset,
    cfg: TrainConfig,
    loss_fn: LossFn = bce_loss,
    on_epoch: Callable[[int, dict[str, float]], None] | None = None,
    desc: str = "train",
) -> TrainResult:
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = make_optimizer(model.named_parameters(), cfg)
    val = val_rows(cfg, data)
    n = epoch_rows(cfg, data)
    ckpt = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if ckpt:
        ckpt.mkdir(parents=True, exist_ok=True)

    early, best_state = EarlyStop(cfg.patience), None
    history: list[dict[str, float]] = []

    def record(epoch: int, row: dict[str, float], note: str = "") -> None:
        history.append(row)
        if on_epoch:
            on_epoch(epoch, row)
        if cfg.progress:
            auc = row["val_auc"]
            print(
                f"{desc} epoch {epoch + 1}: loss {row['train_loss']:.4f} val auc {auc:.4f}{note}", flush=True
            )

    t0 = time.time()
    for epoch in range(cfg.epochs):
        model.train()
        perm = torch.randperm(len(data.train), generator=gen)[:n]
        what = f"{desc} epoch {epoch + 1}/{cfg.epochs}"
        last = early.best_epoch >= 0 and early.stale >= cfg.patience  # no gain here ends training
        loss, cut = _checked_epoch(
            model, data, perm, opt, cfg, loss_fn, what, val, early.best_auc if last else None
        )
        if cut is not None:
            early.improved(epoch, cut["val_auc"])
            share = cut["epoch_fraction"]
            record(
                epoch, cut, f" after {share:.1%} of its rows: below the best {early.best_auc:.4f}, stopped"
            )
            break
        m = val_metrics(model, val)
        record(epoch, epoch_row(loss, m))
        if ckpt:
            torch.save(model.state_dict(), ckpt / "last.pt")
        if early.improved(epoch, m["auc"]):
            best_state = copy.deepcopy(model.state_dict())
            if ckpt:
                torch.save(best_state, ckpt / "best.pt")
        elif early.stop:
            break
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return TrainResult(early.best_epoch, early.best_auc, history, time.time() - t0)
