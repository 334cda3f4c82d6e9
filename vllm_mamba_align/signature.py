"""The split's signature, shared by every route bound to a scheduler.

``Scheduler._mamba_block_aligned_split`` takes ``(self, request, num_new_tokens,
num_new_local_computed_tokens=0, num_external_computed_tokens=0)`` in every
release; 0.24.0-0.25.1 add ``num_uncached_common_prefix_tokens=0``
(releases.py: ``SplitBody.extra_parameter``). Both callers in
``Scheduler.schedule()`` pass positional arguments.

A route (the fix in split.py, the audit's observer) is written once, with the
four common parameters, around a call of vLLM's function with those four
(:data:`StockCall`). :func:`bind_route` binds it with exactly the installed
method's parameters: on four-parameter releases the route is called directly
and calls vLLM's function directly (nothing in between); on 0.24.0-0.25.1 a
shell with the five parameters hands the fifth argument to that call.

In front of every bound route stands the past-prefill shortcut. vLLM calls the
split for every running request at every step, and nearly every such call is a
decode, for which every released body answers ``num_new_tokens`` unchanged
(it splits prefill chunks only). The shortcut answers those calls with the
same number at the cost of the body's own prefill test, before the route
swaps any config or consults any policy; only calls that may be prefill reach
the route. ``tests/test_decode_shortcut.py`` holds the shortcut's answer equal
to the full route's, for every mode, on requests at every phase.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from .releases import PrefillRule

SplitFunction = Callable[..., int]
"""``_mamba_block_aligned_split`` as bound to one scheduler (no ``self``)."""

StockCall = Callable[[Any, Any, int, int, int], int]
"""vLLM's function called with the scheduler and the four common arguments."""

Route = Callable[[Any, int, int, int], int]
"""A route with the four common parameters (request, num_new_tokens,
num_new_local_computed_tokens, num_external_computed_tokens)."""


def present_as(route: SplitFunction, stock: SplitFunction) -> SplitFunction:
    """Give a bound route vLLM's method's identity, once, at bind time.

    ``__name__``, ``__qualname__``, ``__doc__``, ``__module__`` and
    ``__wrapped__`` (``stock``, vLLM's own function) are copied, and the
    signature is vLLM's without ``self``, so tracebacks, profilers and
    ``inspect`` see vLLM's method. Routes take their parameters as plain
    positional ones (a ``*rest`` parameter would cost about 70 ns per call, on
    every request at every step).
    """
    functools.update_wrapper(route, stock)
    signature = inspect.signature(stock)
    route.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=tuple(signature.parameters.values())[1:]
    )
    return route


class _FifthArgument(threading.local):
    """The fifth argument of the call in progress, on this thread."""

    value: Any = 0


def _no_output_yet_shortcut(full: SplitFunction) -> SplitFunction:
    """:data:`PrefillRule.NO_OUTPUT_YET` (0.15.0-0.16.0, four parameters)."""

    def no_output_yet(
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        if request.num_output_tokens and not num_external_computed_tokens:
            return num_new_tokens
        return full(
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )

    return no_output_yet


def _before_prefill_end_shortcut(full: SplitFunction) -> SplitFunction:
    """:data:`PrefillRule.BEFORE_PREFILL_END` (0.17.0+), four parameters."""

    def before_prefill_end(
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        if not num_external_computed_tokens:
            start = request.num_computed_tokens + num_new_local_computed_tokens
            if start >= request.num_prompt_tokens and start >= request.num_tokens - 1:
                return num_new_tokens
        return full(
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )

    return before_prefill_end


def _before_prefill_end_shortcut_five(full: SplitFunction) -> SplitFunction:
    """:data:`PrefillRule.BEFORE_PREFILL_END` with 0.24.0-0.25.1's fifth
    parameter."""

    def before_prefill_end_with_prefix_tokens(
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        num_uncached_common_prefix_tokens: int = 0,
    ) -> int:
        if not num_external_computed_tokens:
            start = request.num_computed_tokens + num_new_local_computed_tokens
            if start >= request.num_prompt_tokens and start >= request.num_tokens - 1:
                return num_new_tokens
        return full(
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
            num_uncached_common_prefix_tokens,
        )

    return before_prefill_end_with_prefix_tokens


def _past_prefill_shortcut(
    full: SplitFunction, rule: PrefillRule, five: bool
) -> SplitFunction:
    """``full`` behind the body's own past-prefill test: calls that cannot be
    prefill get ``num_new_tokens`` back at once.

    Every released body returns ``num_new_tokens`` unchanged for such a call
    (0.15.0-0.22.1 after asserting that no external tokens came with it: the
    shortcut leaves any call with external tokens to the route, so that
    assertion still speaks). The test is the body's own, as
    :func:`releases.in_prefill` states it, written out in each shortcut
    because it runs for every running request at every step: two
    comparisons, no call.
    """
    if rule is PrefillRule.NO_OUTPUT_YET:
        assert not five, "no five-parameter body has this prefill rule"
        return _no_output_yet_shortcut(full)
    if five:
        return _before_prefill_end_shortcut_five(full)
    return _before_prefill_end_shortcut(full)


def bind_route(
    make: Callable[[StockCall], Route],
    stock: SplitFunction,
    extra_parameter: str | None,
    shortcut: PrefillRule | None,
) -> SplitFunction:
    """The route ``make`` builds around vLLM's call, bound with the parameters
    of the installed method, behind the past-prefill shortcut of the body's
    prefill rule ``shortcut`` (:attr:`releases.SplitBody.past_prefill_shortcut`;
    None: no shortcut), and presented as vLLM's method (:func:`present_as`).

    ``extra_parameter`` is the body's fifth parameter (None: four). With one,
    the shell passes its fifth argument on to vLLM's call unchanged, and its
    default is vLLM's own (0). The shortcut holds the route as ``full`` (the
    name its closure gives it).
    """
    full: SplitFunction
    if extra_parameter is None:
        full = make(stock)
    else:
        fifth = _FifthArgument()

        def call(
            scheduler: Any, request: Any, new: int, local: int, external: int
        ) -> int:
            return stock(scheduler, request, new, local, external, fifth.value)

        route = make(call)

        def split_with_prefix_tokens(
            request: Any,
            num_new_tokens: int,
            num_new_local_computed_tokens: int = 0,
            num_external_computed_tokens: int = 0,
            num_uncached_common_prefix_tokens: int = 0,
        ) -> int:
            fifth.value = num_uncached_common_prefix_tokens
            return route(
                request,
                num_new_tokens,
                num_new_local_computed_tokens,
                num_external_computed_tokens,
            )

        full = split_with_prefix_tokens
    if shortcut is None:
        return present_as(full, stock)
    answered = _past_prefill_shortcut(full, shortcut, extra_parameter is not None)
    return present_as(answered, stock)
