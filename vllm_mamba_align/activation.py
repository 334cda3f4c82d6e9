"""Per-scheduler decision: activate the fix, stand aside, or refuse to start.

Runs right after vLLM's own ``Scheduler.__init__``, when the KV-cache groups are
known. Logs exactly one line through vLLM's logger saying what it found and did.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from . import __version__, audit, metrics, settings
from .errors import MambaAlignError
from .fingerprint import CodeShape
from .geometry import state_block_size
from .releases import (
    SUPPORTED_RELEASES,
    SplitBody,
    describe_mismatch,
    describe_version,
    expected_body,
)
from .retention import Retention, read_retention
from .settings import Mode
from .split import SplitFunction, state_grid_split, step_budget

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
    """vLLM's own ``_mamba_block_aligned_split`` function, as found (unwrapped)."""


def _logger() -> Any:
    from vllm.logger import init_logger

    return init_logger("vllm.plugins.mamba_align")


def _needs_align_split(scheduler: Any) -> bool:
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
    structural = (
        "It passes the structural check (one grid read, compatible signature), so "
        if shape and shape.structurally_compatible
        else "It does NOT pass the structural check (exactly one read of "
        "self.cache_config.block_size and the usual signature), so the opt-in "
        "cannot help either; "
    )
    return MambaAlignError(
        "vllm-mamba-align: this model needs vLLM's align-mode chunk split, but the "
        "installed Scheduler._mamba_block_aligned_split is code the plugin has not "
        f"verified (vLLM {describe_version(recognition.vllm_version)}, fingerprint "
        f"{found}).{known} Verified releases: {', '.join(SUPPORTED_RELEASES)}. "
        f"{structural}to run the fix on it anyway set "
        f"{settings.ALLOW_UNVERIFIED_VARIABLE}=1; or install a verified vLLM "
        "release; or leave the plugin out of VLLM_PLUGINS to run stock vLLM."
    )


def _refuse_stall(scheduler: Any, body: SplitBody, state_grid: int) -> None:
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
    """
    if recognition.body is None:
        return _refuse_unknown_code(recognition)
    return None


def _geometry(scheduler: Any, state_grid: int | None) -> str:
    cache_block = scheduler.cache_config.block_size
    hash_block = getattr(scheduler, "hash_block_size", cache_block)
    grid = "none" if state_grid is None else state_grid
    return (
        f"cache block C={cache_block}, Mamba state block B={grid}, "
        f"hash block {hash_block}"
    )


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


def _runs_recognized_split(scheduler: Any, recognition: Recognition) -> bool:
    """Whether this scheduler's class calls the split the plugin recognized.

    False for a scheduler class that overrides the split with its own code.
    """
    in_class = inspect.getattr_static(type(scheduler), SPLIT_METHOD, None)
    wrapped = getattr(in_class, "__wrapped__", None)
    return wrapped is not None and wrapped is recognition.split


def _refuse_override(scheduler: Any) -> MambaAlignError:
    return MambaAlignError(
        f"vllm-mamba-align: {type(scheduler).__qualname__} overrides "
        f"{SPLIT_METHOD} with code the plugin has not verified, so the plugin "
        "cannot apply the fix (or the audit) to it. Use vLLM's own Scheduler, or "
        f"set {settings.MODE_VARIABLE}=off (or leave the plugin out of "
        "VLLM_PLUGINS) to run that scheduler's split unchanged."
    )


def _bind_split(scheduler: Any, route: SplitFunction) -> None:
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


def attach(scheduler: Any, recognition: Recognition) -> None:
    """Decide for one freshly built scheduler; raise to refuse it, never half-apply."""
    mode = settings.read_mode()
    if not _needs_align_split(scheduler):
        _log(scheduler, recognition, "inactive (no Mamba layers in align mode)", None)
        return
    if hasattr(scheduler, STATE_BLOCK_ATTRIBUTE):
        upstream = getattr(scheduler, STATE_BLOCK_ATTRIBUTE)
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
    refusal = hybrid_refusal(recognition)
    if refusal is not None:
        raise refusal
    body = recognition.body
    assert body is not None  # hybrid_refusal refuses every body-less recognition
    recognized = _runs_recognized_split(scheduler, recognition)
    if mode is Mode.OFF:
        if recognized:  # vLLM's own function, without the wrapper's layers
            stock = recognition.split.__get__(scheduler, type(scheduler))
            _bind_split(scheduler, stock)
        _log(scheduler, recognition, "loaded, mode=off (stock vLLM split)", state_grid)
        return
    if not recognized:
        raise _refuse_override(scheduler)
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
    route = state_grid_split(
        scheduler, recognition.split, mode, state_grid, body, retention
    )
    _bind_split(scheduler, route)
    setattr(scheduler, STATE_BLOCK_ATTRIBUTE, state_grid)
    _log(
        scheduler,
        recognition,
        f"ACTIVE, mode={mode.value}: {mode_summary(mode, retention)} "
        "(backport of vLLM PR #54076)",
        state_grid,
    )


def mode_summary(mode: Mode, retention: Retention) -> str:
    """What a fixing mode does under this retention, for the start line."""
    kept = retention.describe()
    if mode is Mode.FULL:
        cost = (
            ""
            if retention.dense
            else "; stops also where vLLM drops the state (one prefill step each): "
            "use mode=kept to stop only at kept boundaries"
        )
        return (
            "chunks end on the B grid and stop at every B boundary, so every state "
            "is computed by the same chunks whoever writes it (a cached "
            f"continuation equals a fresh one bit for bit); {kept}{cost}"
        )
    if mode is Mode.KEPT:
        return (
            "chunks end on the B grid and stop at every B boundary vLLM keeps "
            f"(every kept state materialized); {kept}"
        )
    return (
        "chunks end on the B grid (no wrong state published; boundaries inside a "
        f"chunk are not materialized); {kept}"
    )
