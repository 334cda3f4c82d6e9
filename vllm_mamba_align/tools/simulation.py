"""A real vLLM scheduler on CPU, and an oracle of the Mamba states its worker holds.

Used by ``vllm-mamba-align simulate``, the benchmarks and the test suite; it needs
vLLM (and its torch) installed, which the plugin itself never does. No GPU, no
weights: the model is a config-only tiny hybrid written to a temporary directory.

Everything scheduled here goes through the installed vLLM's own ``VllmConfig``,
``Scheduler``, ``KVCacheManager`` and ``Request``. Only the GPU worker is modeled,
the way vLLM's align-mode worker behaves: after a step that ends at token ``e``, the
request's running slot (block-table column ``ceil(e / B) - 1`` of the Mamba group)
holds the state after exactly ``e`` tokens; other slots keep what they held.

The oracle then checks the invariant users care about: a Mamba block published
under the hash of prefix ``[0, L)`` holds the state after exactly those ``L`` tokens,
and a request that reuses a cached state reads the state of its own prefix. Which
boundary states must be materialized it learns from vLLM itself: the keep-or-drop
decision its Mamba manager takes on each slot when it caches a request's blocks;
never from the plugin's model of vLLM's retention, prefill rule or release table.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import hashlib
import inspect
import json
import math
import os
import tempfile
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..checkpoints import flashkda_position
from ..releases import (
    CHECKPOINT_BACKENDS_SINCE,
    checkpoint_backends,
    installed_version,
    requests_need_eos_token_id,
    retention_in_kv_config,
)

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


@functools.cache
def model_dir() -> str:
    path = tempfile.mkdtemp(prefix="tiny-qwen3-next-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_QWEN3_NEXT, f)
    return path


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
    path = tempfile.mkdtemp(prefix="tiny-qwen3-next-mtp-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**TINY_QWEN3_NEXT, "num_nextn_predict_layers": modules}, f)
    return path


@functools.cache
def eagle_draft_dir() -> str:
    path = tempfile.mkdtemp(prefix="tiny-eagle3-draft-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_EAGLE3_DRAFT, f)
    return path


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
    if eagle_block_drop:
        from vllm.config import SpeculativeConfig

        if "disable_lookahead_block_hashes" in SpeculativeConfig.__dataclass_fields__:
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

    vLLM 0.24.0-0.25.1's CPU platform turns prefix caching off for linear-attention
    models when the CPU has AMX; no setting avoids it. Results must not depend on
    the host, and the scheduler under test never runs a CPU kernel.
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


CHECKPOINT_BACKENDS = tuple(CHECKPOINT_BACKENDS_SINCE)
"""Backends whose in-chunk prefill checkpoint the worker model writes, each from
the release where it declares checkpoint blocks (releases.CHECKPOINT_BACKENDS_SINCE):
flashkda 0.29.0+, Mamba2 0.32.0+, GDN on FlashInfer 0.33.0+. 0.29.0 has no
alignment field (flashkda's rule is 16 there)."""


def available_checkpoint_backends() -> tuple[str, ...]:
    """The backends of :data:`CHECKPOINT_BACKENDS` the installed vLLM has."""
    return checkpoint_backends(installed_version())


def checkpoint_alignment(backend: str, hash_block: int) -> int:
    """The backend's ``prefill_checkpoint_alignment``."""
    if backend == "gdn-flashinfer":
        return math.lcm(hash_block, 64)
    if backend == "mamba2":
        return 1
    if backend == "flashkda":
        return 16
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

    def mamba(block: int) -> Any:
        return MambaSpec(
            block_size=block,
            shapes=((1,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
            **checkpoint,
        )

    attention_layers = ["model.layers.3.self_attn.attn"]
    if drafts:
        # The drafter's attention layer has the target's spec (its ``is_draft``
        # flag does not compare, 0.33.0 kv_cache_interface.py:215): one group.
        attention_layers.append("mtp.layers.0.self_attn.attn")
    groups = [
        KVCacheGroupSpec(
            attention_layers,
            FullAttentionSpec(
                block_size=geometry.cache_block,
                num_kv_heads=1,
                head_size=16,
                dtype=torch.float32,
            ),
        ),
    ]
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
    from ..retention import RETENTION_VARIABLE

    raw = os.environ.get(RETENTION_VARIABLE, "")
    return int(raw) if raw.strip() else None


@contextlib.contextmanager
def retention_environment(geometry: Geometry) -> Iterator[None]:
    """0.27.1-0.28.0 read the retention from the environment when the KV-cache
    coordinator is built: set it for the build when the geometry picks one."""
    from ..retention import RETENTION_VARIABLE

    if retention_in_kv_config() or geometry.retention == DEFAULT_RETENTION:
        yield
        return
    previous = os.environ.get(RETENTION_VARIABLE)
    if geometry.retention is None:
        os.environ.pop(RETENTION_VARIABLE, None)
    else:
        os.environ[RETENTION_VARIABLE] = str(geometry.retention)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RETENTION_VARIABLE, None)
        else:
            os.environ[RETENTION_VARIABLE] = previous


def chunk_starts(output: Any) -> dict[str, int]:
    """Where each request's chunk of this step starts, from the scheduler's output.

    Read from the output rather than the requests: releases differ in when they
    advance ``request.num_computed_tokens``.
    """
    starts: dict[str, int] = {
        new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs
    }
    cached = output.scheduled_cached_reqs
    for req_id, computed in zip(
        cached.req_ids, cached.num_computed_tokens, strict=True
    ):
        starts[req_id] = computed
    return starts


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
        if not hasattr(config.cache_config, "prefix_match_unit"):
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


def _compute_checkpoints() -> Callable[..., tuple[list[int], list[int]]] | None:
    """vLLM's ``compute_mamba_prefill_checkpoints`` (0.31.0+), else None."""
    try:
        from vllm.model_executor.layers.mamba import checkpoint
    except ImportError:
        return None
    compute: Callable[..., tuple[list[int], list[int]]] | None = getattr(
        checkpoint, "compute_mamba_prefill_checkpoints", None
    )
    return compute


CANONICAL = "canonical"
FROM_TAIL = "computed around vLLM's partial-tail checkpoint (off the grid)"
FROM_STORE = "continued from a state a KV connector loaded"
NON_CANONICAL = "non-canonical"

StateId = tuple[int, bytes]
"""(number of tokens, digest of those tokens): which state a slot holds."""


def state_id(tokens: Sequence[int], length: int) -> StateId:
    return length, hashlib.blake2b(array("q", tokens[:length]).tobytes()).digest()


def prefix_state_ids(tokens: Sequence[int], step: int) -> Iterator[StateId]:
    """``state_id(tokens, k * step)`` for k = 1, 2, ... in linear time.

    Streaming blake2b gives the same digest as hashing the prefix in one go, so
    long prompts cost O(P), not O(P^2 / step) (a 60k-token prompt: ms, not s).
    """
    digest = hashlib.blake2b()
    for end in range(step, len(tokens) + 1, step):
        digest.update(array("q", tokens[end - step : end]).tobytes())
        yield end, digest.copy().digest()


@dataclass
class Chunk:
    start: int
    end: int


@dataclass
class RequestRecord:
    request: Any
    chunks: list[Chunk] = field(default_factory=list)
    reused_tokens: int | None = None
    prefilled_at_step: int | None = None


@dataclass(frozen=True)
class KeepDecision:
    """vLLM's decision, when it cached a request's blocks, on one Mamba slot."""

    req_id: str
    boundary: int
    """The state the slot stands for: after this many tokens (a multiple of B)."""
    kept: bool
    """Whether vLLM's retention keeps it (publishes it unless the slot is null)."""
    block: Any
    """The block in the slot then (the null block: nothing to publish)."""


@dataclass
class Poisoned:
    block_id: int
    claimed: StateId
    held: StateId | None

    def __str__(self) -> str:
        held = "nothing" if self.held is None else f"state@{self.held[0]}"
        return f"block {self.block_id} hashed as state@{self.claimed[0]} holds {held}"


class Simulation:
    """Drives a real scheduler step by step while modeling the Mamba worker."""

    schedule_calls = 0
    """schedule() calls made by all simulations of this process (for reports)."""

    def __init__(self, geometry: Geometry) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec

        self.geometry = geometry
        self.scheduler = build_scheduler(geometry)
        self.hash_fn = _init_hashing()
        manager = self.scheduler.kv_cache_manager
        self.block_pool = manager.block_pool
        self.mamba_group = next(
            i
            for i, g in enumerate(self.scheduler.kv_cache_config.kv_cache_groups)
            if isinstance(g.kv_cache_spec, MambaSpec)
        )
        self.mamba_manager = manager.coordinator.single_type_managers[self.mamba_group]
        self.state_block = geometry.state_block
        self.hash_block = self.block_pool.hash_block_size
        self.records: dict[str, RequestRecord] = {}
        self.holds: dict[int, StateId] = {}
        self.hash_names: dict[bytes, StateId] = {}
        self.poisoned: dict[tuple[int, bytes], Poisoned] = {}
        self.published: set[tuple[int, bytes]] = set()
        """Every (block, hash) the Mamba group published while we watched."""
        self.wrong_reuse: list[str] = []
        self.same_step_reuse: list[str] = []
        """Hits on a state written in the same step: vLLM's own, not the grid's."""
        self.steps = 0
        self.prefill_now: set[str] = set()
        """The requests whose chunk of the last step was prefill: it computed
        tokens the request already had, other than its last one (its prompt;
        after a preemption also its earlier output), see :meth:`step`."""
        self.keep_decisions: list[KeepDecision] = []
        """Every Mamba slot vLLM decided to keep or drop when it cached a
        request's blocks, in order (see :meth:`_watch_publications`)."""
        self.keep_decision_hooks: list[Callable[[Any, KeepDecision], None]] = []
        """Called with (request, decision) at the moment vLLM decides, while the
        request is as vLLM sees it (a test holds a model of retention there)."""
        self._unjudged: list[KeepDecision] = []
        self._reached: dict[str, dict[int, bool | None]] = {}
        """Request -> B boundary its prefill chunks reached (last time) -> None
        if a chunk crossed it without writing its slot, else whether the
        writer's own chunks were one B block each (the chunk that ended there,
        or the one whose backend checkpoint wrote it)."""
        self.canonical: dict[int, str] = {}
        """Block id -> how its state was computed, through every writer, cache
        hits included: CANONICAL (one B block per chunk from token 0),
        FROM_TAIL (canonically, but continued from vLLM's partial-tail
        checkpoint off the grid), FROM_STORE (likewise, but continued from a
        state a KV connector loaded) or NON_CANONICAL."""
        self._chains: dict[str, tuple[int, bool, str]] = {}
        """Request -> (end of its last prefill chunk, own chunks canonical so far,
        provenance of its state)."""
        self.kept_writes = 0
        """Prefill chunks that ended on a kept boundary and wrote its state."""
        self.noncanonical_kept_writes = 0
        """... whose writer's own chunks were not one B block each (the audit's
        count)."""
        self.noncanonical_kept: list[str] = []
        """Kept states whose state was not computed canonically from token 0."""
        self.tail_resumed_kept: list[str] = []
        """Kept states computed one block per chunk except around vLLM's
        partial-tail checkpoint (resumed from it, or split at it): not
        canonical, and not the split's doing."""
        self.missing_kept: list[str] = []
        """Prompt boundaries vLLM keeps whose state was never materialized."""
        self.checkpoint_now: dict[str, int] = {}
        """Request -> position of the in-chunk checkpoint its backend wrote in
        the last step."""
        self.checkpoint_writes = 0
        self._checkpoint_rule = self._backend_checkpoint_rule()
        self._in_flight: collections.deque[tuple[Any, Any]] = collections.deque()
        """Async scheduling: scheduled steps whose output is not processed yet."""
        self.store_loads: list[tuple[str, int]] = []
        """(request, hit end) for every state a KV connector loaded."""
        self.store_resumed_kept: list[str] = []
        """Kept states computed from a connector-loaded state (its provenance
        is the store's, not this instance's)."""
        self.wrong_offloads: list[str] = []
        """Boundary states vLLM handed the KV connector to save (0.29.0+'s
        ``boundary_state_offloads``) whose block held another state: a store
        would spread them to every instance that loads that prefix."""
        self.offloads = 0
        """Boundary states handed to the connector to save."""
        self._pending_loads: set[str] = set()
        self._loaded_at: dict[str, int] = {}
        self._offloads_now: dict[str, list[tuple[int, int, int]]] = {}
        self._watch_connector()
        self._watch_publications()
        self._hash_streams: dict[str, tuple[int, Any]] = {}
        """Request -> (hashes named so far, running digest of their tokens)."""
        self.drafts = geometry.speculative[1] if geometry.speculative else 0
        """Tokens the drafter proposes per decode step (0: none)."""
        self.accepted_drafts = 0
        self.rejected_drafts = 0
        self.scheduler_drops_eagle = bool(
            getattr(self.scheduler, "use_eagle_block_drop", None)
            if hasattr(self.scheduler, "use_eagle_block_drop")  # 0.30.0+
            else getattr(self.scheduler, "use_eagle", False)  # 0.29.0 and older
        )
        """Whether vLLM's scheduler drops EAGLE's last block (and backs its
        last cacheable position off one block)."""

    # -- requests ---------------------------------------------------------------
    def add(self, request_id: str, tokens: Sequence[int], max_tokens: int = 1) -> Any:
        """A new request, watched by the oracle, handed to the scheduler."""
        request = self.new_request(request_id, tokens, max_tokens)
        self._name_hashes(request, tokens)
        self.records[request_id] = RequestRecord(request)
        self.scheduler.add_request(request)
        return request

    def new_request(
        self, request_id: str, tokens: Sequence[int], max_tokens: int = 1
    ) -> Any:
        """A vLLM ``Request`` hashed for this scheduler (not added, not watched)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        hasher = get_request_block_hasher(self.hash_block, self.hash_fn)
        extra: dict[str, Any] = {}
        if requests_need_eos_token_id():
            extra["eos_token_id"] = None
        return Request(
            request_id,
            list(tokens),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            block_hasher=hasher,
            **extra,
        )

    def _name_hashes(self, request: Any, tokens: Sequence[int]) -> None:
        """Remember which prefix every hash this request can publish names."""
        self._name_new_hashes(request)
        wide = self.state_block
        if wide != self.hash_block and wide % self.hash_block == 0:
            # Releases before 0.26.0 publish a block wider than the hash block under
            # vLLM's merged hash of its hash blocks; later ones reuse the last hash.
            from vllm.v1.core.kv_cache_utils import BlockHashListWithBlockSize

            merged = BlockHashListWithBlockSize(
                request.block_hashes, self.hash_block, wide
            )
            wide_names = prefix_state_ids(tokens, wide)
            for index, name in zip(range(len(merged)), wide_names, strict=False):
                self.hash_names.setdefault(bytes(merged[index]), name)

    def _name_new_hashes(self, request: Any) -> None:
        """Name the hashes vLLM appended to ``request`` since the last call.

        Hash ``i`` names the state after ``(i + 1) * hash block`` tokens. It
        appears only once its tokens exist: output tokens' blocks, and with
        0.33.0's lookahead hashes (speculative decoding) a block's hash also
        waits for the tokens after it, so the prompt's last full block may be
        hashed only when the first output token arrives. Streaming, as in
        :func:`prefix_state_ids`: O(tokens) over a request's life.
        """
        named, digest = self._hash_streams.get(
            request.request_id, (0, hashlib.blake2b())
        )
        hashes = request.block_hashes
        if named >= len(hashes):
            return
        tokens = request.all_token_ids
        step = self.hash_block
        for index in range(named, len(hashes)):
            end = (index + 1) * step
            if end > len(tokens):
                break
            digest.update(array("q", tokens[end - step : end]).tobytes())
            self.hash_names[bytes(hashes[index])] = (end, digest.copy().digest())
            named = index + 1
        self._hash_streams[request.request_id] = (named, digest)

    # -- stepping ---------------------------------------------------------------
    def step(self) -> dict[str, Chunk]:
        """One schedule(), the modeled forward pass, and update_from_output()."""
        from vllm.v1.outputs import ModelRunnerOutput

        if self._in_flight and not self.scheduler.has_requests():
            # Async scheduling, all requests done: drain the queued steps' outputs.
            self.scheduler.update_from_output(*self._in_flight.pop())
            return {}

        # Which chunks are prefill, judged on each request as it is before this
        # step: those computing tokens it already has, other than its last one
        # (a decode step computes the last, and drafts are not its tokens yet).
        known = {
            req_id: max(r.request.num_prompt_tokens, r.request.num_tokens - 1)
            for req_id, r in self.records.items()
        }
        output = self.scheduler.schedule()
        self.steps += 1
        Simulation.schedule_calls += 1
        starts = chunk_starts(output)
        chunks: dict[str, Chunk] = {}
        for req_id, count in output.num_scheduled_tokens.items():
            start = starts[req_id]
            chunks[req_id] = Chunk(start, start + count)
        # The worker runs the step's queued block copies (copy-on-write of
        # partially hit or moved Mamba states) before the forward pass.
        for copy_op in getattr(output, "kv_cache_block_copies", None) or ():
            held = self.holds.get(copy_op.src_block_id)
            if held is None:
                self.holds.pop(copy_op.dst_block_id, None)
            else:
                self.holds[copy_op.dst_block_id] = held
            self.canonical[copy_op.dst_block_id] = self.canonical.get(
                copy_op.src_block_id, NON_CANONICAL
            )
        spec_tokens: dict[str, list[int]] = (
            getattr(output, "scheduled_spec_decode_tokens", None) or {}
        )
        finished_loads = self._load_external_states(starts)
        written = {self._running_block(r, c.end).block_id: r for r, c in chunks.items()}
        for new in output.scheduled_new_reqs:
            self._check_reused_state(new.req_id, new.num_computed_tokens, written)
        for req_id, chunk in chunks.items():
            num_drafts = len(spec_tokens.get(req_id, ()))
            self._write_running_state(req_id, chunk.end, num_drafts)
        self.checkpoint_now = {}
        for req_id, chunk in chunks.items():
            self._write_checkpoint_state(req_id, chunk)
        # The target model verifies the drafts (the sampler's acceptance) in
        # this forward pass, which also moves their states (postprocess).
        accepted: dict[str, int] = {}
        for req_id, chunk in chunks.items():
            proposed = spec_tokens.get(req_id, [])
            if not proposed:
                continue
            request = self.records[req_id].request
            accepted[req_id] = self._accepted(req_id, request, proposed)
            self._write_verified_states(req_id, chunk, proposed, accepted[req_id])
        self.prefill_now = {
            req_id
            for req_id, chunk in chunks.items()
            if req_id in known and chunk.start < known[req_id]
        }
        for req_id, chunk in chunks.items():  # in the scheduler's order
            if req_id in self.prefill_now:
                self._track_kept_states(req_id, chunk)
        self._judge_kept_states()
        self._check_published_hashes()
        self._check_offloaded_states()

        sampled: list[list[int]] = []
        for req_id, chunk in chunks.items():
            record = self.records[req_id]
            request = record.request
            if chunk.start < request.num_prompt_tokens:
                record.chunks.append(chunk)
            done = chunk.end >= request.num_tokens
            if done and record.prefilled_at_step is None:
                record.prefilled_at_step = self.steps
            # The accepted drafts come back as sampled tokens (the drafter
            # proposes SAMPLED_TOKEN; async scheduling only shows placeholders).
            verified = [SAMPLED_TOKEN] * accepted.get(req_id, 0)
            sampled.append([*verified, SAMPLED_TOKEN] if done else [])
        extra: dict[str, Any] = {}
        if finished_loads:
            from vllm.v1.outputs import KVConnectorOutput

            extra["kv_connector_output"] = KVConnectorOutput(
                finished_recving=finished_loads
            )
        runner_output = ModelRunnerOutput(
            req_ids=list(chunks),
            req_id_to_index={req_id: i for i, req_id in enumerate(chunks)},
            sampled_token_ids=sampled,
            **extra,
        )
        if self.geometry.async_scheduling:
            # vLLM's engine core with a batch queue of two
            # (EngineCore.step_with_batch_queue, v1/engine/core.py:708-790 in
            # 0.33.0): a new step is queued, and the oldest one's output is
            # processed only once the queue is full or nothing more was scheduled.
            self._in_flight.appendleft((output, runner_output))
            if len(self._in_flight) < 2 and (chunks or self.scheduler.has_requests()):
                return chunks
            output, runner_output = self._in_flight.pop()
        self.scheduler.update_from_output(output, runner_output)
        for req_id in chunks:
            self._name_new_hashes(self.records[req_id].request)
        if self.drafts:
            self._propose_drafts(chunks)
        return chunks

    # -- speculative decoding ---------------------------------------------------
    def _accepted(self, req_id: str, request: Any, drafts: Sequence[int]) -> int:
        """How many leading drafts the target model accepts: deterministic
        pseudo-random, never a placeholder (-1, vLLM's padding of a decode
        step to 1 + k rows), never beyond max_tokens."""
        import random

        if not drafts:
            return 0
        if self.geometry.async_scheduling:
            # The scheduler only sees placeholders (-1); the worker fills them
            # with its drafter's tokens. The model accepts every draft: vLLM's
            # worker then computes at the positions the scheduler planned
            # (after a rejection it would shift the next in-flight step back,
            # preprocess_mamba's accepted-token bias, which is not modelled).
            # Past max_tokens vLLM trims the tokens itself (check_stop).
            self.accepted_drafts += len(drafts)
            return len(drafts)
        real = next((i for i, t in enumerate(drafts) if t < 0), len(drafts))
        room: int = request.max_tokens - request.num_output_tokens - 1
        pick = random.Random(f"{req_id}/{self.steps}").randint(0, len(drafts))
        accepted = max(0, min(pick, real, room))
        self.accepted_drafts += accepted
        self.rejected_drafts += len(drafts) - accepted
        return accepted

    def _propose_drafts(self, chunks: dict[str, Chunk]) -> None:
        """The drafter's proposal after a step, handed over the way the engine
        core does (``update_draft_token_ids``); vLLM ignores it for requests
        whose chunk was a non-final prefill chunk."""
        from vllm.v1.outputs import DraftTokenIds

        if self.geometry.async_scheduling:
            # The engine core does not hand drafts over under async scheduling:
            # the AsyncScheduler schedules placeholders (core.py:703 in 0.33.0).
            return
        live = [r for r in chunks if r in self.scheduler.requests]
        if live:
            self.scheduler.update_draft_token_ids(
                DraftTokenIds(live, [[SAMPLED_TOKEN] * self.drafts for _ in live])
            )

    def _write_verified_states(
        self, req_id: str, chunk: Chunk, drafts: Sequence[int], accepted: int
    ) -> None:
        """What a verify step leaves in the Mamba slots besides the running one.

        vLLM's align-mode worker (0.33.0 mamba_utils.py:1495-1512 and
        postprocess_mamba_fused_kernel :440-470; the same rule in Python in
        0.18.1 mamba_utils.py:233-262): the state after the running token sits
        in column ``cdiv(end, B) - 1`` (end counts the drafts), the state after
        draft j in the j-th speculative block after it; then, if the accepted
        tokens reach a B boundary at or past the running token, that state is
        copied into the boundary's own column.
        """
        grid = self.state_block
        blocks = self._mamba_blocks(req_id)
        # The request's tokens as they will be once the accepted drafts join
        # (async scheduling: already there, as output placeholders).
        tokens = self._tokens(req_id)
        if not self.geometry.async_scheduling:
            tokens = [*tokens, *[SAMPLED_TOKEN] * accepted]
        column = -(-chunk.end // grid) - 1
        running = chunk.end - len(drafts)
        for j in range(1, len(drafts) + 1):
            if column + j >= len(blocks) or blocks[column + j].is_null:
                continue
            block_id = blocks[column + j].block_id
            self.holds[block_id] = (
                state_id(tokens, running + j)
                if j <= accepted
                else (running + j, b"rejected draft")
            )
            self.canonical[block_id] = NON_CANONICAL
        boundary = (running + accepted) // grid * grid
        if boundary < running or boundary == 0:
            return
        source = blocks[column + boundary - running]
        target = blocks[boundary // grid - 1]
        if source is target or target.is_null:
            return
        held = self.holds.get(source.block_id)
        if held is None:
            self.holds.pop(target.block_id, None)
        else:
            self.holds[target.block_id] = held
        self.canonical[target.block_id] = NON_CANONICAL

    def run(
        self,
        max_steps: int = 10_000,
        after_step: Callable[[Simulation], None] | None = None,
    ) -> None:
        """Step until every request has finished; fail loudly on a stall.

        ``after_step`` (e.g. a progress line) is called after every step.
        """
        idle = 0
        while self.busy():
            if self.steps >= max_steps:
                raise AssertionError(
                    f"requests still unfinished after {max_steps} steps"
                )
            chunks = self.step()
            idle = 0 if chunks else idle + 1
            if idle > 3:
                raise AssertionError("the scheduler stalled: nothing scheduled 4 times")
            if after_step is not None:
                after_step(self)

    def busy(self) -> bool:
        """Requests left, or (async scheduling) steps whose output is pending."""
        return bool(self._in_flight) or self.scheduler.has_requests()

    # -- the worker model and the oracle ----------------------------------------
    def _mamba_blocks(self, req_id: str) -> list[Any]:
        return list(self.mamba_manager.req_to_blocks.get(req_id, ()))

    def _tokens(self, req_id: str) -> Sequence[int]:
        request = self.records[req_id].request
        tokens: Sequence[int] = request.all_token_ids
        in_flight = getattr(request, "num_output_placeholders", 0)
        if self.geometry.async_scheduling and in_flight > 0:
            # Async scheduling: a step may compute tokens whose values arrive
            # with a later update; they are the ones this model samples.
            return [*tokens, *[SAMPLED_TOKEN] * in_flight]
        return tokens

    def _write_running_state(self, req_id: str, end: int, drafts: int = 0) -> None:
        """The running slot: column ``cdiv(end, B) - 1``; with ``drafts``
        speculative tokens scheduled it holds the state after the last
        verified token, ``end - drafts`` (see _write_verified_states)."""
        column = -(-end // self.state_block) - 1
        blocks = self._mamba_blocks(req_id)
        block = blocks[column]
        assert not block.is_null, f"{req_id}: running slot {column} is the null block"
        self.holds[block.block_id] = state_id(self._tokens(req_id), end - drafts)
        self.canonical[block.block_id] = NON_CANONICAL  # until a prefill chunk says so

    def _watch_connector(self) -> None:
        """Watch the scheduler's KV connector, whatever its class, where vLLM
        talks to it: which requests it must load (``update_state_after_alloc``
        with external tokens, scheduler.py:1482-1486 in 0.33.0) and which
        boundary states it is handed to save (the block state its
        ``build_connector_meta`` sees, scheduler.py:1681-1697; vLLM clears it
        from the output right after, :1775)."""
        connector = getattr(self.scheduler, "connector", None)
        if connector is None:
            return
        allocated = connector.update_state_after_alloc
        build_meta = connector.build_connector_meta
        pending = self._pending_loads

        def update_state_after_alloc(
            request: Any, blocks: Any, num_external_tokens: int
        ) -> Any:
            if num_external_tokens > 0:
                pending.add(request.request_id)
            return allocated(request, blocks, num_external_tokens)

        def build_connector_meta(scheduler_output: Any) -> Any:
            state = getattr(scheduler_output, "kv_connector_block_state", None)
            offloads = getattr(state, "boundary_state_offloads", None) or {}
            self._offloads_now = {r: list(o) for r, o in offloads.items()}
            return build_meta(scheduler_output)

        connector.update_state_after_alloc = update_state_after_alloc
        connector.build_connector_meta = build_connector_meta

    def _load_external_states(self, starts: dict[str, int]) -> set[str]:
        """The connector's worker side loading this step's external hits.

        A hit ending at ``e`` (local plus external tokens) leaves the state
        after exactly ``e`` tokens in the request's running slot, block-table
        column ``ceil(e / B) - 1``: the Mamba group gives the external range
        exactly that one real block (``allocate_external_computed_blocks``
        after ``add_local_computed_blocks`` padded the skipped columns with
        the null block, single_type_kv_cache_manager.py:268-362 in 0.33.0).
        The state is right for the prefix: that is the connector's contract.
        A synchronous load lands before the request's first forward pass (its
        chunk starts at ``e``); an asynchronous one while the request waits
        in WAITING_FOR_REMOTE_KVS with ``num_computed_tokens = e``
        (scheduler.py:1514-1545), and is reported finished in this step's
        output, as a worker reports ``finished_recving``.
        Returns the requests whose asynchronous load finished.
        """
        from vllm.v1.request import RequestStatus

        finished: set[str] = set()
        for req_id in sorted(self._pending_loads):
            request = self.records[req_id].request
            if req_id in starts:
                end = starts[req_id]
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                end = request.num_computed_tokens
                finished.add(req_id)
            else:
                continue
            self._pending_loads.discard(req_id)
            column = (end - 1) // self.state_block
            block = self._mamba_blocks(req_id)[column]
            assert not block.is_null, f"{req_id}: loaded into the null block"
            self.holds[block.block_id] = state_id(self._tokens(req_id), end)
            self.canonical[block.block_id] = FROM_STORE
            self.store_loads.append((req_id, end))
            self._loaded_at[req_id] = end
        return finished

    def _check_offloaded_states(self) -> None:
        """Each boundary state handed to the connector this step must be held
        by its block once the step's forward pass ran (a store saves it then)."""
        offloads, self._offloads_now = self._offloads_now, {}
        for req_id, entries in offloads.items():
            if req_id not in self.records:
                continue
            tokens = self._tokens(req_id)
            for group, block_id, boundary in entries:
                if group != self.mamba_group:
                    continue
                self.offloads += 1
                held = self.holds.get(block_id)
                if held != state_id(tokens, boundary):
                    got = "nothing" if held is None else f"state@{held[0]}"
                    self.wrong_offloads.append(
                        f"{req_id}: block {block_id} saved as state@{boundary} "
                        f"holds {got}"
                    )

    def _backend_checkpoint_rule(
        self,
    ) -> Callable[[int, int], tuple[int, int] | None] | None:
        """(query start, seq len) -> (checkpoint position, block-table column)
        or None, as the installed vLLM's GPU backend computes it; None when
        the geometry declares no prefill checkpoint blocks."""
        backend = self.geometry.prefill_checkpoint
        if backend is None:
            return None
        spec = self.mamba_manager.kv_cache_spec
        grid = self.state_block
        compute = _compute_checkpoints()
        if compute is not None:
            # 0.31.0+: MambaPrefillCheckpointBuilder.build calls vLLM's
            # compute_mamba_prefill_checkpoints with the chunk end as seq_len:
            # position = the checkpoint position below the chunk end, kept only
            # if is_mamba_prefill_checkpoint_valid; column cdiv(seq_len, B) - 2;
            # a null column is gathered as NULL_BLOCK_ID, i.e. nothing is
            # written (model_executor/layers/mamba/checkpoint.py:21-58 and
            # :67-123 in 0.31.0, :21-67 and :94-155 in 0.32.0, :21-71 and
            # :113-142 in 0.33.0). Its grid and hash block per release:
            parameters = inspect.signature(compute).parameters
            options: dict[str, Any] = {}
            if "cache_hit_alignment_tokens" in parameters:
                # 0.32.0+: the engine's resolved cache_config.hash_block_size
                # and cache_hit_alignment_tokens (checkpoint.py:111-112 in
                # 0.32.0; the worker copies them from the KV-cache config,
                # v1/worker/gpu_worker.py:864-866), which the managers hold.
                hash_block = self.hash_block
                options["cache_hit_alignment_tokens"] = (
                    self.mamba_manager.cache_hit_alignment_tokens
                )
                if "num_hash_lookahead_tokens" in parameters:  # 0.33.0
                    options["num_hash_lookahead_tokens"] = getattr(
                        self.scheduler, "num_hash_lookahead_tokens", 0
                    )
            else:
                # 0.31.0: prefix_match_unit, else the Mamba block
                # (checkpoint.py:86), whatever hash block the engine resolved.
                hash_block = self._prefix_match_unit() or grid
            alignment = spec.prefill_checkpoint_alignment
            # The builder drops EAGLE's block when the speculative config does
            # and lookahead hashes are off (checkpoint.py:100-107 in 0.33.0):
            # the scheduler's use_eagle_block_drop (scheduler.py:330-345).
            drop_eagle_block = bool(
                getattr(self.scheduler, "use_eagle_block_drop", False)
            )

            def rule(start: int, end: int) -> tuple[int, int] | None:
                offsets, columns = compute(
                    [end],
                    [end - start],
                    hash_block_size=hash_block,
                    mamba_block_size=grid,
                    checkpoint_alignment=alignment,
                    drop_eagle_block=drop_eagle_block,
                    **options,
                )
                if not offsets[0]:
                    return None
                return start + offsets[0], columns[0]

            return rule
        if hasattr(spec, "prefill_checkpoint_alignment"):
            # 0.30.0: only KDA's metadata builder writes a checkpoint; it runs
            # vLLM's position helper and validity check on the chunk end, with
            # prefix_match_unit, else the Mamba block, as hash block and grid
            # (models/kimi_k3/nvidia/kda_metadata.py:604-675): the state at
            # that position, column cdiv(seq_len, B) - 2, NULL_BLOCK_ID (no
            # write) for a null column. It drops EAGLE's block as the
            # speculative config says (use_eagle_block_drop(), :624-627), which
            # the scheduler holds (scheduler.py:287 in 0.30.0).
            from vllm.v1.kv_cache_interface import (
                get_mamba_prefill_checkpoint_position,
                is_mamba_prefill_checkpoint_valid,
            )

            kda_hash_block = self._prefix_match_unit() or grid
            kda_alignment = spec.prefill_checkpoint_alignment
            kda_drops = bool(self.scheduler.use_eagle_block_drop)

            def rule_0_30(start: int, end: int) -> tuple[int, int] | None:
                position = get_mamba_prefill_checkpoint_position(
                    end, kda_hash_block, drop_eagle_block=kda_drops
                )
                if not is_mamba_prefill_checkpoint_valid(
                    query_start=start,
                    query_end=end,
                    checkpoint_position=position,
                    hash_block_size=kda_hash_block,
                    mamba_block_size=grid,
                    checkpoint_alignment=kda_alignment,
                ):
                    return None
                return position, -(-end // grid) - 2

            return rule_0_30
        if "num_prefill_checkpoint_blocks" in type(spec).__dataclass_fields__:
            # 0.29.0: only KDA on flashkda declares checkpoint blocks
            # (models/kimi_k3/nvidia/kda.py:599); its position rule is
            # checkpoints.flashkda_position; column seq_len // B - 1; a null
            # column is gathered as NULL_BLOCK_ID (nothing written).
            def rule_0_29(start: int, end: int) -> tuple[int, int] | None:
                position = flashkda_position(start, end, grid)
                if position < 0:
                    return None
                return position, end // grid - 1

            return rule_0_29
        raise NotImplementedError(
            "the in-chunk prefill checkpoint is modelled for vLLM 0.29.0-0.33.0"
        )

    def _prefix_match_unit(self) -> int | None:
        """The configured prefix_match_unit (None: unset), as the worker reads it."""
        unit: int | None = self.scheduler.vllm_config.cache_config.prefix_match_unit
        return unit

    def _write_checkpoint_state(self, req_id: str, chunk: Chunk) -> None:
        """The backend's in-chunk checkpoint write (see _backend_checkpoint_rule)."""
        rule = self._checkpoint_rule
        if rule is None:
            return
        found = rule(chunk.start, chunk.end)
        if found is None:
            return
        position, column = found
        blocks = self._mamba_blocks(req_id)
        if column >= len(blocks) or blocks[column].is_null:
            return  # NULL_BLOCK_ID: the kernel skips the write
        block_id = blocks[column].block_id
        self.holds[block_id] = state_id(self._tokens(req_id), position)
        self.canonical[block_id] = NON_CANONICAL  # until _track_kept_states says so
        self.checkpoint_now[req_id] = position
        self.checkpoint_writes += 1

    def _track_kept_states(self, req_id: str, chunk: Chunk) -> None:
        """Record the B boundaries one prefill chunk reached, and how it computed
        them (:meth:`_judge_kept_states` judges those vLLM keeps).

        A state is canonical when it was computed one B block per chunk from
        token 0: then it is bit for bit what any other request computes for
        the same prefix. ``full`` promises that for every state it keeps, except
        around vLLM's partial-tail checkpoint (0.26.0+: a resumption from a cache
        hit that ends off the B grid, or vLLM's own stop inside the prompt's last
        block): those are tracked apart (``tail_resumed_kept``).
        """
        grid = self.state_block
        start, end = chunk.start, chunk.end
        request = self.records[req_id].request
        tokens = self._tokens(req_id)
        chain = self._chains.get(req_id)
        if chain is not None and chain[0] == start:
            own, provenance = chain[1], chain[2]
        else:  # a new start: the first chunk, a cache hit, a resumption
            own = start % grid == 0
            provenance = CANONICAL if start == 0 else FROM_TAIL
            if start and self._loaded_at.get(req_id) == start:
                provenance = FROM_STORE  # a connector's state, on or off the grid
            if start and own and provenance != FROM_STORE:
                hit = self._mamba_blocks(req_id)[start // grid - 1]
                right = not hit.is_null and self.holds.get(hit.block_id) == state_id(
                    tokens, start
                )
                provenance = (
                    self.canonical.get(hit.block_id, NON_CANONICAL)
                    if right
                    else NON_CANONICAL
                )
        # The backend's in-chunk checkpoint: as canonical as the chunk's start
        # when it is the chunk's first boundary, one B block from an aligned
        # start (its kernel chunks from the query start, on the alignment).
        checkpoint = self.checkpoint_now.get(req_id)
        own_checkpoint = own and checkpoint is not None and checkpoint == start + grid
        if checkpoint is not None:
            column = -(-end // grid) - 2
            first_block = start % grid == 0 and checkpoint == start + grid
            self.canonical[self._mamba_blocks(req_id)[column].block_id] = (
                provenance if first_block else NON_CANONICAL
            )
        if not (start % grid == 0 and end - start == grid):
            own = False
            # Off the grid only around vLLM's partial-tail checkpoint: resumed
            # from it (up to the next boundary), or stopped at it inside the
            # prompt's last block (vLLM's own stop, which no mode overrides).
            to_boundary = start % grid and end <= (start // grid + 1) * grid
            prompt_end = request.num_prompt_tokens
            at_tail = (
                start % grid == 0
                and end % grid
                and end < prompt_end
                and (
                    (prompt_end - 1) // grid * grid < end
                    or end == self._partial_tail(prompt_end)
                )
            )
            if at_tail and provenance == CANONICAL:
                provenance = FROM_TAIL
            elif not (
                provenance in (FROM_TAIL, FROM_STORE) and (to_boundary or at_tail)
            ):
                provenance = NON_CANONICAL
        self._chains[req_id] = (end, own, provenance)
        self.canonical[self._running_block(req_id, end).block_id] = provenance
        reached = self._reached.setdefault(req_id, {})
        for boundary in range((start // grid + 1) * grid, end + 1, grid):
            if boundary == end:
                reached[boundary] = own
            elif boundary == checkpoint:
                reached[boundary] = own_checkpoint
            else:
                reached[boundary] = None

    def _watch_publications(self) -> None:
        """Watch vLLM decide which Mamba states it keeps: every release caches a
        request's full blocks through ``BlockPool.cache_full_blocks`` (0.15.1+),
        with the Mamba manager's ``block_mask`` where its retention drops some
        (0.27.1+: ``reachable_block_mask``; None or absent: every block). Slot
        ``i`` of a call is the state after ``(i + 1) * B`` tokens; a kept slot
        holding the null block is a state vLLM keeps that nobody wrote."""
        pool = self.mamba_manager.block_pool
        publish = pool.cache_full_blocks
        signature = inspect.signature(publish)
        grid = self.state_block

        def cache_full_blocks(*args: Any, **kwargs: Any) -> Any:
            given = signature.bind(*args, **kwargs).arguments
            if given["kv_cache_group_id"] == self.mamba_group:
                request = given["request"]
                blocks = given["blocks"]
                first = given["num_cached_blocks"]
                mask = given.get("block_mask")
                for index in range(first, given["num_full_blocks"]):
                    decision = KeepDecision(
                        request.request_id,
                        (index + 1) * grid,
                        mask is None or bool(mask[index - first]),
                        blocks[index],
                    )
                    self.keep_decisions.append(decision)
                    self._unjudged.append(decision)
                    for hook in self.keep_decision_hooks:
                        hook(request, decision)
            return publish(*args, **kwargs)

        pool.cache_full_blocks = cache_full_blocks

    def _judge_kept_states(self) -> None:
        """Every state vLLM decided to keep (so far) that a prefill chunk
        reached: materialized in the slot vLLM publishes for it, and how it was
        computed. A boundary vLLM drops is not judged; one no prefill chunk
        reached (below a hit, past the prompt in decode) is not the split's."""
        decisions, self._unjudged = self._unjudged, []
        for decision in decisions:
            req_id, boundary, block = decision.req_id, decision.boundary, decision.block
            reached = self._reached.get(req_id, {})
            if not decision.kept or boundary not in reached:
                continue
            own = reached[boundary]
            if own is None:
                self.missing_kept.append(f"{req_id}: {boundary} inside a chunk")
                continue
            if block.is_null or self.holds.get(block.block_id) != state_id(
                self._tokens(req_id), boundary
            ):
                self.missing_kept.append(f"{req_id}: {boundary} not written")
                continue
            self.kept_writes += 1
            self.noncanonical_kept_writes += not own
            if boundary > self.records[req_id].request.num_prompt_tokens:
                # Past the prompt (a resumed request replaying its output): no
                # chunking makes it canonical; it is no prompt state.
                continue
            held = self.canonical.get(block.block_id, NON_CANONICAL)
            if held == NON_CANONICAL:
                self.noncanonical_kept.append(f"{req_id}: state@{boundary}")
            elif held == FROM_TAIL:
                self.tail_resumed_kept.append(f"{req_id}: state@{boundary}")
            elif held == FROM_STORE:
                self.store_resumed_kept.append(f"{req_id}: state@{boundary}")

    @property
    def retention_interval(self) -> int | None:
        """vLLM's state retention here, as its KV-cache coordinator holds it
        (0.27.1+; None: dense, every state kept, as in every earlier release)."""
        coordinator = self.scheduler.kv_cache_manager.coordinator
        interval: int | None = getattr(coordinator, "retention_interval", None)
        return interval

    def _partial_tail(self, prompt_end: int) -> int:
        """vLLM's partial-tail checkpoint of a prompt, where its split stops
        (0.30.0+, with partial hash hits; 0 elsewhere). With EAGLE's block
        drop it lies one hash block lower (floor(P / hash) * hash - hash,
        kv_cache_interface.py:1169-1186 in 0.33.0), so it can fall in the
        block before the prompt's last one."""
        if not getattr(self.scheduler, "mamba_partial_cache_hit", False):
            return 0
        try:
            from vllm.v1.kv_cache_interface import (
                get_mamba_prefill_checkpoint_position as position_of,
            )
        except ImportError:
            return 0
        options: dict[str, int] = {}
        if "num_hash_lookahead_tokens" in inspect.signature(position_of).parameters:
            # 0.33.0's helper; 0.30.0-0.32.0's has no lookahead hashes.
            options["num_hash_lookahead_tokens"] = getattr(
                self.scheduler, "num_hash_lookahead_tokens", 0
            )
        tail: int = position_of(
            prompt_end, self.hash_block, self.scheduler_drops_eagle, **options
        )
        return tail

    def _running_block(self, req_id: str, end: int) -> Any:
        return self._mamba_blocks(req_id)[-(-end // self.state_block) - 1]

    def _check_reused_state(
        self, req_id: str, num_computed: int, written: dict[int, str]
    ) -> None:
        record = self.records[req_id]
        if record.reused_tokens is None:
            record.reused_tokens = num_computed
        if num_computed == 0:
            return
        column = (num_computed - 1) // self.state_block
        block = self._mamba_blocks(req_id)[column]
        wanted = state_id(self._tokens(req_id), num_computed)
        held = None if block.is_null else self.holds.get(block.block_id)
        # Its own running block (a partial hit's copy, a connector's load) is
        # no other request's same-step write: it must hold the state already.
        if held != wanted and written.get(block.block_id, req_id) != req_id:
            # vLLM before the same-step deferral (0.15.1-0.16.0 seen) lets a request
            # hit a block another request of this very step is still writing.
            self.same_step_reuse.append(f"{req_id} hit block {block.block_id}")
        elif held != wanted:
            got = "nothing" if held is None else f"state@{held[0]}"
            self.wrong_reuse.append(
                f"{req_id} resumed at {num_computed} from block {block.block_id} "
                f"holding {got}"
            )

    def published_mamba_blocks(self) -> Iterator[tuple[Any, bytes, StateId]]:
        """(block, hash key, state the hash names) for every published Mamba block."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        for block in self._hashed_blocks():
            key = block.block_hash
            if key is None or get_group_id(key) != self.mamba_group:
                continue
            claimed = self.hash_names.get(bytes(get_block_hash(key)))
            if claimed is not None:
                yield block, bytes(key), claimed

    def _hashed_blocks(self) -> Iterator[Any]:
        """Every block of the pool that carries a hash: those in the pool's
        hash map (every release 0.15.1+ keeps one, ``BlockHashToBlockMap``), a
        few dozen, rather than a scan of all blocks each step."""
        cache = getattr(self.block_pool.cached_block_hash_to_block, "_cache", None)
        if cache is None:
            yield from self.block_pool.blocks
            return
        seen: set[int] = set()
        for entry in list(cache.values()):
            for block in entry.values() if isinstance(entry, dict) else (entry,):
                if block.block_id not in seen:
                    seen.add(block.block_id)
                    yield block

    def _check_published_hashes(self) -> None:
        for block, key, claimed in self.published_mamba_blocks():
            self.published.add((block.block_id, key))
            held = self.holds.get(block.block_id)
            if held != claimed:
                wrong = Poisoned(block.block_id, claimed, held)
                self.poisoned.setdefault((block.block_id, key), wrong)

    # -- measurements -----------------------------------------------------------
    def chunk_ends(self, req_id: str) -> list[int]:
        return [c.end for c in self.records[req_id].chunks]

    def materialized_boundaries(self, req_id: str) -> list[int]:
        """B boundaries of the prompt held by a Mamba block published for them.

        Reads the block pool, so it still answers after the request finished (its
        blocks stay cached until evicted).
        """

        request = self.records[req_id].request
        tokens = self._tokens(req_id)
        wanted = {
            state_id(tokens, b): b
            for b in cacheable_boundaries(request.num_prompt_tokens, self.state_block)
        }
        found = {
            wanted[claimed]
            for block, _, claimed in self.published_mamba_blocks()
            if claimed in wanted and self.holds.get(block.block_id) == claimed
        }
        return sorted(found)

    def reused(self, req_id: str) -> int:
        reused = self.records[req_id].reused_tokens
        assert reused is not None, f"{req_id} was never scheduled"
        return reused


def prompt(length: int, seed: int) -> list[int]:
    """Deterministic pseudo-random token ids."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(length)]


def cacheable_boundaries(prompt_length: int, state_block: int) -> list[int]:
    """The B boundaries strictly inside a prompt: where its states can be cached."""
    return list(range(state_block, prompt_length, state_block))
