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


SPLIT_BINDING = {
    "FifthArgument",
    "SplitFunction",
    "bind_route",
    "call_vllm",
    "fifth_argument",
}
"""What the audit may take from the route module (split.py): the binding of
a route to a scheduler (the shortcut for decodes, vLLM's call), none of the
fix's stops."""


def test_the_audit_imports_nothing_from_the_fix() -> None:
    for path in sorted((PACKAGE / "audit").glob("*.py")):
        imported = imported_modules(path)
        from_route = {
            module.rsplit(".", 1)[1]
            for module in imported
            if module.startswith("vllm_mamba_align.split.")
        }
        assert from_route <= SPLIT_BINDING, name(path)
        if "vllm_mamba_align.split" in imported:  # by name, not the whole module
            assert from_route, name(path)
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


def package_module(dotted: str, root: Path = PACKAGE.parent) -> Path | None:
    """The file of module ``dotted`` under ``root``, or None if it names none."""
    relative = Path(*dotted.split("."))
    for candidate in (relative.with_suffix(".py"), relative / "__init__.py"):
        if (root / candidate).is_file():
            return root / candidate
    return None


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path, root: Path = PACKAGE.parent) -> set[str]:
    """The modules under ``root`` that ``path`` imports, read with ``ast``
    (nothing is imported): at the top, inside functions and under
    ``TYPE_CHECKING`` alike. ``from x import y`` is module ``x.y`` when that is
    one, else ``x``. A package's ``__init__`` counts only when imported itself
    (Python runs it before a submodule, but a loop through it is one a reader
    follows only if the code names the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    package = parts if parts[-1] == "__init__" else parts[:-1]
    package = package[:-1] if package and package[-1] == "__init__" else package
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:
                inner = f"{module}.{alias.name}"
                found.add(inner if package_module(inner, root) else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    own = module_name(path, root)
    return {m for m in found if m != own and package_module(m, root) is not None}


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of it that it imports."""
    root = package.parent
    return {
        module_name(path, root): {
            m for m in package_imports(path, root) if m.split(".")[0] == package.name
        }
        for path in sorted(package.rglob("*.py"))
    }


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import loop (each once, from its smallest name), as the modules
    around it."""
    found: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                loop = path[path.index(target) :]
                start = loop.index(min(loop))
                key = tuple(loop[start:] + loop[:start])
                if key not in seen:
                    seen.add(key)
                    found.append([*key, key[0]])
            elif target not in done:
                walk(target, [*path, target])
        done.add(module)

    for module in sorted(graph):
        walk(module, [module])
    return found


def test_the_package_imports_in_one_direction() -> None:
    """No module imports, even only for the type checker, one that imports it
    back: a reader follows the facts one way (releases.py's bodies read the
    backend's checkpoint facts in checkpoints.py, never the reverse)."""
    assert [" -> ".join(loop) for loop in loops(import_graph(PACKAGE))] == []


def test_the_maintainers_code_imports_in_one_direction() -> None:
    """The same for maintainers/: each part of onboarding imports the parts
    below it, and the package never imports maintainers/ (no wheel has it)."""
    maintainers = PACKAGE.parent / "maintainers"
    assert [" -> ".join(loop) for loop in loops(import_graph(maintainers))] == []
    importing = sorted(
        name(path)
        for path in PACKAGE.rglob("*.py")
        if any(m.split(".")[0] == "maintainers" for m in imported_modules(path))
    )
    assert importing == []


def test_the_loop_finder_sees_a_loop_closed_under_type_checking(
    tmp_path: Path,
) -> None:
    """The control: a package whose loop is closed only by a ``TYPE_CHECKING``
    import, and one without the loop."""
    package = tmp_path / "shop"
    package.mkdir()
    (package / "__init__.py").write_text("from .till import open_till\n")
    (package / "till.py").write_text(
        "from . import prices\nfrom .stock import Item\ndef open_till(): ...\n"
    )
    (package / "prices.py").write_text("PRICE = 1\n")
    (package / "stock.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from .till import open_till\n"
        "class Item: ...\n"
    )
    assert import_graph(package)["shop.till"] == {"shop.prices", "shop.stock"}
    assert loops(import_graph(package)) == [["shop.stock", "shop.till", "shop.stock"]]
    (package / "stock.py").write_text("class Item: ...\n")
    assert loops(import_graph(package)) == []
