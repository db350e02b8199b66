"""Distributed training from the calling process: check the settings, start `trainer.distributed.nproc`
ranks (torch.distributed's elastic_launch: no torchrun needed), turn a failed rank into one clear error,
and load the result into the plain single-process model.

elastic_launch rather than torch.multiprocessing.spawn: its agent polls the ranks (every 0.5 s here) and,
as soon as one exits non-zero, stops the others (SIGTERM, then SIGKILL) and raises with every rank's exit
code and traceback; with spawn a rank blocked in a collective would wait for gloo's timeout before its
peers' failure surfaced. On one host the rendezvous is a c10d store on an ephemeral port of
trainer.distributed's master_addr, hosted by this process. Over several hosts (nnodes > 1) every host runs
the same command with its own node_rank and this function starts that host's nproc ranks; the rendezvous
is torchrun's static one (`torchrun --nnodes --node-rank --master-addr --master-port`): node 0 hosts the
store on master_addr:master_port, and rank = node_rank * nproc + local rank, so rank 0 (whose result the
pipeline goes on with) is always on node 0.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reco.config import ConfigError, typed
from reco.data.schema import Dataset
from reco.models.protocol import RankingModel
from reco.train.distributed import RankResult, host_inputs, load_plain, train_rank
from reco.train.loop import TrainConfig, TrainResult
from reco.train.sharding import DistributedConfig, TablePlacement, constraints, format_plan


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

    The global batch stays trainer.batch_size, each rank taking batch_size / ranks rows a step; each rank
    must get at least one such share per epoch, so an epoch needs at least batch_size rows.
    """
    d = cfg.distributed
    world, what = d.world, d.setting()
    if cfg.batch_size % world:
        raise ConfigError(
            f"{what}: trainer.batch_size={cfg.batch_size} must be a multiple of the {world} ranks "
            f"(each rank takes batch_size / ranks rows per step)"
        )
    n = train_rows if cfg.max_rows_per_epoch is None else min(train_rows, cfg.max_rows_per_epoch)
    if n < cfg.batch_size:
        raise ConfigError(
            f"{what}: an epoch has {n} train rows, fewer than one batch "
            f"(trainer.batch_size={cfg.batch_size}), so a rank would get less than its share of "
            f"{cfg.batch_size // world} rows; expected at most {max(1, n * world // cfg.batch_size)} ranks "
            f"or a smaller trainer.batch_size"
        )


def launch_config(d: DistributedConfig) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    if d.nnodes == 1:
        rdzv: dict[str, Any] = dict(
            run_id=f"reco-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d", rdzv_endpoint=f"{d.master_addr}:0"
        )
    else:  # every host must name the same run: its id is the store's key prefix
        rdzv = dict(
            run_id=f"reco-{d.master_port}",
            rdzv_backend="static",
            rdzv_endpoint=f"{d.master_addr}:{d.master_port}",
            rdzv_configs={"rank": d.node_rank, "timeout": d.join_timeout_s},
        )
    return LaunchConfig(
        min_nodes=d.nnodes,
        max_nodes=d.nnodes,
        nproc_per_node=d.nproc,
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
        **rdzv,
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
) -> DistributedResult | None:
    """Train `model` over trainer.distributed's ranks (nproc on each of nnodes hosts; this host's
    share) and load the best epoch's weights into it.

    Args:
        model: a fresh plain model; every rank rebuilds it (class, config, weights) and starts from it.
            Every host must pass the same model and `data` (the ranks check, reco.train.distributed).
        checkpoint_dir: where the DCP checkpoint is written (`dcp-best`; `dcp-best.partial` while writing);
            node 0's: the ranks of every host write their shards there, so with nnodes > 1 it must be a
            directory every host sees at that path.
    Returns:
        On node 0, the learning curve (as reco.train.loop.train returns it), the sharding plan and the
        checkpoint; on the other hosts None (their model is left as it was).
    Raises:
        ConfigError naming the trainer.distributed key for settings that cannot run;
        DistributedTrainingError when a rank fails (the others are stopped first).
    """
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    typed(cfg, TrainConfig, "trainer")  # its checks, for a config built in code
    if cfg.stop_check_fraction is not None:  # it saves time only: the epoch it would cut is not kept
        print(
            f"[train] trainer.stop_check_fraction={cfg.stop_check_fraction}: the distributed loop validates at "
            "epoch ends only, so an epoch that falls is trained to its end (the weights kept are the same)",
            flush=True,
        )
        cfg = dataclasses.replace(cfg, stop_check_fraction=None)
    d = cfg.distributed
    check_feedable(cfg, len(data.train))
    # A table no allowed type can place under the limit fails here, before any process starts.
    constraints(model.ebc.embedding_bag_configs(), d, d.world)
    ckpt = Path(checkpoint_dir)
    if d.node_rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    host = host_inputs(data, initial, ckpt) if d.nnodes > 1 else None  # hashed once per host, not per rank
    try:
        out = elastic_launch(launch_config(d), train_rank)(
            type(model), model.cfg, initial, data, cfg, str(ckpt), host
        )
    except ChildFailedError as e:
        if msg := config_error_in(e):
            raise ConfigError(msg) from None
        complete = ckpt / "dcp-best"
        left = (
            f"the last complete checkpoint is {complete}" if complete.exists() else "no complete checkpoint"
        )
        others = "this host's other ranks were stopped" if d.nnodes > 1 else "the other ranks were stopped"
        raise DistributedTrainingError(
            f"distributed training ({d.setting()}) failed: {failure_message(e)}; {others}; {left}"
        ) from None
    except (RendezvousError, DistError) as e:  # nnodes > 1: a host did not come, or not in time
        raise DistributedTrainingError(
            f"distributed training ({d.setting()}): node {d.node_rank} waited "
            f"trainer.distributed.join_timeout_s={d.join_timeout_s} s at {d.master_addr}:{d.master_port} "
            f"and not every host came ({str(e).splitlines()[0]}); expected the same command on every host, "
            f"each with its own node_rank, and node 0 reachable at master_addr"
        ) from None
    if d.node_rank > 0:
        return None
    r: RankResult = out[0]
    load_plain(model, r.checkpoint)
    model.eval()
    if cfg.progress:
        print(f"sharding plan ({d.world} ranks, {d.backend}):\n{format_plan(r.plan)}", flush=True)
    return DistributedResult(
        TrainResult(r.best_epoch, r.best_val_auc, r.history, r.seconds),
        r.plan,
        r.checkpoint,
        r.val_scores,
        r.peak_rss_bytes,
    )
