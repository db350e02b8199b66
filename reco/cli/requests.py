"""The request file a load test replays: rows of the test split, so users come with their real popularity.

Each line is one /recommend body: {"user_id": id, "context": {name: value}, "k": k}, taken from a row
drawn uniformly from the test split (a user appears as often as they do in the log). Context features
are that row's context-side features, by schema name.

    python -m reco.cli.requests --dataset data.pt --out requests.jsonl --n 10000 --k 10
"""

from __future__ import annotations

import argparse
import sys

from reco.loadtest.requests import write_requests


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m reco.cli.requests", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="Dataset .pt file")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--n", type=int, required=True, help="number of requests")
    p.add_argument("--k", type=int, required=True, help="k of every request")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(write_requests(a.dataset, a.out, a.n, a.k, a.seed))


if __name__ == "__main__":
    sys.exit(main())
