"""The invariants of align-mode prefix caching, on the real scheduler.

Geometry from the upstream report: attention block C = 816, Mamba state block
B = 1648, a 16,764-token prompt, step budget 8,192, hash block 16 (vLLM's GCD).
Releases before 0.20.2 only reach C < B when C divides B, so there C = 824;
0.20.2-0.27.1 refuse C < B at startup (those tests skip there). Each test of the
plugin has a twin that shows stock vLLM breaking the same invariant, so none of
them can pass vacuously.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
from helpers import geometry_rule, scheduler_mode

from vllm_mamba_align.tools.sim import (
    Geometry,
    Simulation,
    cacheable_boundaries,
    prompt,
)

B, P, BUDGET = 1648, 16764, 8192
SHARED = 5000  # a sibling prompt sharing only its first 5,000 tokens
SHARED_DEEP = 9000  # deep enough that stock vLLM hands out a published slot


@dataclass(frozen=True)
class Outcome:
    chunk_ends: list[int]
    materialized: list[int]
    reask_reuse: int
    sibling_reuse: int
    deep_sibling_reuse: int
    poisoned: list[str]
    wrong_reuse: list[str]
    tail_stop: int
    prefill_steps: int


def cache_block() -> int | None:
    """C: 816 as upstream, or 824 (a divisor of B) where vLLM requires one."""
    return {"any": 816, "divisor": 824}.get(geometry_rule())


def heterogeneous_geometry() -> Geometry:
    c = cache_block()
    if c is None:
        pytest.skip("this vLLM refuses a cache block smaller than B at startup")
    # Dense retention (every state kept): what these invariants are about. vLLM's
    # default retention (0.29.0+) has its own tests in test_retention.py.
    return Geometry(cache_block=c, state_block=B, budget=BUDGET, retention=None)


@functools.cache
def heterogeneous(mode: str) -> Outcome:
    """A prompt, then an immediate re-ask and two shared-prefix siblings."""
    first = prompt(P, seed=1)
    geometry = heterogeneous_geometry()
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        sim.add("first", first)
        sim.run()
        ends = sim.chunk_ends("first")
        materialized = sim.materialized_boundaries("first")
        sim.add("re-ask", first)
        sim.run()
        sim.add("sibling", first[:SHARED] + prompt(3000, seed=2))
        sim.run()
        sim.add("deep-sibling", first[:SHARED_DEEP] + prompt(3000, seed=3))
        sim.run()
    hash_block = sim.hash_block
    return Outcome(
        chunk_ends=ends,
        materialized=materialized,
        reask_reuse=sim.reused("re-ask"),
        sibling_reuse=sim.reused("sibling"),
        deep_sibling_reuse=sim.reused("deep-sibling"),
        poisoned=[str(p) for p in sim.poisoned.values()],
        wrong_reuse=sim.wrong_reuse,
        tail_stop=(P - 1) // hash_block * hash_block,
        prefill_steps=len(ends),
    )


FIXED_MODES = ["full", "grid"]


@pytest.mark.parametrize("mode", FIXED_MODES)
def test_non_final_chunks_end_on_the_state_grid(mode: str) -> None:
    outcome = heterogeneous(mode)
    *non_final, final = outcome.chunk_ends
    assert final == P
    off_grid = [e for e in non_final if e % B and e != outcome.tail_stop]
    assert off_grid == [], f"chunk ends off the B grid: {off_grid}"


def test_full_mode_never_crosses_a_state_boundary() -> None:
    ends = heterogeneous("full").chunk_ends
    starts = [0, *ends[:-1]]
    crossing = [
        (s, e)
        for s, e in zip(starts, ends, strict=True)
        if (s // B + 1) * B < e and s < P
    ]
    assert crossing == []
    assert ends[:10] == [k * B for k in range(1, 11)]


@pytest.mark.parametrize("mode", FIXED_MODES)
def test_every_published_mamba_hash_names_the_state_its_slot_holds(mode: str) -> None:
    assert heterogeneous(mode).poisoned == []


@pytest.mark.parametrize("mode", FIXED_MODES)
def test_every_reused_state_is_the_state_its_hash_names(mode: str) -> None:
    outcome = heterogeneous(mode)
    assert outcome.wrong_reuse == []
    assert outcome.deep_sibling_reuse > 0


@pytest.mark.parametrize("mode", FIXED_MODES)
def test_an_immediate_re_ask_reuses_every_legal_boundary(mode: str) -> None:
    assert heterogeneous(mode).reask_reuse >= (P - 1) // B * B == 16480


def test_full_mode_sibling_reuses_the_largest_boundary_all_groups_serve() -> None:
    # With C = 816 the attention group holds 4,896 of the shared 5,000 tokens
    # (6 blocks); the largest multiple of B within that is 3,296.
    c = heterogeneous_geometry().cache_block
    expected = min(SHARED // c * c, SHARED // B * B) // B * B
    assert expected == {816: 3296, 824: 4944}[c]
    assert heterogeneous("full").sibling_reuse == expected


def test_full_mode_materializes_every_boundary_of_the_prompt() -> None:
    assert heterogeneous("full").materialized == cacheable_boundaries(P, B)


def test_stock_vllm_breaks_these_invariants() -> None:
    """The control: the same checks catch stock vLLM on this geometry."""
    stock = heterogeneous("stock")
    c = heterogeneous_geometry().cache_block
    off_grid = [e for e in stock.chunk_ends[:-1] if e % B and e != stock.tail_stop]
    assert off_grid, "stock vLLM ends chunks off the B grid"
    assert all(e % c == 0 for e in off_grid), "... on the C grid"
    assert stock.poisoned, "stock vLLM publishes hashes over states from other offsets"
    assert stock.wrong_reuse, "a deep sibling reads a wrong state on stock vLLM"
    assert stock.sibling_reuse == 0
    assert len(stock.materialized) < len(cacheable_boundaries(P, B))


def test_off_mode_schedules_exactly_like_stock() -> None:
    assert heterogeneous("off") == heterogeneous("stock")


def test_five_block_prompt_walked_with_the_full_budget() -> None:
    """Upstream's regression: aligned starts must still stop at each boundary."""
    length = 5 * B + 100
    geometry = Geometry(cache_block=B, state_block=B, budget=length, retention=None)
    results = {}
    for mode in ("stock", "grid", "full"):
        with scheduler_mode(mode):
            sim = Simulation(geometry)
            sim.add("five", prompt(length, seed=5))
            sim.run()
        results[mode] = (sim.materialized_boundaries("five"), len(sim.poisoned))
    assert results["full"] == ([B, 2 * B, 3 * B, 4 * B, 5 * B], 0)
    assert len(results["stock"][0]) < 5
    assert results["grid"] == results["stock"], "equal geometry: grid is stock"
