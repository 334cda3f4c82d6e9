"""The wheel holds what users run, named by audience, and nothing else.

Every user installs the wheel into vLLM's environment; code only maintainers
run (drafting a release's table entry, the nightly-build scan, the interpreter
matrix, onboarding, the release matrix's records) lives in the repository's
``maintainers/`` and never ships. The allow-list below names every module the
wheel may hold, by who runs it: a module added to the package without a place
here fails, and so does a maintainer module placed in the package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SERVING = {
    "__init__",
    "activation",
    "checkpoints",
    "errors",
    "fingerprint",
    "geometry",
    "headless",
    "layers",
    "messages",
    "metrics",
    "plugin",
    "policy",
    "protocols",
    "recognition",
    "releases",
    "retention",
    "settings",
    "signature",
    "split",
    "subclasses",
    "topology",
    "version",
    "worker_seed",
    "audit.__init__",
    "audit.counting",
    "audit.ledger",
    "audit.reporter",
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
    "tools.__init__",
    "tools.modes",
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
