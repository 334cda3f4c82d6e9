# ruff: noqa: E501  (the pinned table: one row per line, five mode columns)
"""The stop policy table: every decision of the fix, per mode, body, retention
and scheduler facts, pinned without vLLM.

``policy.StopPolicy`` is the one place the fix decides where a chunk stops; the
route (split.py) only reads it. Each row below is one split body under one set
of scheduler facts; each cell the decisions that are on for one mode under one
retention. A changed decision for any release shows up here as a changed cell.
"""

from __future__ import annotations

import dataclasses
import difflib

import pytest

from vllm_mamba_align.checkpoints import CheckpointGrid, InternalCheckpoint
from vllm_mamba_align.policy import FIXING_MODES, SchedulerFacts, StopPolicy
from vllm_mamba_align.releases import BODIES, SplitBody
from vllm_mamba_align.retention import Retention
from vllm_mamba_align.settings import Mode

B = 1640
"""A state block with B % 16 == 8 (0.29.0's flashkda guard applies to it)."""

RETENTIONS = {
    "dense": Retention(None, B, 16, "test"),
    "zero": Retention(0, B, 16, "test"),
    "R=4B": Retention(4 * B, B, 16, "test"),
}
"""vLLM's retention kinds (retention.py): every boundary kept, only reachable
boundaries, and also every multiple of an interval R > B."""

FACTS = {
    "plain": SchedulerFacts(step_budget=8192),
    "ckpt": SchedulerFacts(
        reserves_checkpoints=True, decides_checkpoints=True, step_budget=8192
    ),
    "draft": SchedulerFacts(speculative_blocks=2, step_budget=8192),
    "ckpt+draft": SchedulerFacts(
        reserves_checkpoints=True,
        decides_checkpoints=True,
        speculative_blocks=2,
        step_budget=8192,
    ),
    "stays": SchedulerFacts(
        reserves_checkpoints=True,
        decides_checkpoints=True,
        speculative_blocks=2,
        step_budget=8192,
        skips_scratch_move=True,
    ),
    "off-grid": SchedulerFacts(
        reserves_checkpoints=True,
        decides_checkpoints=True,
        backend_off_manager_grid=True,
        step_budget=8192,
    ),
    "rekeys": SchedulerFacts(
        reserves_checkpoints=True,
        decides_checkpoints=True,
        rekeys_checkpoint=True,
        step_budget=8192,
    ),
    "narrow": SchedulerFacts(step_budget=B - 1),
}
"""Scheduler facts: checkpoint blocks in every Mamba spec (so the scheduler
decides internal checkpoints), an EAGLE/MTP drafter's
scratch blocks, with them 0.30.0-0.31.0's manager leaving those blocks in place
in a checkpointing step ("stays"), 0.30.0-0.31.0's backend off the manager's
hash grid, 0.30.0+'s manager re-keying the checkpoint's column ("rekeys"),
a step budget narrower than B."""

LETTERS = {
    "stop_at_boundaries": "b",
    "stop_anywhere": "a",
    "mid_block_stop": "m",
    "guard_unwritten": "u",
    "mid_block_stop_missing": "M",
    "guard_scratch": "s",
    "watch_decisions": "w",
    "align_short_chunks": "c",
    "checkpoint_blocks_unalign": "k",
    "stock_chunk_ends": "e",
    "yield_replay_to_checkpoint": "y",
}
"""One letter per decision, in the policy's field order; "-": none is on."""


def active(policy: StopPolicy) -> tuple[str, ...]:
    """The names of the policy's decisions that are on, in field order."""
    return tuple(
        field.name
        for field in dataclasses.fields(policy)
        if field.type == "bool" and getattr(policy, field.name)
    )


def cell(policy: StopPolicy) -> str:
    return "".join(LETTERS[name] for name in active(policy)) or "-"


def reachable(body: SplitBody, facts: SchedulerFacts) -> bool:
    """Whether a scheduler of this body can have these facts: checkpoint blocks
    from 0.29.0 (a body with internal checkpointing), the backend off the
    manager's grid and a manager that leaves scratch blocks in place only on
    0.30.0-0.31.0 (where ``ckpt+draft`` stands for a build with a newer
    manager), a manager that re-keys the checkpoint's column from 0.30.0."""
    if facts.rekeys_checkpoint:
        return body.internal_checkpoint is InternalCheckpoint.OBSERVED
    if facts.backend_off_manager_grid or facts.skips_scratch_move:
        return body.checkpoint_grid is CheckpointGrid.PREFIX_MATCH_UNIT
    if facts.reserves_checkpoints:
        return body.internal_checkpoint is not InternalCheckpoint.NONE
    return True


def label(body: SplitBody) -> str:
    """A body's name; a nightly-only body's (its first and last build, 45
    characters) is shortened to ``main`` and its fingerprint's first 8 digits."""
    return body.name if body.releases else f"main {body.fingerprint[:8]}"


def table_rows() -> list[str]:
    """``body facts|full: dense zero R=4B|kept: ...|grid: ...``."""
    rows = []
    for body in BODIES:
        for facts_name, facts in FACTS.items():
            if not reachable(body, facts):
                continue
            cells = [
                " ".join(
                    f"{cell(StopPolicy.decide(mode, body, retention, facts, B)):<5}"
                    for retention in RETENTIONS.values()
                )
                for mode in FIXING_MODES
            ]
            row = f"{label(body):<13} {facts_name:<10}|" + "|".join(cells)
            rows.append(row.rstrip())
    return rows


# body         facts     |full: dense zero R=4B|kept: the same  |grid: the same   |lean: the same
EXPECTED = [
    "0.15.0-0.16.0 plain     |bac   bac   bac  |bac   b     b    |aM    M     M    |bac   be    be",
    "0.15.0-0.16.0 draft     |bac   bac   bac  |bac   b     b    |aM    M     M    |bac   be    be",
    "0.15.0-0.16.0 narrow    |ba    ba    ba   |ba    b     b    |aM    M     M    |ba    be    be",
    "0.17.0-0.22.1 plain     |bac   bac   bac  |bac   b     b    |aM    M     M    |bac   be    be",
    "0.17.0-0.22.1 draft     |bac   bac   bac  |bac   b     b    |aM    M     M    |bac   be    be",
    "0.17.0-0.22.1 narrow    |ba    ba    ba   |ba    b     b    |aM    M     M    |ba    be    be",
    "0.23.0        plain     |bac   bac   bac  |bac   b     b    |aM    M     M    |bac   be    be",
    "0.23.0        draft     |bac   bac   bac  |bac   b     b    |aM    M     M    |bac   be    be",
    "0.23.0        narrow    |ba    ba    ba   |ba    b     b    |aM    M     M    |ba    be    be",
    "0.24.0-0.25.1 plain     |bac   bac   bac  |bac   b     b    |aM    M     M    |bac   be    be",
    "0.24.0-0.25.1 draft     |bac   bac   bac  |bac   b     b    |aM    M     M    |bac   be    be",
    "0.24.0-0.25.1 narrow    |ba    ba    ba   |ba    b     b    |aM    M     M    |ba    be    be",
    "main 3342053d plain     |bac   bac   bac  |bac   b     b    |a     -     -    |bac   be    be",
    "main 3342053d draft     |bac   bac   bac  |bac   b     b    |aM    M     M    |bac   be    be",
    "main 3342053d narrow    |ba    ba    ba   |ba    b     b    |a     -     -    |ba    be    be",
    "0.26.0        plain     |bac   bac   bac  |bac   b     b    |a     -     -    |bac   be    be",
    "0.26.0        draft     |bac   bac   bac  |bac   b     b    |aM    M     M    |bac   be    be",
    "0.26.0        narrow    |ba    ba    ba   |ba    b     b    |a     -     -    |ba    be    be",
    "main 3824cac5 plain     |bac   bac   bac  |bac   b     b    |a     -     -    |bac   be    be",
    "main 3824cac5 draft     |bac   bac   bac  |bac   b     b    |aM    M     M    |bac   be    be",
    "main 3824cac5 narrow    |ba    ba    ba   |ba    b     b    |a     -     -    |ba    be    be",
    "0.27.0-0.28.0 plain     |bac   bac   bac  |bac   b     b    |a     -     -    |bac   be    be",
    "0.27.0-0.28.0 draft     |bac   bac   bac  |bac   b     b    |a     -     -    |bac   be    be",
    "0.27.0-0.28.0 narrow    |ba    ba    ba   |ba    b     b    |a     -     -    |ba    be    be",
    "main cd84653e plain     |back  back  back |back  bk    bk   |ak    k     k    |back  bke   bke",
    "main cd84653e ckpt      |bauck bauck bauck|bauck buk   buk  |auk   uk    uk   |bauck buke  buke",
    "main cd84653e draft     |back  back  back |back  bk    bk   |ak    k     k    |back  bke   bke",
    "main cd84653e ckpt+draft|bauck bauck bauck|bauck buk   buk  |auk   uk    uk   |bauck buke  buke",
    "main cd84653e narrow    |bak   bak   bak  |bak   bk    bk   |ak    k     k    |bak   bke   bke",
    "main b6efabe6 plain     |bawc  bawc  bawc |bawc  bw    bw   |a     -     -    |bawc  bwe   bwe",
    "main b6efabe6 ckpt      |bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwe   bwe",
    "main b6efabe6 draft     |bawc  bawc  bawc |bawc  bw    bw   |a     -     -    |bawc  bwe   bwe",
    "main b6efabe6 ckpt+draft|bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwe   bwe",
    "main b6efabe6 stays     |baswc baswc baswc|baswc bsw   bsw  |amsw  msw   msw  |baswc bswe  bswe",
    "main b6efabe6 off-grid  |bawc  bawc  bawc |bawc  bawc  bawc |amw   amw   amw  |bawc  bawc  bawc",
    "main b6efabe6 rekeys    |bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwey  bwey",
    "main b6efabe6 narrow    |baw   baw   baw  |baw   bw    bw   |a     -     -    |baw   bwe   bwe",
    "0.29.0        plain     |back  back  back |back  bk    bk   |ak    k     k    |back  bke   bke",
    "0.29.0        ckpt      |bauck bauck bauck|bauck buk   buk  |auk   uk    uk   |bauck buke  buke",
    "0.29.0        draft     |back  back  back |back  bk    bk   |ak    k     k    |back  bke   bke",
    "0.29.0        ckpt+draft|bauck bauck bauck|bauck buk   buk  |auk   uk    uk   |bauck buke  buke",
    "0.29.0        narrow    |bak   bak   bak  |bak   bk    bk   |ak    k     k    |bak   bke   bke",
    "0.30.0        plain     |bawc  bawc  bawc |bawc  bw    bw   |a     -     -    |bawc  bwe   bwe",
    "0.30.0        ckpt      |bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwe   bwe",
    "0.30.0        draft     |bawc  bawc  bawc |bawc  bw    bw   |a     -     -    |bawc  bwe   bwe",
    "0.30.0        ckpt+draft|bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwe   bwe",
    "0.30.0        stays     |baswc baswc baswc|baswc bsw   bsw  |amsw  msw   msw  |baswc bswe  bswe",
    "0.30.0        off-grid  |bawc  bawc  bawc |bawc  bawc  bawc |amw   amw   amw  |bawc  bawc  bawc",
    "0.30.0        rekeys    |bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwey  bwey",
    "0.30.0        narrow    |baw   baw   baw  |baw   bw    bw   |a     -     -    |baw   bwe   bwe",
    "0.31.0        plain     |bawc  bawc  bawc |bawc  bw    bw   |a     -     -    |bawc  bwe   bwe",
    "0.31.0        ckpt      |bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwe   bwe",
    "0.31.0        draft     |bawc  bawc  bawc |bawc  bw    bw   |a     -     -    |bawc  bwe   bwe",
    "0.31.0        ckpt+draft|bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwe   bwe",
    "0.31.0        stays     |baswc baswc baswc|baswc bsw   bsw  |amsw  msw   msw  |baswc bswe  bswe",
    "0.31.0        off-grid  |bawc  bawc  bawc |bawc  bawc  bawc |amw   amw   amw  |bawc  bawc  bawc",
    "0.31.0        rekeys    |bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwey  bwey",
    "0.31.0        narrow    |baw   baw   baw  |baw   bw    bw   |a     -     -    |baw   bwe   bwe",
    "0.32.0        plain     |bawc  bawc  bawc |bawc  bw    bw   |a     -     -    |bawc  bwe   bwe",
    "0.32.0        ckpt      |bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwe   bwe",
    "0.32.0        draft     |bawc  bawc  bawc |bawc  bw    bw   |a     -     -    |bawc  bwe   bwe",
    "0.32.0        ckpt+draft|bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwe   bwe",
    "0.32.0        rekeys    |bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwey  bwey",
    "0.32.0        narrow    |baw   baw   baw  |baw   bw    bw   |a     -     -    |baw   bwe   bwe",
    "0.33.0-0.34.0 plain     |bawc  bawc  bawc |bawc  bw    bw   |a     -     -    |bawc  bwe   bwe",
    "0.33.0-0.34.0 ckpt      |bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwe   bwe",
    "0.33.0-0.34.0 draft     |bawc  bawc  bawc |bawc  bw    bw   |a     -     -    |bawc  bwe   bwe",
    "0.33.0-0.34.0 ckpt+draft|bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwe   bwe",
    "0.33.0-0.34.0 rekeys    |bawc  bawc  bawc |bawc  bw    bw   |amw   mw    mw   |bawc  bwey  bwey",
    "0.33.0-0.34.0 narrow    |baw   baw   baw  |baw   bw    bw   |a     -     -    |baw   bwe   bwe",
]


def test_the_policy_table_is_pinned() -> None:
    found = table_rows()
    if found != EXPECTED:
        diff = "\n".join(difflib.unified_diff(EXPECTED, found, lineterm=""))
        pytest.fail(f"the stop policy changed:\n{diff}")


def test_every_decision_is_a_documented_boolean_field() -> None:
    """Each decision is a card: a field of its own with a docstring in the
    module source (why, releases, vLLM's reference, delete when)."""
    import inspect

    from vllm_mamba_align import policy

    source = inspect.getsource(policy.StopPolicy)
    for name in LETTERS:
        card = source.split(f"    {name}: bool\n", 1)
        assert len(card) == 2, f"{name} is not a field of StopPolicy"
        text = " ".join(card[1].split('"""')[1].split())
        assert "Releases:" in text, f"{name}: no releases on its card"
        assert "Delete when:" in text, f"{name}: no deletion condition"


@pytest.mark.parametrize("mode", [Mode.OFF, Mode.AUDIT])
def test_modes_that_bind_no_fix_have_no_policy(mode: Mode) -> None:
    with pytest.raises(ValueError, match="binds no fix"):
        StopPolicy.decide(mode, BODIES[-1], RETENTIONS["dense"], FACTS["plain"], B)


def test_a_policy_is_one_frozen_value() -> None:
    found = StopPolicy.decide(
        Mode.FULL, BODIES[-1], RETENTIONS["dense"], FACTS["plain"], B
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.stop_at_boundaries = False  # type: ignore[misc]
    same = StopPolicy.decide(
        Mode.FULL, BODIES[-1], RETENTIONS["dense"], FACTS["plain"], B
    )
    assert found == same and hash(found) == hash(same)
