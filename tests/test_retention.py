"""vLLM's state retention, as the plugin reads it, against what vLLM really keeps.

``kept`` mode and the audit decide from :class:`vllm_mamba_align.retention.Retention`
which B boundaries vLLM keeps. Here the real scheduler in ``full`` mode writes
every boundary's state, and the set of Mamba states vLLM actually publishes must
equal the set the plugin predicts, under vLLM's default retention, dense, and a
segment interval R > 0. Then the modes are held to what they promise there.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import pytest
from helpers import geometry_rule, scheduler_mode, supports_retention_setting

from vllm_mamba_align.retention import RETENTION_VARIABLE, read_retention
from vllm_mamba_align.tools.modes import environment_variable
from vllm_mamba_align.tools.retention_report import installed_setting
from vllm_mamba_align.tools.sim import (
    Geometry,
    Simulation,
    StateId,
    cacheable_boundaries,
    prompt,
    retention_interval,
    state_id,
)

P = 16764
C = 816
# B = 1632 makes the scheduler block lcm(816, 1632) = 1632, so R = 4 * B = 6528 is
# a legal segment interval inside the prompt; with B = 1648 it would be 84,048.
B_SEGMENTS = 1632
R = 4 * B_SEGMENTS
B_UPSTREAM = 1648

RETENTIONS: list[int | str | None] = ["default", None, R]


def _skip_unless_configurable(retention: int | str | None) -> None:
    if retention != "default" and not supports_retention_setting():
        pytest.skip("this vLLM has no retention setting: every state is kept")


def _cache_block(state_block: int) -> int:
    rule = geometry_rule()
    if rule == "any":
        return C
    if rule == "divisor":
        return state_block // 2
    pytest.skip("this vLLM refuses a cache block smaller than B at startup")


@dataclass(frozen=True)
class Run:
    published: set[StateId]
    """The correct B-boundary states vLLM published (all requests)."""
    predicted: set[StateId]
    chunk_ends: list[int]
    poisoned: int
    wrong_reuse: int
    missing_kept: list[str]
    noncanonical_kept: list[str]
    prefill_steps: int
    reuse: tuple[int, ...]


@functools.cache
def scenario(mode: str, state_block: int, retention: int | str | None) -> Run:
    """A prompt, a re-ask, and two siblings sharing 9,000 tokens (a junction)."""
    first = prompt(P, seed=1)
    requests = {
        "first": first,
        "re-ask": first,
        "sibling": first[:9000] + prompt(3000, seed=2),
        "sibling-2": first[:9000] + prompt(3000, seed=3),
    }
    geometry = Geometry(
        _cache_block(state_block), state_block, 8192, retention=retention
    )
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        for name, tokens in requests.items():
            sim.add(name, tokens)
            sim.run()
    grid = state_block
    published = {
        claimed
        for block, _, claimed in sim.published_mamba_blocks()
        if claimed[0] % grid == 0 and sim.holds.get(block.block_id) == claimed
    }
    retention = read_retention(sim.scheduler, sim.state_block)
    predicted = {
        state_id(requests[name], b)
        for name, record in sim.records.items()
        for b in cacheable_boundaries(len(requests[name]), grid)
        if retention.keeps(record.request, b)
    }
    return Run(
        published=published,
        predicted=predicted,
        chunk_ends=sim.chunk_ends("first"),
        poisoned=len(sim.poisoned),
        wrong_reuse=len(sim.wrong_reuse),
        missing_kept=sim.missing_kept,
        noncanonical_kept=sim.noncanonical_kept,
        prefill_steps=len(sim.chunk_ends("first")),
        reuse=tuple(sim.reused(name) for name in requests),
    )


@pytest.mark.parametrize("retention", RETENTIONS, ids=str)
@pytest.mark.parametrize("state_block", [B_SEGMENTS, B_UPSTREAM])
def test_the_plugin_predicts_exactly_the_states_vllm_keeps(
    state_block: int, retention: int | str | None
) -> None:
    _skip_unless_configurable(retention)
    if retention == R and state_block != B_SEGMENTS:
        pytest.skip("R is a legal interval only with B = 1632")
    run = scenario("full", state_block, retention)
    assert run.published == run.predicted
    assert run.missing_kept == []


def test_vllm_default_keeps_only_reachable_states() -> None:
    """The setting users run: on 0.29.0+ few boundary states survive."""
    run = scenario("full", B_UPSTREAM, "default")
    lengths = sorted(length for length, _ in run.published)
    if retention_interval(Geometry(C, B_UPSTREAM)) is None:  # dense before 0.29.0
        assert set(cacheable_boundaries(P, B_UPSTREAM)) <= set(lengths)
    else:
        # The first prompt's replay boundary, the junction the first sibling
        # pinned (9,000 floored to B) and the two siblings' replay boundaries.
        assert lengths == [8240, 11536, 11536, 16480]


@pytest.mark.parametrize("retention", RETENTIONS, ids=str)
def test_kept_mode_materializes_every_kept_state_canonically_when_dense(
    retention: int | str | None,
) -> None:
    _skip_unless_configurable(retention)
    kept = scenario("kept", B_SEGMENTS, retention)
    full = scenario("full", B_SEGMENTS, retention)
    assert kept.poisoned == kept.wrong_reuse == 0
    assert kept.missing_kept == []
    assert kept.published == full.published, "kept keeps what full keeps"
    assert kept.reuse == full.reuse
    assert kept.prefill_steps <= full.prefill_steps
    if scenario("full", B_SEGMENTS, retention).predicted >= set(
        cacheable_boundaries(P, B_SEGMENTS)
    ):
        assert kept.chunk_ends == full.chunk_ends, "dense: kept is full"


@pytest.mark.parametrize("retention", RETENTIONS, ids=str)
def test_full_mode_keeps_only_canonical_states(retention: int | str | None) -> None:
    _skip_unless_configurable(retention)
    assert scenario("full", B_SEGMENTS, retention).noncanonical_kept == []


def test_kept_mode_is_grid_at_retention_zero() -> None:
    if not supports_retention_setting():
        pytest.skip("this vLLM has no retention setting")
    kept = scenario("kept", B_UPSTREAM, 0)
    grid = scenario("grid", B_UPSTREAM, 0)
    assert kept == grid
    if kept.published:  # 0.28.0 keeps no state at all at retention 0
        assert kept.noncanonical_kept, "grid chunking is not canonical"


def test_kept_mode_stops_at_segment_boundaries() -> None:
    if not supports_retention_setting():
        pytest.skip("this vLLM has no retention setting")
    kept = scenario("kept", B_SEGMENTS, R)
    grid = scenario("grid", B_SEGMENTS, R)
    segment_ends = [e for e in kept.chunk_ends if e % R == 0]
    assert segment_ends == [R, 2 * R]
    assert len(kept.chunk_ends) > len(grid.chunk_ends)
    assert grid.missing_kept, "grid loses segment states that kept materializes"


def test_stock_publishes_wrong_states_at_vllm_default() -> None:
    """The control: the defect is there in the configuration users run."""
    stock = scenario("stock", B_UPSTREAM, "default")
    assert stock.poisoned > 0
    assert stock.wrong_reuse > 0
    assert scenario("full", B_UPSTREAM, "default").poisoned == 0


NOT_APPLIED = object()


def _applied_to_mamba_states(sim: Simulation) -> object:
    """The retention value vLLM's own Mamba manager applies in ``sim``:
    the coordinator's, where that manager's mask acts on a sparse value (asked
    of the manager itself, with retention 0 over four blocks); NOT_APPLIED
    where it keeps every state whatever is set (0.23.0: only sliding-window
    groups read it) or there is no setting at all."""
    coordinator = sim.scheduler.kv_cache_manager.coordinator
    if not hasattr(coordinator, "retention_interval"):
        return NOT_APPLIED
    from vllm.v1.kv_cache_interface import MambaSpec

    (manager,) = [
        m
        for m in coordinator.single_type_managers
        if isinstance(m.kv_cache_spec, MambaSpec)
    ]
    arguments = {
        "start_block": 0,
        "end_block": 4,
        "alignment_tokens": manager.block_size,
        "kv_cache_spec": manager.kv_cache_spec,
        "use_eagle": False,
        "retention_interval": 0,
    }
    accepted = inspect.signature(manager.reachable_block_mask).parameters
    mask = manager.reachable_block_mask(
        **{name: value for name, value in arguments.items() if name in accepted}
    )
    if mask is None:
        return NOT_APPLIED
    return coordinator.retention_interval


@pytest.mark.parametrize("variable", [None, "0"], ids=["unset", "variable-0"])
def test_doctor_reports_the_retention_vllms_coordinator_applies(
    variable: str | None,
) -> None:
    """``doctor``'s retention is read from the installed code, never from the
    version number (0.27.0 ships 0.27.1's coordinator under an older number): it
    must name the value vLLM's own Mamba manager applies, with vLLM's retention
    variable unset and set to 0 (0.24.0-0.28.0 read it for Mamba states; 0.23.0
    reads it for sliding-window groups only and refuses it for a model without
    one; 0.29.0+ take the setting from the cache config and ignore it). The
    scheduler's own retention, which ``kept`` and the audit decide by, must
    agree."""
    with environment_variable(RETENTION_VARIABLE, variable):
        has_setting, interval, where = installed_setting()
        try:
            sim = Simulation(Geometry(B_UPSTREAM, B_UPSTREAM, 8192))
        except Exception as error:
            assert variable is not None and not has_setting, (error, where)
            return
    applied = _applied_to_mamba_states(sim)
    served = read_retention(sim.scheduler, B_UPSTREAM)
    if applied is NOT_APPLIED:
        assert not has_setting, where
        assert served.interval is None, served.source
    else:
        assert has_setting, "vLLM's Mamba manager applies a retention setting"
        assert interval == applied, where
        assert served.interval == applied, served.source
