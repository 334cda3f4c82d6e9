"""The audit's arithmetic: what one scheduled prefill chunk does to the state grid.

Pure counting from chunk positions: no clock, no thread, no vLLM. For a chunk
``[start, end)`` of a request, on the Mamba state grid B:

- **would-be-poisoned slot**: the chunk starts off the grid and runs past the
  next boundary ``nb``. The request's running slot holds the state after
  ``start`` tokens; vLLM allocates a new running slot for the chunk's end and
  publishes the old one under the hash of ``[0, nb)``, a state it does not
  hold, when its state retention keeps ``nb``. A chunk that ends exactly on
  ``nb`` is fine: the same slot receives the state at ``nb``.
- **skipped state boundaries**: the other boundaries strictly inside the chunk
  that vLLM's retention keeps (except the one a GPU backend with prefill
  checkpoint blocks writes into its own slot inside the chunk). The allocator
  gives such slots the null block, so those states never exist. Counted when
  the chunk is scheduled, before vLLM caches the request's blocks: a request
  that finishes before the cached prefix reaches the boundary never publishes
  it, nor does vLLM when it frees the slot before caching reaches it (the
  counts are then an upper bound; the test suite's oracle holds both).
- **non-canonical kept state**: a kept state computed by another chunk sequence
  than one B block per chunk from the request's start.

Per-request facts ride on vLLM's ``Request`` (two small attributes that die
with it); nothing here grows with traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..protocols import Request
from ..retention import Retention

# Per-request bits, on vLLM's Request object (dies with the request).
REQUEST_FLAGS = "_vllm_mamba_align_audit_flags"
# (end of the request's last prefill chunk, whether its chunks were canonical).
REQUEST_CHAIN = "_vllm_mamba_align_audit_chain"
_SEEN = 1
_AFFECTED = 2
_POISONING = 4

BackendWrite = Callable[[Request, int, int], int]
"""(request, chunk start, chunk end) -> the boundary the backend writes into
its own slot inside the chunk (0: none); audit.slots.own_slot_write."""


def format_duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h12m``: short and unambiguous in a log line."""
    total = int(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


@dataclass(frozen=True)
class AuditSnapshot:
    """The figures of one scheduler's audit at one moment."""

    state_block: int
    """B: the Mamba state grid (``MambaSpec.block_size``)."""
    cache_block: int
    """C: the grid stock vLLM ends chunks on (``cache_config.block_size``)."""
    prefill_chunks: int
    prefill_tokens: int
    poisoned_slots: int
    """Slots vLLM publishes under the hash of a boundary whose state they do not
    hold: each one serves a wrong state to every request that hits it."""
    skipped_boundaries: int
    """Kept B boundaries crossed inside a chunk: their state is never materialized."""
    noncanonical_states: int
    """Kept states computed by other chunks than one B block per chunk."""
    requests: int
    """Requests with at least one prefill chunk scheduled."""
    requests_affected: int
    """Requests with a would-be-poisoned slot or a skipped boundary."""
    requests_poisoning: int
    """Requests with a would-be-poisoned slot."""
    elapsed_seconds: float

    def summary(self) -> str:
        """The one-line summary the audit logs."""
        return (
            f"vllm-mamba-align audit (B={self.state_block}, C={self.cache_block}): "
            f"{self.prefill_chunks:,} prefill chunks, "
            f"{self.poisoned_slots:,} would-be-poisoned slots, "
            f"{self.skipped_boundaries:,} skipped state boundaries, "
            f"{self.noncanonical_states:,} non-canonical kept states, "
            f"{self.requests_affected:,} of {self.requests:,} requests affected "
            f"({self.requests_poisoning:,} poisoning), "
            f"{self.prefill_tokens:,} prefill tokens scheduled in "
            f"{format_duration(self.elapsed_seconds)}"
        )


class Counts:
    """One scheduler's audit figures, counted from scheduled prefill chunks."""

    __slots__ = (
        "backend_checkpoint",
        "cache_block",
        "noncanonical_states",
        "poisoned_slots",
        "prefill_chunks",
        "prefill_tokens",
        "requests",
        "requests_affected",
        "requests_poisoning",
        "retention",
        "skipped_boundaries",
        "state_block",
    )

    def __init__(
        self,
        state_block: int,
        cache_block: int,
        retention: Retention | None = None,
        backend_checkpoint: BackendWrite | None = None,
    ) -> None:
        self.state_block = state_block
        self.cache_block = cache_block
        self.retention = retention or Retention(None, state_block, state_block, "dense")
        self.backend_checkpoint = backend_checkpoint
        """The B boundary inside a request's chunk ``(start, end)`` whose state
        the GPU backend writes into that boundary's own slot (0: none), where
        the Mamba spec reserves checkpoint blocks
        (:func:`audit.slots.own_slot_write`); None: no in-chunk state is
        counted as written (upper bounds)."""
        self.prefill_chunks = 0
        self.prefill_tokens = 0
        self.poisoned_slots = 0
        self.skipped_boundaries = 0
        self.noncanonical_states = 0
        self.requests = 0
        self.requests_affected = 0
        self.requests_poisoning = 0

    def count_chunk(self, request: Request, start: int, end: int) -> None:
        """Classify one scheduled prefill chunk ``[start, end)``."""
        grid = self.state_block
        self.prefill_chunks += 1
        self.prefill_tokens += end - start
        flags = getattr(request, REQUEST_FLAGS, 0)
        new_flags = flags | _SEEN
        # Boundaries k * B with start < k * B < end, and which of them vLLM keeps.
        if (end - 1) // grid - start // grid > 0:
            kept, poisoned = self._crossed(request, start, end)
            self.poisoned_slots += poisoned
            self.skipped_boundaries += kept - poisoned
            if kept:
                new_flags |= _AFFECTED | (_POISONING if poisoned else 0)
        self._count_canonical(request, start, end)
        if new_flags != flags:
            setattr(request, REQUEST_FLAGS, new_flags)
            gained = new_flags & ~flags
            self.requests += gained & _SEEN
            self.requests_affected += (gained & _AFFECTED) >> 1
            self.requests_poisoning += (gained & _POISONING) >> 2

    def _crossed(self, request: Request, start: int, end: int) -> tuple[int, int]:
        """(kept boundaries inside the chunk, whether the first is poisoned)."""
        grid, retention = self.state_block, self.retention
        kept = retention.count_kept_between(request, start, end)
        first = (start // grid + 1) * grid
        poisoned = 1 if start % grid and retention.keeps(request, first) else 0
        backend = self.backend_checkpoint
        written = backend(request, start, end) if backend is not None else 0
        if written and retention.keeps(request, written):
            # The backend writes that boundary's state into its own slot:
            # neither skipped nor (the start's block, when it is that slot)
            # poisoned.
            kept -= 1
            if written == first:
                poisoned = 0
        return kept, poisoned

    def _count_canonical(self, request: Request, start: int, end: int) -> None:
        """Canonical: one B block per chunk, from a start on the grid."""
        grid = self.state_block
        chain: tuple[int, bool] | None = getattr(request, REQUEST_CHAIN, None)
        continues = chain is not None and chain[0] == start
        canonical = (chain[1] if chain and continues else start % grid == 0) and (
            start % grid == 0 and end - start == grid
        )
        setattr(request, REQUEST_CHAIN, (end, canonical))
        if not canonical and end % grid == 0 and self.retention.keeps(request, end):
            self.noncanonical_states += 1

    def snapshot(self, elapsed_seconds: float) -> AuditSnapshot:
        return AuditSnapshot(
            state_block=self.state_block,
            cache_block=self.cache_block,
            prefill_chunks=self.prefill_chunks,
            prefill_tokens=self.prefill_tokens,
            poisoned_slots=self.poisoned_slots,
            skipped_boundaries=self.skipped_boundaries,
            noncanonical_states=self.noncanonical_states,
            requests=self.requests,
            requests_affected=self.requests_affected,
            requests_poisoning=self.requests_poisoning,
            elapsed_seconds=elapsed_seconds,
        )
