"""The layers the stand-in puts on ``Scheduler._mamba_block_aligned_split``.

Each counts its calls (:data:`CALLS`, by layer) and hands the call on unchanged,
so a test can tell that a layer ran and that nothing bypassed it.
"""

from __future__ import annotations

import collections
import functools
import inspect
from types import ModuleType
from typing import Any

SPLIT_METHOD = "_mamba_block_aligned_split"
CALLS: collections.Counter[str] = collections.Counter()
EXPECTED_PARAMETERS = ("self", "request", "num_new_tokens")


def wrap_with_functools(scheduler_class: type) -> None:
    """Replace the class attribute with a ``functools.wraps`` wrapper of what
    the class holds, as vllm-ascend's platform patch does (it checks the
    parameters first)."""
    original = getattr(scheduler_class, SPLIT_METHOD)
    names = tuple(inspect.signature(original).parameters)
    if names[: len(EXPECTED_PARAMETERS)] != EXPECTED_PARAMETERS:
        raise RuntimeError(f"unexpected split parameters {names}")

    @functools.wraps(original)
    def split_keeping_verifier_width(self: Any, *args: Any, **kwargs: Any) -> int:
        CALLS["wraps"] += 1
        return original(self, *args, **kwargs)  # type: ignore[no-any-return]

    setattr(scheduler_class, SPLIT_METHOD, split_keeping_verifier_width)


_wrapped_classes: set[type] = set()


def wrap_once(scheduler_class: type) -> None:
    if scheduler_class not in _wrapped_classes:
        _wrapped_classes.add(scheduler_class)
        wrap_with_functools(scheduler_class)


def counting_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int:
    """A plain wrapt wrapper, as another general plugin would install one."""
    CALLS["wrapt"] += 1
    return wrapped(*args, **kwargs)  # type: ignore[no-any-return]


_patched_modules: set[str] = set()


def install_platform_patches(module: ModuleType) -> None:
    """What the chosen way's platform patch does to the scheduler module, once."""
    from . import way

    chosen = way() or ""
    if module.__name__ in _patched_modules:
        return
    _patched_modules.add(module.__name__)
    pattern = chosen.rpartition("-at-")[0]
    if pattern in ("wraps", "wraps-swap"):
        wrap_once(module.Scheduler)
    if pattern.endswith("swap"):
        from .swap import swap

        swap(module, pattern.removesuffix("-swap") or "swap")


def install_wrapt_hook(module: ModuleType) -> None:
    import wrapt

    wrapt.wrap_function_wrapper(module.Scheduler, SPLIT_METHOD, counting_wrapper)
