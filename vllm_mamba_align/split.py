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

Read top-down: the entry (:func:`state_grid_split`), the route every call takes
(:func:`kept_route`: vLLM's call on the B-grid view, then the policy's stops),
lean's rule on top of it (:func:`lean_route`), then the stops. The split runs
for every running request at every step (decodes included), so each route is
a plain closure bound to one scheduler: no wrapper layers, no argument
packing, a few integer operations on top of vLLM's own call. The route is
bound with the installed method's parameters, four or five (signature.py), and
carries vLLM's ``__name__``, ``__qualname__``, ``__doc__`` and ``__wrapped__``.

:func:`kept_route` and :func:`lean_route` are public pieces: lean's rule reads
which boundaries are kept from the :class:`retention.Retention` it is given, and
:func:`state_grid_split` looks ``lean_route`` up when it binds a scheduler, so
code outside the serving path can compose a changed lean from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .checkpoints import (
    CheckpointRule,
    backend_checkpoint_rule,
    checkpoint_decisions,
    checkpoint_groups_agree,
)
from .policy import StopPolicy
from .protocols import CacheConfig, Request, Scheduler
from .releases import SplitBody, chunk_start, in_prefill, prefill_end
from .retention import Retention
from .signature import Route, SplitFunction, StockCall, bind_route

BoundaryStop = Callable[[Request, int, int, int], int]
"""(request, chunk start, vLLM's token count, decisions before the call) -> the
token count, stopped where the policy says."""


# -- the entry ----------------------------------------------------------------------


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
    stop = boundary_stops(scheduler, policy, retention, checkpoint_at)

    def route(call: StockCall) -> Route:
        kept = kept_route(scheduler, call, policy, stop)
        if policy.stock_chunk_ends:
            kept = lean_route(scheduler, call, policy, retention, kept, checkpoint_at)
        return clear_of_lookahead(scheduler, policy, kept)

    return bind_route(route, stock, body.extra_parameter, body.past_prefill_shortcut)


# -- the route ----------------------------------------------------------------------


def kept_route(
    scheduler: Scheduler,
    call: StockCall,
    policy: StopPolicy,
    boundary_stop: BoundaryStop,
) -> Route:
    """vLLM's call on the B-grid view, then the policy's stops (every fixing
    mode; lean's rule sits on top of it)."""
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
        # The chunk start, only where something reads it: not on every call.
        start = None
        if align_short_chunks:
            start = chunk_start(
                request, num_new_local_computed_tokens, num_external_computed_tokens
            )
            if falls_short(request, start, num_new_tokens):
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
        if start is None:
            start = chunk_start(
                request, num_new_local_computed_tokens, num_external_computed_tokens
            )
        return boundary_stop(request, start, num_tokens, taken_before)

    return split


def clear_of_lookahead(scheduler: Scheduler, policy: StopPolicy, route: Route) -> Route:
    """``route``, except near a request's end under a multi-module MTP drafter.

    With k MTP modules vLLM never lets a prefill chunk end fewer than k tokens
    before the request's end: after the split it cuts such a chunk back to k
    tokens before the end (``_reserve_prefill_lookahead``, scheduler.py:695-714
    in 0.34.0, :678-697 in 0.33.0). Where the request's last B boundary K lies
    in that window, K can never be a chunk end, and a chunk that ends inside
    K's block (after L = K - B) leaves the next one to start there mid-block:
    stopped at K it is cut to nothing, and the request never finishes its
    prefill; run across K, it fills the start's block, which vLLM then
    publishes as K's state while it holds the state at the start. (k = 3,
    B = 64, C = 16, a 129-token prompt: a stop at 128 is cut to 126 and
    126 -> 128 to 0; vLLM's own chunks 0 -> 112 -> 129 publish the state at
    112 as 128's.) So a prefill chunk that would end inside K's block ends at
    L if it starts below L, and runs to vLLM's allowance from L (K's column
    stays empty: K's state is written in no mode, by vLLM's rule). A chunk
    that starts inside K's block (a prefix hit there, such as a backend's
    prompt checkpoint at 112) keeps the route's answer: vLLM stalls it, as it
    does without the plugin; running it across K would publish a wrong state.
    Without such a drafter (k <= 1) ``route`` is returned as it is."""
    lookahead = int(getattr(scheduler, "num_prefill_lookahead", 0) or 0)
    if lookahead <= 1:
        return route
    grid, prefill_rule = policy.grid, policy.prefill

    def split(
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        num_tokens = route(
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )
        if num_tokens <= 0:
            return num_tokens
        start = chunk_start(
            request, num_new_local_computed_tokens, num_external_computed_tokens
        )
        end, total = start + num_tokens, request.num_tokens
        if end >= total or end <= total - grid - lookahead:
            return num_tokens  # the request's end, or far from it
        last = (total - 1) // grid * grid  # K, the request's last boundary
        floor = last - grid  # L
        if total - last >= lookahead or last <= start or end <= floor:
            return num_tokens
        if not in_prefill(prefill_rule, request, start):
            return num_tokens
        if start < floor:
            return floor - start
        # From L, K's column is a fresh block: run on. From inside K's block (a
        # prefix hit there, e.g. a backend's prompt checkpoint) any chunk across
        # K publishes the start's state as K's: left to vLLM, which stalls it.
        return num_new_tokens if start == floor else num_tokens

    return split


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


# -- lean's rule --------------------------------------------------------------------


def lean_route(
    scheduler: Scheduler,
    call: StockCall,
    policy: StopPolicy,
    retention: Retention,
    kept: Route,
    checkpoint_at: CheckpointRule | None,
) -> Route:
    """lean (:attr:`StopPolicy.stock_chunk_ends`): vLLM's chunk ends, a stop at
    every boundary ``retention`` keeps, one call of vLLM's split per chunk.

    A prefill chunk reaching no kept boundary gets vLLM's answer on C
    (:func:`_on_vllms_grid`); a prefill's last chunk from a kept boundary, on B
    (PR #54076): vLLM's last-cacheable stop on C lies inside the B block that
    boundary opens, where nothing is published (on B it is the boundary, or
    with EAGLE's back-off the one before). One reaching a kept boundary gets
    ``kept``'s answer, ending there at the latest, unless vLLM's own chunk
    yields the boundary's column to the prompt checkpoint
    (:class:`_CheckpointYield`; if not, it stops there without asking vLLM
    again). Other calls (decodes) are ``kept``'s."""
    prefill_rule, decisions = policy.prefill, checkpoint_decisions
    first_kept_after = retention.first_kept_after
    last_from_kept = _last_chunk_from_kept(policy.grid, retention)
    yields = (
        _CheckpointYield(policy.grid, retention, checkpoint_at, stays_whole(scheduler))
        if policy.yield_replay_to_checkpoint and checkpoint_at is not None
        else None
    )
    on_vllms_grid = _on_vllms_grid(scheduler, call, policy.grid)

    def lean(
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        local, external = num_new_local_computed_tokens, num_external_computed_tokens
        counts = (num_new_tokens, local, external)
        if num_new_tokens <= 1:
            return kept(request, *counts)
        start = chunk_start(request, local, external)
        if not in_prefill(prefill_rule, request, start):
            return kept(request, *counts)
        reach = start + num_new_tokens
        boundary = first_kept_after(request, start)
        if boundary is None or boundary > reach:  # nothing kept in reach
            last = last_from_kept(request, start, reach)  # then on B
            return on_vllms_grid(request, start, counts, last)
        if yields is not None and yields.may(request, reach, boundary):
            taken_before = decisions.taken
            num_tokens = on_vllms_grid(request, start, counts, False)
            if decisions.taken != taken_before and yields.does(
                request, start, start + num_tokens
            ):
                return num_tokens  # vLLM's own chunk: see _CheckpointYield
            # kept's stop (kept runs past the boundary only where the backend
            # writes its state in the chunk: a stop there loses nothing).
            return boundary - start
        num_tokens = kept(request, *counts)
        return num_tokens if start + num_tokens > boundary else boundary - start

    return lean


def _last_chunk_from_kept(
    grid: int, retention: Retention
) -> Callable[[Request, int, int], bool]:
    """Whether a prefill chunk from ``start`` reaching ``reach`` is the
    prefill's last and starts on a boundary ``retention`` keeps."""

    def last_from_kept(request: Request, start: int, reach: int) -> bool:
        return bool(
            start > 0
            and start % grid == 0
            and reach >= prefill_end(request)
            and retention.keeps(request, start)
        )

    return last_from_kept


def _on_vllms_grid(
    scheduler: Scheduler, call: StockCall, grid: int
) -> Callable[[Request, int, tuple[int, ...], bool], int]:
    """vLLM's answer on its own grid (C) for a chunk from ``start``; from a
    start off that grid (after a stop at a kept boundary, where vLLM would add
    its stop after a mid-block start), its answer on B stretched back onto C's
    grid as far as the allowance (``counts[0]``) goes (lean only calls it where
    nothing up to there is kept); with ``on_state_grid``, its answer on B as
    it stands (a prefill's last chunk, which no grid floors)."""

    def on_vllms_grid(
        request: Request, start: int, counts: tuple[int, ...], on_state_grid: bool
    ) -> int:
        shared = scheduler.cache_config
        own = shared.block_size
        if start % own == 0 and not on_state_grid:
            return int(call(scheduler, request, *counts))  # type: ignore[arg-type]
        scheduler.cache_config = _StateGridCacheConfig(shared, grid)
        try:
            num_tokens = int(call(scheduler, request, *counts))  # type: ignore[arg-type]
        finally:
            scheduler.cache_config = shared
        if on_state_grid:
            return num_tokens
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
        self,
        grid: int,
        retention: Retention,
        checkpoint_at: CheckpointRule,
        whole: Callable[[Request, int, int], bool],
    ) -> None:
        self.grid, self.retention, self.checkpoint_at = grid, retention, checkpoint_at
        self.whole = whole

    def may(self, request: Request, reach: int, kept: int) -> bool:
        """Whether a chunk reaching up to ``reach`` could yield ``kept``."""
        prompt = request.num_prompt_tokens
        return (
            reach >= prompt
            and prefill_end(request) == prompt
            and kept < prompt <= kept + self.grid
            and self.retention.kept_only_as_replay(request, kept)
        )

    def does(self, request: Request, start: int, end: int) -> bool:
        """Whether vLLM's chunk ``[start, end)`` ends the prompt with the
        backend's write in it, and stays whole after the split
        (:func:`stays_whole`; after :meth:`may`)."""
        return (
            end == request.num_prompt_tokens
            and self.checkpoint_at(start, end) > 0
            and self.whole(request, start, end)
        )


# -- the stops ----------------------------------------------------------------------


def boundary_stops(
    scheduler: Scheduler,
    policy: StopPolicy,
    retention: Retention,
    checkpoint_at: CheckpointRule | None,
) -> BoundaryStop:
    """The policy's stops after vLLM's call, composed once at bind time."""
    if policy.mid_block_stop:
        stop = _keep_mid_block_stop(scheduler, policy, retention, checkpoint_at)
    else:
        stop = _boundary_stop(scheduler, policy, retention, checkpoint_at)
    if policy.guard_scratch:
        # Each manager skips the move in a step its own group checkpoints:
        # where the groups' facts differ, any step may be one (rule unknown).
        agree = checkpoint_groups_agree(scheduler)
        return _scratch_safe(policy, checkpoint_at if agree else None, stop)
    return stop


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
    grid, prefill_rule = policy.grid, policy.prefill
    guard_unwritten = policy.guard_unwritten
    stop_at_boundaries, stop_anywhere = policy.stop_at_boundaries, policy.stop_anywhere
    mid_block_stop_missing = policy.mid_block_stop_missing
    kept_after = retention.first_kept_after
    leaves_unwritten = _leaves_unwritten(grid, checkpoint_at)
    checkpoint_stands_in = _checkpoint_stands_in(
        scheduler, policy, retention, checkpoint_at
    )

    def stop(request: Request, start: int, num_tokens: int, taken_before: int) -> int:
        next_boundary = (start // grid + 1) * grid
        end = start + num_tokens
        if next_boundary >= end:
            return num_tokens  # the chunk crosses no boundary: nothing to stop
        if not in_prefill(prefill_rule, request, start):
            return num_tokens  # not a prefill chunk
        if guard_unwritten and leaves_unwritten(start, end):
            end = end // grid * grid
            num_tokens = end - start
            if next_boundary == end:
                return num_tokens
        if not stop_at_boundaries:
            if mid_block_stop_missing and start % grid:
                return next_boundary - start
            return num_tokens
        if checkpoint_stands_in(request, start, end, taken_before):
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


def _leaves_unwritten(
    grid: int, checkpoint_at: CheckpointRule | None
) -> Callable[[int, int], bool]:
    """:attr:`StopPolicy.guard_unwritten`: whether 0.29.0's flashkda backend
    would leave the state of a chunk ``[start, end)`` from a boundary to a
    mid-block end unwritten."""

    def leaves_unwritten(start: int, end: int) -> bool:
        return bool(
            end % grid
            and start % grid == 0
            and checkpoint_at is not None
            and checkpoint_at(start, end) < 0
        )

    return leaves_unwritten


def stays_whole(scheduler: Scheduler) -> Callable[[Request, int, int], bool]:
    """Whether vLLM leaves a chunk ``[start, end)`` the split answered whole.

    After the split, vLLM's scheduler may still cut a chunk (scheduler.py
    :877-905 in 0.34.0, :861-889 in 0.33.0): the multi-module MTP lookahead
    reserve ends it ``num_prefill_lookahead`` tokens short of the request's
    end when fewer would remain (``_reserve_prefill_lookahead``); an encoder
    input the step cannot encode ends it just before the input's first token
    (``_try_schedule_encoder_inputs``; the step's encoder budget is not known
    to the split, so every input that starts inside the chunk counts). A cut
    chunk is no longer final: vLLM checkpoints nothing inside it, so a stop
    the fix leaves to the backend's in-chunk state would lose the boundary.
    """
    lookahead = int(getattr(scheduler, "num_prefill_lookahead", 0) or 0)

    def whole(request: Request, start: int, end: int) -> bool:
        if 0 < request.num_tokens - end < lookahead:
            return False
        for feature in getattr(request, "mm_features", None) or ():
            if start < feature.mm_position.offset < end:
                return False
        return True

    return whole


def _checkpoint_stands_in(
    scheduler: Scheduler,
    policy: StopPolicy,
    retention: Retention,
    checkpoint_at: CheckpointRule | None,
) -> Callable[[Request, int, int, int], bool]:
    """Whether the backend's in-chunk checkpoint writes the one state a stop
    would: the chunk ``[start, end)`` ends the prefill, vLLM checkpoints it
    internally, and the state the backend writes (the prompt's partial tail)
    is the first boundary after ``start`` (lean: the first kept) and the last
    before the end (a state at a later one would need a 2-block chunk), and
    vLLM does not cut the chunk after the split (:func:`stays_whole`)."""
    grid, observed, lean = policy.grid, policy.watch_decisions, policy.stock_chunk_ends
    decisions, kept_after = checkpoint_decisions, retention.first_kept_after
    whole = stays_whole(scheduler)

    def vllm_checkpoints(start: int, taken_before: int) -> bool:
        """Whether vLLM checkpoints this chunk internally: seen in its decision
        count (0.30.0+), else its flag and an aligned start (0.29.0)."""
        if observed:
            return decisions.taken != taken_before
        return bool(scheduler.mamba_has_prefill_checkpoint_blocks and start % grid == 0)

    def stands_in(request: Request, start: int, end: int, taken_before: int) -> bool:
        if checkpoint_at is None or not vllm_checkpoints(start, taken_before):
            return False
        if end < prefill_end(request):
            return False
        # asked last: lean's first kept boundary costs a walk of them all
        boundary = kept_after(request, start) if lean else (start // grid + 1) * grid
        return (
            boundary is not None
            and end < boundary + grid
            and checkpoint_at(start, end) == boundary
            and whole(request, start, end)
        )

    return stands_in


def _keep_mid_block_stop(
    scheduler: Scheduler,
    policy: StopPolicy,
    retention: Retention,
    checkpoint_at: CheckpointRule | None,
) -> BoundaryStop:
    """:attr:`StopPolicy.mid_block_stop` (grid, on the
    :attr:`InternalCheckpoint.OBSERVED` bodies, 0.30.0+): vLLM's answer, with its
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
    whole = stays_whole(scheduler)

    def writes_boundary(request: Request, start: int, end: int, boundary: int) -> bool:
        """Whether the backend writes ``boundary``'s state in the start's block:
        the chunk ends the prefill within one block past the boundary, and the
        checkpoint lands on it."""
        return (
            checkpoint_at is not None
            and end >= prefill_end(request)
            and end <= boundary + grid
            and checkpoint_at(start, end) == boundary
            and whole(request, start, end)
        )

    def keep_mid_block_stop(
        request: Request, start: int, num_tokens: int, taken_before: int
    ) -> int:
        if start % grid == 0 or decisions.taken == taken_before:
            return num_tokens  # an aligned start, or vLLM kept its stop
        next_boundary = (start // grid + 1) * grid
        end = start + num_tokens
        if next_boundary >= end:
            return num_tokens
        if writes_boundary(request, start, end, next_boundary):
            return num_tokens
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

    def scratch_in_interior(request: Request, start: int, end: int) -> bool:
        """Whether a running request's scratch blocks stand in an interior
        boundary's column of a prefill chunk the backend checkpoints."""
        return (
            request.num_computed_tokens != 0
            and -(-start // grid) < -(-end // grid) - 2
            and in_prefill(prefill_rule, request, start)
            and (checkpoint_at is None or checkpoint_at(start, end) >= 0)
        )

    def scratch_safe(
        request: Request, start: int, num_tokens: int, taken_before: int
    ) -> int:
        num_tokens = then(request, start, num_tokens, taken_before)
        if not scratch_in_interior(request, start, start + num_tokens):
            return num_tokens
        return (start // grid + 1) * grid - start

    return scratch_safe
