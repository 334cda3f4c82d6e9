"""Lean with one of its stops left out, composed from the split's public
pieces: what the concurrent-load ablation (``measure.LEAN_ABLATION``) runs to
count what each stop buys.

Nothing here reaches a scheduler serving users. Each change is a context
manager that, while open, changes how lean is bound on the schedulers built
inside it (the plugin binds a scheduler's route when the scheduler starts):

- a decision of lean's policy turned off (:func:`policy_changed`: the policy
  the plugin builds per scheduler, ``StopPolicy.for_scheduler``, replaced);
- lean's rule reading a view of vLLM's retention blind to the replay
  boundaries or the junctions (:class:`BlindRetention`, in the scheduler's
  record as ``split.lean`` reads it): lean then runs vLLM's own chunk past
  them;
- lean's rule wrapped so that it runs on past vLLM's stop at the prompt's
  partial tail (:func:`past_tail`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any

from vllm_mamba_align import split
from vllm_mamba_align.policy import StopPolicy
from vllm_mamba_align.protocols import Request
from vllm_mamba_align.releases import chunk_start, in_prefill, prefill_end
from vllm_mamba_align.retention import Retention
from vllm_mamba_align.split import Fix, Route

Change = Callable[[], AbstractContextManager[None]]
"""One change to lean: a context manager factory (:data:`LEAN_ABLATION`)."""


class LeanStop(enum.Enum):
    """The kinds of stop lean adds to, or keeps from, vLLM's own chunk ends."""

    REPLAY = "replay-boundary stops"
    """At the replay boundary (where a re-ask or a longer sibling resumes)."""
    JUNCTION = "junction stops"
    """At a detected shared-prefix junction."""
    TAIL = "tail stops after a kept stop"
    """vLLM's own stop at the prompt's partial tail, in the chunk after a stop
    at a kept boundary (no backend can checkpoint that chunk: the tail's column
    is the boundary's own)."""


@dataclass(frozen=True)
class BlindRetention(Retention):
    """vLLM's retention as lean's rule reads it with the replay boundaries or
    the junctions left out of :meth:`first_kept_after`; every other answer
    (what vLLM keeps, what is kept only as a replay boundary) is vLLM's."""

    blind_replay: bool = False
    blind_junction: bool = False

    @classmethod
    def of(cls, retention: Retention, left_out: LeanStop) -> BlindRetention:
        values = {f.name: getattr(retention, f.name) for f in fields(retention)}
        return cls(
            **values,
            blind_replay=left_out is LeanStop.REPLAY,
            blind_junction=left_out is LeanStop.JUNCTION,
        )

    def first_kept_after(self, request: Request, start: int) -> int | None:
        if self.dense:
            return super().first_kept_after(request, start)
        replay = set(self.replay_boundaries(request))
        candidates = [
            boundary
            for boundary in self.reachable(request)
            if boundary > start
            and not (self.blind_replay if boundary in replay else self.blind_junction)
        ]
        if self.interval:
            candidates.append((start // self.interval + 1) * self.interval)
        return min(candidates, default=None)


def past_tail(lean: Route) -> Route:
    """``lean`` (a plain function of the route: ``split.lean``), run on to the
    prefill end where vLLM's own answer for a chunk from a kept boundary, with
    no kept boundary in reach, stops at the prompt's partial tail."""

    def without_tail_stop(
        fix: Fix,
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> int:
        num_tokens = lean(
            fix,
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )
        if num_new_tokens <= 1:
            return num_tokens
        grid, retention = fix.policy.grid, fix.retention
        start = chunk_start(
            request, num_new_local_computed_tokens, num_external_computed_tokens
        )
        if not in_prefill(fix.policy.prefill, request, start):
            return num_tokens
        kept = retention.first_kept_after(request, start)
        if kept is not None and kept <= start + num_new_tokens:
            return num_tokens  # lean stops at a kept boundary: not vLLM's chunk
        ends_at = prefill_end(request)
        if (
            start % grid == 0
            and retention.keeps(request, start)
            and start + num_tokens < ends_at <= start + num_new_tokens
        ):
            return ends_at - start
        return num_tokens

    return without_tail_stop


@contextmanager
def _lean_replaced(
    lean: Callable[[Route], Route], reads: Callable[[Retention], Retention] | None
) -> Iterator[None]:
    """While open, lean's rule (``split.lean``, which the route looks up on
    each call) is ``lean(shipped)``; with ``reads``, lean's rule reads
    ``reads(retention)`` for the scheduler's retention, and the B-grid route it
    calls (``split.b_grid_route``), with its stops, reads vLLM's as shipped."""
    shipped_lean, shipped_b_grid = split.lean, split.b_grid_route
    changed = lean(shipped_lean)
    views: dict[int, Fix] = {}  # the scheduler's record -> lean's view of it
    records: dict[int, Fix] = {}  # lean's view -> the scheduler's record

    def lean_reading(fix: Fix, *arguments: Any) -> int:
        view = views.get(id(fix))
        if view is None and reads is not None:
            view = views[id(fix)] = replace(fix, retention=reads(fix.retention))
            records[id(view)] = fix
        return changed(view or fix, *arguments)

    def b_grid_route(fix: Fix, *arguments: Any) -> int:
        return shipped_b_grid(records.get(id(fix), fix), *arguments)

    split.lean, split.b_grid_route = lean_reading, b_grid_route  # type: ignore[assignment]
    try:
        yield
    finally:
        split.lean, split.b_grid_route = shipped_lean, shipped_b_grid


def without(stop: LeanStop) -> Change:
    """Lean leaving out its stops of kind ``stop``."""
    if stop is LeanStop.TAIL:
        return lambda: _lean_replaced(past_tail, None)
    return lambda: _lean_replaced(
        lambda shipped: shipped,
        lambda retention: BlindRetention.of(retention, stop),
    )


def policy_changed(change: Callable[[StopPolicy], StopPolicy]) -> Change:
    """Lean schedulers built while open run ``change`` of their shipped policy."""

    @contextmanager
    def changed() -> Iterator[None]:
        shipped = StopPolicy.__dict__["for_scheduler"]

        def for_scheduler(cls: type[StopPolicy], *args: Any, **kwargs: Any) -> Any:
            policy = shipped.__func__(cls, *args, **kwargs)
            if not policy.stock_chunk_ends:
                return policy
            return change(policy)

        StopPolicy.for_scheduler = classmethod(for_scheduler)  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            StopPolicy.for_scheduler = shipped  # type: ignore[method-assign]

    return changed


def keeping_replay_over_checkpoint(policy: StopPolicy) -> StopPolicy:
    """Lean stopping at the replay boundary also where vLLM gives its column
    to the prompt checkpoint (:attr:`StopPolicy.yield_replay_to_checkpoint`
    off): the boundary's state kept as well, as ``kept`` keeps it."""
    return replace(policy, yield_replay_to_checkpoint=False)
