"""The witness (tests/witness) shares no code with what it judges.

Every module the witness reaches is followed, transitively, from every file of
tests/witness and of its engine plugin (tests/support/witness_engine_plugin):
``import`` and ``from ... import`` (relative ones resolved), the module named
to ``importlib.import_module``, ``__import__`` and ``importlib.util.find_spec``,
and ``-m MODULE`` in a command line it builds. A module found in this
repository is read and followed in turn; reaching the plugin's package
(``vllm_mamba_align``, tools/sim included), ``benchmarks/`` or
``maintainers/`` fails, naming the chain. Modules from elsewhere (vLLM, the
standard library) end the walk. No vLLM needed: it reads source only.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
ENGINE_PLUGIN = TESTS / "support" / "witness_engine_plugin"
ROOTS = (TESTS, ENGINE_PLUGIN, REPO)
"""Where the witness's imports resolve: tests/ (its processes put it on
sys.path), its engine plugin's folder (installed as a package), the checkout."""
FORBIDDEN_MODULES = ("vllm_mamba_align", "benchmarks", "maintainers")
FORBIDDEN_FOLDERS = ("vllm_mamba_align", "benchmarks", "maintainers")
LOADERS = {"import_module", "__import__", "find_spec"}


def _module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def named_modules(path: Path, source: str, root: Path) -> Iterator[str]:
    """Every module ``source`` (the file ``path`` under ``root``) names."""
    package = _module_of(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                keep = len(parts) - (node.level - 1)
                base = ".".join(parts[: max(keep, 0)] + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else None
            name = func.id if isinstance(func, ast.Name) else name
            first = node.args[0] if node.args else None
            loaded = isinstance(first, ast.Constant) and isinstance(first.value, str)
            if name in LOADERS and loaded:
                assert isinstance(first, ast.Constant)
                yield str(first.value)
        elif isinstance(node, ast.List | ast.Tuple):
            for flag, value in itertools.pairwise(node.elts):
                if (
                    isinstance(flag, ast.Constant)
                    and flag.value == "-m"
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)
                ):
                    yield value.value


def resolve(module: str, roots: tuple[Path, ...]) -> tuple[Path, Path] | None:
    """The file of ``module`` in this repository, and its root (None: elsewhere)."""
    parts = module.split(".")
    for root in roots:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, root
    return None


def forbidden(module: str, path: Path | None, repo: Path) -> bool:
    if module.split(".")[0] in FORBIDDEN_MODULES:
        return True
    if path is None:
        return False
    inside = path.resolve().relative_to(repo.resolve()).parts
    return bool(inside) and inside[0] in FORBIDDEN_FOLDERS


def reached(
    starts: list[tuple[Path, Path]], roots: tuple[Path, ...], repo: Path
) -> list[list[str]]:
    """Every chain from a start file to a forbidden module ([] when none)."""
    found: list[list[str]] = []
    seen: set[Path] = set()
    todo = [(path, root, [str(path.relative_to(repo))]) for path, root in starts]
    while todo:
        path, root, chain = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in named_modules(path, path.read_text(), root):
            located = resolve(module, roots)
            where = None if located is None else located[0]
            if forbidden(module, where, repo):
                found.append([*chain, module])
            elif located is not None:
                todo.append((*located, [*chain, module]))
    return found


def witness_files() -> list[tuple[Path, Path]]:
    files = [(path, TESTS) for path in sorted((TESTS / "witness").glob("*.py"))]
    plugin = ENGINE_PLUGIN / "vllm_test_witness_engine"
    return files + [(path, ENGINE_PLUGIN) for path in sorted(plugin.glob("*.py"))]


def test_the_witness_reaches_nothing_of_what_it_judges() -> None:
    starts = witness_files()
    assert len(starts) >= 8, starts  # the judge, its workloads, engine and plugin
    assert reached(starts, ROOTS, REPO) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> list[tuple[Path, Path]]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return [(tmp_path / name, tmp_path) for name in files if name.startswith("w/")]


@pytest.mark.parametrize(
    ("files", "chain_end"),
    [
        ({"w/a.py": "import vllm_mamba_align.split\n"}, "vllm_mamba_align.split"),
        (  # through a helper of the tests: tests/helpers.py's case
            {
                "w/a.py": "from helpers import x\n",
                "helpers.py": "from vllm_mamba_align.policy import x\n",
            },
            "vllm_mamba_align.policy",
        ),
        (  # a relative import inside the witness's own package
            {
                "w/__init__.py": "",
                "w/a.py": "from . import b\n",
                "w/b.py": "from .c import y\n",
                "w/c.py": "import importlib\n"
                "importlib.import_module('benchmarks.bench')\n",
            },
            "benchmarks.bench",
        ),
        (
            {"w/a.py": "__import__('maintainers.onboard')\n"},
            "maintainers.onboard",
        ),
        (  # a command line it runs
            {"w/a.py": "cmd = ['python', '-m', 'vllm_mamba_align.tools.sim']\n"},
            "vllm_mamba_align.tools.sim",
        ),
        (  # a module that resolves into a forbidden folder under another name
            {"w/a.py": "import tool\n", "benchmarks/tool.py": ""},
            None,
        ),
    ],
)
def test_the_walk_catches_each_way_in(
    tmp_path: Path, files: dict[str, str], chain_end: str | None
) -> None:
    """The checker's own adversaries: each import it must follow."""
    starts = _tree(tmp_path, files)
    roots = (tmp_path, tmp_path / "benchmarks")
    chains = reached(starts, roots, tmp_path)
    assert chains, files
    if chain_end is not None:
        assert chains[0][-1] == chain_end, chains


def test_the_walk_passes_what_is_not_the_plugin(tmp_path: Path) -> None:
    starts = _tree(
        tmp_path,
        {
            "w/a.py": "import json\nfrom vllm.v1 import core\nimport b\n"
            "s = 'vllm_mamba_align' in {}\n",
            "w/b.py": "import os\n",
            "b.py": "import random\n",
        },
    )
    assert reached(starts, (tmp_path,), tmp_path) == []
