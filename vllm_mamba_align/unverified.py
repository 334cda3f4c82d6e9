"""What the plugin reads off split code no release matches, for the opt-in.

With ``VLLM_MAMBA_ALIGN_ALLOW_UNVERIFIED`` a body the table does not know gets
best-effort rules (:func:`unverified_body`), each read from the code as the
table's rows state it: tests/test_release_facts.py holds these readings to the
rows on every release of the matrix, and maintainers/drafting.py drafts a new
release's row with them. Loaded only for such code, by the drafting tools and
by the tests: a known body's rules are its row's.

Importing this module needs neither vLLM nor torch.
"""

from __future__ import annotations

import ast

from .checkpoints import FLASHKDA_CHUNK_SIZE, InternalCheckpoint
from .fingerprint import SPLIT_PARAMETERS, CodeShape, function_def
from .releases import UNVERIFIED, PrefillRule, SplitBody


def _tree(shape: CodeShape) -> ast.FunctionDef | None:
    if shape.source is None:
        return None
    try:
        return function_def(shape.source)
    except (SyntaxError, ValueError):
        return None


def stops_after_mid_block_start(shape: CodeShape) -> bool:
    """Read from the split's code: the body computes the next grid boundary of
    a start it tests to be off the grid, the stop it puts on a chunk starting
    mid-block (``SplitBody.stops_after_mid_block_start``;
    :func:`stops_at_next_boundary`)."""
    tree = _tree(shape)
    return tree is not None and stops_at_next_boundary(tree)


def aligns_drafter_tail(shape: CodeShape) -> bool:
    """Read from the split's code: the ``if`` that floors a chunk end to the
    grid compares it with ``prefill_end``, not with ``last_cache_position``,
    which a drafter backs off one block (``SplitBody.aligns_drafter_tail``;
    :func:`floor_guard_bounds`)."""
    return "prefill_end" in floor_guard_bounds(shape)


def floor_guard_bounds(shape: CodeShape) -> frozenset[str]:
    """The names compared against in every ``if`` whose body floors a position
    to the grid (``x // block_size * block_size``): ``last_cache_position``
    or ``prefill_end`` (:func:`guard_bounds`)."""
    tree = _tree(shape)
    return frozenset() if tree is None else guard_bounds(tree)


def unverified_body(shape: CodeShape) -> SplitBody:
    """Best-effort rules for code no release matches (only with the explicit opt-in).

    Chooses the newest rules whose names the code actually uses.
    """
    if "is_mamba_prefill_checkpoint_valid" in shape.names:
        checkpoint = InternalCheckpoint.OBSERVED
    elif "self.mamba_has_prefill_checkpoint_blocks" in shape.names:
        checkpoint = InternalCheckpoint.ALIGNED_START
    else:
        checkpoint = InternalCheckpoint.NONE
    prefill = (
        PrefillRule.NO_OUTPUT_YET
        if "request.num_output_tokens" in shape.names
        and "prefill_end" not in shape.names
        else PrefillRule.BEFORE_PREFILL_END
    )
    extra = shape.parameters[len(SPLIT_PARAMETERS) :]
    aligned_start = checkpoint is InternalCheckpoint.ALIGNED_START
    return SplitBody(
        releases=(UNVERIFIED,),
        fingerprint=shape.fingerprint or "unreadable",
        prefill=prefill,
        internal_checkpoint=checkpoint,
        wide_block_exemption="max_prefill_tokens" in shape.names,
        extra_parameter=extra[0] if extra else None,
        stops_after_mid_block_start=stops_after_mid_block_start(shape),
        aligns_drafter_tail=aligns_drafter_tail(shape),
        checkpoint_write_stride=FLASHKDA_CHUNK_SIZE if aligned_start else 0,
        checkpoint_blocks_unalign=aligned_start,
        drops_mid_block_stop=checkpoint is InternalCheckpoint.OBSERVED,
    )


def _floors_to_grid(node: ast.AST) -> bool:
    """Whether ``node`` contains ``x // block_size * block_size``."""
    return any(
        isinstance(child, ast.BinOp)
        and isinstance(child.op, ast.Mult)
        and isinstance(child.right, ast.Name)
        and child.right.id == "block_size"
        and isinstance(child.left, ast.BinOp)
        and isinstance(child.left.op, ast.FloorDiv)
        and isinstance(child.left.right, ast.Name)
        and child.left.right.id == "block_size"
        for child in ast.walk(node)
    )


def _is_block_size(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "block_size"


def _next_boundary_positions(node: ast.AST) -> set[str]:
    """The names ``x`` of every ``(x // block_size + 1) * block_size`` in ``node``:
    the grid boundary after position ``x``."""
    found: set[str] = set()
    for child in ast.walk(node):
        if not (
            isinstance(child, ast.BinOp)
            and isinstance(child.op, ast.Mult)
            and _is_block_size(child.right)
        ):
            continue
        added = child.left
        if not (
            isinstance(added, ast.BinOp)
            and isinstance(added.op, ast.Add)
            and isinstance(added.right, ast.Constant)
            and added.right.value == 1
        ):
            continue
        floored = added.left
        if (
            isinstance(floored, ast.BinOp)
            and isinstance(floored.op, ast.FloorDiv)
            and _is_block_size(floored.right)
            and isinstance(floored.left, ast.Name)
        ):
            found.add(floored.left.id)
    return found


def _off_grid_positions(node: ast.AST) -> set[str]:
    """The names ``x`` that ``node`` tests to be off the grid:
    ``x % block_size != 0`` (or ``0 != x % block_size``)."""
    found: set[str] = set()
    for child in ast.walk(node):
        if not (
            isinstance(child, ast.Compare)
            and len(child.ops) == 1
            and isinstance(child.ops[0], ast.NotEq)
        ):
            continue
        for side, other in (
            (child.left, child.comparators[0]),
            (child.comparators[0], child.left),
        ):
            if (
                isinstance(other, ast.Constant)
                and other.value == 0
                and isinstance(side, ast.BinOp)
                and isinstance(side.op, ast.Mod)
                and _is_block_size(side.right)
                and isinstance(side.left, ast.Name)
            ):
                found.add(side.left.id)
    return found


def stops_at_next_boundary(node: ast.AST) -> bool:
    """Whether the split stops a chunk that starts off the grid at the next
    boundary: it computes ``(x // block_size + 1) * block_size`` for a position
    ``x`` it also tests with ``x % block_size != 0``. Read by shape, whatever
    the names: 0.26.0+ call it ``next_block_boundary`` after ``start``, a
    nightly build of vLLM main between 0.25.1 and 0.26.0 ``next_boundary`` after
    ``num_computed_tokens``."""
    return bool(_next_boundary_positions(node) & _off_grid_positions(node))


def guard_bounds(node: ast.AST) -> frozenset[str]:
    """The names on either side of the comparisons guarding a floor to the grid.

    The guard is the ``if`` one of whose own assignments floors a position to
    the grid; what it compares the chunk end with decides which chunks vLLM
    aligns: up to the last cacheable position (which an EAGLE/MTP drafter backs
    off one block, so later chunks run unaligned) or up to the prefill's end.
    """
    bounds: set[str] = set()
    for child in ast.walk(node):
        if not isinstance(child, ast.If):
            continue
        if not any(
            isinstance(statement, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            and _floors_to_grid(statement)
            for statement in child.body
        ):
            continue
        for comparison in ast.walk(child.test):
            if isinstance(comparison, ast.Compare):
                for side in (comparison.left, *comparison.comparators):
                    if isinstance(side, ast.Name):
                        bounds.add(side.id)
    return frozenset(bounds)
