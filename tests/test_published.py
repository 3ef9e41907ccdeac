"""An index enters a process once: `Published.open` parses its location and reads its manifests
(the directory's and the pinned version's), and everything below it (both Serve apps, the
compactor, the write log's address) takes that typed value instead of parsing and reading again."""

from __future__ import annotations

from pathlib import Path

import pytest

from index_build.job import build_index
from shardserve.index import manifest as manifest_module
from shardserve.index.manifest import Published, pinned_location
from shardserve.index.storage import Location


@pytest.fixture()
def counted(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    parses: list[str] = []
    reads: list[str] = []
    parse, read = Location.parse.__func__, manifest_module.read_manifest  # type: ignore[attr-defined]
    monkeypatch.setattr(Location, "parse",
                        classmethod(lambda cls, uri: parses.append(uri) or parse(cls, uri)))
    monkeypatch.setattr(manifest_module, "read_manifest", lambda location: reads.append(location.uri)
                        or read(location))
    return parses, reads


def test_an_index_is_parsed_and_read_once_on_its_way_to_both_apps(tmp_path: Path, counted) -> None:
    from deployments.app import router_app
    from deployments.config import AppArgs
    from deployments.index_version import index_app
    from serving.compactor import AutoCompactor

    index = tmp_path / "idx"
    build_index("synthetic:2000x16", 2, "IVF8,Flat", str(index), backend="local")
    build_index("synthetic:3000x16", 2, "IVF8,Flat", str(index), backend="local", force=True)
    parses, reads = counted
    parses.clear(), reads.clear()
    published = Published.open(str(index))
    # the directory's manifest names the version; the version's own manifest is what replicas read
    assert (len(parses), len(reads)) == (1, 2), (parses, reads)
    assert published.location.uri == str(index) and published.version.uri == pinned_location(str(index))
    assert published.version.uri.startswith(f"{index}/versions/") and published.manifest.num_vectors == 3000
    parses.clear(), reads.clear()
    args = AppArgs(index=published.version.uri).model_dump()
    index_app(args, None, published)
    router_app(args, published)
    AutoCompactor(published.location, "app")
    assert (parses, reads) == ([], [])


def test_without_the_opened_index_each_app_builder_opens_it_itself(tmp_path: Path, counted) -> None:
    """`serve run` of a config: Serve calls the builders with the arguments alone."""
    from deployments.app import build_app
    from deployments.index_version import build_index_app

    index = tmp_path / "idx"
    build_index("synthetic:2000x16", 2, "IVF8,Flat", str(index), backend="local")
    parses, reads = counted
    parses.clear(), reads.clear()
    build_app({"index": str(index)})
    build_index_app({"index": str(index)})
    assert len(parses) == 2 and len(reads) == 4  # per builder: the directory's and the version's manifest
