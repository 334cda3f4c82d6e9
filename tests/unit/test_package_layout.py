"""The package stays readable: small functions on the serving path, modules
readable in one sitting, the audit apart from the fix.

The serving path is everything ``register()`` and a running scheduler import
(``tests/test_serving_path.py`` records that set on a real scheduler); the
tools, the probe, ``doctor`` and the CLI are not part of it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_mamba_align"
APART = ("tools", "probe", "doctor.py", "cli.py", "__main__.py")
SERVING_PATH = sorted(
    path
    for path in PACKAGE.rglob("*.py")
    if not path.relative_to(PACKAGE).parts[0].startswith(APART)
)
LONGEST_FUNCTION = 65
"""Lines, docstring included: about a screen and a half."""
LARGEST_MODULE = 800


def name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


@pytest.mark.parametrize("path", SERVING_PATH, ids=name)
def test_serving_path_functions_fit_a_screen_and_a_half(path: Path) -> None:
    tree = ast.parse(path.read_text())
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    ]
    assert long == []


@pytest.mark.parametrize("path", SERVING_PATH, ids=name)
def test_modules_are_readable_in_one_sitting(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= LARGEST_MODULE


def imported_modules(path: Path) -> set[str]:
    """The package modules ``path`` imports (relative imports resolved)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = [*base, *(node.module.split(".") if node.module else [])]
            found.add(".".join(module))
            found.update(".".join([*module, alias.name]) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_audit_imports_nothing_from_the_fix() -> None:
    for path in sorted((PACKAGE / "audit").glob("*.py")):
        imported = imported_modules(path)
        assert "vllm_mamba_align.split" not in imported, name(path)
        assert "vllm_mamba_align.policy" not in imported, name(path)


def test_the_import_reader_resolves_relative_imports() -> None:
    """The control: the check above would see an import of the fix."""
    assert "vllm_mamba_align.split" in imported_modules(PACKAGE / "activation.py")
    probe = PACKAGE / "audit" / "counting.py"
    assert "vllm_mamba_align.retention" in imported_modules(probe)
    assert "vllm_mamba_align.audit.counting" in imported_modules(
        PACKAGE / "audit" / "__init__.py"
    )


def test_every_package_is_in_the_wheel() -> None:
    """setuptools packs only the packages pyproject.toml lists."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(PACKAGE.parent).parts)
        for init in PACKAGE.rglob("__init__.py")
    }
    assert found <= listed
