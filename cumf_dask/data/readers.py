"""Readers for ingestion: each yields :class:`Chunk` objects of raw ids and ratings.

A reader never maps ids or validates ratings: :mod:`cumf_dask.data.ingest` does that for every
reader alike. Every record carries a number (``seq``) that says where it came from: for files,
``file_index * 2**40 + line`` (text, 1-based line) or ``+ row`` (Parquet, 1-based row); for
in-memory arrays, the 0-based position. :class:`Records` and :class:`Files` word those numbers
for error messages.
"""

from __future__ import annotations

import io
import itertools
import re
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from os import PathLike
from typing import IO, Any

import fsspec
import numpy as np
import pandas as pd
from fsspec.compression import compr
from fsspec.implementations.local import LocalFileSystem

from ..errors import IngestError

Column = str | int
FILE_STRIDE = 1 << 40  # seq = file index * FILE_STRIDE + line (or row)


@dataclass
class Chunk:
    """Raw ratings as read: ids of any type, ratings as text or numbers."""

    users: np.ndarray
    items: np.ndarray
    ratings: np.ndarray
    seq: np.ndarray  # int64 record numbers, see the module docstring
    done: int  # progress so far: bytes of input files, or records of in-memory input


@dataclass(frozen=True)
class TextFormat:
    """How to read one delimited text format."""

    delimiter: str | None  # None: runs of whitespace
    columns: tuple[Column, Column, Column] = (0, 1, 2)  # user, item, rating: name or position
    header: bool | None = None  # None: a header if line 1's rating field reads as a name
    fields: int | None = None  # fields per line (None: as many as line 1 has)
    blocks: bool = False  # Netflix: a line `movie_id:` heads a block of `user,rating,date` lines


# ----------------------------------------------------------------------------- record numbers


class Records:
    """Record numbers of in-memory input: the 0-based position in the arrays."""

    name = "the input"
    text_ids = False  # ids were read as text (their type is unknown)

    def __init__(self, total: int | None = None):
        self.total = total

    def where(self, seq: int) -> str:
        return f"record {int(seq)}"

    def pair(self, a: int, b: int) -> str:
        return f"records {int(a)} and {int(b)}"


class Files(Records):
    """Input files: a path, a glob or a list of them; local or fsspec URLs; compression inferred.

    Progress is counted in bytes of the files as stored (compressed bytes for .gz).
    """

    def __init__(self, path: str | PathLike[str] | Sequence[str | PathLike[str]], unit: str):
        paths = [str(p) for p in path] if isinstance(path, (list, tuple)) else str(path)
        self.files = fsspec.open_files(paths, "rb", compression="infer")
        self.name = paths if isinstance(paths, str) else ", ".join(paths)
        if not self.files:
            raise IngestError(f"{self.name}: no file matches; check the path")
        self.names = [
            f.path if isinstance(f.fs, LocalFileSystem) else f.full_name for f in self.files
        ]
        for f, name in zip(self.files, self.names, strict=True):
            if f.fs.isfile(f.path):
                if f.compression == "zip":  # fsspec would read its first member only
                    raise IngestError(
                        f"{name}: a zip archive{_members(f)}; unzip it and give the ratings "
                        "file inside"
                    )
                continue
            if f.fs.isdir(f.path):
                raise IngestError(
                    f"{name}: is a directory, not a ratings file; give a file in it, or a glob "
                    f"of its files (such as '{name.rstrip('/')}/*.csv')"
                )
            raise IngestError(f"{name}: no such file; check the path")
        sizes = [f.fs.size(f.path) for f in self.files]
        self.start = np.cumsum([0] + [s or 0 for s in sizes]).tolist()
        super().__init__(None if None in sizes else self.start[-1])
        self.unit = unit
        self.text_ids = unit == "line"

    def __len__(self) -> int:
        return len(self.files)

    def seq(self, k: int, first: int, count: int) -> np.ndarray:
        """Record numbers of `count` records of file `k` from line (or row) `first` on."""
        return np.arange(first, first + count, dtype=np.int64) + k * FILE_STRIDE

    def where(self, seq: int) -> str:
        k, line = divmod(int(seq), FILE_STRIDE)
        return f"{self.names[k]}, {self.unit} {line}"

    def pair(self, a: int, b: int) -> str:
        (ka, la), (kb, lb) = divmod(int(a), FILE_STRIDE), divmod(int(b), FILE_STRIDE)
        if ka == kb:
            return f"{self.names[ka]}, {self.unit}s {la} and {lb}"
        return f"{self.where(a)} and {self.where(b)}"

    @contextmanager
    def open(self, k: int) -> Iterator[tuple[IO[bytes], IO[bytes]]]:
        """(decompressed stream, raw file): the raw file's position measures progress."""
        f = self.files[k]
        with ExitStack() as stack:
            raw = stack.enter_context(f.fs.open(f.path, "rb"))
            data = (
                stack.enter_context(compr[f.compression](raw, mode="rb")) if f.compression else raw
            )
            yield data, raw


def _members(f: fsspec.core.OpenFile) -> str:
    """' (holding a.csv, b.txt)': the files in a zip archive, or '' when it cannot be read."""
    try:
        with f.fs.open(f.path, "rb") as raw:
            names = zipfile.ZipFile(raw).namelist()
    except (zipfile.BadZipFile, OSError):
        return ""
    return f" (holding {', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"


def position(column: Column, labels: list[str], count: int, where: str) -> int:
    """0-based position of a column given by name (among `labels`) or by position (< count)."""
    if isinstance(column, str):
        if column in labels:
            return labels.index(column)
        if not labels:
            raise IngestError(
                f"{where}: column {column!r} is given by name but the input has no header; "
                "pass header=True (--header) or give 0-based column positions"
            )
        raise IngestError(
            f"{where}: no column named {column!r} (the columns are {', '.join(labels)}); "
            "check the columns and the delimiter"
        )
    if 0 <= column < count:
        return column
    raise IngestError(
        f"{where}: no column {column}: the input has {count} column(s); check the columns "
        "(0-based) and the delimiter"
    )


# ----------------------------------------------------------------------------- text

_COMMENT = ("#", "%")  # how a comment line starts, to name one where it breaks the parse


def read_text(files: Files, spec: TextFormat, chunk_rows: int) -> Iterator[Chunk]:
    """Stream delimited text files in chunks of `chunk_rows` lines; blank lines are skipped."""
    for k in range(len(files)):
        yield from _read_text_file(files, k, spec, chunk_rows)


def _read_text_file(files: Files, k: int, spec: TextFormat, chunk_rows: int) -> Iterator[Chunk]:
    skip, positions, fields = _layout(files, k, spec)
    sep = r"\s+" if spec.delimiter is None else spec.delimiter
    multi = len(sep) > 1 and spec.delimiter is not None
    line, carry = 1 + skip, None
    with _text_errors(files.names[k]), files.open(k) as (data, raw):
        stream = _Spaces(data, spec.delimiter)
        reader = pd.read_csv(
            stream, sep=re.escape(sep) if multi else sep, engine="python" if multi else "c",
            header=None, names=list(range(fields)), index_col=False, skiprows=skip,
            dtype=object, na_filter=False, skip_blank_lines=False, skipinitialspace=True,
            chunksize=chunk_rows,
        )  # fmt: skip
        for table in reader:
            seq = files.seq(k, line, len(table))
            line += len(table)
            filled = ~(table == "").all(axis=1).to_numpy()
            table, seq = table[filled], seq[filled]
            if spec.blocks:
                table, seq, carry = _netflix_blocks(table, seq, carry, files)
            cols = [table[p].to_numpy(object) for p in positions]
            if stream.spaced:  # the parser strips leading whitespace only
                cols = [np.fromiter(map(str.strip, c), object, len(c)) for c in cols]
            missing = (cols[0] == "") | (cols[1] == "") | (cols[2] == "")
            if missing.any():
                bad = int(np.argmax(missing))
                where = files.where(seq[bad])
                if str(table.iloc[bad, 0]).lstrip().startswith(_COMMENT):
                    raise IngestError(
                        f"{where}: {str(table.iloc[bad, 0]).strip()[:40]!r} looks like a "
                        "comment; comment lines are not supported: remove them"
                    )
                raise IngestError(
                    f"{where}: a field is missing (lines have {fields} fields separated by "
                    f"{_show_sep(spec.delimiter)}); fix or remove the line"
                )
            yield Chunk(*cols, seq, files.start[k] + raw.tell())


def _layout(files: Files, k: int, spec: TextFormat) -> tuple[int, list[int], int]:
    """(lines before the ratings: the header's line number, or 0; positions of the user, item
    and rating columns; fields per line), from the first line that is not blank."""
    with _text_errors(files.names[k]), files.open(k) as (data, _):
        head = data.read(_SNIFF)
        kind = binary_kind(head)
        if kind is not None:
            raise IngestError(f"{files.names[k]}: not a text file: {kind}")
        number, first_bytes = _first_line(head, data)
        first = first_bytes.decode("utf-8-sig", errors="replace").rstrip("\r\n")
    where = f"{files.names[k]}, line {number}"
    if not first.strip():
        raise IngestError(
            f"{where}: the file is empty (or only blank lines); give a file with one rating "
            "per line"
        )
    fields = first.split(spec.delimiter) if spec.delimiter else first.split()
    header = spec.header
    if header is None:
        rating = spec.columns[2]
        header = isinstance(rating, str) or (rating < len(fields) and _is_name(fields[rating]))
    labels = [_unquote(f) for f in fields] if header else []
    count = spec.fields or len(fields)
    try:
        positions = [position(c, labels, count, where) for c in spec.columns]
    except IngestError:
        if first.lstrip().startswith(_COMMENT):
            raise IngestError(
                f"{where}: {first.strip()[:40]!r} looks like a comment; comment lines are not "
                "supported: remove them"
            ) from None
        raise
    return number if header else 0, positions, count


def _first_line(head: bytes, data: IO[bytes]) -> tuple[int, bytes]:
    """(number, bytes) of the first line that is not blank, (1, b"") if none: `head` is what
    was read of `data`, which is read on in blocks (a zstd stream has no readline)."""
    number, parts = 1, []
    for block in itertools.chain([head], iter(lambda: data.read(_SNIFF), b"")):
        *ends, rest = block.split(b"\n")
        for end in ends:
            line, parts = b"".join([*parts, end]), []
            if line.strip():
                return number, line
            number += 1
        parts.append(rest)
    line = b"".join(parts)
    return (number, line) if line.strip() else (1, b"")


_SNIFF = 8192  # bytes looked at to tell text from binary data
_MAGIC = (
    (b"\x1f\x8b", "it looks like gzip-compressed data; name it .gz (then it is decompressed) or "
     "decompress it (gunzip)"),
    (b"PK\x03\x04", "it looks like a zip archive; unzip it and give the ratings file inside"),
    (b"BZh", "it looks like bzip2-compressed data; name it .bz2 or decompress it (bunzip2)"),
    (b"\xfd7zXZ\x00", "it looks like xz-compressed data; name it .xz or decompress it (unxz)"),
    (b"\x28\xb5\x2f\xfd", "it looks like zstd-compressed data; decompress it (unzstd)"),
    (b"PAR1", "it looks like a Parquet file; use --format parquet"),
    (b"\x89HDF", "it looks like an HDF5 file; export the ratings as text or Parquet"),
    (b"\xff\xfe", "it looks like UTF-16 text; convert it to UTF-8 (iconv -f UTF-16)"),
    (b"\xfe\xff", "it looks like UTF-16 text; convert it to UTF-8 (iconv -f UTF-16)"),
)  # fmt: skip


class _Spaces(io.RawIOBase):
    """The stream pandas parses, noting whether a space or a tab that is not the delimiter
    went by: only then may a field end in whitespace, and are fields stripped (a Python call
    per value: too slow for every file)."""

    def __init__(self, data: IO[bytes], delimiter: str | None):
        super().__init__()
        self.data, self.spaced = data, False
        self.marks = [m for m in (b" ", b"\t") if delimiter not in (None, m.decode())]

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        block = self.data.read(size)
        self.spaced = self.spaced or any(m in block for m in self.marks)
        return block


def binary_kind(head: bytes) -> str | None:
    """What `head` (a file's first bytes, after any decompression by name) looks like when it
    is not text: compressed data, an archive, a known binary format, or binary data."""
    for magic, text in _MAGIC:
        if head.startswith(magic):
            return text
    if not head:
        return None
    controls = sum(1 for b in head if b < 32 and b not in b"\t\n\r\f\v") + head.count(127)
    if b"\x00" in head or controls > 0.05 * len(head):
        return (
            "it holds binary data (NUL or control bytes), not lines of ratings; give the "
            "ratings as text (csv, tsv, ...) or Parquet"
        )
    return None


def _netflix_blocks(
    table: pd.DataFrame, seq: np.ndarray, carry: str | None, files: Files
) -> tuple[pd.DataFrame, np.ndarray, str | None]:
    """Netflix Prize blocks -> columns (user, movie, rating); `carry` is the open block's movie."""
    first = table[0]
    head = first.str.endswith(":").to_numpy(bool)
    movie = first.str[:-1].where(head).ffill()
    if carry is not None:
        movie = movie.fillna(carry)
    orphan = movie.isna().to_numpy()
    if orphan.any():
        raise IngestError(
            f"{files.where(seq[np.argmax(orphan)])}: a rating line before any 'movie_id:' "
            "line; a Netflix file is blocks of a line like '1:' and then 'user,rating,date' lines"
        )
    if len(movie):
        carry = movie.iloc[-1]
    keep = ~head
    out = pd.DataFrame({0: first[keep], 1: movie[keep], 2: table[1][keep]})
    return out, seq[keep], carry


@contextmanager
def _text_errors(name: str) -> Iterator[None]:
    """Turn parser and decoding errors into one IngestError naming the file (and the line)."""
    try:
        yield
    except pd.errors.ParserError as exc:
        if "Calling read(nbytes) on source failed" in str(exc):
            # Ctrl-C in a read: pandas drops the handler's KeyboardInterrupt (a bare type, no
            # value yet) and raises this instead
            raise KeyboardInterrupt from None
        found = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", str(exc))
        if found is None:
            raise IngestError(f"{name}: cannot parse the file: {exc}") from None
        want, line, saw = found.groups()
        raise IngestError(
            f"{name}, line {line}: {saw} fields where lines have {want}; fix or remove the line "
            "(or check the delimiter)"
        ) from None
    except UnicodeDecodeError as exc:
        raise IngestError(f"{name}: not UTF-8 text ({exc}); is the format right?") from None
    except (OSError, EOFError) as exc:
        raise IngestError(f"{name}: cannot read the file ({exc})") from None


def _unquote(field: str) -> str:
    return field.strip().strip('"').strip()


def _is_name(field: str) -> bool:
    """Whether a field reads as a column name: it has a letter and is no number (nor nan or
    inf) and no NA."""
    text = _unquote(field)
    return bool(re.search(r"[^\W\d_]", text)) and not _is_number(text) and text.lower() not in _NA


_NA = {"na", "n/a", "#n/a", "<na>", "null", "none"}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _show_sep(delimiter: str | None) -> str:
    return "whitespace" if delimiter is None else repr(delimiter)


# ----------------------------------------------------------------------------- parquet


def read_parquet(files: Files, columns: Sequence[Column], chunk_rows: int) -> Iterator[Chunk]:
    """Stream Parquet files batch by batch (pyarrow), `chunk_rows` rows at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k, name in enumerate(files.names):
        try:
            with files.open(k) as (data, _):
                pf = pq.ParquetFile(data)
                labels = pf.schema_arrow.names
                names = [labels[position(c, labels, len(labels), name)] for c in columns]
                rows, total = 0, max(pf.metadata.num_rows, 1)
                for batch in pf.iter_batches(
                    batch_size=chunk_rows, columns=list(dict.fromkeys(names))
                ):
                    cols = [batch.column(c).to_numpy(zero_copy_only=False) for c in names]
                    cols[:2] = map(_nan_as_missing, cols[:2])
                    seq = files.seq(k, rows + 1, batch.num_rows)
                    rows += batch.num_rows
                    size = files.start[k + 1] - files.start[k]
                    yield Chunk(*cols, seq, files.start[k] + size * rows // total)
        except pa.ArrowException as exc:
            raise IngestError(f"{name}: cannot read it as Parquet ({exc})") from None


# ----------------------------------------------------------------------------- in memory


def read_arrays(
    users: np.ndarray, items: np.ndarray, ratings: np.ndarray, chunk_rows: int
) -> Iterator[Chunk]:
    """Slices of in-memory arrays (views, no copies; float ids with NaN excepted)."""
    for lo in range(0, len(ratings), chunk_rows):
        hi = min(lo + chunk_rows, len(ratings))
        seq = np.arange(lo, hi, dtype=np.int64)
        ids = (_nan_as_missing(a[lo:hi]) for a in (users, items))
        yield Chunk(*ids, ratings[lo:hi], seq, hi)


def _nan_as_missing(ids: np.ndarray) -> np.ndarray:
    """Float ids with NaN (a nullable integer column's nulls) as objects with None there:
    ingestion then names the id as missing, not as a fraction."""
    if ids.dtype.kind != "f" or not np.isnan(ids).any():
        return ids
    out = ids.astype(object)
    out[np.isnan(ids)] = None
    return out


def show(value: Any) -> str:
    """A user's id or rating as it should appear in a message."""
    return repr(value.item() if isinstance(value, np.generic) else value)
