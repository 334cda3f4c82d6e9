"""The hot path: what a split call costs where it cannot change a chunk.

vLLM calls the split for every running request at every step, so nearly every
call is a decode. Every bound route answers such calls through the body's own
past-prefill test (``split.bind_route``) before it does any of its work; and where the
fix would schedule exactly as vLLM (grid mode on a C == B geometry with no
stop for the body) the plugin binds vLLM's own function. Both are shortcuts,
and both are held here against the full computation on the real scheduler:
requests drawn at every phase (prefill from any start, the last prompt token,
decode, spec-decode lookahead, a resumed request replaying its output after
preemption, with local and external hits) get the same answer either way.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import built_or_skipped, cache_block_for, installed_body, scheduler_mode

from vllm_mamba_align import activation, split
from vllm_mamba_align.policy import StopPolicy
from vllm_mamba_align.retention import read_retention
from vllm_mamba_align.settings import Mode
from vllm_mamba_align.split import state_grid_split
from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt

B = 1648
DRAWS = 3000
"""Calls compared per scheduler, each a fresh draw of request, phase and
arguments."""


def full_route(bound: Any) -> Any:
    """The route behind a bound route's past-prefill shortcut: the same plain
    route over the same record (the closure's ``route`` and ``bound``), bound
    without a shortcut (``split.bind_route``); None where no shortcut stands
    in front."""
    names = inspect.getclosurevars(bound).nonlocals
    if "route" not in names:
        return None  # vLLM's own function
    full = split.bind_route(names["route"], names["bound"], None)
    if "shortcut" in names:  # five parameters: the shortcut is a flag
        return full if names["shortcut"] else None
    return None if full.__code__ is bound.__code__ else full


POOL = 40
"""Requests of each kind (without and with output tokens) per scheduler."""


def phase_calls(
    sim: Simulation, seed: int
) -> Iterator[tuple[str, Any, tuple[int, ...]]]:
    """(phase, request, split arguments after the request), at random.

    Requests are real vLLM ``Request`` objects of this scheduler, of random
    prompt and output lengths, put in each phase the way vLLM leaves them
    (``num_computed_tokens`` set; output tokens appended). Arguments may be
    ones vLLM never passes in that phase (a local hit for a decode, say): the
    two answers must agree on any input.
    """
    rng = random.Random(seed)

    def made(serial: int, outputs: bool) -> Any:
        length = rng.choice((rng.randrange(2, 64), rng.randrange(64, 5 * B)))
        request = sim.new_request(f"r{serial}", prompt(length, seed=serial), 10_000)
        if outputs:
            extra = rng.choice((rng.randrange(1, 32), rng.randrange(32, 2 * B)))
            request.append_output_token_ids(list(prompt(extra, seed=serial + 1)))
        return request

    fresh = [made(k, outputs=False) for k in range(POOL)]
    answered = [made(POOL + k, outputs=True) for k in range(POOL)]
    phases = ("prefill", "last prompt token", "decode", "lookahead", "resumed")
    for _ in range(DRAWS):
        phase = rng.choice(phases)
        request = rng.choice(fresh if phase in phases[:2] else answered)
        length = request.num_prompt_tokens
        new, local, external = rng.randrange(1, 9000), 0, 0
        if phase == "prefill":
            computed = rng.randrange(0, length)
            if computed == 0 and rng.random() < 0.5:
                local = rng.randrange(0, length) // 16 * 16
                external = rng.randrange(0, length - local)
        elif phase == "last prompt token":
            computed, new = length - 1, 1
        elif phase in ("decode", "lookahead"):
            computed = request.num_tokens - 1
            new = 1 if phase == "decode" else rng.randrange(2, 8)
        else:  # resumed: preempted, replaying prompt and output from anywhere
            computed = rng.randrange(0, request.num_tokens - 1)
        if rng.random() < 0.05:  # arguments vLLM never sends in this phase
            local, external = rng.randrange(0, 64), rng.randrange(0, 64)
        request.num_computed_tokens = computed
        yield phase, request, (new, local, external)


def answer(split: Any, request: Any, args: tuple[int, ...]) -> int | str:
    """The split's answer, or the type of what it raised (0.15.1-0.22.1 assert
    that no external tokens come with a call)."""
    try:
        return int(split(request, *args))
    except Exception as error:
        return type(error).__name__


def assert_same_answers(sim: Simulation, shortcut: Any, full: Any, seed: int) -> None:
    differences = []
    phases_seen: dict[str, int] = {}
    for phase, request, args in phase_calls(sim, seed):
        phases_seen[phase] = phases_seen.get(phase, 0) + 1
        fast, slow = answer(shortcut, request, args), answer(full, request, args)
        if fast != slow:
            differences.append(
                f"{phase}: prompt {request.num_prompt_tokens}, output "
                f"{request.num_output_tokens}, computed {request.num_computed_tokens}"
                f", arguments {args}: shortcut {fast}, full route {slow}"
            )
    assert not differences, "\n".join(differences[:10])
    assert all(count > 100 for count in phases_seen.values()), phases_seen


def geometries() -> list[Geometry]:
    c = cache_block_for(B)
    return [
        Geometry(cache_block=c, state_block=B, budget=8192, retention=None),
        Geometry(cache_block=c, state_block=B, budget=8192, retention="default"),
        Geometry(cache_block=B, state_block=B, budget=8192, retention=None),
    ]


@pytest.mark.parametrize("mode", ["lean", "kept", "full", "grid", "audit"])
@pytest.mark.parametrize("case", range(3), ids=["C<B dense", "C<B default", "C=B"])
def test_the_past_prefill_shortcut_answers_as_the_full_route(
    mode: str, case: int
) -> None:
    geometry = geometries()[case]
    with built_or_skipped(), scheduler_mode(mode):
        sim = Simulation(geometry)
    bound = sim.scheduler.__dict__.get(activation.SPLIT_ATTRIBUTE)
    if bound is None or full_route(bound) is None:
        # vLLM's own function is bound (grid on C == B): the next test holds it.
        assert mode == "grid" and geometry.cache_block == B
        return
    assert_same_answers(sim, bound, full_route(bound), seed=case)


def test_grid_binds_vllms_own_split_where_the_fix_would_schedule_as_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On C == B, grid binds vLLM's function when no stop applies to the body,
    says so at start, and the route it would otherwise bind answers every call
    as vLLM's function does."""
    lines: list[str] = []

    class Recorder:
        def info(self, message: str, *args: Any) -> None:
            lines.append(message % args)

        warning = info

    monkeypatch.setattr(activation, "_logger", lambda: Recorder())
    geometry = Geometry(cache_block=B, state_block=B, budget=8192, retention=None)
    with scheduler_mode("grid"):
        sim = Simulation(geometry)
    scheduler = sim.scheduler
    body = installed_body()
    retention = read_retention(scheduler, B)
    policy = StopPolicy.for_scheduler(Mode.GRID, body, retention, scheduler, B)
    bound = scheduler.__dict__[activation.SPLIT_ATTRIBUTE]
    if not policy.schedules_as_vllm(B):
        # The body needs a stop vLLM lacks (before 0.26.0): the route is bound.
        assert full_route(bound) is not None, policy
        pytest.skip(f"grid adds stops on body {body.name}: {policy}")
    stock = bound.__func__
    in_class = inspect.getattr_static(type(scheduler), activation.SPLIT_METHOD)
    assert stock is in_class.__wrapped__, "vLLM's own function, no layer of ours"
    assert "bound unchanged" in lines[-1] and "mode=grid" in lines[-1]
    route = state_grid_split(scheduler, stock, policy, retention, body)
    assert_same_answers(sim, bound, full_route(route), seed=7)
