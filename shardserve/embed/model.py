"""Text to vectors with the model an index was built with: ONNX Runtime and Hugging Face `tokenizers`,
no PyTorch.

What a batch costs is its padding: every text of a model run is padded to the run's longest, so a
batch is sorted by token length and cut into runs of similar texts before the model sees it
(`plan_runs`), and the tokenizer's own fixed padding (tokenizer.json may pad every text to 128
tokens) is turned off. Padding changes no vector: the attention mask keeps pad tokens out of every
real token's attention and out of the mean, so a text's vector is the same alone or in any batch,
to float rounding at most (tests/test_embed.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Encoding, Tokenizer

from shardserve.embed.model_files import EmbedderError, ModelFiles, ModelIdentity, resolve_model
from shardserve.errors import BadArgument

_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True, kw_only=True)
class Embedded:
    """One `embed_batch` answer, aligned with its input texts."""

    vectors: np.ndarray  # float32 (n, dim), unit norm when the model normalises
    truncated: tuple[int, ...]  # positions of the texts cut at the model's token limit
    tokens: np.ndarray  # int64 (n,): tokens each vector was computed from, [CLS] and [SEP] included


class Embedder:
    """A model loaded once; `embed` turns texts into vectors. Safe to call from several threads (an
    ONNX Runtime session and a tokenizer both are).

    Arguments:
        model: a known model's name ("all-MiniLM-L6-v2"), a model folder, or resolved `ModelFiles`.
        max_batch: texts per model run at most (`plan_runs` says how a batch is cut into runs).
        max_batch_tokens: tokens per model run (its texts times the longest's tokens): long texts run
            in smaller batches, where a batch's attention outgrows the caches and a text costs more
            than alone.
        intra_op_threads: ONNX Runtime's threads inside one run (inter-op is always 1): one per replica
            lets replicas, not threads, share the cores.
        providers: ONNX Runtime's execution providers, in order of preference (a GPU's needs the
            onnxruntime-gpu package: untested here).
        around_run: a context entered around each model run (ONNX Runtime's, which releases the
            GIL), e.g. shardserve.runtime.procfs.idle_while: tokenizing and pooling stay outside it.
    """

    def __init__(self, model: str | Path | ModelFiles, *, max_batch: int = 16, max_batch_tokens: int = 1024,
                 intra_op_threads: int = 1, providers: Sequence[str] = ("CPUExecutionProvider",),
                 around_run: Callable[[], AbstractContextManager] = nullcontext):
        if min(max_batch, max_batch_tokens, intra_op_threads) < 1:
            raise BadArgument(f"max_batch, max_batch_tokens and intra_op_threads must be >= 1, got "
                              f"{max_batch}, {max_batch_tokens}, {intra_op_threads}")
        self.files = model if isinstance(model, ModelFiles) else resolve_model(model)
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        self._tokenizer = _tokenizer(self.files)
        self._session = _session(self.files.model, intra_op_threads, providers)
        self._around_run = around_run
        inputs = [node.name for node in self._session.get_inputs()]
        if not {"input_ids", "attention_mask"} <= set(inputs) <= set(_INPUTS):
            raise EmbedderError(f"{self.files.model}: inputs {inputs} are not a BERT-style encoder's "
                                f"(input_ids, attention_mask[, token_type_ids])")
        self._inputs = tuple(inputs)
        self._output = self._session.get_outputs()[0].name
        self.dim = self._dim()
        self.identity: ModelIdentity = self.files.identity(self.dim)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """float32 (len(texts), dim), in the order of `texts`."""
        return self.embed_batch(texts).vectors

    def embed_batch(self, texts: Sequence[str]) -> Embedded:
        """The vectors of `texts` and which of them were truncated (see `Embedded`)."""
        encodings = [self._tokenizer.encode(text) for text in texts]
        lengths = np.array([len(encoding.ids) for encoding in encodings], np.int64)
        vectors = np.empty((len(texts), self.dim), np.float32)
        for rows in plan_runs(lengths, max_batch=self.max_batch, max_batch_tokens=self.max_batch_tokens):
            vectors[rows] = self._run([encodings[row] for row in rows])
        truncated = tuple(i for i, encoding in enumerate(encodings) if encoding.overflowing)
        return Embedded(vectors=vectors, truncated=truncated, tokens=lengths)

    def check(self, expected: ModelIdentity) -> None:
        """Raise EmbedderError unless this is the model `expected` names (by content: the name and
        folder may differ)."""
        if expected.model_dump(exclude={"name"}) != self.identity.model_dump(exclude={"name"}):
            raise EmbedderError(
                f"the index was built with embedder {expected.name!r} (sha256 {expected.sha256[:12]}, dim "
                f"{expected.dim}, {expected.max_tokens} tokens); {str(self.files.model)!r} is "
                f"{self.identity.name!r} (sha256 {self.identity.sha256[:12]}, dim {self.identity.dim}, "
                f"{self.identity.max_tokens} tokens)")

    def _run(self, batch: list[Encoding]) -> np.ndarray:
        """One model run over texts padded to the longest of them: pooled (and normalised) vectors."""
        width = max(len(encoding.ids) for encoding in batch)
        ids = np.zeros((len(batch), width), np.int64)
        mask = np.zeros((len(batch), width), np.int64)
        for row, encoding in enumerate(batch):
            ids[row, :len(encoding.ids)] = encoding.ids
            mask[row, :len(encoding.ids)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        with self._around_run():
            hidden = self._session.run([self._output], {name: feeds[name] for name in self._inputs})[0]
        # sentence-transformers' mean pooling: the sum of the real tokens' vectors over their count
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        if self.files.pooling.normalize:  # torch.nn.functional.normalize's eps
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pooled.astype(np.float32, copy=False)

    def _dim(self) -> int:
        shape = self._session.get_outputs()[0].shape
        if len(shape) != 3:
            raise EmbedderError(f"{self.files.model}: output {self._output} has shape {shape}, not "
                                f"batch x tokens x dim (the last hidden state)")
        if isinstance(shape[2], int):
            return shape[2]
        return int(self._run([self._tokenizer.encode("dim")]).shape[1])  # a dynamic dim: ask the model


def plan_runs(lengths: np.ndarray, *, max_batch: int, max_batch_tokens: int) -> list[np.ndarray]:
    """The model runs for texts of `lengths` tokens: their positions, by ascending length (equal lengths
    in arrival order), cut into runs of at most `max_batch` texts and `max_batch_tokens` padded tokens
    with no text padded past twice its own tokens (a run's width is its last, longest text's).
    Batching saves a fraction of a text's cost; padding it to more than twice its length costs more
    than that, so a few texts of mixed lengths run apart."""
    order = np.argsort(lengths, kind="stable")
    runs, start = [], 0
    for end in range(1, len(order) + 1):
        if end == len(order) or end - start == max_batch or \
                (end + 1 - start) * lengths[order[end]] > max_batch_tokens or \
                lengths[order[end]] > 2 * lengths[order[start]]:
            runs.append(order[start:end])
            start = end
    return runs


def _tokenizer(files: ModelFiles) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(files.tokenizer))
    except Exception as exc:  # tokenizers raises its own Exception subclass for a malformed file
        raise EmbedderError(f"{files.tokenizer}: not a tokenizers file ({exc})") from None
    tokenizer.no_padding()  # each batch is padded to its own longest text, in Embedder._run
    tokenizer.enable_truncation(max_length=files.pooling.max_tokens)
    return tokenizer


def _session(path: Path, intra_op_threads: int, providers: Sequence[str]) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # warnings about the graph are the exporter's, not the user's
    # Idle intra-op threads would spin waiting for work, burning the CPU other replicas on the same
    # cores need.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own Exception subclasses for unreadable models
        raise EmbedderError(f"{path}: ONNX Runtime cannot load it ({str(exc).splitlines()[0]})") from None
