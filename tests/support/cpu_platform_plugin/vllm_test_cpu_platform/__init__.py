"""Test-only platform plugin: vLLM's built-in CPU platform on releases < 0.28.0.

Those releases choose the CPU platform only for a CPU build of vLLM or on macOS,
so the regular wheel on a CPU-only Linux machine has no platform at all. This
plugin, installed only into test environments, selects vLLM's own CpuPlatform
unless VLLM_TARGET_DEVICE names another device.
"""

import os


def cpu_platform() -> str | None:
    if os.environ.get("VLLM_TARGET_DEVICE", "cpu") != "cpu":
        return None
    return "vllm.platforms.cpu.CpuPlatform"
