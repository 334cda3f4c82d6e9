"""A real vLLM scheduler for the witness, built as vLLM's engine core builds one,
for a tiny hybrid model known only by its config.json (no weights, no GPU).

Nothing here comes from the plugin: the plugin reaches this scheduler only if
vLLM's own plugin loader installed it (``VLLM_PLUGINS``,
``vllm.plugins.load_general_plugins``) before the scheduler is built.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

TINY_HYBRID = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "vocab_size": 512,
    "max_position_embeddings": 65536,
    "torch_dtype": "float32",
    "rope_theta": 10000.0,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
}
"""Qwen3-Next's layout in miniature: three GDN layers and one attention layer."""

MAX_MODEL_LEN = 16384


@dataclass(frozen=True)
class Shape:
    """What a scheduler is built with."""

    state_block: int
    """B: the Mamba group's block."""
    attention_block: int
    """The attention group's block."""
    drafter_block: int | None = None
    """A third group's block (a drafter's hidden-state layers): C, when smaller."""
    budget: int = 256
    num_blocks: int = 1000
    max_num_seqs: int = 8
    retention: int | str | None = "default"
    """vLLM's prefix-cache state retention: "default" (what the engine resolves
    when the user sets nothing), None (dense) or an interval."""
    priority: bool = False
    async_scheduling: bool = False
    reserve_full_input: bool = True
    """``scheduler_reserve_full_isl`` where vLLM has it; False admits more
    requests than the pool can finish: running ones get preempted."""
    admission_window: int = 0
    """``cache_aware_admission_window`` (vLLM 0.34.0+): within the first N
    waiting requests, those whose prefix is cached are admitted first; 0 (vLLM's
    default) admits in arrival order. When set, it engages at any cache usage
    (``cache_aware_admission_threshold`` 0.0; vLLM's default 0.5 would leave it
    idle in a pool this load fills less than half)."""
    num_prefill_checkpoint_blocks: int = 0
    """``MambaSpec.num_prefill_checkpoint_blocks`` (vLLM 0.29.0+): 1 as GPU
    GDN and Mamba2 layers declare it, so the manager reserves a block for a
    state the backend writes inside a prefill chunk; 0 as CPU engines run."""
    prefill_checkpoint_alignment: int | None = None
    """``MambaSpec.prefill_checkpoint_alignment`` (in 0.32.0-0.34.0): the token
    alignment of the checkpoint's offset into its chunk (1 for Mamba2); None
    takes no checkpoint at all on those releases."""
    drafts: int = 0
    """Draft tokens per step: a ``speculative_config`` with Qwen3-Next's own
    MTP module (``{"method": "mtp", "num_speculative_tokens": drafts}``, as a
    user passes it), its attention layer in the drafter's group of block
    ``drafter_block``, and one speculative state block per draft token in the
    Mamba spec (``num_speculative_blocks``, as vLLM's Mamba layers declare
    it). 0: no speculative decoding."""
    mamba_state: tuple[tuple[tuple[int, ...], ...], tuple[str, ...]] = (
        ((1,),),
        ("float32",),
    )
    """The Mamba spec's state: (shapes, torch dtype names), a model family's
    as its layers declare it; by default one float32 number."""
    second_mamba: tuple[int, int | None] | None = None
    """A second Mamba group of block B, as Qwen4Exp has one for its PLE
    short-conv layer next to its GDN layers (vLLM 0.33.0-0.34.0
    models/qwen4_exp/nvidia/model.py:907-926): its
    ``num_prefill_checkpoint_blocks`` and ``prefill_checkpoint_alignment``,
    which may differ from the first group's. None: one Mamba group."""


@functools.cache
def model_dir() -> str:
    path = tempfile.mkdtemp(prefix="witness-tiny-hybrid-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_HYBRID, f)
    return path


def engine_config(shape: Shape) -> Any:
    """vLLM's own config for the model, from the options a user passes."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.engine.arg_utils import EngineArgs

    options: dict[str, Any] = {}
    if shape.priority:
        options["scheduling_policy"] = "priority"
    if shape.drafts:
        options["speculative_config"] = {
            "method": "mtp",
            "num_speculative_tokens": shape.drafts,
        }
    args = EngineArgs(
        model=model_dir(),
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=max(shape.budget, 2048),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=shape.max_num_seqs,
        **options,
    )
    config = args.create_engine_config()
    assert config.cache_config.mamba_cache_mode == "align", "not in align mode"
    return config


def kv_cache_config(shape: Shape, config: Any) -> Any:
    """The KV-cache groups the engine plans for this model: attention, Mamba
    (GDN), and a drafter's hidden-state group if the shape has one."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    def attention(block: int) -> Any:
        return FullAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=16, dtype=torch.float32
        )

    checkpoints: dict[str, Any] = {}
    if shape.drafts:
        checkpoints["num_speculative_blocks"] = shape.drafts
    if shape.num_prefill_checkpoint_blocks:
        fields = MambaSpec.__dataclass_fields__
        if "num_prefill_checkpoint_blocks" not in fields:
            raise NotImplementedError("this vLLM has no backend prefill checkpoints")
        checkpoints["num_prefill_checkpoint_blocks"] = (
            shape.num_prefill_checkpoint_blocks
        )
        if shape.prefill_checkpoint_alignment is not None:
            if "prefill_checkpoint_alignment" not in fields:
                raise NotImplementedError("this vLLM has no checkpoint alignment")
            checkpoints["prefill_checkpoint_alignment"] = (
                shape.prefill_checkpoint_alignment
            )

    def mamba(**fields: Any) -> Any:
        return MambaSpec(
            block_size=shape.state_block,
            shapes=shape.mamba_state[0],
            dtypes=tuple(getattr(torch, d) for d in shape.mamba_state[1]),
            mamba_cache_mode="align",
            **fields,
        )

    groups = [
        KVCacheGroupSpec(
            ["model.layers.3.self_attn.attn"], attention(shape.attention_block)
        ),
        KVCacheGroupSpec(
            [f"model.layers.{i}.linear_attn" for i in range(3)], mamba(**checkpoints)
        ),
    ]
    if shape.second_mamba is not None:
        blocks, alignment = shape.second_mamba
        second = dict(checkpoints)
        second["num_prefill_checkpoint_blocks"] = blocks
        second["prefill_checkpoint_alignment"] = alignment
        groups.append(
            KVCacheGroupSpec(["model.layers.4.ple.short_conv"], mamba(**second))
        )
    if shape.drafter_block is not None:
        # A drafter's layers: MTP's attention layer with a speculative config,
        # hidden-state layers without one.
        layer = "mtp.layers.0.self_attn.attn"
        if not shape.drafts:
            layer = "drafter.hidden_states.0"
        groups.append(KVCacheGroupSpec([layer], attention(shape.drafter_block)))
    kv = KVCacheConfig(
        num_blocks=shape.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    if hasattr(kv, "prefix_cache_retention_interval"):
        # 0.29.0+: the engine copies the cache config's setting in.
        kv.prefix_cache_retention_interval = (
            config.cache_config.prefix_cache_retention_interval
            if shape.retention == "default"
            else shape.retention
        )
    return kv


def build_scheduler(shape: Shape) -> Any:
    """A real Scheduler (AsyncScheduler under async scheduling) as the engine
    core builds it: the cache config's block is the smallest group block, the
    scheduler and hash blocks as vLLM resolves them."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    if shape.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as Scheduler

    config = engine_config(shape)
    kv = kv_cache_config(shape, config)
    config.cache_config.block_size = min(
        g.kv_cache_spec.block_size for g in kv.kv_cache_groups
    )
    config.cache_config.num_gpu_blocks = shape.num_blocks
    config.scheduler_config.max_num_batched_tokens = shape.budget
    if getattr(config.scheduler_config, "max_num_scheduled_tokens", None):
        config.scheduler_config.max_num_scheduled_tokens = shape.budget
    if hasattr(config.scheduler_config, "scheduler_reserve_full_isl"):
        config.scheduler_config.scheduler_reserve_full_isl = shape.reserve_full_input
    if hasattr(config.scheduler_config, "async_scheduling"):
        config.scheduler_config.async_scheduling = shape.async_scheduling
    if shape.admission_window:
        if not hasattr(config.scheduler_config, "cache_aware_admission_window"):
            raise NotImplementedError("this vLLM has no cache-aware admission")
        config.scheduler_config.cache_aware_admission_window = shape.admission_window
        config.scheduler_config.cache_aware_admission_threshold = 0.0
    if shape.retention != "default" and not hasattr(
        kv, "prefix_cache_retention_interval"
    ):
        raise NotImplementedError("this vLLM has no retention setting")
    sizes: dict[str, int] = {"block_size": config.cache_config.block_size}
    resolve = getattr(kv_cache_utils, "resolve_kv_cache_block_sizes", None)
    if resolve is not None:
        scheduler_block, hash_block = resolve(kv, config)
        if hasattr(kv, "hash_block_size"):
            kv.hash_block_size = hash_block
        sizes = {"block_size": scheduler_block, "hash_block_size": hash_block}
        alignment = getattr(kv_cache_utils, "resolve_cache_hit_alignment_tokens", None)
        if alignment is not None and hasattr(kv, "cache_hit_alignment_tokens"):
            # As vLLM's engine core (0.32.0-0.34.0): where prefix-cache hits land,
            # handed to the workers, whose backends place their prefill
            # checkpoints on it (the witness's judge reads it from here).
            kv.cache_hit_alignment_tokens = alignment(
                kv, config, scheduler_block, hash_block
            )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        log_stats=True,
        **sizes,
    )


def hash_block_of(scheduler: Any) -> int:
    pool = scheduler.kv_cache_manager.block_pool
    return int(
        getattr(pool, "hash_block_size", 0)
        or getattr(scheduler, "hash_block_size", 0)
        or scheduler.cache_config.block_size
    )


@functools.cache
def _hash_function() -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    return sha256


def step_output(req_ids: list[str], sampled: list[list[int]]) -> Any:
    """The worker's output of one step (``ModelRunnerOutput``): vLLM up to
    0.33.0 also wants each id's index (``req_id_to_index``); 0.34.0 has no such
    field, the order of ``req_ids`` is the index."""
    from dataclasses import fields

    from vllm.v1.outputs import ModelRunnerOutput

    indexed = "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}
    index = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled, **(index if indexed else {})
    )


def propose_drafts(scheduler: Any, drafts: dict[str, list[int]]) -> None:
    """The drafter's proposals after a step, handed to the scheduler as vLLM's
    engine core does without async scheduling (``update_draft_token_ids``,
    which ignores them for a request whose chunk was a prefill chunk)."""
    from vllm.v1.outputs import DraftTokenIds

    if drafts:
        scheduler.update_draft_token_ids(
            DraftTokenIds(list(drafts), [list(d) for d in drafts.values()])
        )


def new_request(
    scheduler: Any, req_id: str, tokens: list[int], max_tokens: int, priority: int
) -> Any:
    """A vLLM Request with the block hasher the engine gives it."""
    import inspect

    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(hash_block_of(scheduler), _hash_function())
    extra: dict[str, Any] = {}
    if "eos_token_id" in inspect.signature(Request.__init__).parameters:
        extra["eos_token_id"] = None
    return Request(
        req_id,
        list(tokens),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        None,
        priority=priority,
        block_hasher=hasher,
        **extra,
    )
