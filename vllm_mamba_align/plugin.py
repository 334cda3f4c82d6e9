"""``register()``, and every place in vLLM the plugin touches.

Cheap and idempotent: ``register()`` validates the settings, then arranges (with
wrapt post-import hooks) for vLLM's modules to be patched whenever they are
imported, or at once if they already are. Nothing is patched for code that
releases.py does not recognize by fingerprint (unless the user opts in to
unverified split code that passes the structural check). ``AsyncScheduler`` (and
the diffusion schedulers of 0.31.0+) inherit every scheduler site.

Sites, one card each (why / how / upstream / delete when); the map from vLLM's
side (each function touched: its files, releases, and when to delete it) is
docs/maintaining/patches.md, which a test holds to the code:

1. **vLLM's environment-variable table** (``vllm.envs.environment_variables``).
   Why: 0.33.0 warns about every unknown ``VLLM_*`` variable and refuses to start
   on one under ``--fail-on-environ-validation``. How: ``setdefault`` of our two
   variables (:func:`declare_settings`), never overwriting. Upstream: none.
   Delete when: vLLM gives plugins a way to declare their variables.
2. **Class wrappers on ``Scheduler``** (wrapt, marked with :data:`MARKER`).
   ``__init__``: after vLLM's own init, decide per scheduler: activate, stand
   aside or refuse (activation.py). ``_mamba_block_aligned_split``: routes calls
   made through the class to the scheduler's bound route (:func:`split_wrapper`).
   Why: the engine core builds vLLM's ``Scheduler`` on every path (``vllm
   serve``, ``LLM``); patching the class reaches them all. Upstream: PR #54076
   (open, in no release). Delete when: every supported release has it; the
   plugin already stands aside where the scheduler sets
   ``mamba_state_block_size`` itself.
3. **Instance attributes of each align-mode hybrid scheduler** (the class and
   other schedulers are untouched):
   ``_mamba_block_aligned_split`` and ``_vllm_mamba_align_split`` hold the
   bound route: the fix (split.py), audit's observer (audit/) or, in ``off``,
   vLLM's own function. Why: vLLM calls the split for every running request at
   every step; an instance attribute skips the wrapt layers (about 0.5 us a
   call). ``mamba_state_block_size`` = B, the attribute upstream's fix adds
   (fixing modes only). In ``audit`` mode ``schedule`` and ``shutdown`` are
   observers that call vLLM's methods and return their results unchanged,
   ``_vllm_mamba_align_audit`` holds the counters, and two small attributes
   (``_vllm_mamba_align_audit_flags``, ``_vllm_mamba_align_audit_chain``) ride
   on each vLLM ``Request`` and die with it. Upstream: PR #54076. Delete when: as 2.
4. **The cache config, during each split call** (fixing modes). Why: every
   released split reads its grid from ``self.cache_config.block_size`` (C), the
   smallest block over all groups, not the Mamba grid B. How: for the duration
   of vLLM's call the scheduler's own ``cache_config`` attribute points at a
   read-only view whose ``block_size`` is B, restored in ``finally``; the shared
   config is never written. Upstream: PR #54076 (reads B from the KV-cache
   groups). Delete when: as 2.
5. **Model Runner V2's worker seed** (``MambaHybridModelState.add_request`` and
   ``_get_mamba_group_info``, of the GPU runner and 0.34.0's CPU runner; not in
   ``off`` mode). Why: 0.25.0-0.31.0 seed a resumed request's running-state
   column with C instead of B (vLLM issue #53142: a wrong pre-copy, illegal
   memory access); 0.32.0+ with ``cache_config.mamba_block_size``, which is not
   B once a hidden-state layer larger than the common page has scaled every
   group's block. How: wrapt wrappers re-seed with B once vLLM has bound the
   Mamba spec (worker_seed.py); seeds waiting for the spec sit in the model
   state's ``_vllm_mamba_align_pending_seeds``. Upstream: C fixed by
   #53798 in 0.32.0; the scaled grid in no release. Delete when: vLLM seeds
   from the Mamba spec's block size.
6. **The checkpoint-decision observer** (the scheduler module's
   ``is_mamba_prefill_checkpoint_valid``; bodies of 0.30.0+). Why: the fix must
   not add a stop where vLLM's backend checkpoints a chunk's interior itself;
   watching vLLM's own decision beats re-deriving it. How: a wrapt wrapper that
   counts True answers per thread and returns the answer unchanged
   (``split.observe_checkpoint_decision``); the route compares the count
   before and after vLLM's call. On the module, not per scheduler: vLLM's
   split looks the name up in its module's globals on each call, and that
   look-up is the only place its decision shows (docs/maintaining/patches.md).
   Upstream: PR #54076. Delete when: as 2.
7. **Nothing wrapped: the engine core's open handshake, read at a refusal**
   (``EngineCoreProc._perform_handshake`` in ``vllm/v1/engine/core.py``).
   Why: a refusal at scheduler construction (2.) in a ``vllm serve
   --headless`` node's engine core comes after its HELLO; vLLM then tells the
   head nothing, and the head's startup loop does not watch remote engines: it
   would wait, silent. How: only when ``Scheduler.__init__`` refuses, the
   plugin looks for vLLM's suspended ``_perform_handshake`` generator (by its
   code object) of a headless engine core and sends the refusal on its socket,
   still open then, as the engine's status; the head's
   ``wait_for_engine_startup`` rejects it quoting it (headless.py). A wrapper on
   ``startup_handshake`` would miss spawned engine cores, which load plugins
   after the handshake. Upstream: none. Delete when: vLLM tells the head why a
   remote engine core failed to start.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

import wrapt

from . import settings
from .activation import SPLIT_ATTRIBUTE, attach
from .errors import MambaAlignError
from .layers import MARKER, contains_ours
from .recognition import SPLIT_METHOD, recognize
from .releases import (
    GROUP_INFO_METHOD,
    MODEL_STATE,
    SEED_METHOD,
    WORKER_SITES,
    InternalCheckpoint,
)
from .seed_site import RESEEDED
from .settings import Mode
from .split import observe_checkpoint_decision
from .subclasses import SCHEDULER_MODULE, vllm_scheduler

ENVS_MODULE = "vllm.envs"
CHECKPOINT_DECISION = "is_mamba_prefill_checkpoint_valid"

_hook_installed = False


def register() -> None:
    """Entry point of the ``mamba_align`` plugin (group ``vllm.general_plugins``)."""
    global _hook_installed
    try:
        settings.check_startup()  # a bad setting fails here, before any patch
    except MambaAlignError as error:
        # The launcher of `vllm serve --headless` raises it once it knows the
        # head's address, and tells the head first (headless.py: imported only
        # on a refusal, the one time it has something to do).
        from . import headless

        if headless.hold(error):
            return
        raise
    if _hook_installed:
        return
    wrapt.register_post_import_hook(declare_settings, ENVS_MODULE)
    wrapt.register_post_import_hook(patch_scheduler_module, SCHEDULER_MODULE)
    for worker_module, _ in WORKER_SITES:
        wrapt.register_post_import_hook(patch_worker_module, worker_module)
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
    """Whether this attribute is, or wraps, a wrapper installed by this plugin."""
    return contains_ours(attribute)


def _wrap(owner: Any, name: str, wrapper: Any, tag: Any) -> None:
    wrapt.wrap_function_wrapper(owner, name, wrapper)
    installed = (
        owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    )
    setattr(installed, MARKER, tag)


def patch_scheduler_module(module: ModuleType) -> None:
    """Post-import hook: install the wrappers on vLLM's scheduler module, once.

    The wrappers go on vLLM's own ``Scheduler`` class even where another
    distribution has already put a subclass in its place (vllm-ascend's
    ``BalanceScheduler``, swapped in by its platform patches before general
    plugins load): the subclass inherits them, and activation judges the class
    each scheduler really is (subclasses.py).
    """
    found = getattr(module, "Scheduler", None)
    if found is None:
        return
    scheduler_class = vllm_scheduler(found)
    if is_patched(scheduler_class.__dict__.get("__init__")):
        return
    recognition = recognize(scheduler_class)

    def init_wrapper(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        wrapped(*args, **kwargs)
        try:
            attach(instance, recognition)
        except MambaAlignError as error:
            # An engine core of a headless node: the head hears it (headless.py).
            from . import headless

            headless.tell_head_from_engine_core(error)
            raise

    body = recognition.body
    # Over another plugin's layer nothing but __init__ is wrapped: each hybrid
    # scheduler is refused there (or, in mode off, left to that layer).
    if body is not None and not recognition.foreign:
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
    """Post-import hook: fix the worker's state seed where the code needs it, once.

    The re-seed (worker_seed.py) is imported here, in the process that imports
    vLLM's worker module: a scheduler's process without a worker never loads it.
    """
    model_state = getattr(module, MODEL_STATE, None)
    if model_state is None or is_patched(vars(model_state).get(SEED_METHOD)):
        return
    if settings.read_mode() is Mode.OFF:
        return
    from .worker_seed import Reseed, classify, column_tensor

    site = classify(model_state)
    if site not in RESEEDED:
        return
    reseed = Reseed(column_tensor(model_state))
    _wrap(model_state, GROUP_INFO_METHOD, reseed.group_info, site)
    _wrap(model_state, SEED_METHOD, reseed.add_request, site)
