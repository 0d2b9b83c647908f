"""The package's layering, the part import-linter cannot check: no private name crosses a package boundary.

import-linter (``lint-imports``, run by ``make lint``; contracts in pyproject.toml) checks which module imports which,
not which names: ``from lslm.bench.ddp import _spawn_helper`` inside ``lslm.metrics`` is a module import it sees, but
the leading underscore, a promise that only ``lslm.bench`` relies on that name, is invisible to it. This test walks
every module's syntax tree and fails on any ``from lslm.<pkg>... import _name`` written outside ``lslm.<pkg>``.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lslm"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top(module: str) -> str:
    """The top-level subpackage (or module) of ``lslm`` that ``module`` belongs to; ``""`` for ``lslm`` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` reads from (relative imports resolved against ``importer``)."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    # A module's level-1 import is its own package; a package's __init__ is that package already.
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_cross_package_imports() -> list[str]:
    """Every ``from lslm.a... import _name`` found in a module outside ``lslm.a``, as "file:line: text"."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _resolve(node, importer, path.name == "__init__.py")
            if source != "lslm" and not source.startswith("lslm."):
                continue
            if _top(source) == _top(importer):
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    where = path.relative_to(ROOT)
                    found.append(f"{where}:{node.lineno}: from {source} import {alias.name}")
    return found


def test_no_private_name_imported_across_packages() -> None:
    found = private_cross_package_imports()
    assert not found, "private names imported across lslm's packages (make them public, or move the code):\n" + (
        "\n".join(found))


def test_the_checker_sees_relative_and_absolute_imports() -> None:
    """The walker itself: a cross-package private import is caught in both spellings, a same-package one is not."""
    absolute = ast.parse("from lslm.bench.ddp import _spawn").body[0]
    relative = ast.parse("from ..bench.ddp import _spawn").body[0]
    inside = ast.parse("from .ddp import _spawn").body[0]
    assert isinstance(absolute, ast.ImportFrom) and isinstance(relative, ast.ImportFrom)
    assert isinstance(inside, ast.ImportFrom)
    assert _resolve(absolute, "lslm.metrics.step_time", False) == "lslm.bench.ddp"
    assert _resolve(relative, "lslm.metrics.step_time", False) == "lslm.bench.ddp"
    assert _resolve(inside, "lslm.bench.collectives", False) == "lslm.bench.ddp"
    assert _resolve(inside, "lslm.bench", True) == "lslm.bench.ddp"
    assert _top("lslm.bench.ddp") != _top("lslm.metrics.step_time")
    assert _is_private("_spawn") and not _is_private("__all__") and not _is_private("spawn")


def test_lint_imports_keeps_the_layer_contracts() -> None:
    """`lint-imports` (the contracts in pyproject.toml) passes; `make lint` runs the same command."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed: pip install -e '.[test]'")
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_architecture_doc_and_picture_name_every_layered_package() -> None:
    """docs/architecture.md lists every package of the layers contract, and shows the picture drawn from it."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    names = [n.strip().strip("()") for layer in layers for n in layer.replace(":", "|").split("|")]
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, f"docs/architecture.md does not name {missing}"
    assert "../images/architecture.png" in doc and (ROOT / "images" / "architecture.png").is_file()
