"""The fixed split: vLLM's own algorithm on the Mamba state grid, plus stops.

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
   Fix: the stops of the scheduler's :class:`policy.StopPolicy`, which says per
   mode, release and retention where a chunk stops (each decision a card).

This module is the route only: vLLM's call on the B-grid view, then the policy's
stops. The split runs for every running request at every step (decodes
included), so the route is a plain closure bound to one scheduler: no wrapper
layers, no argument packing, a few integer operations on top of vLLM's own call.
The route is bound with the installed method's parameters, four or five
(signature.py), and carries vLLM's ``__name__``, ``__qualname__``, ``__doc__``
and ``__wrapped__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .checkpoints import CheckpointRule, backend_checkpoint_rule, checkpoint_decisions
from .policy import LeanStop, StopPolicy
from .protocols import CacheConfig, Request, Scheduler
from .releases import SplitBody, in_prefill, prefill_end
from .retention import Retention
from .signature import Route, SplitFunction, StockCall, bind_route

BoundaryStop = Callable[[Request, int, int, int], int]
"""(request, chunk start, vLLM's token count, decisions before the call) -> the
token count, stopped where the policy says."""


class _StateGridCacheConfig:
    """The scheduler's cache config, except that ``block_size`` is the state grid.

    Reads of every other field go to the shared config; writes are refused.
    """

    __slots__ = ("block_size", "shared")
    block_size: int
    shared: CacheConfig

    def __init__(self, shared: CacheConfig, state_block_size: int) -> None:
        object.__setattr__(self, "shared", shared)
        object.__setattr__(self, "block_size", state_block_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.shared, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the Mamba state-grid view of cache_config is read-only")


def _falls_short(
    scheduler: Scheduler, policy: StopPolicy
) -> Callable[[Request, int, int], bool]:
    """:attr:`StopPolicy.align_short_chunks`: whether a prefill chunk from a
    boundary reaches neither the next boundary nor the end of the prefill, where
    vLLM may leave it unaligned: before a boundary inside the prefill, or (0.29.0
    with checkpoint blocks) anywhere short of the prefill end."""
    grid, prefill_rule = policy.grid, policy.prefill
    unalign = policy.checkpoint_blocks_unalign

    def falls_short(request: Request, start: int, num_new_tokens: int) -> bool:
        end = start + num_new_tokens
        if start % grid or end >= start + grid:
            return False
        ends_at = prefill_end(request)
        if end >= ends_at or not in_prefill(prefill_rule, request, start):
            return False
        return start + grid <= ends_at or (
            unalign and scheduler.mamba_has_prefill_checkpoint_blocks
        )

    return falls_short


def _boundary_stop(
    scheduler: Scheduler,
    policy: StopPolicy,
    retention: Retention,
    checkpoint_at: CheckpointRule | None,
) -> BoundaryStop:
    """vLLM's answer for a chunk of two or more tokens, stopped at the next
    boundary where the policy says so (every mode but grid on 0.30.0+)."""
    grid, prefill_rule, decisions = policy.grid, policy.prefill, checkpoint_decisions
    guard_unwritten, observed = policy.guard_unwritten, policy.watch_decisions
    stop_at_boundaries, stop_anywhere = policy.stop_at_boundaries, policy.stop_anywhere
    mid_block_stop_missing = policy.mid_block_stop_missing
    kept_after, lean = retention.first_kept_after, policy.stock_chunk_ends

    def stop(request: Request, start: int, num_tokens: int, taken_before: int) -> int:
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
            end = end // grid * grid  # 0.29.0's flashkda leaves it unwritten
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
            and end >= prefill_end(request)
            # asked last: lean's first kept boundary costs a walk of them all
            and (stand_in := kept_after(request, start) if lean else next_boundary)
            is not None
            and end < stand_in + grid  # no state at a later boundary
            and checkpoint_at(start, end) == stand_in
        ):
            # vLLM checkpoints inside this chunk, which ends the prefill, and
            # the one state its backend writes (the prompt's partial tail) is
            # the first boundary (lean: the first kept) and the last before
            # the end (which is none: that state would need a 2-block chunk).
            return num_tokens
        if stop_anywhere:
            return next_boundary - start
        # kept: stop only at a boundary whose state vLLM keeps; a step spent on
        # a boundary it drops would buy nothing.
        kept = kept_after(request, start)
        if kept is None or kept >= end:
            return num_tokens
        return kept - start

    return stop


def _keep_mid_block_stop(
    policy: StopPolicy, retention: Retention, checkpoint_at: CheckpointRule | None
) -> BoundaryStop:
    """:attr:`StopPolicy.mid_block_stop` (grid, 0.30.0+): vLLM's answer, with its
    own stop at the boundary after a chunk that starts mid-block kept when vLLM
    checkpoints the chunk internally.

    vLLM 0.30.0+ drops that stop for such a chunk (scheduler.py:645-649 in
    0.33.0) although its backend writes one state, and only into the start's
    block when it is that boundary's. Otherwise the start's block (a partial
    hash hit's copy, a KV connector's loaded state: e.g. a store hit ending at
    13,008 with B = 1,648) fills up without ever holding the boundary's state,
    and vLLM publishes it as that state (and hands it to a connector's store)
    once the chunk passes the boundary, if its state retention keeps that
    boundary (else the block is freed unpublished and no stop is needed).
    """
    grid, decisions, keeps = policy.grid, checkpoint_decisions, retention.keeps

    def keep_mid_block_stop(
        request: Request, start: int, num_tokens: int, taken_before: int
    ) -> int:
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
            and end >= prefill_end(request)
            and end <= next_boundary + grid  # the checkpoint's column is the start's
            and checkpoint_at(start, end) == next_boundary
        ):
            return num_tokens  # the backend writes the boundary's state there
        if not keeps(request, next_boundary):
            return num_tokens
        return next_boundary - start

    return keep_mid_block_stop


def _scratch_safe(
    policy: StopPolicy, checkpoint_at: CheckpointRule | None, then: BoundaryStop
) -> BoundaryStop:
    """:attr:`StopPolicy.guard_scratch` (0.30.0-0.31.0 with a drafter): ``then``'s
    answer, or up to the next boundary where vLLM would leave a running request's
    scratch blocks inside the chunk.

    Their columns start at ``cdiv(start, B)`` (the blocks after the running
    state; later if the request holds more), the checkpoint's is ``cdiv(end, B)
    - 2``: a scratch block stands in an interior boundary's column when the
    first is below the second, in a step the backend checkpoints
    (conservatively: any, when the rule is unknown). A fresh request (no blocks
    yet) gets its scratch blocks after the chunk's.
    """
    grid, prefill_rule = policy.grid, policy.prefill

    def scratch_safe(
        request: Request, start: int, num_tokens: int, taken_before: int
    ) -> int:
        num_tokens = then(request, start, num_tokens, taken_before)
        end = start + num_tokens
        if (
            request.num_computed_tokens == 0
            or -(-start // grid) >= -(-end // grid) - 2
            or not in_prefill(prefill_rule, request, start)
            or (checkpoint_at is not None and checkpoint_at(start, end) < 0)
        ):
            return num_tokens
        return (start // grid + 1) * grid - start

    return scratch_safe


def boundary_stops(
    scheduler: Scheduler,
    policy: StopPolicy,
    retention: Retention,
    checkpoint_at: CheckpointRule | None,
) -> BoundaryStop:
    """The policy's stops after vLLM's call, composed once at bind time."""
    if policy.mid_block_stop:
        stop = _keep_mid_block_stop(policy, retention, checkpoint_at)
    else:
        stop = _boundary_stop(scheduler, policy, retention, checkpoint_at)
    if policy.guard_scratch:
        return _scratch_safe(policy, checkpoint_at, stop)
    return stop


def state_grid_split(
    scheduler: Scheduler,
    stock: SplitFunction,
    policy: StopPolicy,
    retention: Retention,
    body: SplitBody,
) -> SplitFunction:
    """The fix for one scheduler, as a function with the split's own signature.

    ``stock`` is vLLM's unwrapped function (it takes the scheduler first). For the
    duration of each call the scheduler's own ``cache_config`` attribute points at
    a read-only view whose ``block_size`` is B, and is restored before the call
    returns. (A proxy of the whole scheduler would work too, but costs about 10 us
    per call in attribute look-ups.)
    """
    checkpoint_at = backend_checkpoint_rule(scheduler, stock, body, policy.grid)
    boundary_stop = boundary_stops(scheduler, policy, retention, checkpoint_at)
    return bind_route(
        lambda call: _routed(
            scheduler, call, policy, retention, boundary_stop, checkpoint_at
        ),
        stock,
        body.extra_parameter,
        body.past_prefill_shortcut,
    )


def _routed(
    scheduler: Scheduler,
    call: StockCall,
    policy: StopPolicy,
    retention: Retention,
    boundary_stop: BoundaryStop,
    checkpoint_at: CheckpointRule | None,
) -> Route:
    """The route, with lean's layer on top where the policy says so."""
    route = _route(scheduler, call, policy, boundary_stop)
    if policy.stock_chunk_ends:
        return _lean(scheduler, call, policy, retention, route, checkpoint_at)
    return route


def _lean(
    scheduler: Scheduler,
    call: StockCall,
    policy: StopPolicy,
    retention: Retention,
    kept_route: Route,
    checkpoint_at: CheckpointRule | None,
) -> Route:
    """:attr:`StopPolicy.stock_chunk_ends` (lean): a prefill chunk whose step
    allowance reaches no kept boundary gets vLLM's own answer on vLLM's own
    grid; from a start off that grid (after a stop at a kept boundary, where
    vLLM would add its stop after a mid-block start), vLLM's answer on B
    stretched back onto vLLM's grid as far as the allowance goes (nothing up
    to there is kept). One whose allowance reaches a kept boundary gets
    ``kept_route``'s answer (the backend's checkpoint standing in where it
    writes that state), ending on the boundary at the latest, unless vLLM's
    own chunk gives that boundary's column to the prompt checkpoint
    (:attr:`StopPolicy.yield_replay_to_checkpoint`). Every other call
    (decodes included) is ``kept_route``'s."""
    grid, prefill_rule, decisions = policy.grid, policy.prefill, checkpoint_decisions
    first_kept_after = _first_kept_without(retention, policy.without)
    ablation = _LeanAblation(policy, retention)
    yields = (
        _CheckpointYield(grid, retention, checkpoint_at)
        if policy.yield_replay_to_checkpoint and checkpoint_at is not None
        else None
    )
    on_vllms_grid = _on_vllms_grid(scheduler, call, grid)

    def lean(
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        counts = (
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )
        if num_new_tokens <= 1:
            return kept_route(request, *counts)
        start = (
            request.num_computed_tokens
            + num_new_local_computed_tokens
            + num_external_computed_tokens
        )
        if not in_prefill(prefill_rule, request, start):
            return kept_route(request, *counts)
        kept = first_kept_after(request, start)
        if kept is None or kept > start + num_new_tokens:
            num_tokens = on_vllms_grid(request, start, counts)
            return ablation.past_tail(request, start, num_new_tokens, num_tokens)
        if yields is not None and yields.may(request, start + num_new_tokens, kept):
            taken_before = decisions.taken
            num_tokens = on_vllms_grid(request, start, counts)
            if decisions.taken != taken_before and yields.does(
                start, start + num_tokens, request.num_prompt_tokens
            ):
                return num_tokens  # vLLM's own chunk: see _CheckpointYield
        num_tokens = kept_route(request, *counts)
        return num_tokens if start + num_tokens > kept else kept - start

    return lean


def _on_vllms_grid(
    scheduler: Scheduler, call: StockCall, grid: int
) -> Callable[[Request, int, tuple[int, ...]], int]:
    """vLLM's answer on its own grid (C) for a chunk from ``start``; from a
    start off that grid, its answer on B stretched back onto C's grid as far
    as the allowance (``counts[0]``) goes (lean only calls it where nothing
    up to there is kept)."""

    def on_vllms_grid(request: Request, start: int, counts: tuple[int, ...]) -> int:
        shared = scheduler.cache_config
        own = shared.block_size
        if start % own == 0:
            return int(call(scheduler, request, *counts))  # type: ignore[arg-type]
        scheduler.cache_config = _StateGridCacheConfig(shared, grid)
        try:
            num_tokens = int(call(scheduler, request, *counts))  # type: ignore[arg-type]
        finally:
            scheduler.cache_config = shared
        return max(num_tokens, (start + counts[0]) // own * own - start)

    return on_vllms_grid


class _CheckpointYield:
    """:attr:`StopPolicy.yield_replay_to_checkpoint`: whether vLLM's chunk
    ``[start, end)``, which vLLM decided to checkpoint internally, leaves
    ``kept`` (the first boundary kept after ``start``) to vLLM's own choice.

    It does when the chunk ends a fresh prompt (so the backend's state is the
    prompt checkpoint, which vLLM keys under its own hash), ``kept`` is the
    last boundary before that end (its column is the one the backend writes,
    ``cdiv(end, B) - 2``), the backend writes there at all, and ``kept`` is
    kept only as a replay boundary: a junction a sibling shares, or a
    multiple of the retention interval, keeps its stop. :meth:`may` asks what
    is known before vLLM's own answer, so a chunk that cannot end the prompt
    costs no second call of vLLM's split; :meth:`does` the rest.

    Backports nothing: vLLM PR #54076 stops at every boundary; this is lean's
    own relaxation, where stock vLLM already gives the boundary up.
    """

    def __init__(
        self, grid: int, retention: Retention, checkpoint_at: CheckpointRule
    ) -> None:
        self.grid, self.retention, self.checkpoint_at = grid, retention, checkpoint_at

    def may(self, request: Request, reach: int, kept: int) -> bool:
        """Whether a chunk reaching up to ``reach`` could yield ``kept``."""
        prompt = request.num_prompt_tokens
        return (
            reach >= prompt
            and prefill_end(request) == prompt
            and kept < prompt <= kept + self.grid
            and self.retention.kept_only_as_replay(request, kept)
        )

    def does(self, start: int, end: int, prompt: int) -> bool:
        """Whether vLLM's chunk ``[start, end)`` ends the prompt with the
        backend's write in it (after :meth:`may`)."""
        return end == prompt and self.checkpoint_at(start, end) > 0


class _LeanAblation:
    """:attr:`StopPolicy.without` (benchmark only; empty when serving, where
    the check costs one attribute test): lean's stops that are not about
    which boundary is kept (those: :func:`_first_kept_without`)."""

    def __init__(self, policy: StopPolicy, retention: Retention) -> None:
        self.grid, self.retention = policy.grid, retention
        self.tail = LeanStop.TAIL in policy.without

    def past_tail(
        self, request: Request, start: int, num_new_tokens: int, num_tokens: int
    ) -> int:
        """vLLM's answer, run on to the prefill end where it stops at the
        prompt's partial tail after a stop at a kept boundary (when the tail
        stop is left out)."""
        ends_at = prefill_end(request)
        if (
            self.tail
            and start % self.grid == 0
            and self.retention.keeps(request, start)
            and start + num_tokens < ends_at <= start + num_new_tokens
        ):
            return ends_at - start
        return num_tokens


def _first_kept_without(
    retention: Retention, without: frozenset[LeanStop]
) -> Callable[[Request, int], int | None]:
    """:meth:`Retention.first_kept_after`, blind to the replay boundaries or
    the junctions when :attr:`StopPolicy.without` (benchmark only) says so."""
    blind_replay = LeanStop.REPLAY in without
    blind_junction = LeanStop.JUNCTION in without
    if not (blind_replay or blind_junction) or retention.dense:
        return retention.first_kept_after
    interval = retention.interval

    def first_kept_after(request: Request, start: int) -> int | None:
        replay = set(retention.replay_boundaries(request))
        candidates = [
            boundary
            for boundary in retention.reachable(request)
            if boundary > start
            and not (blind_replay if boundary in replay else blind_junction)
        ]
        if interval:
            candidates.append((start // interval + 1) * interval)
        return min(candidates, default=None)

    return first_kept_after


def _route(
    scheduler: Scheduler,
    call: StockCall,
    policy: StopPolicy,
    boundary_stop: BoundaryStop,
) -> Route:
    """vLLM's call on the B-grid view, then the policy's stops."""
    grid, observed, any_stop = policy.grid, policy.watch_decisions, policy.any_stop
    align_short_chunks, decisions = policy.align_short_chunks, checkpoint_decisions
    view = _StateGridCacheConfig(scheduler.cache_config, grid)
    falls_short = _falls_short(scheduler, policy)

    def split(
        request: Request,
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
            num_tokens = call(
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

    return split
