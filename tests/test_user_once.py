"""User and context embedded once per request (issue 30, item 5): the request form of every runtime scores
what the per-candidate form scores on the same rows, for one request and for a dynamic batch of several."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest
import torch

from reco.data import schema
from reco.models.dcn import DCN, DCNConfig
from reco.models.protocol import PlainScorer, RequestScorer, as_requests, request_groups
from reco.runtime import REQUEST_ROLE, load_scorer
from reco.serve.batcher import DynamicBatcher
from reco.steps.accelerate.export import random_batch, real_batch
from reco.variant import ArtifactError, Variant

SIZES = [1, 37, 0, 200, 62]  # uneven requests, one of a single candidate and one of none


def requests_of(model, data, sizes=SIZES, seed=0):
    shared = data.schema.shared_columns
    batch = random_batch(model, sum(sizes), data.test.ids.shape[2], seed=seed)  # pruned ids included
    return as_requests(batch, shared, sizes), shared


def test_shared_columns_are_the_user_and_context_sides(data):
    s = data.schema
    assert [s.sparse[i].name for i in s.shared_columns] == [
        f.name for f in s.sparse if f.side in ("user", "context")
    ]
    assert s.sparse[s.shared_columns[0]].side == "user" and len(s.shared_columns) < len(s.sparse)


@pytest.mark.parametrize("groups", [request_groups, schema.request_groups], ids=["models", "torch-free"])
def test_request_groups_map_rows_to_their_request(groups):
    """Both copies (reco.data.schema's, which the ONNX runtime uses without torch, and the one in
    reco.models.protocol, whose file enters every variant's cache key) map rows alike."""
    first, owner = groups([2, 0, 3])
    assert first.tolist() == [0, 2] and owner.tolist() == [0, 0, 1, 1, 1]
    for sizes in ([1], [3, 0, 0, 2, 5], SIZES):
        assert all(np.array_equal(a, b) for a, b in zip(groups(sizes), request_groups(sizes), strict=True))


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_torch_request_scorer_equals_per_candidate(arch, parent, data):
    model = parent.load_torch()
    if arch == "dcn":
        torch.manual_seed(0)
        model = DCN(
            DCNConfig(
                **{**model.cfg.to_dict(), "bottom": [32], "top": [32], "cross_layers": 2, "low_rank": 8}
            )
        )
    (dense, ids, mask), shared = requests_of(model, data)
    x = [torch.from_numpy(a) for a in (dense, ids, mask)]
    groups = [torch.from_numpy(a) for a in request_groups(SIZES)]
    with torch.inference_mode():
        plain = PlainScorer(model.eval())(*x)
        once = RequestScorer(model, shared)(*x, *groups)
        torch.testing.assert_close(once, plain, rtol=0, atol=1e-6)
        # The control: rows that do NOT share their request's user are scored wrongly by the request
        # form, so the equality above is not vacuous.
        other = random_batch(model, sum(SIZES), data.test.ids.shape[2], seed=9)
        y = [torch.from_numpy(a) for a in other]
        assert (RequestScorer(model, shared)(*y, *groups) - PlainScorer(model)(*y)).abs().max() > 1e-3


def test_request_scorer_refuses_columns_outside_the_model(parent):
    with pytest.raises(ValueError, match="shared columns"):
        RequestScorer(parent.load_torch(), [0, 99])


def test_onnx_request_graph_is_built_checked_and_served(untuned_int8, parent, data):
    v = Variant.load(untuned_int8.dir)
    shared = data.schema.shared_columns
    assert v.runtime["shared_columns"] == shared and REQUEST_ROLE in v.artifacts
    g = onnx.load(str(v.verify(REQUEST_ROLE)))
    assert [i.name for i in g.graph.input] == ["dense", "ids", "mask", "first", "owner"]
    assert (
        sum(n.op_type == "MatMulInteger" for n in g.graph.node) == untuned_int8.metrics["quantized_matmuls"]
    )
    report = json.loads(v.verify("report").read_text())
    assert max(report["request_parity_max_abs"].values()) <= v.step_config["parity_tol"]
    rows, _ = requests_of(parent.load_torch(), data)
    once, plain = load_scorer(v, shared=shared), load_scorer(v)
    np.testing.assert_allclose(once(*rows, SIZES), plain(*rows), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(once(*rows), plain(*rows))  # no sizes: per candidate
    real = as_requests(real_batch(data.test, 300), shared, [300])
    np.testing.assert_allclose(once(*real, [300]), plain(*real), rtol=0, atol=1e-5)


def test_a_batch_job_scores_on_every_thread_asked_and_gets_the_servers_scores(
    untuned_int8, parent, data, monkeypatch
):
    """A server's session tuned to one intra-op thread: a batch job (what users see, accuracy) scores on the
    threads it asks for, and every score is the server's bit for bit, on blocks as large as the study's."""
    import onnxruntime as ort

    v = Variant.load(untuned_int8.dir)
    # as tuning picks it on 2 cores (reco/steps/accelerate/tuning.py)
    v.runtime["ort"] = {"intra_op_num_threads": 1}
    threads: list[int] = []
    real_session = ort.InferenceSession

    def session(path, options, **kw):
        threads.append(options.intra_op_num_threads)
        return real_session(path, options, **kw)

    monkeypatch.setattr(ort, "InferenceSession", session)
    shared = data.schema.shared_columns
    served, batched = load_scorer(v, 2, shared), load_scorer(v, 2, shared, batch=True)
    assert threads == [1, 1, 2, 2]  # plain and request graph each
    sizes = [500] * 8  # served_topk's call: 8 requests of 500 candidates
    rows, _ = requests_of(parent.load_torch(), data, sizes, seed=3)
    np.testing.assert_array_equal(batched(*rows, sizes), served(*rows, sizes))
    np.testing.assert_array_equal(batched(*rows), served(*rows))


def test_a_request_graph_for_other_columns_is_refused(untuned_int8, data):
    with pytest.raises(ArtifactError, match="rebuild the variant"):
        load_scorer(Variant.load(untuned_int8.dir), shared=data.schema.shared_columns[:-1])


def test_dynamic_batch_of_several_users_scores_each_as_alone(parent, data):
    """Three requests of different users coalesced into one call: each gets its own user's scores."""
    shared = data.schema.shared_columns
    model = parent.load_torch()
    sizes = [50, 1, 120]
    blocks = []
    for j, n in enumerate(sizes):
        blocks.append(as_requests(random_batch(model, n, data.test.ids.shape[2], seed=20 + j), shared, [n]))
    once, plain = load_scorer(parent, shared=shared), load_scorer(parent)

    async def run():
        with ThreadPoolExecutor(1) as ex:
            b = DynamicBatcher(once, ex, max_batch=4096, max_queue_delay_ms=50)
            await b.start()
            try:
                out = await asyncio.gather(*(b.score(*blk) for blk in blocks))
            finally:
                await b.stop()
        return out

    scored = asyncio.run(run())
    assert max(s.batch_requests for s in scored) == 3  # really one call for the three
    for s, blk in zip(scored, blocks, strict=True):
        np.testing.assert_allclose(s.probs, plain(*blk), rtol=0, atol=1e-6)
