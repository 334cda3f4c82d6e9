"""A real vLLM scheduler on CPU, and an oracle of the Mamba states its worker holds.

Used by ``vllm-mamba-align simulate``, the benchmarks and the test suite; it needs
vLLM (and its torch) installed, which the plugin itself never does. In parts:

- :mod:`.engine`: configs, schedulers and the tiny-model fixtures (no GPU, no
  weights: a config-only tiny hybrid in a temporary directory);
- :mod:`.worker`: the worker model, which writes the Mamba states vLLM's
  align-mode GPU worker would write;
- :mod:`.oracle`: the verdicts, which only read those states and judge them by
  what vLLM does (what it publishes, which states it keeps, what requests
  read), never by the plugin's predictions;
- :mod:`.driver`: :class:`Simulation`, stepping the scheduler as vLLM's engine
  core does.
"""

from .driver import Simulation, chunk_starts
from .engine import (
    CHECKPOINT_BACKENDS,
    MAX_MODEL_LEN,
    SAMPLED_TOKEN,
    SCHEDULER_BUILT_HOOKS,
    SPECULATIVE_METHODS,
    Geometry,
    available_checkpoint_backends,
    base_vllm_config,
    build_scheduler,
    cacheable_boundaries,
    kv_cache_config,
    prompt,
    retention_interval,
    runner_output,
    supports_admission_window,
)
from .oracle import KeepDecision, Poisoned
from .states import Chunk, RequestRecord, StateId, prefix_state_ids, state_id

__all__ = [
    "CHECKPOINT_BACKENDS",
    "MAX_MODEL_LEN",
    "SAMPLED_TOKEN",
    "SCHEDULER_BUILT_HOOKS",
    "SPECULATIVE_METHODS",
    "Chunk",
    "Geometry",
    "KeepDecision",
    "Poisoned",
    "RequestRecord",
    "Simulation",
    "StateId",
    "available_checkpoint_backends",
    "base_vllm_config",
    "build_scheduler",
    "cacheable_boundaries",
    "chunk_starts",
    "kv_cache_config",
    "prefix_state_ids",
    "prompt",
    "retention_interval",
    "runner_output",
    "state_id",
    "supports_admission_window",
]
