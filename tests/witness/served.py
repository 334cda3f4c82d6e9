"""The witness inside a served engine: attached to each engine core's scheduler
by the test-only plugin ``tests/support/witness_engine_plugin`` (which finds
this module on ``PYTHONPATH``), it judges every step the real engine schedules
and writes what it found to ``<folder>/witness-<pid>.json`` after every step
(one file per engine core: data parallel ranks each have their own).

The worker's writes are the witness's mirror (judge.py), fed by the real
scheduler's output; the model's sampled tokens are the request's own
(``all_token_ids``), known when the step that computes them is scheduled
under synchronous scheduling.

A step that verifies draft tokens (``SchedulerOutput.scheduled_spec_decode_tokens``)
is mirrored when its output comes back: the worker's copy after the step
depends on how many drafts each request accepted, which is the number of
tokens the model runner sampled for it less one (``ModelRunnerOutput``'s
``sampled_token_ids``, read at ``Scheduler.update_from_output`` before vLLM
applies them, the count vLLM's scheduler takes there too). A request that
leaves between the two (an abort the engine core applies while the step runs)
is mirrored as the scheduler held it when it scheduled the step: the worker
ran its row.

A step the judge does not mirror is counted, not judged: one whose tokens are
not all known yet (async scheduling's placeholders), one that verifies drafts
where the judge does not know the worker's rule (``Witness.speculative``) or
refuses the row (``NotImplementedError``), one whose output never came or
carries no sampled token for a drafted request. ``unmirrored_steps`` must stay
0 for the verdict to stand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any

from witness.judge import Witness
from witness.workloads import Events, count_preemptions


def tokens_of(request: Any) -> list[int]:
    return list(request.all_token_ids)


def accepted_drafts(
    output: Any, chunks: dict[str, tuple[int, int]], runner_output: Any
) -> dict[str, int] | None:
    """How many of its scheduled drafts each drafted request of the step
    accepted: the tokens the runner sampled for it, less the one sampled
    after its accepted drafts (vLLM 0.32.0 ``Scheduler.update_from_output``,
    vllm/v1/core/sched/scheduler.py:2105-2118; the worker's ``num_accepted``
    is that count plus one). None if a drafted request has no sampled token
    (the worker's count is then unknown)."""
    sampled = getattr(runner_output, "sampled_token_ids", None)
    if sampled is None:
        sampled = []
    index = getattr(runner_output, "req_id_to_index", None) or {}
    accepted = {}
    for req_id, drafts in output.scheduled_spec_decode_tokens.items():
        if req_id not in chunks or not drafts:
            continue
        row = index.get(req_id)
        tokens = sampled[row] if row is not None and row < len(sampled) else ()
        if len(tokens) == 0:
            return None
        accepted[req_id] = len(tokens) - 1
    return accepted


def watch(scheduler: Any, folder: str) -> None:
    """Judge every ``schedule()`` of ``scheduler`` from now on."""
    from vllm.v1.request import RequestStatus

    witness = Witness(scheduler, tokens_of)
    events = Events()
    counts = {"unmirrored_steps": 0, "requests": 0, "rows_after_finish": 0}
    seen: set[str] = set()
    path = os.path.join(folder, f"witness-{os.getpid()}.json")
    schedule = scheduler.schedule
    update_from_output = scheduler.update_from_output
    finish_requests = scheduler.finish_requests
    drafted: list[tuple[Any, dict[str, tuple[int, int]]]] = []
    """The step that verifies drafts, until its output comes back (at most one:
    synchronous scheduling)."""
    departed: dict[str, tuple[Any, dict[Any, list[Any]]]] = {}
    """Requests of that step finished before its output came: the request and
    its Mamba blocks per group as the scheduler held them."""

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

    def mirror(
        output: Any,
        chunks: dict[str, tuple[int, int]],
        accepted: dict[str, int] | None = None,
    ) -> None:
        try:
            witness.run_step(output, chunks, accepted)
        except NotImplementedError:
            counts["unmirrored_steps"] += 1
            return
        witness.forget_evicted()

    @contextlib.contextmanager
    def held_as_scheduled() -> Any:
        """The departed requests back in the scheduler's tables while their
        step is mirrored (nothing else runs on the scheduler meanwhile)."""
        restored = []
        for req_id, (request, tables) in departed.items():
            if req_id in scheduler.requests:
                continue
            scheduler.requests[req_id] = request
            for mamba, blocks in tables.items():
                mamba.req_to_blocks[req_id] = blocks
            restored.append((req_id, tables))
            counts["rows_after_finish"] += 1
        try:
            yield
        finally:
            for req_id, tables in restored:
                scheduler.requests.pop(req_id, None)
                for mamba in tables:
                    mamba.req_to_blocks.pop(req_id, None)
            departed.clear()

    def watched_schedule(*args: Any, **kwargs: Any) -> Any:
        if drafted:  # the previous step's output never came back
            drafted.clear()
            departed.clear()
            counts["unmirrored_steps"] += 1
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
        in_flight = any(
            getattr(scheduler.requests[r], "num_output_placeholders", 0) for r in chunks
        )
        verifies = any(drafts.get(r) for r in chunks)
        if in_flight or (verifies and not witness.speculative):
            counts["unmirrored_steps"] += 1
        elif verifies:
            drafted.append((output, chunks))  # mirrored when its output comes
        elif chunks:
            mirror(output, chunks)
        count_preemptions(scheduler, running, chunks, events, RequestStatus)
        save()
        return output

    def watched_update_from_output(
        scheduler_output: Any, model_runner_output: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if drafted and drafted[0][0] is scheduler_output:
            output, chunks = drafted.pop()
            accepted = accepted_drafts(output, chunks, model_runner_output)
            with held_as_scheduled():
                if accepted is None:
                    counts["unmirrored_steps"] += 1
                else:
                    mirror(output, chunks, accepted)
            save()
        return update_from_output(
            scheduler_output, model_runner_output, *args, **kwargs
        )

    def watched_finish_requests(request_ids: Any, finished_status: Any) -> Any:
        if request_ids is not None and not isinstance(request_ids, str):
            request_ids = list(request_ids)  # read twice: here and by vLLM
        ids = [request_ids] if isinstance(request_ids, str) else request_ids or []
        if drafted:
            for req_id in ids:
                request = scheduler.requests.get(req_id)
                if req_id in drafted[0][1] and request is not None:
                    departed[req_id] = (
                        request,
                        {
                            mamba: list(mamba.req_to_blocks.get(req_id, ()))
                            for mamba in witness.mambas.values()
                        },
                    )
        if finished_status == RequestStatus.FINISHED_ABORTED:
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
    scheduler.update_from_output = watched_update_from_output
    scheduler.finish_requests = watched_finish_requests
    save()
