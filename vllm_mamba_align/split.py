"""The fixed split: vLLM's own algorithm on the Mamba state grid, plus one stop.

Backport of vLLM PR #54076 (never merged). Two defects of
``Scheduler._mamba_block_aligned_split`` in align mode:

1. It reads its grid from ``cache_config.block_size`` (C), which the engine sets to
   the smallest block over all KV-cache groups. The worker checkpoints a state only
   where a chunk ends on the Mamba grid B. With C < B chunks end where no state
   exists, and slots get published under hashes of states they do not hold.
   Fix: run vLLM's own function with a scheduler-local view of the cache config
   whose ``block_size`` is B. The shared config is never touched.
2. A chunk that starts on a boundary is not stopped at the next one, so one step
   can cross several boundaries; the allocator gives a request one real state
   block per step, so the crossed interior states are never materialized.
   Fix (``full`` mode): a non-final prefill chunk stops at the next B boundary,
   unless vLLM's backend checkpoints interior states itself for that chunk.
"""

from __future__ import annotations

import threading
from typing import Any

from .releases import InternalCheckpoint, PrefillRule, SplitBody
from .settings import Mode


class _StateGridCacheConfig:
    """The scheduler's cache config, except that ``block_size`` is the state grid.

    Reads of every other field go to the shared config; writes are refused.
    """

    __slots__ = ("block_size", "shared")

    def __init__(self, shared: Any, state_block_size: int) -> None:
        object.__setattr__(self, "shared", shared)
        object.__setattr__(self, "block_size", state_block_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.shared, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the Mamba state-grid view of cache_config is read-only")


class _CheckpointObserver(threading.local):
    """Records vLLM's internal-checkpoint decision taken inside one split call."""

    watching: bool = False
    used: bool = False


checkpoint_observer = _CheckpointObserver()


def observe_checkpoint_decision(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Wrapper of the scheduler module's ``is_mamba_prefill_checkpoint_valid``.

    On 0.30.0+ the split uses internal checkpointing exactly when this returns
    True (it is the last operand of a short-circuit ``and``). Watching it keeps the
    plugin in step with vLLM's decision instead of re-deriving it.
    """
    result = wrapped(*args, **kwargs)
    if checkpoint_observer.watching and result:
        checkpoint_observer.used = True
    return result


def _chunk_start(
    request: Any,
    num_new_tokens: int,
    num_new_local_computed_tokens: int = 0,
    num_external_computed_tokens: int = 0,
    *_: Any,
    **__: Any,
) -> tuple[Any, int]:
    """Binds the split's arguments by vLLM's names; returns (request, chunk start)."""
    start = (
        request.num_computed_tokens
        + num_new_local_computed_tokens
        + num_external_computed_tokens
    )
    return request, start


class StateGridSplit:
    """The fix as installed on one scheduler.

    For the duration of one split call the scheduler's own ``cache_config``
    attribute points at a read-only view whose ``block_size`` is B; the shared
    config object is never touched, and the attribute is restored before the call
    returns. (A proxy of the whole scheduler would work too, but costs about 10 us
    per call in attribute look-ups; this costs a few hundred nanoseconds.)
    """

    __slots__ = ("body", "grid_config", "mode", "observing", "state_block_size")

    def __init__(
        self, scheduler: Any, mode: Mode, state_block_size: int, body: SplitBody
    ) -> None:
        self.mode = mode
        self.state_block_size = state_block_size
        self.body = body
        self.observing = body.internal_checkpoint is InternalCheckpoint.OBSERVED
        self.grid_config = _StateGridCacheConfig(
            scheduler.cache_config, state_block_size
        )

    def __call__(
        self,
        wrapped: Any,
        scheduler: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> int:
        shared = scheduler.cache_config
        if shared is not self.grid_config.shared:  # replaced since init
            self.grid_config = _StateGridCacheConfig(shared, self.state_block_size)
        observer = checkpoint_observer
        if self.observing:
            observer.watching = True
            observer.used = False
        scheduler.cache_config = self.grid_config
        try:
            num_tokens: int = wrapped(*args, **kwargs)
        finally:
            scheduler.cache_config = shared
            if self.observing:
                observer.watching = False
        if num_tokens <= 0 or self.mode is not Mode.FULL:
            return num_tokens
        request, start = _chunk_start(*args, **kwargs)
        grid = self.state_block_size
        next_boundary = (start // grid + 1) * grid
        if next_boundary >= start + num_tokens:
            return num_tokens  # the chunk crosses no boundary: nothing to stop
        if not self._in_prefill(request, start):
            return num_tokens
        if self._internal_checkpoint(scheduler, start):
            return num_tokens
        return next_boundary - start

    def _in_prefill(self, request: Any, start: int) -> bool:
        if self.body.prefill is PrefillRule.NO_OUTPUT_YET:
            return bool(request.num_output_tokens == 0)
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        return bool(start < prefill_end)

    def _internal_checkpoint(self, scheduler: Any, start: int) -> bool:
        rule = self.body.internal_checkpoint
        if rule is InternalCheckpoint.OBSERVED:
            return checkpoint_observer.used
        if rule is InternalCheckpoint.ALIGNED_START:
            return bool(
                scheduler.mamba_has_prefill_checkpoint_blocks
                and start % self.state_block_size == 0
            )
        return False
