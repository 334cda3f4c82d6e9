"""The fixed split: vLLM's own algorithm on the Mamba state grid, plus one stop.

Backport of vLLM PR #54076 (never merged). Two defects of
``Scheduler._mamba_block_aligned_split`` in align mode:

1. It reads its grid from ``cache_config.block_size`` (C), which the engine sets to
   the smallest block over all KV-cache groups. The worker checkpoints a state only
   where a chunk ends on the Mamba grid B. With C < B chunks end where no state
   exists, and slots get published under hashes of states they do not hold.
   Fix: run vLLM's own function on a scheduler-local view whose
   ``cache_config.block_size`` is B. The shared config is never touched.
2. A chunk that starts on a boundary is not stopped at the next one, so one step
   can cross several boundaries; the allocator gives a request one real state
   block per step, so the crossed interior states are never materialized.
   Fix (``full`` mode): a non-final prefill chunk stops at the next B boundary,
   unless vLLM's backend checkpoints interior states itself for that chunk.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import wrapt

from .releases import InternalCheckpoint, PrefillRule, SplitBody
from .settings import Mode


class _StateGridCacheConfig(wrapt.ObjectProxy):  # type: ignore[misc,type-arg]
    """The scheduler's cache config, except that ``block_size`` is the state grid."""

    def __init__(self, cache_config: Any, state_block_size: int) -> None:
        super().__init__(cache_config)
        self._self_state_block_size = state_block_size

    @property
    def block_size(self) -> int:
        return int(self._self_state_block_size)

    @block_size.setter
    def block_size(self, value: int) -> None:
        raise AttributeError("the Mamba state-grid view of cache_config is read-only")


class _StateGridScheduler(wrapt.ObjectProxy):  # type: ignore[misc,type-arg]
    """The scheduler as the split function sees it: same object, state-grid config."""

    def __init__(self, scheduler: Any, state_block_size: int) -> None:
        super().__init__(scheduler)
        self._self_cache_config = _StateGridCacheConfig(
            scheduler.cache_config, state_block_size
        )

    @property
    def cache_config(self) -> Any:
        return self._self_cache_config


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


@dataclass(frozen=True)
class StateGridSplit:
    """The fix as installed on one scheduler."""

    mode: Mode
    state_block_size: int
    body: SplitBody
    view: Any

    @classmethod
    def for_scheduler(
        cls, scheduler: Any, mode: Mode, state_block_size: int, body: SplitBody
    ) -> StateGridSplit:
        return cls(
            mode,
            state_block_size,
            body,
            _StateGridScheduler(scheduler, state_block_size),
        )

    def __call__(
        self,
        wrapped: Any,
        scheduler: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> int:
        observing = self.body.internal_checkpoint is InternalCheckpoint.OBSERVED
        if observing:
            checkpoint_observer.watching = True
            checkpoint_observer.used = False
        try:
            num_tokens = int(wrapped.__func__(self.view, *args, **kwargs))
        finally:
            if observing:
                checkpoint_observer.watching = False
        if self.mode is not Mode.FULL or num_tokens <= 0:
            return num_tokens
        request, start = _chunk_start(*args, **kwargs)
        if not self._in_prefill(request, start):
            return num_tokens
        if self._internal_checkpoint(scheduler, start):
            return num_tokens
        grid = self.state_block_size
        next_boundary = (start // grid + 1) * grid
        if start < next_boundary < start + num_tokens:
            return next_boundary - start
        return num_tokens

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
