"""``lean``: chunks end where stock vLLM ends them, and on every boundary vLLM keeps.

Under sparse state retention vLLM publishes a Mamba block only for a boundary
it keeps, so only those boundaries need a chunk to end on them; elsewhere
``lean`` leaves vLLM's own chunk ends alone. Held here on the real scheduler
with requests arriving over time and decodes sharing each step's budget: no
wrong publication, no wrong read, no kept state lost, and the time to first
token (in steps) no worse than ``kept``'s. The random workloads
(test_property.py) run ``lean`` too.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from helpers import cache_block_for, scheduler_mode

from vllm_mamba_align import split
from vllm_mamba_align.tools.modes import STOCK
from vllm_mamba_align.tools.sim import (
    Geometry,
    Simulation,
    available_checkpoint_backends,
    prompt,
    state_id,
)

B = 1648
REQUESTS = 16


def served(
    mode: str, families: bool, retention: int | str | None
) -> tuple[Simulation, int]:
    """:data:`REQUESTS` requests of 1,000-20,000 tokens, one arriving every
    0-4 steps, 16-128 output tokens each; with ``families`` most of them
    extend one of two shared prefixes. Returns the simulation and the steps
    from each request's arrival to its first token, summed."""
    rng = random.Random(5)
    prefixes = [prompt(6000, seed=70), prompt(9000, seed=71)]
    geometry = Geometry(
        cache_block=cache_block_for(B),
        state_block=B,
        budget=8192,
        num_blocks=8000,
        retention=retention,
    )
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        arrival = 0
        arrivals = []
        for i in range(REQUESTS):
            arrival += rng.randint(0, 4)
            own = prompt(rng.randint(1000, 20000), seed=100 + i)
            if families and rng.random() < 0.7:
                own = rng.choice(prefixes) + own[:3000]
            arrivals.append((arrival, f"q{i}", own, rng.randint(16, 128)))
        arrived: dict[str, int] = {}
        while arrivals or sim.busy():
            while arrivals and arrivals[0][0] <= sim.steps:
                _, name, tokens, max_tokens = arrivals.pop(0)
                arrived[name] = sim.steps
                sim.add(name, tokens, max_tokens=max_tokens)
            sim.step()
            assert sim.steps < 5000, "not drained"
    ttft = sum(
        (record.prefilled_at_step or 0) - arrived[name]
        for name, record in sim.records.items()
    )
    return sim, ttft


@contextmanager
def vllm_calls_per_split_call(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[Simulation], list[int]]]:
    """Inside: schedulers bind a counted route, which counts its calls of
    vLLM's split (the route and vLLM's function otherwise unchanged). Yields
    a function that lists, for a simulation built inside, how many calls of
    vLLM's split each call of the scheduler's route (past the shortcut for
    decodes) made."""
    made: list[int] = []
    route, call_vllm = split.route, split.call_vllm

    def counted_route(*args: Any) -> Any:
        made.append(0)
        return route(*args)

    def counted_call(*args: Any) -> Any:
        made[-1] += 1
        return call_vllm(*args)

    # The entry binds split.route, and the route calls split.call_vllm, by
    # the names the module holds when it runs.
    monkeypatch.setattr(split, "route", counted_route)
    monkeypatch.setattr(split, "call_vllm", counted_call)
    yield lambda sim: list(made)


@pytest.mark.parametrize("families", [False, True], ids=["unique", "families"])
def test_lean_keeps_every_kept_state_and_publishes_nothing_wrong(
    families: bool,
) -> None:
    sim, _ = served("lean", families, "default")
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
    assert not sim.wrong_reuse, sim.wrong_reuse
    assert sim.missing_kept == [], sim.missing_kept
    assert all(r.prefilled_at_step is not None for r in sim.records.values())
    if families:
        assert sum(sim.reused(name) for name in sim.records) > 0


@pytest.mark.parametrize("families", [False, True], ids=["unique", "families"])
def test_lean_reaches_first_tokens_no_later_than_kept_and_near_stock(
    families: bool,
) -> None:
    """Where vLLM keeps only replay boundaries and junctions (retention 0),
    lean is within 5 % of stock's time to first token on unique prompts
    (its extra chunk ends: the replay boundaries) and no later than stock's
    with shared prefixes (which stock publishes wrongly or loses); never later
    than kept's. Measured on 0.33.0: 88 steps against stock's 85 and kept's
    96 (unique), 65 against 72 and 70 (families)."""
    sim, lean = served("lean", families, "default")
    _, kept = served("kept", families, "default")
    assert lean <= kept
    if sim.retention_interval == 0:
        _, stock = served(STOCK, families, "default")
        assert lean <= (stock if families else stock * 1.05)


def test_lean_is_kept_under_dense_retention() -> None:
    lean, _ = served("lean", True, None)
    kept, _ = served("kept", True, None)
    for name, record in kept.records.items():
        assert lean.chunk_ends(name) == [c.end for c in record.chunks]


@pytest.mark.parametrize(
    ("length", "lean_ends", "boundary_kept"),
    [
        (4 * B + 5, [4 * B + 5], True),
        (4 * B + 105, [4 * B, 4 * B + 96, 4 * B + 105], True),
        (4 * B + 68, [4 * B + 68], False),
    ],
    ids=["tail-is-the-boundary", "backend-declines", "tail-takes-the-column"],
)
def test_lean_leaves_the_replay_boundary_to_the_backends_prompt_checkpoint(
    length: int,
    lean_ends: list[int],
    boundary_kept: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With backend prefill checkpoints (GDN on FlashInfer, alignment
    lcm(16, 64) from the chunk's start) the backend writes the prompt
    checkpoint (P - 1 floored to the hash block) into the replay boundary's
    column (P - 1 floored to B), and vLLM publishes that column under the
    checkpoint's hash. Where the checkpoint is the boundary, one chunk serves
    both; where the backend declines (6,688 is 32 past the 64-token grid),
    lean ends a chunk on the boundary and vLLM stops at the tail after it;
    where it writes a checkpoint past the boundary, lean takes the prompt in
    one chunk as stock does and the boundary's state is what vLLM gives up
    for the checkpoint (``kept`` keeps both: two more chunks). Every time:
    nothing wrong published, the prompt checkpoint published."""
    if "gdn-flashinfer" not in available_checkpoint_backends():
        pytest.skip("this vLLM's GDN declares no checkpoint blocks (0.33.0+)")
    geometry = Geometry(
        cache_block=cache_block_for(B),
        state_block=B,
        hash_block=16,
        budget=8192,
        num_blocks=8000,
        retention="default",
        prefill_checkpoint="gdn-flashinfer",
    )
    tokens = prompt(length, seed=9)
    with scheduler_mode("lean"), vllm_calls_per_split_call(monkeypatch) as calls:
        sim = Simulation(geometry)
        if sim.retention_interval != 0:
            pytest.skip("vLLM's default retention keeps every boundary here")
        sim.add("p", tokens)
        sim.run()
    # One call of vLLM's split per chunk, whether or not vLLM's own chunk
    # yields the boundary (it asks before it knows).
    assert max(calls(sim)) == 1
    assert sim.chunk_ends("p") == lean_ends
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
    tail = (length - 1) // 16 * 16
    assert state_id(tokens, tail) in sim.published_states
    assert (4 * B in sim.materialized_boundaries("p")) == boundary_kept
    assert sim.missing_kept == ([] if boundary_kept else [f"p: {4 * B} inside a chunk"])


def test_lean_ends_a_prefill_from_its_kept_boundary_as_the_fix_on_b_would() -> None:
    """C divides B: after lean's stop at the replay boundary K, the prompt's
    last chunk runs on B, where vLLM's last cacheable position is K itself; on
    C it would stop once more at 4,352, inside the B block K opens, where
    nothing is published. So lean spends no more chunks than stock here, and
    K's state is materialized, nothing wrong published."""
    from vllm_mamba_align.tools.installed import supports_hash_block

    if not supports_hash_block():
        pytest.skip("choosing the hash block needs vLLM 0.26.0+")
    state_block, cache_block, length = 1024, 256, 4 * 1024 + 300
    geometry = Geometry(
        cache_block=cache_block,
        state_block=state_block,
        hash_block=16,
        budget=8192,
        num_blocks=8000,
        retention="default",
    )
    tokens = prompt(length, seed=11)
    ends = {}
    for mode in (STOCK, "lean"):
        with scheduler_mode(mode):
            sim = Simulation(geometry)
            if sim.retention_interval != 0:
                pytest.skip("vLLM's default retention keeps every boundary here")
            sim.add("p", tokens)
            sim.run()
        ends[mode] = sim.chunk_ends("p")
    last_cacheable_on_c = (length - 1) // cache_block * cache_block
    assert last_cacheable_on_c in ends[STOCK]
    assert last_cacheable_on_c not in ends["lean"]
    assert ends["lean"][0] == 4 * state_block
    assert len(ends["lean"]) <= len(ends[STOCK])
    assert 4 * state_block in sim.materialized_boundaries("p")
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
    assert sim.missing_kept == []
