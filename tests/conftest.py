"""Shared fixtures: the plugin registered once per session; stock vs patched helpers.

`stock_vllm` and `scheduler_mode` live in the package (simulation.py), so the
`simulate` command and the benchmarks compare modes with the same code as the
tests.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from hypothesis import HealthCheck, settings

from vllm_mamba_align.simulation import scheduler_mode, stock_vllm

settings.register_profile(
    "ci",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

__all__ = ["run_python", "scheduler_mode", "stock_vllm"]


@pytest.fixture(scope="session", autouse=True)
def registered_plugin() -> None:
    import vllm_mamba_align

    vllm_mamba_align.register()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from vllm_mamba_align.simulation import Simulation

    terminalreporter.write_line(
        f"real vLLM schedule() calls in this run: {Simulation.schedule_calls}"
    )


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def run_python(code: str, **env: str) -> Any:
    """Run ``code`` in a fresh interpreter of this environment (a new vLLM process).

    Returns the CompletedProcess; ``tests/`` is importable there. Variables set to
    "" are removed from the child's environment.
    """
    import subprocess
    import sys

    child_env = dict(os.environ)
    repo = os.path.dirname(TESTS_DIR)  # this checkout's package, not another copy
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (repo, TESTS_DIR, child_env.get("PYTHONPATH", "")) if p
    )
    for key, value in env.items():
        if value == "":
            child_env.pop(key, None)
        else:
            child_env[key] = value
    return subprocess.run(
        [sys.executable, "-c", code],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
