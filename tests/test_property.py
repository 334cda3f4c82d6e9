"""Property-based: random geometries and workloads on the real scheduler.

For every drawn case (vLLM's default state retention, dense, or a segment
interval R), with the plugin in ``full``, ``kept``, ``grid`` and ``lean`` mode:
no Mamba hash is published over a state its slot does not hold, no request
resumes from a wrong state, nothing stalls, every request finishes its prefill;
``full``, ``kept`` and ``lean`` materialize every boundary state vLLM keeps,
``full``'s kept states are canonical (one B block per chunk from token 0;
states continued from vLLM's partial-tail checkpoint, which lies off the grid,
are counted apart); at retention 0 ``kept`` schedules exactly like ``grid``
wherever ``grid`` already materializes every kept state, under dense retention
exactly like ``full`` (and ``lean`` like both). In equal geometry ``grid`` mode
schedules exactly like stock vLLM, except where stock publishes a wrong state
(0.30.0+ drops its stop after a mid-block start for a chunk it checkpoints
internally; ``grid`` keeps it).

Profiles: ``ci`` (default, quick) and ``long`` (HYPOTHESIS_PROFILE=long, 2,000
cases per test). The 10^5-workload sweep is ``test_sweep.py``.
"""

from __future__ import annotations

import pytest
from helpers import geometry_rule, installed_body, supports_retention_setting
from hypothesis import Phase, event, find, given, reject, settings
from hypothesis import strategies as st
from random_workloads import (
    HypothesisDraw,
    RetentionWatch,
    Unrunnable,
    VllmDefect,
    Workload,
    check_mode,
    dimensions,
    drafter_tail_unaligned,
    draw_workload,
    keeps_every_boundary,
    scratch_blocks_published_possible,
    unwritten_checkpoints_possible,
)
from random_workloads import simulate as run_case

from vllm_mamba_align.releases import CheckpointGrid
from vllm_mamba_align.settings import DEFAULT_MODE
from vllm_mamba_align.tools.modes import DEFAULT
from vllm_mamba_align.tools.sim import Simulation

pytestmark = pytest.mark.random_workloads


@st.composite
def workloads(
    draw: st.DrawFn, equal_geometry: bool = False, unset_hash_block: bool = False
) -> Workload:
    return draw_workload(HypothesisDraw(draw), equal_geometry, unset_hash_block)


def simulate(mode: str, workload: Workload) -> Simulation:
    try:
        return run_case(mode, workload)
    except Unrunnable:
        reject()
        raise  # unreachable: reject() raises
    except VllmDefect as defect:
        event(f"vLLM's own defect: {defect}")
        reject()
        raise  # unreachable


def check(mode: str, workload: Workload, sim: Simulation) -> None:
    """:func:`random_workloads.check_mode`, the case redrawn where the wrong
    states are vLLM's own (:class:`VllmDefect`, recorded as an event)."""
    try:
        check_mode(mode, workload, sim)
    except VllmDefect as defect:
        event(f"vLLM's own defect: {defect}")
        reject()


@given(workloads())
def test_fixed_scheduler_never_poisons_and_always_finishes(workload: Workload) -> None:
    runs = {}
    for mode in ("full", "kept", "grid", "lean"):
        sim = runs[mode] = simulate(mode, workload)
        check(mode, workload, sim)
    for label in dimensions(workload, runs["full"]):
        event(label)
    interval = runs["kept"].retention_interval
    checkpointed = workload.geometry.prefill_checkpoint is not None
    # vLLM's own stops already land on every kept boundary at retention 0, so
    # kept adds none; where they do not (0.29.0's replay stop when B divides P;
    # with backend checkpoints a final chunk that runs past the replay boundary)
    # kept stops there and grid loses the state.
    if interval == 0 and not checkpointed and not runs["grid"].missing_kept:
        for req_id, record in runs["grid"].records.items():
            assert runs["kept"].chunk_ends(req_id) == [c.end for c in record.chunks]
    elif interval == 0:
        event("retention 0: grid lost a kept state that kept saved")
    if keeps_every_boundary(workload, runs["kept"]):
        for req_id, record in runs["full"].records.items():
            assert runs["kept"].chunk_ends(req_id) == [c.end for c in record.chunks]
            assert runs["lean"].chunk_ends(req_id) == [c.end for c in record.chunks]


@settings(max_examples=30)
@given(workloads())
def test_without_a_mode_setting_the_default_mode_schedules(workload: Workload) -> None:
    """A run without ``VLLM_MAMBA_ALIGN_MODE`` is the default mode's run: the
    same chunks for every request, and what that mode holds."""
    unset = simulate(DEFAULT, workload)
    check(DEFAULT, workload, unset)
    chosen = simulate(DEFAULT_MODE.value, workload)
    for req_id, record in chosen.records.items():
        assert unset.chunk_ends(req_id) == [c.end for c in record.chunks]


@given(workloads())
def test_the_plugin_predicts_every_state_vllm_keeps_or_drops(
    workload: Workload,
) -> None:
    """``kept`` mode and the audit decide by the plugin's model of vLLM's state
    retention (``retention.Retention``). Here it is held against every keep or
    drop decision vLLM's Mamba manager takes when it caches a request's
    blocks, at that moment, in random workloads (the fixed scenarios are
    test_retention.py's)."""
    sim = simulate("kept", workload)
    watch = RetentionWatch.of(sim)
    assert not watch.wrong, watch.wrong[:5]
    dropped = any(not d.kept for d in sim.keep_decisions)
    event("vLLM dropped a state" if dropped else "vLLM kept every state")


@given(workloads(unset_hash_block=True))
def test_full_and_kept_never_poison_with_a_backend_off_the_hash_grid(
    workload: Workload,
) -> None:
    """0.30.0-0.31.0: with prefix_match_unit unset the backend checkpoints on
    prefix_match_unit-or-B, the manager on the engine's hash block; where the
    two differ (C < B) vLLM publishes wrong states itself (stock and grid).
    ``full`` and ``kept`` stop at every boundary there and stay correct."""
    if installed_body().checkpoint_grid is not CheckpointGrid.PREFIX_MATCH_UNIT:
        pytest.skip("0.32.0+ backends checkpoint on the engine's hash grid")
    for mode in ("full", "kept"):
        sim = simulate(mode, workload)
        check(mode, workload, sim)
        off_grid = sim.hash_block != workload.geometry.state_block
        event("backend off the hash grid" if off_grid else "hash block = B")
        if sim.checkpoint_writes:
            event(f"the backend wrote an in-chunk checkpoint ({mode})")


@given(workloads(equal_geometry=True))
def test_grid_mode_is_stock_in_equal_geometry(workload: Workload) -> None:
    """Except where stock publishes a wrong state or loses a kept one (or
    would, were the boundary kept: :func:`what_grids_stops_spare`): 0.30.0+
    drops its stop after a mid-block start for a chunk it checkpoints
    internally, grid keeps it; before 0.27.1 a drafter's unaligned last blocks
    run across a boundary (grid stops there; vLLM's own defect, measured on
    0.18.1: 4 of 400 drafted equal-geometry cases, each with stock publishing
    wrong; on 0.26.0 also one losing a state and one at a dropped boundary); and
    before 0.26.0 a chunk from a KV connector's hit runs on past the next
    boundary (grid adds the stop vLLM makes from 0.26.0)."""
    grid = simulate("grid", workload)
    if unwritten_checkpoints_possible(workload.geometry):
        # The one intended difference: grid ends a chunk on the grid where
        # vLLM 0.29.0 would publish a flashkda checkpoint its backend never
        # writes (B % 16 == 8).
        assert not grid.poisoned, [str(p) for p in grid.poisoned.values()]
        return
    stock = simulate("stock", workload)
    same = all(
        grid.chunk_ends(req_id) == [c.end for c in record.chunks]
        for req_id, record in stock.records.items()
    )
    if not same:
        event("equal geometry: grid kept a stop that stock dropped")
        geometry = workload.geometry
        if scratch_blocks_published_possible(geometry):
            # The route-around for 0.30.0-0.31.0's scratch blocks cuts every
            # chunk that would leave one inside, whether or not the retention
            # keeps (and vLLM publishes) that boundary.
            event("0.30.0-0.31.0: grid cut a chunk around the scratch blocks")
            return
        assert (
            geometry.prefill_checkpoint is not None
            or drafter_tail_unaligned(geometry)
            or (
                geometry.kv_connector is not None
                and not installed_body().stops_after_mid_block_start
            )
        )
        reason = what_grids_stops_spare(grid, stock, geometry.state_block)
        assert reason is not None, "grid changed chunks where stock lost nothing"
        event(f"equal geometry: grid's stops spare {reason}")


def what_grids_stops_spare(
    grid: Simulation, stock: Simulation, state_block: int
) -> str | None:
    """What stock loses where grid ends chunks that stock does not (None:
    nothing). Stock's chunk runs across a B boundary; then it publishes a wrong
    state there, or leaves a state vLLM keeps unwritten (its slot null: no
    reuse), or vLLM's retention drops that boundary (grid's stop costs a chunk
    and spares nothing here, but it is the stop that spares a wrong state
    wherever the boundary is kept: seen on 0.26.0 with MTP and retention 224)."""
    if stock.poisoned:
        return "a wrong state"
    if set(stock.missing_kept) - set(grid.missing_kept):
        return "a lost state"
    kept = {(d.req_id, d.boundary) for d in stock.keep_decisions if d.kept}
    for req_id, record in stock.records.items():
        for end in set(grid.chunk_ends(req_id)) - {c.end for c in record.chunks}:
            crossed = any(c.start < end < c.end for c in record.chunks)
            if end % state_block == 0 and crossed and (req_id, end) not in kept:
                return "nothing: vLLM does not keep that boundary"
    return None


CONTROL_SEARCH = settings(max_examples=400, database=None, phases=[Phase.generate])
"""How a control looks for a workload on which a check fails (stock publishes a
wrong state, grid loses a kept one): up to 400 random workloads, and the first
one found is the answer. A control asserts that such a workload exists; shrinking
it to a minimal one would re-simulate it hundreds of times (about 340 s of test
time on 0.33.0, 2 cores, against 18 s without) and prove nothing more."""


def test_the_property_catches_stock_vllm() -> None:
    """The control: the same oracle finds poisoning on stock vLLM quickly, at
    vLLM's default retention (what users run)."""
    if geometry_rule() == "equal":
        pytest.skip("this vLLM refuses C < B at startup: stock cannot poison")
    found = find(
        workloads(),
        lambda w: (
            w.geometry.retention == "default" and bool(simulate("stock", w).poisoned)
        ),
        settings=CONTROL_SEARCH,
    )
    assert simulate("stock", found).poisoned


def test_the_property_catches_lost_kept_states() -> None:
    """The control of the materialization check: grid loses states vLLM keeps."""
    found = find(
        workloads(),
        lambda w: bool(simulate("grid", w).missing_kept),
        settings=CONTROL_SEARCH,
    )
    assert simulate("grid", found).missing_kept


def test_the_property_sees_vllm_drop_states() -> None:
    """The control of the retention check: random workloads reach states
    vLLM's retention drops (so the plugin's model is asked both ways)."""
    if not supports_retention_setting():
        pytest.skip("this vLLM has no retention setting: every state is kept")
    found = find(
        workloads(),
        lambda w: any(not d.kept for d in simulate("kept", w).keep_decisions),
        settings=CONTROL_SEARCH,
    )
    assert any(not d.kept for d in simulate("kept", found).keep_decisions)
