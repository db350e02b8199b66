"""Retrieval: FAISS indexes as levers (settings refused with the setting named, recall against the exact
search), the front's figures, and the two-tower model trained on the tiny data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reco.cli.compose import compose
from reco.config import ConfigError, typed
from reco.retrieval.ann import IndexSpec, build, search
from reco.retrieval.front import measure_front, recall_at_n
from reco.retrieval.two_tower import (
    TwoTowerConfig,
    batch_logits,
    catalogue_rows,
    encode,
    sample_uniform,
    side_rows,
    train_two_tower,
)


def clustered(n: int, d: int = 16, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(32, d))
    x = centres[rng.integers(0, 32, n)] + 0.3 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            IndexSpec("ivf_flat", nlist=16, nprobe=32),
            r"expected 1 <= nprobe <= nlist, got nprobe=32, nlist=16",
        ),
        (IndexSpec("ivf_pq", nlist=16, nprobe=4, m=5), r"m=5 must divide the vector dimension 16"),
        (IndexSpec("ivf_pq", nlist=16, nprobe=4, m=4, nbits=12), r"at least 2\^nbits = 4096 items"),
        (IndexSpec("ivf_pq", nlist=16, nprobe=4, m=4, nbits=20), r"expected m >= 1 and 1 <= nbits <= 16"),
        (
            IndexSpec("ivf_flat", nlist=5000, nprobe=1),
            r"nlist=5000 cells need at least as many items, got 2000",
        ),
        (IndexSpec("hnsw", M=1, ef_search=8), r"expected M >= 2"),
        (IndexSpec("annoy"), r"kind 'annoy': expected one of"),
    ],
)
def test_a_setting_the_index_cannot_take_is_refused_before_building(spec, message):
    with pytest.raises(ConfigError, match=message):
        build(spec, clustered(2000))


def test_a_bad_index_setting_in_the_config_names_its_key():
    with pytest.raises(
        ConfigError, match=r"serve.retrieval.index ivf_flat nlist=8 nprobe=9: expected 1 <= nprobe"
    ):
        compose_serve("retrieval.index={kind: ivf_flat, nlist: 8, nprobe: 9}")


def compose_serve(*overrides: str):
    from reco.serve.config import serve_config

    return serve_config(compose([f"serve.{o}" for o in overrides]).serve)


def test_indexes_against_the_exact_search():
    items, queries = clustered(5000), clustered(200, seed=1)
    exact = search(build(IndexSpec("flat"), items), queries, 50)
    truth = np.argsort(-(queries @ items.T), axis=1)[:, :50]
    assert recall_at_n(exact, truth).mean() > 0.999  # ties aside, the flat index is the exact search
    full = build(IndexSpec("ivf_flat", nlist=32, nprobe=32), items)  # every cell probed: exact again
    assert recall_at_n(search(full, queries, 50), exact).mean() > 0.999
    one = build(IndexSpec("ivf_flat", nlist=32, nprobe=1), items)
    assert recall_at_n(search(one, queries, 50), exact).mean() < 0.999  # a lever with a price

    rows = measure_front(
        [
            IndexSpec("flat"),
            IndexSpec("hnsw", M=16, ef_search=64),
            IndexSpec("ivf_pq", nlist=32, nprobe=8, m=4),
        ],
        items,
        queries,
        50,
        threads=1,
    )
    flat, hnsw, pq = rows
    assert flat.recall.value == 1.0 and flat.speedup.value == pytest.approx(1.0)
    assert hnsw.recall.value > 0.8 and 0 <= hnsw.recall.lo <= hnsw.recall.value <= hnsw.recall.hi <= 1
    assert pq.recall.value < 1.0 and all(r.p50_ms.n == 200 and r.p50_ms.value > 0 for r in rows)


def test_two_tower_learns_who_clicks_what(tiny_data):
    cfg = typed(compose([]).retrieval.two_tower, TwoTowerConfig, "retrieval.two_tower")
    cfg.epochs, cfg.batch_size = 3, 256
    model, report = train_two_tower(tiny_data, cfg, seed=0, say=lambda _: None)
    assert len(report.loss) == 3 and report.loss[-1] < report.loss[0]
    s, va = tiny_data.schema, tiny_data.val
    pos = torch.nonzero(va.labels > 0.5).flatten()[:500]
    u = encode(model.user, side_rows(s, va, "user", pos))
    i = encode(model.item, side_rows(s, va, "item", pos))
    np.testing.assert_allclose(np.linalg.norm(u, axis=1), 1.0, rtol=1e-5)
    shuffled = i[np.random.default_rng(0).permutation(len(i))]
    # On held-out positives, a user's vector is closer to the item it clicked than to another user's item.
    assert (u * i).sum(1).mean() > (u * shuffled).sum(1).mean() + 0.05


def test_a_negative_count_of_uniform_negatives_names_its_key():
    with pytest.raises(ConfigError, match=r"retrieval.two_tower.uniform_negatives: expected >= 0.*got -1"):
        typed(
            compose(["retrieval.two_tower.uniform_negatives=-1"]).retrieval.two_tower,
            TwoTowerConfig,
            "retrieval.two_tower",
        )
    with pytest.raises(ConfigError, match=r"retrieval.two_tower: logq: .*not a valid bool"):
        typed(
            compose(["retrieval.two_tower.logq=sometimes"]).retrieval.two_tower,
            TwoTowerConfig,
            "retrieval.two_tower",
        )


def test_uniform_negatives_come_from_the_whole_catalogue(tiny_data):
    s, tr = tiny_data.schema, tiny_data.train
    ids, rows = catalogue_rows(s, tr)
    col = tr.ids[:, s.index(s.item_key), 0]
    assert ids.tolist() == sorted(set(col.tolist()) - {0})
    assert (col[rows] == ids).all()  # each item's own row ...
    for item, row in list(zip(ids.tolist(), rows.tolist(), strict=True))[:50]:
        assert row == int(torch.nonzero(col == item).max())  # ... its latest one
    drawn = ids[sample_uniform(ids, 20_000, torch.Generator().manual_seed(0))]
    clicked = set(col[tr.labels > 0.5].tolist())
    assert set(drawn.tolist()) <= set(ids.tolist())
    # Uniform, not by popularity: items nobody clicked in train are drawn too, in proportion to their number.
    never = ~torch.isin(drawn, torch.tensor(sorted(clicked)))
    share = (~torch.isin(ids, torch.tensor(sorted(clicked)))).float().mean()
    assert never.float().mean() == pytest.approx(float(share), abs=0.02) and share > 0.05


def test_a_sampled_negative_equal_to_the_positive_is_not_a_negative():
    torch.manual_seed(0)
    user, item, neg = (torch.nn.functional.normalize(torch.randn(n, 8), dim=1) for n in (3, 3, 4))
    pos_ids, neg_ids = torch.tensor([5, 6, 5]), torch.tensor([6, 9, 5, 7])
    logits = batch_logits(user, item, pos_ids, neg, neg_ids, None, 0.1)
    masked = torch.isinf(logits)
    want = torch.zeros(3, 7, dtype=torch.bool)
    want[0, 2] = want[2, 0] = True  # rows 0 and 2 share item 5: not each other's negative
    want[0, 5] = want[2, 5] = want[1, 3] = True  # the drawn 5 for rows 0 and 2, the drawn 6 for row 1
    assert masked.tolist() == want.tolist()
    assert torch.isfinite(logits.diagonal()).all()


def test_the_logq_correction_is_the_mixture_the_candidates_were_drawn_from():
    torch.manual_seed(0)
    user, item, neg = (torch.nn.functional.normalize(torch.randn(n, 8), dim=1) for n in (4, 4, 2))
    pos_ids, neg_ids = torch.tensor([1, 2, 3, 4]), torch.tensor([7, 8])
    q = torch.tensor([0.0, 0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0])
    target = torch.arange(4)
    plain = batch_logits(user, item, pos_ids, None, None, None, 0.05)
    # In-batch only: log(B q) differs from log q by a constant per row, which the softmax ignores.
    by_q = nn_ce(batch_logits(user, item, pos_ids, None, None, torch.log(q), 0.05), target)
    assert by_q == pytest.approx(
        nn_ce(batch_logits(user, item, pos_ids, None, None, torch.log(4 * q), 0.05), target)
    )
    assert by_q != pytest.approx(nn_ce(plain, target))  # the correction changes the loss
    mixed = torch.log(4 * q + 2 / 8)
    got = batch_logits(user, item, pos_ids, neg, neg_ids, mixed, 0.05)
    want = torch.cat([user @ item.T, user @ neg.T], 1) / 0.05 - mixed[torch.cat([pos_ids, neg_ids])]
    torch.testing.assert_close(got, want)


def test_a_dropped_feature_is_not_read_and_an_unknown_one_is_refused(tiny_data):
    from reco.retrieval.two_tower import TwoTower

    def config(*overrides):
        tt = compose([f"retrieval.two_tower.{o}" for o in overrides]).retrieval.two_tower
        return typed(tt, TwoTowerConfig, "retrieval.two_tower")

    s = tiny_data.schema
    torch.manual_seed(0)
    model = TwoTower(s, config("drop_features=[user_id,item_pop]"))
    assert model.user.features == ["user_segment", "user_recent_categories"]
    assert not any("user_id" in k for k in model.user.state_dict())
    pos = torch.nonzero(tiny_data.val.labels > 0.5).flatten()[:64]
    u, i = side_rows(s, tiny_data.val, "user", pos), side_rows(s, tiny_data.val, "item", pos)
    other_user, other_pop = u.ids.clone(), i.dense.clone()
    other_user[:, 0] = 1  # every row the same user id
    other_pop[:, s_dense_pos(s, "item", "item_pop")] = 9.0
    torch.testing.assert_close(
        model.user(other_user, u.lengths, u.dense), model.user(u.ids, u.lengths, u.dense)
    )
    torch.testing.assert_close(model.item(i.ids, i.lengths, other_pop), model.item(i.ids, i.lengths, i.dense))
    full = TwoTower(s, config("drop_features=[]"))
    assert not torch.allclose(full.user(other_user, u.lengths, u.dense), full.user(u.ids, u.lengths, u.dense))
    with pytest.raises(
        ConfigError, match=r"retrieval.two_tower.drop_features: \['userid'\] are not features"
    ):
        TwoTower(s, config("drop_features=[userid]"))
    with pytest.raises(ConfigError, match=r"item tower has no item-side sparse feature left"):
        TwoTower(s, config("drop_features=[item_id,category,brand]"))


def s_dense_pos(schema, side: str, name: str) -> int:
    return [f.name for f in schema.dense if f.side == side].index(name)


def nn_ce(logits: torch.Tensor, target: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits, target))


def test_two_tower_trains_with_uniform_negatives_and_without_logq(tiny_data):
    cfg = typed(
        compose(
            ["retrieval.two_tower.uniform_negatives=128", "retrieval.two_tower.logq=false"]
        ).retrieval.two_tower,
        TwoTowerConfig,
        "retrieval.two_tower",
    )
    cfg.epochs, cfg.batch_size = 3, 256
    _, report = train_two_tower(tiny_data, cfg, seed=0, say=lambda _: None)
    assert len(report.loss) == 3 and report.loss[-1] < report.loss[0]


def test_validation_requests_are_drawn_from_the_val_split(tiny_data):
    from reco.serve.quality import quality_requests

    s, va = tiny_data.schema, tiny_data.val
    reqs = quality_requests(tiny_data, 50, seed=1, split="val")
    assert len(reqs.users) == 50
    users = va.ids[:, s.index(s.user_key), 0].numpy()
    items = va.ids[:, s.index(s.item_key), 0].numpy()
    pos = va.labels.numpy() > 0.5
    assert (users[reqs.rows] == reqs.users).all() and pos[reqs.rows].all()
    for u, rel in zip(reqs.users, reqs.relevant, strict=True):
        assert sorted(rel.tolist()) == sorted(items[pos & (users == u)].tolist())
    assert quality_requests(tiny_data, 50, seed=1).rows.tolist() != reqs.rows.tolist()  # test by default
    assert reqs.split == "val"  # what served_topk and planted_gains read the contexts from
    with pytest.raises(ValueError, match=r"split 'tran': expected one of \('train', 'val', 'test'\)"):
        quality_requests(tiny_data, 50, seed=1, split="tran")


@pytest.fixture(scope="module")
def stage(tiny_data, tmp_path_factory):
    """A trained two-tower stage for the tiny data, as the pipeline makes it (with_retrieval)."""
    from reco.experiment import experiment_config
    from reco.pipeline import with_retrieval

    cache = tmp_path_factory.mktemp("cache")
    exp = experiment_config(
        compose(["serve.retrieval.kind=two_tower", "retrieval.two_tower.epochs=1", f"cache_dir={cache}"])
    )
    serve = with_retrieval(exp, tiny_data)
    assert with_retrieval(exp, tiny_data).retrieval.artifact == serve.retrieval.artifact  # trained once
    return serve


def test_a_saved_stage_is_checked_on_load(stage, tiny_data, tmp_path):
    import shutil

    from reco.retrieval.artifact import load_artifact
    from reco.variant import ArtifactError

    art = load_artifact(stage.retrieval.artifact, tiny_data.schema, tiny_data.fingerprint)
    out_dim = compose([]).retrieval.two_tower.out_dim
    assert art.item_vectors.shape == (len(art.item_ids), out_dim) and (art.item_ids > 0).all()
    with pytest.raises(ArtifactError, match="trained on data .* served with other"):
        load_artifact(stage.retrieval.artifact, tiny_data.schema, "other")
    bad = tmp_path / "bad"
    shutil.copytree(stage.retrieval.artifact, bad)
    vec = np.load(bad / "item_vectors.npy")
    np.save(bad / "item_vectors.npy", vec + 1)
    with pytest.raises(ArtifactError, match="item_vectors.npy: missing or SHA-256 mismatch"):
        load_artifact(bad, tiny_data.schema, tiny_data.fingerprint)


def test_a_server_retrieves_its_candidates_from_the_index(stage, tiny_data, tmp_path):
    import dataclasses

    from conftest import make_variant
    from test_serve import Client, a_test_row

    from reco.serve.features import FeatureStore
    from reco.serve.process import ServerStartError, start_server

    vdir, dpath = make_variant(tiny_data, tmp_path, onnx=True)
    cfg = dataclasses.replace(stage, keep_warm=False, n_candidates=50)
    store = FeatureStore(tiny_data, cfg.retrieval)
    body = a_test_row(tiny_data)
    want = store.candidates(store.user_row(body["user_id"]), 50)
    assert len(want) == 50 and len(set(want.tolist())) == 50
    with start_server(vdir, dpath, cfg, work_dir=tmp_path / "srv") as h:
        assert h.health()["retrieval"] == "two_tower flat (exact)"
        c = Client(h.url)
        status, headers, resp = c.recommend({**body, "k": 10})
        c.close()
    assert status == 200 and {it["item_id"] for it in resp["items"]} <= set(want.tolist())
    assert "retrieval;dur=" in headers["server-timing"]
    untrained = dataclasses.replace(cfg, retrieval=dataclasses.replace(cfg.retrieval, artifact=None))
    with pytest.raises(
        ServerStartError, match="serve.retrieval.kind=two_tower needs serve.retrieval.artifact"
    ):
        start_server(vdir, dpath, untrained, work_dir=tmp_path / "srv2", timeout_s=120)
