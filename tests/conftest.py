"""Shared fixtures: the plugin registered once per session, and a way back to stock.

Stock runs temporarily put vLLM's original functions back on the class (the
wrappers' ``__wrapped__``), so "stock" below is vLLM's own code, not our ``off``
mode.
"""

from __future__ import annotations

import contextlib
import os
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
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def registered_plugin() -> None:
    import vllm_mamba_align

    vllm_mamba_align.register()


def _patched_sites() -> list[tuple[Any, str]]:
    import vllm.v1.core.sched.scheduler as module

    from vllm_mamba_align.plugin import CHECKPOINT_DECISION, SPLIT_METHOD

    return [
        (module.Scheduler, "__init__"),
        (module.Scheduler, SPLIT_METHOD),
        (module, CHECKPOINT_DECISION),
    ]


@contextlib.contextmanager
def stock_vllm() -> Iterator[None]:
    """Run vLLM's unpatched scheduler code inside the block."""
    from vllm_mamba_align.plugin import is_patched

    saved = []
    for owner, name in _patched_sites():
        current = vars(owner).get(name)
        if is_patched(current):
            saved.append((owner, name, current))
            setattr(owner, name, current.__wrapped__)
    try:
        yield
    finally:
        for owner, name, current in saved:
            setattr(owner, name, current)


@contextlib.contextmanager
def scheduler_mode(mode: str) -> Iterator[None]:
    """Schedulers built and run inside use ``mode``: stock, off, grid or full."""
    if mode == "stock":
        with stock_vllm():
            yield
        return
    previous = os.environ.get("VLLM_MAMBA_ALIGN_MODE")
    os.environ["VLLM_MAMBA_ALIGN_MODE"] = mode
    try:
        yield
    finally:
        if previous is None:
            del os.environ["VLLM_MAMBA_ALIGN_MODE"]
        else:
            os.environ["VLLM_MAMBA_ALIGN_MODE"] = previous


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
