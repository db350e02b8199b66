"""Retrieval as a stage with its own levers: a two-tower model, its item vectors in FAISS indexes, and the
front of recall@N against per-request latency.

    python -m bench.retrieval_front --dataset .cache/data/<data>.pt            # after a study built it
    python -m bench.retrieval_front --dataset ... --epochs 1 --queries 200      # quicker
    python -m bench.retrieval_front --dataset ... retrieval.two_tower.uniform_negatives=1024  # any override

Trains the two-tower model (reco/retrieval/two_tower.py) on the train split's positives, encodes every
item of the catalogue (each item's latest train row, as the server's feature store holds it) and the
validation split's users (the queries: hyper-parameters are chosen on validation), then for every index
prints recall@N against the exact search, the p50/p99 of one query per call and the speed-up against the
exact search (reco/retrieval/front.py). It also says what the candidates are worth: recall@N of the test
split's positives for the two-tower's exact top-N against reco's heuristic candidates (serve.retrieval),
for the same test users, and their difference per user with a paired bootstrap CI. The settings are
chosen on validation with `python -m bench.two_tower_sweep`; this test figure is for the final report.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from reco.cli.compose import compose
from reco.config import typed
from reco.data.schema import Dataset
from reco.retrieval.ann import IndexSpec
from reco.retrieval.front import front_lines, measure_front
from reco.retrieval.two_tower import SideRows, TwoTower, TwoTowerConfig, encode, side_rows, train_two_tower
from reco.serve.config import serve_config
from reco.serve.features import FeatureStore
from reco.serve.quality import QualityRequests, quality_requests
from reco.stats.topk import mean_ci

DEFAULT_INDEXES = [  # N = 500 candidates: HNSW's beam and IVF's probes must reach that far for recall
    IndexSpec("flat"),
    IndexSpec("ivf_flat", nlist=256, nprobe=16),
    IndexSpec("ivf_flat", nlist=256, nprobe=64),
    IndexSpec("hnsw", M=32, ef_search=128),
    IndexSpec("hnsw", M=32, ef_search=512),
    IndexSpec("hnsw", M=32, ef_search=1024),
    IndexSpec("ivf_pq", nlist=256, nprobe=64, m=8, nbits=8),
]


def candidate_recall(
    model: TwoTower, data: Dataset, store: FeatureStore, reqs: QualityRequests, split: str, n: int
) -> dict[str, np.ndarray]:
    """Per user of `reqs` (drawn from `split`): the share of its positive rows in `split` whose item is among
    the N candidates -- {"two_tower": the exact top-N of its request row's user vector over the store's
    catalogue, "heuristic": the store's heuristic candidates for the user's stored features}."""
    item_ids, ids, mask, dense = store.item_catalogue()
    item_vecs = encode(model.item, SideRows.from_arrays(ids, mask, dense))
    q = encode(model.user, side_rows(data.schema, getattr(data, split), "user", torch.from_numpy(reqs.rows)))
    tops = [  # the set of the N best is all recall needs: argpartition, no sort; in blocks to bound memory
        item_ids[np.argpartition(-(q[a : a + 256] @ item_vecs.T), n, axis=1)[:, :n]]
        for a in range(0, len(q), 256)
    ]
    top = np.concatenate(tops) if tops else np.empty((0, n), np.int64)
    heur = [store.candidates(store.user_row(int(u)), n) for u in reqs.users]
    return {
        "two_tower": np.array(
            [np.isin(rel, row).mean() for rel, row in zip(reqs.relevant, top, strict=True)]
        ),
        "heuristic": np.array([np.isin(rel, c).mean() for rel, c in zip(reqs.relevant, heur, strict=True)]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.retrieval_front", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="a Dataset .pt file (e.g. .cache/data/<data>.pt)")
    p.add_argument("--n", type=int, default=500, help="candidates per request (serve.n_candidates)")
    p.add_argument("--queries", type=int, default=1000, help="validation users whose vectors are the queries")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="FAISS threads per query (the server's); also torch's for training",
    )
    p.add_argument("--epochs", type=int, help="override retrieval.two_tower.epochs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. retrieval.two_tower.temperature=0.1")
    args = p.parse_args(argv)
    cfg = compose(args.overrides)
    tt = typed(cfg.retrieval.two_tower, TwoTowerConfig, "retrieval.two_tower")
    if args.epochs:
        tt.epochs = args.epochs
    data = Dataset.load(args.dataset)
    torch.set_num_threads(args.threads)
    model, report = train_two_tower(data, tt, args.seed)
    serve = serve_config(cfg.serve)
    store = FeatureStore(data, serve.retrieval)
    item_ids, ids, mask, dense = store.item_catalogue()
    item_vecs = encode(model.item, SideRows.from_arrays(ids, mask, dense))
    s, va = data.schema, data.val
    vusers = va.ids[:, s.index(s.user_key), 0].numpy()
    _, first = np.unique(vusers, return_index=True)
    pick = np.random.default_rng(args.seed).permutation(first)[: args.queries]
    queries = encode(model.user, side_rows(s, va, "user", torch.from_numpy(pick)))
    print(
        f"\n{len(item_ids):,} items x {item_vecs.shape[1]} dims, {len(queries):,} validation queries, N={args.n}"
    )
    rows = measure_front(DEFAULT_INDEXES, item_vecs, queries, args.n, args.threads)
    print("", *front_lines(rows), sep="\n")
    # What the candidates are worth: the test positives they contain, two-tower exact vs the heuristic.
    reqs = quality_requests(data, args.queries, args.seed, split="test")
    got = candidate_recall(model, data, store, reqs, "test", args.n)
    print(
        f"\nTest positives among the N={args.n} candidates, {len(reqs.users):,} test users (mean, 95 % bootstrap CI):"
    )
    print(f"- two-tower (exact): {mean_ci(got['two_tower']).fmt('.3f')}")
    print(f"- heuristic ({store.retrieval_name}): {mean_ci(got['heuristic']).fmt('.3f')}")
    print(
        f"- two-tower - heuristic, per user (paired): {mean_ci(got['two_tower'] - got['heuristic']).fmt('+.3f')}"
    )
    print(
        f"\ntwo-tower: {report.epochs} epochs over {report.rows:,} positives in {report.seconds:.0f} s; losses {report.loss}; "
        f"settings {tt}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
