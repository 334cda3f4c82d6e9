"""The backend's in-chunk prefill checkpoint: when vLLM takes it, where it goes.

From 0.29.0 a GPU Mamba/GDN backend whose spec declares
``num_prefill_checkpoint_blocks > 0`` writes ONE state inside a prefill chunk
vLLM decides to checkpoint internally (``use_internal_checkpoint`` in
``Scheduler._mamba_block_aligned_split``): the state at a checkpoint position,
into the request's Mamba block column ``cdiv(end, B) - 2``, skipped when that
column holds the null block. Every vLLM rule about it is written here once and
read by the fix (split.py, policy.py), the audit (audit/) and the simulation
(tools/sim/). vLLM's decision to take it is counted by the route
(``split.observe_checkpoint_decision``).

Importing this module needs neither vLLM nor torch.
"""

from __future__ import annotations

import ast
import enum
import functools
import inspect
import textwrap
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .protocols import Scheduler


class InternalCheckpoint(enum.Enum):
    """How to tell that vLLM's backend materializes interior states itself.

    When it does, the chunk may span several state blocks: the PR's extra stop
    must not apply.
    """

    NONE = "none"
    """No internal prefill checkpointing in this body (before 0.29.0)."""
    ALIGNED_START = "mamba_has_prefill_checkpoint_blocks and start on the grid"
    """0.29.0's rule, re-derived from the scheduler's own flag."""
    OBSERVED = "vLLM's own is_mamba_prefill_checkpoint_valid() decision"
    """0.30.0+: watch the decision vLLM takes inside the split."""


class CheckpointGrid(enum.Enum):
    """Which hash grid the GPU backend puts its one in-chunk prefill state on
    (bodies with :attr:`InternalCheckpoint.OBSERVED`).

    The backend places it at ``get_mamba_prefill_checkpoint_position(chunk end,
    grid)`` and writes it only if ``is_mamba_prefill_checkpoint_valid`` agrees
    with the same hash block; the grid differs across releases.
    """

    PREFIX_MATCH_UNIT = "cache_config.prefix_match_unit, else the Mamba block"
    """0.30.0, 0.31.0: the backend's own choice, grid and hash block alike
    (models/kimi_k3/nvidia/kda_metadata.py:620-621 in 0.30.0,
    model_executor/layers/mamba/checkpoint.py:86 in 0.31.0). With
    prefix_match_unit unset it is not the engine's hash block."""
    CACHE_HIT_ALIGNMENT = "the engine's cache-hit alignment and hash block"
    """0.32.0+: ``cache_config.cache_hit_alignment_tokens`` (the hash block
    under partial hash hits, else the scheduler block) and
    ``cache_config.hash_block_size``, as resolved by the engine
    (model_executor/layers/mamba/checkpoint.py:111-133 in 0.32.0)."""


class CheckpointFacts(Protocol):
    """What the rules below read of a split body (``releases.SplitBody``).

    Named here, not imported: releases.py builds its bodies from this
    module's types, and the facts go one way (releases -> checkpoints)."""

    @property
    def internal_checkpoint(self) -> InternalCheckpoint: ...

    @property
    def checkpoint_grid(self) -> CheckpointGrid | None: ...


FLASHKDA_CHUNK_SIZE = 16
"""0.29.0's flashkda kernel writes its in-chunk state only this many tokens
apart from the chunk start (models/kimi_k3/nvidia/kda_metadata.py:582-605)."""


def flashkda_position(start: int, end: int, grid: int) -> int:
    """0.29.0's flashkda rule: where the backend writes its in-chunk state for a
    chunk ``[start, end)`` vLLM checkpoints internally (-1: nowhere).

    The last B boundary below the chunk end, if the chunk does not end on the
    grid, the boundary lies inside the chunk and its offset from the chunk start
    is a multiple of :data:`FLASHKDA_CHUNK_SIZE`
    (models/kimi_k3/nvidia/kda_metadata.py:582-605 in 0.29.0). It goes into
    column ``end // B - 1``.
    """
    position = end // grid * grid
    offset = position - start
    if end % grid == 0 or offset <= 0 or offset % FLASHKDA_CHUNK_SIZE:
        return -1
    return position


CheckpointRule = Callable[[int, int], int]
"""(chunk start, chunk end) -> where the backend's in-chunk checkpoint goes, for
a chunk vLLM decided to checkpoint internally (-1: nowhere)."""


def spec_reserves_checkpoints(scheduler: Scheduler) -> bool:
    """Whether a Mamba group's spec declares prefill checkpoint blocks, which
    its manager reserves for a chunk that starts on the grid and ends off it,
    whatever the scheduler's own ``mamba_has_prefill_checkpoint_blocks`` says."""
    return any(
        getattr(group.kv_cache_spec, "num_prefill_checkpoint_blocks", 0) > 0
        for group in scheduler.kv_cache_config.kv_cache_groups
    )


def checkpoint_alignments(scheduler: Scheduler) -> tuple[int | None, ...]:
    """Each Mamba group's prefill checkpoint alignment, as that group's manager
    and the worker's backend for it read it (None: the group writes no
    in-chunk state: no checkpoint blocks, or no alignment); () without vLLM.

    A model may have several Mamba specs (0.33.0+: Qwen4Exp's GDN layers and
    its PLE short-conv layer, models/qwen4_exp/nvidia/model.py:907-926 in
    0.34.0), each checkpointing by its own spec
    (single_type_kv_cache_manager.py:1684, model_executor/layers/mamba/
    checkpoint.py:138 in 0.34.0), while vLLM's scheduler decides with the
    first group's alignment only (scheduler.py:445-454 in 0.34.0, a TODO of
    vLLM's). The backend writes a state in a chunk in every group only where
    every group's alignment admits it (:func:`backend_checkpoint_rule`)."""
    try:
        from vllm.v1.kv_cache_interface import MambaSpec
    except ImportError:
        return ()
    alignments: list[int | None] = []
    for group in scheduler.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, MambaSpec):
            continue
        declared = getattr(spec, "num_prefill_checkpoint_blocks", 0) > 0
        alignment = getattr(spec, "prefill_checkpoint_alignment", None)
        alignments.append(alignment if declared else None)
    return tuple(alignments)


def checkpoint_groups_agree(scheduler: Scheduler) -> bool:
    """Whether every Mamba group checkpoints by the same facts (one alignment,
    or none), so that where one group's backend writes its in-chunk state,
    every group's does."""
    return len(set(checkpoint_alignments(scheduler))) <= 1


RELOCATE_SCRATCH = "_relocate_speculative_block"
"""The Mamba manager's method that moves a running request's speculative
scratch block out of a column the step leaves behind (0.29.0+)."""


def _guards_of_calls(
    node: ast.AST, method: str, guards: tuple[ast.expr, ...]
) -> Iterator[tuple[ast.expr, ...]]:
    """Yield, for each call of ``self.<method>`` under ``node``, the tests of
    the ``if`` statements in whose body (not ``else``) the call stands."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == method
    ):
        yield guards
    if isinstance(node, ast.If):
        for statement in node.body:
            yield from _guards_of_calls(statement, method, (*guards, node.test))
        for statement in node.orelse:
            yield from _guards_of_calls(statement, method, guards)
        return
    for child in ast.iter_child_nodes(node):
        yield from _guards_of_calls(child, method, guards)


def _negates_checkpoint_block(test: ast.expr) -> bool:
    return any(
        isinstance(part, ast.UnaryOp)
        and isinstance(part.op, ast.Not)
        and isinstance(part.operand, ast.Name)
        and part.operand.id == "checkpoint_block"
        for part in ast.walk(test)
    )


def skips_scratch_move_in_checkpoint_steps(manager_source: str) -> bool:
    """Whether a Mamba manager's code leaves a running request's speculative
    scratch blocks where they stand in a step vLLM checkpoints internally.

    Read from the code: the move (:data:`RELOCATE_SCRATCH`) runs only under an
    ``if`` that tests ``not checkpoint_block`` (0.30.0, 0.31.0:
    ``if blocks_allocated and not checkpoint_block:``). 0.29.0 and 0.32.0+
    move them in such a step too; before 0.29.0 there is no move and no such
    step. In a step that skips the move, a chunk crossing two boundaries past
    its start leaves the scratch blocks in interior boundary columns, and vLLM
    publishes them as those boundaries' states, which they do not hold.
    """
    tree = ast.parse(textwrap.dedent(manager_source))
    return any(
        any(_negates_checkpoint_block(test) for test in guards)
        for guards in _guards_of_calls(tree, RELOCATE_SCRATCH, ())
    )


@functools.lru_cache(maxsize=8)
def installed_manager_skips_scratch_move(manager_class: type | None = None) -> bool:
    """:func:`skips_scratch_move_in_checkpoint_steps` for the Mamba manager class
    a scheduler runs (None: the installed vLLM's ``MambaManager``), once per
    class. The code read is the ``allocate_new_blocks`` that class resolves to,
    so a platform's subclass that overrides it is read as written. Code that
    cannot be read, or a method wrapped by someone else (``__wrapped__``, whose
    source is not the code that runs), counts as skipping: the fix then keeps
    its guard (``StopPolicy.guard_scratch``)."""
    try:
        if manager_class is None:
            from vllm.v1.core.single_type_kv_cache_manager import MambaManager

            manager_class = MambaManager
    except ImportError:
        return True
    source = _own_method_source(manager_class, "allocate_new_blocks")
    if source is None:
        return True
    try:
        return skips_scratch_move_in_checkpoint_steps(source)
    except SyntaxError:
        return True


def _own_method_source(manager_class: type, name: str) -> str | None:
    """The source of the method ``manager_class`` resolves ``name`` to, or None
    where it cannot be read or is wrapped by someone else (``__wrapped__``: the
    source inspect finds is not the code that runs)."""
    try:
        method = inspect.getattr_static(manager_class, name)
        if hasattr(method, "__wrapped__"):
            return None
        return inspect.getsource(method)
    except (AttributeError, OSError, TypeError):
        return None


REKEY_CHECKPOINT = "_cache_partial_tail_block"
"""The Mamba manager's method that publishes a request's partial tail and, from
0.30.0, re-keys its reserved checkpoint block."""


def rekeys_checkpoint_block(manager_source: str) -> bool:
    """Whether a Mamba manager's code publishes the backend's in-chunk state
    under its own position's hash, in whatever column the backend wrote it.

    Read from the code of :data:`REKEY_CHECKPOINT`: it looks up the request's
    reserved checkpoint (``self._checkpoints``) and passes its block to
    ``cache_partial_block`` with ``replace_existing_hashes=True``, dropping the
    full-block hash that column received in the same step (0.30.0-0.33.0). 0.29.0
    has neither: its method publishes only a prompt's partial tail.
    """
    tree = ast.parse(textwrap.dedent(manager_source))
    reads_checkpoints = any(
        isinstance(node, ast.Attribute)
        and node.attr == "_checkpoints"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        for node in ast.walk(tree)
    )
    replaces = any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "cache_partial_block"
        and any(
            keyword.arg == "replace_existing_hashes"
            and isinstance(keyword.value, ast.Constant)
            and keyword.value.value is True
            for keyword in node.keywords
        )
        for node in ast.walk(tree)
    )
    return reads_checkpoints and replaces


@functools.lru_cache(maxsize=8)
def manager_rekeys_checkpoint_block(manager_class: type) -> bool:
    """:func:`rekeys_checkpoint_block` for the Mamba manager class a scheduler
    runs, once per class, read from the method that class resolves to. Code
    that cannot be read, or a method wrapped by someone else, counts as not
    re-keying: the audit then counts such a write as no boundary (an upper
    bound on what vLLM leaves unwritten)."""
    source = _own_method_source(manager_class, REKEY_CHECKPOINT)
    if source is None:
        return False
    try:
        return rekeys_checkpoint_block(source)
    except SyntaxError:
        return False


def backend_off_manager_grid(
    scheduler: Scheduler, body: CheckpointFacts, grid: int
) -> bool:
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


def backend_checkpoint_rule(
    scheduler: Scheduler, stock: Callable[..., int], body: CheckpointFacts, grid: int
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
      scheduler module imported them (:func:`_observed_rule`).
    - 0.29.0: :func:`flashkda_position`.

    With several Mamba groups (:func:`checkpoint_alignments`), the position
    is the one every group's backend writes; a chunk in which only some
    groups write a state gets -1, so no stop is skipped on its account.
    """
    rule = body.internal_checkpoint
    if rule is InternalCheckpoint.ALIGNED_START:
        return lambda start, end: flashkda_position(start, end, grid)
    if rule is not InternalCheckpoint.OBSERVED or body.checkpoint_grid is None:
        return None
    names = getattr(stock, "__globals__", {})
    position_of: Callable[..., int] | None = names.get(
        "get_mamba_prefill_checkpoint_position"
    )
    # The route counts the module's validity calls (split.py's observer): ask
    # the function it wraps, so these calls count no decision.
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
    alignments = tuple(dict.fromkeys(checkpoint_alignments(scheduler))) or (
        scheduler.mamba_prefill_checkpoint_alignment,
    )
    return _observed_rule(
        scheduler, grid, position_of, valid, by_prefix_unit, lookahead, alignments
    )


def _observed_rule(
    scheduler: Scheduler,
    grid: int,
    helper: Callable[..., int],
    check: Callable[..., bool],
    by_prefix_unit: bool,
    lookahead: bool,
    alignments: tuple[int | None, ...],
) -> CheckpointRule:
    """0.30.0+'s position, by vLLM's own helper and validity check. The
    helper's parameters are the release's: three up to 0.32.0, a fourth
    (``num_hash_lookahead_tokens``, ``lookahead``) in 0.33.0. The check is
    asked once per distinct alignment of the Mamba groups (``alignments``):
    the position counts only where every group's backend writes it."""

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
        for alignment in alignments:
            if not check(
                query_start=start,
                query_end=end,
                checkpoint_position=position,
                hash_block_size=hash_block,
                mamba_block_size=grid,
                checkpoint_alignment=alignment,
            ):
                return -1  # a group's backend declines: not every group writes
        return position

    return observed
