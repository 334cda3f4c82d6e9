"""What the plugin says about its decision for a scheduler (activation.py).

The one start line a scheduler logs, the statuses it carries (one per outcome of
activation's decision table), the mode summaries and the notes on vLLM's
batch-invariant mode. Text only: every decision is activation's; these functions
word what it decided and the scheduler it decided for, and change nothing. The
refusals' words are refusals.py's, loaded only to refuse.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import metrics
from .geometry import MambaGroup
from .layers import Finding
from .recognition import SPLIT_METHOD, Recognition
from .releases import (
    BATCH_INVARIANT_VARIABLE,
    SELECTOR_ASKS_BATCH_INVARIANCE,
    describe_version,
)
from .retention import Retention
from .seed_site import seed_grid
from .settings import Mode
from .subclasses import describe_class, foreign_classes, problems
from .version import __version__

if TYPE_CHECKING:
    from .protocols import Scheduler

# -- the start line ------------------------------------------------------------


def start_line(
    scheduler: Any,
    recognition: Recognition,
    mode: Mode,
    status: str,
    state_grid: int | None,
) -> str:
    """The one line a scheduler logs at start: the plugin, vLLM's code, what
    activation decided (``status``) in ``mode`` and the geometry it saw."""
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
    seed = None if state_grid is None else seed_grid(fixing=mode is not Mode.OFF)
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


NO_ALIGN_SPLIT_STATUS = "inactive (no Mamba layers in align mode)"
NO_MAMBA_SPEC_STATUS = "inactive (no Mamba spec among KV groups)"
UPSTREAM_STATUS = (
    "inactive (vLLM already derives mamba_state_block_size itself: "
    "the upstream fix is present)"
)


def off_status(
    findings: Sequence[Finding], disagreeing: Sequence[MambaGroup] = ()
) -> str:
    """The start line's status in mode ``off``: the split runs unchanged.
    ``findings``: the split's layers, judged (recognition.split_findings);
    ``disagreeing``: the Mamba groups, when their block sizes differ (which a
    fixing mode refuses)."""
    unverified = [
        finding.layer.describe() for finding in findings if not finding.verified
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


def active_status(
    mode: Mode,
    retention: Retention,
    yields_replay: bool,
    version: str | None,
    note: str = "",
) -> str:
    """The start line's status where a fixing mode binds its route (or vLLM's
    own split, ``note`` saying why)."""
    summary = mode_summary(mode, retention, yields_replay)
    invariance = batch_invariance_note(mode, retention.dense, version)
    return (
        f"ACTIVE, mode={mode.value}: {summary}{note} "
        "(backport of vLLM PR #54076)" + (f"; {invariance}" if invariance else "")
    )


def schedules_as_vllm_note(body_name: str) -> str:
    """Why a fixing mode binds vLLM's own split on this scheduler."""
    return (
        f"; here C = B and no stop applies to body {body_name}, so vLLM's own "
        "split already schedules as the fix would and is bound unchanged"
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
    release = describe_version(version)
    from .batch_invariance import refuses_batch_invariance_for_mamba

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
