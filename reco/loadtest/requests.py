"""The request file a load test replays: rows of the test split, so users come with their real popularity.

Each line is one /recommend body: {"user_id": id, "context": {name: value}, "k": k}, taken from a row
drawn uniformly from the test split (a user appears as often as they do in the log). Context features
are that row's context-side features, by schema name.

    python -m reco.cli.requests --dataset data.pt --out requests.jsonl --n 10000 --k 10
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from reco.data.schema import Dataset


def request_bodies(ds: Dataset, n: int, k: int, seed: int) -> list[dict]:
    s, te = ds.schema, ds.test
    if s.user_key is None:
        raise ValueError(f"dataset {ds.name!r}: schema.user_key is None; requests need a user id feature")
    if len(te) == 0:
        raise ValueError(f"dataset {ds.name!r}: empty test split, cannot draw requests")
    rows = np.random.default_rng(seed).integers(0, len(te), size=n)
    ids, lengths, dense = te.ids.numpy()[rows], te.lengths.numpy()[rows], te.dense.numpy()[rows]
    u = s.index(s.user_key)
    ctx_sparse = [(i, f) for i, f in enumerate(s.sparse) if f.side == "context"]
    ctx_dense = [(i, f) for i, f in enumerate(s.dense) if f.side == "context"]
    out = []
    for r in range(n):
        ctx: dict[str, object] = {}
        for i, f in ctx_sparse:
            vals = ids[r, i, : lengths[r, i]].tolist()
            ctx[f.name] = vals[0] if f.max_len == 1 and len(vals) == 1 else vals
        for i, f in ctx_dense:
            ctx[f.name] = float(dense[r, i])
        out.append({"user_id": int(ids[r, u, 0]), "context": ctx, "k": int(k)})
    return out


def write_requests(ds: Dataset | str | Path, out_path: str | Path, n: int, k: int, seed: int) -> Path:
    """Write `n` request bodies (JSON lines) drawn from the test split of `ds` (a Dataset or its .pt)."""
    if not isinstance(ds, Dataset):
        ds = Dataset.load(str(ds))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for body in request_bodies(ds, n, k, seed):
            f.write(json.dumps(body, separators=(",", ":")) + "\n")
    return out
