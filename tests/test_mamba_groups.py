"""Two Mamba groups of one B, each with its own backend checkpoint facts.

Qwen4Exp (vLLM 0.33.0-0.34.0, models/qwen4_exp/nvidia/model.py:907-926 in
0.34.0) has a GDN spec and a PLE short-conv spec, two Mamba groups; on GPUs
both declare a prefill checkpoint block with the same alignment (the
checkpoint grid, ``get_mamba_prefill_checkpoint_grid``: B without a
prefix-match unit; ple_layer.py:202-220, qwen_gdn_linear_attn.py:911).
vLLM's scheduler decides whether a chunk is checkpointed inside with the first
Mamba group's alignment (scheduler.py:445-454, a TODO), while each manager
reserves and the worker writes by its own group's. With different alignments
(synthetic: 16 and B; 1 and 16) a chunk can carry the checkpoint in one group
and not in the other. The plugin skips a stop for a state only where every
group's backend writes it (``checkpoints.checkpoint_alignments``).

Judged by the witness (tests/witness), which writes each group's checkpoint by
that group's own spec: no wrong publication or read, every request finished,
and in ``lean``, ``kept`` and ``full`` every state vLLM keeps written. Stock
vLLM loses the replay boundary (64) of the second group in the unequal cases
(no wrong state: its column is the null block); ``off`` and ``audit``
schedule as stock.
"""

from __future__ import annotations

import random

import pytest
from helpers import installed_body
from judged_runs import Run, run

from vllm_mamba_align.releases import InternalCheckpoint

B = 64
MATERIALIZING = ("lean", "kept", "full")
FIXING = (*MATERIALIZING, "grid")
AS_STOCK = ("off", "audit")

CASES = {
    # name: (attention block C, first group's alignment, second group's, prompt)
    # Qwen4Exp as vLLM builds it: both groups on the checkpoint grid B; at 70
    # tokens the checkpoint (64) is the replay boundary, written in both.
    "qwen4exp-equal": (16, B, B, 70),
    # The first group writes the state at 80 (hash block 16) into the replay
    # boundary's column, the second (alignment B) does not.
    "16-and-B": (16, 16, B, 90),
    # Hash block 8: the first writes 72, the second (72 % 16 != 0) does not.
    "1-and-16": (8, 1, 16, 78),
    # The scheduler decides by the first group (B): no in-chunk checkpoint.
    "B-and-16": (16, B, 16, 90),
}


def _shape(case: str) -> object:
    from witness.engine import Shape

    attention, first, second, _ = CASES[case]
    return Shape(
        state_block=B,
        attention_block=attention,
        budget=2048,
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=first,
        second_mamba=(1, second),
    )


def _requests(case: str) -> list[tuple[str, list[int]]]:
    rng = random.Random(case)
    prompt = [rng.randrange(1, 500) for _ in range(CASES[case][3])]
    return [("first", prompt), ("re-ask", prompt)]


def _skip_unless_checkpoint_rule() -> None:
    from witness.judge import mirrors_backend_checkpoints

    if installed_body().internal_checkpoint is not InternalCheckpoint.OBSERVED:
        pytest.skip("checkpoint alignments per Mamba spec: vLLM 0.30.0+")
    if not mirrors_backend_checkpoints():
        pytest.skip("the witness mirrors backend checkpoints on 0.32.0-0.34.0")


_stock: dict[str, Run] = {}


def _stock_run(case: str) -> Run:
    if case not in _stock:
        _stock[case] = run("stock", _shape(case), _requests(case))
    return _stock[case]


@pytest.mark.parametrize("case", CASES)
def test_every_fixing_mode_holds_the_invariant_with_two_mamba_groups(
    case: str,
) -> None:
    """Every fixing mode: nothing wrong published or read, prefill finished;
    lean, kept and full: every kept state written in both groups, and the
    re-ask reuses it."""
    _skip_unless_checkpoint_rule()
    shape, requests = _shape(case), _requests(case)
    for mode in FIXING:
        result = run(mode, shape, requests)
        assert not result.sound(mode in MATERIALIZING), (mode, result.chunks)
        if mode in MATERIALIZING:
            assert result.hits["re-ask"] >= B, (mode, result.hits)
    if case == "qwen4exp-equal":
        # Both groups' backends write the replay boundary: no stop spent on it.
        assert (0, 64) not in run("kept", shape, requests).chunks["first"]


@pytest.mark.parametrize("case", ["16-and-B", "1-and-16"])
def test_stock_loses_the_second_groups_boundary_and_off_schedules_as_stock(
    case: str,
) -> None:
    """vLLM's own behaviour, recorded: it checkpoints the prompt's final chunk
    by the first group's alignment, so the second group's replay boundary is
    never written (a lost state, not a wrong one). ``off`` and ``audit``
    schedule exactly as stock."""
    _skip_unless_checkpoint_rule()
    stock = _stock_run(case)
    assert stock.findings.lost_kept_states > 0
    assert not stock.findings.wrong_publications
    for mode in AS_STOCK:
        assert run(mode, _shape(case), _requests(case)).chunks == stock.chunks, mode
