"""Where the rank time goes (reco.profile): real profiler traces of a real torch model and a real ORT session."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_steps import load_step_config

from reco.models.protocol import as_requests
from reco.profile import STAGES, ProfileConfig, _ort_node_stages, profile_rank
from reco.steps import StepRun, accelerate

CFG = ProfileConfig(enabled=True, calls=5, warmup=1)


@pytest.fixture(scope="module")
def block(data):
    part = data.val.take(np.arange(200))
    return part.dense.numpy(), part.ids.numpy(), part.mask().numpy()


@pytest.fixture(scope="module")
def onnx_variant(parent, data, trainer, tmp_path_factory):
    c = load_step_config("accelerate", {"mode": "onnx_fp32", "tune": {"repeats": 4, "rounds": 1}})
    return accelerate.run(parent, data, c, StepRun("fp32", tmp_path_factory.mktemp("fp32"), trainer))


def _check(p, total_share: float) -> None:
    assert set(p.stages_ms) == set(STAGES)
    assert all(v >= 0 for v in p.stages_ms.values()), p.stages_ms
    # every stage was seen, and the stages account for the call (profiling overhead aside)
    assert p.stages_ms["embedding"] > 0 and p.stages_ms["mlp"] > 0 and p.stages_ms["interaction"] > 0
    assert sum(p.stages_ms.values()) == pytest.approx(p.total_ms, rel=total_share)


@pytest.mark.parametrize("once", [False, True], ids=["per_candidate", "user_once"])
def test_torch_profile_splits_the_call_and_writes_a_chrome_trace(once, parent, block, data, tmp_path):
    shared = data.schema.shared_columns if once else None
    p = profile_rank(
        parent, as_requests(block, shared, [200]) if once else block, tmp_path, CFG, shared=shared
    )
    _check(p, 0.5)
    names = {e["name"] for e in json.loads(p.trace.read_text())["traceEvents"]}
    assert {"reco::head", "reco::mlp.bottom", "reco::mlp.top", "aten::embedding"} <= names


@pytest.mark.parametrize("once", [False, True], ids=["per_candidate", "user_once"])
def test_ort_profile_splits_the_call_by_graph_position(once, onnx_variant, block, data, tmp_path):
    assert onnx_variant.backend == "onnxruntime"
    shared = data.schema.shared_columns if once else None
    p = profile_rank(
        onnx_variant, as_requests(block, shared, [200]) if once else block, tmp_path, CFG, shared=shared
    )
    _check(p, 0.05)  # other is the remainder by construction here
    events = json.loads(p.trace.read_text())
    assert any(e.get("cat") == "Node" for e in events)


def test_ort_node_stages_follow_the_dense_input_and_mlp_scopes(onnx_variant):
    stages = _ort_node_stages(onnx_variant.verify("onnx"), ["/bottom/", "/top/"])
    by_stage = {s: [n for n, st in stages.items() if st == s] for s in STAGES}
    assert any("Gather" in n for n in by_stage["embedding"])  # the table lookups
    assert all("/bottom/" in n or "/top/" in n for n in by_stage["mlp"]) and by_stage["mlp"]
    assert any("MatMul" in n for n in by_stage["interaction"])  # DLRM's pairwise dots
    assert not any("/top/" in n for n in by_stage["embedding"] + by_stage["interaction"])
