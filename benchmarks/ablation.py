"""Lean with one of its stops left out, composed from the split's public
pieces: what the concurrent-load ablation (``measure.LEAN_ABLATION``) runs to
count what each stop buys.

Nothing here reaches a scheduler serving users. Each change is a context
manager that, while open, changes how lean is bound on the schedulers built
inside it (the plugin binds a scheduler's route when the scheduler starts):

- a decision of lean's policy turned off (:func:`policy_changed`: the policy
  the plugin builds per scheduler, ``StopPolicy.for_scheduler``, replaced);
- lean's rule reading a view of vLLM's retention blind to the replay
  boundaries or the junctions (:class:`BlindRetention`, passed to
  ``split.lean_route``): lean then runs vLLM's own chunk past them;
- lean's route wrapped so that it runs on past vLLM's stop at the prompt's
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
from vllm_mamba_align.signature import Route

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


def past_tail(lean: Route, policy: StopPolicy, retention: Retention) -> Route:
    """``lean``, run on to the prefill end where vLLM's own answer for a chunk
    from a kept boundary, with no kept boundary in reach, stops at the
    prompt's partial tail."""
    grid, prefill_rule = policy.grid, policy.prefill

    def without_tail_stop(
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        num_tokens = lean(
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )
        if num_new_tokens <= 1:
            return num_tokens
        start = chunk_start(
            request, num_new_local_computed_tokens, num_external_computed_tokens
        )
        if not in_prefill(prefill_rule, request, start):
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
def _lean_route_composed(
    compose: Callable[[Callable[..., Route], tuple[Any, ...]], Route],
) -> Iterator[None]:
    """``split.lean_route`` replaced while open: ``compose(shipped, arguments)``
    builds each lean scheduler's route."""
    shipped = split.lean_route

    def lean_route(*arguments: Any) -> Route:
        return compose(shipped, arguments)

    split.lean_route = lean_route
    try:
        yield
    finally:
        split.lean_route = shipped


def without(stop: LeanStop) -> Change:
    """Lean leaving out its stops of kind ``stop``."""

    def blind(shipped: Callable[..., Route], arguments: tuple[Any, ...]) -> Route:
        scheduler, call, policy, retention, kept, checkpoint_at = arguments
        view = BlindRetention.of(retention, stop)
        return shipped(scheduler, call, policy, view, kept, checkpoint_at)

    def tail(shipped: Callable[..., Route], arguments: tuple[Any, ...]) -> Route:
        _, _, policy, retention, _, _ = arguments
        return past_tail(shipped(*arguments), policy, retention)

    return lambda: _lean_route_composed(tail if stop is LeanStop.TAIL else blind)


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
