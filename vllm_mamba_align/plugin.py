"""``register()``: the vLLM general-plugin entry point.

Cheap and idempotent: it validates the settings, then arranges (with a wrapt
post-import hook) for vLLM's scheduler module to be patched whenever it is
imported, or at once if it already is. What is patched:

- ``Scheduler.__init__``: after vLLM's init, decide per scheduler (activation.py).
- ``Scheduler._mamba_block_aligned_split``: only when its code is recognized (or the
  user opted in to unverified code that passes the structural check).
- Model Runner V2's ``MambaHybridModelState.add_request`` (and
  ``_get_mamba_group_info``): only on 0.25.1-0.31.0 code, which seeds the running
  state column with the wrong block size (worker_seed.py).
- The scheduler module's ``is_mamba_prefill_checkpoint_valid``: only on bodies whose
  internal-checkpoint decision is observed (0.30.0+); it records, never changes.

``AsyncScheduler`` inherits all of it.
"""

from __future__ import annotations

import functools
import os
import sys
from importlib import metadata
from types import ModuleType
from typing import Any

import wrapt

from . import settings
from .activation import SPLIT_ATTRIBUTE, Recognition, attach
from .activation import SPLIT_METHOD as SPLIT_METHOD  # re-exported
from .fingerprint import analyse_function
from .releases import InternalCheckpoint, body_for, unverified_body
from .settings import Mode
from .split import observe_checkpoint_decision
from .worker_seed import (
    MODEL_STATE,
    WORKER_MODULE,
    SeedSite,
    add_request_wrapper,
    classify,
    group_info_wrapper,
)

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
ENVS_MODULE = "vllm.envs"
CHECKPOINT_DECISION = "is_mamba_prefill_checkpoint_valid"
# Set on every wrapper this plugin installs, so a second register() (or a forked
# child, which inherits the patched class) never stacks another one.
MARKER = "_self_vllm_mamba_align"

_hook_installed = False


def register() -> None:
    """Entry point of the ``mamba_align`` plugin (group ``vllm.general_plugins``)."""
    global _hook_installed
    settings.read_mode()  # a bad setting fails here, before anything is patched
    settings.audit_interval()
    if _hook_installed:
        return
    wrapt.register_post_import_hook(declare_settings, ENVS_MODULE)
    wrapt.register_post_import_hook(patch_scheduler_module, SCHEDULER_MODULE)
    wrapt.register_post_import_hook(patch_worker_module, WORKER_MODULE)
    _hook_installed = True


def declare_settings(envs_module: ModuleType) -> None:
    """Make our ``VLLM_MAMBA_ALIGN_*`` variables known to vLLM.

    vLLM 0.33.0 warns about every ``VLLM_*`` variable it does not know, and refuses
    to start on one when ``--fail-on-environ-validation`` is set. Declaring ours
    in its table keeps users' logs clean and their servers starting.
    """
    table = getattr(envs_module, "environment_variables", None)
    if not isinstance(table, dict):
        return
    for name in (
        settings.MODE_VARIABLE,
        settings.ALLOW_UNVERIFIED_VARIABLE,
        settings.AUDIT_INTERVAL_VARIABLE,
    ):
        table.setdefault(name, functools.partial(os.getenv, name))


def is_patched(attribute: Any) -> bool:
    """Whether this attribute is a wrapper installed by this plugin."""
    return getattr(attribute, MARKER, None) is not None


def _installed_vllm_version() -> str | None:
    vllm = sys.modules.get("vllm")
    version = getattr(vllm, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def recognize(scheduler_class: type) -> Recognition:
    """Identify the installed split function and pick the rules for it."""
    version = _installed_vllm_version()
    split = scheduler_class.__dict__.get(SPLIT_METHOD)
    if split is None:
        return Recognition(version, None, None, verified=False)
    shape = analyse_function(split)
    body = body_for(shape.fingerprint)
    if body is not None:
        return Recognition(version, shape, body, verified=True, split=split)
    if settings.allow_unverified() and shape.structurally_compatible:
        body = unverified_body(shape)
        return Recognition(version, shape, body, verified=False, split=split)
    return Recognition(version, shape, None, verified=False, split=split)


def _wrap(owner: Any, name: str, wrapper: Any, tag: Any) -> None:
    wrapt.wrap_function_wrapper(owner, name, wrapper)
    installed = (
        owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    )
    setattr(installed, MARKER, tag)


def patch_scheduler_module(module: ModuleType) -> None:
    """Post-import hook: install the wrappers on vLLM's scheduler module, once."""
    scheduler_class = getattr(module, "Scheduler", None)
    if scheduler_class is None or is_patched(scheduler_class.__dict__.get("__init__")):
        return
    recognition = recognize(scheduler_class)

    def init_wrapper(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        wrapped(*args, **kwargs)
        attach(instance, recognition)

    body = recognition.body
    if body is not None:
        if body.internal_checkpoint is InternalCheckpoint.OBSERVED:
            _wrap(module, CHECKPOINT_DECISION, observe_checkpoint_decision, recognition)
        _wrap(scheduler_class, SPLIT_METHOD, split_wrapper, recognition)
    _wrap(scheduler_class, "__init__", init_wrapper, recognition)


def split_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int:
    """Route a split call made through the class to the scheduler's bound route.

    A scheduler's own calls normally skip this wrapper: ``activation`` binds the
    route on the instance. Calls through the class (``Scheduler.<split>(s, …)``)
    arrive here and go the same way; schedulers without a route run stock.
    """
    route = getattr(instance, "__dict__", {}).get(SPLIT_ATTRIBUTE)
    if route is None:
        return wrapped(*args, **kwargs)  # type: ignore[no-any-return]
    return route(*args, **kwargs)  # type: ignore[no-any-return]


def patch_worker_module(module: ModuleType) -> None:
    """Post-import hook: fix the worker's state seed where the code needs it, once."""
    model_state = getattr(module, MODEL_STATE, None)
    if model_state is None or is_patched(vars(model_state).get("add_request")):
        return
    if settings.read_mode() is Mode.OFF:
        return
    site = classify(model_state)
    if site is not SeedSite.SEEDS_WITH_CACHE_BLOCK:
        return
    _wrap(model_state, "_get_mamba_group_info", group_info_wrapper, site)
    _wrap(model_state, "add_request", add_request_wrapper, site)
