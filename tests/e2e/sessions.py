"""Deployments that run in a nox session of their own, outside CI's default list.

CI's e2e leg holds what a fresh-clone ``.ci/run`` can afford within its time
budget (docs/maintaining: "What CI runs"); the longer deployments are collected
there too and skipped, each saying which session runs it, so CI's table counts
them and a reader of the skip learns where they run.
"""

from __future__ import annotations

import os

import pytest

DEPLOYMENTS_VARIABLE = "MAMBA_ALIGN_E2E_DEPLOYMENTS"
"""Set by ``nox -s e2e_deployments``: run test_moe_dp.py and test_ray_dp.py."""


def outside_ci(variable: str, what: str, session: str) -> pytest.MarkDecorator:
    """Skip unless ``session`` (which sets ``variable`` to 1) runs the test."""
    return pytest.mark.skipif(
        os.environ.get(variable) != "1",
        reason=f"{what}: nox -s {session} (not in CI's default list)",
    )
