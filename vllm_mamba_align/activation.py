"""Per-scheduler decision: activate the fix, stand aside, or refuse to start.

Runs right after vLLM's own ``Scheduler.__init__``, when the KV-cache groups are
known. Logs exactly one line through vLLM's logger saying what it found and did.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import audit, metrics, settings
from .errors import MambaAlignError
from .fingerprint import CodeShape
from .geometry import state_block_size
from .layers import (
    Chain,
    Finding,
    Layer,
    Order,
    describe_distribution,
    findings,
    walk,
)
from .policy import StopPolicy, step_budget
from .protocols import Scheduler
from .releases import (
    BATCH_INVARIANT_VARIABLE,
    SUPPORTED_RELEASES,
    SplitBody,
    describe_mismatch,
    describe_version,
    expected_body,
    mamba_backends_accepting_batch_invariance,
    refuses_batch_invariance_for_mamba,
)
from .retention import Retention, read_retention
from .settings import Mode
from .signature import SplitFunction
from .split import state_grid_split
from .subclasses import describe_class, foreign_classes, problems
from .version import __version__

# The attribute upstream's fix (PR #54076) adds; if vLLM set it itself, the fix landed.
STATE_BLOCK_ATTRIBUTE = "mamba_state_block_size"
SPLIT_METHOD = "_mamba_block_aligned_split"
# Where the installed fix lives on a scheduler instance.
SPLIT_ATTRIBUTE = "_vllm_mamba_align_split"


@dataclass(frozen=True)
class Recognition:
    """What the plugin found when vLLM's scheduler module was imported."""

    vllm_version: str | None
    shape: CodeShape | None
    """None when this vLLM has no ``_mamba_block_aligned_split`` at all."""
    body: SplitBody | None
    """The known body, or the best-effort rules of an opted-in unverified body."""
    verified: bool
    split: Any = None
    """vLLM's own ``_mamba_block_aligned_split`` function: the innermost layer of
    the class attribute, defined in the scheduler's module (None: no such layer)."""
    layers: tuple[Layer, ...] = ()
    """Every layer of the class attribute when vLLM's scheduler module was
    imported, outermost first, this plugin's own left out (layers.py)."""
    scheduler_class: type | None = None
    """The class recognized (and patched): vLLM's ``Scheduler``."""

    @property
    def foreign(self) -> tuple[Layer, ...]:
        """The layers found at import that are not vLLM's own function."""
        return tuple(layer for layer in self.layers if layer.target is not self.split)


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


def _logger() -> Any:
    from vllm.logger import init_logger

    return init_logger("vllm.plugins.mamba_align")


def _needs_align_split(scheduler: Scheduler) -> bool:
    flag = getattr(scheduler, "need_mamba_block_aligned_split", None)
    if flag is not None:
        return bool(flag)
    has_mamba = bool(getattr(scheduler.kv_cache_config, "has_mamba_layers", False))
    mode = getattr(scheduler.cache_config, "mamba_cache_mode", None)
    return has_mamba and mode == "align"


def _refuse_unknown_code(recognition: Recognition) -> MambaAlignError:
    shape = recognition.shape
    found = shape.fingerprint if shape and shape.fingerprint else "unreadable source"
    if shape and shape.problem:
        found += f" ({shape.problem})"
    expected = expected_body(recognition.vllm_version)
    known = (
        f" {describe_mismatch(recognition.vllm_version, expected.fingerprint, found)}."
        if expected
        else ""
    )
    newest = SUPPORTED_RELEASES[-1]
    if shape and shape.structurally_compatible:
        opt_in = (
            f"(2) set {settings.ALLOW_UNVERIFIED_VARIABLE}=1 to run the fix on this "
            "code anyway: the plugin then checks only that the function reads "
            "self.cache_config.block_size exactly once and takes the released "
            "parameters (this code does), and applies the newest rules whose names "
            "the code uses; nothing else about this code has been tested"
        )
    else:
        opt_in = (
            f"(2) {settings.ALLOW_UNVERIFIED_VARIABLE}=1 cannot help: this code "
            "does NOT pass the structural check it requires (exactly one read of "
            "self.cache_config.block_size, the released parameters)"
        )
    return MambaAlignError(
        f"vllm-mamba-align {__version__}: this model needs vLLM's align-mode chunk "
        "split, but the installed Scheduler._mamba_block_aligned_split is code the "
        f"plugin has not verified (vLLM {describe_version(recognition.vllm_version)}"
        f", fingerprint {found}).{known} The newest vLLM release vllm-mamba-align "
        f"{__version__} has verified is {newest}. Verified releases: "
        f"{', '.join(SUPPORTED_RELEASES)}. Ways out: (1) pin vLLM to a "
        f"verified release (pip install vllm=={newest}); {opt_in}; (3) set "
        f"{settings.MODE_VARIABLE}=off (or leave mamba_align out of VLLM_PLUGINS) "
        "to run vLLM's own split unchanged, defect included. Please report this "
        "vLLM on the plugin's issue tracker with the output of "
        "`vllm-mamba-align doctor --json` attached."
    )


def _refuse_stall(scheduler: Scheduler, body: SplitBody, state_grid: int) -> None:
    """Stall guard for bodies without vLLM's "block too wide for one chunk" rule.

    Those bodies (0.15.1-0.26.0) floor every non-final chunk to the grid; on the B
    grid a B wider than the step budget floors to 0 tokens forever.
    """
    budget, source = step_budget(scheduler)
    if state_grid <= budget:
        return
    raise MambaAlignError(
        f"vllm-mamba-align: the Mamba state block B={state_grid} is larger than "
        f"the per-step prefill budget {budget} ({source}). On vLLM "
        f"{body.name} a prefill chunk must end on the state grid, so no request "
        f"could ever finish its prefill. Raise --max-num-batched-tokens (and "
        f"--long-prefill-token-threshold, if set) to at least {state_grid}, or "
        "lower --mamba-block-size, or upgrade to vLLM 0.27.1+ (which lets a wide "
        "block advance in sub-block steps)."
    )


def hybrid_refusal(recognition: Recognition) -> MambaAlignError | None:
    """Why a hybrid align-mode scheduler would be refused with this code, if at all.

    The one decision both :func:`attach` and ``vllm-mamba-align doctor`` use, so
    the doctor cannot disagree with what vLLM will do at start.
    In mode ``off`` nothing is refused: vLLM's own split runs unchanged.
    """
    if recognition.body is None and settings.read_mode() is not Mode.OFF:
        return _refuse_unknown_code(recognition)
    return None


def _geometry(scheduler: Scheduler, state_grid: int | None) -> str:
    cache_block = scheduler.cache_config.block_size
    hash_block = getattr(scheduler, "hash_block_size", cache_block)
    grid = "none" if state_grid is None else state_grid
    return (
        f"cache block C={cache_block}, Mamba state block B={grid}, "
        f"hash block {hash_block}"
        f"{_data_parallel_rank(scheduler)}"
    )


def _data_parallel_rank(scheduler: Any) -> str:
    """``; data-parallel rank R of N`` where vLLM runs N > 1 lockstep engine
    cores, ``; data-parallel rank R`` in any Ray actor.

    Why: under the Ray backend every engine core logs under its actor's class
    and process id, with no rank (vLLM's own process tag, ``EngineCore_DP<R>``,
    names it in its other launch modes). A rank that vLLM runs independently
    (a model it does not count as MoE) has its data-parallel size set to 1
    before the scheduler is built; its index still names the rank.
    """
    config = getattr(scheduler, "vllm_config", None)
    size = getattr(getattr(config, "parallel_config", None), "data_parallel_size", 1)
    lockstep = isinstance(size, int) and size > 1
    if not lockstep and not metrics.in_ray_actor():
        return ""
    rank = metrics.scheduler_labels(scheduler)["engine"]
    return f"; data-parallel rank {rank}" + (f" of {size}" if lockstep else "")


def _log(
    scheduler: Any, recognition: Recognition, status: str, state_grid: int | None
) -> None:
    body = recognition.body
    code = (
        f"split body {body.name}, fingerprint {body.fingerprint}"
        if body and recognition.verified
        else f"unverified split, fingerprint {recognition.shape.fingerprint}"
        if recognition.shape and recognition.shape.fingerprint
        else "no align split in this vLLM"
    )
    note = scheduler_note(type(scheduler))
    if note is not None:
        code += f"; scheduler class {note}"
    _logger().info(
        "vllm-mamba-align %s on vLLM %s (%s): %s; %s",
        __version__,
        describe_version(recognition.vllm_version),
        code,
        status,
        _geometry(scheduler, state_grid),
    )
    metrics.publish_info(
        scheduler,
        mode=settings.read_mode().value,
        status=status.split(",")[0].split(" ")[0],
        state_block=state_grid,
        vllm_version=recognition.vllm_version,
    )


def split_findings(recognition: Recognition, chain: Chain) -> tuple[Finding, ...]:
    """Every layer of a split chain, judged: this plugin's wrapper, vLLM's
    function the plugin recognized, or not verified (layers.py)."""
    return findings(
        chain, recognition.split, recognition.layers, recognition.scheduler_class
    )


def split_refusal(
    recognition: Recognition, scheduler_class: type
) -> MambaAlignError | None:
    """Why a hybrid align-mode scheduler of this class would be refused, if at all:
    a layer in its split the plugin has not verified (another plugin's wrapper, a
    subclass's override), or vLLM code the plugin does not know.

    The one decision both :func:`attach` and ``vllm-mamba-align doctor`` use. In
    mode ``off`` nothing is refused: the split runs unchanged, whoever wrote it.
    """
    mode = settings.read_mode()
    if mode is Mode.OFF:
        return None
    chain = walk(scheduler_class, SPLIT_METHOD)
    found = split_findings(recognition, chain)
    if any(not finding.verified for finding in found):
        return _refuse_unverified_layers(recognition, chain, found)
    refused = hybrid_refusal(recognition)
    if refused is not None:
        return refused
    return subclass_refusal(scheduler_class, audit=mode is Mode.AUDIT)


def subclass_refusal(scheduler_class: type, audit: bool) -> MambaAlignError | None:
    """Why the fix cannot run inside this scheduler class, when it is another
    distribution's subclass of vLLM's ``Scheduler`` that inherits vLLM's split
    (subclasses.py); None when its code keeps what the fix relies on."""
    for klass in foreign_classes(scheduler_class):
        reasons = problems(klass, audit)
        if reasons:
            return _refuse_subclass(scheduler_class, klass, reasons)
    return None


def _refuse_subclass(
    scheduler_class: type, klass: type, reasons: list[str]
) -> MambaAlignError:
    built = (
        ""
        if klass is scheduler_class
        else f" (an ancestor of {describe_class(scheduler_class)})"
    )
    return MambaAlignError(
        f"vllm-mamba-align {__version__}: this model needs vLLM's align-mode chunk "
        f"split, and the scheduler vLLM builds is {describe_class(klass)}{built}, "
        "a subclass of vLLM's Scheduler from another distribution. It inherits "
        f"vLLM's own {SPLIT_METHOD}, but the fix also relies on the subclass "
        "calling that split only as self."
        f"{SPLIT_METHOD}(...) with vLLM's arguments and on attributes bound on the "
        f"scheduler taking effect, and its code does not: {'; '.join(reasons)}. "
        "The plugin starts its fix only inside code it has checked, so it refuses "
        "to start this scheduler rather than run the fix half applied. Ways out: "
        f"(1) set {settings.MODE_VARIABLE}=off: the plugin binds nothing on this "
        "scheduler and it runs unchanged (vLLM's defect included); (2) leave "
        "mamba_align out of VLLM_PLUGINS (list every other plugin you need, your "
        "platform plugin included); (3) report it on the plugin's issue tracker "
        "with the output of `vllm-mamba-align doctor --json` attached."
    )


def scheduler_note(scheduler_class: type) -> str | None:
    """For the start line: the scheduler class, when it is another
    distribution's subclass of vLLM's (None: vLLM's own class)."""
    foreign = foreign_classes(scheduler_class)
    if not foreign:
        return None
    named = "; ".join(describe_class(klass) for klass in foreign)
    if foreign[0] is not scheduler_class:  # e.g. vLLM's AsyncScheduler over it
        named = f"{scheduler_class.__qualname__} (vLLM's), built on {named}"
    unchecked = [reason for klass in foreign for reason in problems(klass, False)]
    if unchecked:
        return (
            f"{named}, a subclass of vLLM's Scheduler whose code "
            f"the fix could not run in: {'; '.join(unchecked)}"
        )
    return (
        f"{named}, a subclass of vLLM's Scheduler that calls the "
        f"split only as self.{SPLIT_METHOD}(...) with vLLM's arguments (checked)"
    )


def _describe_finding(number: int, finding: Finding, recognition: Recognition) -> str:
    text = f"{number}. {finding.layer.describe()}, {finding.where}: "
    if finding.order is not None:
        return text + f"NOT VERIFIED, {finding.order.value}"
    if finding.layer.ours:
        return text + "this plugin's wrapper"
    body = recognition.body
    shape = recognition.shape
    fingerprint = shape.fingerprint if shape else None
    if body is not None and recognition.verified:
        return text + f"vLLM's own function, split body {body.name} ({fingerprint})"
    return text + f"vLLM's function, matching no verified release ({fingerprint})"


def _refuse_unverified_layers(
    recognition: Recognition, chain: Chain, found: tuple[Finding, ...]
) -> MambaAlignError:
    unverified = [finding for finding in found if not finding.verified]
    plugins = ", ".join(
        dict.fromkeys(
            describe_distribution(finding.layer.module) for finding in unverified
        )
    )
    owner = chain.owner
    if unverified[0].order is Order.OVERRIDE and owner is not None:
        headline = (
            f"{owner.__qualname__} overrides {SPLIT_METHOD} with code the plugin "
            f"has not verified ({plugins})"
        )
    else:
        headline = (
            f"another plugin patched vLLM's Scheduler.{SPLIT_METHOD} with code "
            f"the plugin has not verified ({plugins})"
        )
    layers = "; ".join(
        _describe_finding(number, finding, recognition)
        for number, finding in enumerate(found, start=1)
    )
    return MambaAlignError(
        f"vllm-mamba-align {__version__}: this model needs vLLM's align-mode chunk "
        f"split, but {headline}. The split a {_scheduler_named(chain)} calls, "
        f"outermost layer first: {layers}. The plugin runs only code it has "
        "verified inside its fix and has no rule for composing the fix with "
        "another plugin's split, so it refuses to start this scheduler rather than "
        "change or bypass that split. Ways out: (1) set "
        f"{settings.MODE_VARIABLE}=off: the plugin binds nothing on this scheduler "
        "and that split runs unchanged (vLLM's defect included); (2) leave "
        "mamba_align out of VLLM_PLUGINS (list every other plugin you need, your "
        "platform plugin included); (3) report it on the plugin's issue tracker "
        "with the output of `vllm-mamba-align doctor --json` attached. "
        f"{settings.ALLOW_UNVERIFIED_VARIABLE} does not apply to another plugin's "
        "code."
    )


def _scheduler_named(chain: Chain) -> str:
    klass = chain.scheduler_class
    if foreign_classes(klass):
        return describe_class(klass)
    return klass.__qualname__


def _bind_unchanged(scheduler: Scheduler) -> None:
    """Mode off: this scheduler calls what vLLM would call without the plugin.

    Where this plugin's wrapper is the class's outermost layer, the scheduler is
    bound straight to what that wrapper wraps (vLLM's function, or another
    plugin's layer installed before this one), skipping the wrapper's frames.
    Otherwise (another plugin's layer above ours, a subclass's override) nothing
    is bound and vLLM calls that layer, which runs as its plugin wrote it.
    """
    below = walk(type(scheduler), SPLIT_METHOD).below_own_layer()
    if below is not None and type(below.target) is types.FunctionType:
        _bind_split(scheduler, below.target.__get__(scheduler, type(scheduler)))


def _off_status(recognition: Recognition, scheduler: Scheduler) -> str:
    unverified = [
        finding.layer.describe()
        for finding in split_findings(recognition, walk(type(scheduler), SPLIT_METHOD))
        if not finding.verified
    ]
    if not unverified:
        return "loaded, mode=off (stock vLLM split)"
    return (
        "loaded, mode=off (the split runs unchanged, with layers the plugin has "
        f"not verified: {'; '.join(unverified)})"
    )


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


def attach(scheduler: Scheduler, recognition: Recognition) -> None:
    """Decide for one freshly built scheduler; raise to refuse it, never half-apply."""
    mode = settings.read_mode()
    if not _needs_align_split(scheduler):
        _log(scheduler, recognition, "inactive (no Mamba layers in align mode)", None)
        return
    if upstream_fix_present(type(scheduler)):
        upstream = getattr(scheduler, STATE_BLOCK_ATTRIBUTE, None)
        _log(
            scheduler,
            recognition,
            "inactive (vLLM already derives mamba_state_block_size itself: "
            "the upstream fix is present)",
            upstream,
        )
        return
    state_grid = state_block_size(scheduler.kv_cache_config)
    if state_grid is None:
        _log(scheduler, recognition, "inactive (no Mamba spec among KV groups)", None)
        return
    refusal = split_refusal(recognition, type(scheduler))
    if refusal is not None:
        raise refusal
    if mode is Mode.OFF:  # also unverified code, or another plugin's: unchanged
        _bind_unchanged(scheduler)
        _log(scheduler, recognition, _off_status(recognition, scheduler), state_grid)
        return
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
            f"{audit.ACTIVE_STATUS}; {retention.describe()}",
            state_grid,
        )
        return
    if not body.wide_block_exemption:
        _refuse_stall(scheduler, body, state_grid)
    _activate_fix(scheduler, recognition, mode, retention, state_grid)


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
    summary = mode_summary(mode, retention, policy.yield_replay_to_checkpoint)
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
    invariance = batch_invariance_note(mode, retention.dense, recognition.vllm_version)
    _log(
        scheduler,
        recognition,
        f"ACTIVE, mode={mode.value}: {summary} "
        "(backport of vLLM PR #54076)" + (f"; {invariance}" if invariance else ""),
        state_grid,
    )


CANONICAL = (
    "every kept state is computed one B block per chunk whoever writes it, so a "
    "continuation from the cache equals a fresh run bit for bit while the writer's "
    "steps do not change the numerics"
)


def mode_summary(mode: Mode, retention: Retention, yields_replay: bool = False) -> str:
    """What a fixing mode does under this retention, for the start line;
    ``yields_replay``: :attr:`StopPolicy.yield_replay_to_checkpoint`."""
    kept = retention.describe()
    if mode is Mode.GRID:
        return (
            "chunks end on the B grid (no wrong state published; boundaries inside "
            f"a chunk are not materialized); {kept}"
        )
    if mode is Mode.LEAN and not retention.dense:
        given_up = (
            ", except a replay boundary whose slot the backend's prompt checkpoint "
            "takes (vLLM keeps the checkpoint there, as stock does)"
            if yields_replay
            else ""
        )
        return (
            "chunks end where vLLM's own split ends them, and on every B boundary "
            "vLLM keeps (every kept state materialized, no wrong state published, "
            f"stock's steps elsewhere){given_up}; {kept}"
        )
    if retention.dense:  # every boundary kept: kept and full stop alike
        return (
            "chunks end on the B grid and stop at every B boundary, all of which "
            f"vLLM keeps (lean, kept and full are the same here): {CANONICAL}; {kept}"
        )
    if mode is Mode.FULL:
        return (
            "chunks end on the B grid and stop at every B boundary, also where vLLM "
            f"drops the state (one prefill step each): {CANONICAL} (serial traffic, "
            "unless vLLM runs batch-invariant, which 0.20.2+ refuses for Mamba "
            f"backends); {kept}"
        )
    return (
        "chunks end on the B grid and stop at every B boundary vLLM keeps (every "
        f"kept state materialized, no step spent on a state vLLM drops); {kept}; "
        "mode=full also stops where vLLM drops the state, so that a cached "
        "continuation equals a fresh run bit for bit for serial traffic"
    )


def batch_invariance_requested() -> bool:
    """Whether ``VLLM_BATCH_INVARIANT`` is on, read as vLLM reads it."""
    raw = os.environ.get(BATCH_INVARIANT_VARIABLE, "0").strip()
    try:
        return bool(int(raw))
    except ValueError:
        return False


def batch_invariance_note(
    mode: Mode, retention_dense: bool, version: str | None
) -> str | None:
    """What vLLM's batch-invariant mode means for the modes on this release,
    when it is on (None when it is off)."""
    if not batch_invariance_requested():
        return None
    release = describe_version(version)
    if refuses_batch_invariance_for_mamba():
        return (
            f"{BATCH_INVARIANT_VARIABLE}=1: vLLM {release} refuses batch-invariant "
            f"mode for Mamba backends{_except_accepting()} (RuntimeError while the "
            "model loads, before any scheduler starts), so hybrid models run "
            "without it and cached equals fresh for serial traffic only, in every "
            f"mode; unset {BATCH_INVARIANT_VARIABLE} to serve hybrid models"
        )
    if mode is Mode.FULL or (mode in (Mode.KEPT, Mode.LEAN) and retention_dense):
        return (
            f"{BATCH_INVARIANT_VARIABLE}=1 (vLLM {release} accepts it for hybrid "
            f"models): with mode={mode.value} a continuation from the cache equals "
            "a fresh run also for batched traffic"
        )
    return (
        f"{BATCH_INVARIANT_VARIABLE}=1 (vLLM {release} accepts it for hybrid "
        f"models): mode={mode.value} leaves kept states computed by chunks that "
        "depend on who wrote them; set VLLM_MAMBA_ALIGN_MODE=full to make a "
        "continuation from the cache equal a fresh run for batched traffic"
    )


def _except_accepting() -> str:
    """`` other than SHORT_CONV (it accepts it)`` where the installed vLLM's
    selector lets some Mamba backends run batch-invariant (0.34.0), else ""."""
    accepting = mamba_backends_accepting_batch_invariance()
    if not accepting:
        return ""
    return f" other than {', '.join(accepting)} (which vLLM lets run batch-invariant)"


def describe_batch_invariance(version: str | None) -> str:
    """What vLLM's batch-invariant mode means for the modes on this release, for
    ``doctor`` (set or not)."""
    release = describe_version(version)
    requested = batch_invariance_requested()
    if refuses_batch_invariance_for_mamba():
        return (
            f"vLLM {release} refuses batch-invariant mode for Mamba backends"
            + _except_accepting()
            + (
                f" and {BATCH_INVARIANT_VARIABLE}=1 is set: a hybrid model will "
                f"not load (unset {BATCH_INVARIANT_VARIABLE})"
                if requested
                else ""
            )
            + ": a cached continuation equals a fresh run bit for bit only for "
            "serial traffic, and only with full (or lean and kept under dense "
            "retention); lean and kept keep the states vLLM keeps with fewer "
            "prefill steps"
        )
    return (
        f"vLLM {release} accepts batch-invariant mode for hybrid models "
        + (
            f"({BATCH_INVARIANT_VARIABLE}=1 is set)"
            if requested
            else f"({BATCH_INVARIANT_VARIABLE} not set)"
        )
        + ": with it, full makes a continuation from the cache equal a fresh run "
        "also for batched traffic"
    )
