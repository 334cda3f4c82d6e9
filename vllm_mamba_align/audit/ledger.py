"""The step ledger: which proposed prefill chunks a ``schedule()`` really ran.

The split observer notes the prefill chunks vLLM's split proposes (calls of two
or more tokens); a chunk can be proposed and then not scheduled when its blocks
do not fit, so the step's output confirms which ran, and only those are counted
(counting.py). One-token calls (mostly decodes) skip the observer; a one-token
chunk crosses no boundary, but it is a prefill chunk when its request is new or
known to be mid-prefill, and those few are looked up in the output. The notes
of a step are cleared after it: nothing grows with traffic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..releases import PrefillRule, in_prefill
from .counting import Counts

if TYPE_CHECKING:
    from ..protocols import Request, SchedulerOutput


def computes_known_tokens(request: Request, start: int) -> bool:
    """Whether a chunk from ``start`` computes tokens the request already has,
    other than its last one: a prompt, or output replayed after preemption.

    Under async scheduling a request's first decode is scheduled before its
    first output token comes back, so ``num_output_tokens`` is still 0 and the
    0.15.0-0.16.0 bodies (:attr:`PrefillRule.NO_OUTPUT_YET`) call it prefill.
    It computes a token no one knows yet; a boundary it ends on is no prompt
    state, and it is no prefill chunk of the audit's (found by the release
    matrix: a 7-token prompt, B = 8, the first decode ``[7, 8)`` counted as a
    non-canonical kept state). It is the later bodies' own prefill rule, which
    implies it for them.
    """
    return in_prefill(PrefillRule.BEFORE_PREFILL_END, request, start)


class StepLedger:
    """One scheduler's proposed chunks of the current step, matched against
    the step's output."""

    __slots__ = ("counts", "live_requests", "pending", "prefill_rule", "prefilling")

    def __init__(
        self,
        counts: Counts,
        prefill_rule: PrefillRule,
        live_requests: Mapping[str, Request],
    ) -> None:
        self.counts = counts
        self.prefill_rule = prefill_rule
        self.live_requests = live_requests
        """The scheduler's own ``requests`` table."""
        self.pending: dict[str, Request] = {}
        """Prefill chunks the split proposed this step, by request."""
        self.prefilling: dict[str, Request] = {}
        """Requests known to be mid-prefill (their next chunk may be one token)."""

    def note(self, request: Request, start: int) -> None:
        """The split proposed a chunk of two or more tokens from ``start``."""
        if in_prefill(self.prefill_rule, request, start):
            self.pending[request.request_id] = request

    def after_schedule(self, output: SchedulerOutput) -> None:
        """Count the prefill chunks this ``schedule()`` really scheduled."""
        scheduled = output.num_scheduled_tokens
        pending = self.pending
        prefilling = self.prefilling
        for new in output.scheduled_new_reqs:
            request_id = new.req_id
            if request_id not in pending and scheduled.get(request_id) == 1:
                prefilling[request_id] = self.live_requests[request_id]
        for request_id, request in pending.items():
            count = scheduled.get(request_id, 0)
            if count > 0:
                self.count_scheduled(request, count)
        if prefilling:
            for request_id in [r for r in prefilling if r not in pending]:
                count = scheduled.get(request_id, 0)
                if count == 1:
                    self.count_scheduled(prefilling[request_id], 1)
                elif count == 0 and request_id not in self.live_requests:
                    del prefilling[request_id]  # finished or aborted
        pending.clear()

    def count_scheduled(self, request: Request, count: int) -> None:
        """Count a scheduled chunk of ``count`` tokens if it is prefill, and note
        whether prefill goes on after it.

        Both judged by the installed body's rule (:func:`releases.in_prefill`),
        the same predicate the split observer and the fix use, for a chunk
        that computes tokens the request already has
        (:func:`computes_known_tokens`). Between the split
        call and this look at the step's output vLLM changes only
        ``num_computed_tokens``, so the judgement at ``start`` is the body's own.
        """
        end = request.num_computed_tokens  # vLLM advanced it by the scheduled count
        start = end - count
        rule = self.prefill_rule
        if in_prefill(rule, request, start) and computes_known_tokens(request, start):
            self.counts.count_chunk(request, start, end)
            if in_prefill(rule, request, end):
                self.prefilling[request.request_id] = request
                return
        self.prefilling.pop(request.request_id, None)
