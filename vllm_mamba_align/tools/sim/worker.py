"""The worker model: which Mamba states vLLM's align-mode GPU worker writes where.

After a step that ends at token ``e``, the request's running slot (block-table
column ``ceil(e / B) - 1`` of the Mamba group) holds the state after exactly
``e`` tokens; other slots keep what they held. Besides: the step's queued block
copies, a backend's in-chunk prefill checkpoint (0.29.0+), a verify step's
draft states (speculative decoding) and a KV connector's loads. The worker
writes :attr:`SchedulerView.holds`; it judges nothing (that is the oracle's).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence
from typing import Any

from ...checkpoints import flashkda_position
from .engine import SAMPLED_TOKEN
from .states import FROM_STORE, NON_CANONICAL, Chunk, SchedulerView, state_id


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


class Worker(SchedulerView):
    """The modeled worker of one simulation."""

    def _init_worker(self) -> None:
        self.holds = {}
        self.canonical = {}
        self.checkpoint_now = {}
        self.checkpoint_writes = 0
        """In-chunk checkpoint states the backend wrote."""
        self._checkpoint_rule = self._backend_checkpoint_rule()
        self.store_loads: list[tuple[str, int]] = []
        """(request, hit end) for every state a KV connector loaded."""
        self._pending_loads: set[str] = set()
        self._loaded_at = {}
        self._offloads_now = {}
        self._watch_connector()
        self.drafts = self.geometry.speculative[1] if self.geometry.speculative else 0
        """Tokens the drafter proposes per decode step (0: none)."""
        self.accepted_drafts = 0
        self.rejected_drafts = 0

    def _run_block_copies(self, output: Any) -> None:
        """The step's queued block copies (copy-on-write of partially hit or
        moved Mamba states), run before the forward pass."""
        for copy_op in getattr(output, "kv_cache_block_copies", None) or ():
            held = self.holds.get(copy_op.src_block_id)
            if held is None:
                self.holds.pop(copy_op.dst_block_id, None)
            else:
                self.holds[copy_op.dst_block_id] = held
            self.canonical[copy_op.dst_block_id] = self.canonical.get(
                copy_op.src_block_id, NON_CANONICAL
            )

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

    def _accepted(self, req_id: str, request: Any, drafts: Sequence[int]) -> int:
        """How many leading drafts the target model accepts: deterministic
        pseudo-random, never a placeholder (-1, vLLM's padding of a decode
        step to 1 + k rows), never beyond max_tokens."""
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
