"""Model Runner V2's running-state seed, on vLLM's real MambaHybridModelState (CPU).

A request resumed (or hit in the prefix cache) at ``n`` computed tokens continues
from the state in block-table column ``(n - 1) // B``. Releases 0.25.1-0.31.0 seed
``(n - 1) // C``; with C = 816 < B = 1648 that is another column (vLLM #53142).
0.32.0+ seed ``(n - 1) // cache_config.mamba_block_size``, another column once a
hidden-state layer has scaled every group's block (the last test).
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
    from vllm_mamba_align.seed_site import RESEEDED

    site = _site()
    patched = is_patched(vars(_model_state_class() or object).get("add_request"))
    assert patched == (site in RESEEDED)
    if site is SeedSite.SEEDS_WITH_MAMBA_BLOCK:
        state = _model_state()
        state.add_request(0, _new_request(RESUMED_AT))
        assert _seed(state) == (RESUMED_AT - 1) // B


# -- B on two grids: a hidden-state layer larger than the common page ------------
#
# vLLM's group builder (``_ensure_min_page_size``, 0.30.0+) multiplies every
# group's block size, the Mamba spec's too, when a hidden-state layer
# (``extract_hidden_states``) costs more per token than the common page, and
# leaves ``cache_config.mamba_block_size`` as it was. 0.32.0+ seed with that
# field. Built here from the end-to-end model's layers (NemotronH: 2 KV heads
# of 32, two Mamba2 layers, bf16 attention on B = 64) and a hidden state of
# 4 x 4,096 bf16 (32,768 bytes a token, twice the 16,384-byte common page).
# CI's suite legs run 0.34.0; 0.32.0's seed runs in ``nox -s "tests(vllm='0.32.0')"``.

ATTENTION_BLOCK = 64  # what align mode sets mamba_block_size to


def _scaled_groups() -> list[Any]:
    """vLLM's own groups for those layers (every group's block doubled)."""
    import copy

    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        MambaSpec,
    )

    from vllm_mamba_align.tools.sim import base_vllm_config

    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    except ImportError:  # 0.32.0
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    config = copy.deepcopy(base_vllm_config())
    attention = FullAttentionSpec(
        block_size=ATTENTION_BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
    )
    mamba = MambaSpec(  # NemotronH's Mamba2 conv and SSM states
        block_size=ATTENTION_BLOCK,
        shapes=((3, 288), (4, 32, 16)),
        dtypes=(torch.float32, torch.float32),
        page_size_padded=attention.page_size_bytes,
        mamba_cache_mode="align",
    )
    hidden = HiddenStateCacheSpec(
        block_size=ATTENTION_BLOCK, num_kv_heads=4, head_size=4096, dtype=torch.bfloat16
    )
    specs = {
        "model.layers.0.mixer": mamba,
        "model.layers.1.mixer.attn": attention,
        "model.layers.2.mixer": mamba,
        "model.layers.4.hidden_states": hidden,
    }
    try:  # 0.34.0: the engine core resolves the layout before grouping
        from vllm.v1.attention.backends import utils as backend_utils

        backend_utils.resolve_kv_cache_layout(
            config,
            [[layout.name for layout in backend_utils._DEFAULT_LAYOUT_PREFERENCE]],
            specs.values(),
        )
    except AttributeError:
        pass
    return list(get_kv_cache_groups(config, specs))


def _scaled_model_state(model_state_class: Any, groups: list[Any]) -> Any:
    import copy

    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_mamba_align.tools.sim import base_vllm_config

    config = copy.deepcopy(base_vllm_config())
    config.cache_config.block_size = ATTENTION_BLOCK
    config.cache_config.mamba_block_size = ATTENTION_BLOCK  # nothing rewrites it
    state = model_state_class(config, torch.nn.Module(), None, torch.device("cpu"))
    # vLLM binds the spec when it initializes the KV cache, before any request.
    state._get_mamba_group_info(
        KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    )
    return state


def _seed_sites() -> list[Any]:
    import importlib

    from vllm_mamba_align.releases import MODEL_STATE, WORKER_SITES

    found = []
    for module_name, _ in WORKER_SITES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        model_state = getattr(module, MODEL_STATE, None)
        if classify(model_state) is SeedSite.SEEDS_WITH_MAMBA_BLOCK:
            found.append(pytest.param(model_state, id=module_name.split(".")[3]))
    return found or [pytest.param(None, id="none")]


@pytest.mark.parametrize("model_state_class", _seed_sites())
@pytest.mark.parametrize("computed", [1000, 4000, 896, 3968])
def test_scaled_grid_seed_names_the_column_the_block_table_holds(
    model_state_class: Any, computed: int
) -> None:
    if model_state_class is None:
        pytest.skip("this vLLM's worker does not seed with mamba_block_size")
    from vllm_mamba_align.plugin import is_patched
    from vllm_mamba_align.worker_seed import column_tensor

    groups = _scaled_groups()
    state_grid = {g.kv_cache_spec.block_size for g in groups[:3]}
    assert state_grid == {2 * ATTENTION_BLOCK}  # every group doubled, Mamba's too
    (B,) = state_grid
    column = column_tensor(model_state_class)

    stock = _scaled_model_state(model_state_class, groups)
    add_request = vars(model_state_class)["add_request"]
    assert is_patched(add_request)
    add_request.__wrapped__(stock, 0, _new_request(computed))
    stock_column = int(getattr(stock, column)[0])
    # vLLM's own seed: on the mamba_block_size grid, another column.
    assert stock_column == (computed - 1) // ATTENTION_BLOCK

    fixed = _scaled_model_state(model_state_class, groups)
    fixed.add_request(0, _new_request(computed))
    # The block table's column holding the state after `computed` tokens.
    assert int(getattr(fixed, column)[0]) == (computed - 1) // B != stock_column


@pytest.mark.parametrize("mode", ["lean", "off"])
def test_the_start_line_says_which_grid_the_seed_uses(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read from the installed worker file (the engine core does not import
    it): on B where the plugin re-seeds, on vLLM's divisor in ``off``."""
    from helpers import StartLines, scheduler_mode

    from vllm_mamba_align import activation
    from vllm_mamba_align.releases import SEED_BODIES
    from vllm_mamba_align.tools.sim import Geometry, build_scheduler

    recorder = StartLines()
    monkeypatch.setattr(activation, "_logger", lambda: recorder)
    with scheduler_mode(mode):
        build_scheduler(Geometry(cache_block=B, state_block=B))
    (line,) = recorder.lines
    site = _site()
    if site not in (SeedSite.SEEDS_WITH_CACHE_BLOCK, SeedSite.SEEDS_WITH_MAMBA_BLOCK):
        assert "worker seed" not in line
        return
    (divisor,) = {code.divisor for code in SEED_BODIES if code.site is site}
    if mode == "off":
        seed = f"; worker seed on vLLM's {divisor} (not B where it differs); "
    else:
        seed = f"; worker seed on B (the plugin re-seeds vLLM's {divisor} seed); "
    # In the status, before the geometry log readers parse (tests/e2e/geometry.py).
    assert seed + "cache block C=" in line
