"""One rank of distributed training: the model wrapped in TorchRec's DistributedModelParallel, trained on
this rank's share of every epoch, evaluated and early-stopped like reco.train.loop, checkpointed with
torch.distributed.checkpoint (DCP).

Every rank builds the caller's model (its class, config and initial weights); the planner (reco.train.sharding) decides which rank
holds which table (or which rows/columns of it), DMP keeps the dense layers data-parallel. An epoch's
permutation is drawn from the same generator on every rank (as the single-process loop draws it) and cut
into `nproc` contiguous parts: no row is seen twice per epoch. The global batch stays trainer.batch_size
(each rank takes batch_size / nproc rows a step), so the optimizer takes the same number of steps per epoch
as the single-process loop. The tables take no weight decay, the dense layers trainer.weight_decay, as in
the loop. How a sharded table is updated depends on trainer.optimizer (`shard`): adagrad inside the backward
pass by FBGEMM's fused kernel (sparse updates; its CPU build takes only SGD and Adagrad), any other
optimizer (adamw) by the torch optimizer the loop uses, after the backward pass, on the tables of TorchRec's
dense kernel (plain parameters with dense gradients). Either way a table's gradient is the global batch's
mean, as in the loop: DDP averages the dense layers' gradients over the ranks, and TorchRec's all-to-all
divides the tables' by the world size.

The best epoch's weights are saved with DCP into `<checkpoint dir>/dcp-best` (written into a `.partial`
directory first and renamed when every rank has finished writing, so a crash never leaves a directory that
looks complete); `load_plain` reads them into the plain single-process model. Starting the ranks is
reco.train.launch's job.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from reco import known_warnings
from reco.config import ConfigError
from reco.data.schema import Dataset, Split
from reco.models.protocol import ArchConfig, RankingModel
from reco.train.loop import (
    OPTIMIZERS,
    EarlyStop,
    Optimizer,
    TrainConfig,
    TrainResult,
    bce_loss,
    epoch_row,
    epoch_rows,
    make_optimizer,
    val_rows,
)
from reco.train.metrics import classification_metrics
from reco.train.sharding import TablePlacement, placements, plan

BEST = "dcp-best"
# Test-only fault hook: "<rank>:<steps>" makes that rank exit (code 3) after that many training steps.
FAULT_ENV = "RECO_TEST_DIST_FAULT"
# Optimizers FBGEMM's fused CPU kernels apply to sharded tables inside the backward pass (they also take
# SGD); the others step the tables of TorchRec's dense kernel after it (`shard`).
FUSED_ON_CPU = {Optimizer.adagrad}


@dataclass
class Sharded:
    dmp: nn.Module  # DistributedModelParallel
    optimizer: torch.optim.Optimizer
    plan: list[TablePlacement]


@dataclass
class RankResult(TrainResult):
    """What rank 0 reports back to the launcher: the loop's result, and the plan and checkpoint it made."""

    plan: list[TablePlacement] = field(default_factory=list)
    checkpoint: str = ""
    val_scores: np.ndarray | None = None  # the best epoch's validation scores
    peak_rss_bytes: list[int] = field(default_factory=list)  # each rank's peak resident memory, by rank


def shard(model: RankingModel, cfg: TrainConfig, batch_size: int, sharder: Any = None) -> Sharded:
    """`model` (identical on every rank) planned and wrapped in DistributedModelParallel. Collective.

    With trainer.optimizer in FUSED_ON_CPU the tables keep the planner's fused kernel, their optimizer
    applied inside the backward pass; otherwise every table gets TorchRec's dense kernel and one optimizer,
    built as the loop builds it (`make_optimizer`), steps tables and dense layers alike.

    sharder: the EmbeddingBagCollection's sharder (default `cpu_sharder()`; bench/dmp_sharding.py passes
        TorchRec's stock one to show what it refuses).
    """
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    fused = cfg.optimizer in FUSED_ON_CPU
    if fused:
        # with the loop's eps (torch.optim.Adagrad's 1e-10; FBGEMM's own is 1e-8): a row that saw only tiny
        # gradients steps lr g / (sqrt(sum g^2) + eps), which a 100x larger eps visibly shrinks
        kind = OPTIMIZERS[cfg.optimizer]
        eps = inspect.signature(kind).parameters["eps"].default
        _apply_optimizer_in_backward(kind, model.ebc.parameters(), {"lr": cfg.lr, "eps": eps})
    sharders = [sharder or cpu_sharder()]
    world = dist.get_world_size()
    configs = model.ebc.embedding_bag_configs()  # DMP replaces model.ebc by its sharded version
    sharding_plan = plan(model, cfg.distributed, world, sharders, batch_size)  # type: ignore[arg-type]
    if not fused:
        dense_kernels(sharding_plan)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=sharding_plan, sharders=sharders)
    if fused:
        # What the fused kernel does not step: the dense layers, and any data_parallel table (its DENSE
        # kernel's weights lose the in-backward optimizer), which takes no weight decay, as in the loop.
        rest = dict(in_backward_optimizer_filter(dmp.named_parameters()))
        dense = KeyedOptimizerWrapper(rest, lambda _: make_optimizer(rest.items(), cfg))
        opt: torch.optim.Optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    else:
        # DMP names the parameters as the plain model does (`ebc.embedding_bags.<table>.weight`); a table
        # another rank holds is an empty parameter without a gradient, which the optimizer skips.
        opt = make_optimizer(dmp.named_parameters(), cfg)
    return Sharded(dmp, opt, placements(sharding_plan, configs, world))


def dense_kernels(sharding_plan: Any) -> None:
    """Give every table of the `ebc` module's plan TorchRec's dense kernel (BatchedDenseEmbeddingBag).

    The sharder cannot offer it: TorchRec's planner rejects it for any type but data_parallel ("DENSE kernel
    requires DATA_PARALLEL sharding", planners.validate_compute_kernels) although DistributedModelParallel
    builds and trains it for all seven types over gloo (same gradients, losses and weights as the
    single-process loop; experiments/distributed_training/README.md). So the plan is made with the fused
    kernel and its kernel replaced; the placement, and so the bytes per rank, stay the planner's."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    for ps in (sharding_plan.get_plan_for_module("ebc") or {}).values():
        ps.compute_kernel = EmbeddingComputeKernel.DENSE.value


@torch.no_grad()
def start_from(dmp: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy the plain model's `state` into the sharded one: DMP creates the sharded tables anew (TorchRec
    does not copy the module's weights into the shards), and every rank must start from the very model the
    single-process loop starts from. Each rank writes only its own shards."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for key, target in dmp.state_dict().items():
        if isinstance(target, ShardedTensor):
            for shard_ in target.local_shards():
                (r, c), (h, w) = shard_.metadata.shard_offsets, shard_.metadata.shard_sizes
                shard_.tensor.copy_(state[key][r : r + h, c : c + w])
        else:
            target.copy_(state[key])


def cpu_sharder() -> Any:
    """TorchRec's EmbeddingBagCollection sharder, offering on CPU the types it otherwise offers only on GPUs
    (row_wise, table_row_wise, grid_shard). They train over gloo (bench/dmp_sharding.py) as long as every
    rank steps the same batch size: their backward all-gathers the per-rank gradients and gloo's allgather
    needs equal sizes, which `_train` (equal row shares) and `predict_sharded` (padding) guarantee."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    class CpuSharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return super().sharding_types("cuda" if compute_device_type == "cpu" else compute_device_type)

    return CpuSharder()


def rank_rows(n: int, rank: int, world: int) -> slice:
    """This rank's contiguous part of n rows; the n % world last rows are left out so every rank runs the
    same number of steps (each step is a collective)."""
    per = n // world
    return slice(rank * per, (rank + 1) * per)


@torch.no_grad()
def predict_sharded(dmp: nn.Module, model: RankingModel, split: Split, batch_size: int) -> np.ndarray:
    """Click probabilities [len(split)] scored by all ranks together, every rank gets them all. Collective:
    each rank scores an equal part (the last padded with row 0's copies), gathered in rank order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = len(split)
    per = -(-n // world)
    idx = torch.arange(rank * per, (rank + 1) * per).clamp(max=n - 1)
    mine = split.take(idx)
    dmp.eval()
    out = []
    for lo in range(0, per, batch_size):
        part = mine.take(slice(lo, lo + batch_size))
        out.append(torch.sigmoid(dmp(part.dense, model.kjt(part.ids, part.lengths)).float()))
    local = torch.cat(out)
    every = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(every, local)
    return torch.cat(every)[:n].numpy()


def save_checkpoint(dmp: nn.Module, ckpt: Path) -> Path:
    """DCP of the sharded weights into ckpt/dcp-best, replacing the previous one only once complete."""
    import torch.distributed.checkpoint as dcp

    partial, final = ckpt / f"{BEST}.partial", ckpt / BEST
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    dcp.save(dmp.state_dict(), checkpoint_id=str(partial))  # DMP's keys are the plain model's
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    dist.barrier()
    return final


def load_plain(model: nn.Module, checkpoint: str | Path) -> nn.Module:
    """Load a DCP checkpoint of the sharded model into the plain single-process `model` (same keys as its
    state_dict). Runs without a process group (the launcher's process, after the ranks have exited)."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(state)
    return model


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux VmHWM; 0 elsewhere). Not getrusage's ru_maxrss, which
    Linux carries across execve: a spawned rank would report its launcher's peak. Pages of the dataset
    shared with the other ranks (torch.multiprocessing passes tensors through shared memory) count in
    every rank that touched them."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class HostInputs:
    """What every host of a training over several hosts must agree on, computed once per host by the
    launcher (host_inputs) and compared by the ranks (agree)."""

    data: str  # the dataset's fingerprint
    weights: str  # SHA-256 of the initial weights
    ckpt: str  # this host's checkpoint directory; node 0's is the one every rank writes to


def host_inputs(data: Dataset, initial: dict[str, torch.Tensor], ckpt: Path) -> HostInputs:
    weights = hashlib.sha256()
    for k in sorted(initial):
        weights.update(k.encode())
        weights.update(initial[k].contiguous().view(torch.uint8).numpy().tobytes())
    return HostInputs(data.fingerprint, weights.hexdigest()[:16], str(ckpt))


def agree(mine: HostInputs, nproc: int) -> Path:
    """Check that every rank's host built the same data and initial weights (from the same config and
    files), and return node 0's checkpoint directory, where every rank writes its shards. Collective; every
    rank raises the same ConfigError when a host differs."""
    every: list[HostInputs | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    first = every[0]
    assert first is not None
    for rank, theirs in enumerate(every):
        assert theirs is not None
        for key, what in (("data", "dataset fingerprint"), ("weights", "initial weights")):
            if getattr(theirs, key) != getattr(first, key):
                raise ConfigError(
                    f"trainer.distributed.nnodes: node {rank // nproc} (rank {rank}) has a different {what} "
                    f"({getattr(theirs, key)}) from node 0's ({getattr(first, key)}); expected every host to "
                    f"run the same command with the same code, config and data"
                )
    return Path(first.ckpt)


def _fault(rank: int) -> int | None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    who, steps = spec.split(":")
    return int(steps) if int(who) == rank else None


def train_rank(
    cls: type[RankingModel],
    arch: ArchConfig,
    initial: dict[str, torch.Tensor],
    data: Dataset,
    cfg: TrainConfig,
    ckpt_dir: str,
    host: HostInputs | None = None,
) -> RankResult | None:
    """One rank's whole run (the launcher's entry point; RANK, WORLD_SIZE, MASTER_ADDR/PORT come from the
    environment): the model `cls(arch)` with the weights `initial` (the caller's fresh model, so every
    rank starts from the model the single-process loop would). `host`: this host's HostInputs when there
    are several hosts (None: one launcher handed every rank the same objects, nothing to compare).
    Returns rank 0's result, None elsewhere."""
    known_warnings.follow_parent()  # a spawned rank: TorchRec's warnings to the entry point's file
    d = cfg.distributed
    dist.init_process_group(d.backend, timeout=timedelta(seconds=d.timeout_s))
    try:
        ckpt = Path(ckpt_dir) if host is None else agree(host, d.nproc)
        return _train(cls, arch, initial, data, cfg, ckpt)
    finally:
        dist.destroy_process_group()


def _train(
    cls: type[RankingModel],
    arch: ArchConfig,
    initial: dict[str, torch.Tensor],
    data: Dataset,
    cfg: TrainConfig,
    ckpt: Path,
) -> RankResult | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # A host's cores are shared by its ranks: trainer.threads in all, at least one each.
    torch.set_num_threads(max(1, cfg.threads // cfg.distributed.nproc))
    model = cls(arch)
    model.load_state_dict(initial)
    local_batch = cfg.batch_size // world
    sh = shard(model, cfg, local_batch)
    start_from(sh.dmp, initial)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    val = val_rows(cfg, data)
    n = epoch_rows(cfg, data)
    mine = rank_rows(n, rank, world)
    die_after = _fault(rank)
    ckpt.mkdir(parents=True, exist_ok=True)

    early, steps_done = EarlyStop(cfg.patience), 0
    best_scores: np.ndarray | None = None
    history: list[dict[str, float]] = []
    t0 = time.time()
    for epoch in range(cfg.epochs):
        sh.dmp.train()
        perm = torch.randperm(len(data.train), generator=gen)[:n][mine]
        total, count = 0.0, 0
        for lo in range(0, len(perm), local_batch):
            rows = perm[lo : lo + local_batch]
            part = data.train.take(rows)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                logits = sh.dmp(part.dense, model.kjt(part.ids, part.lengths)).float()
            loss = bce_loss(logits, part, rows)
            loss.backward()
            sh.optimizer.step()
            sh.optimizer.zero_grad()
            total += loss.item() * len(rows)
            count += len(rows)
            steps_done += 1
            if die_after is not None and steps_done >= die_after:
                os._exit(3)
        sums = torch.tensor([total, float(count)], dtype=torch.float64)
        dist.all_reduce(sums)
        scores = predict_sharded(sh.dmp, model, val, max(local_batch, 1024))
        m = classification_metrics(val.labels.numpy(), scores)
        # Every rank holds the same scores, but the stop decision must not rest on float agreement.
        auc = torch.tensor([m["auc"]], dtype=torch.float64)
        dist.broadcast(auc, 0)
        row = epoch_row(float(sums[0] / max(sums[1], 1)), m) | {"val_auc": float(auc)}
        history.append(row)
        if rank == 0 and cfg.progress:
            print(f"epoch {epoch + 1}: loss {row['train_loss']:.4f} val auc {row['val_auc']:.4f}", flush=True)
        if early.improved(epoch, row["val_auc"]):
            best_scores = scores
            save_checkpoint(sh.dmp, ckpt)
        elif early.stop:
            break
    rss: list[int] = [0] * world
    dist.all_gather_object(rss, peak_rss_bytes())
    if rank != 0:
        return None
    assert best_scores is not None
    return RankResult(
        early.best_epoch,
        early.best_auc,
        history,
        time.time() - t0,
        sh.plan,
        str(ckpt / BEST),
        best_scores,
        rss,
    )
