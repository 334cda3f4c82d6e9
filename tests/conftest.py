"""Fixtures and hooks: the plugin registered once per session, every scheduler
a test builds shut down at the end of that test, hypothesis profiles, and the
tests that need vLLM skipped where it is not installed. Helpers the tests
import are in ``helpers.py``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=150,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
settings.register_profile(
    "long",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _maintainers_from_the_checkout() -> None:
    """Make ``maintainers`` (the repository's maintainer code, which no wheel
    holds) importable from the checkout, for the tests of onboarding, the
    nightly scan, the interpreter matrix and the generated tables.

    Registered by its path, not by putting the checkout on ``sys.path``: there
    the checkout's ``vllm_mamba_align`` would shadow the installed wheel the
    suites judge (tests/unit/test_installed_package.py). Its own imports of
    the package resolve to the wheel too."""
    folder = os.path.join(os.path.dirname(TESTS_DIR), "maintainers")
    spec = importlib.util.spec_from_file_location(
        "maintainers",
        os.path.join(folder, "__init__.py"),
        submodule_search_locations=[folder],
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["maintainers"] = module
    spec.loader.exec_module(module)


_maintainers_from_the_checkout()
WITHOUT_VLLM = ("unit",)
"""Folders of tests that run without vLLM (``e2e`` decides for itself)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Without vLLM, skip every test that drives it (the fast tier still runs)."""
    if VLLM_INSTALLED:
        return
    skip = pytest.mark.skip(reason="needs vLLM installed (nox -s ci / tests)")
    for item in items:
        folder = os.path.relpath(str(item.path), TESTS_DIR).split(os.sep)[0]
        if folder not in (*WITHOUT_VLLM, "e2e"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def registered_plugin() -> None:
    import vllm_mamba_align

    vllm_mamba_align.register()


_WORKER_CALLS: list[int] = []
"""``schedule()`` calls counted by pytest-xdist's workers, as each goes down."""


def pytest_sessionfinish(session: Any) -> None:
    output = getattr(session.config, "workeroutput", None)
    if output is not None:  # an xdist worker: hand its count to the controller
        from vllm_mamba_align.tools.sim import Simulation

        output["schedule_calls"] = Simulation.schedule_calls


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    _WORKER_CALLS.append(getattr(node, "workeroutput", {}).get("schedule_calls", 0))


_built: weakref.WeakSet[Any] = weakref.WeakSet()
"""Schedulers built since the last test ended and still alive (tools.sim
reports each it builds)."""


@pytest.fixture(scope="session", autouse=True)
def _record_built_schedulers() -> Iterator[None]:
    from vllm_mamba_align.tools.sim import SCHEDULER_BUILT_HOOKS

    SCHEDULER_BUILT_HOOKS.append(_built.add)
    yield
    SCHEDULER_BUILT_HOOKS.remove(_built.add)


AUDIT_REPORTER = "vllm-mamba-align-audit"
"""The name of an audited scheduler's reporter thread (audit.py)."""


@pytest.fixture(autouse=True)
def schedulers_shut_down() -> Iterator[None]:
    """Every scheduler built during a test (its fixtures' included) is shut
    down when the test ends, as vLLM's engine core shuts its own down: an
    audit writes its final line and stops its reporter thread inside the test
    that built it. No reporter may outlive it (its cadence would log into a
    later test)."""
    yield
    for scheduler in list(_built):
        scheduler.shutdown()
    _built.clear()
    # A scheduler collected before the end has no one to shut it down; its
    # reporter notices within a tick and ends.
    for thread in threading.enumerate():
        if thread.name == AUDIT_REPORTER:
            thread.join(timeout=5)
    left = [t for t in threading.enumerate() if t.name == AUDIT_REPORTER]
    assert not left, f"{len(left)} audit reporter thread(s) outlived the test"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from vllm_mamba_align.tools.sim import Simulation

    calls = Simulation.schedule_calls + sum(_WORKER_CALLS)
    terminalreporter.write_line(f"real vLLM schedule() calls in this run: {calls}")
