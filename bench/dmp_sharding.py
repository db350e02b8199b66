"""Which TorchRec sharding types train on CPU over gloo: DistributedModelParallel of reco's DLRM on N ranks.

    python -m bench.dmp_sharding                                  # all 7 types, 2 ranks, 20 steps
    python -m bench.dmp_sharding --types row_wise --steps 5       # one type
    python -m bench.dmp_sharding --stock-sharder                  # TorchRec's own sharder (no row_wise on CPU)
    python -m bench.dmp_sharding --uneven --types row_wise        # rank 1 steps half rank 0's batch
    python -m bench.dmp_sharding --optimizer adamw                # AdamW: the tables on the dense kernel

For each sharding type every table of a small DLRM (reco.data.synthetic with 6,000 rows, the default
feature layout, embedding_dim 64) is constrained to that type; N processes (torch.distributed's
elastic_launch, gloo on 127.0.0.1, 1 thread each) plan it with TorchRec's EmbeddingShardingPlanner, wrap
it in DistributedModelParallel (reco.train.distributed.shard: with adagrad the tables' optimizer fused into
the backward pass, with adamw one torch optimizer for tables and dense layers), copy the plain model's
weights in, train `--steps` mini-batches and check that the sharded model is the model it claims to be, before training (its logits
against the plain model's) and after (its weights saved with torch.distributed.checkpoint and loaded into
the plain DLRM score the same logits). The table prints, per type: whether it trained, both parities, the
table bytes each rank holds, which ranks hold each table, or the last line of the error.
Correctness and memory, not speed: the 2 cores of the machine are shared.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import traceback

import torch

from reco.cpu import cpu_model
from reco.data.synthetic import SyntheticConfig

TYPES = [
    "data_parallel",
    "table_wise",
    "column_wise",
    "table_column_wise",
    "row_wise",
    "table_row_wise",
    "grid_shard",
]
SMALL = SyntheticConfig(
    n_rows=6_000,
    n_users=600,
    n_items=300,
    n_categories=20,
    n_brands=40,
    latent_dim=8,
    max_recent=4,
    seed=0,
)


def stock_sharder():  # noqa: ANN201 (torchrec is imported in the worker)
    """TorchRec's own EmbeddingBagCollection sharder: on CPU it offers no row_wise, table_row_wise or
    grid_shard, which stops the planner before anything runs (reco.train.distributed.cpu_sharder does)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder()


def probe(
    sharding_type: str,
    optimizer: str,
    stock: bool,
    uneven: bool,
    dim: int,
    steps: int,
    batch: int,
    out_dir: str,
) -> dict:
    """One rank's run (elastic_launch sets RANK/WORLD_SIZE/MASTER_*); the result of rank 0 is printed."""
    import torch.distributed as dist

    from reco.cli.compose import compose
    from reco.config import typed
    from reco.data.synthetic import generate
    from reco.models.dlrm import DLRM, DLRMConfig
    from reco.train.distributed import load_plain, save_checkpoint, shard, start_from
    from reco.train.loop import TrainConfig
    from reco.train.sharding import ShardingType

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    try:
        data = generate(SMALL)
        torch.manual_seed(0)
        model = DLRM(DLRMConfig.from_schema(data.schema, embedding_dim=dim, bottom=[64, dim], top=[64, 32]))
        cfg = typed(
            compose([f"trainer.optimizer={optimizer}", "trainer.lr=0.01"]).trainer, TrainConfig, "trainer"
        )
        cfg.distributed.sharding_types = [ShardingType(sharding_type)]
        plain = DLRM(model.cfg)
        plain.load_state_dict(model.state_dict())
        sh = shard(model, cfg, batch, stock_sharder() if stock else None)
        dmp, opt = sh.dmp, sh.optimizer
        start_from(dmp, plain.state_dict())
        first = data.val.take(slice(0, batch))
        with torch.no_grad():
            dmp.eval()
            init_diff = (
                (
                    dmp(first.dense, model.kjt(first.ids, first.lengths))
                    - plain(first.dense, plain.kjt(first.ids, first.lengths))
                )
                .abs()
                .max()
            )
            dmp.train()
        world = dist.get_world_size()
        for s in range(steps):
            # Every rank the same batch size: see --uneven for what a smaller batch on one rank does.
            size = batch // 2 if uneven and rank == 1 else batch
            rows = (torch.arange(size) + (s * world + rank) * batch) % len(data.train)
            part = data.train.take(rows)
            logits = dmp(part.dense, model.kjt(part.ids, part.lengths))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, part.labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
        part = data.val.take(slice(0, batch))
        with torch.no_grad():
            dmp.eval()
            sharded = dmp(part.dense, model.kjt(part.ids, part.lengths))
        ckpt = save_checkpoint(dmp, __import__("pathlib").Path(out_dir))
        out = {"ok": True, "loss": float(loss), "plan": [vars(p) for p in sh.plan]}
        if rank == 0:
            load_plain(plain, ckpt)
            with torch.no_grad():
                ref = plain(part.dense, plain.kjt(part.ids, part.lengths))
            out["max_abs_diff"] = float((ref - sharded).abs().max())
            out["init_diff"] = float(init_diff)
        return out
    finally:
        dist.destroy_process_group()


def run_type(
    sharding_type: str,
    optimizer: str,
    stock: bool,
    uneven: bool,
    dim: int,
    nproc: int,
    steps: int,
    batch: int,
) -> dict:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cfg = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
    )
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return elastic_launch(cfg, probe)(
                sharding_type, optimizer, stock, uneven, dim, steps, batch, tmp
            )[0]
        except ChildFailedError as e:
            msgs = [f.message for f in e.failures.values()]
            first = next((m for m in msgs if isinstance(m, dict)), msgs[0])
            text = first.get("message", str(first)) if isinstance(first, dict) else str(first)
            return {"ok": False, "error": text.strip().splitlines()[-1] if text else "?", "full": text}
        except Exception as e:  # noqa: BLE001 (the bench reports any failure as a row)
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "full": traceback.format_exc()}


def main(argv: list[str] | None = None) -> int:
    import torchrec

    p = argparse.ArgumentParser(prog="bench.dmp_sharding", description=__doc__.splitlines()[0])
    p.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=128, help="rows per rank per step")
    p.add_argument("--optimizer", default="adagrad", choices=["adagrad", "adamw"], help="trainer.optimizer")
    p.add_argument(
        "--stock-sharder",
        action="store_true",
        help="TorchRec's sharder instead of reco's (no row_wise on CPU)",
    )
    p.add_argument("--dim", type=int, default=64, help="embedding_dim (the default model's)")
    p.add_argument("--uneven", action="store_true", help="rank 1 takes half the rows of rank 0 each step")
    p.add_argument("--verbose", action="store_true", help="print the full error of a failing type")
    args = p.parse_args(argv)
    print(
        f"torch {torch.__version__}, torchrec {torchrec.__version__}, gloo, {args.nproc} ranks, "
        f"trainer.optimizer={args.optimizer}, embedding_dim {args.dim}, stock sharder={args.stock_sharder}, "
        f"uneven batches={args.uneven}, CPU: {cpu_model()} ({os.cpu_count()} cores)"
    )
    rows = []
    for st in args.types:
        r = run_type(
            st, args.optimizer, args.stock_sharder, args.uneven, args.dim, args.nproc, args.steps, args.batch
        )
        rows.append((st, r))
        if args.verbose and not r["ok"]:
            print(r.get("full", ""))
    ranks = range(args.nproc)
    cols = " ".join(f"{'rank ' + str(k) + ' bytes':>13}" for k in ranks)
    print(
        f"\n{'sharding type':<18} {'trains':<6} {'start':>8} {'parity':>8} {cols}  ranks holding each table / error"
    )
    for st, r in rows:
        if r["ok"]:
            held = sorted({tuple(t["ranks"]) for t in r["plan"]})
            totals = " ".join(f"{sum(t['bytes_per_rank'].get(k, 0) for t in r['plan']):>13,}" for k in ranks)
            print(f"{st:<18} {'yes':<6} {r['init_diff']:>8.0e} {r['max_abs_diff']:>8.0e} {totals}  {held}")
        else:
            print(f"{st:<18} {'NO':<6} {'':>8} {'':>8} {' ' * 14 * len(ranks)} {r['error'][:160]}")
    print(f"\nstart: max |logit difference| on {args.batch} validation rows between the sharded model before")
    print("training (the plain model's weights copied in: reco.train.distributed.start_from) and the plain")
    print("model; parity: the same after training, against the plain DLRM loaded with the sharded model's")
    print("weights (torch.distributed.checkpoint). bytes: the table weights each rank holds (a data_parallel")
    print("table counts on every rank). Rerun: python -m bench.dmp_sharding [--stock-sharder] [--uneven]")
    return 0 if all(r["ok"] for _, r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
