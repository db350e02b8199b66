"""Models chosen by `_target_` (reco.models.protocol): the protocol check, and DCN-v2 through every step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import premade_store, trainer_config
from test_pipeline import run_py
from torch import nn
from torchrec.models.dlrm import DLRM_DCN

from reco.cli.compose import compose
from reco.config import ConfigError, resolve_config, typed
from reco.graph import cache_key, plan
from reco.measure import evaluate
from reco.models.dcn import DCN, DCNConfig, DCNSettings
from reco.models.dlrm import DLRM
from reco.models.protocol import METHODS, count_params, resolve, target_of
from reco.runtime import load_scorer, ort_scorer
from reco.steps import StepError, StepRun, accelerate, distill, embed_quant, prune
from reco.steps.accelerate.export import check_parity, export_onnx, random_batch, real_batch
from reco.train.loop import train
from reco.variant import ArtifactError, Variant


class NoPlainForward(nn.Module):
    """Everything of the protocol but forward_plain (what export and serving run)."""

    Config = DCNConfig
    Settings = DCNSettings


for _m in METHODS:
    if _m != "forward_plain":
        setattr(NoPlainForward, _m, lambda self, *a, **k: None)


class NotAModule:
    pass


def dcn_settings(**over) -> DCNSettings:
    """conf/model/dcn.yaml as the pipeline types it, at a test size."""
    node = compose(["model=dcn"]).model
    merged = {
        **dict(node),
        **{"embedding_dim": 16, "bottom": [32, 16], "top": [64, 32], "cross_layers": 2, "low_rank": 8},
        **over,
    }
    return typed(merged, DCNSettings, "model")


def tiny_dcn(schema, seed: int = 0) -> DCN:
    torch.manual_seed(seed)
    return DCN.from_settings(schema, dcn_settings())


@pytest.fixture(scope="module")
def dcn_parent(data, trainer, tmp_path_factory) -> Variant:
    """A tiny DCN trained on part of one epoch, saved as a baseline variant with its test AUC."""
    model = tiny_dcn(data.schema)
    train(model, data, trainer)
    v = Variant("dcn_base", "train", None, "torch", {}, dir=str(tmp_path_factory.mktemp("dcn_base")))
    v.save_torch(model)
    v.metrics.update(evaluate(load_scorer(v), data.test))
    v.save()
    return v


# The protocol ------------------------------------------------------------------------------------
def test_protocol_check_names_the_setting_and_what_is_missing():
    allowed = {target_of(NoPlainForward): "conf/model/bad.yaml", target_of(NotAModule): "conf/model/x.yaml"}
    with pytest.raises(ConfigError) as e:
        resolve(target_of(NoPlainForward), "model._target_", allowed)
    msg = str(e.value)
    assert msg.startswith("model._target_: ") and "does not follow the ranking-model protocol" in msg
    assert "missing: method forward_plain()" in msg and "from_settings" not in msg
    with pytest.raises(ConfigError, match=r"missing: a torch.nn.Module subclass, method from_settings\(\)"):
        resolve(target_of(NotAModule), "model._target_", allowed)
    assert resolve("reco.models.dcn.DCN", "model._target_") is DCN  # the shipped ones pass
    assert resolve("reco.models.dlrm.DLRM", "model._target_") is DLRM


def test_unlisted_target_is_refused_at_plan_time():
    """Only classes some conf/model/*.yaml names may be built (or loaded); the plan fails before training."""
    with pytest.raises(
        ConfigError, match=r"variants.baseline: model._target_: 'collections.OrderedDict' is not"
    ):
        plan(resolve_config(compose(["model._target_=collections.OrderedDict"])))
    with pytest.raises(ConfigError, match=r"model._target_: 'reco.models.dcn.DCNConfig' is not an allowed"):
        plan(resolve_config(compose(["model._target_=reco.models.dcn.DCNConfig"])))
    with pytest.raises(ConfigError, match="cross_layers"):  # DCN's schema checks its own keys
        plan(resolve_config(compose(["model=dcn", "model.cross_layers=0"])))


def test_model_choice_enters_the_cache_key():
    dlrm, dcn = plan(resolve_config(compose()))[0], plan(resolve_config(compose(["model=dcn"])))[0]
    assert type(dlrm.config).__name__ == "ModelConfig" and isinstance(dcn.config, DCNSettings)
    t = trainer_config()
    assert cache_key(dlrm, None, "d", t) != cache_key(dcn, None, "d", t)


def test_distributed_settings_enter_the_cache_key_only_when_they_shape_the_model():
    import dataclasses

    node, t = plan(resolve_config(compose()))[0], trainer_config()

    def key(**dist) -> str:
        return cache_key(
            node, None, "d", dataclasses.replace(t, distributed=dataclasses.replace(t.distributed, **dist))
        )

    assert key(timeout_s=5) == key() == key(sharding_types=["table_wise"])  # one process: unchanged
    two = key(nproc=2)
    assert two != key() and key(nproc=2, timeout_s=5, master_addr="10.0.0.1") == two
    assert key(nproc=2, sharding_types=["table_wise"]) != two


# DCN-v2 ------------------------------------------------------------------------------------------
def test_dcn_forward_shapes_and_equals_torchrec_dlrm_dcn(data):
    model = tiny_dcn(data.schema).eval()
    part = data.val.take(slice(0, 64))
    with torch.no_grad():
        a = model(part.dense, model.kjt(part.ids, part.lengths))
        b = model.forward_plain(part.dense, part.ids, part.mask())
        cfg = model.cfg
        ref = DLRM_DCN(
            embedding_bag_collection=model.ebc,
            dense_in_features=cfg.dense_in,
            dense_arch_layer_sizes=cfg.bottom,
            over_arch_layer_sizes=[*cfg.top, 1],
            dcn_num_layers=cfg.cross_layers,
            dcn_low_rank_dim=cfg.low_rank,
        )
        ref.inter_arch.crossnet.load_state_dict(model.cross.state_dict())
        ours = [x for x in [*model.bottom, *model.top] if isinstance(x, nn.Linear)]
        theirs = [x for x in ref.modules() if isinstance(x, nn.Linear)]
        assert len(ours) == len(theirs)
        for o, t in zip(ours, theirs, strict=True):
            t.weight.copy_(o.weight)
            t.bias.copy_(o.bias)
        c = ref.eval()(part.dense, model.kjt(part.ids, part.lengths)).squeeze(1)
    n = cfg.bottom[-1] + len(cfg.tables) * cfg.embedding_dim
    assert a.shape == b.shape == (64,) and model.cross(torch.zeros(3, n)).shape == (3, n)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    assert cfg.flops_per_candidate() > 0


def test_dcn_trains_above_chance(dcn_parent):
    assert dcn_parent.metrics["auc"] > 0.6, dcn_parent.metrics


def test_dcn_save_load_round_trip_weights_only(dcn_parent, data):
    v = Variant.load(dcn_parent.dir)
    assert v.model_target == "reco.models.dcn.DCN" and v.model_config["cross_layers"] == 2
    model = v.load_torch()
    assert isinstance(model, DCN) and count_params(model) == v.params
    batch = real_batch(data.val, 256)
    before = evaluate(load_scorer(dcn_parent), data.val)["auc"]
    assert evaluate(load_scorer(v), data.val)["auc"] == before
    assert np.isfinite(load_scorer(v)(*batch)).all()


def test_tampered_manifest_or_weights_are_refused(dcn_parent, tmp_path):
    import shutil

    d = tmp_path / "v"
    shutil.copytree(dcn_parent.dir, d)
    rec = json.loads((d / "variant.json").read_text())
    (d / "variant.json").write_text(json.dumps({**rec, "model_target": "os.system"}))
    with pytest.raises(ArtifactError, match="model_target: 'os.system' is not an allowed model class"):
        Variant.load(d).load_torch()
    (d / "variant.json").write_text(json.dumps(rec))
    with open(d / "model.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(ArtifactError, match="SHA-256 mismatch"):
        Variant.load(d).load_torch()


def test_dcn_onnx_export_matches_torch_in_ort(dcn_parent, data, tmp_path):
    model = dcn_parent.load_torch()
    path = tmp_path / "dcn.onnx"
    export_onnx(model, path, data.val.take(slice(0, 8)), opset=18, exporter="torchscript")
    batches = {
        "random": random_batch(model, 500, data.val.ids.shape[2], seed=0),
        "real": real_batch(data.val, 500),
    }
    diffs = check_parity(ort_scorer(path, {}), model, batches, 1e-4, "dcn")
    assert max(diffs.values()) <= 1e-4


# DCN through the steps ---------------------------------------------------------------------------
def step_cfg(step: str, overrides: dict | None = None):
    from reco.graph import step_config
    from reco.steps import get_step

    return step_config(
        resolve_config(compose(["model=dcn"])), get_step(step), overrides or {}, f"variants.{step}"
    )


def test_dcn_prune_narrows_mlps_and_keeps_the_cross_net(dcn_parent, data, trainer, tmp_path):
    cfg = step_cfg("prune", {"finetune_epochs": 0, "embeddings": {"min_rows": 100}})
    v = prune.run(dcn_parent, data, cfg, StepRun("p", tmp_path / "p", trainer))
    before, after = dcn_parent.load_torch(), v.load_torch()
    assert isinstance(after, DCN) and v.model_target == "reco.models.dcn.DCN"
    assert after.cfg.bottom[:-1] < before.cfg.bottom[:-1] and after.cfg.top < before.cfg.top
    assert after.cfg.bottom[-1] == before.cfg.bottom[-1]
    for k, w in before.cross.state_dict().items():
        torch.testing.assert_close(after.cross.state_dict()[k], w)
    assert count_params(after) <= (1 - cfg.amount) * count_params(before)


def test_dcn_distill_builds_a_smaller_dcn_student(dcn_parent, data, trainer, tmp_path):
    cfg = step_cfg(
        "distill",
        {
            "student": {"embedding_dim": 4, "bottom": [8, 4], "top": [16], "min_rows": 100},
            "epochs": 1,
            "rows_per_epoch": 4000,
            "control": False,
        },
    )
    v = distill.run(dcn_parent, data, cfg, StepRun("s", tmp_path / "s", trainer))
    student = v.load_torch()
    assert isinstance(student, DCN) and student.cfg.cross_layers == 2
    # the teacher's rank-to-width ratio: 8 of its cross width, scaled to the student's (1/4 as wide here)
    teacher = dcn_parent.load_torch().cfg
    assert student.cfg.cross_in * 4 == teacher.cross_in and student.cfg.low_rank == 8 // 4
    assert v.metrics["size_ratio"] > 2 and count_params(student) < count_params(dcn_parent.load_torch())


def test_dcn_student_not_smaller_names_the_setting(dcn_parent, data, trainer, tmp_path):
    cfg = step_cfg(
        "distill",
        {
            "student": {
                "embedding_dim": 32,
                "bottom": [64, 32],
                "top": [64],
                "min_count": 0,
                "user_min_count": None,
            }
        },
    )
    with pytest.raises(
        StepError, match=r"not fewer than the teacher.*model reco.models.dcn.DCN.*distill.student"
    ):
        distill.run(dcn_parent, data, cfg, StepRun("big", tmp_path, trainer))


def test_dcn_accelerate_onnx_int8(dcn_parent, data, trainer, tmp_path):
    cfg = step_cfg("accelerate", {"mode": "onnx_int8", "tune": None})
    v = accelerate.run(dcn_parent, data, cfg, StepRun("i8", tmp_path / "i8", trainer))
    assert v.backend == "onnxruntime" and v.model_target == "reco.models.dcn.DCN"
    assert v.metrics["parity_max_abs_real"] <= cfg.parity_tol
    assert v.metrics["quantized_matmuls"] >= 1 and v.metrics["float_matmuls"] == 0
    assert abs(v.metrics["auc_rel_drop"]) <= cfg.auc_guard


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
def test_dcn_embed_quant_tables(dcn_parent, data, trainer, tmp_path, runtime):
    cfg = step_cfg("embed_quant", {"runtime": runtime, "precisions": ["int8"], "budget": 0.05, "tune": None})
    v = embed_quant.run(dcn_parent, data, cfg, StepRun("q", tmp_path / "q", trainer))
    assert v.metrics["emb_size_ratio"] > 3  # int8 rows of 16 + 4 bytes of scale/bias vs 64 bytes
    got = evaluate(load_scorer(v), data.val)["auc"]
    assert abs(got - evaluate(load_scorer(dcn_parent), data.val)["auc"]) < 0.01


# End to end --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_experiment_with_dcn(tmp_path: Path):
    """`run.py experiment=smoke model=dcn` through run.py's plumbing: the model chosen by `_target_`, trained,
    exported to ONNX INT8, evaluated and reported. Its prune, distill, accelerate and embed_quant steps are
    tested above on the DCN parent; the load study does not depend on the model (test_pipeline's end-to-end
    test serves and load-tests the chain), so both stay out of this subprocess to keep make test short."""
    premade_store(tmp_path)
    proc = run_py(
        tmp_path,
        "experiment=smoke",
        "model=dcn",
        "loadtest.enabled=false",
        "quality.users=0",
        "variants=baseline",
        "+variants.onnx_int8={step: accelerate, parent: baseline, mode: onnx_int8}",
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name in ("baseline", "onnx_int8"):
        rec = json.loads(next((tmp_path / "cache" / "variants").glob(f"{name}-*/variant.json")).read_text())
        assert rec["model_target"] == "reco.models.dcn.DCN", name
    report = (tmp_path / "report" / "report.md").read_text()
    assert "`onnx_int8`" in report and "PASS" in report
