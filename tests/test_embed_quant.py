"""embed_quant on a tiny trained parent: real TorchRec quantized tables, real ONNX Runtime sessions, real files."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import pickle
import shutil
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import onnx
import pytest
import torch
from conftest import make_variant
from torchrec.modules.embedding_configs import DataType

from reco.cli.compose import compose
from reco.config import ConfigError, resolve_config
from reco.graph import step_config
from reco.models.dlrm import DLRM, DLRMConfig
from reco.models.protocol import as_requests
from reco.pipeline import measure_accuracy
from reco.runtime import REQUEST_ROLE, load_scorer
from reco.runtime import torchrec_quant as qmodel
from reco.runtime.rowwise import Precision, quantize_table
from reco.serve.config import serve_config
from reco.serve.process import start_server
from reco.steps import StepError, StepRun, get_step
from reco.steps.accelerate.export import random_batch, real_batch
from reco.variant import ArtifactError, Variant

pytestmark = pytest.mark.timeout(240)


def config(overrides: dict | None = None, cli: list[str] | None = None):
    """The step's typed config as the pipeline builds it: composed defaults + a variant's overrides."""
    return step_config(
        resolve_config(compose(cli or [])), get_step("embed_quant"), overrides or {}, "variants.q"
    )


def build(parent: Variant, data, trainer, out: Path, **overrides) -> Variant:
    cfg = config({"tune": None, **overrides})
    return get_step("embed_quant").fn(parent, data, cfg, StepRun(out.name, out, trainer))


def dir_digest(path: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(path).iterdir())}


# One mixed assignment (every precision the kernels offer) used to compare the two runtimes.
MIXED = {
    "user_id": "int8",
    "item_id": "int4",
    "recent_categories": "int2",
    "brand": "fp16",
    "category": "fp32",
}


@pytest.fixture(scope="module")
def torch_q(parent, data, trainer, tmp_path_factory) -> tuple[Variant, dict]:
    """Default settings (sweep over int4/int8/fp16), torch runtime; also the parent's digest before."""
    digest = dir_digest(parent.dir)
    v = build(parent, data, trainer, tmp_path_factory.mktemp("q_torch"), runtime="torch")
    return v, digest


@pytest.fixture(scope="module")
def mixed(parent, data, trainer, tmp_path_factory) -> dict[str, Variant]:
    """The same fixed precisions built for both runtimes."""
    return {
        rt: build(parent, data, trainer, tmp_path_factory.mktemp(f"mixed_{rt}"), runtime=rt, tables=MIXED)
        for rt in ("torch", "onnxruntime")
    }


def test_torch_variant_is_smaller_scores_close_and_leaves_parent_alone(torch_q, parent, data):
    v, before = torch_q
    assert dir_digest(parent.dir) == before
    assert v.backend == "torchrec_quant" and v.parent == "base" and v.step == "embed_quant"
    assert v.artifacts[qmodel.ROLE] == qmodel.FILE and v.sha256[qmodel.ROLE]
    # Served file vs the parent's: every table at int4 or more bits, MLPs unchanged.
    assert v.size_mb < parent.size_mb / 3
    assert v.metrics["emb_size_ratio"] > 3.0
    assert v.metrics["model_size_ratio"] == pytest.approx(parent.size_mb / v.size_mb)
    for f in [t["feature"] for t in parent.model_config["tables"]]:
        assert v.metrics[f"emb_{f}_bits"] in (4.0, 8.0, 16.0)
        assert f"emb_{f}_sens_drop" in v.metrics
    assert v.metrics["emb_val_auc_rel_drop"] <= v.step_config["budget"]
    # Outputs move (the tables changed) but stay within a bounded distance of the parent's.
    batch = real_batch(data.test, 2_000)
    diff = np.abs(load_scorer(v)(*batch) - load_scorer(parent)(*batch))
    assert 0 < diff.max() < 0.02 and diff.mean() < 0.003
    # The pipeline measures it through its own runtime like any variant.
    measure_accuracy(v, data, threads=1)
    assert abs(v.metrics["auc"] - parent.metrics["auc"]) / parent.metrics["auc"] < 0.005
    report = json.loads(v.verify("report").read_text())
    assert report["precision"] == {f: p for f, p in v.runtime["embed_quant"]["precision"].items()}
    assert set(report["solo"]) == set(report["precision"]) and report["mix"]


def test_int4_tables_are_really_4_bit(parent, data, trainer, tmp_path):
    """In the file, in TorchRec's module and in its FBGEMM kernel's memory: half a byte per value."""
    v = build(parent, data, trainer, tmp_path / "int4", precisions=["int4"])
    q8 = build(parent, data, trainer, tmp_path / "int8", precisions=["int8"])
    cfg = DLRMConfig(**parent.model_config)
    rows, d = sum(t.num_rows for t in cfg.tables), cfg.embedding_dim
    state = torch.load(v.verify(qmodel.ROLE), weights_only=True)
    for t in cfg.tables:
        assert state[f"emb.{t.feature}.data"].dtype == torch.uint8
        assert tuple(state[f"emb.{t.feature}.data"].shape) == (t.num_rows, d // 2)
        assert state[f"emb.{t.feature}.scale_bias"].dtype == torch.float16
    model = qmodel.load(v)
    assert {c.data_type for c in model.ebc.embedding_bag_configs()} == {DataType.INT4}
    kernel_bytes = sum(m.weights_host.numel() for m in model.ebc._emb_modules)
    assert abs(kernel_bytes - rows * (d // 2 + 4)) <= 64 * len(cfg.tables)  # + per-table alignment
    # The files differ by exactly the half byte per value the codes save.
    saved = (Path(q8.artifact(qmodel.ROLE)).stat().st_size - Path(v.artifact(qmodel.ROLE)).stat().st_size) / (
        rows * d / 2
    )
    assert 0.95 < saved < 1.05
    assert v.metrics["emb_size_ratio"] == pytest.approx(rows * d * 4 / (rows * (d / 2 + 4)))


def test_sweep_gives_sensitive_tables_more_bits(parent, data, trainer, tmp_path):
    """table_budget 0: a table keeps int2 only if int2 alone costs no validation AUC, else it gets int8."""
    v = build(
        parent, data, trainer, tmp_path / "sweep", precisions=["int8", "int2"], table_budget=0.0, budget=1.0
    )
    bits = {k[4:-5]: b for k, b in v.metrics.items() if k.endswith("_bits")}
    assert set(bits.values()) == {2.0, 8.0}  # the tiny model has tables of both kinds
    for f, b in bits.items():
        assert b == (2.0 if v.metrics[f"emb_{f}_sens_drop"] <= 0 else 8.0), f


def test_a_mix_over_the_budget_raises_tables_and_reports_each_at_its_bits(parent, data, trainer, tmp_path):
    """Every table alone may lose anything (table_budget 1), so all start at int2; the variant's budget then
    raises the most sensitive ones a step at a time. Each table's metrics are at the precision it ended with
    (the report once looked up a precision the sweep had never scored: KeyError 'int4')."""
    budget = 1e-4
    v = build(parent, data, trainer, tmp_path / "raise", precisions=["int2", "int4", "int8", "fp16"],
              table_budget=1.0, budget=budget)  # fmt: skip
    bits = {k[4:-5]: b for k, b in v.metrics.items() if k.endswith("_bits")}
    assert max(bits.values()) > 2.0 and v.metrics["emb_sweep_points"] > len(bits) + 1  # it raised
    assert v.metrics["emb_tables_val_auc_rel_drop"] <= budget
    assert all(f"emb_{f}_val_auc_drop" in v.metrics for f in bits)


def test_unreachable_budget_is_a_step_error(parent, data, trainer, tmp_path):
    with pytest.raises(StepError, match=r"embed_quant\.budget=0\.0000%"):
        build(parent, data, trainer, tmp_path / "b", precisions=["int2"], budget=0.0, table_budget=0.0)


def test_ort_and_torch_runtimes_agree_on_the_same_tables(mixed, parent, data):
    t, o = mixed["torch"], mixed["onnxruntime"]
    assert t.runtime["embed_quant"] == o.runtime["embed_quant"]
    assert o.backend == "onnxruntime"
    for batch in (
        real_batch(data.test, 1_000),
        random_batch(qmodel.load(t), 1_000, data.test.ids.shape[2], seed=3),
    ):
        pt, po = load_scorer(t)(*batch), load_scorer(o)(*batch)
        assert np.abs(pt - po).max() < 1e-5
        assert np.abs(pt - load_scorer(parent)(*batch)).max() > 1e-4  # not the float model in disguise
    # The graph holds each quantized table once, at its precision, and no float copy of it.
    proto = onnx.load(str(o.verify("onnx")))
    inits = {i.name: i for i in proto.graph.initializer}
    u8 = onnx.TensorProto.UINT8
    assert inits["emb_user_id.int8"].data_type == u8 and list(inits["emb_user_id.int8"].dims) == [2001, 16]
    assert list(inits["emb_item_id.int4"].dims) == [1001, 8]
    assert list(inits["emb_recent_categories.int2"].dims) == [51, 4]
    assert inits["emb_brand.fp16"].data_type == onnx.TensorProto.FLOAT16
    floats = [
        i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2
    ]
    assert [list(i.dims) for i in floats if i.dims[1] == 16 and i.dims[0] in (2001, 1001, 51, 101)] == [
        [51, 16]
    ]


def test_request_graph_reads_the_same_quantized_tables(mixed, data):
    """The request graph (user and context once per request) gets the tables' rewrite too."""
    o, shared = mixed["onnxruntime"], data.schema.shared_columns
    proto = onnx.load(str(o.verify(REQUEST_ROLE)))
    assert "emb_user_id.int8" in {i.name for i in proto.graph.initializer}
    sizes = [1, 400, 99]
    rows = as_requests(real_batch(data.test, 500), shared, sizes)
    once, plain = load_scorer(o, shared=shared), load_scorer(o)
    np.testing.assert_allclose(once(*rows, sizes), plain(*rows), rtol=0, atol=1e-5)


def test_dense_int8_on_top_in_one_variant(mixed, parent, data, trainer, tmp_path):
    v = build(parent, data, trainer, tmp_path / "both", runtime="onnxruntime", tables=MIXED, dense_int8=True)
    # build() pins tune=null: ORT's default session settings, no choice made by timing, so the scores
    # below are the same on a busy machine (measured: max diff 0.0022 in every context).
    assert v.runtime["ort"] == {} and "tuning" not in json.loads(v.verify("report").read_text())
    assert v.metrics["quantized_matmuls"] > 0 and v.metrics["float_matmuls"] == 0
    assert v.size_mb < mixed["onnxruntime"].size_mb
    batch = real_batch(data.test, 1_000)
    diff = np.abs(load_scorer(v)(*batch) - load_scorer(mixed["torch"])(*batch))
    assert 0 < diff.max() < 0.01  # dense INT8 moves the scores a little, not the tables


def test_variant_is_served_over_http(torch_q, data, tmp_path):
    """The HTTP service loads the torchrec_quant variant through load_scorer and ranks with it."""
    v, _ = torch_q
    dpath = tmp_path / "data.pt"
    data.save(str(dpath))
    h = start_server(
        Path(v.dir),
        dpath,
        serve_config(compose(["serve.keep_warm=false"]).serve),
        wait=False,
        work_dir=tmp_path / "srv",
    )
    try:
        h.wait_ready(timeout_s=180)
        u = urlparse(h.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        body = json.dumps({"user_id": 1, "k": 5})
        conn.request("POST", "/recommend", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        out = json.loads(r.read())
        conn.close()
        assert r.status == 200 and len(out["items"]) == 5, out
    finally:
        h.stop()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"tables": {"user_id": "int4"}},
            r"embed_quant\.tables\.user_id=int4.*table 'user_id'.*multiple of 16",
        ),
        ({"precisions": ["int8", "int4"]}, r"embed_quant\.precisions lists int4.*tables \['user_id'"),
        ({"tables": {"nope": "int8"}}, r"embed_quant\.tables\.nope: the parent has no table 'nope'"),
        ({"dense_int8": True}, r"embed_quant\.dense_int8=true needs embed_quant\.runtime=onnxruntime"),
        ({"budget": -0.1}, r"embed_quant\.budget must be >= 0"),
    ],
)
def test_bad_settings_are_clear_step_errors(data, trainer, tmp_path, overrides, match):
    """embedding_dim 6: int8 rows pack into 6 bytes (fine), int4 rows into 3 (FBGEMM refuses odd widths)."""
    torch.manual_seed(0)
    model = DLRM(DLRMConfig.from_schema(data.schema, embedding_dim=6, bottom=[8, 6], top=[16]))
    p = Variant("dim6", "train", None, "torch", {}, dir=str(tmp_path / "dim6"))
    p.save_torch(model)
    p.save()
    digest = dir_digest(p.dir)
    # Settings wrong on their own stop at config time (plan()), the rest when the parent is known.
    with pytest.raises((StepError, ConfigError), match=match):
        cfg = config({"tune": None, "runtime": "torch", **overrides})
        get_step("embed_quant").fn(p, data, cfg, StepRun("bad", tmp_path / "bad", trainer))
    assert dir_digest(p.dir) == digest


def test_unknown_precision_is_named_at_compose():
    with pytest.raises(ConfigError, match=r"embed_quant\.tables\.user_id.*'int3'.*int8, int4"):
        compose(["+embed_quant.tables.user_id=int3"])
    assert config(cli=["+embed_quant.tables.user_id=int8"]).tables == {"user_id": Precision.int8}


def test_load_checks_sha256_and_never_unpickles_code(torch_q, tmp_path):
    v, _ = torch_q
    copy = tmp_path / "copy"
    shutil.copytree(v.dir, copy)
    w = Variant.load(copy)
    path = w.artifact(qmodel.ROLE)
    raw = bytearray(path.read_bytes())
    raw[-200] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="SHA-256 mismatch"):
        load_scorer(w)
    # A file whose hash is (re)recorded but that carries a pickled callable: weights_only refuses it.
    marker = tmp_path / "executed"
    torch.save({"x": Evil(str(marker))}, path)
    w.add_artifact(qmodel.ROLE, path.name)
    with pytest.raises(pickle.UnpicklingError):
        load_scorer(w)
    assert not marker.exists()


class Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_rowwise_format_matches_fbgemm_and_torchrec():
    """int4 codes: low nibble first; dequantize = code * scale + bias, as the kernels and the graph compute."""
    w = torch.randn(7, 8)
    q = quantize_table(w, Precision.int4)
    codes = q.data.long()
    digits = torch.stack([codes & 15, codes >> 4], -1).reshape(7, 8).float()
    sb = q.scale_bias.float()
    torch.testing.assert_close(digits * sb[:, :1] + sb[:, 1:], q.dequantize())
    assert (q.dequantize() - w).abs().max() < (w.max(1).values - w.min(1).values).max() / 15
    assert q.nbytes == 7 * (4 + 4)


def test_model_layout_is_unchanged_for_other_backends(tmp_path, data):
    """A plain torch variant still serves model.pt (the new backend only adds a role)."""
    vdir, _ = make_variant(data, tmp_path)
    v = Variant.load(vdir)
    assert v.serving_role == "torch" and load_scorer(v)(*real_batch(data.test, 4)).shape == (4,)


def test_pruned_parent_keeps_its_id_maps_in_both_runtimes(data, trainer, tmp_path):
    """A parent whose tables hold fewer rows than ids (prune's id maps): both runtimes map ids the same way."""
    base = DLRMConfig.from_schema(data.schema, embedding_dim=8, bottom=[16, 8], top=[16])
    for t in base.tables:
        if t.feature in ("user_id", "item_id"):
            t.num_rows = t.cardinality // 3
            base.remapped.append(t.feature)
    torch.manual_seed(1)
    model = DLRM(base)
    for f in base.remapped:
        m = model.id_map(f)
        m.copy_(torch.randint(0, m.numel() // 3, m.shape, dtype=torch.int32))
    p = Variant("pruned", "prune", None, "torch", {}, dir=str(tmp_path / "pruned"))
    p.save_torch(model)
    p.save()
    over = {"precisions": ["int4"], "budget": 1.0, "sweep_rows": 500}
    t = build(p, data, trainer, tmp_path / "t", runtime="torch", **over)
    o = build(p, data, trainer, tmp_path / "o", runtime="onnxruntime", **over)
    assert qmodel.load(t).id_map("user_id").equal(model.id_map("user_id"))
    batch = random_batch(model, 500, data.test.ids.shape[2], seed=2)  # ids over the full cardinality
    assert np.abs(load_scorer(t)(*batch) - load_scorer(o)(*batch)).max() < 1e-5
