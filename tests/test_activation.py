"""The per-scheduler decision (``activation.attach``) on a real scheduler."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import scheduler_mode

from vllm_mamba_align import activation
from vllm_mamba_align.layers import Chain
from vllm_mamba_align.tools.sim import Geometry, Simulation

B = 1648


@pytest.mark.parametrize("mode", ["off", "lean", "kept", "full", "grid", "audit"])
def test_the_split_is_walked_once_per_attach_in_every_mode(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal checks, mode off's binding and the start line read one walk
    of the split's layers."""
    walked: list[str] = []
    walk = activation.walk

    def counted(scheduler_class: type, name: str) -> Chain:
        walked.append(name)
        return walk(scheduler_class, name)

    monkeypatch.setattr(activation, "walk", counted)
    with scheduler_mode(mode):
        sim: Any = Simulation(Geometry(cache_block=B, state_block=B, budget=8192))
    assert sim.scheduler is not None
    assert walked == [activation.SPLIT_METHOD]
