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
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

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


def bind_route(
    make: Callable[[StockCall], Route],
    stock: SplitFunction,
    extra_parameter: str | None,
) -> SplitFunction:
    """The route ``make`` builds around vLLM's call, bound with the parameters
    of the installed method and presented as it (:func:`present_as`).

    ``extra_parameter`` is the body's fifth parameter (None: four). With one,
    the shell passes its fifth argument on to vLLM's call unchanged, and its
    default is vLLM's own (0).
    """
    if extra_parameter is None:
        return present_as(make(stock), stock)
    fifth = _FifthArgument()

    def call(scheduler: Any, request: Any, new: int, local: int, external: int) -> int:
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

    return present_as(split_with_prefix_tokens, stock)
