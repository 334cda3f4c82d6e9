"""Helpers the tests share: fresh interpreters, what the installed vLLM starts
with, stock vs patched. (Fixtures and hooks live in ``conftest.py``.)

`stock_vllm` and `scheduler_mode` live in the package's tools
(``vllm_mamba_align.tools.modes``), so the `simulate` command and the benchmarks
compare modes with the same code as the tests.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
from collections.abc import Iterator
from typing import Any

import pytest
from packaging.version import InvalidVersion, Version

from vllm_mamba_align.releases import SplitBody
from vllm_mamba_align.tools.modes import scheduler_mode, stock_vllm

__all__ = [
    "async_republishes_partial_tail",
    "built_or_skipped",
    "cache_block_for",
    "cache_block_rule",
    "geometry_rule",
    "installed_body",
    "plugins",
    "run_python",
    "scheduler_mode",
    "stock_vllm",
    "supports_retention_setting",
    "vllm_refuses",
]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# Releases before 0.28.0 need the test-only CPU platform plugin; VLLM_PLUGINS
# filters platform plugins too, so tests that set it must list that one as well.
PLATFORM_PLUGINS = os.environ.get("MAMBA_ALIGN_TEST_PLATFORM_PLUGINS", "")


def plugins(*names: str) -> str:
    """A VLLM_PLUGINS value naming these plugins plus the test platform plugin."""
    return ",".join(n for n in (*names, *PLATFORM_PLUGINS.split(",")) if n)


def run_python(code: str, **env: str) -> Any:
    """Run ``code`` in a fresh interpreter of this environment (a new vLLM process).

    Returns the CompletedProcess; ``tests/`` is importable there, and the
    package is the one this session imports (the installed wheel under nox).
    Variables set to "" are removed from the child's environment.
    """
    import subprocess
    import sys

    import vllm_mamba_align

    child_env = dict(os.environ)
    package = os.path.dirname(os.path.dirname(vllm_mamba_align.__file__))
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package, TESTS_DIR, child_env.get("PYTHONPATH", "")) if p
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


def vllm_refuses(error: BaseException) -> bool:
    """Whether an error raised while building a scheduler came from vLLM itself.

    Some releases refuse some geometries at startup (0.20.2-0.27.1 assert when
    C < B; see domain notes): such a geometry cannot occur with that release.
    """
    import traceback

    if not isinstance(error, (AssertionError, ValueError, NotImplementedError)):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"{os.sep}vllm{os.sep}" in frames[-1].filename


@contextlib.contextmanager
def built_or_skipped() -> Iterator[None]:
    """Skip the test when the installed vLLM refuses the geometry at startup."""
    try:
        yield
    except Exception as error:
        if vllm_refuses(error):
            pytest.skip(f"this vLLM refuses the geometry at startup: {error}")
        raise


class CacheBlockRule(enum.Enum):
    """Which cache blocks C < B a release's engine starts a hybrid model with."""

    ANY = "any"
    """Any C (sliding-window drafters, hidden-state and ring-buffer groups): after
    ``releases.CACHE_BLOCK_EQUALS``."""
    DIVISOR = "divisor"
    """C must divide B: ``releases.CACHE_BLOCK_DIVIDES``."""
    EQUAL = "equal"
    """C == B: ``releases.CACHE_BLOCK_EQUALS``."""


def cache_block_rule(version: str | None) -> CacheBlockRule:
    """The rule for a release; EQUAL (what every release starts) when unknown."""
    from vllm_mamba_align.releases import CACHE_BLOCK_DIVIDES, CACHE_BLOCK_EQUALS

    try:
        Version(version or "")
    except InvalidVersion:
        return CacheBlockRule.EQUAL
    assert version is not None
    if CACHE_BLOCK_DIVIDES.covers(version):
        return CacheBlockRule.DIVISOR
    after = CACHE_BLOCK_EQUALS.before
    if after is not None and Version(Version(version).base_version) >= Version(after):
        return CacheBlockRule.ANY
    return CacheBlockRule.EQUAL


def supports_retention_setting() -> bool:
    """Whether this vLLM has a state retention setting for Mamba states (0.24.0+:
    an environment variable until 0.28.0, the cache config from 0.29.0)."""
    from vllm_mamba_align.tools.installed import retention_in_kv_config
    from vllm_mamba_align.tools.retention_report import (
        retention_variable_reaches_mamba,
    )

    return retention_in_kv_config() or retention_variable_reaches_mamba()


def geometry_rule() -> str:
    """Which C < B geometries the installed vLLM starts with (:func:`cache_block_rule`).

    "any", "divisor" (C must divide B) or "equal" (C < B refused at startup),
    by the rows ``releases.CACHE_BLOCK_DIVIDES`` and ``CACHE_BLOCK_EQUALS``. Read
    from the version: nothing is built to find out.
    """
    from vllm_mamba_align.releases import installed_version

    return cache_block_rule(installed_version()).value


def cache_block_for(state_block: int, upstream: int = 816) -> int:
    """A cache block C < B the installed vLLM starts with next to ``state_block``:
    upstream's 816 where any C goes, B / 2 where C must divide B, else B."""
    rule = geometry_rule()
    if rule == "any":
        return upstream
    if rule == "divisor":
        return state_block // 2
    return state_block


@functools.cache
def installed_body() -> SplitBody:
    """The release-table entry of the installed split function."""
    import vllm.v1.core.sched.scheduler as module

    from vllm_mamba_align.recognition import recognize

    body = recognize(module.Scheduler).body
    assert body is not None, "the tests run on verified releases"
    return body


@functools.cache
def async_republishes_partial_tail() -> bool:
    """Whether stock vLLM's async scheduling publishes a prompt's partial-tail
    state a second time, on the block its first decode step then overwrites.

    vLLM's own defect, measured here rather than listed (seen on 0.26.0
    through 0.31.0, not on 0.18.1, 0.32.0 or 0.33.0): with a token in flight,
    the decode step caches the request up to ``request.num_tokens`` (the
    prompt, its sampled token not yet appended), which registers the prompt's
    partial-tail block again on the running slot after the previous step's
    copy-on-write moved it away. Needs a prompt ending on a hash block inside a
    state block, and async scheduling.
    """
    from vllm_mamba_align.tools.installed import supports_hash_block
    from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt

    if not supports_hash_block():
        return False  # no partial-tail checkpoint (before 0.26.0)
    geometry = Geometry(64, 64, hash_block=16, retention=None, async_scheduling=True)
    with scheduler_mode("stock"):
        sim = Simulation(geometry)
        sim.add("probe", prompt(96, seed=1), max_tokens=3)
        sim.run()
    return any(p.claimed[0] == 96 for p in sim.poisoned.values())


class StartLines:
    """Stands in for vLLM's logger: keeps the plugin's start lines (install with
    ``monkeypatch.setattr(activation, "_logger", lambda: recorder)``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, message: str, *args: Any) -> None:
        self.lines.append(message % args)

    warning = info


def left_to_prompt_checkpoint(sim: Any, lost: str) -> bool:
    """Whether a kept state left unmaterialized (an entry of
    ``sim.missing_kept``) is a prompt's replay boundary whose slot vLLM gave
    to the prompt checkpoint, as it does on stock vLLM: the chunk across the
    boundary ended the prompt, and a state of the same prompt past the
    boundary, within one state block, was published. ``lean`` leaves those
    to vLLM (``StopPolicy.yield_replay_to_checkpoint``); judged here from the
    oracle's records alone."""
    from vllm_mamba_align.tools.sim import state_id

    req_id, what = lost.split(": ", 1)
    if not what.endswith("inside a chunk"):
        return False
    boundary = int(what.split()[0])
    record = sim.records[req_id]
    tokens = record.request.prompt_token_ids
    length, grid = len(tokens), sim.geometry.state_block
    if boundary != (length - 1) // grid * grid:
        return False
    if not any(c.start < boundary < c.end == length for c in record.chunks):
        return False
    return any(
        state_id(tokens, position) in sim.published_states
        for position in range(boundary + 1, min(boundary + grid, length))
    )


def lost_kept_states(sim: Any, mode: str) -> list[str]:
    """The states vLLM keeps that ``mode`` left unmaterialized
    (``sim.missing_kept``), less, in ``lean``, the replay boundaries it leaves
    to vLLM's prompt checkpoint (:func:`left_to_prompt_checkpoint`)."""
    if mode != "lean":
        return list(sim.missing_kept)
    return [e for e in sim.missing_kept if not left_to_prompt_checkpoint(sim, e)]
