"""The witness: which Mamba state each block holds, and whether vLLM's hashes and
reads agree with it, after every step of a real scheduler.

Written from vLLM's align-mode contract alone (it shares no code with the
plugin, and imports nothing of it):

- A step schedules a request's tokens ``[start, end)``. Before the forward
  pass the worker runs the step's queued block copies
  (``SchedulerOutput.kv_cache_block_copies``: copy-on-write of a partially hit
  state). The forward pass reads the state in block-table column
  ``(start - 1) // B`` of the request's Mamba group, which must be the state
  after exactly its first ``start`` tokens, and leaves the state after ``end``
  tokens in column ``ceil(end / B) - 1`` (the running slot). Other columns
  keep what they held.
- A Mamba block carrying a hash names the state after the prefix that hash
  chains over: the ``j``-th of a request's block hashes covers its first
  ``(j + 1) * hash_block`` tokens. It must hold exactly that state once the
  step that published it has run, and after every later step while it
  carries the hash.
- Where a Mamba group's spec declares backend prefill checkpoints, the forward
  pass also leaves ONE more state inside a prefill chunk in that group: the
  state at the checkpoint position, in the column vLLM computes for it, unless
  that column holds the null block (:meth:`Witness.backend_checkpoint`). Each
  group by its own spec (the worker builds the checkpoint metadata per spec:
  ``MambaPrefillCheckpointBuilder``), whatever the scheduler decided.
- With a speculative config (vLLM 0.32.0 to 0.34.0 only), the worker's
  own rule for draft steps replaces the two rules above
  (:meth:`Witness._draft_step`): a running column per request, an
  accepted-token offset into it, the state after every token of a verify
  step in its own column, and a copy after the step to the B boundary the
  accepted tokens reached. The state after a draft token is named by the
  draft tokens, so a rejected draft's state is no prefix of the request.
- Every Mamba block vLLM's prefix cache decides to keep (its block mask, or
  every block where it has none) must be a real block when it is cached: a
  null block there is a boundary state vLLM keeps that no chunk ever wrote.

A state is named by the tokens it has seen: ``(length, digest of the tokens)``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

StateName = tuple[int, bytes]


def state_name(tokens: Sequence[int], length: int) -> StateName:
    """The state after the first ``length`` of ``tokens``."""
    return length, hashlib.sha256(array("q", tokens[:length]).tobytes()).digest()


@dataclass
class Findings:
    """What the witness saw: the counts a report shows, and the first examples."""

    steps: int = 0
    chunks: int = 0
    publications: int = 0
    wrong_publications: int = 0
    reads: int = 0
    wrong_reads: int = 0
    kept_decisions: int = 0
    lost_kept_states: int = 0
    backend_checkpoints: int = 0
    """States the backend wrote inside a prefill chunk (its prefill
    checkpoints), into a real block."""
    backend_checkpoints_on_null: int = 0
    """Checkpoints the backend's rule places in a column holding the null
    block: not written."""
    draft_steps: int = 0
    """Rows of a step that verified draft tokens, mirrored (one per request
    and step, whatever the number of Mamba groups)."""
    drafts_accepted: int = 0
    drafts_rejected: int = 0
    draft_boundary_copies: int = 0
    """Copies after a step of the state at a B boundary that accepted draft
    tokens reached (``mamba_state_copy_boundary`` with a bias > 0)."""
    draft_step_copies: int = 0
    """Rows verifying drafts after which the worker copies a state into a
    boundary's column (any bias; not the no-op of the running column onto
    itself): one per row, whatever the number of Mamba groups."""
    examples: list[str] = field(default_factory=list)

    def note(self, line: str) -> None:
        if len(self.examples) < 8:
            self.examples.append(line)


class Witness:
    """Mirrors the worker's Mamba writes for one scheduler and judges vLLM's
    hashes and reads against them.

    ``tokens_of(request)`` gives a request's tokens as the worker knows them
    (its prompt, then every sampled token, in-flight ones included).
    """

    def __init__(
        self, scheduler: Any, tokens_of: Callable[[Any], Sequence[int]]
    ) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec

        self.scheduler = scheduler
        self.tokens_of = tokens_of
        manager = scheduler.kv_cache_manager
        coordinator = manager.coordinator
        found = [
            (index, single)
            for index, single in enumerate(coordinator.single_type_managers)
            if isinstance(single.kv_cache_spec, MambaSpec)
        ]
        assert found, "no Mamba group"
        self.mambas = dict(found)
        """Group id -> its manager: a model's Mamba layers may fill several
        groups of one spec, each with its own block table and blocks."""
        (self.state_block,) = {m.kv_cache_spec.block_size for _, m in found}
        self.block_pool = manager.block_pool
        self.hash_block: int = int(
            getattr(self.block_pool, "hash_block_size", 0)
            or getattr(scheduler, "hash_block_size", 0)
            or scheduler.cache_config.block_size
        )
        self.checkpoints = _backend_checkpoints(scheduler, found)
        """Group id -> the backend's prefill-checkpoint rule's inputs for that
        group's spec, or None where it declares no checkpoint blocks."""
        self.speculative = _speculative(scheduler)
        """Whether the worker's rule for draft steps is mirrored
        (:meth:`_draft_step`)."""
        self.running_column: dict[str, int] = {}
        """Request -> the worker's running column (``mamba_state_idx``)."""
        self.num_accepted: dict[str, int] = {}
        """Request -> the worker's ``num_accepted_tokens`` (1: no offset)."""
        self.holds: dict[int, StateName] = {}
        """Block id -> the state the worker last wrote there."""
        self.findings = Findings()
        self._judged: set[tuple[int, bytes]] = set()
        """(block, hash) pairs counted as publications."""
        self._wrong: set[tuple[int, bytes]] = set()
        """(block, hash) pairs counted as wrong publications."""
        self._watch_caching()

    # -- what vLLM decides to keep -------------------------------------------
    def _watch_caching(self) -> None:
        """Count every Mamba block vLLM's prefix cache keeps when it caches a
        request's full blocks, and the kept ones that are null (never written).
        Watched at ``BlockPool.cache_full_blocks``, whose arguments say which
        blocks and which of them the retention mask keeps."""
        pool = self.block_pool
        cache_full_blocks = pool.cache_full_blocks
        witness = self

        def watched(*args: Any, **kwargs: Any) -> Any:
            names = (
                "request",
                "blocks",
                "num_cached_blocks",
                "num_full_blocks",
                "block_size",
                "kv_cache_group_id",
                "block_mask",
            )
            bound = dict(zip(names, args, strict=False)) | kwargs
            if bound.get("kv_cache_group_id") in witness.mambas:
                witness._judge_kept(bound)
            return cache_full_blocks(*args, **kwargs)

        pool.cache_full_blocks = watched

    def _judge_kept(self, call: dict[str, Any]) -> None:
        blocks = call["blocks"]
        first, last = call["num_cached_blocks"], call["num_full_blocks"]
        mask = call.get("block_mask")
        request = call["request"]
        for index in range(first, last):
            if mask is not None and not mask[index - first]:
                continue
            self.findings.kept_decisions += 1
            if blocks[index].is_null:
                self.findings.lost_kept_states += 1
                self.findings.note(
                    f"{request.request_id}: vLLM keeps the state after "
                    f"{(index + 1) * self.state_block} tokens, but its slot "
                    "is the null block (no chunk ended there)"
                )

    # -- the worker ---------------------------------------------------------
    def _column(self, mamba: Any, req_id: str, column: int) -> Any:
        blocks = mamba.req_to_blocks.get(req_id, ())
        return blocks[column] if column < len(blocks) else None

    def run_step(
        self,
        output: Any,
        chunks: dict[str, tuple[int, int]],
        accepted: dict[str, int] | None = None,
    ) -> None:
        """The forward pass of one scheduled step: block copies, reads, writes,
        then the hashes vLLM holds on Mamba blocks judged. ``accepted``: how
        many of each request's scheduled draft tokens the step accepts."""
        self.findings.steps += 1
        for copy in getattr(output, "kv_cache_block_copies", None) or ():
            source, target = copy
            if source in self.holds:
                self.holds[target] = self.holds[source]
            else:
                self.holds.pop(target, None)
        requests = self.scheduler.requests
        if self.speculative:
            self._forget_worker_states(output)
            drafts = output.scheduled_spec_decode_tokens
            for req_id, (start, end) in chunks.items():
                self._draft_step(
                    req_id,
                    requests[req_id],
                    start,
                    end,
                    list(drafts.get(req_id, ())),
                    (accepted or {}).get(req_id, 0),
                )
            self._judge_published()
            return
        drafted = getattr(output, "scheduled_spec_decode_tokens", None) or {}
        if any(drafted.get(req_id) for req_id in chunks):
            raise NotImplementedError(
                "the witness does not know how this vLLM's worker moves "
                "speculative Mamba states (DRAFT_RULE_RELEASES), or mirrors them "
                "only without async scheduling"
            )
        for req_id, (start, end) in chunks.items():
            request = requests[req_id]
            tokens = self.tokens_of(request)
            self.findings.chunks += 1
            for group, mamba in self.mambas.items():
                if start > 0:
                    self._judge_read(mamba, req_id, tokens, start)
                self._write_checkpoint(group, mamba, req_id, tokens, start, end)
                column = -(-end // self.state_block) - 1
                running = self._column(mamba, req_id, column)
                assert running is not None and not running.is_null, (
                    f"{req_id}: the running slot of a chunk ending at {end} is missing"
                )
                self.holds[running.block_id] = state_name(tokens, end)
        self._judge_published()

    # -- the worker, with draft tokens --------------------------------------
    def _forget_worker_states(self, output: Any) -> None:
        """The worker drops a request's running column when it finishes or is
        preempted, and seeds it afresh when the request is scheduled as new
        or resumed (0.33.0 ``cleanup_mamba_state_idx``, mamba_utils.py; 0.34.0
        ``MambaHybridModelState.add_request``, gpu/model_states/mamba_hybrid.py)."""
        cached = output.scheduled_cached_reqs
        gone = {
            *output.finished_req_ids,
            *(getattr(output, "preempted_req_ids", None) or ()),
            *(getattr(cached, "resumed_req_ids", None) or ()),
            *(new.req_id for new in output.scheduled_new_reqs),
        }
        for req_id in gone:
            self.running_column.pop(req_id, None)
            self.num_accepted.pop(req_id, None)

    def _draft_step(
        self,
        req_id: str,
        request: Any,
        start: int,
        end: int,
        drafts: list[int],
        accepted: int,
    ) -> None:
        """One request's row of a step under speculative decoding, as vLLM's
        align-mode worker moves its Mamba states (:data:`DRAFT_RULE_RELEASES`;
        0.32.0's vllm/v1/worker/mamba_utils.py is 0.33.0's, byte for byte, so
        the 0.33.0 lines below are 0.32.0's too):

        1. Before the forward pass (0.34.0 ``preprocess_mamba_align_fused_kernel``
           and ``precopy_mamba_align_fused_kernel``, vllm/v1/worker/mamba_utils.py
           :510-558 and :562-646; 0.33.0 ``preprocess_mamba``, mamba_utils.py
           :1446-1549): the running column becomes ``ceil(end / B) - 1`` (end
           counts the drafts; a new or resumed request's previous column is
           ``(start - 1) // B``). If it moved, the state in the previous column
           plus ``num_accepted - 1`` is copied into it and ``num_accepted``
           becomes 1 (temporal states read ``bt[src_col + token_bias]``,
           ``_copy_mamba_state_block``, 0.34.0 mamba_utils.py:344-360).
        2. The forward pass reads the state in the running column plus
           ``num_accepted - 1`` (the kernels' initial-state index); a row
           verifying drafts (one real token, then k drafts) writes the state
           after its i-th token into the running column plus i (the
           ``1 + num_speculative_blocks`` aligned state indices from
           ``(seq_len - 1) // B``, ``get_aligned_state_indices_multi_group_kernel``,
           0.34.0 mamba_utils.py:39-100); any other row its final state into
           the running column.
        3. After sampling (0.34.0 ``postprocess_mamba_fused_kernel`` :364-506
           with ``mamba_state_copy_boundary``, replayssm_utils.py:80-90; 0.33.0
           ``postprocess_mamba_align_gpu`` :1552-1605 and the same kernel
           :369-500): ``num_accepted`` is the sampled count (at least 1); the
           running state holds ``end - k`` tokens, the request now
           ``end - k + num_accepted - 1``. If the last B boundary at or below
           that is at or past the running state's length, the state in the
           running column plus their difference is copied into the boundary's
           column, and ``num_accepted`` becomes 1 if that is the running
           column.
        """
        grid = self.state_block
        tokens = list(self.tokens_of(request))
        real_end = end - len(drafts)
        if drafts and real_end - start != 1:
            raise NotImplementedError(
                f"{req_id}: draft tokens after {real_end - start} real tokens"
            )
        # The tokens this row runs on: a draft's state names the draft tokens.
        seen = [*tokens[:real_end], *drafts]
        previous = self.running_column.get(req_id, (start - 1) // grid)
        num_accepted = self.num_accepted.get(req_id, 1)
        column = -(-end // grid) - 1
        moved = previous >= 0 and previous != column
        if not moved and real_end - start > 1 and num_accepted != 1:
            raise NotImplementedError(f"{req_id}: a prefill row read at an offset")
        boundary = post_step_copy(real_end, real_end + accepted, grid)
        for mamba in self.mambas.values():
            if moved:
                self._copy(mamba, req_id, previous + num_accepted - 1, column)
            offset = 0 if moved else num_accepted - 1
            if start > 0:
                self._judge_read(mamba, req_id, tokens, start, column=column + offset)
            running = self._column(mamba, req_id, column)
            assert running is not None and not running.is_null, (
                f"{req_id}: the running slot of a chunk ending at {end} is missing"
            )
            if drafts:
                for i in range(end - start):
                    block = self._column(mamba, req_id, column + i)
                    if block is not None and not block.is_null:
                        self.holds[block.block_id] = state_name(seen, start + 1 + i)
            else:
                self.holds[running.block_id] = state_name(tokens, end)
            if boundary is not None:
                bias, target = boundary
                if not (target == column and bias == 0):
                    self._copy(mamba, req_id, column + bias, target)
        self.findings.chunks += 1
        if drafts:
            self.findings.draft_steps += 1
            self.findings.drafts_accepted += accepted
            self.findings.drafts_rejected += len(drafts) - accepted
        num_accepted = accepted + 1
        if boundary is not None:
            bias, target = boundary
            self.findings.draft_boundary_copies += bias > 0
            if drafts and not (target == column and bias == 0):
                self.findings.draft_step_copies += 1
            if target == column:
                num_accepted = 1
        self.running_column[req_id] = column
        self.num_accepted[req_id] = num_accepted

    def _copy(self, mamba: Any, req_id: str, source: int, target: int) -> None:
        """The worker's copy of a state between two columns of a request's
        Mamba table: from a null or missing block it copies no named state;
        into one it writes nothing anyone reads."""
        into = self._column(mamba, req_id, target)
        if into is None or into.is_null:
            return
        out = self._column(mamba, req_id, source)
        held = None if out is None or out.is_null else self.holds.get(out.block_id)
        if held is None:
            self.holds.pop(into.block_id, None)
        else:
            self.holds[into.block_id] = held

    def backend_checkpoint(
        self, start: int, end: int, group: int | None = None
    ) -> tuple[int, int] | None:
        """Where the backend writes its prefill checkpoint in a chunk
        ``[start, end)`` of a Mamba group (None: the first): (the position
        whose state it writes, the block-table column it writes it into), or
        None for a chunk it writes none in.

        The rule of vLLM's ``compute_mamba_prefill_checkpoints``
        (vllm/model_executor/layers/mamba/checkpoint.py, with
        ``get_mamba_prefill_checkpoint_position`` and
        ``is_mamba_prefill_checkpoint_valid`` of vllm/v1/kv_cache_interface.py),
        as vLLM 0.34.0 has it (0.32.0 and 0.33.0 the same without a drafter),
        for an engine without speculative decoding (no EAGLE block drop, no
        hash lookahead): the position is the last multiple of the cache-hit
        alignment short of the chunk's end; the chunk must start on the hash
        block, lie at least one hash block before the position, hold the
        position strictly inside it at a multiple of the checkpoint alignment
        from its start, and have the position's column ``ceil(end / B) - 2``
        after the column it reads (``(start - 1) // B``). The worker applies
        it to every row, prefill or not, whatever the scheduler decided, and
        with each group's own checkpoint alignment."""
        rule = self.checkpoints[next(iter(self.mambas)) if group is None else group]
        if rule is None:
            return None
        hash_block, unit, alignment = rule
        position = max((end - 1) // unit * unit, 0)
        column = -(-end // self.state_block) - 2
        if (
            start % hash_block == 0
            and column > (start - 1) // self.state_block
            and start + hash_block <= position
            and start < position < end
            and (position - start) % alignment == 0
        ):
            return position, column
        return None

    def _write_checkpoint(
        self,
        group: int,
        mamba: Any,
        req_id: str,
        tokens: Sequence[int],
        start: int,
        end: int,
    ) -> None:
        """The backend's prefill checkpoint of one chunk in one Mamba group,
        if it writes one: skipped where its column holds the null block, as
        the backend's store skips ``NULL_BLOCK_ID``."""
        checkpoint = self.backend_checkpoint(start, end, group)
        if checkpoint is None:
            return
        position, column = checkpoint
        block = self._column(mamba, req_id, column)
        if block is None or block.is_null:
            self.findings.backend_checkpoints_on_null += 1
            return
        self.findings.backend_checkpoints += 1
        self.holds[block.block_id] = state_name(tokens, position)

    def _judge_read(
        self,
        mamba: Any,
        req_id: str,
        tokens: Sequence[int],
        start: int,
        column: int | None = None,
    ) -> None:
        """The state a chunk from ``start`` reads: in column ``column``, by
        default the one where the previous chunk left it."""
        self.findings.reads += 1
        if column is None:
            column = (start - 1) // self.state_block
        block = self._column(mamba, req_id, column)
        held = (
            None if block is None or block.is_null else self.holds.get(block.block_id)
        )
        if held != state_name(tokens, start):
            self.findings.wrong_reads += 1
            what = "nothing" if held is None else f"the state after {held[0]} tokens"
            self.findings.note(
                f"{req_id}: a chunk from {start} reads {what} "
                f"(wants the state after {start} of its own tokens)"
            )

    def _judge_published(self) -> None:
        """Every hashed Mamba block of a live request holds the state its hash
        names, re-checked after every step: a block right when published and
        overwritten later (a running slot written on after its hash was set,
        a copy's target) is as wrong as one published wrong. Each
        (block, hash) counts once as a publication and at most once as a
        wrong one.

        Live requests' tables cover every block the worker can still write:
        the mirror writes only running slots, backend checkpoints' columns
        and copy targets, all in a live request's table, and a block that
        leaves every table keeps its state until it is reallocated, which
        drops its hash (:meth:`forget_evicted`)."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        for request, group, blocks in self._mamba_tables():
            lengths = self._hash_lengths(request)
            tokens = self.tokens_of(request)
            for block in blocks:
                key = block.block_hash
                if block.is_null or key is None or get_group_id(key) != group:
                    continue
                digest = bytes(get_block_hash(key))
                judged = (block.block_id, digest)
                if judged not in self._judged:
                    self._judged.add(judged)
                    self.findings.publications += 1
                if judged in self._wrong:
                    continue
                length = lengths.get(digest)
                if length is None:
                    # In the request's own table, yet no prefix of its tokens.
                    self._wrong.add(judged)
                    self.findings.wrong_publications += 1
                    self.findings.note(
                        f"{request.request_id}: block {block.block_id} carries a "
                        "hash of no prefix of the request's tokens"
                    )
                    continue
                held = self.holds.get(block.block_id)
                if held != state_name(tokens, length):
                    self._wrong.add(judged)
                    self.findings.wrong_publications += 1
                    what = "nothing" if held is None else f"state@{held[0]}"
                    self.findings.note(
                        f"{request.request_id}: block {block.block_id} hashed as "
                        f"the state after {length} tokens holds {what} "
                        f"(step {self.findings.steps})"
                    )

    def _mamba_tables(self) -> list[tuple[Any, int, Sequence[Any]]]:
        """(request, group id, its blocks in that group) for live requests."""
        tables = []
        for request in self.scheduler.requests.values():
            for group, mamba in self.mambas.items():
                blocks = mamba.req_to_blocks.get(request.request_id, ())
                if blocks:
                    tables.append((request, group, blocks))
        return tables

    def _hash_lengths(self, request: Any) -> dict[bytes, int]:
        """Hash -> the prefix length it names, for a request's prefixes at
        every hash block: vLLM hashes a Mamba block as the chained hash of its
        last hash block (0.26.0+), or as the concatenation of its hash blocks'
        hashes (before, where the group's block is a multiple of the hash
        block): both forms are named."""
        step = self.hash_block
        per_block = max(self.state_block // step, 1)
        hashes = [bytes(h) for h in request.block_hashes]
        lengths: dict[bytes, int] = {}
        for j, digest in enumerate(hashes):
            lengths[digest] = (j + 1) * step
            first = j // per_block * per_block
            lengths[b"".join(hashes[first : j + 1])] = (j + 1) * step
        return lengths

    def forget_evicted(self) -> None:
        """A block whose hash vLLM dropped (evicted and reused) counts again
        when it is next published."""
        blocks = self.block_pool.blocks
        self._judged = {
            pair for pair in self._judged if blocks[pair[0]].block_hash is not None
        }
        self._wrong = {
            pair for pair in self._wrong if blocks[pair[0]].block_hash is not None
        }


def post_step_copy(running: int, computed: int, grid: int) -> tuple[int, int] | None:
    """After a step, the copy vLLM's worker makes when accepted tokens reach
    a B boundary (0.34.0 ``mamba_state_copy_boundary``,
    vllm/v1/worker/replayssm_utils.py:80-90; 0.33.0 inline in
    ``postprocess_mamba_fused_kernel``, vllm/v1/worker/mamba_utils.py:458-467):
    with the running state after ``running`` tokens and the request at
    ``computed``, (the offset from the running column of the state to copy,
    the column to copy it into), or None for no copy."""
    aligned = computed // grid * grid
    if aligned < running:
        return None
    return aligned - running, aligned // grid - 1


DRAFT_RULE_RELEASES = ((0, 32), (0, 33), (0, 34))
"""The vLLM releases whose align-mode worker rule for speculative Mamba states
:meth:`Witness._draft_step` follows, read from each release's wheel. Others
are refused (:func:`_speculative`).

0.32.0 (the e2e tests' served vLLM) has 0.33.0's rule: its
vllm/v1/worker/mamba_utils.py is identical to 0.33.0's (``preprocess_mamba``
:1446-1549, ``postprocess_mamba_align_gpu`` :1552-1605,
``postprocess_mamba_fused_kernel`` :369-500, ``cleanup_mamba_state_idx``
:1398-1413 in both), the model runner calls them at the same points
(``GPUModelRunner._update_states_after_model_execute``, gpu_model_runner.py
:1544-1590), and the forward pass's state columns come from the same gather
(``mamba_get_block_table_tensor``, vllm/v1/attention/backends/utils.py
:1163-1195: ``(seq_len - 1) // B`` plus ``0 .. num_speculative_blocks``;
0.33.0 computes it in a Triton kernel on GPUs, the same expression on CPUs)."""


def mirrors_draft_steps() -> bool:
    """Whether the judge knows how the installed vLLM's worker moves Mamba
    states under speculative decoding (:data:`DRAFT_RULE_RELEASES`)."""
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__).release[:2] in DRAFT_RULE_RELEASES


def _speculative(scheduler: Any) -> bool:
    """Whether the judge mirrors the worker's rule for draft steps here: a
    speculative config on a release whose rule it follows, without async
    scheduling. Elsewhere a step that verifies draft tokens is refused
    (:meth:`Witness.run_step`); steps without any are the same under either
    rule (no accepted-token offset, no copy after the step)."""
    return (
        scheduler.vllm_config.speculative_config is not None
        and mirrors_draft_steps()
        and not getattr(
            scheduler.vllm_config.scheduler_config, "async_scheduling", False
        )
    )


CHECKPOINT_RULE_RELEASES = ((0, 32), (0, 33), (0, 34))
"""The vLLM releases whose backend prefill-checkpoint rule
:meth:`Witness.backend_checkpoint` follows, read from each release's wheel.
Others (0.29.0-0.31.0 declare checkpoint blocks under other rules; a newer
release may change it) are not judged with checkpoints."""


def mirrors_backend_checkpoints() -> bool:
    """Whether the judge knows where the installed vLLM's backends write their
    prefill checkpoints (:data:`CHECKPOINT_RULE_RELEASES`)."""
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__).release[:2] in CHECKPOINT_RULE_RELEASES


def _backend_checkpoints(
    scheduler: Any, mambas: Sequence[tuple[int, Any]]
) -> dict[int, tuple[int, int, int] | None]:
    """Group id -> (hash block, cache-hit alignment, checkpoint alignment) as
    the worker reads them for that Mamba group's spec when it declares prefill
    checkpoint blocks; None where it declares none, or where the worker takes
    none (an alignment or block size left unresolved). Each group's own
    alignment: vLLM's scheduler decides with the first group's (a TODO in
    scheduler.py:445-454 of 0.34.0), its worker writes by each spec's."""
    specs = {group: manager.kv_cache_spec for group, manager in mambas}
    rules: dict[int, tuple[int, int, int] | None] = dict.fromkeys(specs)
    if not any(
        getattr(spec, "num_prefill_checkpoint_blocks", 0) for spec in specs.values()
    ):
        return rules
    if not mirrors_backend_checkpoints():
        raise NotImplementedError(
            "the witness does not know this vLLM's backend checkpoint rule"
        )
    if scheduler.vllm_config.speculative_config is not None:
        raise NotImplementedError(
            "the witness mirrors backend checkpoints without speculative decoding"
        )
    kv = scheduler.kv_cache_config
    hash_block = getattr(kv, "hash_block_size", None)
    unit = getattr(kv, "cache_hit_alignment_tokens", None)
    if hash_block is None or unit is None:
        return rules
    for group, spec in specs.items():
        alignment = spec.prefill_checkpoint_alignment
        if spec.num_prefill_checkpoint_blocks and alignment is not None:
            rules[group] = int(hash_block), int(unit), int(alignment)
    return rules
