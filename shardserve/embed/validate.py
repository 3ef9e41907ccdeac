"""The checks a text must pass before it reaches a model: a 422 naming the field, never a 500.

Bounds by characters and by texts per request, so one request's embedding work is bounded before a
token is computed: the model reads at most its token limit of a text, but the tokenizer reads it all.
"""

from __future__ import annotations

from shardserve.data.text import encodable
from shardserve.query.api import ApiError

# A text's characters: well past what all-MiniLM-L6-v2 reads (256 tokens, ~1,000 characters of
# English), short enough that tokenizing it costs little next to the model run.
MAX_TEXT_CHARS = 2000
# Texts in one request: each costs a model run (milliseconds of CPU, the most at the token limit), so
# a request of more is better split by the client than queued behind.
MAX_TEXTS = 64
# Characters in one request's texts together: about 8,000 tokens of English, seconds of one
# replica's model time, well inside the embedder's timeout.
MAX_REQUEST_CHARS = 32_000


def check_text(value: object, *, field: str = "text", max_chars: int = MAX_TEXT_CHARS) -> str:
    """`value` when it is a string holding a non-space character, at most `max_chars` long; else
    ApiError(422, field, ...)."""
    return _text(value, field, field, max_chars)


def check_texts(value: object, *, field: str = "texts", max_texts: int = MAX_TEXTS,
                max_chars: int = MAX_TEXT_CHARS, max_total_chars: int = MAX_REQUEST_CHARS) -> list[str]:
    """`value` when it is a non-empty list of at most `max_texts` texts that each pass `check_text`
    and hold `max_total_chars` together; else ApiError(422, field, ...) whose message names the
    first text at fault by its position."""
    if not isinstance(value, list) or not value:
        raise ApiError(422, field, f"{field} must be a non-empty list of strings")
    if len(value) > max_texts:
        raise ApiError(422, field, f"too many texts: {len(value)} > max {max_texts}")
    texts = [_text(item, field, f"{field}[{i}]", max_chars) for i, item in enumerate(value)]
    if (total := sum(map(len, texts))) > max_total_chars:
        raise ApiError(422, field, f"the texts hold {total} characters together > max {max_total_chars}: "
                                   "send them in several requests")
    return texts


def _text(value: object, field: str, where: str, max_chars: int) -> str:
    if not isinstance(value, str):
        raise ApiError(422, field, f"{where} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ApiError(422, field, f"{where} is empty (or only white space): there is nothing to embed")
    if len(value) > max_chars:
        raise ApiError(422, field, f"{where} has {len(value)} characters > max {max_chars}")
    if not value.isascii() and not encodable(value):
        raise ApiError(422, field, f"{where} is not valid Unicode (a lone surrogate)")
    return value
