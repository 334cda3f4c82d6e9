"""User settings, read from the environment (vLLM plugins take no arguments)."""

from __future__ import annotations

import enum
import os
from typing import Any

from .errors import MambaAlignError

MODE_VARIABLE = "VLLM_MAMBA_ALIGN_MODE"
ALLOW_UNVERIFIED_VARIABLE = "VLLM_MAMBA_ALIGN_ALLOW_UNVERIFIED"


class Mode(str, enum.Enum):
    """What the plugin does to a hybrid scheduler in align mode."""

    FULL = "full"
    """Chunks end on the Mamba state grid and stop at every boundary (PR #54076):
    every kept state is computed one B block per chunk, so a continuation from
    the cache equals a fresh run bit for bit while the writer's steps do not
    change the numerics (serial traffic: vLLM refuses batch-invariant mode for
    Mamba backends through 0.33.0). Under dense retention the same as ``kept``."""
    KEPT = "kept"
    """Chunks end on the Mamba state grid and stop at a boundary only where
    vLLM's state retention keeps that boundary's state: no poisoning, every
    kept state materialized (also a replay boundary whose column vLLM gives to
    the backend's prompt checkpoint), no step spent on a state vLLM throws
    away."""
    GRID = "grid"
    """Chunks end on the Mamba state grid only: no poisoning, fewer extra stops."""
    LEAN = "lean"
    """The default. Chunks end where stock vLLM ends them, except at a boundary
    whose state vLLM's retention keeps: no poisoning, every kept state
    materialized, stock's step count elsewhere. Where the backend checkpoints
    a prompt's final chunk into its replay boundary's column, vLLM keeps the
    prompt checkpoint instead of that boundary, as stock does. Where retention
    keeps every boundary (dense), or the scheduler's facts leave a case
    undecided, the same as ``kept``."""
    OFF = "off"
    """Loaded and logging, changes nothing whatever it finds (Mamba groups that
    disagree, another plugin's split, code no release has: the start line names
    them, vLLM runs as it is): for A/B runs against stock vLLM."""
    AUDIT = "audit"
    """Schedules exactly like stock vLLM and counts the poisoned slots and skipped
    state boundaries it causes on live traffic, before you switch the fix on."""


DEFAULT_MODE = Mode.LEAN
"""What a run without ``VLLM_MAMBA_ALIGN_MODE`` gets: the cheapest mode that
publishes no wrong state and materializes the states vLLM keeps (counted under
concurrent load in benchmarks/LOAD.md)."""


def read_mode() -> Mode:
    """The mode chosen by ``VLLM_MAMBA_ALIGN_MODE`` (default ``lean``)."""
    raw = os.environ.get(MODE_VARIABLE)
    if raw is None or raw.strip() == "":
        return DEFAULT_MODE
    value = raw.strip().lower()
    for mode in Mode:
        if mode.value == value:
            return mode
    valid = ", ".join(m.value for m in Mode)
    raise MambaAlignError(
        f"{MODE_VARIABLE}={raw!r} is not a valid mode. Valid values: {valid} "
        f"(default: {DEFAULT_MODE.value}). Unset {MODE_VARIABLE} or set it to one "
        "of these."
    )


def allow_unverified() -> bool:
    """Whether the user opted in to running the fix on code no release matches."""
    raw = os.environ.get(ALLOW_UNVERIFIED_VARIABLE, "").strip().lower()
    return raw in ("1", "true", "yes", "on")


AUDIT_INTERVAL_VARIABLE = "VLLM_MAMBA_ALIGN_AUDIT_INTERVAL"
DEFAULT_AUDIT_INTERVAL = 60.0


def audit_interval() -> float:
    """Seconds between audit summary lines (``VLLM_MAMBA_ALIGN_AUDIT_INTERVAL``)."""
    raw = os.environ.get(AUDIT_INTERVAL_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_AUDIT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise MambaAlignError(
            f"{AUDIT_INTERVAL_VARIABLE}={raw!r} is not a number of seconds > 0 "
            f"(default {DEFAULT_AUDIT_INTERVAL:.0f}). Unset it or set e.g. "
            f"{AUDIT_INTERVAL_VARIABLE}=300."
        )
    return value


STARTUP_CHECKS = (read_mode, audit_interval)
"""Every setting ``register()`` reads when vLLM loads the plugin: a bad value
raises there, and vLLM (0.33.0's ``load_general_plugins``) does not start. The
doctor runs these same functions (:func:`startup_problems`), so it cannot pass a
setting that stops ``vllm serve``; a setting read later belongs here too. In
mode ``off`` only the mode is read (:func:`_startup_checks`)."""


def _startup_checks() -> tuple[Any, ...]:
    """The checks ``register()`` runs: all of them, but in mode ``off`` only
    the mode's, since ``off`` changes nothing and so reads no other setting."""
    try:
        off = read_mode() is Mode.OFF
    except MambaAlignError:
        off = False
    return (read_mode,) if off else STARTUP_CHECKS


def check_startup() -> None:
    """Raise the first ``MambaAlignError`` a setting gives (``register()``)."""
    for check in _startup_checks():
        check()


def startup_problems() -> list[str]:
    """Each setting's error, as ``register()`` would raise it (the doctor)."""
    problems = []
    for check in _startup_checks():
        try:
            check()
        except MambaAlignError as error:
            problems.append(str(error))
    return problems
