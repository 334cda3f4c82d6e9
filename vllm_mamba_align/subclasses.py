"""The scheduler class vLLM builds, when it is another distribution's subclass.

vllm-ascend's platform patches end with ``vllm.v1.core.sched.scheduler.Scheduler
= BalanceScheduler``: vLLM then builds a subclass of its ``Scheduler`` defined
elsewhere, which inherits vLLM's ``_mamba_block_aligned_split`` and brings a
``schedule()`` of its own (a copy of vLLM's). Platforms also configure
``scheduler_cls`` to such subclasses, and those may subclass ``AsyncScheduler``.

An inherited split is vLLM's function, and the plugin's wrappers on vLLM's class
reach such a subclass through inheritance. What the fix relies on besides the
split is the subclass's: that its instance attributes shadow class attributes
(the fix and the audit's observers are bound on the instance), and that every
call it makes to the split is ``self._mamba_block_aligned_split(...)`` with the
arguments vLLM's own callers pass (so each call goes to the bound fix, with the
meaning the fix was verified for). Those are read here from the subclass's code:
:func:`problems` names every place where a subclass does something else, and the
plugin then refuses to start the fix in it (activation.py).
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

from .layers import describe_distribution

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
SCHEDULER_NAME = "Scheduler"
SPLIT_METHOD = "_mamba_block_aligned_split"
# Modules whose classes are no subclass's own code: vLLM's, and the language's.
VLLM_PACKAGE = "vllm"
LANGUAGE_MODULES = frozenset({"builtins", "abc", "typing"})
# Attributes the plugin sets on a scheduler instance (plugin.py, site 3) and
# which a class-level descriptor of the same name would shadow.
INSTANCE_BOUND = (SPLIT_METHOD, "schedule", "shutdown")


def is_vllms(klass: type) -> bool:
    """Whether the class is defined in vLLM's own package (or the language's)."""
    top = klass.__module__.split(".")[0]
    return top == VLLM_PACKAGE or klass.__module__ in LANGUAGE_MODULES


def vllm_scheduler(scheduler_class: type) -> type:
    """vLLM's own ``Scheduler`` among the class's ancestors (the class itself
    when none is: then the class is recognized as it is)."""
    for klass in scheduler_class.__mro__:
        if klass.__module__ == SCHEDULER_MODULE and klass.__name__ == SCHEDULER_NAME:
            return klass
    return scheduler_class


def foreign_classes(scheduler_class: type) -> tuple[type, ...]:
    """The classes of the MRO above vLLM's ``Scheduler`` that are not vLLM's:
    another distribution's code, most derived first."""
    base = vllm_scheduler(scheduler_class)
    found = []
    for klass in scheduler_class.__mro__:
        if klass is base:
            break
        if not is_vllms(klass):
            found.append(klass)
    return tuple(found)


def describe_class(klass: type) -> str:
    """A class for a person: its name, module and distribution."""
    return (
        f"{klass.__qualname__} (module {klass.__module__}, "
        f"{describe_distribution(klass.__module__)})"
    )


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
def vllm_callers(source_file: str) -> dict[str, frozenset[str]]:
    """vLLM's own ``Scheduler`` methods that call the split, each with the
    argument forms it passes, read from the scheduler module's file."""
    tree = ast.parse(Path(source_file).read_text())
    callers: dict[str, set[str]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name == SCHEDULER_NAME):
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


def _class_problems(klass: type, audit: bool) -> list[str]:
    """What in the class itself keeps an attribute bound on the scheduler
    from taking effect."""
    found: list[str] = []
    name = klass.__qualname__
    own = vars(klass)
    if "__getattribute__" in own:
        found.append(
            f"{name} defines __getattribute__, so what the scheduler's calls "
            "resolve to cannot be read from its code"
        )
    bound = INSTANCE_BOUND if audit else INSTANCE_BOUND[:1]
    for attribute in bound:
        if attribute in own and hasattr(own[attribute], "__set__"):
            found.append(
                f"{name}.{attribute} is a data descriptor "
                f"({type(own[attribute]).__name__}): an attribute bound on the "
                "scheduler would not take effect"
            )
    return found


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


def problems(klass: type, audit: bool) -> list[str]:
    """Why the fix cannot run inside a scheduler of this (another
    distribution's) class: empty when its code keeps every assumption the fix
    makes. ``audit``: the audit's ``schedule``/``shutdown`` observers are bound too."""
    found = _class_problems(klass, audit)
    base = vllm_scheduler(klass)
    module = sys.modules.get(base.__module__)
    source_file = getattr(module, "__file__", None)
    try:
        callers = vllm_callers(source_file) if source_file else {}
    except (OSError, SyntaxError, ValueError):
        callers = {}
    if not callers:
        if not hasattr(base, SPLIT_METHOD):  # a vLLM before align mode
            return found
        return [
            *found,
            f"the plugin cannot read which of vLLM's methods call {SPLIT_METHOD}, "
            f"so it cannot check {klass.__qualname__}'s",
        ]
    allowed = frozenset().union(*callers.values())
    for method, attribute in vars(klass).items():
        function = _function_of(attribute)
        if function is not None:
            found += _method_problems(
                klass.__qualname__, method, function, callers, allowed
            )
    return found
