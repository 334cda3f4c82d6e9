"""Short runs of a real scheduler judged by the witness (tests/witness), for
tests that want the chunks a mode schedules next to the witness's verdict.

The scheduler is the witness's own (``witness.engine.build_scheduler``: vLLM's
``VllmConfig``, ``Scheduler``, ``KVCacheManager`` and ``Request``); the mode is
picked as everywhere in the suite (``helpers.scheduler_mode``). Requests run
one after another, each to its end, so a later one reads what an earlier one
cached. ``prepare`` may change the built scheduler before the first request
(e.g. give it a multimodal model's encoder budget) and ``request_of`` may
replace the request the run adds (e.g. one with encoder inputs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from helpers import scheduler_mode

SAMPLED = 7
"""The token the modelled runner samples (the witness's workloads' own)."""


@dataclass
class Run:
    """What one mode did with a list of requests."""

    chunks: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Request -> every chunk ``[start, end)`` it was scheduled, in order."""
    hits: dict[str, int] = field(default_factory=dict)
    """Request -> the tokens it found cached when admitted."""
    unfinished: list[str] = field(default_factory=list)
    """Requests that did not generate all their tokens."""
    findings: Any = None
    """The witness's :class:`witness.judge.Findings`."""

    def sound(self, materialized: bool) -> list[str]:
        """The invariant's breaches: wrong publications or reads, an
        unfinished request, and (``materialized``) a state vLLM keeps that no
        chunk wrote."""
        f = self.findings
        problems = [*(f"unfinished: {r}" for r in self.unfinished)]
        if f.wrong_publications or f.wrong_reads:
            problems.append(
                f"{f.wrong_publications} wrong publications, "
                f"{f.wrong_reads} wrong reads"
            )
        if materialized and f.lost_kept_states:
            problems.append(f"{f.lost_kept_states} kept states never written")
        return problems + (list(f.examples) if problems else [])


def tokens_of(request: Any) -> list[int]:
    return list(request.all_token_ids)


def run(
    mode: str,
    shape: Any,
    requests: Sequence[tuple[str, list[int]]],
    max_tokens: int = 2,
    prepare: Callable[[Any], None] | None = None,
    request_of: Callable[[Any, str, list[int]], Any] | None = None,
) -> Run:
    """``requests`` (name, prompt) one after another on a fresh scheduler of
    ``shape`` in ``mode``, under the witness."""
    from witness.engine import build_scheduler, new_request, step_output
    from witness.judge import Witness

    result = Run()
    with scheduler_mode(mode):
        scheduler = build_scheduler(shape)
        try:
            if prepare is not None:
                prepare(scheduler)
            witness = Witness(scheduler, tokens_of)
            for name, tokens in requests:
                request = (
                    request_of(scheduler, name, tokens)
                    if request_of is not None
                    else new_request(scheduler, name, tokens, max_tokens, 0)
                )
                scheduler.add_request(request)
                steps = 0
                while scheduler.has_requests():
                    output = scheduler.schedule()
                    for new in output.scheduled_new_reqs:
                        result.hits[new.req_id] = new.num_computed_tokens
                    chunks = {}
                    for req_id, count in output.num_scheduled_tokens.items():
                        end = scheduler.requests[req_id].num_computed_tokens
                        chunks[req_id] = (end - count, end)
                        result.chunks.setdefault(req_id, []).append(chunks[req_id])
                    sampled = [
                        [SAMPLED] if end >= scheduler.requests[r].num_tokens else []
                        for r, (_, end) in chunks.items()
                    ]
                    witness.run_step(output, chunks)
                    witness.forget_evicted()
                    scheduler.update_from_output(
                        output, step_output(list(chunks), sampled)
                    )
                    steps += 1
                    if steps > 1000:
                        result.unfinished.append(name)
                        scheduler.finish_requests(name, _aborted())
                        break
                short = request.num_output_tokens < max_tokens
                if short and name not in result.unfinished:
                    result.unfinished.append(name)
        finally:
            scheduler.shutdown()
    result.findings = witness.findings
    return result


def _aborted() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED
