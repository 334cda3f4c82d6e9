"""The oracle: it reads the states the worker model wrote and judges them by
what vLLM does, never by the plugin's predictions.

- Every Mamba block vLLM publishes under the hash of prefix ``[0, L)`` must hold
  the state after exactly those ``L`` tokens (:attr:`Oracle.poisoned`).
- A request that reuses a cached state must read the state of its own prefix
  (:attr:`Oracle.wrong_reuse`).
- Every boundary state vLLM keeps, by the keep-or-drop decision its Mamba
  manager takes on each slot when it caches a request's blocks (watched at
  ``BlockPool.cache_full_blocks``), must be materialized where a prefill chunk
  reached it (:attr:`Oracle.missing_kept`), and how it was computed is tracked
  (:attr:`Oracle.noncanonical_kept`). A slot vLLM freed itself after a chunk
  wrote it, before caching it, is vLLM's drop, not the split's
  (:attr:`Oracle.dropped_by_vllm`).
- A boundary state handed to a KV connector to save must be the one its block
  holds (:attr:`Oracle.wrong_offloads`).

Which chunk is prefill comes from the workload: one that computes tokens the
request already has, other than its last one.
"""

from __future__ import annotations

import hashlib
import inspect
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .engine import cacheable_boundaries
from .states import (
    CANONICAL,
    FROM_STORE,
    FROM_TAIL,
    NON_CANONICAL,
    Chunk,
    SchedulerView,
    StateId,
    prefix_state_ids,
    state_id,
)


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


class Oracle(SchedulerView):
    """The verdicts of one simulation."""

    def _init_oracle(self) -> None:
        self.hash_names: dict[bytes, StateId] = {}
        self.poisoned: dict[tuple[int, bytes], Poisoned] = {}
        self.published: set[tuple[int, bytes]] = set()
        """Every (block, hash) the Mamba group published while we watched."""
        self.published_states: set[StateId] = set()
        """Every state a published Mamba hash named while we watched (held or
        not: :attr:`poisoned` says which were wrong)."""
        self.wrong_reuse: list[str] = []
        self.same_step_reuse: list[str] = []
        """Hits on a state written in the same step: vLLM's own, not the grid's."""
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
        self.dropped_by_vllm: list[str] = []
        """Boundaries a prefill chunk wrote into their own slot (it ended there,
        or the backend's checkpoint wrote it), whose slot vLLM freed before it
        cached the request's blocks (its keep decision then finds the null
        block): vLLM's own drop, after the split did its part (seen on 0.33.0
        with MTP: an 8-token prompt, C = 16, B = 8, cached only once decoding
        reached 16; on 0.30.0 for a flashkda checkpoint at 16 in a chunk 0-17,
        C = 32)."""
        self.noncanonical_dropped = 0
        """... of which the writer's own chunks were not one B block each (the
        audit counts them as non-canonical kept states when it sees the chunk)."""
        self._written: set[tuple[str, int]] = set()
        """(request, boundary) whose state a prefill chunk wrote into the
        boundary's own slot: the chunk ended there, or the backend's in-chunk
        checkpoint wrote it."""
        self.store_resumed_kept: list[str] = []
        """Kept states computed from a connector-loaded state (its provenance
        is the store's, not this instance's)."""
        self.wrong_offloads: list[str] = []
        """Boundary states vLLM handed the KV connector to save (0.29.0+'s
        ``boundary_state_offloads``) whose block held another state: a store
        would spread them to every instance that loads that prefix."""
        self.offloads = 0
        """Boundary states handed to the connector to save."""
        self._hash_streams: dict[str, tuple[int, Any]] = {}
        """Request -> (hashes named so far, running digest of their tokens)."""
        self._watch_publications()

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
                self._written.add((req_id, boundary))
            elif boundary == checkpoint:
                reached[boundary] = own_checkpoint
                self._written.add((req_id, boundary))
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
            if block.is_null and (req_id, boundary) in self._written:
                self.dropped_by_vllm.append(f"{req_id}: {boundary}")
                self.noncanonical_dropped += not own
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
    def skipped_never_cached(self) -> list[str]:
        """Boundaries a prefill chunk crossed without writing, on which vLLM has
        taken no keep-or-drop decision (yet).

        vLLM caches a request's Mamba slots only up to the prefix a later hit
        could match (0.33.0 rounds it down to the scheduler block, the LCM of
        the groups' blocks), so a request that finishes before that prefix
        reaches a boundary never publishes it. The audit counts such a boundary
        when the split skips it, before vLLM could decide; it is no lost state.
        """
        return self._never_cached(lambda own: own is None)

    @property
    def noncanonical_never_cached(self) -> list[str]:
        """Likewise, boundaries a prefill chunk wrote not one B block per chunk
        (what the audit counts as non-canonical) that vLLM never cached."""
        return self._never_cached(lambda own: own is False)

    def _never_cached(self, how: Callable[[bool | None], bool]) -> list[str]:
        decided = {(d.req_id, d.boundary) for d in self.keep_decisions}
        return [
            f"{req_id}: {boundary}"
            for req_id, reached in self._reached.items()
            for boundary, own in reached.items()
            if how(own) and (req_id, boundary) not in decided
        ]

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
            # The helper of releases with lookahead block hashes
            # (releases.LOOKAHEAD_HASHES).
            options["num_hash_lookahead_tokens"] = getattr(
                self.scheduler, "num_hash_lookahead_tokens", 0
            )
        tail: int = position_of(
            prompt_end, self.hash_block, self.scheduler_drops_eagle, **options
        )
        return tail

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
        few dozen, rather than a scan of all blocks each step.

        Up to 0.33.0 the map's ``_cache`` holds a block, or a dict of blocks by
        id for a key several blocks carry; 0.34.0 holds block ids: one id per
        key in ``_cache``, every id of a key several blocks carry in
        ``_dup_ids``."""
        table = self.block_pool.cached_block_hash_to_block
        cache = getattr(table, "_cache", None)
        if cache is None:
            yield from self.block_pool.blocks
            return
        blocks = self.block_pool.blocks
        seen: set[int] = set()
        entries = [*cache.values(), *getattr(table, "_dup_ids", {}).values()]
        for entry in entries:
            if isinstance(entry, int):
                members: Iterable[Any] = (blocks[entry],)
            elif isinstance(entry, dict):
                members = (
                    blocks[key] if isinstance(key, int) and value is None else value
                    for key, value in entry.items()
                )
            else:
                members = (entry,)
            for block in members:
                if block.block_id not in seen:
                    seen.add(block.block_id)
                    yield block

    def _check_published_hashes(self) -> None:
        for block, key, claimed in self.published_mamba_blocks():
            self.published.add((block.block_id, key))
            self.published_states.add(claimed)
            held = self.holds.get(block.block_id)
            if held != claimed:
                wrong = Poisoned(block.block_id, claimed, held)
                self.poisoned.setdefault((block.block_id, key), wrong)

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
