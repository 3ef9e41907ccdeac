"""One variable names the node's cache: remote shards and exact ground truth both live under it."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardserve.data.groundtruth import cache_dir
from shardserve.index.storage import cache_root
from shardserve.settings import CACHE_ENV


def test_one_variable_moves_every_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert CACHE_ENV == "SHARDSERVE_CACHE_DIR"
    assert cache_root() == str(tmp_path) and cache_dir() == tmp_path / "groundtruth"


def test_the_default_follows_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == str(tmp_path / "shardserve")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == str(Path("~/.cache/shardserve").expanduser())


def test_the_tests_run_in_their_own_cache() -> None:
    """tests/conftest.py points the one variable at a temporary directory for the whole session."""
    assert not cache_root().startswith(str(Path("~/.cache").expanduser()))
