"""The triton step: a variant the study serves from Triton (runtime["server"]), beside the same model on reco's server."""

from __future__ import annotations

import dataclasses

import pytest
from test_steps import load_step_config

from reco.cli.compose import compose
from reco.serve.config import ServeBackend, for_variant, serve_config
from reco.steps import StepError, StepRun, get_step


def test_triton_variant_asks_for_triton_and_keeps_the_model(parent, data, trainer, tmp_path):
    cfg = load_step_config("triton", {"instances": 2, "batching": True, "max_queue_delay_ms": 3.0})
    v = get_step("triton").fn(parent, data, cfg, StepRun("t", tmp_path / "t", trainer))
    assert v.runtime["server"] == {"backend": "triton", "instances": 2}
    assert v.runtime["batching"]["enabled"] is True and v.runtime["batching"]["max_queue_delay_ms"] == 3.0
    assert v.sha256["torch"] == parent.sha256["torch"] and v.backend == parent.backend
    serve = serve_config(compose().serve)
    assert serve.backend == ServeBackend.reco
    got = for_variant(serve, v.runtime)
    assert got.backend == ServeBackend.triton and got.triton.instances == 2
    assert dataclasses.replace(got, backend=serve.backend, triton=serve.triton) == serve  # nothing else moves
    assert for_variant(serve, parent.runtime) == serve


def test_triton_step_refuses_zero_instances(parent, data, trainer, tmp_path):
    cfg = load_step_config("triton", {"instances": 0})
    with pytest.raises(StepError, match="triton: instances: expected >= 1"):
        get_step("triton").fn(parent, data, cfg, StepRun("t", tmp_path / "t", trainer))
