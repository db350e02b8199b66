"""Column values -> numbers, with errors naming the column and the file line (or Parquet row).

Loaders read text as strings (so "007" stays a category and a typo is not silently NaN); the numeric
columns go through here: missing stays NaN, anything else that is not a number raises.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc


def numeric(values: pd.Series, what: str, where: str = "line", integer: bool = False) -> pd.Series:
    """Strings -> float64 (missing stays NaN); a value that is not a number raises.

    Args:
        values: the column, indexed by file line number (`where`="line") or 0-based row ("row", Parquet).
        what: names the column in errors, e.g. "u.data column rating".
        integer: the values must also be whole numbers.
    Returns:
        float64 Series with the same index.
    """
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


def arrow_numeric(values: pa.ChunkedArray, lines: np.ndarray, what: str, integer: bool = False) -> np.ndarray:
    """A string column of a `Chunk` -> [rows] float64 (null: NaN), without building Python strings.

    Args:
        values: the column; lines: [rows] its file line numbers (for the error); what, integer: see `numeric`.
    Returns:
        [rows] float64.
    """
    try:
        x = pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        x = None
    if x is not None:
        present = ~values.is_null().to_numpy(zero_copy_only=False)
        ok = ~np.isnan(x[present]).any()
        if ok and integer:
            v = x[present]
            ok = bool((np.isfinite(v) & (v == np.floor(v))).all())
        if ok:
            return x
    series = pd.Series(values.to_pandas().to_numpy(), index=pd.Index(lines))
    return numeric(series, what, "line", integer).to_numpy()  # raises naming the line


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
