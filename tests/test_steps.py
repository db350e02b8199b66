"""prune / distill / accelerate on a tiny trained parent: real models, real files, real ORT sessions."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import make_variant
from onnx import TensorProto, helper, numpy_helper

from reco.cli.compose import compose
from reco.config import ConfigError, resolve_config
from reco.cpu import int8_saturates
from reco.graph import step_config
from reco.measure import evaluate
from reco.models.dlrm import DLRM, count_params
from reco.runtime import load_scorer, ort_scorer
from reco.steps import StepError, StepRun, accelerate, distill, get_step, prune  # noqa: F401 (registers them)
from reco.steps.accelerate import auc_guard
from reco.steps.accelerate.export import check_parity, export_onnx, random_batch, real_batch, torch_probs
from reco.steps.accelerate.quantize import QuantizeConfig, gemm_to_matmul
from reco.train.loop import predict_torch
from reco.variant import ArtifactError, Variant


@pytest.fixture(scope="module")
def pruned(parent, data, trainer, tmp_path_factory) -> Variant:
    cfg = load_step_config("prune", {"finetune_rows": 4_000})
    return prune.run(parent, data, cfg, StepRun("pruned", tmp_path_factory.mktemp("pruned"), trainer))


def load_step_config(step: str, overrides: dict | None = None):
    """The step's typed config as the pipeline builds it: composed defaults + a variant's overrides."""
    return step_config(resolve_config(compose()), get_step(step), overrides or {}, f"variants.{step}")


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def dir_digest(path: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(path).iterdir())}


def linear_shapes(model: DLRM) -> list[tuple[int, int]]:
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]


# prune ------------------------------------------------------------------------------------------
def test_prune_physically_shrinks_and_meets_amount(parent, pruned, data):
    before, after = parent.load_torch(), Variant.load(pruned.dir).load_torch()
    amount = pruned.step_config["amount"]
    assert count_params(after) <= (1 - amount) * count_params(before)
    assert pruned.metrics["params_removed_pct"] >= 100 * amount
    assert pruned.metrics["flops_removed_pct"] > 0
    # Hidden layers narrower; bottom output (= embedding_dim) and the final logit unchanged.
    s0, s1 = linear_shapes(before), linear_shapes(after)
    assert len(s0) == len(s1) and all(b[0] <= a[0] and b[1] <= a[1] for a, b in zip(s0, s1, strict=True))
    assert s1[0][0] < s0[0][0] and s1[-2][0] < s0[-2][0]
    assert after.bottom[-2].out_features == after.cfg.embedding_dim and after.top[-1].out_features == 1
    # Embedding tables lost rows but still accept every id of the schema.
    rows0 = {t.feature: t.num_rows for t in before.cfg.tables}
    shrunk = [t for t in after.cfg.tables if t.num_rows < rows0[t.feature]]
    assert shrunk and all(t.cardinality == rows0[t.feature] for t in shrunk)
    assert {t.feature for t in shrunk} <= set(after.cfg.remapped)
    assert pruned.parent == "base" and pruned.step == "prune" and pruned.sha256["torch"]


def test_pruned_outputs_valid_and_paths_agree(pruned, data):
    """Random ids over the full cardinality (pruned ones included) score finite probabilities, and the
    TorchRec forward (KJT through the id map) equals the export forward (Gather through the id map)."""
    model = Variant.load(pruned.dir).load_torch()
    dense, ids, mask = (torch.from_numpy(a) for a in random_batch(model, 256, data.test.ids.shape[2], seed=1))
    with torch.no_grad():
        plain = model.forward_plain(dense, ids, mask)
        kjt = model(dense, model.kjt(ids, mask.sum(2).long()))
    assert torch.isfinite(plain).all()
    torch.testing.assert_close(plain, kjt, rtol=1e-5, atol=1e-5)
    # A dropped id scores exactly like the unknown id 0.
    f = pruned.model_config["remapped"][0]
    i = model.features.index(f)
    dropped = int((model.id_map(f) == 0).nonzero()[1])
    a, b = ids.clone(), ids.clone()
    a[:, i, 0], b[:, i, 0] = dropped, 0
    with torch.no_grad():
        torch.testing.assert_close(model.forward_plain(dense, a, mask), model.forward_plain(dense, b, mask))


def test_saved_variant_reloads_to_equal_outputs(pruned, data):
    batch = real_batch(data.test, 300)
    p1 = load_scorer(Variant.load(pruned.dir))(*batch)
    p2 = torch_probs(pruned.load_torch(), batch)
    np.testing.assert_array_equal(p1, p2)
    assert ((p1 > 0) & (p1 < 1)).all()


def test_prune_taylor_iterative_leaves_parent_untouched(parent, data, trainer, tmp_path):
    digest = dir_digest(parent.dir)
    cfg = load_step_config(
        "prune", {"criterion": "taylor", "iterations": 2, "finetune_rows": 2_000, "amount": 0.5}
    )
    v = prune.run(parent, data, cfg, StepRun("taylor", tmp_path / "taylor", trainer))
    assert v.params <= 0.5 * parent.params
    assert dir_digest(parent.dir) == digest


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"amount": 1.5}, r"prune\.amount must be in \(0, 1\)"),
        ({"amount": 0.0}, r"prune\.amount must be in \(0, 1\)"),
    ],
)
def test_prune_bad_config_is_a_clear_error(parent, data, trainer, tmp_path, override, field):
    # Planning stops on it before anything runs ...
    with pytest.raises(ConfigError, match=r"variants\.prune: .*" + field):
        load_step_config("prune", override)
    # ... and the step itself refuses it when called directly.
    bad = dataclasses.replace(load_step_config("prune"), **override)
    with pytest.raises(StepError, match=field):
        prune.run(parent, data, bad, StepRun("x", tmp_path, trainer))


def test_unknown_or_mistyped_config_key_is_named():
    with pytest.raises(ConfigError, match=r"variants\.prune: .*amout"):
        load_step_config("prune", {"amout": 0.3})
    with pytest.raises(ConfigError, match=r"variants\.prune: .*expected one of \[taylor, l1, l2\]"):
        load_step_config("prune", {"criterion": "l3"})


# distill ----------------------------------------------------------------------------------------
def distill_cfg(**over) -> dict:
    base = {
        "student": {"embedding_dim": 4, "bottom": [16, 4], "top": [16], "min_rows": 500},
        "epochs": 1,
        "rows_per_epoch": 6_000,
        "list_loss": "none",  # the pointwise student; the list terms: tests/test_kd_lists.py
    }
    return load_step_config("distill", deep_merge(base, over))


def test_distill_student_smaller_with_control(parent, data, trainer, tmp_path):
    v = distill.run(parent, data, distill_cfg(), StepRun("student", tmp_path / "student", trainer))
    assert v.params < parent.params and v.metrics["size_ratio"] == pytest.approx(parent.params / v.params)
    m = v.metrics
    assert m["kd_gain_val_auc"] == pytest.approx(m["student_val_auc"] - m["control_val_auc"])
    assert m["kd_gain_val_auc_lo"] < m["kd_gain_val_auc"] < m["kd_gain_val_auc_hi"]
    teacher_val = evaluate(load_scorer(parent), data.val)["auc"]
    assert m["teacher_val_auc"] == pytest.approx(teacher_val, abs=1e-6)
    assert 0 < m["teacher_rows_scored"] <= len(data.train)
    # The student variant scores through the runtime exactly as the step measured it.
    loaded = Variant.load(v.dir)
    assert evaluate(load_scorer(loaded), data.val)["auc"] == pytest.approx(m["student_val_auc"], abs=1e-6)
    # The control is a real, loadable artifact with the student's architecture, and it is what the
    # step scored as the control (not the student again).
    control_v = dataclasses.replace(
        loaded, artifacts={"torch": "control.pt"}, sha256={"torch": loaded.sha256["control_torch"]}
    )
    control_auc = evaluate(load_scorer(control_v), data.val)["auc"]
    assert control_auc == pytest.approx(m["control_val_auc"], abs=1e-6)
    assert control_auc != pytest.approx(m["student_val_auc"], abs=1e-9)
    assert v.size_mb < parent.size_mb


def test_distill_from_pruned_teacher_reuses_its_tables(pruned, data, trainer, tmp_path):
    cfg = distill_cfg(student={"tables": "teacher", "min_count": 0, "user_min_count": None}, control=False)
    v = distill.run(pruned, data, cfg, StepRun("s", tmp_path / "s", trainer))
    teacher, student = pruned.load_torch(), v.load_torch()
    assert [t.num_rows for t in student.cfg.tables] == [t.num_rows for t in teacher.cfg.tables]
    for f in teacher.cfg.remapped:
        assert torch.equal(student.id_map(f), teacher.id_map(f))
    assert "control_val_auc" not in v.metrics and "control_torch" not in v.artifacts


def test_wider_student_with_fewer_user_rows_exports_to_int8(parent, data, trainer, tmp_path):
    """The default's shape (user_min_count above min_count, a wider embedding): the users folded into row 0
    score through the same int32 id map in torch and in the INT8 ONNX graph."""
    user = data.schema.index(data.schema.user_key)
    cfg = distill_cfg(student={"embedding_dim": 8, "bottom": [16, 8], "user_min_count": 10}, control=False)
    v = distill.run(parent, data, cfg, StepRun("w", tmp_path / "w", trainer))
    student = v.load_torch()
    folded = student.id_map(data.schema.user_key)[data.test.ids[:, user, 0]].eq(0)
    assert 0.1 < folded.float().mean() < 0.9 and student.cfg.embedding_dim == 8
    q = accel_cfg("onnx_int8", tune=None, auc_guard=1.0)
    int8 = accelerate.run(v, data, q, StepRun("w8", tmp_path / "w8", trainer))
    batch = real_batch(data.test, 500)
    assert np.abs(load_scorer(int8)(*batch) - torch_probs(student, batch)).max() < 0.02


def test_user_min_count_thins_the_user_table_alone(parent, data):
    """user_min_count: the user table keeps the users seen that often (+ row 0); the others keep min_count."""
    teacher = parent.load_torch()
    sc = distill_cfg(student={"min_count": 2, "user_min_count": 5, "min_rows": 100}).student
    cfg, _ = distill.student_config(sc, teacher, data)
    rows = {t.feature: t.num_rows for t in cfg.tables}
    for feature, least in ((data.schema.user_key, 5), ("item_id", 2)):
        seen = torch.bincount(data.train.ids[:, data.schema.index(feature), 0])
        assert rows[feature] == 1 + int((seen[1:] >= least).sum())
    with pytest.raises(ConfigError, match=r"distill.student.user_min_count must be >= 0 or null"):
        distill_cfg(student={"user_min_count": -1})


def test_distill_student_larger_than_teacher_is_an_error(parent, data, trainer, tmp_path):
    cfg = distill_cfg(
        student={"embedding_dim": 64, "bottom": [64], "top": [128], "min_count": 0, "user_min_count": None}
    )
    with pytest.raises(StepError, match="student has .* not fewer than the teacher"):
        distill.run(parent, data, cfg, StepRun("big", tmp_path, trainer))


def test_resampled_impressions_swap_exactly_the_item_side(parent, data):
    """Each re-sampled row is one batch row's user/context with another batch row's item features."""
    teacher = parent.load_torch()
    cfg = distill_cfg(resampled_rows=2.0)
    loss = distill.KDLoss(teacher, data.train, cfg, student=teacher, schema=data.schema, seed=0)
    part = data.train.take(slice(0, 64))
    extra = loss.resample(part)
    assert len(extra) == 128
    item = [f.side == "item" for f in data.schema.sparse]
    user = [not x for x in item]
    # every extra row's user/context side and item side come from some batch row, not always the same one
    dense_item = [f.side == "item" for f in data.schema.dense]
    assert any(dense_item)

    def side(split, k, sparse, dense=None):  # one row's ids (+ lengths, dense) of one side, hashable
        key = (split.ids[k][sparse].flatten().tolist(), split.lengths[k][sparse].tolist())
        return str(key if dense is None else (key, split.dense[k][dense].tolist()))

    users = {side(part, k, user) for k in range(64)}
    items = {side(part, k, item, dense_item) for k in range(64)}  # an item's ids and dense move together
    pairs = {(side(part, k, user), side(part, k, item, dense_item)) for k in range(64)}
    new = [(side(extra, k, user), side(extra, k, item, dense_item)) for k in range(128)]
    assert all(u in users and i in items for u, i in new)
    assert sum(p not in pairs for p in new) > 64  # mostly impressions the batch did not have


@pytest.mark.parametrize("soft_target", ["probabilities", "logits"])
def test_distill_soft_targets_and_resampled_rows_train(soft_target, parent, data, trainer, tmp_path):
    cfg = distill_cfg(soft_target=soft_target, resampled_rows=0.5, control=False)
    v = distill.run(parent, data, cfg, StepRun("s", tmp_path / "s", trainer))
    # the teacher scored the labelled rows once and 0.5 x that many re-sampled rows per epoch
    assert v.metrics["teacher_rows_scored"] == pytest.approx(6_000 * 1.5, rel=0.01)
    # and the student moved towards the teacher: closer scores than the same student untrained
    untrained = distill.run(
        parent, data, distill_cfg(epochs=0, control=False), StepRun("u", tmp_path / "u", trainer)
    )
    teacher = predict_torch(parent.load_torch(), data.val)

    def gap(variant):
        return float(np.mean((predict_torch(variant.load_torch(), data.val) - teacher) ** 2))

    assert gap(v) < 0.8 * gap(untrained)


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"resampled_rows": -1.0}, "distill.resampled_rows must be >= 0"),
        ({"resampled_rows": 1.0, "alpha": 1.0}, "resampled_rows > 0 needs alpha < 1"),
        ({"soft_target": "kl"}, "soft_target"),
    ],
)
def test_distill_bad_soft_target_settings_are_clear_errors(over, match, parent, data, trainer, tmp_path):
    with pytest.raises((StepError, ValueError), match=match):
        distill.run(parent, data, distill_cfg(**over), StepRun("bad", tmp_path, trainer))


# accelerate -------------------------------------------------------------------------------------
def accel_cfg(mode: str, **over) -> dict:
    # A short tuning run: the grid and its timing are exercised, not benchmarked.
    return load_step_config("accelerate", {"mode": mode, "tune": {"repeats": 6, "rounds": 2}, **over})


@pytest.fixture(scope="module")
def int8(parent, data, trainer, tmp_path_factory) -> Variant:
    return accelerate.run(
        parent,
        data,
        accel_cfg("onnx_int8", quantize={"static": False}),  # dynamic: its MatMulInteger nodes are counted
        StepRun("int8", tmp_path_factory.mktemp("int8"), trainer),
    )


def test_int8_graph_is_static_and_every_mlp_layer_quantized(int8, parent):
    g = onnx.load(str(int8.verify("onnx")))
    ops = {n.op_type for n in g.graph.node}
    assert not ops & {"Loop", "Scan", "If"}
    report = json.loads(int8.verify("report").read_text())
    assert report["fp32_ops"]["Gemm"] == 5 and not set(report["fp32_ops"]) & {"Loop", "Scan", "If"}
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in parent.load_torch().modules())
    assert int8.metrics["quantized_matmuls"] == n_linear == int8.metrics["mlp_layers"]
    assert int8.metrics["float_matmuls"] == 0 and int8.metrics["quantized_nodes"] > 0
    assert int8.params == parent.params and int8.flops_per_candidate == parent.flops_per_candidate
    assert sum(n.op_type == "MatMulInteger" for n in g.graph.node) == n_linear
    assert max(int8.metrics["parity_max_abs_random"], int8.metrics["parity_max_abs_real"]) <= 1e-4


def test_int8_variant_scores_like_torch_from_its_dir(int8, parent, data):
    v = Variant.load(int8.dir)
    assert v.backend == "onnxruntime" and v.parent == "base"
    assert set(v.runtime["ort"]) == {
        "graph_optimization_level",
        "intra_op_num_threads",
        "inter_op_num_threads",
        "execution_mode",
    }
    batch = real_batch(data.test, 500)
    diff = np.abs(load_scorer(v)(*batch) - torch_probs(parent.load_torch(), batch))
    assert diff.max() < 0.02  # int8 weights and activations; fp32 parity is checked separately
    assert v.metrics["auc_rel_drop"] <= v.step_config["auc_guard"]
    table = json.loads(v.verify("report").read_text())["tuning"]["table"]
    assert len(table) == 3 and all(r["rank_p50_ms"] > 0 for r in table)


def test_reduce_range_auto_follows_the_cpu(tmp_path):
    """7-bit weights exactly where u8s8 can saturate: x86 without VNNI/AMX (VPMADDUBSW sums at int16)."""
    info = tmp_path / "cpuinfo"
    for flags, saturates in [
        ("fpu avx2 fma", True),
        ("avx2 avx512f avx512_vnni", False),
        ("avx2 avx_vnni", False),
    ]:
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert int8_saturates(info) is saturates, flags
    info.write_text("processor\t: 0\nFeatures\t: fp asimd asimddp\n")  # aarch64: no x86 flags line
    assert int8_saturates(info) is False
    assert int8_saturates(tmp_path / "missing") is True
    qc = QuantizeConfig("QInt8", False, "auto", ["MatMul"], True, True, False, "MinMax", False, 8, 512)
    qc.check()
    assert qc.reduce_range is int8_saturates()  # resolved in place: the cache key and the report hold it
    with pytest.raises(StepError, match="accelerate.quantize.reduce_range must be true, false or auto"):
        QuantizeConfig(
            "QInt8", False, "sometimes", ["MatMul"], True, True, False, "MinMax", False, 8, 512
        ).check()


@pytest.mark.parametrize("rewrite", [True, False])
def test_static_int8_needs_the_gemm_rewrite(parent, data, trainer, tmp_path, rewrite):
    """ORT's static (QDQ) quantizer leaves Gemm in float; gemm_to_matmul is what quantizes the MLP."""
    q = {"static": True, "gemm_to_matmul": rewrite, "calibration_batches": 2}
    cfg = accel_cfg("onnx_int8", tune=None, auc_guard=1.0, quantize=q)
    v = accelerate.run(parent, data, cfg, StepRun("static", tmp_path / "static", trainer))
    n_linear = v.metrics["mlp_layers"]
    if rewrite:
        assert v.metrics["quantized_matmuls"] == n_linear and v.metrics["float_matmuls"] == 0
    else:
        assert v.metrics["float_matmuls"] == n_linear and v.metrics["quantized_matmuls"] == 0


def test_int8_tables_of_a_pruned_parent_keep_its_id_maps(pruned, data, trainer, tmp_path):
    """8-bit embedding tables (op_types + Gather) behind int32 id maps, which must stay exact."""
    # dynamic: the random batch's inputs lie outside any calibration range, where static INT8 clips
    cfg = accel_cfg("onnx_int8", tune=None, quantize={"op_types": ["MatMul", "Gather"], "static": False})
    v = accelerate.run(pruned, data, cfg, StepRun("p8", tmp_path / "p8", trainer))
    model = pruned.load_torch()
    batch = random_batch(model, 400, data.test.ids.shape[2], seed=2)  # pruned ids included
    assert np.abs(load_scorer(v)(*batch) - torch_probs(model, batch)).max() < 0.02
    assert v.metrics["quantized_tables"] == len(model.cfg.tables) and v.params == pruned.params
    assert v.size_mb < pruned.size_mb / 2


def test_fp32_onnx_parity_and_tamper_detection(parent, data, trainer, tmp_path):
    v = accelerate.run(
        parent, data, accel_cfg("onnx_fp32", tune=None), StepRun("fp32", tmp_path / "fp32", trainer)
    )
    assert v.runtime["ort"] == {}
    batch = random_batch(parent.load_torch(), 300, data.test.ids.shape[2], seed=3)
    np.testing.assert_allclose(load_scorer(v)(*batch), torch_probs(parent.load_torch(), batch), atol=1e-4)
    copy = tmp_path / "tampered"
    shutil.copytree(v.dir, copy)
    with open(copy / "model.onnx", "r+b") as f:
        f.seek(-16, 2)
        f.write(b"\x00" * 16)
    with pytest.raises(ArtifactError, match="SHA-256 mismatch"):
        load_scorer(Variant.load(copy))


def test_parity_check_catches_a_wrong_export(parent, data, tmp_path):
    model = parent.load_torch()
    other = parent.load_torch()
    with torch.no_grad():
        other.top[-1].bias += 0.05  # a small, real difference in the exported graph
    export_onnx(other, tmp_path / "m.onnx", data.test.take(slice(0, 4)), opset=18, exporter="torchscript")
    batches = {"real": real_batch(data.test, 64)}
    with pytest.raises(StepError, match="parity failed"):
        check_parity(ort_scorer(tmp_path / "m.onnx", {}), model, batches, 1e-4, "test")
    assert check_parity(ort_scorer(tmp_path / "m.onnx", {}), other, batches, 1e-4, "test")["real"] <= 1e-4


def test_auc_guard_rejects_a_worse_variant(parent, data, tmp_path):
    """An untrained model of the same shape scored against the trained parent: far below the guard."""
    untrained = Variant.load(make_variant(data, tmp_path)[0])
    with pytest.raises(StepError, match=r"lost too much validation AUC: parent 'base' auc 0\.\d+ -> 'tiny'"):
        auc_guard(parent, untrained, data, guard=0.005, threads=1)
    auc_guard(parent, parent, data, guard=0.0, threads=1)  # the parent against itself: no drop


def test_bf16_backend_keeps_weights(parent, data, trainer, tmp_path):
    v = accelerate.run(
        parent, data, accel_cfg("torch_bf16", auc_guard=0.02), StepRun("bf16", tmp_path / "bf16", trainer)
    )
    assert v.backend == "torch_bf16" and v.sha256["torch"] == parent.sha256["torch"]
    assert v.metrics["guard_val_auc"] == pytest.approx(v.metrics["guard_parent_val_auc"], abs=0.01)


def test_accelerate_needs_a_torch_parent(int8, data, trainer, tmp_path):
    with pytest.raises(StepError, match="no 'torch' artifact"):
        accelerate.run(int8, data, accel_cfg("onnx_fp32"), StepRun("again", tmp_path, trainer))
    with pytest.raises(StepError, match="backend onnxruntime"):
        distill.run(int8, data, distill_cfg(), StepRun("again", tmp_path, trainer))


def test_gemm_to_matmul_preserves_outputs(tmp_path):
    """All Gemm attribute cases the rewrite handles, checked by running both graphs in ORT."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 3)).astype(np.float32)  # transB=1: [out, in]
    b = rng.normal(size=(4,)).astype(np.float32)
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="g", transB=1, alpha=0.5, beta=2.0)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert gemm_to_matmul(rewritten) == 1
    assert [n.op_type for n in rewritten.graph.node] == ["MatMul", "Add"]
    import onnxruntime as ort

    x = rng.normal(size=(5, 3)).astype(np.float32)
    out = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        for m in (model, rewritten)
    ]
    np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[0], 0.5 * x @ w.T + 2.0 * b, rtol=1e-5, atol=1e-6)


def test_train_step_initialises_from_its_seed(data, trainer, tmp_path):
    """Two baselines of one config start from the same weights whatever drew from torch's RNG before."""
    from reco.steps import train as train_step

    cfg = step_config(resolve_config(compose()), get_step("train"), {}, "variants.baseline")
    budget = dataclasses.replace(trainer, epochs=0)
    weights = []
    for k in range(2):
        torch.rand(k + 1)  # another draw from the global RNG before each build
        v = train_step.run(None, data, cfg, StepRun(f"b{k}", tmp_path / f"b{k}", budget))
        weights.append(v.load_torch().state_dict())
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
