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
meaning the fix was verified for). Those are read from the subclass's code
(the class here, its methods in subclass_code.py, loaded only for such a class):
:func:`problems` names every place where a subclass does something else, and the
plugin then refuses to start the fix in it (activation.py).
"""

from __future__ import annotations

from .layers import describe_distribution
from .recognition import SPLIT_METHOD

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
SCHEDULER_NAME = "Scheduler"
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


def problems(klass: type, audit: bool) -> list[str]:
    """Why the fix cannot run inside a scheduler of this (another
    distribution's) class: empty when its code keeps every assumption the fix
    makes. ``audit``: the audit's ``schedule``/``shutdown`` observers are bound too.

    Only another distribution's class is ever asked (:func:`foreign_classes`),
    so the reader of its methods' code (subclass_code.py) is loaded only then.
    """
    from .subclass_code import code_problems

    found = _class_problems(klass, audit)
    return found + code_problems(klass, vllm_scheduler(klass))
