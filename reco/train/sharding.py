"""How the embedding tables are split over ranks: the `trainer.distributed` settings, TorchRec's planner
constrained by them, and the plan as a table a user can read (table, sharding type, ranks, bytes per rank).

Bytes are the table's weights (rows x embedding_dim x 4 for fp32) held by each rank; the optimizer's
state (Adagrad: one more tensor of the same shape; AdamW on the dense kernel: two, and a dense gradient)
comes on top and is not counted, so the number is the one a user can compute from the schema.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import MISSING

from reco.config import ConfigError

if TYPE_CHECKING:
    from torch import nn
    from torchrec.distributed.types import ShardingPlan


class ShardingType(Enum):
    """TorchRec's sharding types (torchrec.distributed.types.ShardingType values)."""

    data_parallel = "data_parallel"
    table_wise = "table_wise"
    column_wise = "column_wise"
    table_column_wise = "table_column_wise"
    row_wise = "row_wise"
    table_row_wise = "table_row_wise"
    grid_shard = "grid_shard"


# What trains on CPU over gloo with torch 2.13 / torchrec 1.8.0 when every rank steps the same batch size
# (bench/dmp_sharding.py, experiments/distributed_training/README.md). TorchRec's sharder offers the last
# three only on GPUs; reco.train.distributed's sharder offers them on CPU too.
WORKS_ON = {"gloo": list(ShardingType)}
# Types that split one table over several ranks (the others hold a whole table per rank).
SPLITTING = {
    ShardingType.column_wise,
    ShardingType.table_column_wise,
    ShardingType.row_wise,
    ShardingType.table_row_wise,
    ShardingType.grid_shard,
}


@dataclass
class DistributedConfig:
    """`trainer.distributed` (conf/trainer/default.yaml): training over processes with TorchRec's
    DistributedModelParallel. nproc 1 is the single-process loop (reco.train.loop), untouched."""

    nproc: int = MISSING  # worker processes on this machine; 1 (with nnodes 1): no torch.distributed at all
    backend: str = MISSING  # torch.distributed backend; gloo (CPU) is the one measured
    sharding_types: list[ShardingType] = MISSING  # the planner may choose among these for every table
    max_bytes_per_rank: int | None = MISSING  # embedding weight bytes one rank may hold (None: no limit)
    timeout_s: int = MISSING  # a collective waiting longer (a dead peer) fails the job
    master_addr: str = MISSING  # rendezvous address: this machine, or node 0's when nnodes > 1
    nnodes: int = MISSING  # hosts, each running the same command with its own node_rank
    node_rank: int = MISSING  # this host's index; node 0 hosts the rendezvous and goes on with the pipeline
    master_port: int = MISSING  # node 0's rendezvous port when nnodes > 1 (one host takes a free port)
    join_timeout_s: int = MISSING  # how long a host waits for the others to arrive at the rendezvous

    @property
    def world(self) -> int:
        """Ranks over all hosts."""
        return self.nproc * self.nnodes

    def setting(self, where: str = "trainer.distributed") -> str:
        """The settings that make the ranks, as a user writes them (for messages)."""
        return f"{where}.nproc={self.nproc}" + (f" nnodes={self.nnodes}" if self.nnodes > 1 else "")

    def check(self, where: str) -> None:
        if self.nproc < 1:
            raise ConfigError(f"{where}.nproc: expected >= 1 worker processes, got {self.nproc}")
        if self.nnodes < 1:
            raise ConfigError(f"{where}.nnodes: expected >= 1 hosts, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"{where}.node_rank: expected 0 <= node_rank < nnodes={self.nnodes}, got {self.node_rank}"
            )
        if self.nnodes > 1 and not 0 < self.master_port < 65536:
            raise ConfigError(
                f"{where}.master_port: expected node 0's rendezvous port (1-65535) with nnodes={self.nnodes}, "
                f"got {self.master_port}"
            )
        if self.join_timeout_s <= 0:
            raise ConfigError(f"{where}.join_timeout_s: expected a positive number of seconds")
        works = WORKS_ON.get(self.backend)
        if works is None:
            raise ConfigError(f"{where}.backend: expected one of {sorted(WORKS_ON)}, got {self.backend!r}")
        if not self.sharding_types:
            raise ConfigError(f"{where}.sharding_types: expected at least one of {[t.value for t in works]}")
        if bad := [t.value for t in self.sharding_types if t not in works]:
            raise ConfigError(
                f"{where}.sharding_types: {bad} do not train with backend {self.backend!r} on CPU "
                f"(experiments/distributed_training/README.md); expected a subset of {[t.value for t in works]}"
            )
        if self.max_bytes_per_rank is not None and self.max_bytes_per_rank <= 0:
            raise ConfigError(f"{where}.max_bytes_per_rank: expected a positive byte count or null")
        if self.timeout_s <= 0:
            raise ConfigError(f"{where}.timeout_s: expected a positive number of seconds")


@dataclass
class TablePlacement:
    """One row of the readable plan."""

    table: str
    sharding_type: str
    compute_kernel: str
    ranks: list[int]
    bytes: int  # the whole table's weights
    bytes_per_rank: dict[int, int] = field(default_factory=dict)


def table_bytes(configs: list[Any]) -> dict[str, int]:
    """{table name: weight bytes} of TorchRec EmbeddingBagConfigs."""
    return {c.name: c.num_embeddings * c.embedding_dim * _dtype_bytes(c.data_type) for c in configs}


def _dtype_bytes(data_type: Any) -> int:
    from torchrec.modules.embedding_configs import data_type_to_dtype

    return torch.empty((), dtype=data_type_to_dtype(data_type)).element_size()


def constraints(
    configs: list[Any], cfg: DistributedConfig, world: int, split_all: bool = False
) -> dict[str, Any]:
    """Per-table ParameterConstraints: the allowed types; a table larger than max_bytes_per_rank (every
    table with `split_all`) may only take the allowed types that split it, since the planner does not know
    the limit and may place a table whole on one rank.

    Raises:
        ConfigError naming the table, its bytes and trainer.distributed.max_bytes_per_rank when no allowed
        type can place it under the limit.
    """
    from torchrec.distributed.planner.types import ParameterConstraints

    allowed = list(cfg.sharding_types)
    out = {}
    for name, size in table_bytes(configs).items():
        types = allowed
        limit = cfg.max_bytes_per_rank
        if split_all and (split := [t for t in allowed if t in SPLITTING]):
            types = split
        if limit is not None and size > limit:
            types = [t for t in allowed if t in SPLITTING]
            smallest = math.ceil(size / world)
            if not types or smallest > limit:
                how = (
                    f"split over {world} ranks it still needs {smallest:,} bytes per rank"
                    if types
                    else f"none of the allowed sharding types {[t.value for t in allowed]} splits a table "
                    f"({sorted(t.value for t in SPLITTING)} do)"
                )
                raise ConfigError(
                    f"trainer.distributed.max_bytes_per_rank: table {name!r} holds {size:,} bytes of weights, "
                    f"over the limit of {limit:,} bytes per rank; {how}"
                )
        out[name] = ParameterConstraints(sharding_types=[t.value for t in types])
    return out


def plan(
    model: nn.Module, cfg: DistributedConfig, world: int, sharders: list, batch_size: int
) -> ShardingPlan:
    """TorchRec's EmbeddingShardingPlanner on every rank at once (rank 0 plans, the others receive it).

    Raises:
        ConfigError (max_bytes_per_rank) when a table or a rank's tables exceed the limit.
    """
    import torch.distributed as dist
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    configs = model.ebc.embedding_bag_configs()

    def planned(split_all: bool) -> ShardingPlan:
        planner = EmbeddingShardingPlanner(
            # local_world_size: the ranks of one host, which table_row_wise keeps a table within
            topology=Topology(world_size=world, local_world_size=cfg.nproc, compute_device="cpu"),
            batch_size=batch_size,
            constraints=constraints(configs, cfg, world, split_all),
            debug=False,
        )
        return planner.collective_plan(model, sharders, dist.GroupMember.WORLD)

    out = planned(split_all=False)
    try:
        check_limit(placements(out, configs, world), cfg.max_bytes_per_rank)
    except ConfigError:
        if not SPLITTING & set(cfg.sharding_types):
            raise
        # The planner balances its own cost model, not the limit: splitting every table over every rank
        # gives each rank the smallest share it can get. Every rank reaches this branch (same plan).
        out = planned(split_all=True)
        check_limit(placements(out, configs, world), cfg.max_bytes_per_rank)
    return out


def placements(sharding_plan: ShardingPlan, configs: list[Any], world: int) -> list[TablePlacement]:
    """The plan of the `ebc` module (tables `configs`) as one row per table: which ranks hold it and how
    many weight bytes each."""
    sizes = table_bytes(configs)
    dims = {c.name: c for c in configs}
    module_plan = sharding_plan.get_plan_for_module("ebc") or {}
    rows = []
    for name, ps in module_plan.items():
        per_rank: dict[int, int] = {}
        if ps.sharding_spec is not None:
            elem = sizes[name] // (dims[name].num_embeddings * dims[name].embedding_dim)
            for shard in ps.sharding_spec.shards:
                rank = shard.placement.rank()
                per_rank[rank] = per_rank.get(rank, 0) + math.prod(shard.shard_sizes) * elem
        else:  # data_parallel: a whole replica on every rank
            per_rank = dict.fromkeys(range(world), sizes[name])
        rows.append(
            TablePlacement(name, ps.sharding_type, ps.compute_kernel, sorted(per_rank), sizes[name], per_rank)
        )
    return rows


def check_limit(rows: list[TablePlacement], limit: int | None) -> None:
    if limit is None:
        return
    for r in rows:
        for rank, b in r.bytes_per_rank.items():
            if b > limit:
                raise ConfigError(
                    f"trainer.distributed.max_bytes_per_rank: table {r.table!r} ({r.bytes:,} bytes) puts "
                    f"{b:,} bytes on rank {rank} ({r.sharding_type}), over the limit of {limit:,} bytes"
                )
    totals: dict[int, int] = {}
    for r in rows:
        for rank, b in r.bytes_per_rank.items():
            totals[rank] = totals.get(rank, 0) + b
    for rank, total in sorted(totals.items()):
        if total > limit:
            names = [r.table for r in rows if rank in r.bytes_per_rank]
            raise ConfigError(
                f"trainer.distributed.max_bytes_per_rank: rank {rank} holds {total:,} bytes of tables {names}, "
                f"over the limit of {limit:,} bytes (each table fits alone; allow a splitting sharding type, "
                f"more processes or a higher limit)"
            )


def format_plan(rows: list[TablePlacement]) -> str:
    """The plan as a fixed-width table, one line per table, and the bytes each rank holds."""
    ranks = sorted({k for r in rows for k in r.bytes_per_rank})
    head = f"{'table':<20} {'sharding type':<18} {'kernel':<8} {'bytes':>12} " + " ".join(
        f"{'rank ' + str(k):>12}" for k in ranks
    )
    lines = [head]
    for r in rows:
        cells = " ".join(f"{r.bytes_per_rank.get(k, 0):>12,}" for k in ranks)
        lines.append(f"{r.table:<20} {r.sharding_type:<18} {r.compute_kernel:<8} {r.bytes:>12,} {cells}")
    totals = " ".join(f"{sum(r.bytes_per_rank.get(k, 0) for r in rows):>12,}" for k in ranks)
    lines.append(f"{'total':<20} {'':<18} {'':<8} {sum(r.bytes for r in rows):>12,} {totals}")
    return "\n".join(lines)
