"""Two-tower training settings chosen on validation: for each setting, train, then the share of validation
users' positives among the N=500 candidates, two-tower exact top-N vs the heuristic, for the same users.

    python -m bench.two_tower_sweep --dataset .cache/data/<data>.pt                       # the default grid
    python -m bench.two_tower_sweep --dataset ... --setting "" --setting "epochs=3 temperature=0.1"
    python -m bench.two_tower_sweep --dataset ... --users 2000 --setting "" \
        --setting "embedding_dim=32 hidden=[64] out_dim=32 epochs=2 drop_features=[]"  # issue 30's choice

A setting is space-separated `retrieval.two_tower` overrides on top of conf/config.yaml ("" is the
defaults); the first setting is the reference the others are compared with. The requests are up to
`--users` users with a positive in the val split (reco.serve.quality.quality_requests, split="val"), each
with its first positive val row's user features; its relevant items are its val positives. The test split
is not read: it is for the final report (`python -m bench.retrieval_front`). Every interval is a
percentile bootstrap over users (reco.stats.topk.mean_ci); a difference is per user, so it is paired.
Runs one after another, on one torch thread (`--threads`).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.retrieval_front import candidate_recall
from reco.cli.compose import compose
from reco.config import typed
from reco.data.schema import Dataset
from reco.retrieval.two_tower import TwoTowerConfig, train_two_tower
from reco.serve.config import serve_config
from reco.serve.features import FeatureStore
from reco.serve.quality import quality_requests
from reco.stats.topk import mean_ci

DEFAULT_GRID = [  # the defaults (chosen with this tool, experiments/retrieval/README.md), then one lever each
    "",
    "embedding_dim=32 hidden=[64] out_dim=32 epochs=2 drop_features=[]",  # the defaults before issue 30
    "drop_features=[]",
    "epochs=8",
    "uniform_negatives=1024",
    "temperature=0.1",
    "logq=false",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.two_tower_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="a Dataset .pt file (e.g. .cache/data/<data>.pt)")
    p.add_argument(
        "--setting", action="append", help="retrieval.two_tower overrides, e.g. 'epochs=3 lr=0.001'"
    )
    p.add_argument("--n", type=int, default=500, help="candidates per request (serve.n_candidates)")
    p.add_argument("--users", type=int, default=2000, help="validation users with a positive")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    settings = args.setting if args.setting is not None else DEFAULT_GRID
    torch.set_num_threads(args.threads)
    data = Dataset.load(args.dataset)
    base = compose([])
    store = FeatureStore(data, serve_config(base.serve).retrieval)
    reqs = quality_requests(data, args.users, args.seed, split="val")
    print(
        f"{len(reqs.users):,} validation users with a positive, N={args.n}, heuristic: {store.retrieval_name}"
    )
    rows, ref, heur = [], None, None
    for setting in settings:
        cfg = compose([f"retrieval.two_tower.{o}" for o in setting.split()])
        tt = typed(cfg.retrieval.two_tower, TwoTowerConfig, "retrieval.two_tower")
        t0 = time.time()
        model, report = train_two_tower(data, tt, args.seed, say=lambda m: print(m, flush=True))
        got = candidate_recall(model, data, store, reqs, "val", args.n)
        tt_r, heur = got["two_tower"], got["heuristic"]
        ref = tt_r if ref is None else ref
        row = (
            setting or "(defaults)",
            f"{report.loss[-1]:.3f}",
            mean_ci(tt_r).fmt(".3f"),
            mean_ci(tt_r - heur).fmt("+.3f"),
            mean_ci(tt_r - ref).fmt("+.3f") if tt_r is not ref else "--",
            f"{time.time() - t0:.0f}",
        )
        rows.append(row)
        print("| " + " | ".join(row) + " |", flush=True)
    print(
        f"\nValidation positives among the N={args.n} candidates, {len(reqs.users):,} val users "
        f"(mean, 95 % bootstrap CI); heuristic ({store.retrieval_name}): {mean_ci(heur).fmt('.3f')}\n"
    )
    print(
        "| setting (retrieval.two_tower) | last loss | two-tower recall@N [CI] | − heuristic, paired [CI] "
        f"| − {settings[0] or '(defaults)'}, paired [CI] | s |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
