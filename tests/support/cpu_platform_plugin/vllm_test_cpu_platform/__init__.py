"""Test-only platform plugin: vLLM's built-in CPU platform on releases < 0.28.0.

Those releases choose the CPU platform only for a CPU build of vLLM or on macOS,
so the regular wheel on a CPU-only Linux machine has no platform at all. This
plugin, installed only into test environments, selects vLLM's own CpuPlatform
unless VLLM_TARGET_DEVICE names another device.

vLLM <= 0.17.1 asks ``torch._C._cpu._is_avx512_supported()``, which torch 2.13 moved
to ``torch.cpu``; the missing names are pointed there.
"""

import os


def _torch_compat() -> None:
    import torch

    for name in dir(torch.cpu):
        probe = name.startswith("_is_") and name.endswith("_supported")
        if probe and not hasattr(torch._C._cpu, name):
            setattr(torch._C._cpu, name, lambda n=name: getattr(torch.cpu, n)())


def cpu_platform() -> str | None:
    if os.environ.get("VLLM_TARGET_DEVICE", "cpu") != "cpu":
        return None
    _torch_compat()
    return "vllm.platforms.cpu.CpuPlatform"
