"""shardserve.settings: each accessor reads the environment when called (tests and the CLI set the
variables after import), falls back to its default, and is the only product module that names a
SHARDSERVE_ variable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from shardserve import settings

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ["shardserve", "index_build", "deployments", "serving"]


def test_fashion_mnist_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.FASHION_MNIST_ENV, raising=False)
    assert settings.fashion_mnist_dir() == Path("/usr/share/datasets/fashion-mnist")
    monkeypatch.setenv(settings.FASHION_MNIST_ENV, str(tmp_path))
    assert settings.fashion_mnist_dir() == tmp_path


def test_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_dir() == str(tmp_path / "xdg" / "shardserve")
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path))
    assert settings.cache_dir() == str(tmp_path)


def test_write_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (settings.WRITE_LOG_ENV, settings.PASSWORD_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    assert settings.write_log_url() is None and settings.write_log_password_file() is None
    monkeypatch.setenv(settings.WRITE_LOG_ENV, "redis://127.0.0.1:6379/0")
    monkeypatch.setenv(settings.PASSWORD_FILE_ENV, str(tmp_path / "password"))
    assert settings.write_log_url() == "redis://127.0.0.1:6379/0"
    assert settings.write_log_password_file() == tmp_path / "password"
    monkeypatch.setenv(settings.WRITE_LOG_ENV, "")  # empty: as unset
    assert settings.write_log_url() is None


def test_api_key_is_read_then_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.API_KEY_ENV, raising=False)
    assert settings.api_key() is None
    monkeypatch.setenv(settings.API_KEY_ENV, "k" * 32)
    assert settings.api_key() == "k" * 32
    settings.forget_api_key()
    assert settings.api_key() is None
    settings.forget_api_key()  # already gone: nothing to do


def test_serve_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.SERVE_MARK_ENV, raising=False)
    assert settings.serve_mark() is None
    settings.set_serve_mark("123-abc")  # monkeypatch restores the environment afterwards
    assert settings.serve_mark() == "123-abc"


def test_the_names_other_modules_export_are_the_settings() -> None:
    from shardserve.writes import redis_log

    assert settings.CACHE_ENV == "SHARDSERVE_CACHE_DIR"
    assert redis_log.WRITE_LOG_ENV == settings.WRITE_LOG_ENV == "SHARDSERVE_WRITE_LOG"
    assert redis_log.PASSWORD_FILE_ENV == settings.PASSWORD_FILE_ENV


def test_only_settings_names_a_variable() -> None:
    """No other product module holds a SHARDSERVE_ variable's name as a string of its own (messages
    and docstrings that mention one are fine): it reads the setting through shardserve.settings."""
    name = re.compile(r"SHARDSERVE_[A-Z0-9_]+")
    offenders = []
    for path in sorted(p for layer in PRODUCT for p in (ROOT / layer).rglob("*.py")):
        if path == ROOT / "shardserve" / "settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and name.fullmatch(node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
