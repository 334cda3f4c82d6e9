"""The driver: a real vLLM scheduler stepped as vLLM's engine core steps it, with
the worker model writing states after every ``schedule()`` and the oracle
judging them (``vllm-mamba-align simulate``, the benchmarks and the tests)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

from ..installed import requests_need_eos_token_id
from .engine import (
    SAMPLED_TOKEN,
    Geometry,
    _init_hashing,
    build_scheduler,
    runner_output,
)
from .oracle import Oracle
from .states import Chunk, RequestRecord
from .worker import Worker


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


class Simulation(Worker, Oracle):
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
        self.records = {}
        self.steps = 0
        self.prefill_now: set[str] = set()
        """The requests whose chunk of the last step was prefill: it computed
        tokens the request already had, other than its last one (its prompt;
        after a preemption also its earlier output), see :meth:`step`."""
        self._in_flight = collections.deque()
        """Async scheduling: scheduled steps whose output is not processed yet."""
        self.scheduler_drops_eagle = bool(
            getattr(self.scheduler, "use_eagle_block_drop", None)
            if hasattr(self.scheduler, "use_eagle_block_drop")  # 0.30.0+
            else getattr(self.scheduler, "use_eagle", False)  # 0.29.0 and older
        )
        """Whether vLLM's scheduler drops EAGLE's last block (and backs its
        last cacheable position off one block)."""
        self._init_worker()
        self._init_oracle()

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

    # -- stepping ---------------------------------------------------------------
    def step(self) -> dict[str, Chunk]:
        """One schedule(), the modeled forward pass, and update_from_output()."""
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
        self._run_block_copies(output)
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
        runner = runner_output(list(chunks), sampled, **extra)
        if self.geometry.async_scheduling:
            # vLLM's engine core with a batch queue of two
            # (EngineCore.step_with_batch_queue, v1/engine/core.py:708-790 in
            # 0.33.0): a new step is queued, and the oldest one's output is
            # processed only once the queue is full or nothing more was scheduled.
            self._in_flight.appendleft((output, runner))
            if len(self._in_flight) < 2 and (chunks or self.scheduler.has_requests()):
                return chunks
            output, runner = self._in_flight.pop()
        self.scheduler.update_from_output(output, runner)
        for req_id in chunks:
            self._name_new_hashes(self.records[req_id].request)
        if self.drafts:
            self._propose_drafts(chunks)
        return chunks

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

    # -- measurements -----------------------------------------------------------
    def chunk_ends(self, req_id: str) -> list[int]:
        return [c.end for c in self.records[req_id].chunks]

    def reused(self, req_id: str) -> int:
        reused = self.records[req_id].reused_tokens
        assert reused is not None, f"{req_id} was never scheduled"
        return reused
