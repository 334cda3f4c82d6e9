"""Per-scheduler decision: activate the fix, stand aside, or refuse to start.

Runs right after vLLM's own ``Scheduler.__init__``, when the KV-cache groups are
known. Logs exactly one line through vLLM's logger saying what it found and did;
its words (the refusals, the start line, the mode summaries) are messages.py's.
"""

from __future__ import annotations

import ast
import functools
import sys
import types
from pathlib import Path
from typing import Any

from . import audit, hazard, messages, metrics, settings
from .errors import MambaAlignError
from .geometry import mamba_groups
from .layers import Chain, walk
from .policy import StopPolicy, step_budget
from .protocols import Scheduler
from .recognition import SPLIT_METHOD as SPLIT_METHOD  # re-exported
from .recognition import Recognition, split_findings
from .releases import SplitBody
from .retention import Retention, read_retention
from .settings import Mode
from .split import SplitFunction, state_grid_split
from .subclasses import foreign_classes, problems

# The attribute upstream's fix (PR #54076) adds; if vLLM set it itself, the fix landed.
STATE_BLOCK_ATTRIBUTE = "mamba_state_block_size"
# Where the installed fix lives on a scheduler instance.
SPLIT_ATTRIBUTE = "_vllm_mamba_align_split"


def attach(scheduler: Scheduler, recognition: Recognition) -> None:
    """Decide for one freshly built scheduler; raise to refuse it, never half-apply.

    The mode is read once, first: in ``off`` nothing found here refuses
    (vLLM's split runs unchanged, whoever wrote it, whatever the Mamba groups
    say); the start line says why the plugin stands aside. The split's layers
    are walked once, here: the refusal checks, mode ``off``'s binding and its
    start line all read that one walk.
    """
    mode = settings.read_mode()
    if not _needs_align_split(scheduler):
        _log(scheduler, recognition, mode, "inactive (no Mamba layers in align mode)")
        return
    if upstream_fix_present(type(scheduler)):
        upstream = getattr(scheduler, STATE_BLOCK_ATTRIBUTE, None)
        _log(
            scheduler,
            recognition,
            mode,
            "inactive (vLLM already derives mamba_state_block_size itself: "
            "the upstream fix is present)",
            upstream,
        )
        return
    if mode is Mode.OFF:
        _stand_aside(scheduler, recognition)
        return
    groups = mamba_groups(scheduler.kv_cache_config)
    if len({group.block_size for group in groups}) > 1:
        # No single grid can keep every slot's state at its boundary: guessing
        # one would publish wrong states.
        listing = "; ".join(group.describe() for group in groups)
        raise messages.refuse_disagreeing_groups(listing, recognition.vllm_version)
    state_grid = groups[0].block_size if groups else None
    if state_grid is None:
        _log(scheduler, recognition, mode, "inactive (no Mamba spec among KV groups)")
        return
    chain = walk(type(scheduler), SPLIT_METHOD)
    refusal = split_refusal(recognition, chain, mode)
    if refusal is not None:
        raise refusal
    body = recognition.body
    assert body is not None  # split_refusal refuses every body-less recognition
    retention = read_retention(scheduler, state_grid)
    if mode is Mode.AUDIT:  # stock schedules, counted: no stall guard needed
        observer = audit.install(
            scheduler, state_grid, body, recognition.split, retention
        )
        _bind_split(scheduler, observer)
        _log(
            scheduler,
            recognition,
            mode,
            f"{audit.ACTIVE_STATUS}; {retention.describe()}",
            state_grid,
        )
        return
    if not body.wide_block_exemption:
        _refuse_stall(scheduler, body, state_grid)
    _activate_fix(scheduler, recognition, mode, retention, state_grid)


def _stand_aside(scheduler: Scheduler, recognition: Recognition) -> None:
    """Mode ``off``: refuse nothing, bind vLLM's own split (or leave another
    plugin's layer in place), and say on the start line what a fixing mode
    would have refused, so an A/B run shows why the two differ."""
    groups = mamba_groups(scheduler.kv_cache_config)
    if not groups:
        status = "inactive (no Mamba spec among KV groups)"
        _log(scheduler, recognition, Mode.OFF, status)
        return
    sizes = {group.block_size for group in groups}
    state_grid = next(iter(sizes)) if len(sizes) == 1 else None
    chain = walk(type(scheduler), SPLIT_METHOD)
    _bind_unchanged(scheduler, chain)
    status = messages.off_status(recognition, chain, groups if len(sizes) > 1 else ())
    _log(scheduler, recognition, Mode.OFF, status, state_grid)


def _activate_fix(
    scheduler: Scheduler,
    recognition: Recognition,
    mode: Mode,
    retention: Retention,
    state_grid: int,
) -> None:
    """Bind the fix of a fixing mode, or vLLM's own split where the fix would
    schedule exactly as it does, and log the start line."""
    body = recognition.body
    assert body is not None
    policy = StopPolicy.for_scheduler(mode, body, retention, scheduler, state_grid)
    summary = messages.mode_summary(mode, retention, policy.yield_replay_to_checkpoint)
    if policy.schedules_as_vllm(scheduler.cache_config.block_size):
        # Nothing to change on this scheduler: vLLM's own function, no layer.
        _bind_split(scheduler, recognition.split.__get__(scheduler, type(scheduler)))
        summary += (
            f"; here C = B and no stop applies to body {body.name}, so vLLM's own "
            "split already schedules as the fix would and is bound unchanged"
        )
    else:
        route = state_grid_split(scheduler, recognition.split, policy, retention, body)
        _bind_split(scheduler, route)
    setattr(scheduler, STATE_BLOCK_ATTRIBUTE, state_grid)
    invariance = messages.batch_invariance_note(
        mode, retention.dense, recognition.vllm_version
    )
    _log(
        scheduler,
        recognition,
        mode,
        f"ACTIVE, mode={mode.value}: {summary} "
        "(backport of vLLM PR #54076)" + (f"; {invariance}" if invariance else ""),
        state_grid,
    )


# -- recognition of the scheduler ----------------------------------------------


def _needs_align_split(scheduler: Scheduler) -> bool:
    flag = getattr(scheduler, "need_mamba_block_aligned_split", None)
    if flag is not None:
        return bool(flag)
    has_mamba = bool(getattr(scheduler.kv_cache_config, "has_mamba_layers", False))
    mode = getattr(scheduler.cache_config, "mamba_cache_mode", None)
    return has_mamba and mode == "align"


def upstream_fix_present(scheduler_class: type) -> bool:
    """Whether vLLM's own scheduler code derives ``mamba_state_block_size``
    itself (upstream's fix, PR #54076, is in this vLLM): some module of the
    class's MRO assigns that attribute.

    The one check both activation and ``vllm-mamba-align doctor`` use. Read
    from the source, not an instance: the plugin sets the same attribute on the
    schedulers it fixes. Each file is parsed once per process.
    """
    for klass in scheduler_class.__mro__:
        module = sys.modules.get(klass.__module__)
        source_file = getattr(module, "__file__", None)
        if source_file and _assigns_state_block(source_file):
            return True
    return False


@functools.lru_cache(maxsize=16)
def _assigns_state_block(source_file: str) -> bool:
    try:
        tree = ast.parse(Path(source_file).read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    return any(
        isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and node.attr == STATE_BLOCK_ATTRIBUTE
        for node in ast.walk(tree)
    )


# -- refusal checks ------------------------------------------------------------


def split_refusal(
    recognition: Recognition, chain: Chain, mode: Mode | None = None
) -> MambaAlignError | None:
    """Why a hybrid align-mode scheduler of the chain's class would be refused,
    if at all: a layer in its split (``chain``, layers.walk) the plugin has not
    verified (another plugin's wrapper, a subclass's override), or vLLM code the
    plugin does not know.

    The one decision both :func:`attach` and ``vllm-mamba-align doctor`` use. In
    mode ``off`` nothing is refused: the split runs unchanged, whoever wrote it.
    ``mode``: the one :func:`attach` read (None: read it here, for ``doctor``).
    """
    if mode is None:
        mode = settings.read_mode()
    if mode is Mode.OFF:
        return None
    found = split_findings(recognition, chain)
    if any(not finding.verified for finding in found):
        return messages.refuse_unverified_layers(recognition, chain, found)
    refused = hybrid_refusal(recognition, mode)
    if refused is not None:
        return refused
    return subclass_refusal(chain.scheduler_class, audit=mode is Mode.AUDIT)


def hybrid_refusal(
    recognition: Recognition, mode: Mode | None = None
) -> MambaAlignError | None:
    """Why a hybrid align-mode scheduler would be refused with this code, if at all.

    The one decision both :func:`attach` and ``vllm-mamba-align doctor`` use, so
    the doctor cannot disagree with what vLLM will do at start.
    In mode ``off`` nothing is refused: vLLM's own split runs unchanged.
    """
    if mode is None:
        mode = settings.read_mode()
    if recognition.body is None and mode is not Mode.OFF:
        return messages.refuse_unknown_code(recognition)
    return None


def subclass_refusal(scheduler_class: type, audit: bool) -> MambaAlignError | None:
    """Why the fix cannot run inside this scheduler class, when it is another
    distribution's subclass of vLLM's ``Scheduler`` that inherits vLLM's split
    (subclasses.py); None when its code keeps what the fix relies on."""
    for klass in foreign_classes(scheduler_class):
        reasons = problems(klass, audit)
        if reasons:
            return messages.refuse_subclass(scheduler_class, klass, reasons)
    return None


def _refuse_stall(scheduler: Scheduler, body: SplitBody, state_grid: int) -> None:
    """Stall guard for bodies without vLLM's "block too wide for one chunk" rule.

    Those bodies (0.15.0-0.26.0) floor every non-final chunk to the grid; on the B
    grid a B wider than the step budget floors to 0 tokens forever.
    """
    budget, source = step_budget(scheduler)
    if state_grid > budget:
        raise messages.refuse_stall(body, state_grid, budget, source)


# -- binding and the start line ------------------------------------------------


def _bind_unchanged(scheduler: Scheduler, chain: Chain) -> None:
    """Mode off: this scheduler calls what vLLM would call without the plugin.

    Where this plugin's wrapper is the class's outermost layer, the scheduler is
    bound straight to what that wrapper wraps (vLLM's function, or another
    plugin's layer installed before this one), skipping the wrapper's frames.
    Otherwise (another plugin's layer above ours, a subclass's override) nothing
    is bound and vLLM calls that layer, which runs as its plugin wrote it.
    """
    below = chain.below_own_layer()
    if below is not None and type(below.target) is types.FunctionType:
        _bind_split(scheduler, below.target.__get__(scheduler, type(scheduler)))


def _bind_split(scheduler: Scheduler, route: SplitFunction) -> None:
    """Bind this scheduler's split calls straight to ``route``.

    vLLM calls ``self._mamba_block_aligned_split`` for every running request at
    every step, decodes included. The class-level wrapt wrapper would add its
    layers to each of those calls; an attribute on the scheduler instance shadows
    it, so this scheduler's calls go straight to the fix (or straight to vLLM's
    own function when there is nothing to fix). The class wrapper stays, and
    routes any call made through the class to the same place.
    """
    scheduler.__dict__[SPLIT_ATTRIBUTE] = route
    scheduler.__dict__[SPLIT_METHOD] = route


def _logger() -> Any:
    from vllm.logger import init_logger

    return init_logger("vllm.plugins.mamba_align")


def _log(
    scheduler: Any,
    recognition: Recognition,
    mode: Mode,
    status: str,
    state_grid: int | None = None,
) -> None:
    _logger().info(
        "%s", messages.start_line(scheduler, recognition, status, state_grid)
    )
    hazard.warn_known_defects(
        scheduler, recognition.vllm_version, _logger(), state_grid
    )
    metrics.publish_info(
        scheduler,
        mode=mode.value,
        status=metrics.status_word(status),
        state_block=state_grid,
        vllm_version=recognition.vllm_version,
    )
