"""The route (split.py) on both of vLLM's split signatures, without vLLM.

0.24.0-0.25.1 give ``_mamba_block_aligned_split`` a fifth parameter
(``num_uncached_common_prefix_tokens``); every other release has four. The
route is written once and bound with the installed method's parameters
(split.py: ``bind_route``): here it drives a vLLM-free split function of each shape,
which ends chunks on the grid it reads from ``self.cache_config.block_size``
the way vLLM's does, and records what it was called with.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_mamba_align.policy import SchedulerFacts, StopPolicy
from vllm_mamba_align.releases import BODIES, UNVERIFIED, SplitBody
from vllm_mamba_align.retention import Retention
from vllm_mamba_align.settings import Mode
from vllm_mamba_align.split import bind_route, state_grid_split

B, C, P = 1648, 816, 16764
FIVE = next(body for body in BODIES if body.extra_parameter is not None)
FOUR = BODIES[-1]


class Scheduler:
    """The attributes a route reads on a scheduler with no checkpoint blocks."""

    def __init__(self) -> None:
        self.cache_config = SimpleNamespace(block_size=C, prefix_match_unit=None)
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=())
        self.max_num_scheduled_tokens = 8192
        self.scheduler_config = SimpleNamespace(long_prefill_token_threshold=0)
        self.mamba_has_prefill_checkpoint_blocks = False
        self.calls: list[tuple[Any, ...]] = []


def aligned_end(self: Scheduler, request: Any, num_new_tokens: int, start: int) -> int:
    """vLLM's rule in short: a non-final prefill chunk ends on the grid."""
    end = start + num_new_tokens
    if end < request.num_prompt_tokens:
        end = end // self.cache_config.block_size * self.cache_config.block_size
    return end - start


def split_with_prefix_tokens(
    self: Scheduler,
    request: Any,
    num_new_tokens: int,
    num_new_local_computed_tokens: int = 0,
    num_external_computed_tokens: int = 0,
    num_uncached_common_prefix_tokens: int = 0,
) -> int:
    """The shape of 0.24.0-0.25.1's split."""
    self.calls.append((self.cache_config.block_size, num_uncached_common_prefix_tokens))
    start = (
        request.num_computed_tokens
        + num_new_local_computed_tokens
        + num_external_computed_tokens
    )
    return aligned_end(self, request, num_new_tokens, start)


def split(
    self: Scheduler,
    request: Any,
    num_new_tokens: int,
    num_new_local_computed_tokens: int = 0,
    num_external_computed_tokens: int = 0,
) -> int:
    """The shape of every other release's split."""
    self.calls.append((self.cache_config.block_size,))
    start = (
        request.num_computed_tokens
        + num_new_local_computed_tokens
        + num_external_computed_tokens
    )
    return aligned_end(self, request, num_new_tokens, start)


def request(computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="r",
        num_prompt_tokens=P,
        num_tokens=P,
        num_output_tokens=0,
        num_computed_tokens=computed,
    )


def full_route(bound: Any) -> Any:
    """The route behind a bound route's past-prefill shortcut: the same plain
    route over the same record (the closure's ``route`` and ``bound``), bound
    without a shortcut (:func:`bind_route`); None where no shortcut stands
    in front."""
    names = inspect.getclosurevars(bound).nonlocals
    if "route" not in names:
        return None  # vLLM's own function
    full = bind_route(names["route"], names["bound"], None)
    if "shortcut" in names:  # five parameters: the shortcut is a flag
        return full if names["shortcut"] else None
    return None if full.__code__ is bound.__code__ else full


def bind(stock: Any, body: SplitBody, mode: Mode) -> tuple[Scheduler, Any]:
    scheduler = Scheduler()
    retention = Retention(None, B, B, "test")
    policy = StopPolicy.decide(mode, body, retention, SchedulerFacts(8192), B)
    route = state_grid_split(scheduler, stock, policy, retention, body)  # type: ignore[arg-type]
    return scheduler, route


def test_the_fifth_parameter_is_passed_through_on_the_state_grid() -> None:
    scheduler, route = bind(split_with_prefix_tokens, FIVE, Mode.FULL)
    shared = scheduler.cache_config
    # vLLM ends the chunk on the B grid (4 * B); full stops it at the first B.
    assert route(request(), 8192, 0, 0, 37) == B
    assert scheduler.calls == [(B, 37)], "vLLM's split saw B and the fifth argument"
    assert scheduler.cache_config is shared, "the shared config is back in place"
    assert route(request(), 8192) == B
    assert scheduler.calls[-1] == (B, 0), "not passed: vLLM's own default"


def test_the_route_presents_the_installed_signature() -> None:
    for stock, body in ((split_with_prefix_tokens, FIVE), (split, FOUR)):
        _, route = bind(stock, body, Mode.FULL)
        expected = list(inspect.signature(stock).parameters)[1:]
        assert list(inspect.signature(route).parameters) == expected
        code = route.__code__  # the function's own parameters, not a copy
        assert list(code.co_varnames[: code.co_argcount]) == expected
        assert route.__wrapped__ is stock and route.__name__ == stock.__name__


def test_four_parameters_reach_a_four_parameter_split() -> None:
    scheduler, route = bind(split, FOUR, Mode.FULL)
    assert route(request(), 8192, 0, 0) == B
    assert scheduler.calls == [(B,)]


@pytest.mark.parametrize("mode", [Mode.GRID, Mode.KEPT])
def test_a_mid_block_start_stops_at_the_next_boundary_with_five_parameters(
    mode: Mode,
) -> None:
    """0.24.0-0.25.1 have no stop after a mid-block start (a connector's hit):
    grid adds it, kept stops there under dense retention."""
    scheduler, route = bind(split_with_prefix_tokens, FIVE, mode)
    assert route(request(100), 8192, 0, 0, 5) == B - 100
    assert scheduler.calls == [(B, 5)]


def test_a_decode_is_answered_before_the_route() -> None:
    """The past-prefill shortcut answers a decode with its token count and
    never reaches vLLM's function; the full route behind it calls vLLM on the
    state grid, with the fifth argument."""
    scheduler, route = bind(split_with_prefix_tokens, FIVE, Mode.FULL)
    decoding = request(P)
    decoding.num_tokens = P + 1
    assert route(decoding, 1, 0, 0, 0) == 1
    assert scheduler.calls == [], "answered before the route"
    assert full_route(route)(decoding, 1, 0, 0, 3) == 1
    assert scheduler.calls == [(B, 3)]
    assert list(inspect.signature(full_route(route)).parameters) == list(
        inspect.signature(route).parameters
    )


def test_opted_in_unverified_code_answers_every_call_itself() -> None:
    """Nobody has read what unverified code answers past the prefill: no
    shortcut stands before it, and a decode reaches vLLM's function."""
    unverified = dataclasses.replace(FOUR, releases=(UNVERIFIED,))
    assert unverified.past_prefill_shortcut is None
    assert FOUR.past_prefill_shortcut is FOUR.prefill
    scheduler, route = bind(split, unverified, Mode.FULL)
    decoding = request(P)
    decoding.num_tokens = P + 1
    assert route(decoding, 1) == 1
    assert scheduler.calls == [(B,)], "vLLM's function answered the decode"
    assert full_route(route) is None


BINDERS = {"_no_output_yet", "_before_prefill_end", "_every_call", "_five_parameters"}
"""The functions of split.py that build the one closure bound to a scheduler."""


def nested_functions(source: str) -> dict[str, list[str]]:
    """For each top-level function (or method) of ``source``, the functions
    and lambdas defined inside it."""
    found: dict[str, list[str]] = {}
    for outer in ast.walk(ast.parse(source)):
        if not isinstance(outer, ast.FunctionDef):
            continue
        inner = [
            node.name if isinstance(node, ast.FunctionDef) else "<lambda>"
            for node in ast.walk(outer)
            if node is not outer and isinstance(node, ast.FunctionDef | ast.Lambda)
        ]
        if inner:
            found[outer.name] = inner
    return found


def test_the_route_is_one_closure_per_scheduler_around_plain_functions() -> None:
    """Only the shortcut binders define a function inside a function, one
    each: everything a call does past the shortcut is a plain function of the
    scheduler's record."""
    import vllm_mamba_align.split as route_module

    source = inspect.getsource(route_module)
    assert {outer: len(inner) for outer, inner in nested_functions(source).items()} == {
        binder: 1 for binder in BINDERS
    }
    nested = "def f():\n    def g():\n        pass\n    return lambda: g\n"
    assert nested_functions(nested) == {"f": ["g", "<lambda>"]}


@pytest.mark.parametrize("mode", [Mode.FULL, Mode.KEPT, Mode.GRID, Mode.LEAN])
@pytest.mark.parametrize("body", [FOUR, FIVE], ids=["four", "five"])
def test_a_bound_route_closes_over_a_plain_route_and_one_record(
    mode: Mode, body: SplitBody
) -> None:
    stock = split if body is FOUR else split_with_prefix_tokens
    _, bound = bind(stock, body, mode)
    closed = inspect.getclosurevars(bound).nonlocals
    assert set(closed) <= {"route", "bound", "shortcut"}
    assert "<locals>" not in closed["route"].__qualname__
    assert dataclasses.is_dataclass(closed["bound"])
