"""The stand-in's platform: vLLM's own CPU platform, plus a patch applied in
``pre_register_and_update`` (where vllm-ascend applies its global patches)."""

from __future__ import annotations

from typing import Any

from vllm.platforms.cpu import CpuPlatform


def _torch_compat() -> None:
    """What the test CPU platform plugin does for vLLM <= 0.17.1 (this platform
    replaces it when selected)."""
    try:
        from vllm_test_cpu_platform import _torch_compat as compat
    except ImportError:
        return
    compat()


_torch_compat()


class ForeignCpuPlatform(CpuPlatform):  # type: ignore[misc]
    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        super().pre_register_and_update(parser)
        from . import way

        if (way() or "").endswith("-at-pre-register"):
            import vllm.v1.core.sched.scheduler as module

            from .patches import install_platform_patches

            install_platform_patches(module)  # vLLM calls this more than once
