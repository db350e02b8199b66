"""Distributed training from the calling process: check the settings, start `trainer.distributed.nproc`
ranks (torch.distributed's elastic_launch: no torchrun needed), turn a failed rank into one clear error,
and load the result into the plain single-process model.

elastic_launch rather than torch.multiprocessing.spawn: its agent polls the ranks (every 0.5 s here) and,
as soon as one exits non-zero, stops the others (SIGTERM, then SIGKILL) and raises with every rank's exit
code and traceback; with spawn a rank blocked in a collective would wait for gloo's timeout before its
peers' failure surfaced. The rendezvous is a c10d store on an ephemeral port of trainer.distributed's
master_addr, hosted by this process.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reco.config import ConfigError, typed
from reco.data.schema import Dataset
from reco.models.protocol import RankingModel
from reco.train.distributed import RankResult, load_plain, train_rank
from reco.train.loop import TrainConfig, TrainResult
from reco.train.sharding import TablePlacement, constraints, format_plan


class DistributedTrainingError(RuntimeError):
    """A rank failed; the message names the rank, its exit code or error, and what was left on disk."""


@dataclass
class DistributedResult:
    train: TrainResult
    plan: list[TablePlacement] = field(default_factory=list)
    checkpoint: str = ""
    val_scores: np.ndarray | None = None  # the sharded model's validation scores at its best epoch
    peak_rss_bytes: list[int] = field(default_factory=list)  # each rank's peak resident memory


def check_feedable(cfg: TrainConfig, train_rows: int) -> None:
    """Raise ConfigError (naming trainer.distributed.nproc) unless every rank gets a full share of a batch.

    The global batch stays trainer.batch_size, each rank taking batch_size / nproc rows a step; each rank
    must get at least one such share per epoch, so an epoch needs at least batch_size rows.
    """
    nproc = cfg.distributed.nproc
    if cfg.batch_size % nproc:
        raise ConfigError(
            f"trainer.distributed.nproc={nproc}: trainer.batch_size={cfg.batch_size} must be a multiple of it "
            f"(each rank takes batch_size / nproc rows per step)"
        )
    n = train_rows if cfg.max_rows_per_epoch is None else min(train_rows, cfg.max_rows_per_epoch)
    if n < cfg.batch_size:
        raise ConfigError(
            f"trainer.distributed.nproc={nproc}: an epoch has {n} train rows, fewer than one batch "
            f"(trainer.batch_size={cfg.batch_size}), so a rank would get less than its share of "
            f"{cfg.batch_size // nproc} rows; expected nproc <= {max(1, n * nproc // cfg.batch_size)} "
            f"or a smaller trainer.batch_size"
        )


def launch_config(nproc: int, master_addr: str) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"reco-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{master_addr}:0",
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
    )


def failure_message(err: Any) -> str:
    """One line per failed rank of a ChildFailedError: its exit code and the last line of its traceback."""
    lines = []
    for rank, f in sorted(err.failures.items()):
        text = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message or "")
        last = text.strip().splitlines()[-1] if text.strip() else ""
        if not last or last.startswith("To enable traceback"):
            last = "no Python error: the process exited (killed, or os._exit)"
        lines.append(f"rank {rank} (pid {f.pid}) exited with code {f.exitcode}: {last}")
    return "; ".join(lines)


def config_error_in(err: Any) -> str | None:
    """A rank's ConfigError (the sharding plan breaking max_bytes_per_rank) as its message, else None."""
    for f in err.failures.values():
        text = f.message.get("message", "") if isinstance(f.message, dict) else ""
        for line in reversed(text.strip().splitlines()):
            if m := re.match(r"(?:reco\.config\.)?ConfigError: (.*)", line):
                return m.group(1)
    return None


def train_distributed(
    model: RankingModel, data: Dataset, cfg: TrainConfig, checkpoint_dir: str | Path
) -> DistributedResult:
    """Train `model` over trainer.distributed.nproc ranks and load the best epoch's weights into it.

    Args:
        model: a fresh plain model; every rank rebuilds it (class, config, weights) and starts from it.
        checkpoint_dir: where the DCP checkpoint is written (`dcp-best`; `dcp-best.partial` while writing).
    Returns:
        The learning curve (as reco.train.loop.train returns it), the sharding plan and the checkpoint.
    Raises:
        ConfigError naming the trainer.distributed key for settings that cannot run;
        DistributedTrainingError when a rank fails (the others are stopped first).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    typed(cfg, TrainConfig, "trainer")  # its checks, for a config built in code
    d = cfg.distributed
    check_feedable(cfg, len(data.train))
    # A table no allowed type can place under the limit fails here, before any process starts.
    constraints(model.ebc.embedding_bag_configs(), d, d.nproc)
    ckpt = Path(checkpoint_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    try:
        out = elastic_launch(launch_config(d.nproc, d.master_addr), train_rank)(
            type(model),
            model.cfg,
            {k: v.clone() for k, v in model.state_dict().items()},
            data,
            cfg,
            str(ckpt),
        )
    except ChildFailedError as e:
        if msg := config_error_in(e):
            raise ConfigError(msg) from None
        complete = ckpt / "dcp-best"
        left = (
            f"the last complete checkpoint is {complete}" if complete.exists() else "no complete checkpoint"
        )
        raise DistributedTrainingError(
            f"distributed training (trainer.distributed.nproc={d.nproc}) failed: {failure_message(e)}; "
            f"the other ranks were stopped; {left}"
        ) from None
    r: RankResult = out[0]
    load_plain(model, r.checkpoint)
    model.eval()
    if cfg.progress:
        print(f"sharding plan ({d.nproc} ranks, {d.backend}):\n{format_plan(r.plan)}", flush=True)
    return DistributedResult(
        TrainResult(r.best_epoch, r.best_val_auc, r.history, r.seconds),
        r.plan,
        r.checkpoint,
        r.val_scores,
        r.peak_rss_bytes,
    )
