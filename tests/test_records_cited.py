"""Every record the code and the docs cite exists: a figure quoted from a record that is not
committed cannot be checked."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "loadtests" / "records"
CITING = ["shardserve", "index_build", "deployments", "serving", "loadtests", "lab", "docs", "notebooks"]
# `records/NAME.json` anywhere; a backticked `NAME.json` in the docs (they name records that way)
CITED = re.compile(r"records/((?:sample/)?[\w.-]+\.json)")
BACKTICKED = re.compile(r"`([\w-]+\.json)`")
# NAME: a placeholder; pooling.json and tokenizer.json: an embedding model's files
NOT_RECORDS = {"manifest.json", "openapi.json", "shardserve.json", "NAME.json", "pooling.json",
               "tokenizer.json"}


def _cited() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    paths = [p for top in CITING for p in (ROOT / top).rglob("*")
             if p.suffix in (".py", ".md", ".ipynb", ".sh") and "records" not in p.parts]
    for path in [*paths, ROOT / "README.md"]:
        text = path.read_text()
        names = set(CITED.findall(text))
        if path.suffix == ".md":
            names |= set(BACKTICKED.findall(text))
        for name in names - NOT_RECORDS:
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_cited_record_is_committed() -> None:
    cited = _cited()
    assert "bench.json" in cited and "admission.json" in cited  # the scan sees citations
    missing = {name: sorted(where) for name, where in cited.items() if not (RECORDS / name).exists()}
    assert missing == {}
