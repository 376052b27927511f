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
import gzip
import io
import itertools
import lzma
import os
import re
import stat
import warnings
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from os import PathLike
from pathlib import PurePosixPath
from typing import IO, Any

import fsspec
import numpy as np
import pandas as pd
from fsspec.compression import compr
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import compressions

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
    # user, item, rating: name or position; None: as Parquet's (:func:`default_columns`)
    columns: tuple[Column, Column, Column] | None = None
    header: bool | None = None  # None: guessed from line 1 (:func:`_is_header`)
    fields: int | None = None  # fields per line (None: as many as line 1 has)
    blocks: bool = False  # Netflix: a line `movie_id:` heads a block of `user,rating,date` lines
    # the delimiter doubled in the file ('::' read as ':' with an empty field between each
    # two, for the fast parser: movielens-1m); messages count the file's own fields
    doubled: bool = False

    def count(self, fields: int) -> int:
        """`fields` as the format counts them ('::' read as ':' splits N fields into 2N - 1)."""
        return fields // 2 + 1 if self.doubled else fields

    def lines(self, fields: int) -> str:
        """'lines have N fields separated by D', in the format's terms."""
        shown = 2 * self.delimiter if self.doubled and self.delimiter else self.delimiter
        return f"lines have {self.count(fields)} fields separated by {_show_sep(shown)}"


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

    def origin(self, seq: int) -> str:
        """The input a record came from: its file, or the input when in memory."""
        return self.name


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
                    f"of its files (such as '{name.rstrip('/')}/*{_extension(f, unit)}')"
                )
            special = _special(f.path) if isinstance(f.fs, LocalFileSystem) else None
            if special:
                raise IngestError(
                    f"{name}: is {special}, not a file (ingest reads its input more than "
                    "once); save the ratings to a file first and give that"
                )
            raise IngestError(f"{name}: no such file; check the path")
        self.stamps = self._stamps()
        sizes = [size for size, _ in self.stamps]
        self.start = np.cumsum([0] + [s or 0 for s in sizes]).tolist()
        super().__init__(None if None in sizes else self.start[-1])
        self.unit = unit
        self.text_ids = unit == "line"

    def _stamps(self) -> list[tuple[int | None, Any]]:
        """(bytes, modification time) of each file; None where the file system keeps none."""
        stamps = []
        for f in self.files:
            try:
                modified = f.fs.modified(f.path)
            except (NotImplementedError, OSError):
                modified = None
            stamps.append((f.fs.size(f.path), modified))
        return stamps

    def check_unchanged(self) -> None:
        """Refuse files that changed while they were read: the ratings would mix two
        versions of a file, and the store's source would name a state never read whole."""
        for name, (size, modified), (now, later) in zip(
            self.names, self.stamps, self._stamps(), strict=True
        ):
            if (size, modified) != (now, later):
                raise IngestError(
                    f"{name}: changed while it was read (size {size} -> {now} bytes, "
                    f"modified {modified} -> {later}); ingest it again once it is complete"
                )

    def __len__(self) -> int:
        return len(self.files)

    def seq(self, k: int, first: int, count: int) -> np.ndarray:
        """Record numbers of `count` records of file `k` from line (or row) `first` on."""
        return np.arange(first, first + count, dtype=np.int64) + k * FILE_STRIDE

    def where(self, seq: int) -> str:
        k, line = divmod(int(seq), FILE_STRIDE)
        return f"{self.names[k]}, {self.unit} {line}"

    def origin(self, seq: int) -> str:
        return self.names[int(seq) // FILE_STRIDE]

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


def _extension(folder: fsspec.core.OpenFile, unit: str) -> str:
    """The extension most files in `folder` have ('.csv', '.csv.gz'; hidden files and
    Spark's '_SUCCESS' aside), else the format's: '.parquet' (rows) or '.csv' (lines)."""
    try:
        entries = folder.fs.ls(folder.path, detail=True)
    except Exception:  # only for an example in a message: a remote filesystem's own error too
        entries = []
    found: Counter[str] = Counter()
    for entry in entries:
        base = PurePosixPath(entry["name"])
        if entry["type"] == "file" and base.suffix and not base.name.startswith((".", "_")):
            compressed = base.suffix[1:] in compressions and len(base.suffixes) > 1
            found["".join(base.suffixes[-2:]) if compressed else base.suffix] += 1
    if found:
        return found.most_common(1)[0][0]
    return ".parquet" if unit == "row" else ".csv"


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


def positions(columns: Sequence[Column], labels: list[str], count: int, where: str) -> list[int]:
    """0-based positions of the user, item and rating columns (:func:`position`); an input of
    two columns has no rating (interactions without a count): named as such."""
    rating = columns[2]
    if count == 2 and isinstance(rating, int) and rating >= count:
        raise IngestError(
            f"{where}: the input has 2 columns and no rating column; add a third column with "
            "the rating (for implicit feedback, a count: 1 for each interaction)"
        )
    return [position(c, labels, count, where) for c in columns]


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
    files.check_unchanged()


def _read_text_file(files: Files, k: int, spec: TextFormat, chunk_rows: int) -> Iterator[Chunk]:
    skip, picked, fields = _layout(files, k, spec)
    carry, separator = None, _separator(spec.delimiter)
    with _text_errors(files, k, spec) as lines, files.open(k) as (data, raw):
        stream = lines.stream = _Watched(data, spec.delimiter)
        lines.record = lines.line = 1 + skip
        reader = pd.read_csv(
            stream, header=None, names=list(range(fields)), skiprows=skip, chunksize=chunk_rows,
            **_PARSE, **separator,
        )  # fmt: skip
        python = separator["engine"] == "python"
        for table in _strict(reader) if python else reader:
            stream.refuse(files.names[k])
            if python:  # it gives a field that a line lacks as None
                table = table.fillna("")
            seq = lines.number(table)
            blank = stream.blank_lines(lines.line - 1)
            filled = ~_blank_rows(table, seq - k * FILE_STRIDE, blank)
            table, seq = table[filled], seq[filled]
            if spec.blocks:
                table, seq, carry = _netflix_blocks(table, seq, carry, files)
            cols = [table[p].to_numpy(object) for p in picked]
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
                    f"{where}: a field is missing ({spec.lines(fields)}); fix or remove the line"
                )
            yield Chunk(*cols, seq, files.start[k] + raw.tell())
        stream.refuse(files.names[k])


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


def _line_breaks(table: pd.DataFrame) -> np.ndarray | None:
    """The line breaks in each row's fields (a quoted field may hold some, which the parser
    keeps), None when there are none: a fast scan of each column first."""
    columns = [table[c].to_numpy(object) for c in table]
    if not any("\n" in "".join(c) for c in columns):
        return None
    return sum(np.char.count(c.astype(str), "\n") for c in columns).astype(np.int64)


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
    with _text_errors(files, k, spec), files.open(k) as (data, _):
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
    given = spec.columns or _FIRST_THREE
    header = spec.header if spec.header is not None else _is_header(fields, given)
    if header and _reads_as_rating(fields, given):
        raise IngestError(
            f"{where}: a header was asked for (--header) but this line ({first.strip()[:60]!r}) "
            "reads as a rating; drop --header (header=True)"
        )
    labels = [_unquote(f) for f in fields] if header else []
    count = spec.fields or len(fields)
    try:
        found = positions(spec.columns or default_columns(labels, where), labels, count, where)
    except IngestError:
        if first.lstrip().startswith(_COMMENT):
            raise IngestError(
                f"{where}: {first.strip()[:40]!r} looks like a comment; comment lines are not "
                "supported: remove them"
            ) from None
        if "::" in first:
            raise IngestError(
                f"{where}: the fields of this line ({first.strip()[:40]!r}) are separated by "
                "'::', as in MovieLens 1M/10M ratings.dat; use --format movielens-1m"
            ) from None
        raise
    line, width = number, len(fields)  # the first data line: line 1, or the one after a header
    if header:
        line, text = lines[1] if len(lines) > 1 else (number, "")
        width = len(_split(text, spec.delimiter) or []) if text else 0
    if width > count:
        raise _too_many(name, f"line {line}", spec, width, count, number if header else None)
    return number if header else 0, found, count


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


def _reads_as_rating(fields: list[str], columns: tuple[Column, Column, Column]) -> bool:
    """Whether a line taken as the header is a rating: its columns are given by position
    and every field is a number (a header there would drop that rating silently)."""
    named = any(isinstance(c, str) for c in columns)
    return not named and all(_is_number(_unquote(f)) for f in fields)


def _first_lines(head: bytes, data: IO[bytes], count: int) -> list[tuple[int, str]]:
    """(number, text) of the first `count` lines that are not blank (fewer when there are
    not as many), a line going on past a line break inside quotes (for 1 MB at most: a
    stray quote opens none for the parser): `head` is what was read of `data`, which is
    read on in blocks (a zstd stream has no readline)."""
    found: list[tuple[int, str]] = []
    number, start, parts, inside, size = 1, 1, [], False, 0
    for block in itertools.chain([head], iter(lambda: data.read(_SNIFF), b"")):
        *ends, rest = block.split(b"\n")
        for end in ends:
            parts.append(end)
            number, inside = number + 1, inside ^ (end.count(b'"') % 2 == 1)
            size += len(end) + 1
            if inside and size < _SPAN:  # a quoted field goes on in the next line
                parts.append(b"\n")
                continue
            line, parts, inside, size = b"".join(parts), [], False, 0
            if line.strip():
                found.append((start, _decode(line)))
                if len(found) == count:
                    return found
            start = number
        parts.append(rest)
        inside, size = inside ^ (rest.count(b'"') % 2 == 1), size + len(rest)
    line = b"".join(parts)
    return [*found, (start, _decode(line))] if line.strip() else found


def _decode(line: bytes) -> str:
    return line.decode("utf-8-sig", errors="replace").rstrip("\r\n")


_SNIFF = 8192  # bytes looked at to tell text from binary data
_SPAN = 1 << 20  # the most bytes of a line with a quoted line break that _first_lines joins
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
    delimiters), and the lines of the first quote (a quoted field may hold line breaks)
    and of the first NUL byte (binary data; line 1's is refused before: :func:`binary_kind`)."""

    def __init__(self, data: IO[bytes], delimiter: str | None):
        super().__init__()
        self.data, self.delimiter, self.spaced = data, delimiter, False
        self.quote: int | None = None
        self.nul: int | None = None
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
        self.quote = self.quote or self._line_of(block, b'"')
        self.nul = self.nul or self._line_of(block, b"\x00")
        self._note_blank(block)
        return block

    @property
    def quoted(self) -> bool:
        return self.quote is not None

    def _line_of(self, block: bytes, byte: bytes) -> int | None:
        """The line of the first `byte` in `block` (None when there is none)."""
        at = block.find(byte)
        return None if at < 0 else self._line + (self._tail + block[:at]).count(b"\n")

    def refuse(self, name: str) -> None:
        """Raise the error of a NUL byte (the parser would take it into a field: an id
        holding it), or of a quote with a delimiter of several characters (the parser
        splits at such a delimiter inside quotes), if one went by."""
        if self.nul is not None:
            raise IngestError(f"{name}, line {self.nul}: not a text file: {_BINARY}")
        if self.quote is not None and self.delimiter is not None and len(self.delimiter) > 1:
            raise IngestError(
                f"{name}, line {self.quote}: a quote (\"), and with a delimiter of several "
                f"characters ({self.delimiter!r}) quotes do not keep a field together (one "
                "holding the delimiter would be split); use a one-character delimiter, or "
                "remove the quotes"
            )

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
        return _BINARY
    return None


_BINARY = (
    "it holds binary data (NUL or control bytes), not lines of ratings; give the ratings as "
    "text (csv, tsv, ...) or Parquet"
)


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
def _read_errors(name: str) -> Iterator[None]:
    """Turn errors of reading a file (damaged compressed data included: zlib and lzma raise
    their own errors, no OSError) into one IngestError naming the file."""
    try:
        yield
    except (zlib.error, lzma.LZMAError, gzip.BadGzipFile, EOFError) as exc:
        if str(exc).startswith("Not a gzipped file"):
            raise IngestError(f"{name}: not gzip-compressed data ({exc}); if it is plain text, "
                              "name it without .gz") from None  # fmt: skip
        raise IngestError(
            f"{name}: the compressed data is damaged or cut short ({exc}); download or copy the "
            "file again"
        ) from None
    except OSError as exc:
        raise IngestError(f"{name}: cannot read the file ({exc})") from None


@dataclass
class _Lines:
    """The line each record of a file begins on. The parser numbers records (1-based,
    skipped lines counted), and a record spans more lines than one when a quoted field holds
    line breaks: `record` is the number of the next record and `line` its line."""

    files: Files
    k: int
    stream: _Watched | None = None
    record: int = 1
    line: int = 1

    def number(self, table: pd.DataFrame) -> np.ndarray:
        """The record numbers (:class:`Files`: file and line) of the next rows, `table`."""
        seq = self.files.seq(self.k, self.line, len(table))
        breaks = _line_breaks(table) if self.stream is not None and self.stream.quoted else None
        if breaks is not None:  # a row begins after the line breaks of the rows before
            seq[1:] += np.cumsum(breaks[:-1])
        self.record += len(table)
        self.line += len(table) + (0 if breaks is None else int(breaks.sum()))
        return seq

    def at(self, record: int) -> str:
        """'line N' of the record the parser numbers `record`, not read yet (it names it in
        its errors): found by reading the file again when a quote went by."""
        ahead = record - self.record
        if self.stream is not None and self.stream.quoted:
            return f"line {_record_line(self.files, self.k, self.line, ahead)}"
        return f"line {self.line + ahead}"


def _record_line(files: Files, k: int, start: int, ahead: int) -> int:
    """The line that the record `ahead` records after the one on line `start` begins on: a
    record goes on past a line break inside quotes (after an odd count of quotes in it)."""
    inside, number = False, start - 1
    with _read_errors(files.names[k]), files.open(k) as (data, _):
        for number, raw in enumerate(_raw_lines(data, start), start):
            if not inside:
                if ahead == 0:
                    return number
                ahead -= 1
            inside ^= raw.count(b'"') % 2 == 1
    return number + 1


def _raw_lines(data: IO[bytes], first: int) -> Iterator[bytes]:
    """The lines of a stream from line `first` on, read in blocks (a zstd stream has no
    readline); those before are skipped a block at a time."""
    number, tail = 1, b""  # the number of the line that `tail` begins
    for block in iter(lambda: data.read(1 << 20), b""):
        *lines, tail = (tail + block).split(b"\n")
        yield from lines[max(first - number, 0) :]
        number += len(lines)
    if tail and number >= first:
        yield tail


def _strict(reader: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
    """The Python engine's chunks, its ParserWarning raised as an error (:func:`_text_errors`):
    before pandas 3.1 it drops a line's extra fields with a warning ("loss of data with
    index_col=False"). Only that engine: catch_warnings changes the process's filters,
    which other threads share, for the time a chunk is parsed."""
    while True:
        with warnings.catch_warnings():
            warnings.simplefilter("error", pd.errors.ParserWarning)
            table = next(reader, None)
        if table is None:
            return
        yield table


@contextmanager
def _text_errors(files: Files, k: int, spec: TextFormat) -> Iterator[_Lines]:
    """Turn parser and decoding errors into one IngestError naming the file (and the line)."""
    name, lines = files.names[k], _Lines(files, k)
    try:
        with _read_errors(name):
            yield lines
    except pd.errors.ParserError as exc:
        if "Calling read(nbytes) on source failed" in str(exc):
            # Ctrl-C in a read: pandas drops the handler's KeyboardInterrupt (a bare type, no
            # value yet) and raises this instead
            raise KeyboardInterrupt from None
        if lines.stream is not None:  # a NUL byte or a quote that went by is the cause
            lines.stream.refuse(name)
        raise _parse_error(name, str(exc), lines, spec) from None
    except pd.errors.ParserWarning as exc:
        if lines.stream is not None:
            lines.stream.refuse(name)
        raise IngestError(f"{name}: lines differ in their number of fields ({exc}); fix or "
                          "remove the line that differs (or check the delimiter)") from None
    except UnicodeDecodeError:
        raise _not_utf8(files, k) from None


def _parse_error(name: str, message: str, lines: _Lines, spec: TextFormat) -> IngestError:
    """The error of a line the parser refused: too many fields, or a quote never closed."""
    found = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", message)
    if found is not None:
        want, record, saw = found.groups()
        return _too_many(name, lines.at(int(record)), spec, int(saw), int(want))
    found = re.search(r"EOF inside string starting at row (\d+)", message)
    if found is not None:  # a 0-based record number
        return IngestError(
            f"{name}, {lines.at(int(found.group(1)) + 1)}: a quote (\") opens a field that is "
            "never closed; close or remove it"
        )
    return IngestError(f"{name}: cannot parse the file: {message}")


def _not_utf8(files: Files, k: int) -> IngestError:
    """The error of a file that is not UTF-8, naming the first line that is not (the
    parser's error says where in its buffer only), found by reading the file again."""
    name = files.names[k]
    with _read_errors(name), files.open(k) as (data, _):
        for number, raw in enumerate(_raw_lines(data, 1), 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return IngestError(
                    f"{name}, line {number}: byte 0x{raw[exc.start]:02x} is not UTF-8 text; "
                    "convert the file to UTF-8 (such as iconv -f latin1 -t utf-8 IN > OUT)"
                )
    return IngestError(f"{name}: not UTF-8 text; convert the file to UTF-8")


def _too_many(
    name: str, at: str, spec: TextFormat, saw: int, want: int, header: int | None = None
) -> IngestError:
    """The error of a line (`at`: 'line 7') with more fields than lines have (than the
    header on line `header` names), counted as the format counts them."""
    saw, want = spec.count(saw), spec.count(want)
    if header is None:
        return IngestError(f"{name}, {at}: {saw} fields where lines have {want}; fix or "
                           "remove the line (or check the delimiter)")  # fmt: skip
    return IngestError(
        f"{name}, {at}: {saw} fields where the header (line {header}) names {want}; "
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


# ----------------------------------------------------------------------------- columns

_NAMES = ("user", "item", "rating")  # the columns when none are given, by name if all there
_FIRST_THREE = (0, 1, 2)  # else by position
# Names that say which column is which (lower case): positions 0, 1, 2 of the fallback
_ROLES = {"user": 0, "userid": 0, "user_id": 0, "item": 1, "itemid": 1, "item_id": 1,
          "movie": 1, "movieid": 1, "movie_id": 1, "rating": 2, "ratings": 2}  # fmt: skip


def default_columns(labels: list[str], where: str) -> tuple[Column, Column, Column]:
    """The user, item and rating columns when none are given, among the columns named
    `labels` (a Parquet schema, a text header; none: by position): those named user, item
    and rating when all three are there, else the first three, unless a name says that a
    column is another one (refused: a silent mis-parse)."""
    if set(_NAMES) <= set(labels):
        return _NAMES
    wrong = misplaced(labels, "the file")
    if wrong is not None:
        problem, example = wrong
        raise IngestError(f"{where}: {problem}; give the columns (--columns "
                          f"{','.join(example)})")  # fmt: skip
    return _FIRST_THREE


def misplaced(labels: Sequence[Any], subject: str) -> tuple[str, list[str]] | None:
    """A column whose name says it is another one than the first three read it as (a
    'rating' column second: item ids), as (the problem, said of `subject`; the user, item
    and rating columns by name: USER, ITEM, RATING where the names do not say them all);
    None when there is none."""
    names = [str(label) for label in labels]
    roles = [_ROLES.get(label.lower()) for label in names]
    at = next((i for i, role in enumerate(roles) if role is not None and role != i), None)
    if at is None:
        return None
    found = {role: label for role, label in zip(roles, names, strict=True) if role is not None}
    example = [found[r] for r in range(3)] if len(found) == 3 else ["USER", "ITEM", "RATING"]
    problem = (f"the column {names[at]!r} is at position {at}, so the first three columns "
               f"(read as user, item, rating when {subject} lacks columns named user, item and "
               "rating) would misread it")  # fmt: skip
    return problem, example


# ----------------------------------------------------------------------------- parquet


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
            with _read_errors(name), files.open(k) as (data, _):
                pf = pq.ParquetFile(data)
                picked, read = _parquet_columns(pf.schema_arrow.names, columns, name)
                rows, total = 0, max(pf.metadata.num_rows, 1)
                for batch in pf.iter_batches(batch_size=chunk_rows, columns=read):
                    cols = [batch.column(p).to_numpy(zero_copy_only=False) for p in picked]
                    cols[:2] = map(_nan_as_missing, cols[:2])
                    seq = files.seq(k, rows + 1, batch.num_rows)
                    rows += batch.num_rows
                    size = files.start[k + 1] - files.start[k]
                    yield Chunk(*cols, seq, files.start[k] + size * rows // total)
        except pa.ArrowException as exc:
            raise IngestError(f"{name}: cannot read it as Parquet ({exc})") from None
    files.check_unchanged()


def _parquet_columns(
    labels: list[str], columns: Sequence[Column] | None, name: str
) -> tuple[list[int], list[str] | None]:
    """(positions of the user, item and rating columns in each batch, the columns to read:
    None for all). A file whose column names repeat is read whole and its columns taken by
    position (pyarrow would read every column of a repeated name)."""
    chosen = columns or default_columns(labels, name)
    repeated = next((c for c in chosen if isinstance(c, str) and labels.count(c) > 1), None)
    if repeated is not None:
        raise IngestError(
            f"{name}: column {repeated!r} appears {labels.count(repeated)} times; give the "
            "columns by 0-based position (--columns 0,1,2)"
        )
    picked = positions(chosen, labels, len(labels), name)
    if len(set(labels)) < len(labels):
        return picked, None
    read = list(dict.fromkeys(labels[p] for p in picked))
    return [read.index(labels[p]) for p in picked], read


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


def show(value: Any, limit: int = 60) -> str:
    """A user's id or rating as it should appear in a message: cut to `limit` characters
    (a 1 MB id would make a 1 MB message)."""
    text = repr(value.item() if isinstance(value, np.generic) else value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
