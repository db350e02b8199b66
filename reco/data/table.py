"""Bring-your-own table: a CSV/TSV or Parquet file plus a YAML column mapping -> `Dataset`.

The mapping (conf/data/table.yaml) names the label, an optional time column, and the dense and
sparse columns; encoding follows reco.data.encode. Text files are read by reco.data.text: every line
is checked, so a short line raises naming the file and line (or is padded / skipped and counted, per
`short_rows`), blank lines are skipped without shifting line numbers, and bytes that are not valid in
`encoding` are reported with their line. Rows with a missing label or time are skipped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pandas as pd
import pyarrow as pa

from reco.data.encode import DenseColumn, SparseColumn, frame_to_dataset
from reco.data.schema import Dataset, Side
from reco.data.text import ARROW_NULLS, SHORT_ROWS, TextFormat, read_chunks, read_header
from reco.data.values import numeric, show

CHUNK_ROWS = 1_000_000  # lines parsed at a time; bounds the parser's temporary memory


@dataclass
class TableConfig:
    """`data.params` of the table loader; values in conf/data/table.yaml (documented there)."""

    path: str  # .csv/.tsv/.txt (optionally .gz) or .parquet
    format: str  # auto | csv | parquet
    csv_separator: str  # text files only
    encoding: str  # text files only, e.g. utf-8, latin-1
    short_rows: str  # text files only: error | pad | skip
    name: str | None  # dataset name; None: the file name
    label: str
    label_threshold: float | None  # label = value >= threshold; None: values must be 0/1
    time: str | None  # column ordering the rows; None: file order
    min_count: int
    user_key: str | None
    item_key: str | None
    dense: list[dict[str, Any]]  # each: DenseColumn's fields
    sparse: list[dict[str, Any]]  # each: SparseColumn's fields


def load_table(
    path: str,
    format: str,
    csv_separator: str,
    encoding: str,
    short_rows: str,
    name: str | None,
    label: str,
    label_threshold: float | None,
    time: str | None,
    min_count: int,
    user_key: str | None,
    item_key: str | None,
    dense: list[dict],
    sparse: list[dict],
) -> Dataset:
    """Load a CSV/TSV/Parquet table described by a data config.

    Args:
        The fields of `TableConfig` (see conf/data/table.yaml).
    Returns:
        A fingerprinted `Dataset`; skipped rows by reason in `skipped` (label_missing, time_missing,
        short_rows), padded short rows in `padded`.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data.params.path: file {file} not found (cwd {Path.cwd()})")
    fmt = _format(file, format)
    if short_rows not in SHORT_ROWS:
        raise ValueError(f"data.params.short_rows: expected one of {SHORT_ROWS}, got {short_rows!r}")
    dense_cols = [_column_spec(DenseColumn, d, f"data.params.dense[{i}]") for i, d in enumerate(dense or [])]
    sparse_cols = [
        _column_spec(SparseColumn, s, f"data.params.sparse[{i}]") for i, s in enumerate(sparse or [])
    ]
    wanted = {"data.params.label": label}
    if time is not None:
        wanted["data.params.time"] = time
    wanted |= {f"data.params.dense[{i}].column": c.column for i, c in enumerate(dense_cols)}
    wanted |= {f"data.params.sparse[{i}].column": c.column for i, c in enumerate(sparse_cols)}

    text = TextFormat(
        csv_separator,
        (),
        encoding,
        header=True,
        quoted=True,
        short_rows=short_rows,  # type: ignore[arg-type]  # checked above
        skip_blank_lines=True,
        null_values=ARROW_NULLS,
        short_rows_key="data.params.short_rows",
        encoding_key="data.params.encoding",
    )
    have = read_header(file, text) if fmt == "csv" else _parquet_columns(file)
    for field_name, column in wanted.items():
        if column not in have:
            raise ValueError(f"{field_name}: column {column!r} not in {file}; its columns: {have}")
    usecols = list(dict.fromkeys(wanted.values()))
    skipped: dict[str, int] = {}
    padded: dict[str, int] = {}
    if fmt == "csv":
        frame, skipped["short_rows"], padded["short_rows"] = _read_text(
            file, replace(text, names=tuple(have)), usecols
        )
        where = "line"
    else:
        frame = pd.read_parquet(file, columns=usecols)
        where = "row"

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
        {k: v for k, v in padded.items() if v},
    )


def _read_text(file: Path, fmt: TextFormat, usecols: list[str]) -> tuple[pd.DataFrame, int, int]:
    """-> (the `usecols` as strings indexed by file line, short lines skipped, short lines padded)."""
    chunks = list(read_chunks(file, fmt, CHUNK_ROWS, columns=usecols))
    tables = [c.table for c in chunks] or [pa.table({c: pa.array([], pa.string()) for c in usecols})]
    frame = pa.concat_tables(tables).to_pandas()
    frame.index = pd.Index(np.concatenate([c.lines for c in chunks]) if chunks else np.zeros(0, np.int64))
    return frame, sum(c.skipped for c in chunks), sum(c.padded for c in chunks)


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


def _parquet_columns(file: Path) -> list[str]:
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
    """-> float64 0/1, NaN where missing. Without a threshold the values must already be 0/1
    (true/false in any case count as 1/0)."""
    if values.dtype == bool:
        values = values.astype(np.float64)
    elif pd.api.types.is_string_dtype(values):
        lower = values.str.lower()
        values = values.mask(lower == "true", "1").mask(lower == "false", "0")
    y = numeric(values, what, where)
    if threshold is not None:
        return (y >= threshold).astype(np.float64).where(y.notna())
    bad = y.notna() & ~y.isin([0.0, 1.0])
    if bad.any():
        row = bad.idxmax()
        shown = values[row] if isinstance(values[row], str) else show(values[row])  # a number: as written
        raise ValueError(
            f"{what}: {where} {row}: label {shown}, expected 0 or 1 "
            "(set data.params.label_threshold to binarise a score)"
        )
    return y


def _time(values: pd.Series, what: str, where: str) -> pd.Series:
    """Numbers (or text that is all numbers) stay numbers; other text is parsed as date/times (UTC,
    naive = UTC) -> ns since epoch. Missing -> NaN."""
    if pd.api.types.is_numeric_dtype(values):
        return values.astype(np.float64)
    x = pd.to_numeric(values, errors="coerce")
    if not (values.notna() & x.isna()).any():
        return x.astype(np.float64)
    t = pd.to_datetime(values, errors="coerce", utc=True)  # one format, inferred from the first value
    if (values.notna() & t.isna()).any():
        t = pd.to_datetime(values, errors="coerce", utc=True, format="mixed")  # slower, per value
    bad = values.notna() & t.isna()
    if bad.any():
        row = bad.idxmax()
        raise ValueError(f"{what}: {where} {row}: {show(values[row])} is not a number or a date/time")
    ns = t.astype("datetime64[ns, UTC]").astype(np.int64).astype(np.float64)
    return ns.where(t.notna())
