"""A trained retrieval stage on disk, and the candidates it serves.

    save_artifact(dir, model, cfg, item_ids, item_vectors, fingerprint)   # after training (the pipeline)
    r = Retriever(load_artifact(dir, schema, fingerprint), spec, threads)  # a server, at start-up
    r.candidates(user_ids, user_mask, user_dense, n)                       # per request

The directory holds the two-tower weights (`two_tower.pt`, a state dict loaded with weights_only=True),
the catalogue's item ids and vectors (`.npy`, loaded without pickle) and `retrieval.json`: the tower
settings, the dataset fingerprint and each file's SHA-256, checked on load. The index is built from the
vectors when a server starts (seconds for this catalogue), so one trained stage serves every index
setting. Per request the user tower runs on the user's features (online, as a production user tower
does: its features change between requests there) and the index returns the N nearest items.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from reco.retrieval.ann import IndexSpec, build, search
from reco.retrieval.two_tower import SideRows, TwoTower, TwoTowerConfig
from reco.variant import ArtifactError, atomic_write, sha256_file

FILES = {"weights": "two_tower.pt", "item_ids": "item_ids.npy", "item_vectors": "item_vectors.npy"}
MANIFEST = "retrieval.json"


def save_artifact(
    out: Path,
    model: TwoTower,
    cfg: TwoTowerConfig,
    item_ids: np.ndarray,
    item_vectors: np.ndarray,
    fingerprint: str,
) -> Path:
    """Write the stage to `out` (replaced whole: built in a sibling directory, then renamed)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(model.state_dict(), tmp / FILES["weights"])
    np.save(tmp / FILES["item_ids"], np.asarray(item_ids, np.int64), allow_pickle=False)
    np.save(tmp / FILES["item_vectors"], np.asarray(item_vectors, np.float32), allow_pickle=False)
    manifest = {
        "two_tower": dataclasses.asdict(cfg),
        "data_fingerprint": fingerprint,
        "sha256": {role: sha256_file(tmp / f) for role, f in FILES.items()},
    }
    atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


@dataclass(frozen=True)
class RetrievalArtifact:
    dir: Path
    model: TwoTower
    item_ids: np.ndarray  # [n] int64
    item_vectors: np.ndarray  # [n, d] float32


def load_artifact(path: str | Path, schema, fingerprint: str) -> RetrievalArtifact:
    """Load and check a saved stage: ArtifactError when a file is missing or fails its SHA-256, or the
    stage was trained on other data."""
    d = Path(path)
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{d / MANIFEST}: cannot read the retrieval stage's manifest ({e})") from None
    for role, f in FILES.items():
        p = d / f
        if not p.exists() or sha256_file(p) != manifest["sha256"].get(role):
            raise ArtifactError(f"{p}: missing or SHA-256 mismatch (expected {manifest['sha256'].get(role)})")
    if fingerprint and manifest["data_fingerprint"] != fingerprint:
        raise ArtifactError(
            f"{d}: retrieval stage trained on data {manifest['data_fingerprint']}, served with {fingerprint}"
        )
    model = TwoTower(schema, TwoTowerConfig(**manifest["two_tower"]))
    model.load_state_dict(torch.load(d / FILES["weights"], weights_only=True))
    ids = np.load(d / FILES["item_ids"], allow_pickle=False)
    vecs = np.load(d / FILES["item_vectors"], allow_pickle=False)
    if vecs.shape != (len(ids), manifest["two_tower"]["out_dim"]):
        raise ArtifactError(f"{d}: item vectors {vecs.shape} do not match {len(ids)} items x out_dim")
    return RetrievalArtifact(d, model.eval(), ids, vecs)


class Retriever:
    """The user tower and an index over the catalogue's vectors (one per server worker)."""

    def __init__(self, art: RetrievalArtifact, spec: IndexSpec, threads: int = 1) -> None:
        import faiss

        faiss.omp_set_num_threads(threads)
        self.art, self.spec = art, spec
        self.index = build(spec, art.item_vectors)

    @property
    def name(self) -> str:
        return f"two_tower {self.spec.label}"

    @torch.no_grad()
    def candidates(self, ids: np.ndarray, mask: np.ndarray, dense: np.ndarray, n: int) -> np.ndarray:
        """The n nearest items [<= n] int64 to the user of one row: ids [1, Fs, L], mask, dense [1, Ds]."""
        u = SideRows.from_arrays(ids, mask, dense)
        v = self.art.model.user(u.ids, u.lengths, u.dense)
        rows = search(self.index, v.numpy(), min(n, len(self.art.item_ids)))[0]
        return self.art.item_ids[rows[rows >= 0]]
