"""Where the fix stops a prefill chunk on one scheduler: one frozen value.

:class:`StopPolicy` holds every stop decision of the fix for one scheduler,
taken once at bind time from the mode, the installed split body
(releases.py), vLLM's state retention (retention.py) and a few facts of the
scheduler (:class:`SchedulerFacts`). The route (split.py) reads it on every
call and decides nothing else. Each field is a card: why it exists (the
defect, with vLLM's reference), which releases need it, and when it can be
deleted. ``tests/unit/test_policy_table.py`` pins the whole table over
mode, body, retention and scheduler facts.

Importing this module needs neither vLLM nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .checkpoints import (
    InternalCheckpoint,
    backend_off_manager_grid,
    installed_manager_skips_scratch_move,
    manager_rekeys_checkpoint_block,
    spec_reserves_checkpoints,
)
from .releases import PrefillRule, SplitBody
from .retention import Retention, mamba_manager
from .settings import Mode

if TYPE_CHECKING:
    from .protocols import Scheduler

FIXING_MODES = (Mode.FULL, Mode.KEPT, Mode.GRID, Mode.LEAN)
"""The modes that bind the fix (``off`` and ``audit`` leave vLLM's split as it is)."""


def step_budget(scheduler: Scheduler) -> tuple[int, str]:
    """The most prefill tokens one request may get in a step, and what sets it
    (vLLM's split computes the same bound)."""
    budget = int(scheduler.max_num_scheduled_tokens)
    source = f"--max-num-batched-tokens={budget}"
    threshold = int(scheduler.scheduler_config.long_prefill_token_threshold or 0)
    if 0 < threshold < budget:
        budget, source = threshold, f"--long-prefill-token-threshold={threshold}"
    return budget, source


def speculative_blocks(scheduler: Scheduler) -> int:
    """The most speculative scratch blocks a Mamba group's spec reserves per
    request (an EAGLE/MTP drafter's; 0 without one)."""
    return max(
        (
            getattr(group.kv_cache_spec, "num_speculative_blocks", 0)
            for group in scheduler.kv_cache_config.kv_cache_groups
        ),
        default=0,
    )


@dataclass(frozen=True)
class SchedulerFacts:
    """What the policy reads off one scheduler, once, at bind time."""

    reserves_checkpoints: bool = False
    """A Mamba group's spec declares prefill checkpoint blocks
    (:func:`checkpoints.spec_reserves_checkpoints`)."""
    speculative_blocks: int = 0
    """Speculative scratch blocks per request (:func:`speculative_blocks`)."""
    backend_off_manager_grid: bool = False
    """:func:`checkpoints.backend_off_manager_grid`."""
    step_budget: int = 1 << 30
    """:func:`step_budget`."""
    skips_scratch_move: bool = False
    """The scheduler's Mamba manager leaves speculative scratch blocks in place in
    a step it checkpoints internally, read from its class's code
    (:func:`checkpoints.installed_manager_skips_scratch_move`)."""
    decides_checkpoints: bool = False
    """The scheduler's own ``mamba_has_prefill_checkpoint_blocks``: without it
    vLLM never decides to checkpoint a chunk internally (every body with
    internal checkpointing tests this flag first), so nothing a stop guards
    against that decision can happen."""
    rekeys_checkpoint: bool = False
    """The scheduler's Mamba manager publishes the backend's in-chunk state
    under its own position's hash, dropping the hash its column got as a full
    block in the same step, read from its class's code
    (:func:`checkpoints.manager_rekeys_checkpoint_block`, 0.30.0+)."""

    @classmethod
    def of(cls, scheduler: Scheduler, body: SplitBody, grid: int) -> SchedulerFacts:
        return cls(
            decides_checkpoints=bool(
                getattr(scheduler, "mamba_has_prefill_checkpoint_blocks", False)
            ),
            reserves_checkpoints=spec_reserves_checkpoints(scheduler),
            speculative_blocks=speculative_blocks(scheduler),
            backend_off_manager_grid=backend_off_manager_grid(scheduler, body, grid),
            step_budget=step_budget(scheduler)[0],
            skips_scratch_move=installed_manager_skips_scratch_move(
                _mamba_manager_class(scheduler)
            ),
            rekeys_checkpoint=_rekeys_checkpoint(scheduler),
        )


def _rekeys_checkpoint(scheduler: Scheduler) -> bool:
    """:attr:`SchedulerFacts.rekeys_checkpoint`; False without a Mamba manager."""
    manager_class = _mamba_manager_class(scheduler)
    return manager_class is not None and manager_rekeys_checkpoint_block(manager_class)


def _mamba_manager_class(scheduler: Scheduler) -> type | None:
    """The class of the Mamba manager this scheduler runs (a platform's subclass
    included); None where it has none."""
    manager = mamba_manager(scheduler.kv_cache_manager.coordinator)
    return None if manager is None else type(manager)


@dataclass(frozen=True)
class StopPolicy:
    """Every stop decision of the fix for one scheduler (B = ``grid``)."""

    grid: int
    """B, the Mamba state grid the route runs vLLM's split on."""
    prefill: PrefillRule
    """The installed body's prefill test: only prefill chunks are stopped."""

    stop_at_boundaries: bool
    """Stop a prefill chunk at the next B boundary it would cross, also from an
    aligned start. Why: the allocator gives a request one real Mamba block per
    step, so boundaries crossed inside a chunk are never materialized
    (single_type_kv_cache_manager.py, ``MambaManager``, every release).
    Releases: all. Modes: full, kept. Upstream: PR #54076 (step 3). Delete
    when: every supported release has the PR."""
    stop_anywhere: bool
    """Stop at every boundary, not only where vLLM's retention keeps the state.
    Why: ``full`` promises canonical states; under dense retention every
    boundary is kept anyway; and where the backend's in-chunk state lands on
    another grid than its manager publishes (:attr:`SchedulerFacts.\
backend_off_manager_grid`, 0.30.0-0.31.0) a longer chunk gets a wrongly
    published checkpoint. Releases: all (the last case 0.30.0-0.31.0). Delete
    when: as :attr:`stop_at_boundaries`."""
    mid_block_stop: bool
    """grid mode: put back vLLM's own stop at the boundary after a chunk that
    starts mid-block (a partial hit, a KV connector's hit) when vLLM
    checkpoints that chunk internally. Why: 0.30.0+ drop that stop for such a
    chunk (scheduler.py:645-649 in 0.33.0) although the backend writes one
    state, so the start's block is published as the boundary's state it never
    held. Releases: 0.30.0+ (``SplitBody.drops_mid_block_stop``), on a
    scheduler that decides internal checkpoints at all
    (:attr:`SchedulerFacts.decides_checkpoints`). Delete when: vLLM keeps its
    stop for internally checkpointed chunks."""
    guard_unwritten: bool
    """End a chunk from a boundary on the grid where 0.29.0's flashkda backend
    would not write its in-chunk state. Why: it writes only 16-aligned from the
    chunk start (:func:`checkpoints.flashkda_position`), yet vLLM publishes the
    reserved checkpoint block either way; with B % 16 != 0 a chunk across an
    odd number of blocks publishes a hash over an unwritten slot. The manager
    reserves that block by the Mamba spec even where the scheduler's own flag
    is off with a drafter (scheduler.py:329-338 and
    single_type_kv_cache_manager.py:1565-1580 in 0.29.0): the guard goes by
    the spec. Releases: 0.29.0 (``SplitBody.checkpoint_write_stride``). Modes:
    every fixing mode. Delete when: 0.29.0
    is no longer supported."""
    mid_block_stop_missing: bool
    """grid mode: add the stop at the boundary after a chunk that starts
    mid-block, which vLLM lacks. Why: before 0.26.0 there is no such stop, so
    the start's block (holding a KV connector's loaded state) is published as
    the boundary's; 0.26.0 still lacks it in its drafter tail (unaligned before
    0.27.0: with MTP, C = B = 168 and a 176-token prompt next to a decode,
    stock runs 0 -> 166 -> 176 and publishes the block of 168 holding
    state@166). Releases: 0.15.0-0.25.1; 0.26.0 with a drafter. Delete when:
    0.26.0 and older are no longer supported."""
    guard_scratch: bool
    """Cut a chunk vLLM checkpoints internally at its first boundary when a
    running request's speculative scratch blocks would stand in its interior
    boundary columns. Why: in such a step 0.30.0-0.31.0's manager leaves them
    where they stood and publishes them as those states
    (single_type_kv_cache_manager.py:1873 in 0.30.0, :1882 in 0.31.0; read
    from the code: :func:`checkpoints.skips_scratch_move_in_checkpoint_steps`);
    a cut step checkpoints nothing, so vLLM moves them as in any other step.
    Releases:
    0.30.0-0.31.0 with a drafter and checkpoint blocks. Modes: every fixing
    mode. Delete when: 0.31.0 and older are no longer supported."""
    watch_decisions: bool
    """Read vLLM's internal-checkpoint decision for each call (the count of
    :data:`split.checkpoint_decisions`) instead of re-deriving it. Why:
    0.30.0+ decide with ``is_mamba_prefill_checkpoint_valid`` inside the split;
    a stop must not cut a chunk whose only boundary the backend writes.
    Releases: 0.30.0+, whenever any stop applies. Delete when: as
    :attr:`stop_at_boundaries`."""
    align_short_chunks: bool
    """Refuse (0 tokens) a prefill chunk from a boundary that the step budget
    squeezes short of the next one, where vLLM would leave it unaligned. Why: its
    boundary's state would come from two chunks; vLLM's split waits for a whole
    block itself except 0.29.0 once checkpoint blocks exist, and bodies before
    0.27.0 with an EAGLE/MTP drafter in the last block but one. Releases: all,
    where boundary states must be canonical (full; kept under dense retention)
    and B fits the budget. Delete when: as :attr:`stop_at_boundaries`."""
    checkpoint_blocks_unalign: bool
    """For :attr:`align_short_chunks`: vLLM leaves a chunk short of the prefill
    end unaligned anywhere once the scheduler has checkpoint blocks. Releases:
    0.29.0 (``SplitBody.checkpoint_blocks_unalign``). Delete when: 0.29.0 is
    no longer supported."""
    stock_chunk_ends: bool
    """lean mode: run vLLM's split on its own grid (C, as stock does) for a
    chunk that starts on that grid, and on B for one that starts off it (after
    a stop at a kept boundary, so vLLM does not add its stop after a mid-block
    start), and on B for a prefill's last chunk from a kept boundary (where
    vLLM's last-cacheable-position stop on C would fall inside the B block
    that boundary opens, where nothing is published). Why: under sparse
    retention vLLM publishes a Mamba block only for a boundary it keeps; a
    chunk that runs across any other boundary, or ends between two, leaves a
    block nobody hashes, so only the stops at kept
    boundaries (:attr:`stop_at_boundaries`) are needed and flooring every
    chunk end to B costs steps for nothing. Off where every boundary is kept
    (dense) and where the backend's state lands off the manager's grid: lean
    is ``kept`` there. With backend prefill checkpoints the backend writes
    only the prompt's partial-tail state, into the replay boundary's column
    (``compute_mamba_prefill_checkpoints``), so lean still stops at that
    boundary, except where the tail is the boundary itself.
    Releases: all. Delete when: as :attr:`stop_at_boundaries`."""
    yield_replay_to_checkpoint: bool
    """lean mode: no stop at a replay boundary (kept for nothing else) in a
    fresh prompt's final chunk that vLLM checkpoints internally with the
    backend's write in that boundary's column. Why: the backend writes the
    prompt checkpoint (the prompt's partial tail) there, and vLLM's manager
    publishes that column under the checkpoint's hash, dropping the
    boundary's (``_cache_partial_tail_block`` with
    ``replace_existing_hashes=True``, single_type_kv_cache_manager.py:2028-2086
    in 0.33.0): stock vLLM keeps the prompt checkpoint instead of the
    boundary, which serves every re-ask and continuation of the prompt from
    further on. A stop there would keep both at the cost of two more chunks
    (the boundary's, then vLLM's own stop at the tail, which no backend can
    checkpoint from the boundary); ``kept`` makes that trade. Releases:
    0.30.0+ (:attr:`InternalCheckpoint.OBSERVED`), where the manager's code
    re-keys the column (:attr:`SchedulerFacts.rekeys_checkpoint`) and the
    scheduler decides internal checkpoints. Delete when: as
    :attr:`stop_at_boundaries`."""

    @property
    def any_stop(self) -> bool:
        """Whether the route changes vLLM's answer at all after its call."""
        return (
            self.stop_at_boundaries
            or self.mid_block_stop
            or self.guard_unwritten
            or self.mid_block_stop_missing
            or self.guard_scratch
        )

    def schedules_as_vllm(self, cache_block: int) -> bool:
        """Whether the route would answer every call exactly as vLLM's own split:
        the grid it runs vLLM's split on is vLLM's own (B == C), no stop follows
        the call and no short chunk is refused. Then the fix binds vLLM's
        function itself (grid mode on a C == B geometry, for instance), and a
        split call costs what it costs on stock vLLM."""
        return (
            self.grid == cache_block
            and not self.any_stop
            and not self.align_short_chunks
        )

    @classmethod
    def decide(
        cls,
        mode: Mode,
        body: SplitBody,
        retention: Retention,
        facts: SchedulerFacts,
        grid: int,
    ) -> StopPolicy:
        """The policy for a fixing mode; no vLLM needed."""
        if mode not in FIXING_MODES:
            raise ValueError(f"mode {mode.value} binds no fix")
        observed = body.internal_checkpoint is InternalCheckpoint.OBSERVED
        stop_at_boundaries = mode in (Mode.FULL, Mode.KEPT, Mode.LEAN)
        stop_anywhere = (
            mode is Mode.FULL or retention.dense or facts.backend_off_manager_grid
        )
        drafter = facts.speculative_blocks > 0
        policy = cls(
            grid=grid,
            prefill=body.prefill,
            stop_at_boundaries=stop_at_boundaries,
            stop_anywhere=stop_anywhere,
            mid_block_stop=mode is Mode.GRID
            and body.drops_mid_block_stop
            and facts.decides_checkpoints,
            guard_unwritten=bool(body.checkpoint_write_stride)
            and grid % body.checkpoint_write_stride != 0
            and facts.reserves_checkpoints,
            mid_block_stop_missing=mode is Mode.GRID
            and not (
                body.stops_after_mid_block_start
                and (body.aligns_drafter_tail or not drafter)
            ),
            guard_scratch=observed
            and facts.skips_scratch_move
            and facts.reserves_checkpoints
            and drafter,
            watch_decisions=False,
            align_short_chunks=stop_at_boundaries
            and stop_anywhere
            and 0 < grid <= facts.step_budget,
            checkpoint_blocks_unalign=body.checkpoint_blocks_unalign,
            stock_chunk_ends=mode is Mode.LEAN and not stop_anywhere,
            yield_replay_to_checkpoint=mode is Mode.LEAN
            and not stop_anywhere
            and observed
            and facts.decides_checkpoints
            and facts.reserves_checkpoints
            and facts.rekeys_checkpoint,
        )
        if observed and policy.any_stop:
            return replace(policy, watch_decisions=True)
        return policy

    @classmethod
    def for_scheduler(
        cls,
        mode: Mode,
        body: SplitBody,
        retention: Retention,
        scheduler: Scheduler,
        grid: int,
    ) -> StopPolicy:
        """The policy for one freshly built scheduler (bind time)."""
        facts = SchedulerFacts.of(scheduler, body, grid)
        return cls.decide(mode, body, retention, facts, grid)
