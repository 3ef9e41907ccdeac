"""`shardserve build --embedder MODEL --text-column C`: a sharded index of a text corpus.

1. check: the driver reads the corpus once (shardserve.data.text.open_corpus): every text, id and
   metadata value is checked and the first bad row stops the build, named, before a model is loaded
   or a file written; the rows are cut into pieces of PIECE_ROWS.
2. embed: Ray Data over the pieces, `map_batches` on a pool of actors (`EmbedPieces`, one per CPU
   Ray has, `num_cpus=1` each; at least one: fewer while other work holds CPUs): each actor loads the
   model once (ONNX Runtime, one intra-op thread),
   then reads its pieces itself and embeds them. Block order is preserved, so the driver receives
   the vectors in corpus order and writes them as they come to parquet files under
   `<out>/embedded/<build id>/` (`id` int64: the id column or the row number; `embedding`
   fixed_size_list<float32>[dim]; the metadata columns), a row group of ROW_GROUP_BYTES at a time.
   `--backend local` runs the same actor code in this process, one piece after another.
3. build: those files are an ordinary parquet dataset, built by the streaming build
   (index_build.streaming: train once, add per shard) under the cosine metric, the manifest
   recording the model (`embedder`, which the index version covers) and, as its dataset, the
   embedded files: `shardserve eval --dataset <manifest dataset.name>` and the swap gate read them
   like any parquet data.

No process holds the corpus's vectors: an actor holds a piece's, the driver one row group's, a
shard task its own shard's. A text's vector does not depend on the texts it is embedded with
(shardserve.embed.model), so any piece size, actor count or backend gives the same bytes.

The embedded files stay beside the versions (not inside one): a version compacted from this build
(index_build.compact) grades its recall gate against them too, after the build's own version
directory may have been pruned. `index_build.compact.prune_versions` deletes them once no version
on disk refers to them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from index_build.publish import BuildParams, new_version_id
from shardserve.data.text import PieceReader, TextCorpus, TextPiece, open_corpus
from shardserve.embed.model import Embedder
from shardserve.embed.model_files import KNOWN_MODELS
from shardserve.errors import ShardserveError
from shardserve.index.indexes import make_empty_index
from shardserve.index.manifest import EMBEDDED_DIR, VERSIONS_DIR, Manifest, ModelIdentity
from shardserve.index.storage import Location

log = logging.getLogger(__name__)

VECTOR_COLUMN = "embedding"
ID_COLUMN = "id"
ROW_GROUP_BYTES = 32 * 2**20  # vectors per row group of the embedded files: 21,845 rows at 384 dims
FILE_ROW_GROUPS = 16  # row groups per embedded file
# What each embedded row also carries to the driver (never written): its corpus row (the order is
# checked), its tokens and truncation, and the actor's process id and CPU clock.
ROW, TOKENS, TRUNCATED, PID, CPU_S, INIT_CPU_S, READY_CPU_S = (
    "__row", "__tokens", "__truncated", "__pid", "__cpu_s", "__init_cpu_s", "__ready_cpu_s")


def build_text_index(spec: str, *, text_column: str | None, model: str, params: BuildParams,
                     location: Location, backend: str, id_column: str | None,
                     metadata_columns: list[str] | None, limit: int | None,
                     factory_for: Callable[[int, int], tuple[str, str | None]],
                     discard_writes: bool = False) -> Manifest:
    """Embed the corpus at `spec` with `model`, then build and publish its index at `location`
    (arguments as `index_build.job.build_index` documents them; `params.metric` is cosine)."""
    from index_build.streaming import build_streaming

    started = time.perf_counter()
    corpus = open_corpus(spec, text_column, id_column, metadata_columns, limit)
    for name in corpus.metadata_columns:
        if name in (ID_COLUMN, VECTOR_COLUMN) or name.startswith("__"):
            raise ShardserveError(f"metadata column {name!r}: the embedded files have columns "
                                  f"{ID_COLUMN!r} and {VECTOR_COLUMN!r} of their own; rename it")
    if corpus.rows < params.shards:
        raise ShardserveError(f"{params.shards} shards need at least {params.shards} texts, "
                              f"got {corpus.rows}")
    embedder = Embedder(model, intra_op_threads=1)  # an unusable model fails here, in one line
    if params.factory != "auto":
        make_empty_index(params.factory, embedder.dim, params.metric)  # a bad factory, before any work
    version_id = new_version_id()
    # The version's directory exists from now on: index_build.compact.prune_versions leaves a build in
    # progress alone, and with it these embedded files.
    version = location.child(f"{VERSIONS_DIR}/{version_id}")
    embedded = location.child(f"{EMBEDDED_DIR}/{version_id}")
    try:
        version.fs.create_dir(version.root, recursive=True)
        embedded.fs.create_dir(embedded.root, recursive=True)
        if backend == "ray":
            from shardserve.runtime.ray_session import ensure_ray

            ensure_ray(serving_node=False)
        stats = write_embedded(corpus, model, embedder, backend, embedded)
        identity = embedder.identity
        del embedder  # the model's memory, free for the index build
        log.info("embedded %d texts in %.1f s with %d %s (%d truncated at the model's %d-token limit): %s",
                 corpus.rows, stats["wall_s"], stats["actors"], "actors" if backend == "ray" else "process",
                 stats["truncated"], identity.max_tokens, embedded.uri)
        where = embedded.root if isinstance(embedded.fs, pafs.LocalFileSystem) else embedded.uri
        text = {"dataset": spec, "format": corpus.kind, "text_column": corpus.text_column,
                "id_column": corpus.id_column, "rows": corpus.rows, "embed": stats}
        return build_streaming(where, params=params, location=location, backend=backend,
                               vector_column=VECTOR_COLUMN, id_column=ID_COLUMN,
                               metadata_columns=list(corpus.metadata_columns), limit=None,
                               factory_for=factory_for, discard_writes=discard_writes,
                               embedder=identity, name=where, text_column=corpus.text_column,
                               extra={"text": text}, version_id=version_id, started=started)
    except BaseException:
        for folder in (embedded, version):  # this build's own: the published version is untouched
            folder.delete_dir()
        for parent in (EMBEDDED_DIR, VERSIONS_DIR):
            location.child(parent).delete_dir(only_if_empty=True)
        raise


def write_embedded(corpus: TextCorpus, model: str, embedder: Embedder, backend: str,
                   at: Location) -> dict[str, Any]:
    """Embed every piece of `corpus` and write the vectors to parquet files at `at`, in corpus order;
    what it cost (the `embed` of the build's params)."""
    started = time.perf_counter()
    writer = EmbeddedWriter(at, embedder.dim)
    totals = EmbedTotals()
    for table in embedded_tables(corpus, model, embedder, backend):
        totals.add(table, expected_row=totals.rows)
        writer.add(table.drop_columns([c for c in table.column_names if c.startswith("__")]))
    writer.close()
    if totals.rows != corpus.rows:
        raise ShardserveError(f"the embedding stage returned {totals.rows} of {corpus.rows} rows")
    return {**totals.summary(), "wall_s": round(time.perf_counter() - started, 3),
            "files": writer.files, "row_groups": writer.row_groups}


def embedded_tables(corpus: TextCorpus, model: str, embedder: Embedder | None = None,
                    backend: str = "ray", actors: int | None = None) -> Iterator[pa.Table]:
    """The embedded pieces of `corpus`, in corpus order: Ray Data's actor pool (`backend="ray"`, on
    the Ray this process is connected to; `actors`: the CPUs Ray has) or this process (`embedder`,
    else one loaded here)."""
    embedder = embedder or Embedder(model, intra_op_threads=1)
    if model not in KNOWN_MODELS and Path(model).expanduser().is_dir():  # a folder, wherever actors run
        model = str(Path(model).expanduser().resolve())
    if backend == "local":
        local = EmbedPieces(corpus, model, embedder.identity, embedder=embedder)
        for piece in corpus.pieces:
            yield local.embed(piece)
        return
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1))
    pool = max(1, min(actors or cpus, len(corpus.pieces)))
    context = ray.data.DataContext.get_current()
    keep = context.execution_options.preserve_order
    context.execution_options.preserve_order = True  # the dataset keeps a copy of the context
    try:
        pieces = ray.data.from_items([{"piece": piece.to_json()} for piece in corpus.pieces],
                                     override_num_blocks=len(corpus.pieces))  # a block per piece
    finally:
        context.execution_options.preserve_order = keep
    # An actor per CPU Ray has, starting all of them at once; at least one, so a cluster whose CPUs
    # other work holds runs the stage on fewer rather than waits. One piece in flight per actor: a
    # piece is seconds of work, so the wait for the next costs nothing, and no actor queues pieces
    # while another has none (the default, 4, lets the first actor up take the first 4 pieces).
    embedded = pieces.map_batches(
        EmbedPieces, batch_size=1, batch_format="numpy", num_cpus=1,
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=pool, initial_size=pool,
                                           max_tasks_in_flight_per_actor=1),
        fn_constructor_kwargs={"corpus": dataclasses.replace(corpus, pieces=()), "model": model,
                               "identity": embedder.identity})
    yield from embedded.iter_batches(batch_size=None, batch_format="pyarrow")


class EmbedPieces:
    """Ray Data's callable class: loads the model once (one ONNX Runtime thread), then reads and
    embeds the pieces it is given. Refuses to run a model other than `identity` (another copy's
    bytes on some node)."""

    def __init__(self, corpus: TextCorpus, model: str, identity: ModelIdentity | None,
                 embedder: Embedder | None = None):
        self.init_cpu_s = time.process_time()
        self.embedder = embedder or Embedder(model, intra_op_threads=1)
        if identity is not None:
            self.embedder.check(identity)
        self.reader = PieceReader(corpus)
        self.ready_cpu_s = time.process_time()

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        return pa.concat_tables([self.embed(TextPiece.from_json(str(piece))) for piece in batch["piece"]])

    def embed(self, piece: TextPiece) -> pa.Table:
        rows = self.reader.read(piece)
        embedded = self.embedder.embed_batch(rows.texts)
        n, dim = embedded.vectors.shape
        truncated = np.zeros(n, bool)
        truncated[list(embedded.truncated)] = True
        columns: dict[str, Any] = {
            ID_COLUMN: pa.array(rows.ids, pa.int64()),
            VECTOR_COLUMN: pa.FixedSizeListArray.from_arrays(pa.array(embedded.vectors.reshape(-1)), dim)}
        if rows.metadata is not None:
            columns.update({name: rows.metadata.column(name) for name in rows.metadata.column_names})
        columns.update({
            ROW: pa.array(np.arange(piece.first_row, piece.first_row + n, dtype=np.int64)),
            TOKENS: pa.array(embedded.tokens.astype(np.int32)), TRUNCATED: pa.array(truncated),
            PID: pa.array(np.full(n, os.getpid(), np.int64)),
            CPU_S: pa.array(np.full(n, time.process_time())),
            INIT_CPU_S: pa.array(np.full(n, self.init_cpu_s)),
            READY_CPU_S: pa.array(np.full(n, self.ready_cpu_s))})
        return pa.table(columns)


class EmbedTotals:
    """What the embedded tables say, summed as they arrive: rows (in order), tokens, truncated texts,
    and each actor process's CPU clock at its last piece."""

    def __init__(self) -> None:
        self.rows = self.tokens = self.truncated = 0
        # pid -> its CPU clock at its last piece, at its __init__'s start and end
        self.cpu: dict[int, tuple[float, float, float]] = {}

    def add(self, table: pa.Table, expected_row: int) -> None:
        if not table.num_rows:
            return
        rows = table.column(ROW).to_numpy()
        if rows[0] != expected_row or (np.diff(rows) != 1).any():
            raise ShardserveError(f"the embedding stage returned row {int(rows[0])} where row {expected_row} "
                                  "was due: rows out of order")
        self.rows += table.num_rows
        self.tokens += int(pc.sum(table.column(TOKENS)).as_py())
        self.truncated += int(pc.sum(table.column(TRUNCATED).cast(pa.int64())).as_py())
        pid = int(table.column(PID)[0].as_py())
        cpu = float(table.column(CPU_S)[-1].as_py())
        init, ready = (float(table.column(c)[0].as_py()) for c in (INIT_CPU_S, READY_CPU_S))
        self.cpu[pid] = (max(cpu, self.cpu.get(pid, (0.0,))[0]), init, ready)

    def summary(self) -> dict[str, Any]:
        """Rows, tokens, truncated texts, actors, and the CPU seconds the actors' processes spent
        (their own clocks): `cpu_s` from the start of their __init__ (model load, reading and
        embedding), `load_cpu_s` of it in __init__, `process_cpu_s` since each process started (Ray's
        start-up of the worker too)."""
        return {"rows": self.rows, "tokens": self.tokens, "truncated": self.truncated,
                "actors": len(self.cpu),
                "cpu_s": round(sum(cpu - init for cpu, init, _ in self.cpu.values()), 3),
                "load_cpu_s": round(sum(ready - init for _, init, ready in self.cpu.values()), 3),
                "process_cpu_s": round(sum(cpu for cpu, _, _ in self.cpu.values()), 3)}


class EmbeddedWriter:
    """Parquet files `part-00000.parquet`, ... at `at`, filled in order: ROW_GROUP_BYTES of vectors a
    row group, FILE_ROW_GROUPS row groups a file; one row group of rows buffered at most."""

    def __init__(self, at: Location, dim: int):
        self.at = at
        self.group_rows = max(1, ROW_GROUP_BYTES // (4 * dim))
        self.buffered: list[pa.Table] = []
        self.pending = 0
        self.files = self.row_groups = 0
        self._writer: Any = None
        self._groups_in_file = 0

    def add(self, table: pa.Table) -> None:
        self.buffered.append(table)
        self.pending += table.num_rows
        if self.pending >= self.group_rows:
            self._flush(final=False)

    def close(self) -> None:
        self._flush(final=True)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _flush(self, final: bool) -> None:
        if not self.pending:
            return
        table = pa.concat_tables(self.buffered).combine_chunks()
        start = 0
        while table.num_rows - start >= self.group_rows or (final and start < table.num_rows):
            self._write_group(table.slice(start, self.group_rows))
            start += self.group_rows
        rest = table.slice(start)
        self.buffered, self.pending = ([rest], rest.num_rows) if rest.num_rows else ([], 0)

    def _write_group(self, group: pa.Table) -> None:
        import pyarrow.parquet as pq

        if self._writer is None or self._groups_in_file == FILE_ROW_GROUPS:
            if self._writer is not None:
                self._writer.close()
            path = self.at.path(f"part-{self.files:05d}.parquet")
            self._writer = pq.ParquetWriter(path, group.schema, filesystem=self.at.fs,
                                            compression={VECTOR_COLUMN: "none"} | {
                                                name: "snappy" for name in group.column_names
                                                if name != VECTOR_COLUMN})
            self.files += 1
            self._groups_in_file = 0
        self._writer.write_table(group, row_group_size=group.num_rows)
        self._groups_in_file += 1
        self.row_groups += 1
