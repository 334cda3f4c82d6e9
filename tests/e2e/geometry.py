"""What the e2e engines and servers share, apart from any test: the plugins
vLLM loads, the heterogeneous geometry (C < B) and the plugin's start line.

A module of its own so that benchmarks/served.py starts its servers exactly
as the tests do without importing a test module.
"""

from __future__ import annotations

import re
from typing import Any

WORKAROUNDS = "cpu_e2e_workarounds"  # tests/support/cpu_e2e_workarounds
PLUGIN = "mamba_align"

HETEROGENEOUS: dict[str, Any] = {
    "speculative_config": {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        # Four hidden states per token: the hidden-state group's pages hold
        # fewer tokens than the attention/Mamba pages, so its block (and with it
        # vLLM's cache_config.block_size, C) is smaller than the Mamba block B.
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2, 3]}
        },
    },
    # User-specified: the CPU platform otherwise resets an unspecified
    # block_size to 128 when the engine core re-validates its config after the
    # multiprocess handshake, after the scheduler was built with C < B.
    "block_size": 32,
}

LOG_LINE = re.compile(
    # The status may contain semicolons (retention, audit): up to the geometry.
    r"vllm-mamba-align \S+ on vLLM (?P<vllm>\S+) \([^)]*\): (?P<status>[^\n]*); "
    r"cache block C=(?P<c>\d+), Mamba state block B=(?P<b>\w+), "
    r"hash block (?P<h>\d+)"
)
