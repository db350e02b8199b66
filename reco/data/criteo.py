"""Criteo display-advertising logs (train.txt of the Kaggle challenge, or a day_N file) -> `Dataset`.

Each line: label <TAB> I1..I13 (integers) <TAB> C1..C26 (32-bit hex hashes); any value may be empty.
The file is read in chunks of `chunk_rows` lines, so memory holds the output tensors of the rows kept
(`max_rows`, the first lines of the file) plus one chunk, never the whole file. There are no
timestamps: the file is in time order, so the first 80% of the rows are train, then 10% val, 10% test.

- dense I1..I13: log(1 + max(x, 0)); an empty value becomes 0 (the same as a 0 count). Negative
  values (I2 has a few) are clipped to 0, as in the DLRM reference preprocessing.
- categorical C1..C26, `categorical: hash`: id = 1 + hash(value) mod (hash_buckets - 1); one pass,
  no vocabulary. A table cannot use more rows than the train split has distinct values, so each one
  is capped at `max_buckets_per_value` x (distinct ids in train) + 1 rows (at least 2): a capped
  table's id is 1 + ((id - 1) mod (cap - 1)), and the loader prints which tables were capped.
  (A 1,000-line sample with 100k buckets would otherwise give 26 x 100k rows, ~640 MB of embeddings
  at dim 64.) `categorical: vocab`: a first pass counts values over the train rows; values seen
  >= `min_count` times get ids 1..K (most frequent first). Empty, rare or unseen values are id 0.
- user_key / item_key are None: the data trains and evaluates a model but cannot be served.
- lengths are one value expanded to [N, 26] (every feature holds one id), not N x 26 int64s.

Public samples strip trailing empty fields from about half their lines (37-38 tab-separated fields
instead of 40): `short_rows: pad` reads the missing fields as empty (counted in padded["short_rows"]),
`skip` leaves such lines out (skipped["short_rows"]), `error` (the default) raises naming the line.
Errors name the file and line: a short or long line, a label other than 0/1, an I column that is
not an integer, bytes that are not UTF-8, a file with fewer than 10 usable rows. Lines after
`max_rows` are counted in skipped["after_max_rows"].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import torch

from reco.data.encode import vocab_from_counts
from reco.data.schema import MIN_ROWS, Dataset, DenseFeature, Schema, SparseFeature, Split, time_split
from reco.data.text import SHORT_ROWS, TextFormat, count_lines, read_chunks
from reco.data.values import arrow_numeric

INT_COLS = [f"I{i}" for i in range(1, 14)]
CAT_COLS = [f"C{i}" for i in range(1, 27)]
COLUMNS = ["label", *INT_COLS, *CAT_COLS]


@dataclass
class CriteoConfig:
    """`data.params` of the criteo loader; values in conf/data/criteo.yaml (documented there)."""

    path: str  # train.txt or day_N, optionally .gz
    max_rows: int | None  # the first N lines; None: all
    categorical: str  # hash | vocab
    hash_buckets: int  # hash mode: rows per table before the cap (row 0 = empty value)
    max_buckets_per_value: float | None  # hash mode: cap per table; None: no cap
    min_count: int  # vocab mode: values seen fewer times in train -> id 0
    chunk_rows: int  # lines parsed at a time
    short_rows: str  # error | pad | skip


def load_criteo(
    path: str,
    max_rows: int | None,
    categorical: str,
    hash_buckets: int,
    max_buckets_per_value: float | None,
    min_count: int,
    chunk_rows: int,
    short_rows: str,
) -> Dataset:
    """Read a Criteo TSV file (rules in the module docstring).

    Args:
        The fields of `CriteoConfig`.
    Returns:
        A fingerprinted `Dataset`: dense [N, 13], ids [N, 26, 1], no user/item key.
    """
    file = Path(path)
    _check_settings(file, categorical, hash_buckets, max_buckets_per_value, short_rows)
    fmt = TextFormat("\t", tuple(COLUMNS), short_rows=short_rows, short_rows_key="data.params.short_rows")  # type: ignore[arg-type]

    # skip: the kept rows (and so the train split) are known only after counting the short lines
    total, short = (
        count_lines(file, max_rows, "\t", len(COLUMNS))
        if short_rows == "skip"
        else (
            count_lines(file)[0],
            0,
        )
    )
    n_lines = total if max_rows is None else min(total, max_rows)
    n = n_lines - short
    if n < MIN_ROWS:
        read = f"{n_lines} lines read" + (f" of {total} (data.params.max_rows)" if n_lines < total else "")
        raise ValueError(
            f"{file}: {n} usable rows ({read}" + (f", {short} short lines skipped" if short else "") + "); "
            f"the 80/10/10 train/validation/test split needs at least {MIN_ROWS} rows "
            "(8 train, 1 validation, 1 test)"
        )
    n_train = time_split(n)[0].stop
    vocabs = _vocabs(file, fmt, n_lines, n_train, min_count, chunk_rows) if categorical == "vocab" else None

    dense, ids, labels, padded, skipped_short, lo = _read_rows(
        file, fmt, n, n_lines, chunk_rows, vocabs, hash_buckets
    )
    assert lo == n and skipped_short == short, (lo, n, skipped_short, short)
    skipped = {
        "short_rows": skipped_short,
        "after_max_rows": total - n_lines,
    }  # the latter counted, not parsed

    if vocabs is not None:
        cards = [len(v) + 1 for v in vocabs]
    elif max_buckets_per_value is None:
        cards = [hash_buckets] * len(CAT_COLS)
    else:
        cards = _cap_buckets(ids, n_train, hash_buckets, max_buckets_per_value, file)
    schema = Schema(
        dense=tuple(DenseFeature(c, "context") for c in INT_COLS),
        sparse=tuple(SparseFeature(c, card, 1, "context") for c, card in zip(CAT_COLS, cards, strict=True)),
    )
    full = Split(
        torch.from_numpy(dense),
        torch.from_numpy(ids),
        torch.ones((1, 1), dtype=torch.int64).expand(n, len(CAT_COLS)),  # a view: no N x 26 int64s
        torch.from_numpy(labels),
    )
    ds = Dataset(
        schema,
        *(full.take(p) for p in time_split(n)),
        name=f"criteo_{file.name}",
        skipped={k: v for k, v in skipped.items() if v},
        padded={"short_rows": padded} if padded else {},
    )
    ds.compute_fingerprint()
    return ds


def _check_settings(
    file: Path, categorical: str, hash_buckets: int, max_buckets_per_value: float | None, short_rows: str
) -> None:
    """Every setting checked before the file is read; the errors name data.params.<key>."""
    if not file.is_file():
        raise FileNotFoundError(
            f"data.params.path: Criteo file {file} not found (cwd {Path.cwd()}). Download Criteo's "
            "display-advertising challenge data by hand (its terms must be accepted), extract train.txt "
            "(40 tab-separated fields per line) and point data.params.path at it; .gz files are read as is."
        )
    if categorical not in ("hash", "vocab"):
        raise ValueError(f"data.params.categorical: expected 'hash' or 'vocab', got {categorical!r}")
    if categorical == "hash" and hash_buckets < 2:
        raise ValueError(f"data.params.hash_buckets: expected >= 2 (id 0 is reserved), got {hash_buckets}")
    if max_buckets_per_value is not None and not max_buckets_per_value > 0:
        raise ValueError(
            f"data.params.max_buckets_per_value: expected > 0 or null, got {max_buckets_per_value}"
        )
    if short_rows not in SHORT_ROWS:
        raise ValueError(f"data.params.short_rows: expected one of {SHORT_ROWS}, got {short_rows!r}")


def _read_rows(
    file: Path, fmt: TextFormat, n: int, n_lines: int, chunk_rows: int, vocabs, hash_buckets: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int, int]:
    """The file's first n_lines lines, chunk by chunk: dense [n, 13] (log1p of the counts), ids [n, 26, 1]
    (hashed, or vocabulary positions + 1; 0 = empty or unknown), labels [n]; and the padded and skipped
    short lines and the rows read."""
    dense = np.zeros((n, len(INT_COLS)), dtype=np.float32)
    ids = np.zeros((n, len(CAT_COLS), 1), dtype=np.int64)
    labels = np.zeros(n, dtype=np.float32)
    padded = skipped_short = 0
    lo = 0
    for chunk in read_chunks(file, fmt, chunk_rows, limit=n_lines):
        table = chunk.table
        hi = lo + table.num_rows
        labels[lo:hi] = _labels(table["label"], chunk.lines, file)
        for j, col in enumerate(INT_COLS):
            x = arrow_numeric(table[col], chunk.lines, f"{file} column {col}", integer=True)
            dense[lo:hi, j] = np.nan_to_num(np.log1p(np.maximum(x, 0.0)), nan=0.0)
        for j, col in enumerate(CAT_COLS):
            values = table[col].combine_chunks()
            if vocabs is None:
                code = (hash_strings(values) % np.uint64(hash_buckets - 1)).astype(np.int64) + 1
                ids[lo:hi, j, 0] = np.where(values.is_null().to_numpy(zero_copy_only=False), 0, code)
            else:  # position in the vocabulary + 1; null (empty) and out-of-vocabulary -> 0
                pos = pc.index_in(values, value_set=vocabs[j]).fill_null(-1)
                ids[lo:hi, j, 0] = pos.to_numpy(zero_copy_only=False).astype(np.int64) + 1
        padded += chunk.padded
        skipped_short += chunk.skipped
        lo = hi
    return dense, ids, labels, padded, skipped_short, lo


def _labels(label: pa.ChunkedArray, lines: np.ndarray, file: Path) -> np.ndarray:
    """label: the chunk's label strings; lines: [rows] their line numbers -> [rows] float32 0/1."""
    ok = pc.is_in(label, value_set=pa.array(["0", "1"])).fill_null(False).to_numpy(zero_copy_only=False)
    if not ok.all():
        row = int(np.argmin(ok))
        value = label[row].as_py() or ""
        raise ValueError(f"{file}: line {lines[row]}: label {value!r}, expected 0 or 1")
    return pc.equal(label, "1").to_numpy(zero_copy_only=False).astype(np.float32)


def _cap_buckets(ids: np.ndarray, n_train: int, hash_buckets: int, per_value: float, file: Path) -> list[int]:
    """Shrink every hash table to what the train rows can fill, in place; prints the capped tables.

    Args:
        ids: [N, 26, 1] hashed ids in [0, hash_buckets), 0 = empty value.
        n_train: the train rows (the first n_train).
    Returns:
        The 26 cardinalities: min(hash_buckets, max(2, ceil(per_value x distinct train ids) + 1)).
    """
    cards, capped = [], []
    for j, name in enumerate(CAT_COLS):
        col = ids[:, j, 0]  # a view: edited in place
        seen = np.zeros(hash_buckets, dtype=bool)
        seen[col[:n_train]] = True
        distinct = int(seen[1:].sum())
        card = min(hash_buckets, max(2, int(np.ceil(per_value * distinct)) + 1))
        if card < hash_buckets:
            col[:] = np.where(col > 0, (col - 1) % (card - 1) + 1, 0)
            capped.append(f"{name} {card:,}")
        cards.append(card)
    if capped:
        print(
            f"[data] {file.name}: {len(capped)} of {len(CAT_COLS)} hash tables capped below "
            f"hash_buckets={hash_buckets:,} at {per_value:g} x their distinct train values + 1 "
            f"(data.params.max_buckets_per_value): {', '.join(capped)}",
            flush=True,
        )
    return cards


def hash_strings(values: pa.StringArray) -> np.ndarray:
    """[N] uint64 hash of each string's UTF-8 bytes, vectorised over Arrow's buffers (nulls: any value).

    A polynomial over the bytes (mod 2^64) finished by SplitMix64's mixer: deterministic across
    runs and platforms (unlike Python's hash) and ~20x faster than hashing Python string objects.
    """
    arr = pc.cast(values, pa.large_string())  # int64 offsets
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
    data = arr.buffers()[2]
    start, end = int(offsets[0]), int(offsets[-1])
    body = np.frombuffer(data, dtype=np.uint8)[start:end] if data is not None and end > start else None
    if body is None:
        return _mix(np.zeros(len(arr), dtype=np.uint64))
    lens = np.diff(offsets)
    pos = np.arange(end - start) - np.repeat(offsets[:-1] - start, lens)  # byte index in its string
    powers = np.cumprod(np.full(int(lens.max()), _PRIME, dtype=np.uint64))  # wraps mod 2^64
    csum = np.concatenate([[np.uint64(0)], np.cumsum((body.astype(np.uint64) + 1) * powers[pos])])
    h = csum[offsets[1:] - start] - csum[offsets[:-1] - start]  # per-string sums, mod 2^64
    return _mix(h + lens.astype(np.uint64))


_PRIME = np.uint64(0x100000001B3)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: spreads every input bit over the output (so `mod buckets` is uniform)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _vocabs(
    file: Path, fmt: TextFormat, n_lines: int, n_train: int, min_count: int, chunk_rows: int
) -> list[pa.Array]:
    """First pass over the first n_train rows (of the first n_lines lines): per categorical column, the
    values seen >= min_count times, most frequent first (position i -> id i + 1)."""
    counts: list[pa.Table | None] = [None] * len(CAT_COLS)
    seen = 0
    for chunk in read_chunks(file, fmt, chunk_rows, limit=n_lines):
        table = chunk.table.slice(0, n_train - seen)
        seen += table.num_rows
        for j, col in enumerate(CAT_COLS):
            vc = pc.value_counts(table[col].drop_null())
            part = pa.table({"value": vc.field("values"), "count": vc.field("counts").cast(pa.int64())})
            if counts[j] is not None:  # fold into the running totals: memory ~ distinct values
                total = pa.concat_tables([counts[j], part]).group_by("value").aggregate([("count", "sum")])
                part = total.select(["value", "count_sum"]).rename_columns(["value", "count"])
            counts[j] = part
        if seen >= n_train:
            break
    vocabs = []
    for c in counts:
        series = (
            pd.Series(dtype=np.int64)
            if c is None
            else pd.Series(c["count"].to_numpy(), index=c["value"].to_pandas())
        )
        vocabs.append(pa.array(vocab_from_counts(series, min_count).to_numpy(dtype=object), type=pa.string()))
    return vocabs
