"""Delimited text files (GroupLens ratings, Criteo logs, CSV/TSV tables) read in checked chunks.

pandas and Arrow alone fill a short line with nulls silently, skip blank lines without saying where,
and report bad bytes without the file name. Here every line is counted and its fields checked before
Arrow parses the chunk (multi-threaded, ~10x pandas' C parser on string columns), so every error
names the file and the physical line, and every row carries its line number for later messages.

Short lines (fewer fields than the header / layout) follow `TextFormat.short_rows`:
- error: raise naming file, line, and the fields expected and found (the default everywhere);
- pad:   the missing trailing fields read as empty (Criteo's public samples strip trailing empty
         fields from about half their lines); counted in `Chunk.padded`;
- skip:  the line is left out; counted in `Chunk.skipped`.
A line with too many fields always raises.
"""

from __future__ import annotations

import csv
import gzip
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import IO, Literal, get_args

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv

ShortRows = Literal["error", "pad", "skip"]
SHORT_ROWS: tuple[str, ...] = get_args(ShortRows)
ARROW_NULLS: tuple[str, ...] = tuple(pcsv.ConvertOptions().null_values)  # "", "NA", "NULL", "nan", ...
_BLOCK = 1 << 24  # bytes read at a time when only counting lines


@dataclass(frozen=True)
class TextFormat:
    """How one file is laid out.

    sep: field separator (one or more characters; '::' for ml-1m).
    names: the column names, one per field, in file order.
    header: the first line holds the names (checked against `names`).
    quoted: '"' quotes fields (CSV written by pandas/Excel); GroupLens and Criteo files never quote.
    short_rows: error | pad | skip, see the module docstring.
    skip_blank_lines: blank lines are not rows (CSV convention); otherwise a blank line is a short row.
    null_values: cell texts read as missing.
    short_rows_key, encoding_key: the config keys that set `short_rows` / `encoding`, named in errors.
    """

    sep: str
    names: tuple[str, ...]
    encoding: str = "utf-8"
    header: bool = False
    quoted: bool = False
    short_rows: ShortRows = "error"
    skip_blank_lines: bool = False
    null_values: tuple[str, ...] = ("",)
    short_rows_key: str = ""
    encoding_key: str = ""

    def short_hint(self) -> str:
        if not self.short_rows_key:
            return ""
        return (
            f"; set {self.short_rows_key}=pad to read missing trailing fields as empty, "
            "or skip to leave such lines out"
        )

    def encoding_hint(self) -> str:
        return f"; set {self.encoding_key} to the file's encoding (e.g. latin-1)" if self.encoding_key else ""


@dataclass
class Chunk:
    """Up to `chunk_rows` consecutive lines of a file, parsed.

    lines: [rows] int64, the 1-based file line of each row.
    table: one string column per selected name; missing values are null.
    padded: short lines completed with empty trailing fields.
    skipped: short lines left out.
    """

    lines: np.ndarray
    table: pa.Table
    padded: int = 0
    skipped: int = 0


def open_binary(path: Path) -> IO[bytes]:
    """The file's bytes; .gz files are decompressed on the fly."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_header(path: Path, fmt: TextFormat) -> list[str]:
    """The column names on line 1 of a delimited file (fmt.names is not used).

    Returns:
        The names in file order; raises naming the file if it is empty or a name repeats.
    """
    with open_binary(path) as f:
        line = f.readline()
    if not line.strip():
        raise ValueError(f"{path}: line 1: expected a header line with the column names, found an empty line")
    names = _split(_decode(line, path, 1, fmt).rstrip("\r\n"), fmt.sep, fmt.quoted)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{path}: line 1: column name(s) {repeated} appear more than once")
    return names


def read_chunks(
    path: Path,
    fmt: TextFormat,
    chunk_rows: int,
    limit: int | None = None,
    columns: Sequence[str] | None = None,
) -> Iterator[Chunk]:
    """Parse a delimited file `chunk_rows` lines at a time.

    Args:
        path: the file (.gz read as is).
        fmt: its layout; every line must have len(fmt.names) fields (see `TextFormat.short_rows`).
        chunk_rows: lines per chunk; bounds the parser's temporary memory.
        limit: read only the first `limit` data lines (after the header).
        columns: the names to parse (default all); the others are checked but not converted.
    Returns:
        An iterator of `Chunk`s in file order; every column a string column.
    """
    with open_binary(path) as f:
        line_no = 0
        if fmt.header:
            first = f.readline()
            line_no = 1
            found = _split(_decode(first, path, 1, fmt).rstrip("\r\n"), fmt.sep, fmt.quoted)
            if found != list(fmt.names):
                raise ValueError(
                    f"{path}: line 1: expected header {fmt.sep.join(fmt.names)!r}, found {fmt.sep.join(found)!r}"
                )
        left = -1 if limit is None else limit
        while left != 0 and (lines := list(islice(f, chunk_rows if left < 0 else min(chunk_rows, left)))):
            start = line_no + 1
            line_no += len(lines)
            left = max(left - len(lines), 0) if left > 0 else left
            yield _chunk(path, fmt, lines, start, list(columns or fmt.names))


def _chunk(path: Path, fmt: TextFormat, lines: list[bytes], start: int, columns: list[str]) -> Chunk:
    sep = fmt.sep.encode()
    want = len(fmt.names)
    drop: list[int] = []
    padded = skipped = 0
    for i, ln in enumerate(lines):
        n = _count_fields(ln, sep, fmt.quoted)
        if n == want:
            continue
        if fmt.skip_blank_lines and not ln.strip():
            drop.append(i)
        elif n > want or fmt.short_rows == "error":
            raise ValueError(
                f"{path}: line {start + i}: expected {want} fields separated by {fmt.sep!r} "
                f"({', '.join(fmt.names)}), found {n}" + (fmt.short_hint() if n < want else "")
            )
        elif fmt.short_rows == "skip":
            drop.append(i)
            skipped += 1
        else:  # pad: the missing trailing fields are empty values
            lines[i] = ln.rstrip(b"\r\n") + sep * (want - n) + b"\n"
            padded += 1
    line_nos = np.arange(start, start + len(lines), dtype=np.int64)
    if drop:
        kept = np.ones(len(lines), dtype=bool)
        kept[drop] = False
        lines = [ln for ln, k in zip(lines, kept, strict=True) if k]
        line_nos = line_nos[kept]
    return Chunk(line_nos, _parse(path, fmt, lines, line_nos, columns), padded, skipped)


def _count_fields(line: bytes, sep: bytes, quoted: bool) -> int:
    if quoted and b'"' in line:  # a separator inside quotes does not split; rare, so the slow path
        text = line.decode("latin-1").rstrip("\r\n")  # latin-1 never fails; separators are ASCII
        return len(next(csv.reader([text], delimiter=sep.decode(), quotechar='"'), []))
    return line.count(sep) + 1


def _parse(
    path: Path, fmt: TextFormat, lines: list[bytes], line_nos: np.ndarray, columns: list[str]
) -> pa.Table:
    if not lines:
        return pa.table({c: pa.array([], pa.string()) for c in columns})
    text, sep = b"".join(lines), fmt.sep.encode()
    if len(sep) > 1:  # Arrow needs a one-byte delimiter: swap '::' for a byte the text lacks
        one = next(c for c in (b"\t", b"\x1f", b"\x1e", b"\x1d") if c not in text)
        text, sep = text.replace(sep, one), one
    try:
        return pcsv.read_csv(
            io.BytesIO(text),
            read_options=pcsv.ReadOptions(column_names=list(fmt.names), encoding=fmt.encoding),
            parse_options=pcsv.ParseOptions(
                delimiter=sep.decode(), quote_char='"' if fmt.quoted else False, ignore_empty_lines=False
            ),
            convert_options=pcsv.ConvertOptions(
                include_columns=columns,
                column_types={n: pa.string() for n in columns},
                null_values=list(fmt.null_values),
                strings_can_be_null=True,
            ),
        )
    except (pa.ArrowInvalid, UnicodeDecodeError) as e:
        for ln, no in zip(lines, line_nos, strict=True):  # which line? decode them one by one
            _decode(ln, path, int(no), fmt)
        raise ValueError(f"{path}: lines {line_nos[0]}-{line_nos[-1]}: {e}") from None


def _decode(line: bytes, path: Path, line_no: int, fmt: TextFormat) -> str:
    try:
        return line.decode(fmt.encoding)
    except UnicodeDecodeError as e:
        bad = line[e.start : e.start + 1].hex()
        raise ValueError(
            f"{path}: line {line_no}: byte {e.start + 1} (0x{bad}) is not valid {fmt.encoding} text"
            + fmt.encoding_hint()
        ) from None


def _split(line: str, sep: str, quoted: bool) -> list[str]:
    if quoted and len(sep) == 1:
        return next(csv.reader([line], delimiter=sep, quotechar='"'), [])
    return line.split(sep)


def read_frames(
    path: Path, fmt: TextFormat, chunk_rows: int, limit: int | None = None
) -> Iterator[pd.DataFrame]:
    """`read_chunks` as DataFrames of strings (missing: NaN), indexed by 1-based line number."""
    for chunk in read_chunks(path, fmt, chunk_rows, limit):
        frame = chunk.table.to_pandas()
        frame.index = pd.Index(chunk.lines)
        yield frame


def count_lines(
    path: Path, limit: int | None = None, sep: str | None = None, fields: int = 0
) -> tuple[int, int]:
    """Count lines by 16 MB blocks (a final line without a newline counts) without parsing them.

    Args:
        path: the file (.gz read as is).
        limit, sep, fields: also count, among the first `limit` lines (all if None), those with fewer
            than `fields` fields separated by the one-byte `sep` (blank lines included).
    Returns:
        (lines in the file, short lines among the first `limit`); the second is 0 without `sep`.
    """
    lines = short = 0
    left = limit if limit is not None else -1
    sep_byte = None if sep is None else ord(sep.encode())
    carry = b""
    with open_binary(path) as f:
        while True:
            block = f.read(_BLOCK)
            buf = carry + block if carry else block
            if not block:
                break
            arr = np.frombuffer(buf, dtype=np.uint8)
            ends = np.flatnonzero(arr == 10)
            if sep_byte is not None and left != 0:
                take = len(ends) if left < 0 else min(len(ends), left)
                per_line = np.diff(np.searchsorted(np.flatnonzero(arr == sep_byte), ends[:take]), prepend=0)
                short += int((per_line < fields - 1).sum())
                left = left - take if left > 0 else left
            lines += len(ends)
            carry = buf[ends[-1] + 1 :] if len(ends) else buf
    if carry:  # the last line has no newline
        lines += 1
        if sep_byte is not None and left != 0 and carry.count(bytes([sep_byte])) < fields - 1:
            short += 1
    return lines, short
