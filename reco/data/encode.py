"""Shared encoding of the real-data loaders: a time-ordered DataFrame -> the padded tensors of a `Dataset`.

MovieLens, Criteo's vocab mode and user tables all encode the same way:
- rows are split 80/10/10 in time order; every vocabulary and every dense statistic comes from the
  train split only, so validation and test rows never leak into the features;
- sparse values seen at least `min_count` times in train get ids 1..K (most frequent first, ties by
  value); everything else -- rarer, unseen in train, or missing -- is id 0, the shared "unknown" row;
- a missing single value is id 0 with length 1; a missing or empty multi-valued cell has length 0;
  lists longer than `max_len` keep their first `max_len` values (the rest are counted in
  Dataset.skipped as "<column>_values_over_max_len");
- dense values: optional log(1 + max(x, 0)), then standardised with the train mean / std; a missing
  value becomes the train mean, i.e. 0 after standardising.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from reco.data.schema import MIN_ROWS, Dataset, DenseFeature, Schema, Side, SparseFeature, Split, time_split


@dataclass(frozen=True)
class DenseColumn:
    """A numeric column that becomes one dense feature of the same name."""

    column: str
    side: Side
    log: bool = False  # log(1 + max(x, 0)) before standardising (counts, prices)


@dataclass(frozen=True)
class SparseColumn:
    """A categorical column that becomes one embedding table (sparse feature) of the same name."""

    column: str
    side: Side
    multi_valued: bool = False
    separator: str = "|"  # multi-valued string cells: "a|b|c"; list-valued Parquet cells need none
    max_len: int = 1  # multi-valued only: values kept per row


def frame_to_dataset(
    frame: pd.DataFrame,
    labels: np.ndarray,
    dense: list[DenseColumn],
    sparse: list[SparseColumn],
    min_count: int,
    user_key: str | None,
    item_key: str | None,
    name: str,
    skipped: dict[str, int],
    padded: dict[str, int] | None = None,
) -> Dataset:
    """Encode a time-ordered frame (rules in the module docstring).

    Args:
        frame: N rows already in time order, one column per feature (schema names = column names).
        labels: [N] in {0, 1}.
        dense, sparse: the columns to encode, in schema order.
        min_count: sparse values seen fewer times in train -> id 0.
        user_key, item_key: single-valued sparse columns naming the user / item, or None.
        name: the dataset name (also prefixes errors).
        skipped, padded: row counts by reason, kept in `Dataset.skipped` / `Dataset.padded`.
    Returns:
        A fingerprinted `Dataset` split 80/10/10.
    """
    if not dense:
        raise ValueError(f"{name}: at least one dense column is required (DLRM's bottom MLP needs one)")
    if not sparse:
        raise ValueError(f"{name}: at least one sparse column is required")
    for key, value in (("user_key", user_key), ("item_key", item_key)):
        single = [c.column for c in sparse if not c.multi_valued]
        if value is not None and value not in single:
            raise ValueError(
                f"{name}: {key}={value!r} must name a single-valued sparse column, one of {single}"
            )
    n = len(frame)
    if n < MIN_ROWS:
        raise ValueError(f"{name}: {n} usable rows; a train/val/test split needs at least {MIN_ROWS}")
    tr, _, _ = time_split(n)
    n_train = tr.stop

    L = max(c.max_len if c.multi_valued else 1 for c in sparse)
    ids = np.zeros((n, len(sparse), L), dtype=np.int64)
    lengths = np.zeros((n, len(sparse)), dtype=np.int64)
    features = []
    for f, col in enumerate(sparse):
        if col.multi_valued:
            f_ids, f_len, card, n_cut = _encode_multi(
                frame[col.column], col.separator, col.max_len, n_train, min_count
            )
            if n_cut:  # values past max_len are not used: say how many
                skipped = {**skipped, f"{col.column}_values_over_max_len": n_cut}
            ids[:, f, : col.max_len] = f_ids
            lengths[:, f] = f_len
            features.append(SparseFeature(col.column, card, col.max_len, col.side))
        else:
            vocab = _vocab(frame[col.column].iloc[:n_train], min_count)
            ids[:, f, 0] = vocab.get_indexer(frame[col.column]) + 1  # -1 (unknown / missing) -> 0
            lengths[:, f] = 1
            features.append(SparseFeature(col.column, len(vocab) + 1, 1, col.side))

    dense_x = np.stack([_encode_dense(frame[c.column], c.log, n_train) for c in dense], axis=1)
    schema = Schema(
        dense=tuple(DenseFeature(c.column, c.side) for c in dense),
        sparse=tuple(features),
        user_key=user_key,
        item_key=item_key,
    )
    full = Split(
        torch.from_numpy(dense_x.astype(np.float32)),
        torch.from_numpy(ids),
        torch.from_numpy(lengths),
        torch.from_numpy(np.asarray(labels, dtype=np.float32)),
    )
    parts = time_split(n)
    ds = Dataset(
        schema, *(full.take(p) for p in parts), name=name, skipped=dict(skipped), padded=dict(padded or {})
    )
    ds.compute_fingerprint()
    return ds


def _vocab(values: pd.Series | np.ndarray, min_count: int) -> pd.Index:
    """Values seen >= min_count times, most frequent first (ties by value, so the order is stable)."""
    return vocab_from_counts(pd.Series(values).value_counts(dropna=True), min_count)


def vocab_from_counts(counts: pd.Series, min_count: int) -> pd.Index:
    """counts: value -> occurrences in train. Position i of the result gets id i + 1."""
    counts = counts[counts >= min_count]
    counts = counts.sort_index(kind="stable").sort_values(ascending=False, kind="stable")
    return pd.Index(counts.index)


def _encode_multi(
    cells: pd.Series, separator: str, max_len: int, n_train: int, min_count: int
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Multi-valued cells -> ids [N, max_len], lengths [N], cardinality, values cut by max_len.

    Works on the distinct cells (MovieLens has millions of ratings but a few hundred genre strings).
    """
    cells = pd.Series(cells.to_numpy(dtype=object))
    present = cells.dropna()
    if len(present) and isinstance(present.iloc[0], list | tuple | np.ndarray):  # list-valued Parquet
        cells = cells.map(lambda v: tuple(v) if isinstance(v, list | tuple | np.ndarray) else v)
    codes, uniques = pd.factorize(cells)  # missing -> -1
    full = [_split_cell(u, separator) for u in uniques]
    tokens = [t[:max_len] for t in full]
    over = np.array([len(t) - max_len for t in full] + [0], dtype=np.int64).clip(min=0)
    # Token counts over train rows: each distinct cell counted as often as train rows carry it.
    weight = np.bincount(codes[:n_train][codes[:n_train] >= 0], minlength=len(uniques))
    counts: dict = {}
    for toks, w in zip(tokens, weight, strict=True):
        for t in toks:
            counts[t] = counts.get(t, 0) + int(w)
    vocab = vocab_from_counts(
        pd.Series(list(counts.values()), index=list(counts.keys()), dtype=np.int64), min_count
    )
    u_ids = np.zeros((len(uniques) + 1, max_len), dtype=np.int64)  # last row: missing cell
    u_len = np.zeros(len(uniques) + 1, dtype=np.int64)
    for i, toks in enumerate(tokens):
        if toks:
            u_ids[i, : len(toks)] = vocab.get_indexer(pd.Index(toks, dtype=object)) + 1
        u_len[i] = len(toks)
    return u_ids[codes], u_len[codes], len(vocab) + 1, int(over[codes].sum())


def _split_cell(cell: object, separator: str) -> list:
    if isinstance(cell, tuple):
        return [v for v in cell if v is not None and str(v).strip() != ""]
    return [t.strip() for t in str(cell).split(separator) if t.strip() != ""]


def _encode_dense(values: pd.Series, log: bool, n_train: int) -> np.ndarray:
    """[N] float64: optional log1p, standardised by train statistics, missing -> 0."""
    x = np.asarray(values, dtype=np.float64)
    if log:
        x = np.log1p(np.maximum(x, 0.0))
    train = x[:n_train]
    train = train[~np.isnan(train)]
    mu = float(train.mean()) if len(train) else 0.0
    sd = float(train.std()) if len(train) else 1.0
    x = (x - mu) / (sd if sd > 0 else 1.0)
    return np.nan_to_num(x, nan=0.0)
