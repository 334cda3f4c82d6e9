"""The split's route: vLLM's own algorithm on the Mamba state grid, plus stops.

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

Read top to bottom, as a call goes: the entry (:func:`state_grid_split`, once
per scheduler) and the record it builds (:class:`Fix`); the shortcuts for
decodes (:func:`bind_route`: the one closure bound to a scheduler); the route
(:func:`route`); lean's rule (:func:`lean`); the B-grid route
(:func:`b_grid_route`: vLLM's call on the B-grid view, then the stops); the
stops, each commented where it happens; the count of vLLM's checkpoint
decisions the stops read. vLLM calls the split for every running request at
every step, decodes included: a decode is answered by the closure's own two
comparisons, and everything else is a plain function reading the scheduler's
one frozen record.

The split's signature: ``(self, request, num_new_tokens,
num_new_local_computed_tokens=0, num_external_computed_tokens=0)`` in every
release; 0.24.0-0.25.1 add ``num_uncached_common_prefix_tokens=0``
(``SplitBody.extra_parameter``). Both callers in ``Scheduler.schedule()`` pass
positional arguments. A route is written with the four common parameters; the
closure has exactly the installed method's, and hands a fifth argument on to
vLLM's call (:class:`FifthArgument`). The closure carries vLLM's ``__name__``,
``__qualname__``, ``__doc__``, ``__wrapped__`` and signature.

The audit's observer (audit/) is bound the same way (:func:`bind_route`,
:func:`call_vllm`) and reads nothing else of this module. Code outside the
serving path composes a changed lean by replacing :func:`lean`, which
:func:`route` looks up on each call (benchmarks/ablation.py).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .checkpoints import (
    CheckpointRule,
    backend_checkpoint_rule,
    checkpoint_groups_agree,
)
from .policy import StopPolicy
from .releases import PrefillRule, SplitBody, chunk_start, in_prefill, prefill_end
from .retention import Retention

if TYPE_CHECKING:
    from .protocols import CacheConfig, Request, Scheduler

SplitFunction = Callable[..., int]
"""``_mamba_block_aligned_split`` as bound to one scheduler (no ``self``)."""


# -- the entry -----------------------------------------------------------------------


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
    grid = policy.grid
    checkpoint_at = backend_checkpoint_rule(scheduler, stock, body, grid)
    agree = policy.guard_scratch and checkpoint_groups_agree(scheduler)
    fix = Fix(
        scheduler=scheduler,
        stock=stock,
        fifth=fifth_argument(body),
        policy=policy,
        retention=retention,
        checkpoint_at=checkpoint_at,
        scratch_checkpoint_at=checkpoint_at if agree else None,
        lookahead=int(getattr(scheduler, "num_prefill_lookahead", 0) or 0),
        b_grid_view=_StateGridCacheConfig(scheduler.cache_config, grid),
        any_stop=policy.any_stop,
    )
    return bind_route(route, fix, body.past_prefill_shortcut)


# -- one scheduler's record ----------------------------------------------------------


class FifthArgument(threading.local):
    """0.24.0-0.25.1: the fifth argument of the split call in progress, on this
    thread, for :func:`call_vllm` to hand on to vLLM's function."""

    value: Any = 0


def fifth_argument(body: SplitBody) -> FifthArgument | None:
    """A holder of the fifth argument where the body has one."""
    return None if body.extra_parameter is None else FifthArgument()


class Bound(Protocol):
    """What :func:`bind_route` and :func:`call_vllm` read of a route's record."""

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def stock(self) -> SplitFunction: ...

    @property
    def fifth(self) -> FifthArgument | None: ...


@dataclass(frozen=True, eq=False)
class Fix:
    """What the route reads of one scheduler, taken once at bind time."""

    scheduler: Scheduler
    stock: SplitFunction
    """vLLM's function (it takes the scheduler first)."""
    fifth: FifthArgument | None
    policy: StopPolicy
    retention: Retention
    """Which boundaries vLLM keeps: the next kept boundary is its answer."""
    checkpoint_at: CheckpointRule | None
    """Where the backend writes its in-chunk state (None: no rule known)."""
    scratch_checkpoint_at: CheckpointRule | None
    """For :attr:`StopPolicy.guard_scratch`: :attr:`checkpoint_at` where every
    Mamba group checkpoints by the same facts, else None (each manager skips
    the move in a step its own group checkpoints: any step may be one)."""
    lookahead: int
    """vLLM's ``num_prefill_lookahead`` (multi-module MTP), 0 without."""
    b_grid_view: _StateGridCacheConfig
    """The B-grid view of the cache config the scheduler started with."""
    any_stop: bool
    """:attr:`StopPolicy.any_stop`, read once."""


# -- the shortcuts for decodes: the one closure per scheduler ------------------------

Route = Callable[[Any, "Request", int, int, int], int]
"""A plain function: (record, request, num_new_tokens,
num_new_local_computed_tokens, num_external_computed_tokens) -> token count."""


def bind_route(
    route: Route, bound: Bound, shortcut: PrefillRule | None
) -> SplitFunction:
    """``route`` over ``bound``, as one closure with the installed method's
    parameters, behind the past-prefill shortcut of the body's prefill rule
    (:attr:`releases.SplitBody.past_prefill_shortcut`; None: no shortcut), and
    presented as vLLM's method (:func:`present_as`).

    The shortcut: nearly every split call is a decode, for which every
    released body answers ``num_new_tokens`` unchanged (it splits prefill
    chunks only; 0.15.0-0.22.1 after asserting that no external tokens came
    with it: any call with external tokens goes to the route, so that
    assertion still speaks). The test is the body's own
    (:func:`releases.in_prefill`), written out in the closure because it runs
    for every running request at every step: two comparisons, no call.
    ``tests/test_decode_shortcut.py`` holds its answer equal to the route's.
    """
    if bound.fifth is not None:
        assert shortcut is not PrefillRule.NO_OUTPUT_YET, "no five-parameter body"
        split = _five_parameters(route, bound, shortcut is not None)
    elif shortcut is PrefillRule.NO_OUTPUT_YET:
        split = _no_output_yet(route, bound)
    elif shortcut is PrefillRule.BEFORE_PREFILL_END:
        split = _before_prefill_end(route, bound)
    else:
        split = _every_call(route, bound)
    return present_as(split, bound.stock)


def _no_output_yet(route: Route, bound: Bound) -> SplitFunction:
    """:data:`PrefillRule.NO_OUTPUT_YET` (0.15.0-0.16.0, four parameters)."""

    def no_output_yet(
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        if request.num_output_tokens and not num_external_computed_tokens:
            return num_new_tokens
        return route(
            bound,
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )

    return no_output_yet


def _before_prefill_end(route: Route, bound: Bound) -> SplitFunction:
    """:data:`PrefillRule.BEFORE_PREFILL_END` (0.17.0+), four parameters."""

    def before_prefill_end(
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        if not num_external_computed_tokens:
            start = request.num_computed_tokens + num_new_local_computed_tokens
            if start >= request.num_prompt_tokens and start >= request.num_tokens - 1:
                return num_new_tokens
        return route(
            bound,
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )

    return before_prefill_end


def _every_call(route: Route, bound: Bound) -> SplitFunction:
    """No shortcut (opted-in unverified code: nobody has read what it answers
    past the prefill), four parameters."""

    def every_call(
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        return route(
            bound,
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )

    return every_call


def _five_parameters(route: Route, bound: Bound, shortcut: bool) -> SplitFunction:
    """The five parameters of a body with ``SplitBody.extra_parameter``: the
    fifth argument goes to vLLM's call unchanged, and its default is vLLM's
    own (0). With ``shortcut``, :data:`PrefillRule.BEFORE_PREFILL_END`'s
    test stands in front (the one rule of such bodies)."""

    def split_with_prefix_tokens(
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        num_uncached_common_prefix_tokens: int = 0,
    ) -> int:
        if shortcut and not num_external_computed_tokens:
            start = request.num_computed_tokens + num_new_local_computed_tokens
            if start >= request.num_prompt_tokens and start >= request.num_tokens - 1:
                return num_new_tokens
        bound.fifth.value = num_uncached_common_prefix_tokens  # type: ignore[union-attr]
        return route(
            bound,
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )

    return split_with_prefix_tokens


def present_as(split: SplitFunction, stock: SplitFunction) -> SplitFunction:
    """Give a bound route vLLM's method's identity, once, at bind time.

    ``__name__``, ``__qualname__``, ``__doc__``, ``__module__`` and
    ``__wrapped__`` (``stock``, vLLM's own function) are copied, and the
    signature is vLLM's without ``self``, so tracebacks, profilers and
    ``inspect`` see vLLM's method. The closure takes its parameters as plain
    positional ones (a ``*rest`` parameter would cost about 70 ns per call, on
    every request at every step).
    """
    functools.update_wrapper(split, stock)
    signature = inspect.signature(stock)
    split.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=tuple(signature.parameters.values())[1:]
    )
    return split


def call_vllm(
    bound: Bound, request: Request, new: int, local: int, external: int
) -> int:
    """vLLM's function, called on ``bound``'s scheduler with the four common
    arguments (and the fifth of the call in progress, where the body has one)."""
    if bound.fifth is None:
        return bound.stock(bound.scheduler, request, new, local, external)
    fifth = bound.fifth.value
    return bound.stock(bound.scheduler, request, new, local, external, fifth)


# -- the route -----------------------------------------------------------------------


def route(fix: Fix, request: Request, new: int, local: int, external: int) -> int:
    """Every call the shortcut leaves to the fix: lean's rule where the policy
    keeps vLLM's chunk ends, else the B-grid route; then clear of a
    multi-module MTP drafter's lookahead."""
    if fix.policy.stock_chunk_ends:
        num_tokens = lean(fix, request, new, local, external)
    else:
        num_tokens = b_grid_route(fix, request, new, local, external)
    if fix.lookahead <= 1:
        return num_tokens
    return clear_of_lookahead(fix, request, num_tokens, new, local, external)


def on_state_grid(
    fix: Fix, request: Request, new: int, local: int, external: int
) -> int:
    """vLLM's answer on B: its call with the scheduler's own ``cache_config``
    pointing at the B-grid view, restored in ``finally``."""
    scheduler = fix.scheduler
    shared = scheduler.cache_config
    view = fix.b_grid_view
    if view.shared is not shared:  # replaced since the scheduler started
        view = _StateGridCacheConfig(shared, fix.policy.grid)
    scheduler.cache_config = view
    try:
        return call_vllm(fix, request, new, local, external)
    finally:
        scheduler.cache_config = shared


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


# -- lean's rule ---------------------------------------------------------------------


def lean(fix: Fix, request: Request, new: int, local: int, external: int) -> int:
    """lean (:attr:`StopPolicy.stock_chunk_ends`): vLLM's chunk ends, a stop at
    every boundary vLLM keeps, one call of vLLM's split per chunk.

    A prefill chunk reaching no kept boundary gets vLLM's answer on C
    (:func:`on_vllms_grid`); a prefill's last chunk from a kept boundary, on B
    (PR #54076): vLLM's last-cacheable stop on C lies inside the B block that
    boundary opens, where nothing is published (on B it is the boundary, or
    with EAGLE's back-off the one before). One reaching the next kept boundary
    gets the B-grid route's answer, ending there at the latest, unless vLLM's
    own chunk yields that boundary's column to the prompt checkpoint
    (:func:`_may_yield`; if not, it stops there without asking vLLM again).
    Other calls (decodes) are the B-grid route's."""
    if new <= 1:
        return b_grid_route(fix, request, new, local, external)
    start = chunk_start(request, local, external)
    if not in_prefill(fix.policy.prefill, request, start):
        return b_grid_route(fix, request, new, local, external)
    reach = start + new
    next_kept = fix.retention.first_kept_after(request, start)
    if next_kept is None or next_kept > reach:
        # No kept boundary in reach: vLLM's own chunk (on B for a prefill's
        # last chunk from a kept boundary).
        last_from_kept = _last_chunk_from_kept(fix, request, start, reach)
        return on_vllms_grid(fix, request, start, new, local, external, last_from_kept)
    if _may_yield(fix, request, reach, next_kept):
        taken_before = checkpoint_decisions.taken
        num_tokens = on_vllms_grid(fix, request, start, new, local, external, False)
        if checkpoint_decisions.taken != taken_before and _does_yield(
            fix, request, start, start + num_tokens
        ):
            return num_tokens  # vLLM's own chunk: the column is the checkpoint's
        # The B-grid route's stop (it runs past the boundary only where the
        # backend writes its state in the chunk: a stop there loses nothing).
        return next_kept - start
    num_tokens = b_grid_route(fix, request, new, local, external)
    return num_tokens if start + num_tokens > next_kept else next_kept - start


def _last_chunk_from_kept(fix: Fix, request: Request, start: int, reach: int) -> bool:
    """Whether a prefill chunk from ``start`` reaching ``reach`` is the
    prefill's last and starts on a boundary vLLM keeps."""
    return bool(
        start > 0
        and start % fix.policy.grid == 0
        and reach >= prefill_end(request)
        and fix.retention.keeps(request, start)
    )


def on_vllms_grid(
    fix: Fix,
    request: Request,
    start: int,
    new: int,
    local: int,
    external: int,
    state_grid: bool,
) -> int:
    """vLLM's answer on its own grid (C) for a chunk from ``start``; from a
    start off that grid (after a stop at a kept boundary, where vLLM would add
    its stop after a mid-block start), its answer on B stretched back onto C's
    grid as far as the allowance (``new``) goes (lean only calls it where
    nothing up to there is kept); with ``state_grid``, its answer on B as it
    stands (a prefill's last chunk, which no grid floors)."""
    own = fix.scheduler.cache_config.block_size
    if start % own == 0 and not state_grid:
        return int(call_vllm(fix, request, new, local, external))
    num_tokens = int(on_state_grid(fix, request, new, local, external))
    if state_grid:
        return num_tokens
    return max(num_tokens, (start + new) // own * own - start)


def _may_yield(fix: Fix, request: Request, reach: int, next_kept: int) -> bool:
    """:attr:`StopPolicy.yield_replay_to_checkpoint`, before vLLM's answer:
    whether a chunk reaching up to ``reach`` could leave ``next_kept`` to
    vLLM's own choice (so a chunk that cannot end the prompt costs no second
    call of vLLM's split).

    It can when the chunk may end a fresh prompt (so the backend's state is
    the prompt checkpoint, which vLLM keys under its own hash), ``next_kept``
    is the last boundary before that end (its column is the one the backend
    writes, ``cdiv(end, B) - 2``), and it is kept only as a replay boundary:
    a junction a sibling shares, or a multiple of the retention interval,
    keeps its stop. Backports nothing: vLLM PR #54076 stops at every
    boundary; this is lean's own relaxation, where stock vLLM already gives
    the boundary up."""
    if not fix.policy.yield_replay_to_checkpoint or fix.checkpoint_at is None:
        return False
    prompt = request.num_prompt_tokens
    return (
        reach >= prompt
        and prefill_end(request) == prompt
        and next_kept < prompt <= next_kept + fix.policy.grid
        and fix.retention.kept_only_as_replay(request, next_kept)
    )


def _does_yield(fix: Fix, request: Request, start: int, end: int) -> bool:
    """After :func:`_may_yield` and vLLM's decision to checkpoint the chunk:
    whether vLLM's chunk ``[start, end)`` ends the prompt with the backend's
    write in it, and stays whole after the split (:func:`stays_whole`)."""
    return (
        end == request.num_prompt_tokens
        and fix.checkpoint_at is not None
        and fix.checkpoint_at(start, end) > 0
        and stays_whole(fix, request, start, end)
    )


# -- the B-grid route ----------------------------------------------------------------


def b_grid_route(
    fix: Fix, request: Request, new: int, local: int, external: int
) -> int:
    """vLLM's call on the B-grid view, then the policy's stops (every fixing
    mode; lean's rule sits on top of it)."""
    policy = fix.policy
    # The chunk start, only where something reads it: not on every call.
    start = None
    if policy.align_short_chunks:
        start = chunk_start(request, local, external)
        # A chunk from a boundary squeezed short of the next one: none this step.
        if _falls_short(fix, request, start, new):
            return 0
    # Only a chunk of two or more tokens can cross a boundary (decodes can't).
    observed = policy.watch_decisions and new > 1
    taken_before = checkpoint_decisions.taken if observed else 0
    num_tokens = on_state_grid(fix, request, new, local, external)
    if num_tokens <= 1 or not fix.any_stop:
        return num_tokens
    if start is None:
        start = chunk_start(request, local, external)
    return stops(fix, request, start, num_tokens, taken_before)


# -- the stops -----------------------------------------------------------------------


def stops(
    fix: Fix, request: Request, start: int, num_tokens: int, taken_before: int
) -> int:
    """vLLM's answer ``num_tokens`` for a chunk from ``start`` after the
    policy's stops (``taken_before``: vLLM's decision count before its call)."""
    policy = fix.policy
    if policy.mid_block_stop:
        num_tokens = mid_block_stop(fix, request, start, num_tokens, taken_before)
    else:
        num_tokens = boundary_stop(fix, request, start, num_tokens, taken_before)
    if policy.guard_scratch:
        num_tokens = scratch_safe(fix, request, start, num_tokens)
    return num_tokens


def _falls_short(fix: Fix, request: Request, start: int, new: int) -> bool:
    """:attr:`StopPolicy.align_short_chunks`: whether a prefill chunk from a
    boundary reaches neither the next boundary nor the end of the prefill, where
    vLLM may leave it unaligned: before a boundary inside the prefill, or (0.29.0
    with checkpoint blocks) anywhere short of the prefill end."""
    policy = fix.policy
    grid = policy.grid
    end = start + new
    if start % grid or end >= start + grid:
        return False
    ends_at = prefill_end(request)
    if end >= ends_at or not in_prefill(policy.prefill, request, start):
        return False
    return start + grid <= ends_at or (
        policy.checkpoint_blocks_unalign
        and fix.scheduler.mamba_has_prefill_checkpoint_blocks
    )


def boundary_stop(
    fix: Fix, request: Request, start: int, num_tokens: int, taken_before: int
) -> int:
    """vLLM's answer for a chunk of two or more tokens, stopped at the next
    boundary where the policy says so (every mode but grid on 0.30.0+)."""
    policy = fix.policy
    grid = policy.grid
    next_boundary = (start // grid + 1) * grid
    end = start + num_tokens
    if next_boundary >= end:
        return num_tokens  # the chunk crosses no boundary: nothing to stop
    if not in_prefill(policy.prefill, request, start):
        return num_tokens  # not a prefill chunk
    # 0.29.0's flashkda backend would leave the state at a mid-block end
    # unwritten: end on the grid.
    if policy.guard_unwritten and _leaves_unwritten(fix, start, end):
        end = end // grid * grid
        num_tokens = end - start
        if next_boundary == end:
            return num_tokens
    if not policy.stop_at_boundaries:
        # grid: vLLM's own stop after a mid-block start, where it lacks it.
        if policy.mid_block_stop_missing and start % grid:
            return next_boundary - start
        return num_tokens
    # The backend writes the one state a stop would: no stop.
    if _checkpoint_stands_in(fix, request, start, end, taken_before):
        return num_tokens
    # full (and dense retention): the next boundary, kept or not.
    if policy.stop_anywhere:
        return next_boundary - start
    # kept, lean: stop only at a boundary whose state vLLM keeps; a step spent
    # on a boundary it drops would buy nothing.
    next_kept = fix.retention.first_kept_after(request, start)
    if next_kept is None or next_kept >= end:
        return num_tokens
    return next_kept - start


def _leaves_unwritten(fix: Fix, start: int, end: int) -> bool:
    """:attr:`StopPolicy.guard_unwritten`: whether 0.29.0's flashkda backend
    would leave the state of a chunk ``[start, end)`` from a boundary to a
    mid-block end unwritten."""
    grid = fix.policy.grid
    return bool(
        end % grid
        and start % grid == 0
        and fix.checkpoint_at is not None
        and fix.checkpoint_at(start, end) < 0
    )


def _checkpoint_stands_in(
    fix: Fix, request: Request, start: int, end: int, taken_before: int
) -> bool:
    """Whether the backend's in-chunk checkpoint writes the one state a stop
    would: the chunk ``[start, end)`` ends the prefill, vLLM checkpoints it
    internally, and the state the backend writes (the prompt's partial tail)
    is the first boundary after ``start`` (lean: the next kept) and the last
    before the end (a state at a later one would need a 2-block chunk), and
    vLLM does not cut the chunk after the split (:func:`stays_whole`)."""
    checkpoint_at, policy = fix.checkpoint_at, fix.policy
    if checkpoint_at is None:
        return False
    grid = policy.grid
    # Whether vLLM checkpoints this chunk internally: seen in its decision
    # count (0.30.0+), else its flag and an aligned start (0.29.0).
    if policy.watch_decisions:
        if checkpoint_decisions.taken == taken_before:
            return False
    elif not (fix.scheduler.mamba_has_prefill_checkpoint_blocks and start % grid == 0):
        return False
    if end < prefill_end(request):
        return False
    # asked last: lean's next kept boundary costs a walk of them all
    if policy.stock_chunk_ends:
        boundary = fix.retention.first_kept_after(request, start)
    else:
        boundary = (start // grid + 1) * grid
    return (
        boundary is not None
        and end < boundary + grid
        and checkpoint_at(start, end) == boundary
        and stays_whole(fix, request, start, end)
    )


def stays_whole(fix: Fix, request: Request, start: int, end: int) -> bool:
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
    if 0 < request.num_tokens - end < fix.lookahead:
        return False
    for feature in getattr(request, "mm_features", None) or ():
        if start < feature.mm_position.offset < end:
            return False
    return True


def mid_block_stop(
    fix: Fix, request: Request, start: int, num_tokens: int, taken_before: int
) -> int:
    """:attr:`StopPolicy.mid_block_stop` (grid, on the
    :attr:`InternalCheckpoint.OBSERVED` bodies, 0.30.0+): vLLM's answer, with its
    own stop at the boundary after a chunk that starts mid-block put back when
    vLLM checkpoints the chunk internally.

    vLLM 0.30.0+ drops that stop for such a chunk (scheduler.py:645-649 in
    0.33.0) although its backend writes one state, and only into the start's
    block when it is that boundary's. Otherwise the start's block (a partial
    hash hit's copy, a KV connector's loaded state: e.g. a store hit ending at
    13,008 with B = 1,648) fills up without ever holding the boundary's state,
    and vLLM publishes it as that state (and hands it to a connector's store)
    once the chunk passes the boundary, if its state retention keeps that
    boundary (else the block is freed unpublished and no stop is needed).
    """
    grid = fix.policy.grid
    if start % grid == 0 or checkpoint_decisions.taken == taken_before:
        return num_tokens  # an aligned start, or vLLM kept its stop
    next_boundary = (start // grid + 1) * grid
    end = start + num_tokens
    if next_boundary >= end:
        return num_tokens
    # The backend writes the boundary's state in the start's block: the chunk
    # ends the prefill within one block past the boundary, and the checkpoint
    # lands on it.
    if (
        fix.checkpoint_at is not None
        and end >= prefill_end(request)
        and end <= next_boundary + grid
        and fix.checkpoint_at(start, end) == next_boundary
        and stays_whole(fix, request, start, end)
    ):
        return num_tokens
    if not fix.retention.keeps(request, next_boundary):
        return num_tokens
    return next_boundary - start


def scratch_safe(fix: Fix, request: Request, start: int, num_tokens: int) -> int:
    """:attr:`StopPolicy.guard_scratch` (0.30.0-0.31.0 with a drafter): the
    answer ``num_tokens``, or up to the next boundary where vLLM would leave a
    running request's scratch blocks inside the chunk.

    Their columns start at ``cdiv(start, B)`` (the blocks after the running
    state; later if the request holds more), the checkpoint's is ``cdiv(end, B)
    - 2``: a scratch block stands in an interior boundary's column when the
    first is below the second, in a step the backend checkpoints
    (conservatively: any, when the rule is unknown). A fresh request (no blocks
    yet) gets its scratch blocks after the chunk's.
    """
    grid = fix.policy.grid
    end = start + num_tokens
    checkpoint_at = fix.scratch_checkpoint_at
    if (
        request.num_computed_tokens != 0
        and -(-start // grid) < -(-end // grid) - 2
        and in_prefill(fix.policy.prefill, request, start)
        and (checkpoint_at is None or checkpoint_at(start, end) >= 0)
    ):
        return (start // grid + 1) * grid - start
    return num_tokens


def clear_of_lookahead(
    fix: Fix, request: Request, num_tokens: int, new: int, local: int, external: int
) -> int:
    """The route's answer ``num_tokens``, except near a request's end under a
    multi-module MTP drafter (k = :attr:`Fix.lookahead` > 1).

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
    does without the plugin; running it across K would publish a wrong state."""
    if num_tokens <= 0:
        return num_tokens
    grid, lookahead = fix.policy.grid, fix.lookahead
    start = chunk_start(request, local, external)
    end, total = start + num_tokens, request.num_tokens
    if end >= total or end <= total - grid - lookahead:
        return num_tokens  # the request's end, or far from it
    last = (total - 1) // grid * grid  # K, the request's last boundary
    floor = last - grid  # L
    if total - last >= lookahead or last <= start or end <= floor:
        return num_tokens
    if not in_prefill(fix.policy.prefill, request, start):
        return num_tokens
    if start < floor:
        return floor - start
    # From L, K's column is a fresh block: run on. From inside K's block (a
    # prefix hit there, e.g. a backend's prompt checkpoint) any chunk across
    # K publishes the start's state as K's: left to vLLM, which stalls it.
    return new if start == floor else num_tokens


# -- vLLM's checkpoint decision, counted ---------------------------------------------


class _CheckpointDecisions(threading.local):
    """How many times vLLM decided for internal checkpointing, on this thread."""

    taken: int = 0


checkpoint_decisions = _CheckpointDecisions()


def observe_checkpoint_decision(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Wrapper of the scheduler module's ``is_mamba_prefill_checkpoint_valid``
    (plugin.py installs it on bodies of 0.30.0+).

    The split uses internal checkpointing exactly when this returns True (it
    is the last operand of a short-circuit ``and``). Counting its True answers
    keeps the route in step with vLLM's decision instead of re-deriving it: a
    split call whose count moved took the decision. vLLM's function looks the
    name up in its module's globals on each call, so that is where the count
    can be taken (docs/maintaining/patches.md says why not elsewhere).
    """
    result = wrapped(*args, **kwargs)
    if result:
        checkpoint_decisions.taken += 1
    return result
