"""The packages form one-way layers, in the order data flows: shardserve -> index_build -> deployments ->
serving -> loadtests. A module may import its own layer or a lower one, never a higher one.

Read from the source with `ast` (nothing is imported), so the test also sees imports inside functions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["shardserve", "index_build", "deployments", "serving", "loadtests", "lab"]
PRIVATE_RAY = re.compile(r"ray\._private|serve\._private|serve\._run\b|_blocking=|_check_exists")
PRIVATE_RAY_MODULE = "shardserve/runtime/ray_private.py"  # the one module that may use Ray's private APIs


def _modules() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (ROOT / layer).rglob("*.py"))


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _upward_imports(path: Path) -> list[str]:
    own = LAYERS.index(path.relative_to(ROOT).parts[0])
    return sorted(name for name in _imported_packages(path)
                  if name.split(".")[0] in LAYERS and LAYERS.index(name.split(".")[0]) > own)


def test_no_module_imports_a_higher_layer() -> None:
    offenders = {str(p.relative_to(ROOT)): up for p in _modules() if (up := _upward_imports(p))}
    assert offenders == {}


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The test above would pass vacuously if the parser missed imports: show it sees one."""
    module = ROOT / "shardserve" / "_probe_layers.py"
    module.write_text("def f():\n    from serving.cli import main\n    return main\n")
    try:
        assert _upward_imports(module) == ["serving.cli"]
    finally:
        module.unlink()


def test_private_ray_apis_stay_in_one_module() -> None:
    others = [p for p in _modules() if str(p.relative_to(ROOT)) != PRIVATE_RAY_MODULE]
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in others
                 for n, line in enumerate(p.read_text().splitlines(), 1) if PRIVATE_RAY.search(line)]
    assert offenders == []


SHARED = [p for p in _modules() if p.relative_to(ROOT).parts[0] == "shardserve"]


@pytest.mark.parametrize("path", SHARED, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_shared_layer_does_not_import_ray_serve(path: Path) -> None:
    if str(path.relative_to(ROOT)) == PRIVATE_RAY_MODULE:
        return
    assert not [n for n in _imported_packages(path) if n.startswith("ray.serve")]


def test_router_is_serve_glue_only() -> None:
    """Parsing, rendering, fan-out and hedging live in shardserve.query; the ingress class keeps routing,
    admission and the pointer follow, and stays short."""
    tree = ast.parse((ROOT / "deployments" / "router.py").read_text())
    [router] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Router"]
    assert router.end_lineno - router.lineno + 1 <= 120


def test_production_config_has_no_test_switches() -> None:
    from deployments.config import AppArgs

    assert [name for name in AppArgs.model_fields if name.startswith("debug")] == []


def test_serve_app_builders_take_exactly_one_argument() -> None:
    """Serve refuses (at deploy time, in the controller) a builder with any other signature."""
    import inspect

    from deployments.app import build_app, build_index_app

    assert [len(inspect.signature(f).parameters) for f in (build_app, build_index_app)] == [1, 1]


# Inside `shardserve`, by concern, lowest first: a package may import those before it, never after.
INNER = ["shardserve.errors", "shardserve.runtime", "shardserve.transport", "shardserve.index",
         "shardserve.query", "shardserve.embed", "shardserve.writes"]


def test_inside_shardserve_no_package_imports_one_above_it() -> None:
    """The write path stands on the query path (it searches with it), never the other way round:
    write parsing lives in shardserve.writes, not in shardserve.query."""
    offenders = {}
    for number, package in enumerate(INNER):
        folder = ROOT / Path(*package.split("."))
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]:
            above = sorted(name for name in _imported_packages(path)
                           if any(name == up or name.startswith(up + ".") for up in INNER[number + 1:]))
            if above:
                offenders[str(path.relative_to(ROOT))] = above
    assert offenders == {}
