"""Approximate-nearest-neighbour indexes over item vectors (FAISS), as levers like prune and distill.

Every index searches by inner product (the two-tower vectors are unit length, so it is cosine):

    flat      IndexFlatIP: exact, the reference every other index's recall is measured against
    ivf_flat  IndexIVFFlat: k-means into `nlist` cells, search the `nprobe` nearest cells
    hnsw      IndexHNSWFlat: a graph of `M` links per node, searched with a beam of `ef_search`
    ivf_pq    IndexIVFPQ: IVF cells, vectors compressed to `m` sub-quantizers of `nbits` bits each

A setting the index cannot take is refused before anything is built, naming the setting and what was
expected (nprobe > nlist, m not dividing the dimension, fewer items than the training needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reco.config import ConfigError

KINDS = ("flat", "ivf_flat", "hnsw", "ivf_pq")


@dataclass
class IndexSpec:  # not frozen: OmegaConf merges YAML into it (serve.retrieval.index)
    kind: str
    nlist: int = 0  # ivf_*: k-means cells
    nprobe: int = 0  # ivf_*: cells searched per query
    M: int = 0  # hnsw: links per node
    ef_search: int = 0  # hnsw: search beam width
    m: int = 0  # ivf_pq: sub-quantizers (must divide the dimension)
    nbits: int = 8  # ivf_pq: bits per sub-quantizer code

    @property
    def label(self) -> str:
        return {
            "flat": "flat (exact)",
            "ivf_flat": f"ivf_flat nlist={self.nlist} nprobe={self.nprobe}",
            "hnsw": f"hnsw M={self.M} ef_search={self.ef_search}",
            "ivf_pq": f"ivf_pq nlist={self.nlist} nprobe={self.nprobe} m={self.m} nbits={self.nbits}",
        }.get(self.kind, self.kind)

    def check(self, where: str = "serve.retrieval.index") -> None:
        """The settings alone (reco.config.typed calls it): ConfigError naming `where` and the setting."""
        at = f"{where} {self.label}"
        if self.kind not in KINDS:
            raise ConfigError(f"{where}: kind {self.kind!r}: expected one of {list(KINDS)}")
        if self.kind in ("ivf_flat", "ivf_pq") and not 1 <= self.nprobe <= self.nlist:
            raise ConfigError(
                f"{at}: expected 1 <= nprobe <= nlist, got nprobe={self.nprobe}, nlist={self.nlist}"
            )
        if self.kind == "hnsw" and (self.M < 2 or self.ef_search < 1):
            raise ConfigError(
                f"{at}: expected M >= 2 and ef_search >= 1, got M={self.M}, ef_search={self.ef_search}"
            )
        if self.kind == "ivf_pq" and (self.m < 1 or not 1 <= self.nbits <= 16):
            raise ConfigError(
                f"{at}: expected m >= 1 and 1 <= nbits <= 16, got m={self.m}, nbits={self.nbits}"
            )

    def fits(self, dim: int, n_items: int, where: str = "serve.retrieval.index") -> None:
        """check(), and that the index can be built over n_items vectors of `dim` (ConfigError otherwise)."""
        self.check(where)
        at = f"{where} {self.label}"
        if self.kind in ("ivf_flat", "ivf_pq") and n_items < self.nlist:
            raise ConfigError(f"{at}: nlist={self.nlist} cells need at least as many items, got {n_items}")
        if self.kind == "ivf_pq":
            if dim % self.m:
                raise ConfigError(f"{at}: m={self.m} must divide the vector dimension {dim}")
            if n_items < 2**self.nbits:
                raise ConfigError(
                    f"{at}: nbits={self.nbits} needs at least 2^nbits = {2**self.nbits} items to train its "
                    f"codebooks, got {n_items}"
                )


def build(spec: IndexSpec, vectors: np.ndarray, seed: int = 0):
    """The FAISS index of `spec` over `vectors` [n, d] float32 (checked first: IndexSpec.check)."""
    import faiss

    x = np.ascontiguousarray(vectors, dtype=np.float32)
    n, d = x.shape
    spec.fits(d, n)
    if spec.kind == "flat":
        index = faiss.IndexFlatIP(d)
    elif spec.kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, spec.M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = spec.ef_search
    else:
        quantizer = faiss.IndexFlatIP(d)
        if spec.kind == "ivf_flat":
            index = faiss.IndexIVFFlat(quantizer, d, spec.nlist, faiss.METRIC_INNER_PRODUCT)
        else:
            index = faiss.IndexIVFPQ(quantizer, d, spec.nlist, spec.m, spec.nbits, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = seed
        index.train(x)
        index.nprobe = spec.nprobe
    index.add(x)
    return index


def tune(index, spec: IndexSpec) -> None:
    """Set `spec`'s search-time settings (nprobe, efSearch) on an index built with its structure."""
    if spec.kind == "hnsw":
        index.hnsw.efSearch = spec.ef_search
    elif spec.kind in ("ivf_flat", "ivf_pq"):
        index.nprobe = spec.nprobe


def search(index, queries: np.ndarray, n: int) -> np.ndarray:
    """The n best rows per query [q, n] int64 (-1 where the index found fewer)."""
    _, rows = index.search(np.ascontiguousarray(queries, dtype=np.float32), n)
    return rows
