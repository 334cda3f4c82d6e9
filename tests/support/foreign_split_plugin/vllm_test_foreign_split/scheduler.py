"""A subclass of vLLM's scheduler with its own split, as vllm-gaudi's
``HPUAsyncScheduler`` (a subclass of ``AsyncScheduler``) has. Imported only by a
test that builds it."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from .patches import CALLS


class ForeignAsyncScheduler(AsyncScheduler):  # type: ignore[misc]
    def _mamba_block_aligned_split(self, request: Any, *args: Any) -> int:
        CALLS["override"] += 1
        return super()._mamba_block_aligned_split(request, *args)  # type: ignore[no-any-return]
