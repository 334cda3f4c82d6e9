"""Worker side of the same invariant: Model Runner V2's running-state seed.

In align mode ``MambaHybridModelState.add_request`` seeds a new or resumed request's
running-state column as ``(num_computed_tokens - 1) // block_size``. Releases
0.25.1-0.31.0 divide by ``cache_config.block_size`` (C), but the column is counted in
Mamba blocks (B). With C < B the first step of a resumed or prefix-hit request
pre-copies from a wrong column (vLLM issue #53142, fixed upstream by #53798 in
0.32.0). The fix re-seeds with B once vLLM has bound the Mamba spec from the KV-cache
config: right away if it already has, else at the first ``_get_mamba_group_info``
call, which every step makes before the seed is read.

Only code the table below recognizes is patched; 0.32.0+ already seed with B.
"""

from __future__ import annotations

import enum
from typing import Any

from .fingerprint import analyse_function

WORKER_MODULE = "vllm.v1.worker.gpu.model_states.mamba_hybrid"
MODEL_STATE = "MambaHybridModelState"
# Seeds waiting for the Mamba spec, per model state: {request index: computed}.
PENDING_ATTRIBUTE = "_vllm_mamba_align_pending_seeds"


class SeedSite(enum.Enum):
    """What the installed worker does with the seed."""

    SEEDS_WITH_CACHE_BLOCK = "seeds with cache_config.block_size (fixed by plugin)"
    SEEDS_WITH_MAMBA_BLOCK = "seeds with the Mamba block size (no fix needed)"
    UNRECOGNIZED = "unrecognized code (left as it is)"
    ABSENT = "no Model Runner V2 Mamba seed in this vLLM"


# add_request fingerprints -> releases that shipped them.
_NEEDS_FIX = {
    "15fe6a31bda00318": "0.25.1",
    "9be463981ada6b80": "0.26.0",
    "c440bde5f6af797c": "0.27.1-0.31.0",
}
_ALREADY_RIGHT = {"855d57fbda65b32d": "0.32.0-0.33.0"}
# _get_mamba_group_info fingerprints whose contract the deferred seed relies on:
# it binds self._mamba_spec from the KV-cache config and returns (ids, spec).
_GROUP_INFO = {"e9850e0b37703e2e": "0.25.1-0.28.0", "ab92c2fce7e1af45": "0.29.0+"}


def classify(model_state_class: type | None) -> SeedSite:
    """Which kind of seed code is installed."""
    add_request = vars(model_state_class or object).get("add_request")
    if add_request is None:
        return SeedSite.ABSENT  # 0.24.0 and older seed nothing here
    group_info = vars(model_state_class or object).get("_get_mamba_group_info")
    if group_info is None:
        return SeedSite.UNRECOGNIZED
    seed = analyse_function(add_request).fingerprint
    if seed in _ALREADY_RIGHT:
        return SeedSite.SEEDS_WITH_MAMBA_BLOCK
    if seed in _NEEDS_FIX and analyse_function(group_info).fingerprint in _GROUP_INFO:
        return SeedSite.SEEDS_WITH_CACHE_BLOCK
    return SeedSite.UNRECOGNIZED


def _seed(model_state: Any, req_index: int, num_computed: int, state_grid: int) -> None:
    model_state._mamba_state_idx_gpu[req_index] = (num_computed - 1) // state_grid


def add_request_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """After vLLM seeds with C, re-seed with B (now, or once the spec is bound)."""
    result = wrapped(*args, **kwargs)
    if not getattr(instance, "_align_mode", False):
        return result
    req_index, new_req_data = _bind_add_request(*args, **kwargs)
    computed = int(new_req_data.num_computed_tokens)
    spec = getattr(instance, "_mamba_spec", None)
    if spec is not None:
        _seed(instance, req_index, computed, int(spec.block_size))
    else:
        pending = instance.__dict__.setdefault(PENDING_ATTRIBUTE, {})
        pending[req_index] = computed
    return result


def _bind_add_request(req_index: int, new_req_data: Any) -> tuple[int, Any]:
    return req_index, new_req_data


def group_info_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Apply seeds that waited for vLLM to bind the Mamba spec."""
    result = wrapped(*args, **kwargs)
    pending = instance.__dict__.get(PENDING_ATTRIBUTE)
    if pending:
        state_grid = int(result[1].block_size)
        for req_index, computed in pending.items():
            _seed(instance, req_index, computed, state_grid)
        pending.clear()
    return result
