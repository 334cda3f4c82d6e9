"""The plugin under concurrent load, judged by a witness that shares no code
with it (tests/witness: its own model of the worker's Mamba writes, written
from vLLM's align-mode contract, and its own engine and workloads).

Each mode runs every workload in a fresh process that loads the plugin the way
users do, through vLLM's plugin loader (``report.run_mode``). Stock vLLM
publishes wrong states wherever C < B; every fixing mode publishes and reads
none; ``kept``, ``full`` and the default also write every state vLLM keeps;
and the judge fails a plugin broken on purpose
(tests/support/witness_fault_plugin): its retention model (lost kept states),
its split run on C's grid, its junction stops or its replay-boundary stops
left out (wrong publications). That the witness reaches no code of the
plugin is checked without vLLM: tests/unit/test_witness_independence.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from witness.report import FIXING, MATERIALIZING, PUBLISHING_FAULTS, run_mode
from witness.workloads import (
    STATE_BLOCK,
    checkpoint_setting,
    draft_setting,
    drafter_block,
    retention_setting,
    tokens_of,
    workloads,
)

CHECKPOINT_WORKLOAD = "concurrent, backend checkpoints"

pytestmark = pytest.mark.random_workloads


def _needs_witness_release() -> None:
    """The workloads need a drafter's group smaller than B, which vLLM
    0.20.2-0.27.1 refuse at startup (their other checks run elsewhere)."""
    if drafter_block() is None:
        pytest.skip("this vLLM refuses a group block smaller than B at startup")


def test_stock_vllm_publishes_wrong_states_under_load() -> None:
    """Without the plugin, where C < B, the witness finds Mamba blocks
    hashed as states they do not hold: in every such workload where C does not
    divide B (0.28.0+; the drafter workloads, verifying and rejecting draft
    tokens, among them), in some where it does (0.18.1: chunks end on C's grid,
    sometimes on B's too); and chunks that read a wrong state. The process
    never imported the plugin's package (the judge did not either)."""
    _needs_witness_release()
    stock = run_mode("stock")
    wrong = {}
    for workload in workloads():
        line = stock[workload.name]
        assert not line["patched"]
        assert not line["plugin_imported_at_end"], "the witness imported the plugin"
        if workload.stock_wrong:
            wrong[workload.name] = line["findings"]["wrong_publications"]
        for event in ("draft_steps", "drafts_rejected"):
            if event in workload.expects:
                assert line["findings"][event] > 0, (workload.name, event)
    block = drafter_block()
    assert block is not None
    if STATE_BLOCK % block:
        assert all(wrong.values()), wrong
    assert sum(wrong.values()) > 0, wrong
    assert sum(line["findings"]["wrong_reads"] for line in stock.values()) > 0


@pytest.mark.parametrize("mode", FIXING)
def test_no_wrong_state_published_or_read_under_load(mode: str) -> None:
    """Every fixing mode, loaded by vLLM's plugin loader: no Mamba block
    hashed as a state it does not hold, no chunk reading a state other than
    its own prefix's, every request not aborted finished; ``kept``, ``full``
    and the default also leave no state vLLM keeps unwritten. And the load
    really happened: preemptions, priority preemptions of prefills in
    progress, aborts in prefill and decode, the backend's prefill checkpoints
    written (GPU backends' Mamba spec, vLLM 0.32.0-0.34.0), where each
    workload expects them, and cache hits in every workload."""
    _needs_witness_release()
    results = run_mode(mode)
    for workload in workloads():
        line = results[workload.name]
        findings, events = line["findings"], line["events"]
        where = f"{mode}, {workload.name}: {findings['examples']}"
        assert line["patched"] and line["plugin_loaded_by_vllm"], where
        assert findings["wrong_publications"] == 0, where
        assert findings["wrong_reads"] == 0, where
        assert findings["publications"] > 0 and findings["reads"] > 0, where
        if mode in MATERIALIZING:
            assert findings["lost_kept_states"] == 0, where
        assert events["unfinished"] == [], where
        counts = {**findings, **events}
        for event in workload.expects:
            assert counts[event] > 0, f"{mode}, {workload.name}: no {event}"


def test_the_witness_fails_a_broken_retention_model() -> None:
    """With the plugin's retention model broken on purpose (it believes vLLM
    keeps no state: tests/support/witness_fault_plugin, loaded by name),
    ``kept`` runs past boundaries whose states vLLM keeps, and the witness
    sees them unwritten, where the intact plugin leaves none."""
    _needs_witness_release()
    broken = run_mode("kept, retention model broken")
    lost = {name: line["findings"]["lost_kept_states"] for name, line in broken.items()}
    assert sum(lost.values()) > 0, lost
    intact = run_mode("kept")
    assert all(line["findings"]["lost_kept_states"] == 0 for line in intact.values())


@pytest.mark.parametrize("fault", PUBLISHING_FAULTS)
def test_the_witness_catches_a_plugin_that_publishes_wrong_states(fault: str) -> None:
    """The default mode broken on purpose (tests/support/witness_fault_plugin,
    built from the plugin's own stop policy, outside its serving code): its
    split on C's grid instead of B's, or lean without its stops at junctions
    or at replay boundaries (where the Mamba spec declares no backend
    prefill checkpoints, as CPU engines run, none covers a replay boundary).
    Each publishes Mamba blocks
    as states they do not hold, and the witness counts them, where the intact
    default mode publishes none (the test above, "mode unset")."""
    _needs_witness_release()
    block = drafter_block()
    if (
        fault == "unset, split on C's grid"
        and block is not None
        and STATE_BLOCK % block == 0
    ):
        pytest.skip("C divides B here: chunks stopped on C's grid also end on B's")
    if fault != "unset, split on C's grid" and not retention_setting():
        pytest.skip("every state is kept here: lean stops at every boundary")
    broken = run_mode(fault)
    assert all(line["patched"] for line in broken.values())
    wrong = {
        name: line["findings"]["wrong_publications"] for name, line in broken.items()
    }
    assert sum(wrong.values()) > 0, wrong


@pytest.mark.parametrize("alignment", [1, STATE_BLOCK])
def test_the_judge_places_checkpoints_where_vllm_does(alignment: int) -> None:
    """The judge's own statement of where the backend writes its prefill
    checkpoint (``Witness.backend_checkpoint``) agrees with vLLM's
    ``compute_mamba_prefill_checkpoints`` on every chunk ``[start, end)`` of
    the first 8 Mamba blocks, for the witness's scheduler of a checkpoint
    workload (its hash block, cache-hit alignment and B)."""
    if not checkpoint_setting():
        pytest.skip("no backend checkpoint rule the judge follows in this vLLM")
    from vllm.model_executor.layers.mamba.checkpoint import (
        compute_mamba_prefill_checkpoints,
    )

    from witness.engine import build_scheduler
    from witness.judge import Witness

    (workload,) = (w for w in workloads() if w.name == CHECKPOINT_WORKLOAD)
    shape = replace(workload.shape, prefill_checkpoint_alignment=alignment)
    scheduler = build_scheduler(shape)
    try:
        witness = Witness(scheduler, tokens_of)
        kv = scheduler.kv_cache_config
        limit = 8 * STATE_BLOCK
        found = 0
        for start in range(limit):
            for end in range(start + 1, limit + 1):
                (offset,), (column,) = compute_mamba_prefill_checkpoints(
                    [end],
                    [end - start],
                    hash_block_size=kv.hash_block_size,
                    mamba_block_size=STATE_BLOCK,
                    checkpoint_alignment=alignment,
                    drop_eagle_block=False,
                    cache_hit_alignment_tokens=kv.cache_hit_alignment_tokens,
                )
                expected = (start + offset, column) if offset else None
                assert witness.backend_checkpoint(start, end) == expected, (
                    start,
                    end,
                )
                found += expected is not None
        assert found > 0
    finally:
        scheduler.shutdown()


def _drafter_workloads() -> list[str]:
    return [w.name for w in workloads() if w.shape.drafts]


def test_draft_steps_are_judged_where_mirrored() -> None:
    """Workloads with a real speculative config (MTP, 1 to 3 draft tokens) are
    listed where the judge mirrors the worker's rule for speculative Mamba
    states and runs them (vLLM 0.33.0 and 0.34.0,
    ``workloads.DRAFT_WORKLOAD_RELEASES``), each required to verify and reject
    drafts in every mode (``Workload.expects``, checked by the tests above,
    stock's wrong publications among them)."""
    if not draft_setting():
        pytest.skip(
            "the drafter workloads run on vLLM 0.33.0 and 0.34.0 "
            "(witness.workloads.DRAFT_WORKLOAD_RELEASES; the judge refuses draft "
            "steps on releases outside witness.judge.DRAFT_RULE_RELEASES)"
        )
    drafted = [w for w in workloads() if w.shape.drafts]
    assert sorted(w.shape.drafts for w in drafted) == [1, 2, 3], drafted
    for workload in drafted:
        assert workload.stock_wrong and STATE_BLOCK % (drafter_block() or 1)
        assert {"draft_steps", "drafts_rejected", "cache_hits"} <= set(workload.expects)


def test_the_judge_refuses_draft_steps_it_does_not_mirror(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step that verifies draft tokens, on a release whose worker rule the
    judge has not mirrored, is refused, never judged by a guess: here every
    release is made unknown to it, and one request decodes with a drafter."""
    _needs_witness_release()
    from witness import judge
    from witness.engine import Shape
    from witness.workloads import Arrival, Workload, drive

    monkeypatch.setattr(judge, "DRAFT_RULE_RELEASES", ())
    shape = Shape(STATE_BLOCK, STATE_BLOCK, drafter_block(), drafts=1)
    prompt = tuple(range(1, 2 * STATE_BLOCK))
    workload = Workload("refused", shape, (Arrival(0, "r0", prompt, 8),))
    try:
        drive(workload)
    except NotImplementedError as refusal:
        assert "speculative" in str(refusal)
    else:
        pytest.fail("the judge judged draft steps it does not mirror")


def test_the_judge_copies_after_a_step_where_vllm_does() -> None:
    """The judge's copy after a verify step (``judge.post_step_copy``)
    agrees with vLLM's own ``mamba_state_copy_boundary`` (0.34.0,
    vllm/v1/worker/replayssm_utils.py; a Triton function, called here as the
    plain Python it is without Triton, or through its ``fn``) for every
    running-state length and accepted count of the first 8 blocks, B = 96 and
    64. vLLM 0.33.0 has the same arithmetic inline in
    ``postprocess_mamba_fused_kernel`` (mamba_utils.py), where no function
    can be called."""
    try:
        from vllm.v1.worker.replayssm_utils import mamba_state_copy_boundary
    except ImportError:
        pytest.skip("this vLLM has no mamba_state_copy_boundary (0.34.0+)")
    from witness.judge import post_step_copy

    boundary = getattr(mamba_state_copy_boundary, "fn", mamba_state_copy_boundary)
    copies = 0
    for grid in (STATE_BLOCK, 64):
        for running in range(1, 8 * grid):
            for accepted in range(1, 5):
                computed = running + accepted - 1
                needs, bias, target = boundary(running, computed, grid)
                expected = (int(bias), int(target)) if needs else None
                assert post_step_copy(running, computed, grid) == expected, (
                    grid,
                    running,
                    accepted,
                )
                copies += expected is not None and expected[0] > 0
    assert copies > 0
