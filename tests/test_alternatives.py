"""What users run instead of the plugin: a step budget within [B, 2B).

The benchmark's "stock, budget = B" row (benchmarks/measure.py) stands for
operators who cap ``--max-num-batched-tokens`` so that each prefill step
advances at most one state block. Held here on the installed vLLM's real
scheduler, stock: the cap ends every chunk on the state grid, and so
materializes every boundary and publishes nothing wrong, only where C = B, or
where C divides B, the budget stays below B + C and a prompt has its steps to
itself. With C = 816 and B = 1,648 stock still ends chunks on the 816 grid.
"""

from __future__ import annotations

import pytest
from helpers import cache_block_for, geometry_rule, scheduler_mode

from vllm_mamba_align.tools.sim import (
    Geometry,
    Simulation,
    cacheable_boundaries,
    prompt,
)


def grid_budget(cache_block: int, state_block: int, budget: int) -> Geometry:
    """Every boundary kept (dense retention): each one must be materialized."""
    return Geometry(
        cache_block=cache_block,
        state_block=state_block,
        budget=budget,
        retention=None,
    )


def stock_alone(geometry: Geometry, length: int) -> Simulation:
    with scheduler_mode("stock"):
        sim = Simulation(geometry)
        sim.add("p", prompt(length, seed=3))
        sim.run()
    return sim


def test_one_block_budget_ends_stock_chunks_on_the_grid_if_c_divides_b() -> None:
    """Every budget within [B, B + C): each chunk floors to exactly B tokens."""
    state_block = 1632
    cache_block = cache_block_for(state_block)
    length = 10 * state_block + 500
    boundaries = cacheable_boundaries(length, state_block)
    for budget in (state_block, state_block + cache_block - 1):
        sim = stock_alone(grid_budget(cache_block, state_block, budget), length)
        assert sim.chunk_ends("p")[: len(boundaries)] == boundaries, budget
        assert sim.materialized_boundaries("p") == boundaries, budget
        assert not sim.poisoned, budget


@pytest.mark.skipif(
    geometry_rule() == "equal", reason="this vLLM starts only with C = B"
)
def test_the_rest_of_the_one_to_two_block_range_leaves_stock_off_the_grid() -> None:
    """With C < B, a budget within [B + C, 2B) floors to a multiple of C that is
    no multiple of B: the recipe's [B, 2B) holds only where C = B."""
    state_block = 1632
    cache_block = cache_block_for(state_block)
    assert cache_block < state_block
    budget = 2 * state_block - 1
    sim = stock_alone(grid_budget(cache_block, state_block, budget), 10 * state_block)
    assert sim.chunk_ends("p")[0] == budget // cache_block * cache_block == 2448
    assert len(sim.materialized_boundaries("p")) < 9


@pytest.mark.skipif(
    geometry_rule() != "any", reason="this vLLM refuses C=816 < B=1648 at startup"
)
def test_one_block_budget_leaves_stock_chunks_off_the_grid_otherwise() -> None:
    state_block = 1648
    sim = stock_alone(grid_budget(816, state_block, state_block), 10 * state_block)
    assert sim.chunk_ends("p")[:3] == [1632, 3264, 4896]
    assert sim.materialized_boundaries("p") == []
    assert sim.poisoned


@pytest.mark.skipif(
    geometry_rule() == "equal", reason="this vLLM starts only with C = B"
)
def test_one_block_budget_shared_by_concurrent_prompts_leaves_the_grid() -> None:
    """Two prompts in one step share the budget: the second gets what the first
    left, which stock floors to C's grid, so with C < B even a budget of B (C
    dividing B) ends chunks off the state grid and publishes wrong states."""
    state_block = 1632
    cache_block = cache_block_for(state_block)
    assert cache_block < state_block
    with scheduler_mode("stock"):
        sim = Simulation(grid_budget(cache_block, state_block, state_block))
        sim.add("short", prompt(500, seed=4))
        sim.add("long", prompt(10 * state_block, seed=5))
        sim.run()
    assert sim.chunk_ends("short") == [500]
    # The long prompt's first chunk gets 1,132 tokens, floored to 816; from
    # there every chunk of B tokens ends half a block off the grid.
    assert sim.chunk_ends("long")[:3] == [816, 2448, 4080]
    assert sim.materialized_boundaries("long") == []
    assert sim.poisoned
