"""Which state a Mamba slot holds, and the view of the scheduler that the worker
model (which writes states) and the oracle (which only reads them) share.

A state is named by :data:`StateId`: the number of tokens it has seen and a
digest of those tokens. A slot's provenance says how its state was computed
(:data:`CANONICAL`: one B block per chunk from token 0, bit for bit what any
other request computes for the same prefix).
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .engine import SAMPLED_TOKEN, Geometry

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


class SchedulerView:
    """What the worker model and the oracle both read: the scheduler, the
    Mamba group's blocks, the requests' tokens, and the states the worker
    wrote (:attr:`holds`). Set up by the driver (:class:`Simulation`)."""

    geometry: Geometry
    scheduler: Any
    block_pool: Any
    mamba_group: int
    mamba_manager: Any
    state_block: int
    hash_block: int
    steps: int
    records: dict[str, RequestRecord]
    holds: dict[int, StateId]
    """Block id -> the state the worker wrote there."""
    canonical: dict[int, str]
    """Block id -> how its state was computed, through every writer, cache
    hits included: CANONICAL (one B block per chunk from token 0),
    FROM_TAIL (canonically, but continued from vLLM's partial-tail
    checkpoint off the grid), FROM_STORE (likewise, but continued from a
    state a KV connector loaded) or NON_CANONICAL. The worker tags what it
    writes NON_CANONICAL (or FROM_STORE); the oracle's provenance tracking
    refines the tags of prefill chunks' states."""
    checkpoint_now: dict[str, int]
    """Request -> position of the in-chunk checkpoint its backend wrote in
    the last step."""
    scheduler_drops_eagle: bool
    _loaded_at: dict[str, int]
    _offloads_now: dict[str, list[tuple[int, int, int]]]
    _in_flight: collections.deque[tuple[Any, Any]]

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

    def _running_block(self, req_id: str, end: int) -> Any:
        return self._mamba_blocks(req_id)[-(-end // self.state_block) - 1]
