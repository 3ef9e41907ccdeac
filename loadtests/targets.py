"""vegeta JSON targets from real query vectors: many distinct bodies, single or batch flavour.

python -m loadtests.targets --dataset fashion-mnist --url http://127.0.0.1:8000 --out t.jsonl
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path
from urllib.parse import urlencode

import numpy as np
import orjson

from shardserve.data.datasets import load_dataset
from shardserve.query.parse import NPY_CONTENT_TYPE, npy_body


def make_targets(queries: np.ndarray, url: str, k: int = 10, params: dict | None = None,
                 batch: int = 0, count: int = 1000, npy: bool = False) -> list[bytes]:
    """One vegeta JSON target per line; bodies cycle through the real queries (base64-encoded).
    `npy`: float32 .npy bodies with k and params in the query string, instead of JSON bodies."""
    lines = []
    endpoint = url.rstrip("/") + "/v1/search"
    for i in range(count):
        rows = np.arange(i * batch, (i + 1) * batch) % len(queries) if batch else i % len(queries)
        if npy:
            raw, kind = npy_body(queries[rows]), NPY_CONTENT_TYPE
            target = f"{endpoint}?{urlencode({'k': k, **(params or {})})}"
        else:
            body: dict = {"vectors" if batch else "vector": queries[rows], "k": k}
            if params:
                body["params"] = params
            raw, kind = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), "application/json"
            target = endpoint
        lines.append(orjson.dumps({"method": "POST", "url": target, "header": {"Content-Type": [kind]},
                                   "body": base64.b64encode(raw).decode()}))
    return lines


def write_targets(path: Path, lines: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--dataset", default="fashion-mnist")
    cli.add_argument("--url", default="http://127.0.0.1:8000")
    cli.add_argument("--k", type=int, default=10)
    cli.add_argument("--nprobe", type=int)
    cli.add_argument("--ef-search", type=int)
    cli.add_argument("--batch", type=int, default=0, help="vectors per request (0 = single `vector`)")
    cli.add_argument("--count", type=int, default=1000, help="distinct bodies")
    cli.add_argument("--npy", action="store_true", help=".npy bodies (k, params in the query string)")
    cli.add_argument("--out", required=True)
    args = cli.parse_args()
    params = {k: v for k, v in (("nprobe", args.nprobe), ("efSearch", args.ef_search)) if v}
    queries = load_dataset(args.dataset).queries
    path = write_targets(Path(args.out), make_targets(queries, args.url, args.k, params, args.batch,
                                                       args.count, args.npy))
    print(path)


if __name__ == "__main__":
    main()
