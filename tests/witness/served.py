"""The witness inside a served engine: attached to each engine core's scheduler
by the test-only plugin ``tests/support/witness_engine_plugin`` (which finds
this module on ``PYTHONPATH``), it judges every step the real engine schedules
and writes what it found to ``<folder>/witness-<pid>.json`` after every step
(one file per engine core: data parallel ranks each have their own).

The worker's writes are the witness's mirror (judge.py), fed by the real
scheduler's output; the model's sampled tokens are the request's own
(``all_token_ids``), known when the step that computes them is scheduled
under synchronous scheduling. A step whose tokens are not all known yet
(async scheduling's placeholders) or that verifies draft tokens is counted,
not mirrored: ``unmirrored_steps`` must stay 0 for the verdict to stand.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from witness.judge import Witness
from witness.workloads import Events, count_preemptions


def tokens_of(request: Any) -> list[int]:
    return list(request.all_token_ids)


def watch(scheduler: Any, folder: str) -> None:
    """Judge every ``schedule()`` of ``scheduler`` from now on."""
    from vllm.v1.request import RequestStatus

    witness = Witness(scheduler, tokens_of)
    events = Events()
    counts = {"unmirrored_steps": 0, "requests": 0}
    seen: set[str] = set()
    path = os.path.join(folder, f"witness-{os.getpid()}.json")
    schedule = scheduler.schedule
    finish_requests = scheduler.finish_requests

    def save() -> None:
        state = {
            "findings": dataclasses.asdict(witness.findings),
            "events": dataclasses.asdict(events),
            **counts,
        }
        partial = path + ".partial"
        with open(partial, "w") as f:
            json.dump(state, f)
        os.replace(partial, path)

    def watched_schedule(*args: Any, **kwargs: Any) -> Any:
        running = {
            r.request_id: (r.num_computed_tokens, r.num_prompt_tokens, r.priority)
            for r in scheduler.running
        }
        output = schedule(*args, **kwargs)
        chunks = {}
        for req_id, count in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            end = request.num_computed_tokens
            chunks[req_id] = (end - count, end)
            if req_id not in seen:
                seen.add(req_id)
                counts["requests"] += 1
        for new in output.scheduled_new_reqs:
            if new.num_computed_tokens > 0:
                events.cache_hits += 1
        drafts = getattr(output, "scheduled_spec_decode_tokens", None) or {}
        unknown = any(
            getattr(scheduler.requests[r], "num_output_placeholders", 0)
            or drafts.get(r)
            for r in chunks
        )
        if unknown:
            counts["unmirrored_steps"] += 1
        elif chunks:
            witness.run_step(output, chunks)
            witness.forget_evicted()
        count_preemptions(scheduler, running, chunks, events, RequestStatus)
        save()
        return output

    def watched_finish_requests(request_ids: Any, finished_status: Any) -> Any:
        if request_ids is not None and not isinstance(request_ids, str):
            request_ids = list(request_ids)  # read twice: here and by vLLM
        if finished_status == RequestStatus.FINISHED_ABORTED and request_ids:
            ids = [request_ids] if isinstance(request_ids, str) else request_ids
            for req_id in ids:
                request = scheduler.requests.get(req_id)
                if request is None or RequestStatus.is_finished(request.status):
                    continue
                if request.num_computed_tokens == 0:
                    events.aborts_waiting += 1
                elif request.num_computed_tokens < request.num_prompt_tokens:
                    events.aborts_in_prefill += 1
                else:
                    events.aborts_in_decode += 1
        return finish_requests(request_ids, finished_status)

    scheduler.schedule = watched_schedule
    scheduler.finish_requests = watched_finish_requests
    save()
