"""Bring-your-own table: a CSV/TSV or Parquet file plus a YAML column mapping -> `Dataset`.

The mapping is a data config taking conf/data/table.yaml as its base (`defaults: [table, _self_]`):
it names the file, the label, an optional time column, and the dense and sparse columns; every other
key keeps the base's documented value. `table_config` checks it before any file is read: keys unset,
unknown or mistyped, and columns used twice (or the label used as a feature) raise naming the
`data.params.<key>` and what was expected. Encoding follows reco.data.encode. Text files are read by
reco.data.text: every line is checked, so a short line raises naming the file and line (or is padded /
skipped and counted, per `short_rows`), blank lines are skipped without shifting line numbers, and
bytes that are not valid in `encoding` are reported with their line. Rows with a missing label or
time are skipped and counted.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pandas as pd
import pyarrow as pa

from reco.config import ConfigError, typed
from reco.data.encode import DenseColumn, SparseColumn, frame_to_dataset
from reco.data.schema import MIN_ROWS, Dataset, Side
from reco.data.text import ARROW_NULLS, SHORT_ROWS, TextFormat, read_chunks, read_header
from reco.data.values import numeric, show

CHUNK_ROWS = 1_000_000  # lines parsed at a time; bounds the parser's temporary memory
BASE = "conf/data/table.yaml"  # named in errors: where every key is documented with its value


@dataclass
class TableConfig:
    """`data.params` of the table loader. Types and meaning here; the values (each key's default) in
    conf/data/table.yaml, the base every table data config lists first (`defaults: [table, _self_]`)."""

    path: str  # required: the file; .csv/.tsv/.txt (optionally .gz) or .parquet
    format: str  # auto (by the file's extension, else Parquet's magic bytes) | csv | parquet
    csv_separator: str  # text files only: the field separator ("," or "\t")
    encoding: str  # text files only: the text encoding, e.g. utf-8, latin-1
    short_rows: str  # text files only: a line with too few fields -> error | pad | skip
    name: str | None  # the dataset's name in reports; None: the file name
    label: str  # required: the target column, 0/1 or true/false (or a score, with label_threshold)
    label_threshold: float | None  # label = value >= threshold; None: values must be 0/1
    time: str | None  # the column ordering the rows (numbers or date/times); None: file order
    min_count: int  # sparse values seen fewer times in the train split -> id 0 (unknown)
    user_key: str | None  # the single-valued sparse column naming the user; None: not servable
    item_key: str | None  # the single-valued sparse column naming the item; None: not servable
    dense: list[dict[str, Any]]  # required, >= 1: each DenseColumn's fields (column, side, log)
    sparse: list[dict[str, Any]]  # required, >= 1: each SparseColumn's fields


# The keys the base leaves `???`: what no two tables share, so every table data config states them.
REQUIRED = ("path", "label", "dense", "sparse")


def table_config(params: Mapping[str, Any]) -> TableConfig:
    """`data.params` (a plain dict, as the pipeline passes it) -> TableConfig, checked.

    Raises:
        ConfigError naming `data.params.<key>`: a key unknown (with the nearest known one), unset (a
        required key, or the base not listed in the YAML's defaults), or of the wrong type or shape.
    """
    names = [f.name for f in fields(TableConfig)]
    for key in params:
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            raise ConfigError(
                f"data.params.{key}: not a setting of the table loader"
                + (f" (did you mean {near[0]!r}?)" if near else "")
                + f"; its settings: {names}, each documented in {BASE}"
            )
    absent = [k for k in names if k not in params]
    if absent:
        raise ConfigError(_absent_message(absent))
    _column_specs(DenseColumn, params["dense"], "data.params.dense")  # before typed(): its shape errors
    _column_specs(SparseColumn, params["sparse"], "data.params.sparse")  # name no key
    return typed(dict(params), TableConfig, "data.params")


def _absent_message(absent: list[str]) -> str:
    keys = ", ".join(f"data.params.{k}" for k in absent)
    if any(k not in REQUIRED for k in absent):
        # A key the base gives a value is absent: the YAML does not list the base (e.g. a copy of an
        # older table.yaml, starting `defaults: [schema, _self_]`, from before the key existed).
        return (
            f"{keys}: not set. A table data config takes every key it does not state from {BASE}: "
            "start your conf/data/<name>.yaml with `defaults: [table, _self_]` (not [schema, _self_])"
        )
    return f"{keys}: not set; every table data config states " + ", ".join(REQUIRED) + f" (see {BASE})"


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
    if short_rows not in SHORT_ROWS:
        raise ValueError(f"data.params.short_rows: expected one of {SHORT_ROWS}, got {short_rows!r}")
    dense_cols = _column_specs(DenseColumn, dense, "data.params.dense")
    sparse_cols = _column_specs(SparseColumn, sparse, "data.params.sparse")
    wanted = _wanted_columns(label, time, dense_cols, sparse_cols, user_key, item_key)
    file = _existing_file(path)
    fmt = _format(file, format)
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
    frame, where, skipped, padded = _read(file, fmt, text, wanted, sparse_cols)
    y = _labels(frame[label], label_threshold, f"{file} column {label!r} (data.params.label)", where)
    keep = y.notna().to_numpy().copy()  # pandas may hand out a read-only view
    skipped["label_missing"] = int((~keep).sum())
    if time is not None:
        t = _time(frame[time], f"{file} column {time!r} (data.params.time)", where)
        missing_t = keep & t.isna().to_numpy()
        skipped["time_missing"] = int(missing_t.sum())
        keep &= ~missing_t
        order = np.argsort(t.to_numpy()[keep], kind="stable")  # ties keep file order
    else:
        order = np.arange(int(keep.sum()))
    for i, c in enumerate(dense_cols):
        what = f"{file} column {c.column!r} (data.params.dense[{i}])"
        frame[c.column] = numeric(frame[c.column], what, where)
    skipped = {k: v for k, v in skipped.items() if v}
    if len(order) < MIN_ROWS:
        raise ValueError(
            f"{file}: {len(order)} usable rows (rows left out: {skipped or 'none'}); "
            f"a train/val/test split needs at least {MIN_ROWS}"
        )
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
        skipped,
        {k: v for k, v in padded.items() if v},
    )


def _read(
    file: Path, fmt: str, text: TextFormat, wanted: dict[str, str], sparse: list[SparseColumn]
) -> tuple[pd.DataFrame, str, dict[str, int], dict[str, int]]:
    """The `wanted` columns of the file -> (frame, what its index counts: "line" | "row", rows skipped
    by reason, rows padded by reason). A column not in the file raises naming its config key."""
    have = read_header(file, text) if fmt == "csv" else _parquet_columns(file, sparse)
    _check_present(wanted, have, file, text.sep if fmt == "csv" else None)
    usecols = list(dict.fromkeys(wanted.values()))
    if fmt == "csv":
        frame, skipped, padded = _read_text(file, replace(text, names=tuple(have)), usecols)
        return frame, "line", {"short_rows": skipped}, {"short_rows": padded}
    # Rows numbered by position in the file (0-based), not by a pandas index stored with it.
    return pd.read_parquet(file, columns=usecols).reset_index(drop=True), "row", {}, {}


def _read_text(file: Path, fmt: TextFormat, usecols: list[str]) -> tuple[pd.DataFrame, int, int]:
    """-> (the `usecols` as strings indexed by file line, short lines skipped, short lines padded)."""
    chunks = list(read_chunks(file, fmt, CHUNK_ROWS, columns=usecols))
    tables = [c.table for c in chunks] or [pa.table({c: pa.array([], pa.string()) for c in usecols})]
    frame = pa.concat_tables(tables).to_pandas()
    frame.index = pd.Index(np.concatenate([c.lines for c in chunks]) if chunks else np.zeros(0, np.int64))
    return frame, sum(c.skipped for c in chunks), sum(c.padded for c in chunks)


def _existing_file(path: str) -> Path:
    file = Path(path)
    if file.is_dir():
        raise FileNotFoundError(
            f"data.params.path: {file} is a directory; expected a .csv/.tsv/.txt or .parquet file"
        )
    if not file.is_file():
        raise FileNotFoundError(
            f"data.params.path: file {file} not found"
            + (
                ""
                if file.is_absolute()
                else f" (a relative path is read from the working directory {Path.cwd()})"
            )
        )
    return file


def _format(file: Path, fmt: str) -> str:
    if fmt not in ("auto", "csv", "parquet"):
        raise ValueError(f"data.params.format: expected auto, csv or parquet, got {fmt!r}")
    with open(file, "rb") as f:
        is_parquet = f.read(4) == b"PAR1"  # every Parquet file starts (and ends) with these bytes
    if fmt == "csv" and is_parquet:
        raise ValueError(f"data.params.format: csv, but {file} is a Parquet file; set auto or parquet")
    if fmt != "auto":
        return fmt
    suffixes = [s.lower() for s in file.suffixes]
    if any(s in (".parquet", ".pq") for s in suffixes):
        return "parquet"
    if any(s in (".csv", ".tsv", ".txt") for s in suffixes):
        return "csv"
    if is_parquet:
        return "parquet"
    raise ValueError(
        f"data.params.format: cannot tell the format of {file} from its name; set csv or parquet"
    )


def _parquet_columns(file: Path, sparse: list[SparseColumn]) -> list[str]:
    """The file's column names; a list-valued column mapped to a single-valued sparse entry raises."""
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(file)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(
            f"data.params.path: {file} is not a readable Parquet file ({e}); "
            "for a text file set data.params.format=csv"
        ) from None
    for i, c in enumerate(sparse):
        if c.column in schema.names and not c.multi_valued:
            kind = schema.field(c.column).type
            if pa.types.is_list(kind) or pa.types.is_large_list(kind):
                raise ValueError(
                    f"data.params.sparse[{i}]: column {c.column!r} of {file} holds lists ({kind}); "
                    "set multi_valued: true (and max_len) for it"
                )
    return list(schema.names)


def _column_specs(cls: type, specs: Any, key: str) -> list:
    """A `dense` / `sparse` entry list -> its DenseColumn / SparseColumn list, checked."""
    kind = "dense" if cls is DenseColumn else "sparse"
    if not isinstance(specs, list | tuple):
        raise ConfigError(
            f"{key}: expected a list of column entries like [{{column: price, side: item}}], got {specs!r}"
        )
    if not specs:
        why = " (DLRM's bottom MLP needs one)" if kind == "dense" else ""
        raise ConfigError(f"{key}: at least one {kind} column is required{why}; got none")
    return [_column_spec(cls, s, f"{key}[{i}]") for i, s in enumerate(specs)]


def _column_spec(cls: type, spec: Any, where: str) -> DenseColumn | SparseColumn:
    allowed = [f.name for f in fields(cls)]
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where}: expected a mapping with keys {allowed}, got {spec!r}")
    unknown = sorted(set(spec) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {allowed}")
    for key in ("column", "side"):
        if key not in spec:
            raise ConfigError(f"{where}: missing key {key!r}")
    if spec["side"] not in get_args(Side):
        raise ConfigError(f"{where}.side: expected one of {get_args(Side)}, got {spec['side']!r}")
    col = cls(**spec)
    if isinstance(col, SparseColumn) and col.multi_valued and col.max_len < 1:
        raise ConfigError(f"{where}.max_len: expected >= 1 for a multi-valued column, got {col.max_len}")
    return col


def _wanted_columns(
    label: str,
    time: str | None,
    dense: list[DenseColumn],
    sparse: list[SparseColumn],
    user_key: str | None,
    item_key: str | None,
) -> dict[str, str]:
    """config key -> the file column it names. A column is one feature (its name is the feature's), and
    the label is never one: a feature holding the label would score perfectly offline and leak."""
    wanted = {"data.params.label": label}
    if time is not None:
        wanted["data.params.time"] = time
    features: dict[str, str] = {}
    for kind, cols in (("dense", dense), ("sparse", sparse)):
        for i, c in enumerate(cols):
            key = f"data.params.{kind}[{i}].column"
            if c.column == label:
                raise ConfigError(
                    f"{key}: {c.column!r} is the label (data.params.label); a feature holding the label leaks it"
                )
            if c.column in features:
                raise ConfigError(
                    f"{key}: column {c.column!r} is already {features[c.column]}; each column is one feature"
                )
            features[c.column] = key
    single = [c.column for c in sparse if not c.multi_valued]
    for key, value in (("user_key", user_key), ("item_key", item_key)):
        if value is not None and value not in single:
            raise ConfigError(
                f"data.params.{key}: {value!r} must name a single-valued sparse column (data.params.sparse), "
                f"one of {single}"
            )
    return wanted | {v: k for k, v in features.items()}


def _check_present(wanted: dict[str, str], have: list[str], file: Path, sep: str | None) -> None:
    for key, column in wanted.items():
        if column not in have:
            hint = ""
            if sep is not None and len(have) == 1:
                hint = f" (the header has one column: is data.params.csv_separator={sep!r} the file's separator?)"
            raise ValueError(f"{key}: column {column!r} not in {file}; its columns: {have}{hint}")


def _labels(values: pd.Series, threshold: float | None, what: str, where: str) -> pd.Series:
    """-> float64 0/1, NaN where missing. Without a threshold the values must already be 0/1
    (true/false in any case count as 1/0)."""
    if values.dtype == bool:
        values = values.astype(np.float64)
    elif pd.api.types.is_string_dtype(values):
        lower = values.str.lower()
        values = values.mask(lower == "true", "1").mask(lower == "false", "0")
    try:
        y = numeric(values, what, where)
    except ValueError:  # some text is not a number: found below, with what a label must be
        y = pd.to_numeric(values, errors="coerce").astype(np.float64)
    bad = values.notna() & y.isna()
    if threshold is None:
        bad |= y.notna() & ~y.isin([0.0, 1.0])
    if bad.any():
        row = bad.idxmax()
        v = values[row]
        shown = v if isinstance(v, str) and not np.isnan(y[row]) else show(v)  # a number: as written
        expected = (
            "a number (data.params.label_threshold is set)"
            if threshold is not None
            else "0 or 1, or true/false (set data.params.label_threshold to binarise a score)"
        )
        raise ValueError(f"{what}: {where} {row}: label {shown}, expected {expected}")
    if threshold is not None:
        return (y >= threshold).astype(np.float64).where(y.notna())
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
