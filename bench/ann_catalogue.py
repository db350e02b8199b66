"""Where approximate nearest-neighbour search pays: the FAISS front on a catalogue of a million items.

    python -m bench.ann_catalogue                                   # 1,000,000 items x 32 dims, N = 500
    python -m bench.ann_catalogue --items 200000 --queries 300      # quicker
    python -m bench.ann_catalogue --kinds ivf_flat                  # one kind (beside the exact search)

The served catalogue of the default data has ~99k items, where the exact search takes about a millisecond
and no index reached recall@500 >= 0.95 (experiments/retrieval/README.md). A click log big enough for a
two-tower to see a million items does not fit this machine, so the vectors come from the synthetic data's
planted click model at that size (reco.data.synthetic.planted_catalogue: items clustered by category,
unit length as a two-tower's); the queries are user taste vectors of the same model. For each index:
recall@N against the exact search, p50/p99 of one query per call on `--threads` FAISS threads, the
speed-up against the exact search's p50 with its interval, and the build time (reco/retrieval/front.py).
The IVF cell counts follow the catalogue (about 4 sqrt(n) cells, FAISS's guideline).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from reco.data.synthetic import SyntheticConfig, planted_catalogue
from reco.retrieval.ann import IndexSpec
from reco.retrieval.front import front_lines, measure_front


def specs(n_items: int) -> list[IndexSpec]:
    nlist = 2 ** round(math.log2(4 * math.sqrt(n_items)))
    # N = 500 results need wide searches: IVF probes and HNSW beams well past the usual top-10 settings
    # (measured: at 1M items nprobe=128 of 4,096 cells reached recall@500 0.91, ef_search=1024 0.79).
    return [
        IndexSpec("flat"),
        *(IndexSpec("ivf_flat", nlist=nlist, nprobe=p) for p in (64, 128, 256, 512)),
        *(IndexSpec("hnsw", M=32, ef_search=ef) for ef in (1024, 2048, 4096)),
        *(IndexSpec("ivf_pq", nlist=nlist, nprobe=p, m=16, nbits=8) for p in (128, 256)),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.ann_catalogue", description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32, help="vector width (the two-tower's out_dim)")
    p.add_argument("--queries", type=int, default=500)
    p.add_argument("--n", type=int, default=500, help="candidates per request (serve.n_candidates)")
    p.add_argument("--threads", type=int, default=1, help="FAISS threads per query (the server's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", nargs="+", help="only these index kinds (flat is always measured)")
    args = p.parse_args(argv)
    cfg = SyntheticConfig(
        n_rows=0, n_users=0, n_items=args.items, n_categories=500, n_brands=20000,
        latent_dim=args.dim, max_recent=8, seed=args.seed,
    )  # fmt: skip
    t0 = time.perf_counter()
    items, queries = planted_catalogue(cfg, args.queries)
    print(
        f"{len(items):,} items x {items.shape[1]} dims (planted click model, {time.perf_counter() - t0:.0f} s), "
        f"{len(queries):,} queries, N={args.n}, {args.threads} FAISS thread(s); building and timing each index...",
        flush=True,
    )
    grid = [s for s in specs(len(items)) if s.kind == "flat" or not args.kinds or s.kind in args.kinds]
    rows = measure_front(grid, items, queries, args.n, args.threads)
    print("", *front_lines(rows), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
