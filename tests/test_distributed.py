"""Training over 2 processes with TorchRec's DistributedModelParallel (gloo on 127.0.0.1, real ranks):
the result loads into the plain model, the plan is readable and bounded, a dead rank stops the job."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MARK, marked_alive, premade_store, trainer_config

from reco.config import ConfigError, resolve_config, typed
from reco.models.dlrm import DLRM, DLRMConfig
from reco.stats import auc_delta, delong
from reco.steps import StepRun
from reco.steps import train as train_step
from reco.train.distributed import BEST, FAULT_ENV, load_plain, rank_rows
from reco.train.launch import DistributedTrainingError, check_feedable, train_distributed
from reco.train.loop import Optimizer, TrainConfig, bce_loss, make_optimizer, predict_torch
from reco.train.sharding import ShardingType, table_bytes

pytestmark = pytest.mark.slow

ARCH = {"embedding_dim": 16, "bottom": [32, 16], "top": [64, 32]}


def dist_trainer(**dist_overrides) -> TrainConfig:
    """A small budget (2 epochs of 6,000 rows, ~10 s a rank) with trainer.distributed.nproc=2 + overrides."""
    cfg = trainer_config(
        epochs=2,
        batch_size=512,
        lr=0.05,
        optimizer=Optimizer.adagrad,
        patience=1,
        threads=2,
        progress=False,
        max_rows_per_epoch=6_000,
        eval_rows=2_000,
    )
    cfg.distributed = dataclasses.replace(cfg.distributed, **({"nproc": 2} | dist_overrides))
    cfg.distributed.check("trainer.distributed")
    return cfg


def fresh_model(data) -> DLRM:
    torch.manual_seed(0)
    return DLRM(DLRMConfig.from_schema(data.schema, **ARCH))


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    model = fresh_model(data)
    ckpt = tmp_path_factory.mktemp("dist_ckpt")
    return model, train_distributed(model, data, dist_trainer(), ckpt), ckpt


def test_result_loads_into_plain_model_and_scores_like_the_sharded_one(trained, data):
    model, res, ckpt = trained
    assert set(model.state_dict()) == set(fresh_model(data).state_dict())
    val = data.val.take(slice(0, 2_000))
    plain = predict_torch(model, val)
    # res.val_scores: the sharded model's (all ranks') scores of the best epoch, gathered on rank 0
    np.testing.assert_allclose(plain, res.val_scores, rtol=0, atol=1e-5)
    assert res.train.best_val_auc > 0.6 and len(res.train.history) >= 1
    assert (ckpt / BEST).is_dir() and not (ckpt / f"{BEST}.partial").exists()
    # the checkpoint on disk is the model the caller received
    again = load_plain(fresh_model(data), ckpt / BEST)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, rtol=0, atol=0)


def test_plan_names_every_table_and_its_bytes(trained, data):
    model, res, _ = trained
    sizes = table_bytes(fresh_model(data).ebc.embedding_bag_configs())
    assert {r.table for r in res.plan} == set(sizes)
    for r in res.plan:
        assert r.bytes == sizes[r.table]
        assert r.sharding_type in {t.value for t in dist_trainer().distributed.sharding_types}
        held = sum(r.bytes_per_rank.values())
        # a replica on every rank, or the table's bytes split over its ranks
        assert held == (2 * r.bytes if r.sharding_type == "data_parallel" else r.bytes)
        assert set(r.ranks) <= {0, 1}


def test_table_over_the_limit_is_named(data, tmp_path):
    sizes = table_bytes(fresh_model(data).ebc.embedding_bag_configs())
    name, biggest = max(sizes.items(), key=lambda kv: kv[1])
    cfg = dist_trainer(sharding_types=[ShardingType.table_wise], max_bytes_per_rank=biggest - 1)
    with pytest.raises(ConfigError) as e:
        train_distributed(fresh_model(data), data, cfg, tmp_path)
    msg = str(e.value)
    assert "trainer.distributed.max_bytes_per_rank" in msg and repr(name) in msg
    assert f"{biggest:,}" in msg and f"{biggest - 1:,}" in msg


def test_rank_over_the_limit_is_named_by_the_ranks(data, tmp_path):
    """Each table fits alone but not all of them on one of 2 ranks: the planner's plan breaks the limit,
    found inside the ranks and raised in the caller as the same ConfigError."""
    sizes = table_bytes(fresh_model(data).ebc.embedding_bag_configs())
    limit = max(max(sizes.values()), math.ceil(sum(sizes.values()) / 2) - 1)
    cfg = dist_trainer(sharding_types=[ShardingType.table_wise], max_bytes_per_rank=limit)
    with pytest.raises(ConfigError, match=r"trainer.distributed.max_bytes_per_rank: rank \d holds"):
        train_distributed(fresh_model(data), data, cfg, tmp_path)


def test_rank_shares_cover_an_epoch_once():
    for n, world in ((6_000, 2), (10, 3), (7, 7)):
        parts = [set(range(n)[rank_rows(n, r, world)]) for r in range(world)]
        assert sum(len(p) for p in parts) == n - n % world == len(set().union(*parts))
        assert len({len(p) for p in parts}) == 1  # equal shares: every rank runs the same steps


def test_more_ranks_than_the_data_can_feed(data):
    cfg = dataclasses.replace(dist_trainer(), max_rows_per_epoch=500)
    with pytest.raises(ConfigError, match=r"trainer.distributed.nproc=2: an epoch has 500 train rows"):
        check_feedable(cfg, len(data.train))
    cfg = dataclasses.replace(dist_trainer(), batch_size=511)
    with pytest.raises(ConfigError, match=r"trainer.distributed.nproc=2: trainer.batch_size=511"):
        check_feedable(cfg, len(data.train))


def test_unknown_sharding_type_or_backend_names_the_key():
    node = dataclasses.asdict(trainer_config())
    node["distributed"] |= {"nproc": 2, "sharding_types": ["table_wise", "diagonal"]}
    with pytest.raises(
        ConfigError,
        match=r"trainer: distributed.sharding_types\[1\]: Invalid value 'diagonal', expected one of \[.*row_wise",
    ):
        typed(node, TrainConfig, "trainer")
    node["distributed"] |= {"sharding_types": ["table_wise"], "backend": "nccl"}
    with pytest.raises(ConfigError, match=r"trainer.distributed.backend: expected one of \['gloo'\]"):
        typed(node, TrainConfig, "trainer")


def test_hosts_settings_name_the_key():
    node = dataclasses.asdict(trainer_config())
    node["distributed"] |= {"nnodes": 2, "node_rank": 2}
    with pytest.raises(
        ConfigError, match=r"trainer.distributed.node_rank: expected 0 <= node_rank < nnodes=2, got 2"
    ):
        typed(node, TrainConfig, "trainer")
    node["distributed"] |= {"node_rank": 1, "master_port": 0}
    with pytest.raises(
        ConfigError, match=r"trainer.distributed.master_port: expected node 0's rendezvous port"
    ):
        typed(node, TrainConfig, "trainer")


def test_adamw_is_accepted_but_not_gradient_accumulation():
    node = dataclasses.asdict(trainer_config())
    node["distributed"] |= {"nproc": 2}
    node["optimizer"] = "adamw"
    assert typed(node, TrainConfig, "trainer").optimizer == Optimizer.adamw
    node["grad_accum"] = 2
    with pytest.raises(ConfigError, match=r"trainer.grad_accum: expected 1 with trainer.distributed.nproc=2"):
        typed(node, TrainConfig, "trainer")


def test_an_early_check_inside_an_epoch_takes_fractions_and_margins_in_range():
    for key, bad, want in [
        ("stop_check_fraction", 1.0, "0 < fraction < 1"),
        ("stop_check_margin", -0.1, ">= 0"),
    ]:
        node = dataclasses.asdict(trainer_config()) | {key: bad}
        with pytest.raises(ConfigError, match=rf"trainer.{key}: expected .*{want}"):
            typed(node, TrainConfig, "trainer")


def adamw_trainer(**dist_overrides) -> TrainConfig:
    """One epoch of AdamW, the single-process baseline's optimizer, over ranks (fp32)."""
    return dataclasses.replace(
        dist_trainer(**dist_overrides),
        optimizer=Optimizer.adamw,
        lr=0.01,
        weight_decay=0.01,
        epochs=1,
        bf16=False,
    )


def loop_reference(data, cfg: TrainConfig) -> DLRM:
    """reco.train.loop's optimizer (make_optimizer: tables without weight decay) stepped on the global
    batches the ranks step together (each the ranks' shares of it, in rank order), from the same start."""
    ref = fresh_model(data)
    opt = make_optimizer(ref.named_parameters(), cfg)
    world = cfg.distributed.world
    n, local = cfg.max_rows_per_epoch, cfg.batch_size // world
    perm = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(cfg.seed))[:n]
    shares = [perm[rank_rows(n, rank, world)] for rank in range(world)]
    ref.train()
    for lo in range(0, len(shares[0]), local):
        rows = torch.cat([s[lo : lo + local] for s in shares])
        part = data.train.take(rows)
        logits = ref(part.dense, ref.kjt(part.ids, part.lengths))
        bce_loss(logits, part, rows).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ref


def assert_is_reference(model: DLRM, res, ref: DLRM, data, cfg: TrainConfig, atol: float = 5e-5) -> None:
    """Every weight trained and within `atol` of the reference's (moved ~0.1; AdamW: apart by < 5e-6
    measured)."""
    start = fresh_model(data).state_dict()
    for k, v in ref.state_dict().items():
        assert not torch.equal(v, start[k]), k  # every weight was trained
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=atol, msg=k)
    val = data.val.take(slice(0, cfg.eval_rows))
    np.testing.assert_allclose(res.val_scores, predict_torch(ref, val), rtol=0, atol=atol)


@pytest.mark.parametrize(
    "sharding_type", [ShardingType.table_wise, ShardingType.row_wise], ids=lambda t: t.value
)
def test_adamw_on_two_ranks_is_the_single_process_loop(data, tmp_path, sharding_type, capsys):
    """AdamW on 2 ranks: every table gets TorchRec's dense kernel and the optimizer steps after the
    backward pass, so one epoch lands on the weights of reco.train.loop's optimizer stepped on the same
    global batches. Tables whole on one rank, and split by rows: the model-parallel types, whose fused
    kernel took no AdamW. A check inside an epoch (trainer.stop_check_fraction) is the single-process
    loop's: the launch says it validates at epoch ends only."""
    cfg = dataclasses.replace(adamw_trainer(sharding_types=[sharding_type]), stop_check_fraction=0.05)
    model = fresh_model(data)
    res = train_distributed(model, data, cfg, tmp_path)
    assert (
        "trainer.stop_check_fraction=0.05: the distributed loop validates at epoch ends only"
        in capsys.readouterr().out
    )
    assert {r.compute_kernel for r in res.plan} == {"dense"}
    assert {r.sharding_type for r in res.plan} == {sharding_type.value}
    assert_is_reference(model, res, loop_reference(data, cfg), data, cfg)


@pytest.mark.timeout(180)
def test_adagrad_on_two_ranks_with_a_data_parallel_table_is_the_single_process_loop(data, tmp_path):
    """Adagrad: FBGEMM's fused kernel steps the row-wise tables inside the backward pass, the optimizer
    after it the dense layers and the data_parallel tables (their DENSE kernel's weights carry no
    in-backward optimizer). Those tables took the dense layers' weight decay until they were grouped as
    the loop groups them, and the fused kernel FBGEMM's eps (1e-8, the loop's 1e-10): up to 0.4 off the
    loop's weights. Now 2e-4 at most (measured), in one item row: Adagrad's first step on a row that saw
    only tiny gradients is ~lr g / |g|, so float rounding in g moves it visibly; every other weight < 5e-5."""
    cfg = dataclasses.replace(
        adamw_trainer(sharding_types=[ShardingType.row_wise, ShardingType.data_parallel]),
        optimizer=Optimizer.adagrad,
        lr=0.05,
    )
    model = fresh_model(data)
    res = train_distributed(model, data, cfg, tmp_path)
    assert {r.sharding_type for r in res.plan} == {"row_wise", "data_parallel"}, res.plan
    assert_is_reference(model, res, loop_reference(data, cfg), data, cfg, atol=1e-3)


def test_a_dead_rank_stops_the_job(data, tmp_path, monkeypatch):
    """Rank 1 exits (code 3) in the second epoch, after the first epoch's checkpoint: the caller gets a
    clear error (pytest-timeout bounds the wait), no rank is left running and the checkpoint directory
    holds only the complete first-epoch checkpoint."""
    mark = f"dist-fault-{tmp_path.name}"
    monkeypatch.setenv(MARK, mark)
    # 6,000 rows / 2 ranks / 256 rows a step: 12 steps an epoch; die at the 15th
    monkeypatch.setenv(FAULT_ENV, "1:15")
    with pytest.raises(DistributedTrainingError) as e:
        train_distributed(fresh_model(data), data, dist_trainer(), tmp_path)
    msg = str(e.value)
    assert "rank 1" in msg and "code 3" in msg and "trainer.distributed.nproc=2" in msg
    assert "the other ranks were stopped" in msg
    assert marked_alive(mark, within_s=15) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [BEST]
    assert f"the last complete checkpoint is {tmp_path / BEST}" in msg
    load_plain(fresh_model(data), tmp_path / BEST)  # complete: every key present


# Node 1 of two hosts, in its own process as on another machine: the same data and model built from the
# same config, this host's one rank.
NODE1 = """
import sys
sys.path.insert(0, {tests!r})
from conftest import TINY
from reco.data.synthetic import generate
from reco.train.launch import train_distributed
from reco.train.sharding import ShardingType
from test_distributed import adamw_trainer, dist_trainer, fresh_model
data = generate(TINY)
cfg = {make}(nproc=1, nnodes=2, node_rank=1, master_port={port}, join_timeout_s=60, **{extra})
assert train_distributed(fresh_model(data), data, cfg, {ckpt!r}) is None
"""


def start_node1(port: int, ckpt: Path, env: dict[str, str], make: str = "dist_trainer", extra: str = "{}"):
    """Node 1 of two hosts, in its own process as on another machine: the same data and model built from
    the same config (`make`(**`extra`), a Python expression), this host's one rank."""
    code = NODE1.format(
        tests=str(Path(__file__).parent), make=make, extra=extra, port=port, ckpt=str(ckpt / "node1-unused")
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.timeout(180)
def test_two_hosts_train_the_single_process_model(data, tmp_path):
    """nnodes=2 nproc=1: node 1 in another process, the static rendezvous on node 0's 127.0.0.1 port.
    AdamW over tables split by rows across the two hosts lands on the single-process loop's weights, as
    on one host; both hosts' shards go to node 0's checkpoint directory (node 1 is handed another one,
    unused) and node 0 gets the result, node 1 None."""
    from reco.serve.process import free_port

    port = free_port()
    node1 = start_node1(port, tmp_path, {}, "adamw_trainer", "{'sharding_types': [ShardingType.row_wise]}")
    cfg = adamw_trainer(
        nproc=1,
        nnodes=2,
        node_rank=0,
        master_port=port,
        join_timeout_s=60,
        sharding_types=[ShardingType.row_wise],
    )
    model = fresh_model(data)
    res = train_distributed(model, data, cfg, tmp_path / "ckpt")
    out, _ = node1.communicate(timeout=60)
    assert node1.returncode == 0, out[-3000:]
    assert not (tmp_path / "node1-unused").exists() and (tmp_path / "ckpt" / BEST).is_dir()
    assert len(res.peak_rss_bytes) == 2 and {r.sharding_type for r in res.plan} == {"row_wise"}
    assert all(r.ranks == [0, 1] for r in res.plan)
    assert_is_reference(model, res, loop_reference(data, cfg), data, cfg)


@pytest.mark.timeout(180)
def test_a_host_with_other_data_or_a_dead_rank_stops_both_hosts(data, tmp_path, monkeypatch):
    """Node 1 builds other data: both hosts stop with the ConfigError naming node 1. Then node 1's rank dies
    mid-epoch: node 0 gets a clear error, and no process of either host is left."""
    from reco.serve.process import free_port

    mark = f"dist-hosts-{tmp_path.name}"
    monkeypatch.setenv(MARK, mark)
    other = dataclasses.replace(data, fingerprint="0" * 16)  # what another host's other data looks like
    for fault, expect in (({}, ConfigError), ({FAULT_ENV: "1:5"}, DistributedTrainingError)):
        port = free_port()
        node1 = start_node1(port, tmp_path, {MARK: mark, **fault})
        cfg = dist_trainer(nproc=1, nnodes=2, node_rank=0, master_port=port, join_timeout_s=60)
        with pytest.raises(expect) as e:
            train_distributed(fresh_model(data), data if fault else other, cfg, tmp_path / "ckpt")
        out, _ = node1.communicate(timeout=60)
        assert node1.returncode != 0
        if not fault:
            assert "node 1 (rank 1) has a different dataset fingerprint" in str(e.value)
            assert "node 1 (rank 1) has a different dataset fingerprint" in out
        else:
            assert "trainer.distributed.nproc=1 nnodes=2" in str(e.value) and "rank 0" in str(e.value)
            assert "code 3" in out
    assert marked_alive(mark, within_s=15) == []


def test_train_step_auc_matches_single_process(data, tmp_path):
    """The train step with nproc=2 against nproc=1 on the same data and seed: each test AUC lies in the
    other's 95% DeLong interval, and the paired interval of their difference holds 0; the distributed
    variant carries its plan. (lr 0.01 over the whole train split: with 0.05 over 6,000 rows the AUC moves
    by ~0.013 from one seed to the next in either mode, which no interval over test rows accounts for.)
    Its ranks train under a max_bytes_per_rank that the planner's own choice may break but an even split
    of the tables meets: the plan it trains with keeps every rank under it (one launch for both checks:
    each is ~6 s of two ranks importing TorchRec)."""
    from reco.cli.compose import compose
    from reco.graph import step_config
    from reco.steps import get_step

    settings = step_config(resolve_config(compose()), get_step("train"), ARCH, "variants.train")
    limit = int(sum(table_bytes(fresh_model(data).ebc.embedding_bag_configs()).values()) / 2 * 1.05)
    two = dataclasses.replace(dist_trainer(max_bytes_per_rank=limit), lr=0.01, max_rows_per_epoch=None)
    one = dataclasses.replace(dist_trainer(nproc=1), lr=0.01, max_rows_per_epoch=None)
    variants = {
        n: train_step.run(None, data, settings, StepRun(f"nproc{n}", tmp_path / f"nproc{n}", t))
        for n, t in ((1, one), (2, two))
    }
    v2 = variants[2]
    assert "sharding_plan" in v2.artifacts and v2.metrics["nproc"] == 2.0
    assert 0 < v2.metrics["table_bytes_rank0"] <= limit and 0 < v2.metrics["table_bytes_rank1"] <= limit
    assert v2.metrics["peak_rss_mb_rank0"] > 0 and v2.metrics["peak_rss_mb_rank1"] > 0
    labels = data.test.labels.numpy()
    scores = [predict_torch(variants[n].load_torch(), data.test) for n in (1, 2)]
    aucs, cov = delong(labels, scores)
    half = 1.96 * np.sqrt(np.diag(cov))
    assert abs(aucs[0] - aucs[1]) <= min(half), (aucs, half)
    delta, _ = auc_delta(labels, scores[0], scores[1])
    assert delta.lo <= 0 <= delta.hi, delta
    assert aucs.min() > 0.6


# The smallest run.py pipeline that trains: the baseline alone on 8k rows, one epoch, no load study.
SMALL_RUN = [
    "experiment=smoke",
    "loadtest.enabled=false",
    "profile.enabled=false",
    "variants=baseline",
    "data.params.n_rows=8000",
    "trainer.epochs=1",
]


@pytest.mark.timeout(300)
def test_submitit_local_multirun_of_single_and_distributed_training(tmp_path):
    """`python run.py -m ... trainer.distributed.nproc=1,2 hydra/launcher=submitit_local`: two submitit jobs
    (two processes, each with its own job directory), both FINISHED in MLflow, the nproc=2 one with its
    sharding plan in its metrics, and no process of either job left behind."""
    from mlflow.tracking import MlflowClient

    root = Path(__file__).resolve().parents[1]
    mark = f"submitit-{tmp_path.name}"
    sweep = tmp_path / "multirun"
    proc = subprocess.run(
        [
            sys.executable,
            "run.py",
            "-m",
            *SMALL_RUN,
            "trainer.optimizer=adagrad",
            "trainer.distributed.nproc=1,2",
            "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=5",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.artifact_root={tmp_path}/artifacts",
            f"cache_dir={tmp_path}/cache",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, MARK: mark},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    jobs = [p for p in (sweep / ".submitit").iterdir() if p.name != "%j"]
    assert len(jobs) == 2 and all(list(j.glob("*_result.pkl")) for j in jobs)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("smoke")
    parents = client.search_runs([exp.experiment_id], "tags.`mlflow.parentRunId` IS NULL")
    assert sorted(r.data.params["trainer.distributed.nproc"] for r in parents) == ["1", "2"]
    assert all(r.info.status == "FINISHED" for r in parents)
    children = client.search_runs([exp.experiment_id], "tags.`mlflow.parentRunId` IS NOT NULL")
    distributed = [r for r in children if r.data.metrics.get("nproc") == 2.0]
    assert len(distributed) == 1 and distributed[0].data.metrics["table_bytes_rank1"] > 0
    assert marked_alive(mark, within_s=10) == []


@pytest.mark.timeout(240)
def test_run_py_on_two_hosts(tmp_path):
    """The same `python run.py ...` on two hosts (two processes here), trainer.distributed.nnodes=2 and
    each its node_rank: node 1 trains its rank and stops, node 0 runs the pipeline; one MLflow parent run
    (node 0's), whose baseline was trained by 2 ranks. Then node 1 alone finds the baseline finished in
    the shared cache and has nothing to train."""
    from mlflow.tracking import MlflowClient

    from reco.serve.process import free_port

    root = Path(__file__).resolve().parents[1]
    mark = f"hosts-{tmp_path.name}"
    premade_store(tmp_path)  # only node 0 opens it (node 1 trains its ranks and stops)
    common = [
        *SMALL_RUN,
        "trainer.distributed.nnodes=2",
        f"trainer.distributed.master_port={free_port()}",
        "trainer.distributed.join_timeout_s=120",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"tracking.artifact_root={tmp_path}/artifacts",
        f"cache_dir={tmp_path}/cache",
        f"report_dir={tmp_path}/report",
    ]

    def host(node: int) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "run.py",
                *common,
                f"trainer.distributed.node_rank={node}",
                f"hydra.run.dir={tmp_path}/out{node}",
            ],
            cwd=root,
            env={**os.environ, MARK: mark},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    nodes = [host(0), host(1)]
    outs = [p.communicate(timeout=220)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "[node 1/2] baseline: training ranks 1-1 of 2" in outs[1]
    assert "node 0 goes on with the pipeline" in outs[1] and "sharding plan (2 ranks" in outs[0]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("smoke")
    parents = client.search_runs([exp.experiment_id], "tags.`mlflow.parentRunId` IS NULL")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.params["trainer.distributed.nnodes"] == "2"
    (baseline,) = client.search_runs([exp.experiment_id], "tags.`mlflow.parentRunId` IS NOT NULL")
    assert baseline.data.tags["status"] == "ok" and baseline.data.metrics["nproc"] == 2.0
    assert baseline.data.metrics["table_bytes_rank1"] > 0
    assert marked_alive(mark, within_s=10) == []

    again = host(1)
    out = again.communicate(timeout=120)[0]
    assert again.returncode == 0 and "finished in the cache" in out, out[-3000:]
