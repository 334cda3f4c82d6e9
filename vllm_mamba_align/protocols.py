"""The parts of vLLM's objects the serving path reads, as typing protocols.

vLLM's own classes are not imported for typing (the package imports nothing
from vLLM at module level, and its types differ across releases); these
protocols name exactly the attributes the plugin reads (or, for
``Scheduler.cache_config``, swaps for the duration of a split call). A member
that only some releases have says which; the code reads it only on those.
Attributes read with ``getattr(..., default)`` because a release may lack them
are not listed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class CacheConfig(Protocol):
    """``vllm.config.CacheConfig``, as the split and the backend rule read it."""

    @property
    def block_size(self) -> int:
        """C: the grid every released split reads (the smallest block over all
        KV-cache groups, set by the engine core)."""

    @property
    def prefix_match_unit(self) -> int | None:
        """The configured hash block (0.26.0+; read on 0.30.0-0.31.0 only)."""


class SchedulerConfig(Protocol):
    """``vllm.config.SchedulerConfig``."""

    @property
    def long_prefill_token_threshold(self) -> int | None: ...


class KVCacheGroup(Protocol):
    """``vllm.v1.kv_cache_interface.KVCacheGroupSpec``."""

    @property
    def kv_cache_spec(self) -> Any:
        """A spec (``MambaSpec``, ``FullAttentionSpec``, ``UniformTypeKVCacheSpecs``
        …); the Mamba fields are read with defaults: they differ by release."""

    @property
    def layer_names(self) -> Sequence[str]: ...


class KVCacheConfig(Protocol):
    """``vllm.v1.kv_cache_interface.KVCacheConfig``."""

    @property
    def kv_cache_groups(self) -> Sequence[KVCacheGroup]: ...


class Coordinator(Protocol):
    """The KV-cache coordinator (``vllm/v1/core/kv_cache_coordinator.py``)."""

    @property
    def retention_interval(self) -> int | None:
        """The retention setting (0.23.0+; the Mamba manager applies it from 0.24.0)."""

    @property
    def single_type_managers(self) -> Sequence[Any]:
        """One manager per KV-cache group, in the groups' order."""


class KVCacheManager(Protocol):
    """``vllm.v1.core.kv_cache_manager.KVCacheManager``."""

    @property
    def coordinator(self) -> Coordinator: ...


class Request(Protocol):
    """``vllm.v1.request.Request``: the counts the split's prefill test and the
    stops read."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""

    @property
    def num_output_tokens(self) -> int: ...


class NewRequest(Protocol):
    """``vllm.v1.core.sched.output.NewRequestData``."""

    @property
    def req_id(self) -> str: ...


class SchedulerOutput(Protocol):
    """``vllm.v1.core.sched.output.SchedulerOutput``, as the audit reads it."""

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequest]: ...


class Scheduler(Protocol):
    """``vllm.v1.core.sched.scheduler.Scheduler`` (and the classes that inherit
    it), as the fix, the audit and activation read it."""

    cache_config: CacheConfig
    """Swapped for a state-grid view for the duration of each split call."""

    @property
    def kv_cache_config(self) -> KVCacheConfig: ...

    @property
    def scheduler_config(self) -> SchedulerConfig: ...

    @property
    def kv_cache_manager(self) -> KVCacheManager: ...

    @property
    def requests(self) -> Mapping[str, Request]:
        """The requests the scheduler holds, by id."""

    @property
    def max_num_scheduled_tokens(self) -> int:
        """The step budget (``--max-num-batched-tokens``)."""

    @property
    def hash_block_size(self) -> int:
        """The engine's hash block (0.26.0+)."""

    @property
    def block_size(self) -> int:
        """The scheduler block, the LCM of the groups' blocks (0.32.0+)."""

    @property
    def mamba_has_prefill_checkpoint_blocks(self) -> bool:
        """Whether the backend checkpoints inside a chunk (0.29.0+)."""

    @property
    def mamba_partial_cache_hit(self) -> bool:
        """0.32.0+."""

    @property
    def mamba_prefill_checkpoint_alignment(self) -> int:
        """0.30.0+."""

    @property
    def use_eagle_block_drop(self) -> bool:
        """0.30.0+."""

    @property
    def num_hash_lookahead_tokens(self) -> int:
        """0.33.0."""
