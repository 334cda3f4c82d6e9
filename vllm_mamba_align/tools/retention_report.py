"""The retention a new engine of the installed vLLM runs with, and what each
mode does under it: ``doctor``'s retention report (it imports vLLM when
called). The plugin reads a running scheduler's retention in retention.py."""

from __future__ import annotations

import os

from ..retention import (
    NO_FIELD,
    RETENTION_VARIABLE,
    default_interval,
    masks_by_retention,
)


def retention_variable_reaches_mamba() -> bool:
    """Whether the installed vLLM's retention environment variable (0.24.0 to
    0.28.0; still read later) decides which Mamba states are kept: the variable
    is vLLM's and its Mamba manager masks what it publishes
    (:func:`masks_by_retention`; 0.23.0 reads it for sliding-window
    groups only)."""
    import vllm.envs
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    if RETENTION_VARIABLE not in getattr(vllm.envs, "environment_variables", {}):
        return False
    return masks_by_retention(MambaManager)


def installed_setting() -> tuple[bool, int | None, str]:
    """The retention a new engine of the installed vLLM runs with when the user
    sets nothing: (whether vLLM has the setting, the value, where it is set).

    Needs vLLM importable; reads no engine state.
    """
    default = default_interval()
    if default is not NO_FIELD:  # 0.29.0+
        return True, default, "--prefix-cache-retention-interval"
    if retention_variable_reaches_mamba():
        raw = os.environ.get(RETENTION_VARIABLE, "").strip()
        return True, int(raw) if raw else None, RETENTION_VARIABLE
    return False, None, "no retention setting in this vLLM"


def mode_meaning(mode: str, interval: int | None) -> str:
    """What one plugin mode does under a retention value, for ``doctor``."""
    dense = interval is None
    sparse = (
        "only replay boundaries and shared-prefix junctions are kept"
        if interval == 0
        else f"multiples of {interval}, replay boundaries and junctions are kept"
    )
    meanings = {
        "full": "stops at every B boundary: every state vLLM keeps is materialized "
        "and canonical (cached = fresh bit for bit while the writer runs alone in "
        "its steps: serial traffic)"
        + (
            " (dense: the same as kept)"
            if dense
            else f"; {sparse}, so most stops write a state vLLM drops"
        ),
        "kept": "stops at every B boundary vLLM keeps"
        + (" (dense: the same as full)" if dense else f" ({sparse})")
        + "; no wrong state published",
        "grid": "ends chunks on the B grid only: no wrong state published; kept "
        "states inside a chunk are not materialized",
        "lean": (
            "the same as kept (dense)"
            if dense
            else "ends chunks where stock vLLM does and on every B boundary vLLM "
            f"keeps ({sparse}), except where a GPU backend checkpoints a prompt "
            "in its final chunk: vLLM keeps that checkpoint in the replay "
            "boundary's slot instead, as stock does; no wrong state published"
        ),
        "audit": "stock scheduling, counting the wrong publications and lost states "
        "this retention would keep",
        "off": "stock vLLM",
    }
    return meanings[mode]
