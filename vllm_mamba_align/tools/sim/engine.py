"""The engine side of the simulation: a real vLLM scheduler built on CPU the way
vLLM's engine core builds it, from a :class:`Geometry`, for a config-only tiny
hybrid model written to a temporary directory (no GPU, no weights).

Everything scheduled goes through the installed vLLM's own ``VllmConfig``,
``Scheduler``, ``KVCacheManager`` and ``Request``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...releases import installed_version, vllm_package_dir
from ..installed import (
    CHECKPOINT_BACKEND_FILES,
    checkpoint_backends_in,
    retention_in_kv_config,
    supports_hash_block,
    supports_lookahead_hashes,
)
from ..modes import environment_variable

# A tiny hybrid (GDN + full attention) architecture; only config.json is needed.
TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 262144,
    "torch_dtype": "float32",
    "rope_theta": 10000.0,
    "layer_types": [
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ],
}

MAX_MODEL_LEN = 131072
SAMPLED_TOKEN = 7
"""The token the modelled worker samples (and its drafter proposes), always."""


def _config_dir(prefix: str, config: dict[str, Any]) -> str:
    """A fresh folder holding ``config`` as its config.json (a model vLLM can
    configure without weights)."""
    path = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@functools.cache
def model_dir() -> str:
    return _config_dir("tiny-qwen3-next-", TINY_QWEN3_NEXT)


# A tiny EAGLE-3 draft model for the tiny hybrid; only config.json is needed.
TINY_EAGLE3_DRAFT = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1000,
    "draft_vocab_size": 1000,
    "max_position_embeddings": 262144,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

SPECULATIVE_METHODS = ("mtp", "multi-mtp", "eagle")
"""Drafters a geometry can configure: Qwen3-Next's own MTP module, k MTP modules
(a checkpoint with ``num_nextn_predict_layers`` >= k, as Nemotron-H or DeepSeek
ship: vLLM then reads k prefill tokens ahead), or an EAGLE-3 draft model (vLLM
method ``eagle3``)."""


@functools.cache
def multi_mtp_model_dir(modules: int) -> str:
    """The tiny hybrid with ``modules`` MTP modules."""
    config = {**TINY_QWEN3_NEXT, "num_nextn_predict_layers": modules}
    return _config_dir("tiny-qwen3-next-mtp-", config)


@functools.cache
def eagle_draft_dir() -> str:
    return _config_dir("tiny-eagle3-draft-", TINY_EAGLE3_DRAFT)


def speculative_config(
    speculative: tuple[str, int] | None, eagle_block_drop: bool = False
) -> dict[str, Any] | None:
    """The ``--speculative-config`` a user would pass for this drafter."""
    if speculative is None:
        return None
    method, k = speculative
    if method in ("mtp", "multi-mtp"):
        config: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": k}
    elif method == "eagle":
        config = {
            "method": "eagle3",
            "model": eagle_draft_dir(),
            "num_speculative_tokens": k,
        }
    else:
        raise ValueError(f"unknown speculative method {method!r}")
    if eagle_block_drop and supports_lookahead_hashes():
        # 0.33.0: vLLM then drops EAGLE's last block (config/vllm.py:678-692;
        # scheduler.py:330-345), as it does for every KV connector.
        config["disable_lookahead_block_hashes"] = True
    return config


@functools.cache
def base_vllm_config(
    speculative: tuple[str, int] | None = None,
    eagle_block_drop: bool = False,
    kv_connector: str | None = None,
    kv_connector_config: tuple[tuple[str, Any], ...] = (),
) -> Any:
    """One real VllmConfig per process, drafter and connector (building it
    inspects the model: seconds).

    The drafter's SpeculativeConfig is vLLM's own, built from the same options
    a user passes. ``kv_connector`` (``"module.path:ClassName"``) goes in as
    users configure a third-party connector (``--kv-transfer-config`` with
    ``kv_connector_module_path``, role ``kv_both``), so vLLM's own config checks
    see it (e.g. that the connector supports the hybrid KV-cache manager).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.engine.arg_utils import EngineArgs

    transfer: dict[str, Any] = {}
    if kv_connector is not None:
        from vllm.config import KVTransferConfig

        module_path, _, name = kv_connector.partition(":")
        transfer["kv_transfer_config"] = KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module_path,
            kv_role="kv_both",
            kv_connector_extra_config=dict(kv_connector_config),
        )
    model = model_dir()
    if speculative is not None and speculative[0] == "multi-mtp":
        model = multi_mtp_model_dir(speculative[1])
    args = EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=8192,
        max_model_len=MAX_MODEL_LEN,
        **transfer,
        speculative_config=speculative_config(speculative, eagle_block_drop),
    )
    config = _without_amx(args.create_engine_config)
    assert config.cache_config.mamba_cache_mode == "align", (
        "the tiny hybrid model must run in align mode with prefix caching on"
    )
    return config


def _without_amx(build: Any) -> Any:
    """Build a config as on a CPU without AMX, whatever this host has.

    vLLM 0.22.0-0.24.0's CPU platform turns prefix caching off for
    linear-attention models when the CPU has AMX (platforms/cpu.py); no setting
    avoids it. Results must not depend on the host, and the scheduler under
    test never runs a CPU kernel.
    """
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is None:
        return build()
    torch.cpu._is_amx_tile_supported = lambda: False
    try:
        return build()
    finally:
        torch.cpu._is_amx_tile_supported = probe


@functools.cache
def _init_hashing() -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    return sha256


@dataclass(frozen=True)
class Geometry:
    """The block sizes and budgets of one scheduler."""

    cache_block: int
    """C: the attention group's block, which the engine copies into cache_config."""
    state_block: int
    """B: MambaSpec.block_size."""
    budget: int = 8192
    """max_num_batched_tokens."""
    hash_block: int | None = None
    """prefix_match_unit; None lets vLLM pick (the GCD of the groups' blocks)."""
    long_prefill_threshold: int = 0
    max_num_seqs: int = 256
    num_blocks: int = 4000
    reserve_full_input: bool = True
    """scheduler_reserve_full_isl where vLLM has it; False admits more requests
    than the pool can finish, so running ones get preempted and resumed."""
    extra_mamba_block: int | None = None
    """A second Mamba group's block size (to test disagreeing groups)."""
    hybrid: bool = True
    """False: attention only (a model the plugin must leave alone)."""
    retention: int | str | None = "default"
    """Prefix-cache state retention: ``"default"`` (what vLLM's engine uses when
    the user sets nothing), None (dense: every state kept), 0 or R > 0."""
    prefill_checkpoint: str | None = None
    """A GPU backend that saves one prefill checkpoint state inside a chunk
    (``MambaSpec.num_prefill_checkpoint_blocks = 1``, 0.29.0+), by its alignment
    rule in :data:`CHECKPOINT_BACKENDS`; None: the CPU backend (no checkpoint)."""
    async_scheduling: bool = False
    """Async scheduling (vLLM's default on GPU, 0.18.1+): vLLM's
    ``AsyncScheduler``, driven as its engine core drives it (one step in flight:
    step N+1 is scheduled before step N's output is processed). With a drafter
    the worker model accepts every draft (see ``_accepted``)."""
    kv_connector: str | None = None
    """A KV connector the scheduler is built with, ``"module.path:ClassName"``
    (loaded by vLLM from that module, as a third-party connector); None: no KV
    transfer. Its hits start chunks wherever they end; the worker model loads
    the state after a hit's last token into the request's running slot."""
    kv_connector_config: tuple[tuple[str, Any], ...] = ()
    """The connector's ``kv_connector_extra_config``, as (key, value) pairs."""
    speculative: tuple[str, int] | None = None
    """A drafter proposing k tokens per step: ``("mtp", k)`` (Qwen3-Next's MTP
    module), ``("multi-mtp", k)`` (k MTP modules) or ``("eagle", k)`` (an
    EAGLE-3 draft model), configured through vLLM's own SpeculativeConfig
    (:data:`SPECULATIVE_METHODS`); None: no speculative decoding."""
    eagle_block_drop: bool = False
    """0.33.0: turn vLLM's lookahead block hashes off
    (``disable_lookahead_block_hashes``, which every KV connector gets too), so
    the scheduler drops EAGLE's last block (``use_eagle_block_drop``). Releases
    without lookahead hashes always drop (``use_eagle``); there it changes
    nothing."""
    admission_window: int = 0
    """0.34.0+: cache-aware admission (``cache_aware_admission_window``): within
    the first N waiting requests, those whose prefix is cached are admitted
    first, at any cache usage (``cache_aware_admission_threshold`` 0.0); 0,
    vLLM's default: arrival order."""
    mamba_state: tuple[tuple[tuple[int, ...], ...], tuple[str, ...]] | None = None
    """A model family's Mamba state as its layers' specs carry it: (shapes,
    torch dtype names); None: one float32 number. The scheduler reads only the
    spec's block and checkpoint fields; the shape makes the spec the family's."""
    attention_block: int | None = None
    """The model's own attention group's block when a smaller group (a
    drafter's, a hidden-state layer's) sets the cache block C; that group is
    then built at ``cache_block``. None: the attention group is C's."""


def supports_admission_window() -> bool:
    """Whether the installed vLLM has cache-aware admission (0.34.0+)."""
    from vllm.config import SchedulerConfig

    return "cache_aware_admission_window" in SchedulerConfig.__dataclass_fields__


CHECKPOINT_BACKENDS = tuple(CHECKPOINT_BACKEND_FILES)
"""Backends whose in-chunk prefill checkpoint the worker model writes, where
the installed vLLM's layer declares checkpoint blocks
(installed.CHECKPOINT_BACKEND_FILES and releases.CHECKPOINT_BACKENDS_SINCE), each by
its alignment (:func:`checkpoint_alignment`). 0.29.0 has no alignment field
(flashkda's rule is 16 there)."""


def available_checkpoint_backends() -> tuple[str, ...]:
    """The backends of :data:`CHECKPOINT_BACKENDS` the installed vLLM's layers
    declare checkpoint blocks for (read from its files, not its version)."""
    return checkpoint_backends_in(vllm_package_dir())


def checkpoint_alignment(backend: str, hash_block: int) -> int:
    """The backend's ``prefill_checkpoint_alignment``: GDN on FlashInfer and
    Qwen4Exp's PLE layer the checkpoint grid, which FlashInfer's GDN stride
    (64) divides (``get_mamba_prefill_checkpoint_grid``,
    model_executor/layers/mamba/abstract.py:124-136 in 0.34.0; ple_layer.py
    :216-219; v1/attention/backends/gdn_attn.py:35); Mamba2 1; KDA on flashkda
    (Kimi-K3, GLM-5-Next) 16 (model_executor/layers/mamba/kda_checkpoint.py:9-10
    in 0.34.0); Kimi-K3's AMD KDA its chunk, 64
    (models/kimi_k3/amd/ops/kda_chunk.py:21-23 in 0.32.0-0.34.0)."""
    if backend in ("gdn-flashinfer", "qwen4exp-ple"):
        return math.lcm(hash_block, 64)
    if backend == "mamba2":
        return 1
    if backend in ("flashkda", "glm5next-flashkda"):
        return 16
    if backend == "kimi-k3-amd":
        return 64
    raise ValueError(f"unknown prefill checkpoint backend {backend!r}")


def kv_cache_config(geometry: Geometry) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    checkpoint: dict[str, Any] = {}
    if geometry.prefill_checkpoint is not None:
        if geometry.prefill_checkpoint not in available_checkpoint_backends():
            raise ValueError(
                f"{geometry.prefill_checkpoint!r} declares no prefill checkpoint "
                f"blocks in vLLM {installed_version()}"
            )
        checkpoint["num_prefill_checkpoint_blocks"] = 1
        if "prefill_checkpoint_alignment" in MambaSpec.__dataclass_fields__:
            # 0.30.0+ (the scheduler's decision is False without it); the
            # hash block the engine resolves, or vLLM's pick when None.
            hash_block = geometry.hash_block or math.gcd(
                geometry.cache_block, geometry.state_block
            )
            checkpoint["prefill_checkpoint_alignment"] = checkpoint_alignment(
                geometry.prefill_checkpoint, hash_block
            )

    drafts = geometry.speculative[1] if geometry.speculative is not None else 0
    if drafts:
        # Every release's Mamba layer reserves one state block per draft token
        # (0.33.0 model_executor/layers/mamba/abstract.py:86-90; 0.29.0 :81-85).
        checkpoint["num_speculative_blocks"] = drafts

    shapes: tuple[tuple[int, ...], ...] = ((1,),)
    dtypes: tuple[Any, ...] = (torch.float32,)
    if geometry.mamba_state is not None:
        shapes = geometry.mamba_state[0]
        dtypes = tuple(getattr(torch, name) for name in geometry.mamba_state[1])

    def mamba(block: int) -> Any:
        return MambaSpec(
            block_size=block,
            shapes=shapes,
            dtypes=dtypes,
            mamba_cache_mode="align",
            **checkpoint,
        )

    attention_layers = ["model.layers.3.self_attn.attn"]
    if drafts:
        # The drafter's attention layer has the target's spec (its ``is_draft``
        # flag does not compare, 0.33.0 kv_cache_interface.py:215): one group.
        attention_layers.append("mtp.layers.0.self_attn.attn")

    def attention(block: int) -> Any:
        return FullAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=16, dtype=torch.float32
        )

    groups = [
        KVCacheGroupSpec(
            attention_layers,
            attention(geometry.attention_block or geometry.cache_block),
        ),
    ]
    if geometry.attention_block is not None:
        groups.append(
            KVCacheGroupSpec(
                ["drafter.layers.0.self_attn.attn"], attention(geometry.cache_block)
            )
        )
    if drafts and _flags_drafter_group(geometry):
        groups[0].is_eagle_group = True
    if geometry.hybrid:
        groups.append(
            KVCacheGroupSpec(
                [f"model.layers.{i}.linear_attn" for i in range(3)],
                mamba(geometry.state_block),
            )
        )
    if geometry.extra_mamba_block is not None:
        groups.append(
            KVCacheGroupSpec(
                ["mtp.layers.0.linear_attn"], mamba(geometry.extra_mamba_block)
            )
        )
    config = KVCacheConfig(
        num_blocks=geometry.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    if retention_in_kv_config():  # 0.29.0+
        # The engine copies the cache config's setting in; a KVCacheConfig built
        # directly would keep every state, which is not what users get.
        config.prefix_cache_retention_interval = retention_interval(geometry)
    return config


def _flags_drafter_group(geometry: Geometry) -> bool:
    """Whether vLLM's KV-cache planning marks the drafter's group as EAGLE's.

    0.33.0: the groups holding draft layers, when the speculative config drops
    EAGLE's last block (kv_cache_planning.py:1649-1656). 0.27.1-0.29.0 mark only
    DeepSeek V4's MTP group or non-causal multi-token specs
    (kv_cache_utils.py:1809-1860 in 0.29.0): none here, so the coordinator
    flags every group when it drops (kv_cache_coordinator.py:112-113).
    """
    config = base_vllm_config(geometry.speculative, geometry.eagle_block_drop)
    drops = getattr(config.speculative_config, "use_eagle_block_drop", None)
    return bool(drops is not None and drops())


DEFAULT_RETENTION = "default"


def retention_interval(geometry: Geometry) -> int | None:
    """The retention a scheduler of this geometry runs with, as vLLM resolves it."""
    if geometry.retention != DEFAULT_RETENTION:
        return geometry.retention  # type: ignore[return-value]
    if retention_in_kv_config():
        # 0.29.0 defaults a hybrid model with an EAGLE drafter to dense
        # (engine/arg_utils.py:2393-2407): read what the engine resolved.
        config = base_vllm_config(geometry.speculative, geometry.eagle_block_drop)
        cache = config.cache_config
        return cache.prefix_cache_retention_interval  # type: ignore[no-any-return]
    from ...retention import RETENTION_VARIABLE

    raw = os.environ.get(RETENTION_VARIABLE, "")
    return int(raw) if raw.strip() else None


@contextlib.contextmanager
def retention_environment(geometry: Geometry) -> Iterator[None]:
    """0.27.1-0.28.0 read the retention from the environment when the KV-cache
    coordinator is built: set it for the build when the geometry picks one."""
    from ...retention import RETENTION_VARIABLE

    if retention_in_kv_config() or geometry.retention == DEFAULT_RETENTION:
        yield
        return
    value = None if geometry.retention is None else str(geometry.retention)
    with environment_variable(RETENTION_VARIABLE, value):
        yield


SCHEDULER_BUILT_HOOKS: list[Callable[[Any], None]] = []
"""Called with every scheduler :func:`build_scheduler` builds (a test suite
shuts each one down when the test that built it ends)."""


def build_scheduler(geometry: Geometry) -> Any:
    """A real Scheduler, configured the way vLLM's engine core configures it."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.sched.scheduler import Scheduler

    if geometry.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = copy.deepcopy(
        base_vllm_config(
            geometry.speculative,
            geometry.eagle_block_drop,
            geometry.kv_connector,
            geometry.kv_connector_config,
        )
    )
    kv_config = kv_cache_config(geometry)
    # The engine core sets cache_config.block_size to the smallest group block.
    config.cache_config.block_size = min(
        g.kv_cache_spec.block_size for g in kv_config.kv_cache_groups
    )
    config.cache_config.num_gpu_blocks = geometry.num_blocks
    if geometry.hash_block is not None:
        if not supports_hash_block():
            raise NotImplementedError("choosing the hash block needs vLLM 0.26.0+")
        config.cache_config.prefix_match_unit = geometry.hash_block
    sched = config.scheduler_config
    sched.max_num_batched_tokens = geometry.budget
    if getattr(sched, "max_num_scheduled_tokens", None) is not None:
        # With a drafter the config derives the scheduler's own budget from
        # max_num_batched_tokens (0.33.0 config/vllm.py:2341-2348, 0.29.0
        # :1901-1912): derive it from the geometry's.
        sched.max_num_scheduled_tokens = geometry.budget
    sched.max_num_seqs = geometry.max_num_seqs
    sched.long_prefill_token_threshold = geometry.long_prefill_threshold
    if hasattr(sched, "scheduler_reserve_full_isl"):
        sched.scheduler_reserve_full_isl = geometry.reserve_full_input
    resolve = getattr(kv_cache_utils, "resolve_kv_cache_block_sizes", None)
    block_sizes: dict[str, int] = {}
    if resolve is not None:  # 0.20.2+: the engine core resolves both sizes
        scheduler_block, hash_block = resolve(kv_config, config)
        if hasattr(kv_config, "hash_block_size"):  # 0.32.0+
            kv_config.hash_block_size = hash_block
        block_sizes = {"block_size": scheduler_block, "hash_block_size": hash_block}
    else:  # older engines pass cache_config.block_size (also the hash block)
        block_sizes = {"block_size": config.cache_config.block_size}
    if geometry.async_scheduling:
        sched.async_scheduling = True
    if geometry.admission_window:
        if not supports_admission_window():
            raise NotImplementedError("cache-aware admission needs vLLM 0.34.0+")
        sched.cache_aware_admission_window = geometry.admission_window
        sched.cache_aware_admission_threshold = 0.0
    with retention_environment(geometry):
        scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            **block_sizes,
            log_stats=True,
        )
    for hook in SCHEDULER_BUILT_HOOKS:
        hook(scheduler)
    return scheduler


def runner_output(
    req_ids: list[str], sampled_token_ids: list[list[int]], **extra: Any
) -> Any:
    """vLLM's ``ModelRunnerOutput`` for one step: ``req_ids`` in the worker's
    order, each one's sampled tokens. Up to 0.33.0 the output also maps each id
    to its index (``req_id_to_index``); 0.34.0 dropped that field (the order of
    ``req_ids`` is the index)."""
    from dataclasses import fields

    from vllm.v1.outputs import ModelRunnerOutput

    if "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled_token_ids, **extra
    )


def prompt(length: int, seed: int) -> list[int]:
    """Deterministic pseudo-random token ids."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(length)]


def cacheable_boundaries(prompt_length: int, state_block: int) -> list[int]:
    """The B boundaries strictly inside a prompt: where its states can be cached."""
    return list(range(state_block, prompt_length, state_block))
