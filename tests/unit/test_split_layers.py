"""The layer walk on plain classes (no vLLM): each layer named by the code that
runs in it, this plugin's own wrapper told apart from a wrapper around it, and
when each foreign layer came. The real scheduler with a real second plugin is
``tests/test_foreign_split.py``."""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

import wrapt

from vllm_mamba_align.layers import (
    FOREIGN_ROLE,
    MARKER,
    OWN_ROLE,
    VLLM_ROLE,
    Kind,
    Order,
    contains_ours,
    distribution_of,
    findings,
    is_ours,
    walk,
)

SPLIT = "split"


def make_scheduler() -> type:
    class Scheduler:
        def split(self, request: Any, num_new_tokens: int) -> int:
            return num_new_tokens

    return Scheduler


def our_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int:
    return wrapped(*args, **kwargs)  # type: ignore[no-any-return]


def their_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int:
    return wrapped(*args, **kwargs) + 0  # type: ignore[no-any-return]


def wrap_ours(klass: type) -> None:
    wrapt.wrap_function_wrapper(klass, SPLIT, our_wrapper)
    setattr(vars(klass)[SPLIT], MARKER, "tag")


def wrap_with_functools(klass: type) -> None:
    original = getattr(klass, SPLIT)

    @functools.wraps(original)
    def keep_width(self: Any, *args: Any) -> int:
        return original(self, *args)  # type: ignore[no-any-return]

    setattr(klass, SPLIT, keep_width)


def test_a_plain_method_is_one_function_layer() -> None:
    klass = make_scheduler()
    chain = walk(klass, SPLIT)
    assert chain.owner is klass and chain.complete
    (layer,) = chain.layers
    assert layer.kind is Kind.FUNCTION
    assert layer.module == __name__
    assert layer.qualname.endswith("Scheduler.split")
    assert not layer.ours


def test_a_functools_wrapper_is_named_by_its_own_code() -> None:
    """functools.wraps copies __module__ and __qualname__; the code does not lie."""
    klass = make_scheduler()
    original = vars(klass)[SPLIT]
    wrap_with_functools(klass)
    outer, inner = walk(klass, SPLIT).layers
    assert outer.kind is Kind.WRAPS
    assert outer.target.__qualname__ == original.__qualname__  # the copy
    assert "keep_width" in outer.qualname and "Scheduler" not in outer.qualname
    assert inner.target is original


def test_a_foreign_wrapt_wrapper_around_ours_is_not_ours() -> None:
    """A wrapt proxy forwards attribute lookups to what it wraps, this plugin's
    marker included: the walk must read each layer's own attributes."""
    klass = make_scheduler()
    wrap_ours(klass)
    wrapt.wrap_function_wrapper(klass, SPLIT, their_wrapper)
    outer, ours, function = walk(klass, SPLIT).layers
    assert getattr(outer.target, MARKER, None) == "tag"  # the trap
    assert not outer.ours and not is_ours(outer.target)
    assert outer.kind is Kind.WRAPT and outer.qualname == "their_wrapper"
    assert ours.ours and ours.qualname == "our_wrapper"
    assert function.kind is Kind.FUNCTION
    assert contains_ours(outer.target)


def test_a_functools_wrapper_of_our_binding_finds_ours_beneath() -> None:
    """Read through the class, wrapt hands out a binding of our wrapper; a
    functools.wraps wrapper captures that binding."""
    klass = make_scheduler()
    wrap_ours(klass)
    wrap_with_functools(klass)
    outer, binding, _ = walk(klass, SPLIT).layers
    assert outer.kind is Kind.WRAPS and not outer.ours
    assert binding.ours and binding.target is not vars(klass)  # not the class's


def test_orders_before_after_and_replaced() -> None:
    klass = make_scheduler()
    vllm_function = vars(klass)[SPLIT]
    # Before: found at import, the plugin wraps nothing over it.
    wrap_with_functools(klass)
    seen = walk(klass, SPLIT).layers
    before = findings(walk(klass, SPLIT), vllm_function, seen, klass)
    assert [f.order for f in before] == [Order.BEFORE, None]
    assert [f.role for f in before] == [FOREIGN_ROLE, VLLM_ROLE]
    # After: around the plugin's wrapper.
    klass = make_scheduler()
    vllm_function = vars(klass)[SPLIT]
    seen = walk(klass, SPLIT).layers
    wrap_ours(klass)
    wrapt.wrap_function_wrapper(klass, SPLIT, their_wrapper)
    after = findings(walk(klass, SPLIT), vllm_function, seen, klass)
    assert [f.order for f in after] == [Order.AFTER, None, None]
    assert [f.role for f in after] == [FOREIGN_ROLE, OWN_ROLE, VLLM_ROLE]

    # Replaced: the plugin's wrapper is gone, the new function was not there.
    def replacement(self: Any, request: Any, num_new_tokens: int) -> int:
        return 0

    klass.split = replacement  # type: ignore[attr-defined]
    (replaced,) = findings(walk(klass, SPLIT), vllm_function, seen, klass)
    assert replaced.order is Order.REPLACED


def test_a_subclass_override_is_found_through_the_mro() -> None:
    base = make_scheduler()
    wrap_ours(base)

    class Derived(base):  # type: ignore[misc,valid-type]
        pass

    class Override(base):  # type: ignore[misc,valid-type]
        def split(self, request: Any, num_new_tokens: int) -> int:
            return super().split(request, num_new_tokens)  # type: ignore[no-any-return]

    inherited = walk(Derived, SPLIT)
    assert inherited.owner is base and inherited.layers[0].ours
    where = findings(inherited, None, (), base)[0].where
    assert where.startswith("the class attribute of ") and where.endswith(".Derived")
    override = walk(Override, SPLIT)
    assert override.owner is Override
    (finding,) = findings(override, None, (), base)
    assert finding.order is Order.OVERRIDE
    assert ".Override overrides it (" in finding.where


def test_a_cycle_ends_the_walk() -> None:
    klass = make_scheduler()
    function = vars(klass)[SPLIT]
    function.__wrapped__ = function
    chain = walk(klass, SPLIT)
    assert not chain.complete and len(chain.layers) == 1


def test_distributions_name_the_installed_package() -> None:
    assert distribution_of("wrapt.wrappers") == f"wrapt {metadata.version('wrapt')}"
    assert distribution_of(__name__) is None
    assert distribution_of(None) is None
    layer = walk(make_scheduler(), SPLIT).layers[0]
    assert "not from any installed distribution" in layer.describe()
