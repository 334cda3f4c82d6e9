"""Worker side of the same invariant: Model Runner V2's running-state seed.

In align mode ``MambaHybridModelState.add_request`` seeds a new or resumed request's
running-state column as ``(num_computed_tokens - 1) // block_size``. Releases
0.25.0-0.31.0 divide by ``cache_config.block_size`` (C), but the column is counted in
Mamba blocks (B). With C < B the first step of a resumed or prefix-hit request
pre-copies from a wrong column (vLLM issue #53142, fixed upstream by #53798 in
0.32.0). The fix re-seeds with B once vLLM has bound the Mamba spec from the KV-cache
config: right away if it already has, else at the first ``_get_mamba_group_info``
call, which every step makes before the seed is read.

Only code recognized by the fingerprints in releases.py is patched; 0.32.0+
already seed with B.
"""

from __future__ import annotations

from typing import Any

from .fingerprint import analyse_function
from .releases import GROUP_INFO_METHOD, SEED_METHOD, SeedSite, classify_seed

# Seeds waiting for the Mamba spec, per model state: {request index: computed}.
PENDING_ATTRIBUTE = "_vllm_mamba_align_pending_seeds"


def classify(model_state_class: type | None) -> SeedSite:
    """Which kind of seed code is installed (fingerprints in releases.py)."""
    methods = vars(model_state_class or object)
    add_request = methods.get(SEED_METHOD)
    group_info = methods.get(GROUP_INFO_METHOD)
    return classify_seed(
        analyse_function(add_request).fingerprint if add_request else None,
        analyse_function(group_info).fingerprint if group_info else None,
        present=add_request is not None,
    )


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
