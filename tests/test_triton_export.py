"""Triton model repository of an ONNX variant: config.pbtxt parsed against Triton's own ModelConfig schema,
checked against the graph, and the exported model.onnx scored in a real ONNX Runtime session.

Triton's schema comes from tests/data/triton_model_config.txtpb (the descriptor tritonclient ships, as
text) and is loaded with the `protobuf` package alone: tritonclient itself is not a dependency, because
importing its `tritonclient.grpc.model_config_pb2` needs grpcio, and its grpc extra pins protobuf < 7 and
ml-dtypes <= 0.5.4 below the versions onnx/onnxruntime run with here (requirements.lock).
"""

from __future__ import annotations

import hashlib
import shutil
import stat
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

from reco.cli.compose import compose
from reco.cli.export_triton import main, settings
from reco.config import ConfigError, resolve_config
from reco.export.triton import TritonExportError, write_model_repository
from reco.graph import step_config
from reco.runtime import load_scorer
from reco.steps import StepRun, get_step
from reco.steps.accelerate.export import INPUTS, OUTPUT, random_batch
from reco.variant import ArtifactError, Variant

pytestmark = pytest.mark.timeout(240)

SCHEMA = Path(__file__).parent / "data" / "triton_model_config.txtpb"
# Triton's data types by numpy dtype (Triton's model_configuration.md datatypes table), independent of
# the exporter's ONNX -> Triton table.
TRITON_BY_NUMPY = {
    np.dtype(np.float32): "TYPE_FP32",
    np.dtype(np.float64): "TYPE_FP64",
    np.dtype(np.float16): "TYPE_FP16",
    np.dtype(np.int64): "TYPE_INT64",
    np.dtype(np.int32): "TYPE_INT32",
    np.dtype(np.uint8): "TYPE_UINT8",
    np.dtype(np.bool_): "TYPE_BOOL",
}
# The tuned ORT session the variant records (a one-point grid: what the accelerate step keeps).
TUNED = {
    "graph_optimization_level": ["ORT_ENABLE_EXTENDED"],
    "intra_op_num_threads": [2],
    "inter_op_num_threads": [1],
    "execution_mode": ["ORT_SEQUENTIAL"],
}


def model_config_class() -> type:
    """inference.ModelConfig, built from Triton's descriptor."""
    fd = text_format.Parse(SCHEMA.read_text(), descriptor_pb2.FileDescriptorProto())
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("inference.ModelConfig"))


ModelConfig = model_config_class()


def parse(text: str):
    """config.pbtxt as Triton reads it: an unknown field, enum value or wrong type is a ParseError."""
    return text_format.Parse(text, ModelConfig())


def type_name(cfg, value: int) -> str:
    return cfg.DESCRIPTOR.file.enum_types_by_name["DataType"].values_by_number[value].name


def graph_mismatches(cfg, proto: onnx.ModelProto, max_batch: int) -> list[str]:
    """Every way config `cfg` disagrees with the ONNX graph `proto` as Triton's ORT backend would load it."""
    out = []
    weights = {t.name for t in proto.graph.initializer}
    graph = {
        "input": [i for i in proto.graph.input if i.name not in weights],
        "output": list(proto.graph.output),
    }
    for kind, tensors in graph.items():
        entries = list(getattr(cfg, kind))
        if [e.name for e in entries] != [t.name for t in tensors]:
            out.append(f"{kind} names {[e.name for e in entries]} != graph {[t.name for t in tensors]}")
            continue
        for e, t in zip(entries, tensors, strict=True):
            tt = t.type.tensor_type
            want = TRITON_BY_NUMPY[np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))]
            if type_name(cfg, e.data_type) != want:
                out.append(f"{e.name}: data_type {type_name(cfg, e.data_type)} != graph {want}")
            shape = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
            # Triton prepends the batch axis; a reshape entry is the shape the model really takes.
            per_row = list(e.reshape.shape) if e.HasField("reshape") else list(e.dims)
            # Triton: a reshape keeps the element count (and `dims` may not be empty).
            same_size = np.prod(list(e.dims)) == np.prod(per_row)
            if shape[0] != -1 or [-1, *per_row] != shape or not e.dims or not same_size:
                out.append(
                    f"{e.name}: dims {list(e.dims)} (reshape {per_row}) do not give graph shape {shape}"
                )
    if cfg.max_batch_size != max_batch:
        out.append(f"max_batch_size {cfg.max_batch_size} != {max_batch}")
    return out


@pytest.fixture(scope="module")
def onnx_variant(parent, data, trainer, tmp_path_factory) -> Variant:
    """A fp32 ONNX variant of the tiny trained parent, its ORT session tuned to TUNED."""
    spec = get_step("accelerate")
    tune = {"repeats": 2, "rounds": 1, "warmup": 1, "grid": TUNED}
    cfg = step_config(resolve_config(compose()), spec, {"mode": "onnx_fp32", "tune": tune}, "variants.onnx")
    return spec.fn(parent, data, cfg, StepRun("onnx", tmp_path_factory.mktemp("onnx"), trainer))


@pytest.fixture(scope="module")
def repo(onnx_variant, tmp_path_factory) -> Path:
    """The model repository written by the CLI (default settings, default name)."""
    out = tmp_path_factory.mktemp("repo")
    assert main(["--variant", onnx_variant.dir, "--out", str(out)]) == 0
    return out / onnx_variant.name


def test_config_is_a_valid_triton_model_config(repo, onnx_variant):
    cfg = parse((repo / "config.pbtxt").read_text())
    serve = compose().serve
    assert cfg.name == onnx_variant.name == repo.name and cfg.platform == "onnxruntime_onnx"
    assert cfg.max_batch_size == serve.batching.max_batch
    assert cfg.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert cfg.dynamic_batching.max_queue_delay_microseconds == round(
        serve.batching.max_queue_delay_ms * 1000
    )
    assert list(cfg.dynamic_batching.preferred_batch_size) == []
    [group] = cfg.instance_group
    assert group.count == serve.workers and group.kind == group.KIND_CPU
    # The tuned session, in the ORT backend's keys (onnxruntime_backend README).
    assert {k: v.string_value for k, v in cfg.parameters.items()} == {
        "intra_op_thread_count": "2",
        "inter_op_thread_count": "1",
        "execution_mode": "0",
    }
    assert cfg.optimization.graph.level == 1  # ORT_ENABLE_EXTENDED


def test_config_matches_the_graph_and_the_copy_is_the_variants_model(repo, onnx_variant):
    model = repo / "1" / "model.onnx"
    assert hashlib.sha256(model.read_bytes()).hexdigest() == onnx_variant.sha256["onnx"]
    assert all(p.stat().st_mode & stat.S_IROTH for p in (model, repo / "config.pbtxt"))  # any server user
    proto = onnx.load(str(model))
    cfg = parse((repo / "config.pbtxt").read_text())
    assert graph_mismatches(cfg, proto, compose().serve.batching.max_batch) == []
    assert [i.name for i in cfg.input] == list(INPUTS) and [o.name for o in cfg.output] == [OUTPUT]
    probs = cfg.output[0]
    assert list(probs.dims) == [1] and probs.HasField("reshape") and list(probs.reshape.shape) == []


@pytest.mark.parametrize(
    "old, new",
    [
        ("data_type: TYPE_INT64", "data_type: TYPE_INT32"),  # a real Triton type, the wrong one
        ('name: "mask"', 'name: "lengths"'),
        ("    reshape: { shape: [ ] }\n", ""),
        ("dims: [ 1 ]", "dims: [ 2 ]"),
    ],
)
def test_a_wrong_config_is_caught(repo, old, new):
    """The graph check fails on a config that parses but would not load (each edit applied once)."""
    text = (repo / "config.pbtxt").read_text()
    assert old in text
    cfg = parse(text.replace(old, new, 1))
    proto = onnx.load(str(repo / "1" / "model.onnx"))
    assert graph_mismatches(cfg, proto, cfg.max_batch_size)


@pytest.mark.parametrize(
    "old, new", [("TYPE_FP32", "TYPE_FLOAT32"), ("KIND_CPU", "CPU"), ("dims:", "shape:")]
)
def test_a_config_triton_cannot_parse_is_caught(repo, old, new):
    with pytest.raises(text_format.ParseError):
        parse((repo / "config.pbtxt").read_text().replace(old, new, 1))


def test_exported_model_scores_like_the_variant(repo, onnx_variant, parent, data):
    """A batch shaped and typed by the config, run as Triton's ORT backend would set the session up."""
    cfg = parse((repo / "config.pbtxt").read_text())
    rows = 64
    # Valid inputs (ids within each table's cardinality, random lengths) of the model the graph exports.
    feeds = dict(
        zip(INPUTS, random_batch(parent.load_torch(), rows, data.test.ids.shape[2], seed=5), strict=True)
    )
    for entry in cfg.input:
        a = feeds[entry.name]
        assert TRITON_BY_NUMPY[a.dtype] == type_name(cfg, entry.data_type)
        assert list(a.shape) == [rows, *(d if d > 0 else a.shape[i + 1] for i, d in enumerate(entry.dims))]
    so = ort.SessionOptions()
    params = {k: int(v.string_value) for k, v in cfg.parameters.items()}
    so.intra_op_num_threads = params["intra_op_thread_count"]
    so.inter_op_num_threads = params["inter_op_thread_count"]
    so.execution_mode = [ort.ExecutionMode.ORT_SEQUENTIAL, ort.ExecutionMode.ORT_PARALLEL][
        params["execution_mode"]
    ]
    levels = {-1: "ORT_ENABLE_BASIC", 1: "ORT_ENABLE_EXTENDED", 2: "ORT_DISABLE_ALL"}
    so.graph_optimization_level = getattr(
        ort.GraphOptimizationLevel, levels.get(cfg.optimization.graph.level, "ORT_ENABLE_ALL")
    )
    sess = ort.InferenceSession(str(repo / "1" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    [got] = sess.run([cfg.output[0].name], feeds)
    want = load_scorer(Variant.load(onnx_variant.dir))(*(feeds[n] for n in INPUTS))
    assert got.shape == (rows,)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_torch_variant_is_refused_naming_the_accelerate_step(parent, tmp_path, capsys):
    cfg = settings(parent, [])
    with pytest.raises(TritonExportError, match=r"variant 'base'.*backend 'torch'.*accelerate step"):
        write_model_repository(parent.dir, tmp_path, None, cfg)
    assert main(["--variant", parent.dir, "--out", str(tmp_path)]) == 2
    assert "accelerate step" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_tampered_model_is_refused(onnx_variant, tmp_path):
    copy = tmp_path / "tampered"
    shutil.copytree(onnx_variant.dir, copy)
    with open(copy / "model.onnx", "r+b") as f:
        f.seek(-16, 2)
        f.write(b"\x00" * 16)
    with pytest.raises(ArtifactError, match="SHA-256 mismatch"):
        write_model_repository(copy, tmp_path / "repo", "m", settings(onnx_variant, []))
    assert not (tmp_path / "repo" / "m" / "1" / "model.onnx").exists()


def test_batching_variant_settings_and_overrides(onnx_variant, tmp_path):
    """A batching variant's runtime.batching is what reco serves it with; an explicit override still wins."""
    copy = tmp_path / "batched"
    shutil.copytree(onnx_variant.dir, copy)
    v = Variant.load(copy)
    v.runtime["batching"] = {"enabled": True, "max_batch": 3000, "max_queue_delay_ms": 0.5}
    v.save()
    s = settings(v, [])
    assert (s.max_batch_size, s.max_queue_delay_ms) == (3000, 0.5)
    s = settings(v, ["max_batch_size=2500", "preferred_batch_sizes=[1000,2000]", "instance_count=2"])
    model = write_model_repository(copy, tmp_path / "repo", "ranker", s)
    cfg = parse((model / "config.pbtxt").read_text())
    assert cfg.name == "ranker" and cfg.max_batch_size == 2500 and cfg.instance_group[0].count == 2
    assert list(cfg.dynamic_batching.preferred_batch_size) == [1000, 2000]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 500


@pytest.mark.parametrize(
    "override, match",
    [
        (
            ["max_batch_size=100"],
            r"export\.triton\.max_batch_size=100 is below export\.triton\.max_request_rows",
        ),
        (["preferred_batch_sizes=[0]"], r"export\.triton\.preferred_batch_sizes \[0\]"),
        (["max_batchsize=100"], r"export\.triton\.max_batchsize"),
    ],
)
def test_bad_settings_name_the_key(onnx_variant, override, match):
    with pytest.raises(ConfigError, match=match):
        settings(onnx_variant, override)
