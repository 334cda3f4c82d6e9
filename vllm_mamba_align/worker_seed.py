"""Worker side of the same invariant: Model Runner V2's running-state seed.

In align mode ``MambaHybridModelState.add_request`` seeds a new or resumed request's
running-state column as ``(num_computed_tokens - 1) // block_size``; the column is
counted in Mamba blocks (B, the Mamba spec's ``block_size``, which the block table
and the worker's per-step copies follow). Releases 0.25.0-0.31.0 divide by
``cache_config.block_size`` (C): with C < B the first step of a resumed or prefix-hit
request pre-copies from a wrong column (vLLM issue #53142, fixed upstream by #53798
in 0.32.0). 0.32.0+ divide by ``cache_config.mamba_block_size``, which is B until a
hidden-state layer (``extract_hidden_states``) costs more per token than the common
page: vLLM's group builder then multiplies every group's block size, the Mamba
spec's too, and leaves ``mamba_block_size`` as it was (the seed names column 15
where the block table holds the state in column 7 at 1,000 tokens with B doubled).

The fix re-seeds with B once vLLM has bound the Mamba spec from the KV-cache
config: right away if it already has (0.32.0+ bind it when the KV cache is
initialized), else at the first ``_get_mamba_group_info`` call, which every step
makes before the seed is read. Where vLLM's divisor already is B the re-seed
writes the value vLLM wrote.

Only code recognized by the fingerprints in releases.py is patched, in Model
Runner V2's model state and 0.34.0's CPU runner's. Loaded only where vLLM's
worker module is imported (plugin.patch_worker_module); what the start line
reads of the installed seed is seed_site.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fingerprint import analyse_function
from .releases import GROUP_INFO_METHOD, SEED_METHOD, SeedSite, classify_seed, seed_code

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


def column_tensor(model_state_class: type) -> str:
    """The attribute holding the columns the class's recognized seed writes
    (``_mamba_state_idx_gpu``; ``_mamba_state_idx`` in 0.34.0's CPU runner)."""
    add_request = vars(model_state_class).get(SEED_METHOD)
    code = seed_code(analyse_function(add_request).fingerprint if add_request else None)
    if code is None:
        raise ValueError(f"{model_state_class!r} has no recognized seed")
    return code.column


@dataclass(frozen=True)
class Reseed:
    """The two wrappers of one model-state class, writing its column tensor."""

    column: str

    def _seed(
        self, model_state: Any, req_index: int, num_computed: int, state_grid: int
    ) -> None:
        column = (num_computed - 1) // state_grid
        if self.column == "_mamba_state_idx":  # 0.34.0's CPU runner
            model_state._mamba_state_idx[req_index] = column
        else:
            model_state._mamba_state_idx_gpu[req_index] = column

    def add_request(
        self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """After vLLM seeds (with C or ``mamba_block_size``), re-seed with B (now,
        or once the spec is bound)."""
        result = wrapped(*args, **kwargs)
        if not getattr(instance, "_align_mode", False):
            return result
        req_index, new_req_data = _bind_add_request(*args, **kwargs)
        computed = int(new_req_data.num_computed_tokens)
        spec = getattr(instance, "_mamba_spec", None)
        if spec is not None:
            self._seed(instance, req_index, computed, int(spec.block_size))
        else:
            pending = instance.__dict__.setdefault(PENDING_ATTRIBUTE, {})
            pending[req_index] = computed
        return result

    def group_info(
        self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Apply seeds that waited for vLLM to bind the Mamba spec."""
        result = wrapped(*args, **kwargs)
        pending = instance.__dict__.get(PENDING_ATTRIBUTE)
        if pending:
            state_grid = int(result[1].block_size)
            for req_index, computed in pending.items():
                self._seed(instance, req_index, computed, state_grid)
            pending.clear()
        return result


def _bind_add_request(req_index: int, new_req_data: Any) -> tuple[int, Any]:
    return req_index, new_req_data
