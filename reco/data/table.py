"""Bring-your-own table: a CSV or Parquet file plus a YAML column mapping -> `Dataset`.

Also the shared encoder of the real-data loaders: `frame_to_dataset` turns a time-ordered DataFrame
into the padded tensors of `reco.data.schema`, and `read_delimited` reads headerless delimited text in
chunks while checking every line's field count (pandas alone fills short lines with NaN silently).

Encoding rules (the same for MovieLens, Criteo's vocab mode and user tables):
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

import gzip
import io
from collections.abc import Iterator
from dataclasses import dataclass, fields
from itertools import islice
from pathlib import Path
from typing import IO, get_args

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import torch

from reco.data.schema import Dataset, DenseFeature, Schema, Side, SparseFeature, Split, time_split


@dataclass(frozen=True)
class DenseColumn:
    column: str
    side: Side
    log: bool = False  # log(1 + max(x, 0)) before standardising (counts, prices)


@dataclass(frozen=True)
class SparseColumn:
    column: str
    side: Side
    multi_valued: bool = False
    separator: str = "|"  # multi-valued string cells: "a|b|c"; list-valued Parquet cells need none
    max_len: int = 1  # multi-valued only: values kept per row


# --------------------------------------------------------------------------------------------------
# Encoding


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
) -> Dataset:
    """frame: rows already in time order, one column per feature; labels: [N] in {0, 1}.

    Feature names in the schema are the column names. Returns a fingerprinted `Dataset`.
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
    if n < 10:
        raise ValueError(f"{name}: {n} usable rows; a train/val/test split needs at least 10")
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
    ds = Dataset(schema, *(full.take(p) for p in parts), name=name, skipped=dict(skipped))
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


# --------------------------------------------------------------------------------------------------
# Reading delimited text


def open_binary(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_delimited_arrow(
    path: Path,
    sep: str,
    names: list[str],
    chunk_rows: int,
    encoding: str = "utf-8",
    header: bool = False,
    limit: int | None = None,
) -> Iterator[tuple[int, pa.Table]]:
    """Yield (line number of the chunk's first row, Arrow table of up to `chunk_rows` rows), the first
    `limit` data lines if given. Every column is a string column; empty values are null.

    A line without exactly len(names) fields -- a blank line included -- raises naming the file and
    line. Quotes are not interpreted (GroupLens and Criteo files do not quote). Arrow parses each
    chunk (multi-threaded, ~10x pandas' C parser on string columns); lines are only counted here.
    """
    sep_b = sep.encode()
    with open_binary(path) as f:
        line_no = 0
        if header:
            first = f.readline().decode(encoding).rstrip("\r\n").split(sep)
            line_no = 1
            if first != names:
                raise ValueError(
                    f"{path}: line 1: expected header {sep.join(names)!r}, found {sep.join(first)!r}"
                )
        left = limit if limit is not None else -1
        while left != 0 and (lines := list(islice(f, chunk_rows if left < 0 else min(chunk_rows, left)))):
            start = line_no + 1
            line_no += len(lines)
            left = max(left - len(lines), 0) if left > 0 else left
            for i, ln in enumerate(lines):
                if ln.count(sep_b) != len(names) - 1:
                    raise ValueError(
                        f"{path}: line {start + i}: expected {len(names)} fields separated by {sep!r} "
                        f"({', '.join(names)}), found {ln.count(sep_b) + 1}"
                    )
            yield start, _parse_text(b"".join(lines), sep_b, names, encoding)


def _parse_text(text: bytes, sep: bytes, names: list[str], encoding: str) -> pa.Table:
    if len(sep) > 1:  # Arrow needs a one-byte delimiter: swap '::' for a byte the text lacks
        one = next(c for c in (b"\t", b"\x1f", b"\x1e", b"\x1d") if c not in text)
        text, sep = text.replace(sep, one), one
    return pcsv.read_csv(
        io.BytesIO(text),
        read_options=pcsv.ReadOptions(column_names=names, encoding=encoding),
        parse_options=pcsv.ParseOptions(delimiter=sep.decode(), quote_char=False, ignore_empty_lines=False),
        convert_options=pcsv.ConvertOptions(
            column_types={n: pa.string() for n in names}, null_values=[""], strings_can_be_null=True
        ),
    )


def read_delimited(
    path: Path,
    sep: str,
    names: list[str],
    chunk_rows: int,
    encoding: str = "utf-8",
    header: bool = False,
    limit: int | None = None,
) -> Iterator[pd.DataFrame]:
    """`read_delimited_arrow` as DataFrames of strings (missing: NaN) indexed by 1-based line number."""
    for start, table in read_delimited_arrow(path, sep, names, chunk_rows, encoding, header, limit):
        frame = table.to_pandas()
        frame.index = pd.RangeIndex(start, start + len(frame))
        yield frame


def numeric(values: pd.Series, what: str, where: str = "line", integer: bool = False) -> pd.Series:
    """Strings -> float64 (missing stays NaN); a value that is not a number raises naming `what`
    (e.g. "u.data column rating") and the row's index label: `where` says whether that label is a
    file line number ("line") or a 0-based row ("row", Parquet). An integer column must also hold
    whole numbers."""
    x = _fast_float(values)
    if x is None:  # some value Arrow cannot cast: let pandas find which (or parse them all)
        x = pd.to_numeric(values, errors="coerce").astype(np.float64)
    bad = values.notna() & x.isna()
    if integer:
        bad |= values.notna() & ~(np.isfinite(x) & (x == np.floor(x))).fillna(False)
    if bad.any():
        row = bad.idxmax()
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{what}: {where} {row}: value {show(values[row])}, expected {kind}")
    return x


def _fast_float(values: pd.Series) -> pd.Series | None:
    if pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
        return values.astype(np.float64)
    if not pd.api.types.is_string_dtype(values):
        return None
    try:
        arr = pc.cast(pa.array(values, from_pandas=True), pa.float64())
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        return None
    return pd.Series(arr.to_numpy(zero_copy_only=False), index=values.index, dtype=np.float64)


def show(value: object) -> str:
    """A value for an error message: strings quoted, numbers plain (not np.int64(3))."""
    return repr(value) if isinstance(value, str) else str(value)


# --------------------------------------------------------------------------------------------------
# The `table` loader


def load_table(
    path: str,
    label: str,
    dense: list[dict],
    sparse: list[dict],
    min_count: int,
    format: str = "auto",
    csv_separator: str = ",",
    label_threshold: float | None = None,
    time: str | None = None,
    user_key: str | None = None,
    item_key: str | None = None,
    name: str | None = None,
) -> Dataset:
    """Load a CSV/Parquet table described by a data config (see conf/data/table.yaml)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data.params.path: file {file} not found (cwd {Path.cwd()})")
    fmt = _format(file, format)
    dense_cols = [_column_spec(DenseColumn, d, f"data.params.dense[{i}]") for i, d in enumerate(dense or [])]
    sparse_cols = [
        _column_spec(SparseColumn, s, f"data.params.sparse[{i}]") for i, s in enumerate(sparse or [])
    ]
    wanted = {"data.params.label": label}
    if time is not None:
        wanted["data.params.time"] = time
    wanted |= {f"data.params.dense[{i}].column": c.column for i, c in enumerate(dense_cols)}
    wanted |= {f"data.params.sparse[{i}].column": c.column for i, c in enumerate(sparse_cols)}

    have = _file_columns(file, fmt, csv_separator)
    for field_name, column in wanted.items():
        if column not in have:
            raise ValueError(f"{field_name}: column {column!r} not in {file}; its columns: {have}")
    usecols = list(dict.fromkeys(wanted.values()))
    str_cols = {c.column for c in sparse_cols}
    if fmt == "csv":
        frame = pd.read_csv(
            file, sep=csv_separator, usecols=usecols, dtype={c: str for c in str_cols}, low_memory=False
        )
        frame.index = pd.RangeIndex(2, len(frame) + 2)  # file line numbers (line 1 is the header)
        where = "line"
    else:
        frame = pd.read_parquet(file, columns=usecols)
        where = "row"

    skipped: dict[str, int] = {}
    y = _labels(frame[label], label_threshold, f"{file} column {label!r}", where)
    keep = y.notna().to_numpy().copy()  # pandas may hand out a read-only view
    skipped["label_missing"] = int((~keep).sum())
    if time is not None:
        t = _time(frame[time], f"{file} column {time!r}", where)
        missing_t = keep & t.isna().to_numpy()
        skipped["time_missing"] = int(missing_t.sum())
        keep &= ~missing_t
        order = np.argsort(t.to_numpy()[keep], kind="stable")  # ties keep file order
    else:
        order = np.arange(int(keep.sum()))
    for c in dense_cols:
        frame[c.column] = numeric(frame[c.column], f"{file} column {c.column!r}", where)
    frame = frame[keep].iloc[order]
    return frame_to_dataset(
        frame,
        y.to_numpy()[keep][order],
        dense_cols,
        sparse_cols,
        min_count,
        user_key,
        item_key,
        name or file.name.split(".")[0],
        {k: v for k, v in skipped.items() if v},
    )


def _format(file: Path, fmt: str) -> str:
    if fmt in ("csv", "parquet"):
        return fmt
    if fmt != "auto":
        raise ValueError(f"data.params.format: expected auto, csv or parquet, got {fmt!r}")
    suffixes = [s.lower() for s in file.suffixes]
    if any(s in (".parquet", ".pq") for s in suffixes):
        return "parquet"
    if any(s in (".csv", ".tsv", ".txt") for s in suffixes):
        return "csv"
    raise ValueError(
        f"data.params.format: cannot tell the format of {file} from its name; set csv or parquet"
    )


def _file_columns(file: Path, fmt: str, sep: str) -> list[str]:
    if fmt == "csv":
        return list(pd.read_csv(file, sep=sep, nrows=0).columns)
    import pyarrow.parquet as pq

    return list(pq.read_schema(file).names)


def _column_spec(cls: type, spec: dict, where: str) -> DenseColumn | SparseColumn:
    allowed = [f.name for f in fields(cls)]
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a mapping with keys {allowed}, got {spec!r}")
    unknown = sorted(set(spec) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {allowed}")
    for key in ("column", "side"):
        if key not in spec:
            raise ValueError(f"{where}: missing key {key!r}")
    if spec["side"] not in get_args(Side):
        raise ValueError(f"{where}.side: expected one of {get_args(Side)}, got {spec['side']!r}")
    col = cls(**spec)
    if isinstance(col, SparseColumn) and col.multi_valued and col.max_len < 1:
        raise ValueError(f"{where}.max_len: expected >= 1 for a multi-valued column, got {col.max_len}")
    return col


def _labels(values: pd.Series, threshold: float | None, what: str, where: str) -> pd.Series:
    """-> float64 0/1, NaN where missing. Without a threshold the values must already be 0/1."""
    if values.dtype == bool:
        values = values.astype(np.float64)
    y = numeric(values, what, where)
    if threshold is not None:
        return (y >= threshold).astype(np.float64).where(y.notna())
    bad = y.notna() & ~y.isin([0.0, 1.0])
    if bad.any():
        row = bad.idxmax()
        raise ValueError(
            f"{what}: {where} {row}: label {show(values[row])}, expected 0 or 1 "
            "(set data.params.label_threshold to binarise a score)"
        )
    return y


def _time(values: pd.Series, what: str, where: str) -> pd.Series:
    """Numbers stay numbers; strings are parsed as date/times (UTC, naive = UTC) -> ns since epoch.
    Missing -> NaN."""
    if pd.api.types.is_numeric_dtype(values):
        return values.astype(np.float64)
    t = pd.to_datetime(values, errors="coerce", utc=True)  # one format, inferred from the first value
    if (values.notna() & t.isna()).any():
        t = pd.to_datetime(values, errors="coerce", utc=True, format="mixed")  # slower, per value
    bad = values.notna() & t.isna()
    if bad.any():
        row = bad.idxmax()
        raise ValueError(f"{what}: {where} {row}: {show(values[row])} is not a number or a date/time")
    ns = t.astype("datetime64[ns, UTC]").astype(np.int64).astype(np.float64)
    return ns.where(t.notna())
