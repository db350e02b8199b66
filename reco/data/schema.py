"""The one schema and batch format every loader produces.

All loaders turn their source into a `Dataset`: three time-ordered `Split`s of plain tensors plus a
`Schema`. Sparse ids are already mapped into ``[0, cardinality)``; id 0 is reserved for
"unknown / out of vocabulary" in every table, so a value never seen in training, a cold-start user at
serving time, or a row dropped by embedding pruning all land on the same learned row.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:  # torch and torchrec are imported where used: a server of an ONNX variant needs neither
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

Side = Literal["user", "item", "context"]


@dataclass(frozen=True)
class SparseFeature:
    name: str
    cardinality: int  # ids live in [0, cardinality); 0 = unknown
    max_len: int = 1  # > 1: multi-valued (jagged) feature
    side: Side = "item"


@dataclass(frozen=True)
class DenseFeature:
    name: str
    side: Side = "item"


@dataclass(frozen=True)
class Schema:
    dense: tuple[DenseFeature, ...]
    sparse: tuple[SparseFeature, ...]
    user_key: str | None = None  # sparse feature holding the user id (serving needs it)
    item_key: str | None = None  # sparse feature holding the item id

    @property
    def max_len(self) -> int:
        return max(f.max_len for f in self.sparse)

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    @property
    def dense_names(self) -> list[str]:
        return [f.name for f in self.dense]

    def index(self, name: str) -> int:
        return self.sparse_names.index(name)

    @property
    def shared_columns(self) -> list[int]:
        """Sparse columns every candidate of one request shares (user and context sides): what a request
        graph embeds once per request instead of once per candidate (reco.models.protocol.RequestScorer)."""
        return [i for i, f in enumerate(self.sparse) if f.side != "item"]

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> Schema:
        return Schema(
            dense=tuple(DenseFeature(**f) for f in d["dense"]),
            sparse=tuple(SparseFeature(**f) for f in d["sparse"]),
            user_key=d.get("user_key"),
            item_key=d.get("item_key"),
        )


@dataclass
class Batch:
    """What the TorchRec model trains on.

    dense:  [B, D] float32
    sparse: KeyedJaggedTensor, keys = schema sparse names, B lengths per key
    labels: [B] float32 in {0, 1}
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor


@dataclass
class Split:
    """Rows of one split as padded plain tensors (export- and serving-friendly).

    dense:   [N, D] float32
    ids:     [N, F, L] int64, padded with 0 beyond `lengths`
    lengths: [N, F] int64 in [0, L]
    labels:  [N] float32 in {0, 1}
    oracle:  [N] float32 true click probability (synthetic data only)
    """

    dense: torch.Tensor
    ids: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor
    oracle: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.labels.shape[0]

    def take(self, idx: torch.Tensor | slice) -> Split:
        return Split(
            self.dense[idx],
            self.ids[idx],
            self.lengths[idx],
            self.labels[idx],
            None if self.oracle is None else self.oracle[idx],
        )

    def mask(self) -> torch.Tensor:
        """[N, F, L] float32: 1 where a position holds a real id."""
        import torch

        return torch.from_numpy(padding_mask(self.lengths.numpy(), self.ids.shape[2]))

    def batch(self, keys: list[str]) -> Batch:
        return Batch(self.dense, to_kjt(self.ids, self.lengths, keys), self.labels)


def to_kjt(ids: torch.Tensor, lengths: torch.Tensor, keys: list[str]) -> KeyedJaggedTensor:
    """Padded ids [B, F, L] + lengths [B, F] -> KeyedJaggedTensor (key-major, as TorchRec expects)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ids_fm = ids.transpose(0, 1)  # [F, B, L]
    lens_fm = lengths.transpose(0, 1)  # [F, B]
    pos = torch.arange(ids.shape[2])
    keep = pos[None, None, :] < lens_fm[:, :, None]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=ids_fm[keep], lengths=lens_fm.reshape(-1).to(torch.int64)
    )


@dataclass
class Dataset:
    schema: Schema
    train: Split
    val: Split
    test: Split
    name: str = ""
    # Rows not used, by documented reason (e.g. {"rating_missing": 3}); never silently dropped.
    skipped: dict[str, int] = field(default_factory=dict)
    fingerprint: str = ""
    # Rows used after completing them, by reason (e.g. {"short_rows": 12}: missing trailing fields read
    # as empty); logged beside `skipped`.
    padded: dict[str, int] = field(default_factory=dict)

    def splits(self) -> dict[str, Split]:
        return {"train": self.train, "val": self.val, "test": self.test}

    def compute_fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the schema and every split's tensors (their values in row-major
        order, so a view and its copy hash the same); stored in `fingerprint` and returned."""
        h = hashlib.sha256(repr(self.schema.to_dict()).encode())
        for name, s in self.splits().items():
            h.update(name.encode())
            for t in (s.dense, s.ids, s.lengths, s.labels):
                _hash_tensor(h, t)
        self.fingerprint = h.hexdigest()[:16]
        return self.fingerprint

    def save(self, path: str) -> None:
        """Tensors and plain containers only, so `load` can use weights_only=True."""
        blob = {
            "schema": self.schema.to_dict(),
            "name": self.name,
            "skipped": dict(self.skipped),
            "fingerprint": self.fingerprint,
            "padded": dict(self.padded),
        }
        for name, s in self.splits().items():
            blob[name] = {k: v for k, v in vars(s).items() if v is not None}
        import torch

        torch.save(blob, path)

    @staticmethod
    def load(path: str) -> Dataset:
        import torch

        return Dataset._from_blob(torch.load(path, weights_only=True))

    @staticmethod
    def load_arrays(path: str) -> Dataset:
        """The file as `load` reads it, every tensor a read-only numpy array, read without importing torch
        (reco.data.torch_file): what a server needs, ~1.3 s of CPU less per start."""
        from reco.data import torch_file

        return Dataset._from_blob(torch_file.load(path))

    @staticmethod
    def _from_blob(blob: dict) -> Dataset:
        return Dataset(
            schema=Schema.from_dict(blob["schema"]),
            train=Split(**blob["train"]),
            val=Split(**blob["val"]),
            test=Split(**blob["test"]),
            name=blob["name"],
            skipped=blob["skipped"],
            fingerprint=blob["fingerprint"],
            padded=blob.get("padded", {}),  # caches written before `padded` existed
        )


def _hash_tensor(h: hashlib._Hash, t: torch.Tensor, block_bytes: int = 1 << 24) -> None:
    """Feed t's bytes to h without copying the tensor: a contiguous tensor's buffer as is; any other
    (Criteo's lengths are one value expanded to [N, F]) ~16 MB of rows at a time."""
    if t.is_contiguous():
        h.update(t.detach().numpy().reshape(-1).view(np.uint8))
        return
    row_bytes = max(1, t[:1].numel() * t.element_size())
    step = max(1, block_bytes // row_bytes)
    for lo in range(0, t.shape[0], step):
        h.update(t[lo : lo + step].contiguous().numpy().reshape(-1).view(np.uint8))


def padding_mask(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Lengths [N, F] -> [N, F, max_len] float32: 1 where a position holds a real id."""
    return (np.arange(max_len)[None, None, :] < lengths[:, :, None]).astype(np.float32)


def request_groups(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Rows per request [U] (summing to N) -> (first [U] i64: each request's first row, owner [N] i64).

    The same function as reco.models.protocol.request_groups, kept here without torch for the ONNX
    runtime; protocol.py enters every variant's cache key, so it imports this one when next changed
    (test_user_once checks the two agree)."""
    counts = np.asarray(sizes, dtype=np.int64)
    counts = counts[counts > 0]  # a request without rows owns none and needs no first row
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return first, np.repeat(np.arange(len(counts), dtype=np.int64), counts)


MIN_ROWS = 10  # the smallest table time_split gives non-empty train (8), validation (1) and test (1) rows


def time_split(n: int, fractions: tuple[float, float] = (0.8, 0.1)) -> tuple[slice, slice, slice]:
    """Contiguous train/val/test slices of rows already sorted by time."""
    a = int(n * fractions[0])
    b = int(n * (fractions[0] + fractions[1]))
    return slice(0, a), slice(a, b), slice(b, n)
