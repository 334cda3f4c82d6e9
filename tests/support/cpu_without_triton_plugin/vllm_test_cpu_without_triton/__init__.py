"""Test-only plugin: vLLM's CPU platform builds a config on x86 without triton-cpu.

From vLLM 0.34.0, ``CpuPlatform.check_and_update_config`` raises "vLLM on x86
CPUs requires Triton (triton-cpu)." unless ``vllm.triton_utils.HAS_TRITON``:
the CPU model runner's kernels need Triton. The package registry carries no
triton-cpu, and the scheduler-only test environments run no kernel: they build
a real ``VllmConfig`` and a real ``Scheduler``. This plugin, installed only into
the environments whose pinned file names it (``# PLATFORM: cpu_without_triton``),
runs vLLM's own check with ``HAS_TRITON`` read as true for the duration of that
call, so every other setting the check makes is vLLM's, and restores it after
(a later caller still sees that Triton is missing). Nothing of vLLM is edited.

It is a general plugin, not a platform plugin: vLLM 0.34.0 consults no platform
plugin when ``VLLM_TARGET_DEVICE=cpu``, and vLLM loads general plugins (when it
inspects the model's architecture) before it builds the config. A subclass of
``CpuPlatform`` (tests/support/foreign_split_plugin) inherits the patched check.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import wrapt

CPU_PLATFORM_MODULE = "vllm.platforms.cpu"
_registered = False


def _check_without_triton(original: Any) -> Any:
    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        import vllm.triton_utils as triton_utils

        had = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = had

    check_and_update_config.without_triton = True  # type: ignore[attr-defined]
    return classmethod(check_and_update_config)


def _patch_cpu_platform(module: ModuleType) -> None:
    platform = module.CpuPlatform  # type: ignore[attr-defined]
    current = platform.__dict__["check_and_update_config"]
    if getattr(current.__func__, "without_triton", False):
        return
    platform.check_and_update_config = _check_without_triton(current.__func__)


def register() -> None:
    """Entry point (group ``vllm.general_plugins``); idempotent."""
    global _registered
    if _registered:
        return
    _registered = True
    wrapt.register_post_import_hook(_patch_cpu_platform, CPU_PLATFORM_MODULE)
