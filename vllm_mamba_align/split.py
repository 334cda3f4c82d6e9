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
   Fix (``full`` mode): a non-final prefill chunk stops at the next B boundary.
   With backend prefill checkpoints (GPU, 0.29.0+) the backend writes ONE state
   inside a chunk vLLM checkpoints internally: the stop is skipped only when the
   returned chunk really ends the prefill and its only boundary is that state
   (:func:`backend_checkpoint_rule`).
   ``kept`` mode stops only where vLLM's state retention keeps the boundary's
   state (retention.py); ``grid`` mode adds no stop of its own, but keeps
   vLLM's stop after a mid-block start (a partial hit, a KV connector's hit)
   where 0.30.0+ drops it for a chunk it checkpoints internally.

The split runs for every running request at every step (decodes included), so the
fix is a plain closure bound to one scheduler: no wrapper layers, no argument
packing, a few integer operations on top of vLLM's own call. It has exactly the
parameters of the installed vLLM method (after ``self``): one variant for the
four of most releases, one for the five of 0.24.0-0.25.1, chosen once at bind
time; and it carries vLLM's ``__name__``, ``__qualname__``, ``__doc__`` and
``__wrapped__`` (:func:`present_as`).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from .releases import CheckpointGrid, InternalCheckpoint, SplitBody, in_prefill
from .retention import Retention
from .settings import Mode

SplitFunction = Callable[..., int]
"""``_mamba_block_aligned_split`` as bound to one scheduler (no ``self``)."""


def present_as(route: SplitFunction, stock: SplitFunction) -> SplitFunction:
    """Give a bound route vLLM's method's identity, once, at bind time.

    ``__name__``, ``__qualname__``, ``__doc__``, ``__module__`` and
    ``__wrapped__`` (``stock``, vLLM's own function) are copied, and the
    signature is vLLM's without ``self``, so tracebacks, profilers and
    ``inspect`` see vLLM's method. Routes take their parameters as plain
    positional ones (a ``*rest`` parameter would cost about 70 ns per call, on
    every request at every step).
    """
    functools.update_wrapper(route, stock)
    signature = inspect.signature(stock)
    route.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=tuple(signature.parameters.values())[1:]
    )
    return route


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


class _CheckpointDecisions(threading.local):
    """How many times vLLM decided for internal checkpointing, on this thread."""

    taken: int = 0


checkpoint_decisions = _CheckpointDecisions()


def observe_checkpoint_decision(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Wrapper of the scheduler module's ``is_mamba_prefill_checkpoint_valid``.

    On 0.30.0+ the split uses internal checkpointing exactly when this returns
    True (it is the last operand of a short-circuit ``and``). Counting its True
    answers keeps the plugin in step with vLLM's decision instead of re-deriving
    it: a split call whose count moved took the decision.
    """
    result = wrapped(*args, **kwargs)
    if result:
        checkpoint_decisions.taken += 1
    return result


CheckpointRule = Callable[[int, int], int]
"""(chunk start, chunk end) -> where the backend's in-chunk checkpoint goes, for
a chunk vLLM decided to checkpoint internally (-1: nowhere)."""


def backend_off_manager_grid(scheduler: Any, body: SplitBody, grid: int) -> bool:
    """Whether vLLM's backend puts its in-chunk state on another hash grid than
    its Mamba manager reserves and publishes the block for.

    0.30.0-0.31.0 (:attr:`CheckpointGrid.PREFIX_MATCH_UNIT`) with checkpoint
    blocks, prefix_match_unit unset and an engine hash block other than B (the
    GCD of the groups' blocks, so C < B): for a chunk that spans two state
    blocks the manager reserves the checkpoint block at its own position
    (single_type_kv_cache_manager.py:1775-1779 in 0.30.0, :1783-1787 in
    0.31.0) and keys it there (``_cache_partial_tail_block``, :2047-2092 in
    0.31.0), while the backend writes the state of another position into it:
    vLLM publishes a wrong state by itself. No chunk of one block is
    checkpointed internally, so the fix then stops at every boundary, in
    ``kept`` mode too, and never counts on the backend's state.
    """
    if body.checkpoint_grid is not CheckpointGrid.PREFIX_MATCH_UNIT:
        return False
    if not getattr(scheduler, "mamba_has_prefill_checkpoint_blocks", False):
        return False
    backend = getattr(scheduler.cache_config, "prefix_match_unit", None) or grid
    return bool(backend != scheduler.hash_block_size)


def spec_reserves_checkpoints(scheduler: Any) -> bool:
    """Whether a Mamba group's spec declares prefill checkpoint blocks, which
    its manager reserves for a chunk that starts on the grid and ends off it,
    whatever the scheduler's own ``mamba_has_prefill_checkpoint_blocks`` says."""
    return any(
        getattr(group.kv_cache_spec, "num_prefill_checkpoint_blocks", 0) > 0
        for group in scheduler.kv_cache_config.kv_cache_groups
    )


def speculative_blocks(scheduler: Any) -> int:
    """The most speculative scratch blocks a Mamba group's spec reserves per
    request (an EAGLE/MTP drafter's; 0 without one)."""
    return max(
        (
            getattr(group.kv_cache_spec, "num_speculative_blocks", 0)
            for group in scheduler.kv_cache_config.kv_cache_groups
        ),
        default=0,
    )


def backend_checkpoint_rule(
    scheduler: Any, stock: SplitFunction, body: SplitBody, grid: int
) -> CheckpointRule | None:
    """Where vLLM's GPU backend writes its one in-chunk prefill state.

    None: the body has no internal checkpointing, or its position is not known
    here (the fix then stops at every boundary, which is always safe: a cut
    chunk is no longer final and vLLM decides again for the next one).

    - 0.30.0+ (:class:`CheckpointGrid`): the backend puts the state at
      ``get_mamba_prefill_checkpoint_position(chunk end, grid)`` and writes it
      (into column ``cdiv(end, B) - 2``) only where
      ``is_mamba_prefill_checkpoint_valid`` holds for its hash block
      (models/kimi_k3/nvidia/kda_metadata.py:630-652 in 0.30.0,
      model_executor/layers/mamba/checkpoint.py:21-58 in 0.31.0 and 0.32.0,
      :21-63 in 0.33.0); both taken with vLLM's own functions, as the
      scheduler module imported them. The helper's parameters must be the
      release's: three up to 0.32.0, a fourth (``num_hash_lookahead_tokens``)
      in 0.33.0.
    - 0.29.0: only KDA on flashkda has checkpoint blocks; its metadata builder
      (models/kimi_k3/nvidia/kda_metadata.py:582-605) writes the last B boundary
      below the chunk end if the chunk does not end on the grid and the offset
      from the chunk start is a multiple of 16 (FLASHKDA_CHUNK_SIZE).
    """
    rule = body.internal_checkpoint
    if rule is InternalCheckpoint.ALIGNED_START:

        def aligned_start(start: int, end: int) -> int:
            position = end // grid * grid
            if end % grid == 0 or not start < position or (position - start) % 16:
                return -1
            return position

        return aligned_start
    if rule is not InternalCheckpoint.OBSERVED or body.checkpoint_grid is None:
        return None
    names = getattr(stock, "__globals__", {})
    position_of: Callable[..., int] | None = names.get(
        "get_mamba_prefill_checkpoint_position"
    )
    # The plugin counts the module's validity calls (observe_checkpoint_decision):
    # ask the function it wraps, so these calls are not counted as decisions.
    valid: Callable[..., bool] | None = names.get("is_mamba_prefill_checkpoint_valid")
    valid = getattr(valid, "__wrapped__", valid)
    if position_of is None or valid is None:
        return None
    try:
        parameters = tuple(inspect.signature(position_of).parameters)
        valid_parameters = set(inspect.signature(valid).parameters)
    except (TypeError, ValueError):
        return None
    lookahead = parameters == (*_POSITION_PARAMETERS, "num_hash_lookahead_tokens")
    if not (lookahead or parameters == _POSITION_PARAMETERS):
        return None  # a helper this module has not been checked against
    if valid_parameters != _VALID_PARAMETERS:
        return None
    by_prefix_unit = body.checkpoint_grid is CheckpointGrid.PREFIX_MATCH_UNIT
    if by_prefix_unit and lookahead:
        return None  # 0.30.0/0.31.0's grid with 0.33.0's helper: unknown code
    if backend_off_manager_grid(scheduler, body, grid):
        return None
    helper, check = position_of, valid

    def observed(start: int, end: int) -> int:
        if by_prefix_unit:
            # 0.30.0, 0.31.0: the backend's grid and hash block (the same as
            # the manager's: see backend_off_manager_grid).
            hash_block = scheduler.cache_config.prefix_match_unit or grid
            block = hash_block
        else:
            # 0.32.0+: cache_hit_alignment_tokens, which the scheduler's split
            # reads as ckpt_block_size (scheduler.py:473-475 in 0.32.0,
            # :576-578 in 0.33.0), and the engine's hash block.
            hash_block = scheduler.hash_block_size
            partial = scheduler.mamba_partial_cache_hit
            block = hash_block if partial else scheduler.block_size
        drop = scheduler.use_eagle_block_drop
        if lookahead:
            tokens = scheduler.num_hash_lookahead_tokens
            position: int = helper(end, block, drop, num_hash_lookahead_tokens=tokens)
        else:
            position = helper(end, block, drop)
        if not check(
            query_start=start,
            query_end=end,
            checkpoint_position=position,
            hash_block_size=hash_block,
            mamba_block_size=grid,
            checkpoint_alignment=scheduler.mamba_prefill_checkpoint_alignment,
        ):
            return -1  # the backend declines: nothing is written
        return position

    return observed


_POSITION_PARAMETERS = ("num_tokens", "hash_block_size", "drop_eagle_block")
"""``get_mamba_prefill_checkpoint_position``'s parameters, 0.30.0-0.32.0."""
_VALID_PARAMETERS = {
    "query_start",
    "query_end",
    "checkpoint_position",
    "hash_block_size",
    "mamba_block_size",
    "checkpoint_alignment",
}
"""``is_mamba_prefill_checkpoint_valid``'s parameters, 0.30.0-0.33.0."""


def step_budget(scheduler: Any) -> tuple[int, str]:
    """The most prefill tokens one request may get in a step, and what sets it
    (vLLM's split computes the same bound)."""
    budget = int(scheduler.max_num_scheduled_tokens)
    source = f"--max-num-batched-tokens={budget}"
    threshold = int(scheduler.scheduler_config.long_prefill_token_threshold or 0)
    if 0 < threshold < budget:
        budget, source = threshold, f"--long-prefill-token-threshold={threshold}"
    return budget, source


def state_grid_split(
    scheduler: Any,
    stock: SplitFunction,
    mode: Mode,
    state_block_size: int,
    body: SplitBody,
    retention: Retention,
) -> SplitFunction:
    """The fix for one scheduler, as a function with the split's own signature.

    ``stock`` is vLLM's unwrapped function (it takes the scheduler first). For the
    duration of each call the scheduler's own ``cache_config`` attribute points at
    a read-only view whose ``block_size`` is B, and is restored before the call
    returns. (A proxy of the whole scheduler would work too, but costs about 10 us
    per call in attribute look-ups.)
    """
    grid = state_block_size
    stop_at_boundaries = mode in (Mode.FULL, Mode.KEPT)
    # Every boundary is worth a stop (full), or only those vLLM keeps (kept);
    # every one also where a longer chunk gets a wrongly published checkpoint.
    stop_anywhere = (
        mode is Mode.FULL
        or retention.dense
        or backend_off_manager_grid(scheduler, body, state_block_size)
    )
    first_kept_after = retention.first_kept_after
    view = _StateGridCacheConfig(scheduler.cache_config, grid)
    rule = body.internal_checkpoint
    # grid: 0.30.0+ drops its own stop at the boundary after a mid-block start
    # when it checkpoints the chunk internally; grid puts it back (see
    # keep_mid_block_stop).
    mid_block_stop = mode is Mode.GRID and rule is InternalCheckpoint.OBSERVED
    # 0.29.0's flashkda backend writes its in-chunk state only 16-aligned from
    # the chunk start, yet vLLM publishes the reserved checkpoint block either
    # way: with B % 16 == 8 a chunk from a boundary across an odd number of
    # blocks would publish a hash over a slot that holds nothing. Every active
    # mode ends such a chunk on the grid instead (its end state is then written
    # as any chunk end's is; see stop()).
    # The manager reserves (and publishes) that block by the Mamba spec, which
    # keeps its checkpoint blocks with a drafter, while the scheduler's own
    # flag turns off there (scheduler.py:329-338 and
    # single_type_kv_cache_manager.py:1565-1580 in 0.29.0): the guard goes by
    # the spec.
    guard_unwritten = (
        rule is InternalCheckpoint.ALIGNED_START
        and grid % 16 != 0
        and spec_reserves_checkpoints(scheduler)
    )
    # grid before 0.26.0: vLLM has no stop at the boundary after a chunk that
    # starts mid-block (a KV connector's hit off the grid), so the start's block,
    # holding the loaded state, would be published as the boundary's. grid adds
    # the stop 0.26.0+ make themselves (there it changes nothing). 0.26.0 still
    # lacks it in its drafter tail (unaligned before 0.27.1): with MTP, C = B =
    # 168 and a 176-token prompt arriving next to a decode, stock runs
    # 0 -> 166 -> 176 and publishes the block of 168 holding state@166.
    mid_block_stop_missing = mode is Mode.GRID and not (
        body.stops_after_mid_block_start
        and (body.aligns_drafter_tail or speculative_blocks(scheduler) == 0)
    )
    # 0.30.0-0.31.0 with a drafter: in a step it checkpoints internally,
    # vLLM's manager leaves a running request's speculative scratch blocks
    # where they stood, in the columns of the chunk's interior boundaries, and
    # publishes them as those states (stock does; see
    # SplitBody.relocates_scratch_in_checkpoint_steps). Every mode cuts such a
    # chunk at its first boundary: that step checkpoints nothing, so vLLM moves
    # the scratch blocks as in any other step.
    guard_scratch = (
        rule is InternalCheckpoint.OBSERVED
        and not body.relocates_scratch_in_checkpoint_steps
        and spec_reserves_checkpoints(scheduler)
        and speculative_blocks(scheduler) > 0
    )
    any_stop = (
        stop_at_boundaries
        or mid_block_stop
        or guard_unwritten
        or mid_block_stop_missing
        or guard_scratch
    )
    observed = rule is InternalCheckpoint.OBSERVED and any_stop
    prefill_rule = body.prefill
    decisions = checkpoint_decisions

    checkpoint_at = backend_checkpoint_rule(scheduler, stock, body, grid)
    # A prefill chunk from a boundary that the step budget squeezes short of the
    # next one would make that boundary's state a two-chunk one. vLLM's split
    # waits for a whole block itself, except where it leaves such a chunk
    # unaligned: 0.29.0 once checkpoint blocks exist (trusting the backend with
    # the boundary inside), and bodies before 0.27.1 with an EAGLE/MTP drafter
    # in the last block but one (its "prefill the last few tokens" branch once
    # it backs the last cacheable position off one block). Where boundary
    # states must be canonical (full, and kept under dense retention) the fix
    # waits there too; grid leaves vLLM's chunk alone.
    align_short_chunks = (
        stop_at_boundaries and stop_anywhere and 0 < grid <= step_budget(scheduler)[0]
    )
    checkpoint_blocks_unalign = rule is InternalCheckpoint.ALIGNED_START

    def falls_short(request: Any, start: int, num_new_tokens: int) -> bool:
        """Whether a prefill chunk from a boundary reaches neither the next
        boundary nor the end of the prefill, where vLLM may leave it unaligned:
        before a boundary inside the prefill, or (0.29.0 with checkpoint
        blocks) anywhere short of the prefill end."""
        end = start + num_new_tokens
        if start % grid or end >= start + grid:
            return False
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if end >= prefill_end or not in_prefill(prefill_rule, request, start):
            return False
        return start + grid <= prefill_end or (
            checkpoint_blocks_unalign and scheduler.mamba_has_prefill_checkpoint_blocks
        )

    def stop(request: Any, start: int, num_tokens: int, taken_before: int) -> int:
        """vLLM's answer for a chunk of two or more tokens, stopped at the next
        boundary where the mode says so."""
        next_boundary = (start // grid + 1) * grid
        end = start + num_tokens
        if next_boundary >= end:
            return num_tokens  # the chunk crosses no boundary: nothing to stop
        if not in_prefill(prefill_rule, request, start):
            return num_tokens  # not a prefill chunk
        if (
            guard_unwritten
            and end % grid
            and start % grid == 0
            and checkpoint_at is not None
            and checkpoint_at(start, end) < 0
        ):
            end = end // grid * grid
            num_tokens = end - start
            if next_boundary == end:
                return num_tokens
        if not stop_at_boundaries:
            if mid_block_stop_missing and start % grid:
                return next_boundary - start
            return num_tokens
        if (
            checkpoint_at is not None
            and (
                decisions.taken != taken_before
                if observed
                else scheduler.mamba_has_prefill_checkpoint_blocks and start % grid == 0
            )
            and end >= max(request.num_prompt_tokens, request.num_tokens - 1)
            and end < next_boundary + grid  # no state at a later boundary
            and checkpoint_at(start, end) == next_boundary
        ):
            # vLLM checkpoints inside this chunk, which really ends the
            # prefill, and the one state its backend writes is the chunk's
            # only boundary (its end is not one: that state would come from
            # a chunk two blocks long).
            return num_tokens
        if stop_anywhere:
            return next_boundary - start
        # kept: stop only at a boundary whose state vLLM keeps; a step spent on
        # a boundary it drops would buy nothing.
        kept = first_kept_after(request, start)
        if kept is None or kept >= end:
            return num_tokens
        return kept - start

    def keep_mid_block_stop(
        request: Any, start: int, num_tokens: int, taken_before: int
    ) -> int:
        """grid: vLLM's answer, with its own stop at the boundary after a chunk
        that starts mid-block kept when vLLM checkpoints the chunk internally.

        vLLM 0.30.0+ drops that stop for such a chunk (scheduler.py:645-649 in
        0.33.0) although its backend writes one state, and only into the start's
        block when it is that boundary's. Otherwise the start's block (a partial
        hash hit's copy, a KV connector's loaded state: e.g. a store hit ending
        at 13,008 with B = 1,648) fills up without ever holding the boundary's
        state, and vLLM publishes it as that state (and hands it to a
        connector's store) once the chunk passes the boundary, if its state
        retention keeps that boundary (else the block is freed unpublished and
        no stop is needed).
        """
        next_boundary = (start // grid + 1) * grid
        end = start + num_tokens
        if (
            start % grid == 0
            or next_boundary >= end
            or decisions.taken == taken_before  # vLLM kept its stop
        ):
            return num_tokens
        if (
            checkpoint_at is not None
            and end >= max(request.num_prompt_tokens, request.num_tokens - 1)
            and end <= next_boundary + grid  # the checkpoint's column is the start's
            and checkpoint_at(start, end) == next_boundary
        ):
            return num_tokens  # the backend writes the boundary's state there
        if not retention.keeps(request, next_boundary):
            return num_tokens
        return next_boundary - start

    def scratch_safe(request: Any, start: int, num_tokens: int) -> int:
        """``num_tokens``, or up to the next boundary where vLLM 0.30.0-0.31.0
        would leave a running request's scratch blocks inside the chunk.

        Their columns start at ``cdiv(start, B)`` (the blocks after the running
        state; later if the request holds more), the checkpoint's is
        ``cdiv(end, B) - 2``: a scratch block stands in an interior
        boundary's column when the first is below the second, in a step the
        backend checkpoints (conservatively: any, when the rule is unknown).
        A fresh request (no blocks yet) gets its scratch blocks after the
        chunk's."""
        end = start + num_tokens
        if (
            request.num_computed_tokens == 0
            or -(-start // grid) >= -(-end // grid) - 2
            or not in_prefill(prefill_rule, request, start)
            or (checkpoint_at is not None and checkpoint_at(start, end) < 0)
        ):
            return num_tokens
        return (start // grid + 1) * grid - start

    mode_stop = keep_mid_block_stop if mid_block_stop else stop

    def mode_stop_then_scratch_safe(
        request: Any, start: int, num_tokens: int, taken_before: int
    ) -> int:
        return scratch_safe(
            request, start, mode_stop(request, start, num_tokens, taken_before)
        )

    boundary_stop = mode_stop_then_scratch_safe if guard_scratch else mode_stop

    # The two variants differ only in vLLM's optional fifth parameter.
    def split(
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        nonlocal view
        if align_short_chunks and falls_short(
            request,
            request.num_computed_tokens
            + num_new_local_computed_tokens
            + num_external_computed_tokens,
            num_new_tokens,
        ):
            return 0
        shared = scheduler.cache_config
        if view.shared is not shared:  # replaced since the scheduler started
            view = _StateGridCacheConfig(shared, grid)
        # Only a chunk of two or more tokens can cross a boundary (decodes can't).
        taken_before = decisions.taken if observed and num_new_tokens > 1 else 0
        scheduler.cache_config = view
        try:
            num_tokens: int = stock(
                scheduler,
                request,
                num_new_tokens,
                num_new_local_computed_tokens,
                num_external_computed_tokens,
            )
        finally:
            scheduler.cache_config = shared
        if num_tokens <= 1 or not any_stop:
            return num_tokens
        start = (
            request.num_computed_tokens
            + num_new_local_computed_tokens
            + num_external_computed_tokens
        )
        return boundary_stop(request, start, num_tokens, taken_before)

    def split_with_prefix_tokens(
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        num_uncached_common_prefix_tokens: int = 0,
    ) -> int:
        nonlocal view
        if align_short_chunks and falls_short(
            request,
            request.num_computed_tokens
            + num_new_local_computed_tokens
            + num_external_computed_tokens,
            num_new_tokens,
        ):
            return 0
        shared = scheduler.cache_config
        if view.shared is not shared:
            view = _StateGridCacheConfig(shared, grid)
        taken_before = decisions.taken if observed and num_new_tokens > 1 else 0
        scheduler.cache_config = view
        try:
            num_tokens: int = stock(
                scheduler,
                request,
                num_new_tokens,
                num_new_local_computed_tokens,
                num_external_computed_tokens,
                num_uncached_common_prefix_tokens,
            )
        finally:
            scheduler.cache_config = shared
        if num_tokens <= 1 or not any_stop:
            return num_tokens
        start = (
            request.num_computed_tokens
            + num_new_local_computed_tokens
            + num_external_computed_tokens
        )
        return boundary_stop(request, start, num_tokens, taken_before)

    route = split if body.extra_parameter is None else split_with_prefix_tokens
    return present_as(route, stock)
