"""Readers for ingestion: each yields :class:`Chunk` objects of raw ids and ratings.

A reader never maps ids or validates ratings: :mod:`cumf_dask.data.ingest` does that for every
reader alike. Every record carries a number (``seq``) that says where it came from: for files,
``file_index * 2**40 + line`` (text, 1-based line) or ``+ row`` (Parquet, 1-based row); for
in-memory arrays, the 0-based position. :class:`Records` and :class:`Files` word those numbers
for error messages.
"""

from __future__ import annotations

import bisect
import glob
import io
import itertools
import os
import re
import stat
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
    header: bool | None = None  # None: guessed from line 1 (:func:`_is_header`)
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
        self.name = paths if isinstance(paths, str) else ", ".join(paths)
        paths = _glob(paths) if isinstance(paths, str) else paths
        self.files = fsspec.open_files(paths, "rb", compression="infer") if paths else []
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
            special = _special(f.path) if isinstance(f.fs, LocalFileSystem) else None
            if special:
                raise IngestError(
                    f"{name}: is {special}, not a file (ingest reads its input more than "
                    "once); save the ratings to a file first and give that"
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


def _glob(path: str) -> str | list[str]:
    """`path`, or the files it matches when it is a glob with ? or [...] and no file of that
    very name (fsspec expands only '*'; in a web address, ? starts the query)."""
    if "*" in path or not glob.has_magic(path) or path.startswith(("http://", "https://")):
        return path
    fs, local = fsspec.core.url_to_fs(path)
    if fs.exists(local):
        return path
    return [fs.unstrip_protocol(p) for p in sorted(fs.glob(local)) if not fs.isdir(p)]


def _special(path: str) -> str | None:
    """What a local path that is neither a file nor a folder is ('a pipe', 'a device', ...),
    None when nothing is there."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return "a pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


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
    """Stream delimited text files in chunks of `chunk_rows` lines; blank lines (empty or
    whitespace only) are skipped."""
    for k in range(len(files)):
        yield from _read_text_file(files, k, spec, chunk_rows)


def _read_text_file(files: Files, k: int, spec: TextFormat, chunk_rows: int) -> Iterator[Chunk]:
    skip, positions, fields = _layout(files, k, spec)
    line, carry = 1 + skip, None
    separator = _separator(spec.delimiter)
    with _text_errors(files.names[k]), files.open(k) as (data, raw):
        stream = _Watched(data, spec.delimiter)
        reader = pd.read_csv(
            stream, header=None, names=list(range(fields)), skiprows=skip, chunksize=chunk_rows,
            **_PARSE, **separator,
        )  # fmt: skip
        for table in reader:
            if separator["engine"] == "python":  # it gives a field that a line lacks as None
                table = table.fillna("")
            seq = files.seq(k, line, len(table))
            line += len(table)
            filled = ~_blank_rows(table, seq - k * FILE_STRIDE, stream.blank_lines(line - 1))
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


# How every line is parsed (pandas): fields as text, nothing read as NA, leading whitespace
# skipped, blank lines kept (so that rows keep their line numbers)
_PARSE: dict[str, Any] = {
    "dtype": object, "index_col": False, "na_filter": False, "skip_blank_lines": False,
    "skipinitialspace": True,
}  # fmt: skip


def _separator(delimiter: str | None) -> dict[str, str]:
    """pandas' separator and engine for `delimiter`: the fast C parser, or Python's for a
    delimiter of several characters (matched literally)."""
    if delimiter is None:
        return {"sep": r"\s+", "engine": "c"}
    if len(delimiter) > 1:
        return {"sep": re.escape(delimiter), "engine": "python"}
    return {"sep": delimiter, "engine": "c"}


def _split(line: str, delimiter: str | None) -> list[str] | None:
    """The fields of one line, split as the parser splits every line (quotes and all); None
    when the line cannot be parsed alone (a quoted field goes on in the next line)."""
    try:
        table = pd.read_csv(io.StringIO(line), header=None, **_PARSE, **_separator(delimiter))
    except pd.errors.ParserError:
        return None
    return [str(f) for f in table.iloc[0]]


def _blank_rows(table: pd.DataFrame, lines: np.ndarray, blank: np.ndarray) -> np.ndarray:
    """Which rows are blank lines. The parser reads a blank line as empty fields, as it
    reads a line of only delimiters (whose fields are missing: an error), so the stream says
    which `lines` were `blank`; a row must also be empty to be dropped."""
    at = np.isin(lines, blank)
    if at.any():
        at[at] = table[at].map(str.strip).eq("").all(axis=1).to_numpy()
    return at


def _layout(files: Files, k: int, spec: TextFormat) -> tuple[int, list[int], int]:
    """(lines before the ratings: the header's line number, or 0; positions of the user, item
    and rating columns; fields per line), from the first line that is not blank. The first
    data line may not have more fields than that, as no later line may (the parser would
    drop the extra fields of the first with a warning)."""
    name = files.names[k]
    with _text_errors(name), files.open(k) as (data, _):
        head = data.read(_SNIFF)
        kind = binary_kind(head)
        if kind is not None:
            raise IngestError(f"{name}: not a text file: {kind}")
        lines = _first_lines(head, data, 2)
    if not lines:
        raise IngestError(
            f"{name}, line 1: the file is empty (or only blank lines); give a file with one "
            "rating per line"
        )
    number, first = lines[0]
    where = f"{name}, line {number}"
    fields = _split(first, spec.delimiter) or first.split(spec.delimiter)
    header = spec.header if spec.header is not None else _is_header(fields, spec.columns)
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
    line, width = number, len(fields)  # the first data line: line 1, or the one after a header
    if header:
        line, text = lines[1] if len(lines) > 1 else (number, "")
        width = len(_split(text, spec.delimiter) or []) if text else 0
    if width > count:
        raise _too_many(name, line, width, count, number if header else None)
    return number if header else 0, positions, count


def _is_header(fields: list[str], columns: tuple[Column, Column, Column]) -> bool:
    """Whether line 1 is a header: the rating column is given by name, or its rating field
    reads as a name and its user and item fields are not both numbers (then it is a data
    line with a bad rating, which is named as such)."""
    user, item, rating = columns
    if isinstance(rating, str):
        return True

    def number(column: Column) -> bool:
        return isinstance(column, int) and column < len(fields) and _is_number(fields[column])

    return rating < len(fields) and _is_name(fields[rating]) and not (number(user) and number(item))


def _first_lines(head: bytes, data: IO[bytes], count: int) -> list[tuple[int, str]]:
    """(number, text) of the first `count` lines that are not blank (fewer when there are
    not as many): `head` is what was read of `data`, which is read on in blocks (a zstd
    stream has no readline)."""
    found: list[tuple[int, str]] = []
    number, parts = 1, []
    for block in itertools.chain([head], iter(lambda: data.read(_SNIFF), b"")):
        *ends, rest = block.split(b"\n")
        for end in ends:
            line, parts = b"".join([*parts, end]), []
            if line.strip():
                found.append((number, _decode(line)))
                if len(found) == count:
                    return found
            number += 1
        parts.append(rest)
    line = b"".join(parts)
    return [*found, (number, _decode(line))] if line.strip() else found


def _decode(line: bytes) -> str:
    return line.decode("utf-8-sig", errors="replace").rstrip("\r\n")


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


class _Watched(io.RawIOBase):
    """The stream pandas parses, watched as it goes by: whether a space or a tab that is not
    the delimiter went by (only then may a field end in whitespace, and are fields stripped:
    a Python call per value, too slow for every file), and which lines are blank (empty or
    whitespace other than the delimiter: pandas reads them as it reads a line of only
    delimiters)."""

    def __init__(self, data: IO[bytes], delimiter: str | None):
        super().__init__()
        self.data, self.spaced = data, False
        self.marks = [m for m in (b" ", b"\t") if delimiter not in (None, m.decode())]
        self.blank: list[int] = []  # numbers of the blank lines read and not yet taken
        self._line, self._tail = 1, b""  # the number of the line that `_tail` begins
        space = bytes(c for c in b" \t\r\f\v" if delimiter is None or chr(c) not in delimiter)
        self._blank = re.compile(rb"\n[" + re.escape(space) + rb"]*(?=\n)")  # a blank line

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        block = self.data.read(size)
        self.spaced = self.spaced or any(m in block for m in self.marks)
        self._note_blank(block)
        return block

    def _note_blank(self, block: bytes) -> None:
        """Note the blank lines that `block` completes (all that are left, at the end)."""
        text = self._tail + block
        end = text.rfind(b"\n") + 1 if block else len(text)
        done = b"\n" + text[:end] + (b"" if block or not text else b"\n")
        self._tail = text[end:]
        line, at = self._line, 0
        for match in self._blank.finditer(done):
            line += done.count(b"\n", at, match.start())
            at = match.start()
            self.blank.append(line)
        self._line += done.count(b"\n") - 1

    def blank_lines(self, last: int) -> np.ndarray:
        """The numbers of the blank lines up to line `last`, which are then forgotten."""
        k = bisect.bisect_right(self.blank, last)
        taken, self.blank = self.blank[:k], self.blank[k:]
        return np.array(taken, np.int64)


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
        raise _too_many(name, int(line), int(saw), int(want)) from None
    except UnicodeDecodeError as exc:
        raise IngestError(f"{name}: not UTF-8 text ({exc}); is the format right?") from None
    except (OSError, EOFError) as exc:
        raise IngestError(f"{name}: cannot read the file ({exc})") from None


def _too_many(name: str, line: int, saw: int, want: int, header: int | None = None) -> IngestError:
    """The error of a line with more fields than lines have (than the header on line
    `header` names)."""
    if header is None:
        return IngestError(f"{name}, line {line}: {saw} fields where lines have {want}; fix or "
                           "remove the line (or check the delimiter)")  # fmt: skip
    return IngestError(
        f"{name}, line {line}: {saw} fields where the header (line {header}) names {want}; "
        "name every field in the header, or fix the line (or check the delimiter)"
    )


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


_PARQUET_NAMES = ("user", "item", "rating")  # a Parquet file's columns, by name if all there


def read_parquet(
    files: Files, columns: Sequence[Column] | None, chunk_rows: int
) -> Iterator[Chunk]:
    """Stream Parquet files batch by batch (pyarrow), `chunk_rows` rows at a time. Without
    `columns`, a file's columns named user, item and rating when it has all three, else its
    first three (in that order)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k, name in enumerate(files.names):
        try:
            with files.open(k) as (data, _):
                pf = pq.ParquetFile(data)
                labels = pf.schema_arrow.names
                named = set(_PARQUET_NAMES) <= set(labels)
                chosen = columns or (_PARQUET_NAMES if named else (0, 1, 2))
                names = [labels[position(c, labels, len(labels), name)] for c in chosen]
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
