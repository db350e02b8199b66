"""The report's retrieval section: the served two-tower stage's index front, measured once beside it."""

from __future__ import annotations

import json

import pytest

from reco.cli.compose import compose
from reco.config import ConfigError
from reco.experiment import experiment_config
from reco.pipeline import front_file, retrieval_label, with_retrieval
from reco.report.context import StudyContext
from reco.report.sections import retrieval


def _exp(cache, *over):
    return experiment_config(
        compose(
            [
                "serve.retrieval.kind=two_tower",
                "serve.retrieval.index={kind: hnsw, M: 8, ef_search: 64}",
                "retrieval.two_tower.epochs=1",
                "retrieval.front.queries=40",
                "retrieval.front.indexes=[{kind: ivf_flat, nlist: 16, nprobe: 16}, {kind: ivf_flat, nlist: 32, nprobe: 1}]",
                f"cache_dir={cache}",
                *over,
            ]
        )
    )


def test_the_front_is_measured_once_with_the_served_index_and_reported(tiny_data, tmp_path):
    import dataclasses

    exp = _exp(tmp_path)
    serve = with_retrieval(exp, tiny_data)
    path = front_file(dataclasses.replace(exp, serve=serve))
    blob = json.loads(path.read_text())
    labels = [r["index"] for r in blob["rows"]]
    assert labels == [
        "flat (exact)", "hnsw M=8 ef_search=64", "ivf_flat nlist=16 nprobe=16", "ivf_flat nlist=32 nprobe=1",
    ]  # fmt: skip
    assert [r["served"] for r in blob["rows"]] == [False, True, False, False]
    recall = {r["index"]: r["recall"]["value"] for r in blob["rows"]}
    assert recall["flat (exact)"] == recall["ivf_flat nlist=16 nprobe=16"] == 1.0  # every cell probed
    assert recall["ivf_flat nlist=32 nprobe=1"] < 1.0
    assert blob["queries"] == 40 and blob["n"] == min(exp.serve.n_candidates, blob["items"])
    stamp = path.stat().st_mtime_ns
    with_retrieval(exp, tiny_data)  # cached: neither trained nor measured again
    assert path.stat().st_mtime_ns == stamp
    ctx = StudyContext("x", "b", 0.005, 0.01, retrieval=retrieval_label(serve), front=blob)
    text = "\n".join(retrieval(ctx))
    assert (
        "two-tower (hnsw M=8 ef_search=64)" in text and "**(served)**" in text and "| flat (exact) |" in text
    )


def test_heuristic_retrieval_is_named_and_points_at_the_front_elsewhere():
    exp = experiment_config(compose([]))
    ctx = StudyContext("x", "b", 0.005, 0.01, retrieval=retrieval_label(exp.serve))
    text = "\n".join(retrieval(ctx))
    assert (
        text.startswith("Candidates: heuristic: popular items of the user's")
        and "experiments/retrieval" in text
    )


def test_a_front_index_the_config_cannot_take_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"retrieval.front.indexes\[0\].*nprobe <= nlist"):
        _exp(tmp_path, "retrieval.front.indexes=[{kind: ivf_flat, nlist: 4, nprobe: 8}]")
