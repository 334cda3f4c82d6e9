"""``--async-scheduling`` (vLLM's ``AsyncScheduler``), on the real scheduler.

The async scheduler subclasses ``Scheduler`` without overriding the split, and
its engine core schedules step N+1 before it has processed step N's output
(output placeholders stand in for the tokens in flight). The simulation drives
it that way. The fix must reach that class and hold the same invariants: no
wrong publication, no wrong reuse, every kept state saved in ``full``/``kept``.
"""

from __future__ import annotations

import pytest
from helpers import (
    async_republishes_partial_tail,
    geometry_rule,
    lost_kept_states,
    scheduler_mode,
)
from random_workloads import drafters_build

from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt

B, P, BUDGET = 1648, 16764, 8192


def _geometry(
    retention: int | str | None, speculative: tuple[str, int] | None = None
) -> Geometry:
    cache_block = {"any": 816, "divisor": 824}.get(geometry_rule())
    if cache_block is None:
        pytest.skip("this vLLM refuses a cache block smaller than B at startup")
    return Geometry(
        cache_block,
        B,
        BUDGET,
        retention=retention,
        async_scheduling=True,
        speculative=speculative,
    )


def _concurrent(
    mode: str,
    retention: int | str | None,
    tail: int = 3001,
    speculative: tuple[str, int] | None = None,
) -> Simulation:
    """A prompt; then, all at once, a re-ask, two siblings sharing 5,000 and
    9,000 tokens and a long-decoding request (the async placeholders).

    Prompt lengths are off the hash grid (16) unless ``tail`` puts them on it:
    a prompt ending there meets vLLM's own async defect on some releases (see
    helpers.async_republishes_partial_tail), tested apart."""
    first = prompt(P, seed=1)
    with scheduler_mode(mode):
        sim = Simulation(_geometry(retention, speculative))
        assert type(sim.scheduler).__name__ == "AsyncScheduler"
        sim.add("first", first, max_tokens=40)
        sim.run()
        sim.add("re-ask", first, max_tokens=20)
        sim.add("sibling", first[:5000] + prompt(tail, seed=2), max_tokens=30)
        sim.add("deep-sibling", first[:9000] + prompt(tail, seed=3))
        sim.add("other", prompt(tail + 1000, seed=4), max_tokens=60)
        sim.run()
    return sim


@pytest.mark.parametrize("retention", ["default", None])
@pytest.mark.parametrize("mode", ["full", "kept", "grid", "lean"])
def test_the_fix_holds_under_async_scheduling(
    mode: str, retention: int | str | None
) -> None:
    sim = _concurrent(mode, retention)
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
    assert not sim.wrong_reuse
    assert all(r.prefilled_at_step is not None for r in sim.records.values())
    if mode != "grid":
        assert lost_kept_states(sim, mode) == []
    if mode == "full":  # the fix reached the async scheduler's split
        assert sim.chunk_ends("first")[:10] == [k * B for k in range(1, 11)]
    assert sim.reused("re-ask") > 0
    if retention is None:  # at vLLM's default its state at 8,240 was dropped
        assert sim.reused("deep-sibling") % B == 0 < sim.reused("deep-sibling")


@pytest.mark.parametrize("drafter", [("mtp", 2), ("eagle", 3)])
@pytest.mark.parametrize("mode", ["off", "full", "kept", "grid"])
def test_async_scheduling_with_a_drafter(mode: str, drafter: tuple[str, int]) -> None:
    """vLLM's default for a hybrid model served with MTP or EAGLE: it turns
    async scheduling on with those drafters (config/vllm.py, 0.18.1+). The
    scheduler then sees only draft placeholders; the worker model accepts every
    draft (see Simulation._accepted). Stock publishes wrong states here too;
    every mode holds the invariants, and decode verifies drafts past
    boundaries."""
    if not drafters_build():
        pytest.skip("this vLLM cannot build a drafter's config on CPU")
    sim = _concurrent(mode, None, speculative=drafter)
    assert sim.accepted_drafts > 0
    if mode == "off":
        assert sim.poisoned
        return
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
    assert not sim.wrong_reuse
    assert all(r.prefilled_at_step is not None for r in sim.records.values())
    if mode != "grid":
        assert sim.missing_kept == []
    assert sim.reused("re-ask") > 0
    assert sim.reused("deep-sibling") % B == 0 < sim.reused("deep-sibling")


def test_stock_async_scheduling_publishes_wrong_states() -> None:
    """The control: the same workload on stock vLLM's async scheduler."""
    sim = _concurrent("off", None)
    assert sim.poisoned


@pytest.mark.parametrize("mode", ["off", "full"])
def test_vllm_own_async_defect_is_the_only_wrong_publication(mode: str) -> None:
    """Where vLLM's async scheduling republishes a prompt's partial-tail state
    on the block its first decode overwrites (its own defect, stock and plugin
    alike), that is all ``full`` publishes wrong: prompts of 8,000 and 4,000
    tokens (on the hash grid) give exactly state@8000 and state@4000 holding
    the state one token later."""
    if not async_republishes_partial_tail():
        pytest.skip("this vLLM's async scheduling does not republish the tail")
    sim = _concurrent(mode, None, tail=3000)
    wrong = {
        (p.claimed[0], p.held[0] if p.held else None) for p in sim.poisoned.values()
    }
    if mode == "full":
        assert wrong <= {(8000, 8001), (4000, 4001), (12000, 12001)}, wrong
    assert {(8000, 8001), (4000, 4001)} <= wrong


def test_a_boundary_reached_by_a_sampled_token_is_no_prompt_state() -> None:
    """A 1,343-token prompt, C = B = 448, two output tokens. The block ending at
    1,344 holds the prompt plus the first sampled token; under async scheduling
    it is published once the decode step in flight computed it. On 0.15.1-0.16.0
    that step still counts as prefill (no output processed yet), so the oracle
    sees a kept state computed by a one-token chunk. It is right (not wrong,
    not missing), and no chunking of the prompt could make it canonical:
    ``full``'s canonical promise covers prompt states only (found by the
    release matrix on 0.16.0)."""
    geometry = Geometry(448, 448, 448, max_num_seqs=1, async_scheduling=True)
    with scheduler_mode("full"):
        sim = Simulation(geometry)
        sim.add("r0", prompt(1343, seed=100), max_tokens=2)
        sim.add("r1", prompt(1, seed=101))
        sim.run()
    assert sim.chunk_ends("r0") == [448, 896, 1343]
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
    assert sim.missing_kept == []
    assert sim.noncanonical_kept == []
