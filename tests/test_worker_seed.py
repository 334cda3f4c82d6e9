"""Model Runner V2's running-state seed, on vLLM's real MambaHybridModelState (CPU).

A request resumed (or hit in the prefix cache) at ``n`` computed tokens continues
from the state in block-table column ``(n - 1) // B``. Releases 0.25.1-0.31.0 seed
``(n - 1) // C``; with C = 816 < B = 1648 that is another column (vLLM #53142).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from vllm_mamba_align.releases import WORKER_MODULE, SeedSite
from vllm_mamba_align.worker_seed import classify

C, B = 816, 1648
RESUMED_AT = 3 * B + 100  # column 3 on the B grid, column 6 on the C grid


def _module() -> Any:
    import importlib

    try:
        return importlib.import_module(WORKER_MODULE)
    except ImportError:
        return None


def _model_state_class() -> Any:
    module = _module()
    return getattr(module, "MambaHybridModelState", None)


def _site() -> SeedSite:
    return classify(_model_state_class())


def _new_request(num_computed: int) -> Any:
    from vllm.v1.core.sched.output import NewRequestData

    prompt = list(range(RESUMED_AT + 10))
    values = {
        "req_id": "resumed",
        "prompt_token_ids": prompt,
        "prefill_token_ids": prompt,  # 0.34.0+: every token to prefill
        "mm_features": [],
        "sampling_params": None,
        "pooling_params": None,
        "block_ids": ([], []),
        "num_computed_tokens": num_computed,
        "lora_request": None,
    }
    accepted = inspect.signature(NewRequestData).parameters
    return NewRequestData(**{k: v for k, v in values.items() if k in accepted})


def _model_state() -> Any:
    import copy

    import torch

    from vllm_mamba_align.tools.sim import base_vllm_config

    config = copy.deepcopy(base_vllm_config())
    config.cache_config.block_size = C  # the engine's min over groups
    config.cache_config.mamba_block_size = B
    return _model_state_class()(config, torch.nn.Module(), None, torch.device("cpu"))


def _kv_cache_config() -> Any:
    from vllm_mamba_align.tools.sim import Geometry, kv_cache_config

    return kv_cache_config(Geometry(cache_block=C, state_block=B))


def _seed(model_state: Any) -> int:
    return int(model_state._mamba_state_idx_gpu[0])


needs_fix = pytest.mark.skipif(
    _site() is not SeedSite.SEEDS_WITH_CACHE_BLOCK,
    reason="this vLLM's worker does not seed with cache_config.block_size",
)


@needs_fix
@pytest.mark.parametrize("spec_bound_first", [False, True])
def test_resumed_request_seed_is_on_the_state_grid(spec_bound_first: bool) -> None:
    state = _model_state()
    if spec_bound_first:
        state._get_mamba_group_info(_kv_cache_config())
    state.add_request(0, _new_request(RESUMED_AT))
    if not spec_bound_first:
        # vLLM binds the spec from the KV-cache config before reading the seed.
        state._get_mamba_group_info(_kv_cache_config())
    assert _seed(state) == (RESUMED_AT - 1) // B == 3


@needs_fix
def test_stock_worker_seeds_another_column() -> None:
    cls = _model_state_class()
    state = _model_state()
    stock_add_request = vars(cls)["add_request"].__wrapped__
    stock_add_request(state, 0, _new_request(RESUMED_AT))
    assert _seed(state) == (RESUMED_AT - 1) // C == 6


def test_the_seed_site_is_classified() -> None:
    from vllm_mamba_align.plugin import is_patched

    site = _site()
    patched = is_patched(vars(_model_state_class() or object).get("add_request"))
    assert patched == (site is SeedSite.SEEDS_WITH_CACHE_BLOCK)
    if site is SeedSite.SEEDS_WITH_MAMBA_BLOCK:
        state = _model_state()
        state.add_request(0, _new_request(RESUMED_AT))
        assert _seed(state) == (RESUMED_AT - 1) // B
