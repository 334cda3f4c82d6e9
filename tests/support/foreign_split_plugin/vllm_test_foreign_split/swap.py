"""Subclasses of vLLM's ``Scheduler`` swapped into its module, as vllm-ascend's
platform patches swap ``BalanceScheduler`` in.

vllm-ascend's subclass inherits vLLM's split and carries a ``schedule()`` copied
from vLLM's. No vLLM code is written here: :func:`copied_schedule` compiles the
installed vLLM's own ``Scheduler.schedule`` source at run time into this module
(with one counting statement added at its top, and in the ``altered`` pattern
the split's second argument changed), so the copy matches whichever release is
installed. Its source is registered with ``linecache``, as a copy on disk
would be readable.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
from types import ModuleType
from typing import Any

from .patches import CALLS, SPLIT_METHOD

SOURCE_NAME = "<vllm_test_foreign_split.swap: copy of vLLM's Scheduler.schedule>"


class _Copy(ast.NodeTransformer):
    def __init__(self, altered: bool) -> None:
        self.altered = altered

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        func = node.func
        if (
            self.altered
            and isinstance(func, ast.Attribute)
            and func.attr == SPLIT_METHOD
            and len(node.args) >= 2
        ):
            node.args[1] = ast.Call(
                ast.Name("max", ast.Load()),
                [node.args[1], ast.Constant(1)],
                [],
            )
        return node


def copied_schedule(base: type, altered: bool) -> Any:
    """vLLM's ``schedule()`` of ``base``, compiled as this module's code."""
    vllm_module = inspect.getmodule(base)
    source = textwrap.dedent(inspect.getsource(base.schedule))
    tree = ast.parse(source)
    function = tree.body[0]
    assert isinstance(function, ast.FunctionDef)
    function.decorator_list = []
    count = ast.parse("CALLS['schedule'] += 1").body
    function.body = count + function.body
    tree = ast.fix_missing_locations(_Copy(altered).visit(tree))
    text = ast.unparse(tree) + "\n"
    name = SOURCE_NAME + (" (altered)" if altered else "")
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    namespace = dict(vars(vllm_module))
    namespace.update(__name__=__name__, CALLS=CALLS)
    exec(compile(text, name, "exec"), namespace)
    return namespace["schedule"]


def swapped_subclass(base: type, altered: bool = False) -> type:
    """A subclass that inherits ``base``'s split, with a copied ``schedule()``."""

    class SwappedScheduler(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    SwappedScheduler.__qualname__ = "SwappedScheduler"
    SwappedScheduler.schedule = copied_schedule(base, altered)  # type: ignore[method-assign]
    return SwappedScheduler


def overriding_subclass(base: type) -> type:
    """A subclass with its own split, calling ``base``'s."""

    class OverridingScheduler(base):  # type: ignore[misc, valid-type]
        def _mamba_block_aligned_split(self, request: Any, *args: Any) -> int:
            CALLS["override"] += 1
            return super()._mamba_block_aligned_split(request, *args)  # type: ignore[no-any-return]

    OverridingScheduler.__qualname__ = "OverridingScheduler"
    return OverridingScheduler


def swap(module: ModuleType, pattern: str) -> None:
    """Put the pattern's subclass in place of ``module.Scheduler``."""
    base = module.Scheduler
    if pattern == "override":
        module.Scheduler = overriding_subclass(base)
    else:
        module.Scheduler = swapped_subclass(base, altered=pattern == "altered")
