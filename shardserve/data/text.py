"""Text corpora for `shardserve build --embedder`: parquet, JSON lines and plain text files, read in
order, checked row by row, and cut into pieces that any process can read again on its own.

Formats, told apart by the files' suffixes (one file, a directory holding files of one format, a
glob, or a pyarrow URI of any of those):

- parquet (`.parquet`): the text column (strings), and optionally an integer id column and
  metadata columns (strings, numbers, booleans), as for a vector dataset;
- JSON lines (`.jsonl`, or `.json` holding one object per line): each non-blank line one JSON
  object; the text under the text column's key, the id and metadata under theirs (a metadata key a
  row lacks is null there; a column's type is what its values are over the whole file set: int,
  float, string or bool, ints mixed with floats read as floats);
- plain text (`.txt`, UTF-8): each line one text, in a column called `text` (no id, no metadata);
  a blank line is an empty text, an error like any other.

Rows are numbered from 0 in file order (files by name), across files: a row's number is its id
when no id column is named. `open_corpus` reads the whole corpus once (`TextCorpus` keeps no row of
it: only the pieces' places) and stops at the first row no model should embed, naming the row, its
file and line or row group: a text that is null, not a string, empty or only white space. A text's
length is not bounded here: the model reads at most its token limit of it.

A piece is PIECE_ROWS consecutive rows (a slice of one parquet row group, or the lines from a byte
offset of one file). `PieceReader.read(piece)` reads one again, in any process: the build's actors
read their own pieces.
"""

from __future__ import annotations

import array
import contextlib
import glob
import json
import posixpath
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, NamedTuple

import numpy as np

from shardserve.data.dataset import check_ids
from shardserve.data.paths import is_glob, is_uri
from shardserve.errors import ShardserveError

Kind = Literal["parquet", "jsonl", "text"]
SUFFIXES: dict[str, Kind] = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".txt": "text"}
TEXT_FILE_COLUMN = "text"  # the one column of a .txt dataset
PIECE_ROWS = 256  # rows a piece holds: a few seconds of one CPU's embedding
_CHUNK = 1 << 20  # bytes per read of a line file
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class TextPiece:
    """PIECE_ROWS rows (fewer at a file's end or at --limit), found again without reading the rest."""

    file: int  # the corpus's file number
    first_row: int  # corpus row of its first row
    rows: int
    group: int = 0  # parquet: the row group, and its rows before this piece
    skip: int = 0
    offset: int = 0  # line files: the byte offset of its first line, and that line's number (from 1)
    line: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TextPiece:
        return cls(**json.loads(text))


class TextRows(NamedTuple):
    """A piece's rows: its texts, their ids (the user's, else the row numbers) and their metadata
    columns (a pyarrow Table in the corpus's metadata schema, or None)."""

    texts: list[str]
    ids: np.ndarray
    metadata: Any


@dataclass(frozen=True)
class TextCorpus:
    """A checked corpus: where its rows are (`pieces`), not the rows themselves."""

    name: str
    spec: str
    kind: Kind
    files: tuple[str, ...]
    text_column: str
    id_column: str | None
    metadata_columns: tuple[str, ...]
    metadata_schema: Any  # pyarrow Schema of the metadata columns (empty without any)
    pieces: tuple[TextPiece, ...]
    rows: int


def open_corpus(spec: str, text_column: str | None, id_column: str | None = None,
                metadata_columns: list[str] | None = None, limit: int | None = None,
                piece_rows: int = PIECE_ROWS) -> TextCorpus:
    """Read and check the first `limit` rows (all with None) of the corpus at `spec`; raise a
    ShardserveError, in one line naming the row and column at fault, at the first problem."""
    import pyarrow as pa

    if limit is not None and limit < 1:
        raise ShardserveError(f"--limit must be >= 1, got {limit}")
    files, kind = corpus_files(spec)
    metadata = list(dict.fromkeys(metadata_columns or []))
    if kind == "text":
        if text_column not in (None, TEXT_FILE_COLUMN):
            raise ShardserveError(f"{spec}: a .txt dataset has one column, {TEXT_FILE_COLUMN!r} (a text a "
                                  f"line): --text-column {text_column!r} names none")
        if id_column or metadata:
            raise ShardserveError(f"{spec}: a .txt dataset has one column, {TEXT_FILE_COLUMN!r}: it has no "
                                  "id or metadata columns")
        text_column = TEXT_FILE_COLUMN
    if not text_column:
        raise ShardserveError(f"{spec}: name the column the texts are in with --text-column")
    for name in metadata:
        if name == id_column:
            raise ShardserveError(f"metadata column {name!r}: ids are returned as `ids` already")
    scan = _Scan(_dataset_name(spec), spec, kind, files, text_column, id_column, metadata, limit, piece_rows)
    schema = scan.parquet() if kind == "parquet" else scan.lines()
    if not scan.rows:
        raise ShardserveError(f"dataset {scan.name}: no rows")
    if id_column:
        check_ids(scan.name, np.frombuffer(scan.ids, np.int64), scan.rows)
    return TextCorpus(scan.name, spec, kind, tuple(files), text_column, id_column, tuple(metadata),
                      schema if schema is not None else pa.schema([]), tuple(scan.pieces), scan.rows)


def corpus_files(spec: str) -> tuple[list[str], Kind]:
    """The corpus's files in name order (paths, or URIs for a URI spec) and their one format."""
    if is_uri(spec):
        files = _uri_files(spec)
    else:
        if is_glob(spec):
            found = sorted(glob.glob(spec))
        elif Path(spec).is_dir():
            found = sorted(str(p) for p in Path(spec).iterdir() if p.suffix.lower() in SUFFIXES)
        elif Path(spec).is_file():
            found = [spec]
        else:
            raise ShardserveError(f"dataset not found: {spec}")
        files = [f for f in found if Path(f).is_file()]
    if not files:
        raise ShardserveError(f"no .parquet, .jsonl, .json or .txt files match {spec!r}")
    odd = [f for f in files if _suffix(f) not in SUFFIXES]
    if odd:
        raise ShardserveError(f"{odd[0]}: not a text dataset file (.parquet, .jsonl, .json or .txt)")
    kinds = {SUFFIXES[_suffix(f)] for f in files}
    if len(kinds) != 1:
        raise ShardserveError(f"{spec}: files of several formats ({', '.join(sorted(kinds))}): "
                              "a dataset is one format")
    return files, kinds.pop()


class PieceReader:
    """Reads a corpus's pieces again, in any process. Keeps the last parquet row group it read:
    consecutive pieces of one group read it once."""

    def __init__(self, corpus: TextCorpus):
        self.corpus = corpus
        self._group: tuple[tuple[int, int], Any] | None = None

    def read(self, piece: TextPiece) -> TextRows:
        if self.corpus.kind == "parquet":
            return self._parquet(piece)
        return self._lines(piece)

    def _parquet(self, piece: TextPiece) -> TextRows:
        c = self.corpus
        key = (piece.file, piece.group)
        if self._group is None or self._group[0] != key:
            path = c.files[piece.file]
            columns = list(dict.fromkeys([c.text_column, *([c.id_column] if c.id_column else []),
                                          *c.metadata_columns]))
            self._group = (key, _read_group(path, piece.group, columns))
        table = self._group[1].slice(piece.skip, piece.rows)
        texts = table.column(c.text_column).to_pylist()
        where = f"{c.files[piece.file]} row group {piece.group}"
        for i, text in enumerate(texts):
            _check_text(c.name, text, piece.first_row + i, where, c.text_column)
        ids = (table.column(c.id_column).to_numpy().astype(np.int64) if c.id_column
               else np.arange(piece.first_row, piece.first_row + piece.rows, dtype=np.int64))
        metadata = table.select(list(c.metadata_columns)).cast(c.metadata_schema) if c.metadata_columns \
            else None
        return TextRows(texts, ids, metadata)

    def _lines(self, piece: TextPiece) -> TextRows:
        import pyarrow as pa

        c = self.corpus
        texts, ids = [], []
        values: list[list] = [[] for _ in c.metadata_columns]
        rows = _line_rows(c, piece.file, piece.offset, piece.line, piece.first_row)
        for _, _, text, id_, meta in rows:
            texts.append(text)
            ids.append(id_)
            for column, value in zip(values, meta, strict=True):
                column.append(value)
            if len(texts) == piece.rows:
                break
        if len(texts) != piece.rows:
            raise ShardserveError(f"{c.files[piece.file]}: changed since the build read it (a piece of "
                                  f"{piece.rows} rows from line {piece.line} has {len(texts)})")
        metadata = None
        if c.metadata_columns:
            metadata = pa.table([pa.array(v, type=f.type) for v, f in zip(values, c.metadata_schema,
                                                                        strict=True)],
                                schema=c.metadata_schema)
        id_array = (np.array(ids, np.int64) if c.id_column
                    else np.arange(piece.first_row, piece.first_row + piece.rows, dtype=np.int64))
        return TextRows(texts, id_array, metadata)


# --- the pass that checks the corpus and places its pieces ------------------------------------------

class _Scan:
    def __init__(self, name: str, spec: str, kind: Kind, files: list[str], text_column: str,
                 id_column: str | None, metadata: list[str], limit: int | None, piece_rows: int):
        self.name, self.spec, self.kind, self.files = name, spec, kind, files
        self.text_column, self.id_column, self.metadata = text_column, id_column, metadata
        self.limit, self.piece_rows = limit, piece_rows
        self.rows = 0
        self.ids = array.array("q")
        self.pieces: list[TextPiece] = []

    def _place(self, file: int, start: tuple[int, int, int]) -> None:
        """The piece of a line file from `start` (first row, offset, line) to the rows read so far."""
        first_row, offset, line = start
        self.pieces.append(TextPiece(file, first_row, self.rows - first_row, offset=offset, line=line))

    def parquet(self) -> Any:
        """Check every file's schema and every text (and id) of the row groups up to --limit."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schemas = [_parquet_schema(path, self.text_column, self.id_column, self.metadata)
                   for path in self.files]
        meta_schema = pa.schema([schemas[0].field(name) for name in self.metadata])
        for path, schema in zip(self.files, schemas, strict=True):
            for name in self.metadata:
                if _kind(schema.field(name).type) != _kind(meta_schema.field(name).type):
                    raise ShardserveError(f"{path}: metadata column {name!r} is {schema.field(name).type}, "
                                          f"{self.files[0]} has {meta_schema.field(name).type}")
        columns = [self.text_column, *([self.id_column] if self.id_column else [])]
        for number, path in enumerate(self.files):
            try:
                meta = pq.ParquetFile(path).metadata
            except (pa.ArrowException, OSError) as exc:
                raise ShardserveError(f"{path}: cannot read parquet ({exc})") from None
            for group in range(meta.num_row_groups):
                if self.limit is not None and self.rows >= self.limit:
                    return meta_schema
                if not meta.row_group(group).num_rows:
                    continue
                table = _read_group(path, group, columns)
                if self.limit is not None:
                    table = table.slice(0, self.limit - self.rows)
                where = f"{path} row group {group}"
                for i, text in enumerate(table.column(self.text_column).to_pylist()):
                    _check_text(self.name, text, self.rows + i, where, self.text_column)
                if self.id_column:
                    values = table.column(self.id_column)
                    if values.null_count:
                        first = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
                        raise ShardserveError(f"dataset {self.name}: row {self.rows + first} ({where}): id "
                                              f"column {self.id_column!r} is null")
                    self.ids.frombytes(values.to_numpy().astype(np.int64).tobytes())
                for skip in range(0, table.num_rows, self.piece_rows):
                    rows = min(self.piece_rows, table.num_rows - skip)
                    self.pieces.append(TextPiece(number, self.rows + skip, rows, group=group, skip=skip))
                self.rows += table.num_rows
        return meta_schema

    def lines(self) -> Any:
        """Parse every line up to --limit: the texts, ids and metadata checked, the metadata's
        types found over all of them, the pieces placed by byte offset."""
        kinds: dict[str, dict[str, int]] = {name: {} for name in self.metadata}  # kind -> first row
        corpus = TextCorpus(self.name, self.spec, self.kind, tuple(self.files), self.text_column,
                            self.id_column, tuple(self.metadata), None, (), 0)
        for number in range(len(self.files)):
            if self.limit is not None and self.rows >= self.limit:
                break
            start: tuple[int, int, int] | None = None  # the open piece's first row, offset, line
            for offset, line, _, id_, meta in _line_rows(corpus, number, 0, 1, self.rows):
                if self.limit is not None and self.rows >= self.limit:
                    break
                if start is not None and self.rows - start[0] == self.piece_rows:
                    self._place(number, start)
                    start = None
                if start is None:
                    start = (self.rows, offset, line)
                if id_ is not None:
                    self.ids.append(id_)
                for name, value in zip(self.metadata, meta, strict=True):
                    if value is not None:
                        kinds[name].setdefault(_json_kind(value), self.rows)
                self.rows += 1
            if start is not None:
                self._place(number, start)
        return _json_schema(self.name, kinds)


def _line_rows(corpus: TextCorpus, file: int, offset: int, line: int,
               first_row: int) -> Iterator[tuple[int, int, str, int | None, tuple]]:
    """(byte offset, line number, text, id, metadata values) of each row of a line file from
    `offset` (line number `line`, corpus row `first_row`) on, each checked."""
    path, row = corpus.files[file], first_row
    for at, number, raw in _lines(path, offset, line):
        where = f"{path} line {number}"
        if corpus.kind == "text":
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ShardserveError(f"dataset {corpus.name}: row {row} ({where}): not UTF-8 ({exc.reason} "
                                      f"at byte {exc.start})") from None
            _check_text(corpus.name, text, row, where, corpus.text_column)
            yield at, number, text, None, ()
            row += 1
            continue
        if not raw.strip():
            continue  # a blank line between JSON objects holds no row
        try:
            record = json.loads(raw)
        except ValueError as exc:
            raise ShardserveError(f"dataset {corpus.name}: row {row} ({where}): not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise ShardserveError(f"dataset {corpus.name}: row {row} ({where}): a {type(record).__name__}, "
                                  "not a JSON object (a JSON lines dataset holds one object a line)")
        if corpus.text_column not in record:
            raise ShardserveError(f"dataset {corpus.name}: row {row} ({where}): no text column "
                                  f"{corpus.text_column!r} (keys: {sorted(record)[:20]})")
        text = record[corpus.text_column]
        _check_text(corpus.name, text, row, where, corpus.text_column)
        id_ = None
        if corpus.id_column:
            id_ = record.get(corpus.id_column)
            if not isinstance(id_, int) or isinstance(id_, bool) or not -_INT64_MAX - 1 <= id_ <= _INT64_MAX:
                what = "missing" if corpus.id_column not in record else f"{id_!r}, not an int64"
                raise ShardserveError(f"dataset {corpus.name}: row {row} ({where}): id column "
                                      f"{corpus.id_column!r} is {what}")
        meta = tuple(record.get(name) for name in corpus.metadata_columns)
        for name, value in zip(corpus.metadata_columns, meta, strict=True):
            if value is not None and _json_kind(value) == "other":
                raise ShardserveError(f"dataset {corpus.name}: row {row} ({where}): metadata column {name!r} "
                                      f"holds a {type(value).__name__}: only strings, numbers and booleans "
                                      "are returned")
        yield at, number, text, id_, meta
        row += 1


def _lines(path: str, offset: int, line: int) -> Iterator[tuple[int, int, bytes]]:
    """(byte offset, line number, bytes without the line end) of each line from `offset` on."""
    with _open_binary(path) as stream:
        stream.seek(offset)
        head: list[bytes] = []  # the start of a line not ended yet
        while chunk := stream.read(_CHUNK):
            parts = chunk.split(b"\n")
            if len(parts) == 1:
                head.append(chunk)
                continue
            parts[0] = b"".join([*head, parts[0]])
            head = [parts.pop()]
            for part in parts:
                yield offset, line, part.removesuffix(b"\r")
                offset, line = offset + len(part) + 1, line + 1
        last = b"".join(head)
        if last:  # a last line with no line end
            yield offset, line, last.removesuffix(b"\r")


def _open_binary(path: str) -> contextlib.AbstractContextManager[BinaryIO]:
    if not is_uri(path):
        try:
            return open(path, "rb")  # noqa: SIM115  # returned to a `with`
        except OSError as exc:
            raise ShardserveError(f"cannot read {path}: {exc}") from None
    import pyarrow as pa
    import pyarrow.fs as pafs

    try:
        fs, inner = pafs.FileSystem.from_uri(path)
        return fs.open_input_file(inner)  # type: ignore[return-value]  # a file-like NativeFile
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ShardserveError(f"cannot read {path}: {exc}") from None


def _check_text(name: str, text: object, row: int, where: str, column: str) -> None:
    if isinstance(text, str) and text.strip() and (text.isascii() or encodable(text)):
        return
    if text is None:
        problem = "is null"
    elif not isinstance(text, str):
        problem = f"is a {type(text).__name__}, not a string"
    elif text.strip():
        problem = "is not valid Unicode (a lone surrogate, as a JSON escape may write one)"
    else:
        problem = "is empty (or only white space): there is nothing to embed"
    raise ShardserveError(f"dataset {name}: row {row} ({where}): text column {column!r} {problem}")


def encodable(text: str) -> bool:
    """UTF-8 can hold it: a lone surrogate (which a JSON escape may write, and Python's json reads)
    cannot, and the tokenizer refuses one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_kind(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if -_INT64_MAX - 1 <= value <= _INT64_MAX else "other"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    return "other"


def _json_schema(name: str, kinds: dict[str, dict[str, int]]) -> Any:
    """Each metadata column's type from the kinds of its values (and the first row of each)."""
    import pyarrow as pa

    fields = []
    for column, seen in kinds.items():
        found = set(seen)
        if not found:
            raise ShardserveError(f"dataset {name}: no row has metadata column {column!r}")
        if found <= {"int", "float"}:
            kind = pa.int64() if found == {"int"} else pa.float64()
        elif len(found) == 1:
            kind = pa.string() if found == {"string"} else pa.bool_()
        else:
            (a, row_a), (b, row_b) = sorted(seen.items(), key=lambda item: item[1])[:2]
            raise ShardserveError(f"dataset {name}: metadata column {column!r} holds a {a} (row {row_a}) "
                                  f"and a {b} (row {row_b}): one type a column")
        fields.append(pa.field(column, kind))
    return pa.schema(fields)


def _parquet_schema(path: str, text_column: str, id_column: str | None, metadata: list[str]) -> Any:
    """The file's schema, refused unless it has the columns, of types a text build reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise ShardserveError(f"{path}: cannot read parquet ({exc})") from None
    for name, what in [(text_column, "text column"), *([(id_column, "id column")] if id_column else []),
                       *[(m, "metadata column") for m in metadata]]:
        if name not in schema.names:
            raise ShardserveError(f"{path}: no {what} {name!r} (columns: {schema.names})")
    kind = schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ShardserveError(f"{path}: text column {text_column!r} is {kind}, expected strings")
    if id_column and not pa.types.is_integer(schema.field(id_column).type):
        raise ShardserveError(f"{path}: id column {id_column!r} is {schema.field(id_column).type}, "
                              "expected integers")
    for name in metadata:
        if _kind(schema.field(name).type) is None:
            raise ShardserveError(f"{path}: metadata column {name!r} is {schema.field(name).type}: only "
                                  "strings, numbers and booleans are returned")
    return schema


def _kind(kind: Any) -> str | None:
    import pyarrow as pa

    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "string"
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return str(kind)
    if pa.types.is_boolean(kind):
        return "bool"
    return None


def _read_group(path: str, group: int, columns: list[str]) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).read_row_group(group, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise ShardserveError(f"{path}: cannot read parquet ({exc})") from None


def _suffix(path: str) -> str:
    return posixpath.splitext(path.partition("?")[0])[1].lower()


def _dataset_name(spec: str) -> str:
    """A glob's or a directory's directory name, a file's stem."""
    trimmed = spec.partition("?")[0].rstrip("/")
    head, _, last = trimmed.rpartition("/")
    if is_glob(last) and head:
        trimmed = head
    path = Path(trimmed)
    return (path.stem if path.suffix.lower() in SUFFIXES else path.name) or "dataset"


def _uri_files(spec: str) -> list[str]:
    """A URI's files: the file itself, a directory's text dataset files, or a glob in its last part."""
    import fnmatch

    import pyarrow as pa
    import pyarrow.fs as pafs

    uri, _, query = spec.partition("?")
    scheme, (head, tail) = uri.split("://", 1)[0], uri.rstrip("/").rsplit("/", 1)
    pattern = tail if is_glob(tail) else None
    suffix = f"?{query}" if query else ""
    try:
        fs, path = pafs.FileSystem.from_uri(f"{head}{suffix}" if pattern else spec)
        kind = fs.get_file_info(path).type
        if pattern is None and kind == pafs.FileType.File:
            paths = [path]
        elif kind == pafs.FileType.Directory:
            paths = [info.path for info in fs.get_file_info(pafs.FileSelector(path))
                     if info.type == pafs.FileType.File and (
                         fnmatch.fnmatch(info.base_name, pattern) if pattern
                         else _suffix(info.base_name) in SUFFIXES)]
        else:
            raise ShardserveError(f"dataset not found: {spec}")
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ShardserveError(f"cannot list {spec!r}: {exc}") from None
    return sorted(f"{scheme}://{p}{suffix}" for p in paths)
