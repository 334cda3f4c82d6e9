"""Which boundary the backend's in-chunk state lands on as that boundary's own
state: the audit's reading (audit/counting.py counts such a write as the
boundary materialized). The rules it reads are checkpoints.py's, which the fix
reads too.

Importing this module needs neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..checkpoints import (
    CheckpointFacts,
    backend_checkpoint_rule,
    manager_rekeys_checkpoint_block,
    spec_reserves_checkpoints,
)

if TYPE_CHECKING:
    from ..protocols import Request, Scheduler

OwnSlotWrite = Callable[["Request", int, int], int]
"""(request, chunk start, chunk end) -> the B boundary whose state the backend
writes into that boundary's own slot inside the chunk (0: none)."""


def own_slot_write(
    scheduler: Scheduler, stock: Callable[..., int], body: CheckpointFacts, grid: int
) -> OwnSlotWrite | None:
    """Which boundary inside a chunk the GPU backend writes into its own slot,
    read off vLLM's rule and the request's block table; None where the Mamba
    spec reserves no checkpoint block or the backend's position is unknown.

    The backend writes its state (position: :func:`backend_checkpoint_rule`)
    into column ``cdiv(end, B) - 2``, and nothing when vLLM left that column
    null (e.g. 0.29.0 with a drafter moves a speculative scratch block out of
    it). The column is that boundary's own slot when the position is the last
    boundary before the chunk's end block. A position further down (the
    backend's grid, the cache-hit alignment, coarser than B) is published in
    that column under the position's own hash where the manager re-keys its
    checkpoint block (:func:`manager_rekeys_checkpoint_block`, 0.30.0+); on
    0.29.0 such a write makes no boundary exist. E.g. 0.33.0, B = 8, alignment
    16, a 25-token prompt in one chunk: the state at 16 goes into column 2 and
    is published there, under 16's hash.
    """
    if not spec_reserves_checkpoints(scheduler):
        return None
    position_of = backend_checkpoint_rule(scheduler, stock, body, grid)
    if position_of is None:
        return None
    try:
        groups = scheduler.kv_cache_config.kv_cache_groups
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        checkpointing = [
            manager
            for group, manager in zip(groups, managers, strict=True)
            if getattr(group.kv_cache_spec, "num_prefill_checkpoint_blocks", 0) > 0
        ]
        tables = [manager.req_to_blocks for manager in checkpointing]
    except (AttributeError, TypeError, ValueError):
        return None
    if not checkpointing:
        return None
    classes: list[type] = [type(manager) for manager in checkpointing]
    rekeyed = all(manager_rekeys_checkpoint_block(cls) for cls in classes)

    def held(request: Request, column: int) -> bool:
        """Whether every checkpointing group holds a real block in ``column``."""
        for blocks_of in tables:
            blocks = blocks_of.get(request.request_id)
            if not blocks or column >= len(blocks) or blocks[column].is_null:
                return False
        return True

    def written(request: Request, start: int, end: int) -> int:
        position = position_of(start, end)
        if not start < position < end or position % grid:
            return 0
        column = -(-end // grid) - 2
        if position // grid - 1 != column and not rekeyed:
            return 0
        return position if held(request, column) else 0

    return written
