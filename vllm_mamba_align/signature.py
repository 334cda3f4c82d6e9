"""The split's signature, shared by every route bound to a scheduler.

``Scheduler._mamba_block_aligned_split`` takes ``(self, request, num_new_tokens,
num_new_local_computed_tokens=0, num_external_computed_tokens=0)`` in every
release; 0.24.0-0.25.1 add ``num_uncached_common_prefix_tokens=0``
(releases.py: ``SplitBody.extra_parameter``). Both callers in
``Scheduler.schedule()`` pass positional arguments. A route (the fix in
split.py, the audit's observer) takes the four common parameters and an
optional fifth (default None), which it passes on only when vLLM passed one:
one route serves both signatures, and vLLM's function sees exactly the
arguments its caller gave.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

SplitFunction = Callable[..., int]
"""``_mamba_block_aligned_split`` as bound to one scheduler (no ``self``)."""


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
