"""What the plugin says about its decision for a scheduler (activation.py).

The refusals (what was expected, what was found, the ways out), the one start
line a scheduler logs, the mode summaries it carries and the notes on vLLM's
batch-invariant mode. Text only: every decision is activation's; these functions
read what it decided and the scheduler it decided for, and change nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import metrics, settings
from .errors import MambaAlignError
from .geometry import MambaGroup
from .layers import Chain, Finding, Order, describe_distribution
from .recognition import SPLIT_METHOD, Recognition, split_findings
from .releases import (
    BATCH_INVARIANT_VARIABLE,
    SELECTOR_ASKS_BATCH_INVARIANCE,
    SUPPORTED_RELEASES,
    V1_RUNNER_REMOVED_IN,
    WORKER_CHECKS_GROUPS_AT_START_SINCE,
    SplitBody,
    describe_mismatch,
    describe_releases,
    describe_version,
    expected_body,
    release_range,
    releases_where,
)
from .retention import Retention
from .seed_site import seed_grid
from .settings import Mode
from .subclasses import describe_class, foreign_classes, problems
from .version import __version__

if TYPE_CHECKING:
    from .protocols import Scheduler

# -- refusals ------------------------------------------------------------------


def refuse_unknown_code(recognition: Recognition) -> MambaAlignError:
    """vLLM's split is code the plugin has not verified."""
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


def refuse_disagreeing_groups(listing: str, version: str | None) -> MambaAlignError:
    """The Mamba groups reaching the scheduler disagree on their block size.

    In align mode vLLM gives every Mamba layer one block size, the attention
    block, whatever ``--mamba-block-size`` says (0.15.0-0.19.1
    model_executor/models/config.py, 0.20.0+ platforms/interface.py; each Mamba
    layer's spec takes ``cache_config.mamba_block_size``, layers/mamba/abstract.py):
    a group that differs comes from
    a layer spec that sets its own (a model's or another plugin's code). Where
    vLLM's own worker stops such a model before the scheduler exists, the
    message says this refusal is reached only past it."""
    checks = WORKER_CHECKS_GROUPS_AT_START_SINCE
    lazy = release_range(before=checks)
    v1 = release_range(checks, before=V1_RUNNER_REMOVED_IN)
    where = (
        f"vLLM {lazy} starts such a model and checks the groups only at the "
        f"worker's first step; from {checks} Model Runner V2 stops it while the "
        'worker initializes its KV cache ("all mamba groups must share cache '
        'scheduling parameters"), so this refusal is reached there only with '
        f"Model Runner V1 ({v1}: VLLM_USE_V2_MODEL_RUNNER=0) or a worker that is "
        "not vLLM's"
    )
    return MambaAlignError(
        "vllm-mamba-align: the Mamba KV-cache groups disagree on their block "
        f"size ({listing}). Align-mode prefix caching needs one state grid, so "
        f"the scheduler is not started (vLLM {describe_version(version)}). In "
        "align mode vLLM sets every Mamba layer's block size to the attention "
        "block, whatever --mamba-block-size says, so the group that differs "
        "comes from a layer spec that sets its own (the model's code or another "
        "plugin's). Ways out: turn prefix caching off for this model "
        "(--no-enable-prefix-caching), or give that layer's spec the others' "
        f"block size. ({where}.)"
    )


def refuse_stall(
    body: SplitBody, state_grid: int, budget: int, source: str
) -> MambaAlignError:
    """The state block is wider than the step budget on a body that floors
    every non-final chunk to the grid."""
    return MambaAlignError(
        f"vllm-mamba-align: the Mamba state block B={state_grid} is larger than "
        f"the per-step prefill budget {budget} ({source}). On vLLM "
        f"{body.name} a prefill chunk must end on the state grid, so no request "
        f"could ever finish its prefill. Raise --max-num-batched-tokens (and "
        f"--long-prefill-token-threshold, if set) to at least {state_grid}, or "
        "lower --mamba-block-size, or upgrade to vLLM "
        f"{describe_releases(releases_where(lambda b: b.wide_block_exemption))} "
        "(which lets a wide block advance in sub-block steps)."
    )


def refuse_subclass(
    scheduler_class: type, klass: type, reasons: list[str]
) -> MambaAlignError:
    """Another distribution's subclass of vLLM's ``Scheduler`` lacks what the
    fix relies on (``reasons``, subclasses.py)."""
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


def refuse_unverified_layers(
    recognition: Recognition, chain: Chain, found: tuple[Finding, ...]
) -> MambaAlignError:
    """A layer of the split the plugin has not verified: another plugin's
    wrapper, or a subclass's override."""
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


def _scheduler_named(chain: Chain) -> str:
    klass = chain.scheduler_class
    if foreign_classes(klass):
        return describe_class(klass)
    return klass.__qualname__


# -- the start line ------------------------------------------------------------


def start_line(
    scheduler: Any, recognition: Recognition, status: str, state_grid: int | None
) -> str:
    """The one line a scheduler logs at start: the plugin, vLLM's code, what
    activation decided (``status``) and the geometry it saw."""
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
    seed = (
        None
        if state_grid is None
        else seed_grid(fixing=settings.read_mode() is not Mode.OFF)
    )
    if seed:  # in the status, before the geometry that log readers parse
        status += f"; {seed}"
    return (
        f"vllm-mamba-align {__version__} on vLLM "
        f"{describe_version(recognition.vllm_version)} ({code}): {status}; "
        f"{_geometry(scheduler, state_grid)}"
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


def off_status(
    recognition: Recognition, chain: Chain, disagreeing: Sequence[MambaGroup] = ()
) -> str:
    """The start line's status in mode ``off``: the split runs unchanged.
    ``disagreeing``: the Mamba groups, when their block sizes differ (which a
    fixing mode refuses: geometry.py)."""
    unverified = [
        finding.layer.describe()
        for finding in split_findings(recognition, chain)
        if not finding.verified
    ]
    status = (
        "loaded, mode=off (stock vLLM split)"
        if not unverified
        else "loaded, mode=off (the split runs unchanged, with layers the plugin "
        f"has not verified: {'; '.join(unverified)})"
    )
    if disagreeing:
        listing = "; ".join(group.describe() for group in disagreeing)
        status += (
            "; the Mamba KV-cache groups disagree on their block size "
            f"({listing}): no single state grid exists, so a fixing mode would "
            "refuse this scheduler and mode off leaves vLLM as it is"
        )
    return status


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
            "unless vLLM runs batch-invariant, which "
            f"{SELECTOR_ASKS_BATCH_INVARIANCE} refuses for Mamba backends); {kept}"
        )
    return (
        "chunks end on the B grid and stop at every B boundary vLLM keeps (every "
        f"kept state materialized, no step spent on a state vLLM drops); {kept}; "
        "mode=full also stops where vLLM drops the state, so that a cached "
        "continuation equals a fresh run bit for bit for serial traffic"
    )


# -- vLLM's batch-invariant mode -----------------------------------------------


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
    from .batch_invariance import refuses_batch_invariance_for_mamba

    release = describe_version(version)
    if refuses_batch_invariance_for_mamba():
        return (
            f"{BATCH_INVARIANT_VARIABLE}=1: vLLM {release} refuses batch-invariant "
            f"mode for Mamba backends{except_accepting()} (RuntimeError while the "
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


def except_accepting() -> str:
    """`` other than SHORT_CONV (it accepts it)`` where the installed vLLM's
    selector lets some Mamba backends run batch-invariant (0.34.0), else ""."""
    from .batch_invariance import mamba_backends_accepting_batch_invariance

    accepting = mamba_backends_accepting_batch_invariance()
    if not accepting:
        return ""
    return f" other than {', '.join(accepting)} (which vLLM lets run batch-invariant)"
