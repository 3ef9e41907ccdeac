"""`shardserve build --embedder`: a text corpus embedded on a real local Ray (Ray Data actor pool, the
real packaged model, real FAISS), on real text (Debian's fortunes): the same bytes from either
backend and every input format, the model's own vectors in the index, the model in the manifest,
bad rows refused in one line naming them, and the embedded vectors kept while a version uses them."""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deployments.swap import gate_recall
from index_build.compact import compact, prune_versions
from index_build.job import build_index
from serving.evaluate import evaluate
from shardserve.embed.model import Embedder
from shardserve.embed.text_data import TextDataMissing, real_texts
from shardserve.errors import ShardserveError
from shardserve.index.indexes import index_from_bytes, prepare_vectors, stored_points
from shardserve.index.manifest import Manifest, read_manifest, read_shard_checked
from shardserve.index.storage import Location
from shardserve.writes.accept import WriteFront
from shardserve.writes.log import log_path
from tests.conftest import run_cli

pytestmark = pytest.mark.slow

MODEL = "all-MiniLM-L6-v2"
ROWS = 400  # short fortunes: ~3 s of one core's embedding


@pytest.fixture(scope="module")
def texts() -> list[str]:
    try:
        return [text for text in real_texts(2000) if len(text) <= 200][:ROWS]
    except TextDataMissing as exc:
        pytest.skip(f"no real text on this machine: {exc}")


@pytest.fixture(scope="module")
def corpus(texts: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same texts as .txt, JSON lines (with ids and metadata beside) and two parquet files of
    several row groups."""
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "fortunes.txt").write_text("\n".join(texts) + "\n")
    with open(folder / "fortunes.jsonl", "w") as out:
        for row, text in enumerate(texts):
            out.write(json.dumps({"body": text, "doc": 10_000 + 7 * row, "chars": len(text),
                                  "topic": "short" if len(text) < 80 else "long"}) + "\n")
    (folder / "parquet").mkdir()
    half = len(texts) // 2
    for number, part in enumerate((texts[:half], texts[half:])):
        pq.write_table(pa.table({"body": part}), folder / "parquet" / f"part-{number}.parquet",
                       row_group_size=120)
    return {"txt": folder / "fortunes.txt", "jsonl": folder / "fortunes.jsonl", "parquet": folder / "parquet"}


@pytest.fixture(scope="module")
def expected(texts: list[str]) -> np.ndarray:
    """The texts' vectors embedded here, in this process."""
    return Embedder(MODEL).embed(texts)


@pytest.fixture(scope="module")
def ray_built(ray_cluster, corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("idx") / "fortunes"
    build_index(str(corpus["txt"]), 3, "Flat", str(out), backend="ray", embedder=MODEL)
    return out


def _manifest(index: Path) -> Manifest:
    return read_manifest(Location.parse(str(index)))


def _stored(index: Path) -> tuple[np.ndarray, np.ndarray]:
    """Every (id, vector) the index's shards store."""
    location, manifest = Location.parse(str(index)), _manifest(index)
    parts = [stored_points(index_from_bytes(read_shard_checked(location, shard)))
             for shard in manifest.shards]
    assert all(part is not None for part in parts)
    return (np.concatenate([p[0] for p in parts if p]), np.concatenate([p[1] for p in parts if p]))


def test_ray_and_local_backends_build_the_same_version(ray_built: Path, corpus: dict[str, Path],
                                                      tmp_path: Path) -> None:
    build_index(str(corpus["txt"]), 3, "Flat", str(tmp_path / "local"), backend="local", embedder=MODEL)
    local, ray_made = _manifest(tmp_path / "local"), _manifest(ray_built)
    assert local.index_version == ray_made.index_version
    for a, b in zip(local.shards, ray_made.shards, strict=True):
        assert (tmp_path / "local" / a.path).read_bytes() == (ray_built / b.path).read_bytes()
    assert ray_made.build.params["backend"] == "ray" and ray_made.build.params["text"]["embed"]["actors"] >= 1


def test_the_index_holds_the_models_own_vectors(ray_built: Path, expected: np.ndarray) -> None:
    manifest = _manifest(ray_built)
    # the embedded files hold the model's output bit for bit, in corpus order, row numbers as ids
    embedded = pq.read_table(manifest.dataset.name)
    assert embedded.column("id").to_pylist() == list(range(len(expected)))
    vectors = np.asarray(embedded.column("embedding").combine_chunks().flatten(), np.float32)
    assert np.array_equal(vectors.reshape(expected.shape), expected)
    # the shards store them as any cosine index stores a vector (faiss.normalize_L2, which moves
    # some unit-norm vectors by a float rounding), bit for bit
    ids, stored = _stored(ray_built)
    assert sorted(ids.tolist()) == list(range(len(expected)))
    assert np.array_equal(stored, prepare_vectors(expected, "cosine")[ids])
    assert np.abs(stored - expected[ids]).max() < 1e-6
    # and each text's own vector finds that text first
    index = faiss.IndexFlatIP(expected.shape[1])
    index.add(stored)
    _, found = index.search(prepare_vectors(expected, "cosine"), 1)
    assert np.array_equal(ids[found[:, 0]], np.arange(len(expected)))


def test_the_manifest_records_the_model(ray_built: Path, corpus: dict[str, Path]) -> None:
    manifest = _manifest(ray_built)
    assert manifest.embedder == Embedder(MODEL).identity
    assert manifest.metric == "cosine" and manifest.dim == manifest.embedder.dim == 384
    assert manifest.index_version == Manifest.content_version(
        manifest.shards, manifest.index_factory, manifest.metric, embedder=manifest.embedder)
    assert manifest.index_version != Manifest.content_version(
        manifest.shards, manifest.index_factory, manifest.metric)
    info = manifest.dataset
    assert info.text_column == "text" and info.vector_column == "embedding" and info.id_column == "id"
    version = Path(manifest.shards[0].path).parent.name
    assert Path(info.name) == ray_built / "embedded" / version  # beside the version, named like it
    text = manifest.build.params["text"]
    assert text["dataset"] == str(corpus["txt"]) and text["rows"] == ROWS and text["format"] == "text"
    # eval reads the embedded vectors the manifest names, as any parquet dataset
    result = evaluate(str(ray_built), info.name, k=10)
    assert result["recall"] == 1.0 and result["queries"] == ROWS


@pytest.mark.parametrize("kind, text_column", [("parquet", "body"), ("jsonl", "body")])
def test_every_format_of_the_same_texts_builds_the_same_version(ray_built: Path, corpus: dict[str, Path],
                                                                tmp_path: Path, kind: str,
                                                                text_column: str) -> None:
    build_index(str(corpus[kind]), 3, "Flat", str(tmp_path / kind), backend="local", embedder=MODEL,
                text_column=text_column)
    assert _manifest(tmp_path / kind).index_version == _manifest(ray_built).index_version


def _bad_parquet(folder: Path, texts: list[str]) -> str:
    values: list[str | None] = list(texts[:20])
    values[7] = None
    pq.write_table(pa.table({"body": pa.array(values, pa.string())}), folder / "nulls.parquet")
    return str(folder / "nulls.parquet")


def _bad_jsonl(folder: Path, texts: list[str]) -> str:
    rows = [{"body": text} for text in texts[:20]]
    rows[5]["body"] = "   "
    (folder / "blank.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(folder / "blank.jsonl")


def _bad_txt(folder: Path, texts: list[str]) -> str:
    (folder / "gap.txt").write_text("\n".join([*texts[:3], "", *texts[3:10]]) + "\n")
    return str(folder / "gap.txt")


@pytest.mark.parametrize("make, args, message", [
    ("parquet", ["--text-column", "title", "--embedder", MODEL], "no text column 'title'"),
    ("jsonl", ["--text-column", "title", "--embedder", MODEL], "row 0 ("),
    ("bad_parquet", ["--text-column", "body", "--embedder", MODEL], "row 7 ("),
    ("bad_jsonl", ["--text-column", "body", "--embedder", MODEL], "row 5 ("),
    ("bad_txt", ["--embedder", MODEL], "row 3 ("),
    ("txt", ["--text-column", "text"], "--text-column needs --embedder"),
    ("jsonl", ["--embedder", MODEL], "--embedder needs --text-column"),
    ("txt", ["--embedder", "no-such-model"], "neither a model folder nor a known model"),
    ("txt", ["--embedder", MODEL, "--metric", "l2"], "cosine"),
])
def test_bad_input_is_one_line_and_publishes_nothing(corpus: dict[str, Path], texts: list[str],
                                                     tmp_path: Path, make: str, args: list[str],
                                                     message: str) -> None:
    makers = {"bad_parquet": _bad_parquet, "bad_jsonl": _bad_jsonl, "bad_txt": _bad_txt}
    dataset = makers[make](tmp_path, texts) if make in makers else str(corpus[make])
    out = tmp_path / "idx"
    result = run_cli("build", "--dataset", dataset, "--shards", "2", "--index", "Flat", "--out", str(out),
                     "--backend", "local", *args)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("shardserve: error: ") and message in line, line
    if "row" in message:
        assert "is null" in line or "is empty" in line or "no text column" in line
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


def test_a_build_that_fails_after_embedding_leaves_nothing(corpus: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "idx"
    with pytest.raises(ShardserveError, match="needs at least 64 training vectors"):  # when training
        build_index(str(corpus["txt"]), 2, "IVF64,Flat", str(out), backend="local", embedder=MODEL, limit=50)
    assert sorted(p.name for p in out.iterdir()) == []


def test_embedded_vectors_stay_while_a_version_uses_them(corpus: dict[str, Path], tmp_path: Path) -> None:
    """JSON lines with the user's ids and metadata; a compacted version keeps the model and the
    embedded files (its gate grades against them); they go when no version is left that uses them."""
    out = tmp_path / "idx"
    built = build_index(str(corpus["jsonl"]), 2, "Flat", str(out), backend="local", embedder=MODEL,
                        text_column="body", id_column="doc", metadata_columns=["chars", "topic"], limit=200)
    assert built.dataset.metadata_kinds == {"chars": "int64", "topic": "string"}
    ids, _ = _stored(out)
    assert sorted(ids.tolist()) == [10_000 + 7 * row for row in range(200)]
    embedded = Path(built.dataset.name)
    front = WriteFront(log_path(str(out)))
    front.delete(orjson.dumps({"ids": [10_000, 10_007]}), built)
    compacted = compact(str(out))
    assert compacted.embedder == built.embedder and compacted.dataset == built.dataset
    assert compacted.index_version == Manifest.content_version(
        compacted.shards, compacted.index_factory, compacted.metric, compacted.metadata,
        embedder=compacted.embedder)
    prune_versions(str(out), {compacted.index_version})  # the build's own version goes ...
    assert embedded.is_dir()  # ... its vectors stay: the compacted version's gate reads them
    queries, held_out, truth = gate_recall(compacted, None, 50, Location.parse(str(out)))
    assert len(queries) == 50 and held_out.metric == "cosine"
    rebuilt = build_index(str(corpus["jsonl"]), 2, "Flat", str(out), backend="local", embedder=MODEL,
                          text_column="body", limit=100, force=True, discard_writes=True)
    prune_versions(str(out), {rebuilt.index_version})
    assert not embedded.exists() and Path(rebuilt.dataset.name).is_dir()
    assert sorted(p.name for p in (out / "embedded").iterdir()) == [Path(rebuilt.dataset.name).name]
