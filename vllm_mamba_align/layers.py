"""The split vLLM will actually call: every layer from a scheduler class's
attribute down to the innermost function, each named by its code.

Other plugins patch or override the same method. vllm-ascend replaces
``Scheduler._mamba_block_aligned_split`` with a ``functools.wraps`` wrapper of
vLLM's function in its platform patches; vllm-gaudi's ``HPUAsyncScheduler``
overrides it. ``inspect.getsource`` follows ``__wrapped__``, so a fingerprint of
the class attribute reads such a wrapper as the function it wraps: the plugin
would run code it never verified inside its fix. Recognition therefore walks the
chain itself and verifies each layer.

The walk starts at the attribute the class resolves (``inspect.getattr_static``
over its MRO: a subclass's override is the layer vLLM calls) and follows
``__wrapped__`` through ``functools.wraps`` wrappers, wrapt wrappers and proxies
to a callable without one. A layer is named by the code that runs, not by the
names a wrapper copies from what it wraps (``functools.wraps`` copies
``__module__`` and ``__qualname__``): a function by its code object and the
module whose globals it runs in, a wrapt wrapper by its wrapper function, any
other object by its type. The installed distribution that ships the module is
looked up only to describe a layer (``importlib.metadata``).
"""

from __future__ import annotations

import enum
import functools
import inspect
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

# Set on every wrapper this plugin installs, so the walk knows its own layer and
# a second register() (or a forked child, which inherits the patched class)
# never stacks another one.
MARKER = "_self_vllm_mamba_align"
# Far deeper than any real chain; a longer one (or a cycle) ends the walk.
MAX_DEPTH = 32


def _own_attribute(target: Any, name: str) -> Any:
    """An attribute stored on ``target`` itself: a wrapt proxy forwards every
    other lookup to what it wraps, so a foreign wrapper around this plugin's
    wrapper would otherwise answer with this plugin's marker."""
    try:
        return object.__getattribute__(target, name)
    except Exception:
        return None


def is_ours(target: Any) -> bool:
    """Whether this layer is a wrapper installed by this plugin (or wrapt's
    binding of one: ``Scheduler._mamba_block_aligned_split`` read through the
    class, which a ``functools.wraps`` wrapper captures)."""
    if _own_attribute(target, MARKER) is not None:
        return True
    parent = _own_attribute(target, "_self_parent")
    return parent is not None and _own_attribute(parent, MARKER) is not None


def contains_ours(attribute: Any) -> bool:
    """Whether this plugin's wrapper is anywhere in the attribute's chain."""
    for _ in range(MAX_DEPTH):
        if attribute is None:
            return False
        if is_ours(attribute):
            return True
        attribute = _own_wrapped(attribute)
    return False


class Kind(enum.Enum):
    """What a layer is, as far as the walk can tell."""

    FUNCTION = "function"
    WRAPS = "functools.wraps wrapper"
    WRAPT = "wrapt wrapper"
    PROXY = "proxy"
    OTHER = "callable object"


@dataclass(frozen=True)
class Layer:
    """One callable between a scheduler's attribute and the innermost function."""

    target: Any = field(compare=False, repr=False)
    """The object itself (compared by identity: :meth:`same`)."""
    kind: Kind
    module: str | None
    """The module whose code runs: a function's globals, a wrapper function's,
    or an object's type."""
    qualname: str
    location: str | None
    """``file:line`` of the code, where it has one."""
    ours: bool

    def same(self, other: Layer) -> bool:
        return self.target is other.target

    def describe(self) -> str:
        """The layer for a person: what, whose, where on disk."""
        where = f"; {self.location}" if self.location else ""
        return (
            f"{self.kind.value} {self.qualname} (module {self.module or 'unknown'}, "
            f"{describe_distribution(self.module)}{where})"
        )


@dataclass(frozen=True)
class Chain:
    """The layers of one attribute of one scheduler class, outermost first."""

    scheduler_class: type
    owner: type | None
    """The class of the MRO whose ``__dict__`` holds the attribute (None: no
    class defines it)."""
    layers: tuple[Layer, ...]
    complete: bool = True
    """False when the walk stopped at :data:`MAX_DEPTH` or on a cycle."""

    @property
    def innermost(self) -> Layer | None:
        return self.layers[-1] if self.layers else None

    def own_layer_index(self) -> int | None:
        """Where this plugin's wrapper sits in the chain (None: not in it)."""
        return next((i for i, layer in enumerate(self.layers) if layer.ours), None)

    def below_own_layer(self) -> Layer | None:
        """What this plugin's wrapper calls, when that wrapper is the outermost
        layer: the callable vLLM would call without the plugin."""
        if len(self.layers) >= 2 and self.layers[0].ours:
            return self.layers[1]
        return None


def _code_identity(function: types.FunctionType) -> tuple[str | None, str, str]:
    code = function.__code__
    module = function.__globals__.get("__name__")
    # co_qualname (3.11+) is the code's own name; __qualname__ may be a copy
    # (functools.wraps). Python 3.10 has only co_name: there __qualname__ is
    # believed only where it ends in that name, so a copied one never names
    # another function.
    qualname = getattr(code, "co_qualname", None)
    if qualname is None:
        given = getattr(function, "__qualname__", "")
        own = isinstance(given, str) and given.rpartition(".")[2] == code.co_name
        qualname = given if own else code.co_name
    return module, qualname, f"{code.co_filename}:{code.co_firstlineno}"


def _own_wrapped(target: Any) -> Any:
    try:
        return getattr(target, "__wrapped__", None)
    except Exception:
        return None


def identify(target: Any) -> Layer:
    """Name one layer by the code that runs in it."""
    ours = is_ours(target)
    # type(), not isinstance(): a wrapt proxy answers isinstance as what it wraps.
    if type(target) is types.FunctionType:
        module, qualname, location = _code_identity(target)
        wraps = "__wrapped__" in vars(target)
        kind = Kind.WRAPS if wraps else Kind.FUNCTION
        return Layer(target, kind, module, qualname, location, ours)
    wrapper = _own_attribute(target, "_self_wrapper")
    if type(wrapper) is types.FunctionType:
        module, qualname, location = _code_identity(wrapper)
        return Layer(target, Kind.WRAPT, module, qualname, location, ours)
    kind = Kind.PROXY if _own_wrapped(target) is not None else Kind.OTHER
    klass = type(target)
    return Layer(target, kind, klass.__module__, klass.__qualname__, None, ours)


def walk(scheduler_class: type, name: str) -> Chain:
    """Every layer vLLM's call ``scheduler.<name>(...)`` goes through, for a
    scheduler of this class without instance attributes."""
    owner = next((k for k in scheduler_class.__mro__ if name in vars(k)), None)
    if owner is None:
        return Chain(scheduler_class, None, ())
    target = inspect.getattr_static(scheduler_class, name)
    layers: list[Layer] = []
    seen: set[int] = set()
    while target is not None and len(layers) < MAX_DEPTH:
        if id(target) in seen:
            return Chain(scheduler_class, owner, tuple(layers), complete=False)
        seen.add(id(target))
        layers.append(identify(target))
        target = _own_wrapped(target)
    return Chain(scheduler_class, owner, tuple(layers), complete=target is None)


@functools.lru_cache(maxsize=1)
def _distributions() -> Mapping[str, list[str]]:
    return metadata.packages_distributions()


def distribution_of(module: str | None) -> str | None:
    """The installed distribution(s) shipping this module's top-level package,
    with versions (``vllm-ascend 0.23.0``); None when none does."""
    if not module:
        return None
    try:
        names = _distributions().get(module.split(".")[0], [])
    except Exception:
        return None
    found = []
    for name in dict.fromkeys(names):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(name)
    return ", ".join(found) or None


def describe_distribution(module: str | None) -> str:
    found = distribution_of(module)
    return f"distribution {found}" if found else "not from any installed distribution"


class Order(enum.Enum):
    """When a foreign layer came, relative to this plugin's wrapper."""

    BEFORE = "installed before this plugin loaded"
    AFTER = "installed after this plugin loaded, around this plugin's wrapper"
    REPLACED = "installed after this plugin loaded, in place of this plugin's wrapper"
    OVERRIDE = "a subclass's own method"


@dataclass(frozen=True)
class Finding:
    """One layer and what the plugin makes of it."""

    layer: Layer
    role: str
    """``this plugin's wrapper``, ``vLLM's own function`` or ``not verified``."""
    where: str
    order: Order | None
    """For a layer that is not verified; None otherwise."""

    @property
    def verified(self) -> bool:
        return self.order is None

    def as_dict(self) -> dict[str, str | None]:
        """The finding for ``doctor --json``."""
        return {
            "role": self.role,
            "kind": self.layer.kind.value,
            "module": self.layer.module,
            "qualname": self.layer.qualname,
            "location": self.layer.location,
            "distribution": distribution_of(self.layer.module),
            "where": self.where,
            "order": self.order.value if self.order else None,
        }


OWN_ROLE = "this plugin's wrapper"
VLLM_ROLE = "vLLM's own function"
FOREIGN_ROLE = "not verified"


def _where(chain: Chain, patched_class: type | None, index: int) -> str:
    if index > 0:
        return f"wrapped by layer {index}"
    owner = chain.owner
    assert owner is not None
    named = f"{owner.__module__}.{owner.__qualname__}"
    if owner is not patched_class and patched_class is not None:
        return f"{owner.__qualname__} overrides it ({named})"
    inherited = (
        f", inherited by {chain.scheduler_class.__qualname__}"
        if chain.scheduler_class is not owner
        else ""
    )
    return f"the class attribute of {named}{inherited}"


def findings(
    chain: Chain,
    verified: Any,
    seen_at_import: tuple[Layer, ...],
    patched_class: type | None,
) -> tuple[Finding, ...]:
    """Each layer of ``chain``: this plugin's, vLLM's ``verified`` function, or
    not verified, with where it sits and when it came.

    ``seen_at_import`` are the layers the plugin found when vLLM's scheduler
    module was imported (before it wrapped anything); ``patched_class`` is the
    class it patched (vLLM's ``Scheduler``).
    """
    own = chain.own_layer_index()
    override = (
        chain.owner is not None
        and patched_class is not None
        and chain.owner is not patched_class
    )
    result = []
    for index, layer in enumerate(chain.layers):
        where = _where(chain, patched_class, index)
        if layer.ours:
            result.append(Finding(layer, OWN_ROLE, where, None))
            continue
        if layer.target is verified and verified is not None:
            result.append(Finding(layer, VLLM_ROLE, where, None))
            continue
        if override and (own is None or index < own):
            order = Order.OVERRIDE
        elif own is not None:
            order = Order.AFTER if index < own else Order.BEFORE
        elif any(layer.same(seen) for seen in seen_at_import):
            order = Order.BEFORE
        else:
            order = Order.REPLACED
        result.append(Finding(layer, FOREIGN_ROLE, where, order))
    return tuple(result)
