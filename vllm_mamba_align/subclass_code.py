"""What another distribution's ``Scheduler`` subclass does with the split,
read from its methods' code (subclasses.py asks, for such a class only).

Every reference a subclass's method makes to ``_mamba_block_aligned_split``
must be a call ``self._mamba_block_aligned_split(...)`` with arguments one of
vLLM's own callers passes (read from vLLM's scheduler module), and a method
that replaces one of vLLM's callers must still call it (or ``super()``'s).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .recognition import SPLIT_METHOD


@dataclass(frozen=True)
class SplitCall:
    """One reference to the split in a method's code."""

    method: str
    line: int
    text: str
    arguments: str | None
    """The call's arguments in a canonical form; None when the reference is
    not a call ``self._mamba_block_aligned_split(...)``."""


def _split_calls(node: ast.AST, method: str, first_line: int) -> Iterator[SplitCall]:
    calls = {
        id(call.func): call
        for call in ast.walk(node)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
    }
    for found in ast.walk(node):
        if not (isinstance(found, ast.Attribute) and found.attr == SPLIT_METHOD):
            continue
        call = calls.get(id(found))
        through_self = isinstance(found.value, ast.Name) and found.value.id == "self"
        arguments = None
        if call is not None and through_self:
            arguments = ast.dump(ast.Tuple(elts=list(call.args), ctx=ast.Load())) + (
                "".join(ast.dump(keyword) for keyword in call.keywords)
            )
        shown = ast.unparse(call if call is not None else found)
        line = first_line + found.lineno - 1
        yield SplitCall(method, line, shown, arguments)


def _calls_super(node: ast.AST, method: str) -> bool:
    """Whether the code calls ``super().<method>(...)``."""
    return any(
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == method
        and isinstance(call.func.value, ast.Call)
        and isinstance(call.func.value.func, ast.Name)
        and call.func.value.func.id == "super"
        for call in ast.walk(node)
    )


@functools.lru_cache(maxsize=8)
def vllm_callers(source_file: str, class_name: str) -> dict[str, frozenset[str]]:
    """vLLM's own ``Scheduler`` methods (of the class ``class_name`` in the
    scheduler module's file) that call the split, each with the argument forms
    it passes."""
    tree = ast.parse(Path(source_file).read_text())
    callers: dict[str, set[str]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name == class_name):
            continue
        for method in node.body:
            if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in _split_calls(method, method.name, 1):
                if call.arguments is not None:
                    callers.setdefault(method.name, set()).add(call.arguments)
    return {name: frozenset(forms) for name, forms in callers.items()}


def _method_tree(function: types.FunctionType) -> tuple[ast.AST, int] | None:
    try:
        lines, first = inspect.getsourcelines(function.__code__)
    except (OSError, TypeError):
        return None
    try:
        return ast.parse(textwrap.dedent("".join(lines))), max(first, 1)
    except SyntaxError:
        return None


def _function_of(attribute: object) -> types.FunctionType | None:
    if isinstance(attribute, (staticmethod, classmethod)):
        attribute = attribute.__func__
    return attribute if type(attribute) is types.FunctionType else None


def _method_problems(
    name: str,
    method: str,
    function: types.FunctionType,
    callers: dict[str, frozenset[str]],
    allowed: frozenset[str],
) -> list[str]:
    """Each reference of one method to the split that is not a call vLLM's own
    callers make; a replaced caller that never calls it."""
    parsed = _method_tree(function)
    if parsed is None:
        if method not in callers:
            return []
        return [
            f"the source of {name}.{method} (which replaces vLLM's caller of "
            f"{SPLIT_METHOD}) cannot be read"
        ]
    tree, first = parsed
    calls = list(_split_calls(tree, method, first))
    found = []
    for call in calls:
        if call.arguments is None:
            found.append(
                f"{name}.{method} (line {call.line}) reaches the split other "
                f"than by self.{SPLIT_METHOD}(...): {call.text}"
            )
        elif call.arguments not in allowed:
            found.append(
                f"{name}.{method} (line {call.line}) calls {call.text}, with "
                "arguments none of vLLM's calls pass"
            )
    if method in callers and not calls and not _calls_super(tree, method):
        found.append(
            f"{name}.{method} replaces vLLM's {method}() but never calls "
            f"self.{SPLIT_METHOD} (nor super().{method}())"
        )
    return found


def code_problems(klass: type, base: type) -> list[str]:
    """Each place where the methods of ``klass`` (a subclass of vLLM's
    ``Scheduler``, ``base``) reach the split other than as vLLM's own callers
    do; where vLLM's callers cannot be read, that."""
    module = sys.modules.get(base.__module__)
    source_file = getattr(module, "__file__", None)
    try:
        callers = vllm_callers(source_file, base.__name__) if source_file else {}
    except (OSError, SyntaxError, ValueError):
        callers = {}
    if not callers:
        if not hasattr(base, SPLIT_METHOD):  # a vLLM before align mode
            return []
        return [
            f"the plugin cannot read which of vLLM's methods call {SPLIT_METHOD}, "
            f"so it cannot check {klass.__qualname__}'s",
        ]
    found: list[str] = []
    allowed = frozenset().union(*callers.values())
    for method, attribute in vars(klass).items():
        function = _function_of(attribute)
        if function is not None:
            found += _method_problems(
                klass.__qualname__, method, function, callers, allowed
            )
    return found
