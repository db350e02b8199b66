"""Correctness under load for a batched serving (reco.loadtest.correctness): a dynamic-INT8 variant's scores
depend on the other requests in its model call, which the check measures offline and allows for, while a
batcher that shifts rows is still caught; a static-INT8 variant does not, and keeps the unbatched tolerance. The served records are made here the way the batcher scores
(whole requests concatenated into one call of the served runtime), on a real ONNX Runtime session."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from reco.cli.compose import compose
from reco.graph import step_config
from reco.loadtest.correctness import _block, check_scores
from reco.loadtest.outcome import BATCH_MARGIN, CorrectnessCheck
from reco.loadtest.requests import write_requests
from reco.runtime import batch_invariant, load_scorer
from reco.serve.config import ServeConfig, serve_config
from reco.serve.features import FeatureStore
from reco.steps import StepRun, accelerate, get_step
from reco.variant import Variant

TOL = 1e-5
PAYLOADS = range(0, 24, 4)  # each scored in one call with the next three requests of the file


def batched_serve() -> ServeConfig:
    return serve_config(compose(["serve.n_candidates=50", "serve.batching.enabled=true"]).serve)


def served_records(
    variant: Variant, data, serve: ServeConfig, requests: Path, out: Path, shift: int = 0
) -> Path:
    """The .scores.jsonl a batched server would have written: every PAYLOADS request scored in one call
    with its three successors through the server's runtime; `shift` moves the scores by rows (a bug)."""
    bodies = requests.read_text().splitlines()
    store = FeatureStore(data, serve.retrieval)
    scorer = load_scorer(variant, threads=1, shared=data.schema.shared_columns)
    with open(out, "w") as f:
        for i in PAYLOADS:
            blocks = [_block(bodies[j], store, serve) for j in range(i, i + 4)]
            sizes = [len(items) for items, _ in blocks]
            probs = scorer(*(np.concatenate([b[k] for _, b in blocks]) for k in range(3)), sizes)
            items, mine = blocks[0][0], np.roll(probs[: sizes[0]], shift)
            f.write(
                json.dumps(
                    {"payload": i, "items": [[int(a), float(p)] for a, p in zip(items, mine, strict=True)]}
                )
                + "\n"
            )
    return out


def test_a_batched_dynamic_int8_serving_is_held_to_its_batch_spread(untuned_int8, data, tmp_path):
    serve = batched_serve()
    requests = write_requests(data, tmp_path / "requests.jsonl", 40, 10, seed=0)
    good = served_records(untuned_int8, data, serve, requests, tmp_path / "good.jsonl")
    check = check_scores(untuned_int8, data, serve, requests, [good], TOL)
    # dynamic INT8 takes activation scales from the whole call: scores move with the company, beyond fp32's
    # tolerance, and the check passes them only through the spread it measured
    assert check.batch_spread > TOL and check.allowed == pytest.approx(BATCH_MARGIN * check.batch_spread)
    assert not check.batch_invariant and not batch_invariant(untuned_int8)
    assert TOL < check.max_abs_diff <= check.allowed and check.passed
    alone = check_scores(untuned_int8, data, dataclasses.replace(serve, batching=dataclasses.replace(
        serve.batching, enabled=False)), requests, [good], TOL)  # fmt: skip
    assert not alone.passed and alone.batch_spread == 0.0 and alone.allowed == TOL
    # a batcher that hands a request its neighbour rows' scores is far outside the spread
    shifted = served_records(untuned_int8, data, serve, requests, tmp_path / "shifted.jsonl", shift=1)
    bad = check_scores(untuned_int8, data, serve, requests, [shifted], TOL)
    assert not bad.passed and bad.max_abs_diff > 10 * bad.allowed


def test_a_batched_fp32_serving_keeps_the_fp32_tolerance(parent, data, tmp_path):
    serve = batched_serve()
    requests = write_requests(data, tmp_path / "requests.jsonl", 40, 10, seed=0)
    records = served_records(parent, data, serve, requests, tmp_path / "fp32.jsonl")
    check = check_scores(parent, data, serve, requests, [records], TOL)
    assert check.passed and check.batch_spread < TOL / BATCH_MARGIN and check.allowed == TOL


def test_a_batched_static_int8_serving_keeps_the_unbatched_tolerance(parent, data, trainer, tmp_path):
    """Static INT8 fixes every activation scale at calibration, so a request's scores do not depend on its
    batch-mates: the check gives it no batch allowance, and a batcher that shifts rows still fails it."""
    over = {
        "mode": "onnx_int8",
        "tune": None,
        "auc_guard": 1.0,
        "quantize": {"static": True, "calibration_batches": 2},
    }
    cfg = step_config(compose(), get_step("accelerate"), over, "variants.static")
    static = accelerate.run(parent, data, cfg, StepRun("static", tmp_path / "static", trainer))
    assert static.metrics["quantized_matmuls"] == static.metrics["mlp_layers"] and batch_invariant(static)
    serve = batched_serve()
    requests = write_requests(data, tmp_path / "requests.jsonl", 40, 10, seed=0)
    records = served_records(static, data, serve, requests, tmp_path / "static.jsonl")
    check = check_scores(static, data, serve, requests, [records], TOL)
    assert check.batch_invariant and check.allowed == TOL
    assert check.batch_spread <= TOL and check.max_abs_diff <= TOL and check.passed
    shifted = served_records(static, data, serve, requests, tmp_path / "shifted.jsonl", shift=1)
    bad = check_scores(static, data, serve, requests, [shifted], TOL)
    assert not bad.passed and bad.max_abs_diff > 10 * TOL


def test_a_batch_invariant_runtime_gets_no_batch_allowance():
    """Were a batch-invariant runtime's scores to move with its company, that is a failure, not a margin."""
    assert CorrectnessCheck(10, 3e-5, TOL, False, 1e-4, batch_invariant=True).allowed == TOL
    assert CorrectnessCheck(10, 3e-5, TOL, False, 1e-4, batch_invariant=False).allowed == BATCH_MARGIN * 1e-4
