"""Servings crossed with variants (reco.loadtest.servings): how a model is served is the study's, not a step's."""

from __future__ import annotations

import dataclasses

import pytest

from reco.cli.compose import compose
from reco.config import ConfigError, resolve_config, typed
from reco.graph import plan
from reco.loadtest.config import LoadtestConfig, ServingConfig
from reco.loadtest.servings import cross
from reco.serve.config import FeatureSource, ServeBackend, serve_config
from reco.steps import steps


def test_no_step_serves_a_model_another_way():
    assert not {"batching", "triton"} & set(steps())


def _rows(experiment: str, parent):
    cfg = compose([f"experiment={experiment}"])
    lt = typed(cfg.loadtest, LoadtestConfig, "loadtest")
    rows = cross([(n.name, parent) for n in plan(resolve_config(cfg))], lt.study.servings)
    serve = serve_config(cfg.serve)
    return rows, {r.label: r.settings(serve) for r in rows}, serve


def test_the_case_study_serves_its_student_with_and_without_the_batcher(parent):
    rows, by, serve = _rows("ecommerce_case_study", parent)
    labels = [r.label for r in rows]
    # the pairs the report showed when batching was a step; the Triton pairs moved to serving_backends
    # (issue 29: the study fits its time budget)
    assert labels == [
        "baseline", "pruned", "distilled", "distilled_onnx_int8", "distilled_onnx_int8_batched",
        "baseline_onnx_int8", "baseline_emb_onnx_int8",
    ]  # fmt: skip
    assert by["distilled_onnx_int8"] == dataclasses.replace(
        serve, batching=dataclasses.replace(serve.batching, enabled=False)
    )
    assert (
        by["distilled_onnx_int8_batched"].batching.enabled
        and by["distilled_onnx_int8_batched"].backend == "reco"
    )


def test_serving_backends_crosses_the_student_with_four_servings(parent):
    rows, by, serve = _rows("serving_backends", parent)
    labels = [r.label for r in rows]
    assert {
        "distilled_onnx_int8", "distilled_onnx_int8_batched", "distilled_onnx_int8_triton",
        "distilled_onnx_int8_triton_batched",
    } <= set(labels)  # fmt: skip
    t1, t2 = by["distilled_onnx_int8_triton"], by["distilled_onnx_int8_triton_batched"]
    assert t1.backend == t2.backend == ServeBackend.triton and not t1.batching.enabled and t2.batching.enabled
    assert (t1.triton.instances, t2.triton.instances) == (serve.triton.instances, 2)
    # a serving row is the same model: same files, same digests, named for the pair
    row = next(r for r in rows if r.label == "distilled_onnx_int8_batched").as_variant()
    assert row.name == "distilled_onnx_int8_batched" and row.parent == parent.name
    assert row.sha256 == parent.sha256 and row.dir == parent.dir


def test_request_path_serves_the_student_per_candidate_and_from_redis(parent):
    rows, by, serve = _rows("request_path", parent)
    assert [r.label for r in rows if r.variant.name == parent.name and "int8" in r.label] == [
        "distilled_onnx_int8", "distilled_onnx_int8_per_candidate", "distilled_onnx_int8_redis",
    ]  # fmt: skip
    base = by["distilled_onnx_int8"]
    assert base.user_once and base.features == FeatureSource.memory and not base.batching.enabled
    assert by["distilled_onnx_int8_per_candidate"] == dataclasses.replace(base, user_once=False)
    assert by["distilled_onnx_int8_redis"] == dataclasses.replace(base, features=FeatureSource.redis)
    with pytest.raises(
        ConfigError,
        match=r"servings.x: features: Invalid value .postgres., expected one of \[memory, redis\]",
    ):
        typed({"features": "postgres"}, ServingConfig, "loadtest.study.servings.x")


def test_a_serving_states_only_what_differs_and_bad_values_name_the_key():
    assert typed({}, ServingConfig, "s") == ServingConfig()
    lt = dict(compose().loadtest)
    lt["study"] = {**lt["study"], "servings": {"t": {"backend": "triton", "instances": 0}}}
    with pytest.raises(ConfigError, match=r"loadtest.study.servings.t.instances: expected >= 1"):
        typed(lt, LoadtestConfig, "loadtest")
    with pytest.raises(ConfigError, match="instances: only backend=triton"):
        typed({"instances": 2}, ServingConfig, "loadtest.study.servings.x")


def test_a_serving_row_may_not_shadow_a_variant(parent):
    with pytest.raises(ConfigError, match="servings.batched: the row 'a_batched' would clash"):
        cross([("a", parent), ("a_batched", parent)], {"batched": ServingConfig(batching=True)})
