"""Client side of the HTTP API, used by `shardserve eval --url` and the tests."""

from __future__ import annotations

import numpy as np
import orjson

from core.errors import ShardserveError


def search_over_http(url: str, queries: np.ndarray, k: int, params: dict,
                     batch_size: int = 100, timeout_s: float = 60.0) -> np.ndarray:
    """Ids of the top-k of every query, sent as `vectors` batches; any non-200 is an error."""
    import httpx

    ids = np.full((len(queries), k), -1, dtype=np.int64)
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s) as client:
        for start in range(0, len(queries), batch_size):
            chunk = queries[start:start + batch_size]
            body: dict = {"vectors": chunk, "k": k}
            if params:
                body["params"] = params
            content = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
            response = client.post("/v1/search", content=content,
                                   headers={"content-type": "application/json"})
            if response.status_code != 200:
                raise ShardserveError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
            payload = orjson.loads(response.content)
            for row, hits in enumerate(payload["results"]):
                ids[start + row, :len(hits["ids"])] = hits["ids"]
    return ids
