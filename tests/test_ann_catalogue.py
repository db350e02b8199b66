"""The 1M-item catalogue preset of the ANN front (bench.ann_catalogue): the planted click model's vectors."""

from __future__ import annotations

import numpy as np

from reco.data.synthetic import SyntheticConfig, planted_catalogue
from reco.retrieval.ann import IndexSpec
from reco.retrieval.front import measure_front

CFG = SyntheticConfig(
    n_rows=0, n_users=0, n_items=5_000, n_categories=20, n_brands=100, latent_dim=16, max_recent=8, seed=3
)  # fmt: skip


def test_vectors_are_unit_deterministic_and_cluster_by_category():
    items, users = planted_catalogue(CFG, 50)
    assert items.shape == (5_000, 16) and users.shape == (50, 16) and items.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(items, axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(users, axis=1), 1, atol=1e-5)
    again, _ = planted_catalogue(CFG, 50)
    np.testing.assert_array_equal(items, again)
    # items of one category are more alike than items at random (the structure IVF cells exploit)
    from reco.data.synthetic import _items

    cat = _items(CFG, np.random.default_rng(CFG.seed))["cat"]
    same = items[cat == cat[0]]
    assert (same @ same.T).mean() > (items[:500] @ items[:500].T).mean() + 0.1


def test_front_on_the_catalogue_is_exact_where_the_index_searches_everything():
    items, users = planted_catalogue(CFG, 30)
    rows = measure_front(
        [IndexSpec("flat"), IndexSpec("ivf_flat", nlist=16, nprobe=16), IndexSpec("ivf_flat", nlist=64, nprobe=1)],
        items, users, 100, threads=1, warmup=2,
    )  # fmt: skip
    assert rows[1].recall.value == 1.0  # every cell probed: the exact answer
    assert rows[2].recall.value < 0.9  # one cell of 64: an approximation the front must show
