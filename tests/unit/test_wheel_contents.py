"""The wheel holds what users run, named by audience, and nothing else.

Every user installs the wheel into vLLM's environment; code only maintainers
run (drafting a release's table entry, the nightly-build scan, the interpreter
matrix, onboarding, the release matrix's records) lives in the repository's
``maintainers/`` and never ships. The allow-list below names every module the
wheel may hold, by who runs it: a module added to the package without a place
here fails, and so does a maintainer module placed in the package.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SERVING = {
    "__init__",
    "activation",
    "batch_invariance",
    "checkpoints",
    "defects",
    "errors",
    "fingerprint",
    "geometry",
    "hazard",
    "headless",
    "layers",
    "messages",
    "metrics",
    "plugin",
    "policy",
    "protocols",
    "recognition",
    "refusals",
    "releases",
    "retention",
    "seed_site",
    "settings",
    "split",
    "subclass_code",
    "subclasses",
    "unverified",
    "version",
    "worker_seed",
    "audit.__init__",
    "audit.counting",
    "audit.export",
    "audit.ledger",
    "audit.reporter",
    "audit.slots",
}
"""What vLLM loads: ``register()``, the fix, the audit, and what they read."""

OPERATOR = {
    "__main__",
    "cli",
    "doctor",
    "probe.__init__",
    "probe.client",
    "probe.judge",
    "probe.preflight",
    "probe.progress",
    "probe.report",
    "probe.run",
    "probe.server_metrics",
    "probe.workload",
    "topology",
    "tools.__init__",
    "tools.installed",
    "tools.modes",
    "tools.retention_report",
    "tools.simulate",
    "tools.sim.__init__",
    "tools.sim.driver",
    "tools.sim.engine",
    "tools.sim.oracle",
    "tools.sim.states",
    "tools.sim.worker",
}
"""What an operator runs: ``doctor``, ``probe``, ``simulate`` (and the CPU
simulation it drives)."""

MAINTAINER_ONLY = {"drafting", "nightlies", "interpreters", "onboard", "matrix"}
"""Names of maintainer code (``maintainers/``), wherever in the package they
would land."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel nox built for this run, else one built here from a copy of
    the package (setuptools reuses a checkout's build/, which can hold modules
    deleted since)."""
    built = os.environ.get("MAMBA_ALIGN_WHEEL")
    if built:
        return Path(built)
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "PACKAGE.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(
        REPO / "vllm_mamba_align",
        source / "vllm_mamba_align",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    out = tmp_path_factory.mktemp("dist")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out)]
    subprocess.run([*command, str(source)], check=True, capture_output=True)
    return next(out.glob("vllm_mamba_align-*.whl"))


def modules_in(wheel: Path) -> set[str]:
    """The wheel's Python modules, dotted, relative to ``vllm_mamba_align``
    (other top-level names kept whole, so a stray package shows)."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    found = set()
    for name in names:
        if not name.endswith(".py"):
            continue
        parts = name.removesuffix(".py").split("/")
        if parts[0] == "vllm_mamba_align":
            parts = parts[1:]
        found.add(".".join(parts))
    return found


def test_the_wheel_holds_exactly_the_allowed_modules(wheel: Path) -> None:
    modules = modules_in(wheel)
    assert modules - SERVING - OPERATOR == set(), (
        "modules in the wheel no audience claims: serving path and operator "
        "code go into SERVING or OPERATOR here; maintainer code into maintainers/"
    )
    assert modules >= SERVING | OPERATOR, "an allowed module is missing"


def test_no_maintainer_module_ships(wheel: Path) -> None:
    shipped = sorted(
        module
        for module in modules_in(wheel)
        if module.split(".")[-1] in MAINTAINER_ONLY
    )
    assert shipped == [], "maintainer-only code belongs in maintainers/"


def test_the_wheel_holds_one_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {
        "vllm_mamba_align"
    }


def test_the_allow_list_names_distinct_modules() -> None:
    """A module is for one audience; none is named in both lists."""
    assert set() == SERVING & OPERATOR
    assert {m.split(".")[-1] for m in SERVING | OPERATOR} & MAINTAINER_ONLY == set()


# -- names only tests and benchmarks use ---------------------------------------------

PACKAGE = "vllm_mamba_align"
TEST_SIDE = ("tests", "benchmarks")
"""Top-level folders whose code never runs for a user."""
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def repository_sources(root: Path = REPO) -> dict[str, str]:
    """Every .py file of the repository (environments and builds left out),
    by its path relative to ``root``, as text."""
    skipped = {".git", ".nox", "build", "dist", "site", ".venv"}
    sources = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if skipped & set(relative.parts[:-1]):
            continue
        sources[relative.as_posix()] = path.read_text(encoding="utf-8")
    return sources


def module_level_names(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (dunder names left out)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(
            node.target, ast.Name
        ):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("__")}


def referenced_names(tree: ast.Module) -> set[str]:
    """Every name a module refers to: names read, attributes, imported names
    and the identifiers inside string literals (``getattr(x, "name")``, entry
    points); docstrings and names being bound are not references."""
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.update(node.name.split("."))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            found.update(IDENTIFIER.findall(node.value))
    return found


def names_only_tests_use(sources: dict[str, str]) -> list[str]:
    """``module.name`` for every module-level name defined in the package that
    tests/ or benchmarks/ refer to and no other code does (the package, the
    maintainers' tools, the noxfile): code shipped to every user that only
    the tests and the benchmarks run."""
    trees = {path: ast.parse(source) for path, source in sources.items()}
    test_side: set[str] = set()
    elsewhere: set[str] = set()
    for path, tree in trees.items():
        used = referenced_names(tree)
        (test_side if path.split("/")[0] in TEST_SIDE else elsewhere).update(used)
    offenders = []
    for path, tree in trees.items():
        if path.split("/")[0] != PACKAGE:
            continue
        module = path.removesuffix(".py").replace("/", ".")
        for name in sorted(module_level_names(tree)):
            if name in test_side and name not in elsewhere:
                offenders.append(f"{module}.{name}")
    return offenders


def test_no_name_in_the_package_is_only_for_tests_or_benchmarks() -> None:
    """What ships runs for users: a name the package defines and only tests/
    or benchmarks/ refer to belongs with them (a helper in tests/helpers.py,
    a composition in benchmarks/), not in every user's wheel."""
    assert names_only_tests_use(repository_sources()) == []


def test_a_name_only_a_test_refers_to_is_found() -> None:
    """The check above, fed a small tree: a name the package defines that
    only a test or a benchmark reads (by name, by attribute or in a string)
    fails it; one the package itself also uses, or one only a maintainer's
    tool reads, passes."""
    package = textwrap.dedent(
        '''
        """A module."""
        SERVED = 1
        """Read below."""
        ONLY_TESTED = 2
        """Read by a test by name."""
        BY_ATTRIBUTE = 3
        BY_STRING = 4
        FOR_MAINTAINERS = 5


        def run() -> int:
            """Mentions ONLY_TESTED in prose, which is no use of it."""
            return SERVED
        '''
    )
    sources = {
        f"{PACKAGE}/module.py": package,
        "tests/test_module.py": textwrap.dedent(
            f"""
            from {PACKAGE} import module
            from {PACKAGE}.module import ONLY_TESTED, SERVED

            assert module.BY_ATTRIBUTE and getattr(module, "BY_STRING")
            assert ONLY_TESTED + SERVED
            """
        ),
        "benchmarks/measure.py": f"from {PACKAGE}.module import run\n",
        "maintainers/tool.py": f"from {PACKAGE}.module import FOR_MAINTAINERS\n",
    }
    assert names_only_tests_use(sources) == [
        f"{PACKAGE}.module.BY_ATTRIBUTE",
        f"{PACKAGE}.module.BY_STRING",
        f"{PACKAGE}.module.ONLY_TESTED",
        f"{PACKAGE}.module.run",
    ]
    sources["maintainers/tool.py"] += "print(module.ONLY_TESTED)\n"
    assert f"{PACKAGE}.module.ONLY_TESTED" not in names_only_tests_use(sources)
