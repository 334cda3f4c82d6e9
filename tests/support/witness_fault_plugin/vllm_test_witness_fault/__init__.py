"""Test-only fault: the mamba_align plugin's model of vLLM's state retention
believes vLLM keeps no boundary state at all (not dense, no interval, no
replay boundary, no junction), whatever the scheduler's setting is.

With it, ``kept`` mode never stops at a boundary, so under dense retention or
an interval R a chunk runs past boundaries whose states vLLM keeps: their
slots stay null, states no chunk wrote. tests/witness loads this plugin by name
(``VLLM_PLUGINS=mamba_align,mamba_align_retention_fault``) to show that its
judge, which shares no code with the plugin, fails such a plugin. vLLM loads
every general plugin before it builds a scheduler, and the plugin consults the
model while it schedules, so the order in which the two load does not matter.

Inert unless ``MAMBA_ALIGN_WITNESS_FAULT=retention`` is set too: with
``VLLM_PLUGINS`` unset vLLM loads every installed general plugin, and the
suites' environments have this one installed beside the plugin.
"""

from __future__ import annotations

import os
from typing import Any

SWITCH = "MAMBA_ALIGN_WITNESS_FAULT"


def register() -> None:
    if os.environ.get(SWITCH) != "retention":
        return
    from vllm_mamba_align import retention

    model: Any = retention.Retention
    model.dense = property(lambda self: False)
    model.keeps_segment = lambda self, boundary: False
    model.reachable = lambda self, request: ()
