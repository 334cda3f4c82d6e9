"""A test-only KV connector: an external store holding the states of chosen prefixes.

Loaded the way users load third-party connectors, by name and module path:
``KVTransferConfig(kv_connector="PrefixStoreConnector",
kv_connector_module_path="support.prefix_store_connector", kv_role="kv_both")``
(``tests/`` is on the path of the test run). Only the scheduler side is real:
vLLM's scheduler asks it for external hits and tells it what it allocated; the
GPU worker side (loading bytes into blocks) is modelled by the simulation's
worker model (``vllm_mamba_align/tools/sim/worker.py``), so every worker
method here refuses to run.

What the test controls, through ``kv_connector_extra_config``:

- ``divergent_hits`` (bool, default False): the connector's
  ``supports_divergent_local_hybrid_hits``. vLLM 0.29.0+ reads it in
  ``Scheduler._get_local_prefix_cache_hit`` (scheduler.py:664-675 in 0.33.0):
  True makes the local hit the full-attention group's (possibly deeper than
  the Mamba group's), and the external hit must then supply the Mamba state;
  False makes the local hit the one every group agrees on. NIXL and MoRIIO set it.
- ``async_load`` (bool, default False): hits are loaded between steps
  (``load_kv_async``, the request waits in WAITING_FOR_REMOTE_KVS) instead of
  synchronously before the request's first forward pass.

and, after the scheduler is built, :meth:`PrefixStoreConnector.hold`: the store
then holds the state after exactly ``len(prefix)`` tokens of that prefix (the
connector's contract: what it loads is right for that prefix). A request whose
prompt starts with a held prefix gets an external hit ending at that prefix's
length, wherever that is: on the state grid B, on the cache grid C, or neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

NAME = "PrefixStoreConnector"
MODULE = __name__


class PrefixStoreMetadata(KVConnectorMetadata):
    """What the scheduler side hands its worker side for one step."""

    def __init__(self, loads: dict[str, int]) -> None:
        self.loads = loads
        """Request id -> external tokens to load this step."""


class PrefixStoreConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A store of prefix states, scheduler side only (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.divergent_hits = bool(extra.get("divergent_hits", False))
        self.async_load = bool(extra.get("async_load", False))
        self.prefixes: list[tuple[int, ...]] = []
        self.asked: list[tuple[str, int, int]] = []
        """(request id, local tokens vLLM asked with, external tokens answered)."""
        self.allocated: list[tuple[str, int]] = []
        """(request id, external tokens) as vLLM confirmed them after allocation."""
        self.finished: list[str] = []
        self._loads: dict[str, int] = {}

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.divergent_hits

    # -- what the test sets --------------------------------------------------
    def hold(self, prefix: Sequence[int]) -> None:
        """The store now holds the state after exactly this prefix."""
        self.prefixes.append(tuple(prefix))

    # -- scheduler side --------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The longest held prefix of the prompt, beyond what vLLM has locally.

        At most ``num_tokens - 1`` tokens in all: vLLM computes at least the
        last one itself (it needs its logits), as NIXL's decode side does
        (nixl/base_scheduler.py:402-409 in 0.33.0).
        """
        tokens = tuple(request.prompt_token_ids)
        held = max((len(p) for p in self.prefixes if tokens[: len(p)] == p), default=0)
        end = min(held, request.num_tokens - 1)
        hit = max(0, end - num_computed_tokens)
        self.asked.append((request.request_id, num_computed_tokens, hit))
        # vLLM's contract: the async flag must be False for a zero hit.
        return hit, self.async_load and hit > 0

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self.allocated.append((request.request_id, num_external_tokens))
            self._loads[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> PrefixStoreMetadata:
        loads, self._loads = self._loads, {}
        return PrefixStoreMetadata(loads)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append(request.request_id)
        return False, None

    # -- worker side: modelled by the simulation, never run ---------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError("scheduler-side test connector")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError("scheduler-side test connector")

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        raise NotImplementedError("scheduler-side test connector")

    def wait_for_save(self) -> None:
        raise NotImplementedError("scheduler-side test connector")
