"""Concurrent load on the real scheduler, under the witness: staggered arrivals
whose decodes share the step budget with other requests' prefills, siblings
sharing prefixes (cache hits), a scarce block pool (preemption and
resumption), aborts in prefill and in decode, late high-priority arrivals under
``scheduling_policy="priority"``, async scheduling, a drafter's smaller block
(C < B), vLLM's state retention 0 (its default), dense and R > 0, and a Mamba
group declaring backend prefill checkpoints as GPU backends do.

Each workload is driven the way vLLM's engine core drives its scheduler:
``schedule()``, the forward pass (here: the witness's mirror of the worker's
Mamba writes), ``update_from_output()``; under async scheduling the next step
is scheduled before the previous step's output comes back (a queue of two).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from witness.engine import (
    Shape,
    build_scheduler,
    new_request,
    propose_drafts,
    step_output,
)
from witness.judge import (
    Findings,
    Witness,
    mirrors_backend_checkpoints,
    mirrors_draft_steps,
)

SAMPLED = 7
"""The token the modelled model samples, always: tokens in flight are known."""


@dataclass(frozen=True)
class Arrival:
    step: int
    req_id: str
    tokens: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    after: str | None = None
    """Held back, from ``step`` on, until request ``after`` has computed its
    whole prompt (or is gone): a sibling that reads what that one left in the
    cache, whenever the load lets that one get there (after its preemptions,
    behind late high-priority arrivals, steps ahead of its output under async
    scheduling)."""


@dataclass(frozen=True)
class Abort:
    req_id: str
    phase: str
    """"prefill": once its prefill passed ``at`` tokens; "decode": once it has
    ``at`` output tokens."""
    at: int


@dataclass(frozen=True)
class Workload:
    name: str
    shape: Shape
    arrivals: tuple[Arrival, ...]
    aborts: tuple[Abort, ...] = ()
    expects: tuple[str, ...] = ()
    """Events (fields of :class:`Events`, or counts of the witness's
    :class:`Findings` such as ``backend_checkpoints``) that must occur, in
    every mode."""
    stock_wrong: bool = True
    """Whether stock vLLM publishes wrong states here (C < B: it ends chunks
    on C's grid). With C = B it does not on these loads."""


@dataclass
class Events:
    """What happened under the witness (each workload's load must really occur)."""

    preemptions: int = 0
    preempted_in_prefill: int = 0
    priority_preemptions: int = 0
    """Preemptions of a request of lower priority than one scheduled in the
    same step, whose prefill was in progress."""
    aborts_in_prefill: int = 0
    aborts_in_decode: int = 0
    aborts_waiting: int = 0
    """Aborted before any of its tokens was computed (served: a client gone
    while its request waited)."""
    cache_hits: int = 0
    """Requests admitted with computed tokens (a prefix-cache hit)."""
    admitted_ahead: int = 0
    """Requests scheduled for the first time while one that arrived before them
    still waited, never scheduled (cache-aware admission reordering the queue;
    arrival order admits none)."""
    unfinished: list[str] = field(default_factory=list)
    """Requests neither aborted nor given all their tokens (must stay empty)."""


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(length)]


def _load(
    seed: int,
    count: int,
    spread: int,
    late_priority: bool = False,
) -> tuple[Arrival, ...]:
    """``count`` requests over ``spread`` steps: siblings of three shared bases
    (hits, junctions), some with long decodes."""
    rng = random.Random(seed)
    bases = [_prompt(rng, rng.randint(150, 420)) for _ in range(3)]
    arrivals = []
    for index in range(count):
        base = rng.choice(bases)
        shared = rng.randint(0, len(base))
        tail = _prompt(rng, rng.randint(1 if shared else 40, 200))
        decode = rng.choice([1, 3, rng.randint(20, 70)])
        step = rng.randint(0, spread)
        priority = 0
        if late_priority:
            # The first half arrives early at low priority (larger value), the
            # rest late at high priority, while the early ones still prefill.
            early = index < count // 2
            step = rng.randint(0, 3) if early else rng.randint(4, spread)
            priority = 5 if early else 0
            if early:  # long prompts: still in prefill when the others come
                tail += _prompt(rng, 700)
        arrivals.append(
            Arrival(step, f"r{index}", tuple(base[:shared] + tail), decode, priority)
        )
    return tuple(arrivals)


def _aborts(seed: int, arrivals: tuple[Arrival, ...]) -> tuple[Abort, ...]:
    """One request in three aborted: in prefill at a random point, or in decode."""
    rng = random.Random(seed + 1)
    aborts = []
    for arrival in arrivals[::3]:
        if arrival.max_tokens > 2 and rng.random() < 0.5:
            aborts.append(
                Abort(arrival.req_id, "decode", rng.randint(1, arrival.max_tokens - 1))
            )
        else:
            aborts.append(
                Abort(
                    arrival.req_id, "prefill", rng.randint(1, len(arrival.tokens) - 1)
                )
            )
    return tuple(aborts)


def _siblings(
    seed: int,
    arrivals: tuple[Arrival, ...],
    count: int,
    aborts: tuple[Abort, ...] = (),
) -> tuple[Arrival, ...]:
    """``count`` requests that extend the whole prompt of one of ``arrivals``
    each (of those not aborted, the longest decodes) and arrive once that
    one's prompt is computed, at the highest priority: each can hit the state
    vLLM keeps at the replay boundary of the prompt it extends, and the
    attention blocks beside it."""
    rng = random.Random(seed + 2)
    aborted = {abort.req_id for abort in aborts}
    # Long decodes first: their blocks stay in use (so not evicted from a
    # scarce pool) while the sibling waits for its turn.
    extended = sorted(
        (a for a in arrivals if a.req_id not in aborted),
        key=lambda a: (-a.max_tokens, -len(a.tokens), a.req_id),
    )[:count]
    return tuple(
        Arrival(
            base.step,
            f"{base.req_id}-sibling",
            base.tokens + tuple(_prompt(rng, rng.randint(20, 120))),
            rng.choice([1, 3, 12]),
            after=base.req_id,
        )
        for base in extended
    )


def drafter_block() -> int | None:
    """C for the drafter's group beside B = 96 (:data:`STATE_BLOCK`) on the
    installed vLLM: 64 (not a divisor) from 0.28.0, 48 (C must divide B) before
    0.20; None where vLLM refuses C < B at startup (0.20.2-0.27.1)."""
    import vllm
    from packaging.version import Version

    release = Version(vllm.__version__).release
    if release >= (0, 28):
        return 64
    if release < (0, 20):
        return 48
    return None


def admission_setting() -> bool:
    """Whether the installed vLLM has cache-aware admission (0.34.0+)."""
    from vllm.config import SchedulerConfig

    return "cache_aware_admission_window" in SchedulerConfig.__dataclass_fields__


def retention_setting() -> bool:
    """Whether the installed vLLM takes a retention interval for Mamba states
    from the KV-cache config (0.29.0+; before: every state kept)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return "prefix_cache_retention_interval" in KVCacheConfig.__dataclass_fields__


def checkpoint_setting() -> bool:
    """Whether the installed vLLM takes backend prefill checkpoints with an
    alignment (``MambaSpec.prefill_checkpoint_alignment``) and the judge knows
    where its backends write them (0.32.0-0.34.0)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    fields = MambaSpec.__dataclass_fields__
    return "prefill_checkpoint_alignment" in fields and mirrors_backend_checkpoints()


DRAFT_WORKLOAD_RELEASES = ((0, 33), (0, 34))
"""The releases the drafter workloads run on: those whose worker rule the
judge mirrors (judge.DRAFT_RULE_RELEASES) less 0.32.0, which the served
witness covers (tests/e2e/test_witness_served.py). On 0.32.0 the workload
"drafter, 2 draft tokens, scarce pool, dense retention" loses one state vLLM
keeps in stock and in every mode alike, in a decode step, where no split
acts: ``r7-sibling``'s row [286, 289) accepts both drafts past the boundary
288, the worker copies the state after 288 into column 2, and vLLM's Mamba
manager puts the null block in that column before it caches the block at
the next step (no wrong publication, no wrong read)."""


def draft_setting() -> bool:
    """Whether the judge mirrors the installed vLLM's worker under speculative
    decoding, the drafter workloads run on it (:data:`DRAFT_WORKLOAD_RELEASES`)
    and vLLM runs a drafter's group beside B."""
    import vllm
    from packaging.version import Version

    release = Version(vllm.__version__).release[:2]
    return (
        mirrors_draft_steps()
        and release in DRAFT_WORKLOAD_RELEASES
        and drafter_block() is not None
    )


STATE_BLOCK = 96
"""B, the Mamba group's block (and the attention group's)."""
PREEMPTED = "preemptions"
HITS = "cache_hits"
ABORTED = ("aborts_in_prefill", "aborts_in_decode")
CHECKPOINTS = "backend_checkpoints"
DRAFTED = ("draft_steps", "drafts_rejected")


def workloads() -> list[Workload]:
    """The named workloads every mode runs, with the events each must show; a
    drafter's group of block C beside the attention and Mamba groups' B = 96."""
    drafter = Shape(
        state_block=STATE_BLOCK,
        attention_block=STATE_BLOCK,
        drafter_block=drafter_block(),
        budget=256,
    )
    # A pool a few requests fit in at once, not all: running ones are
    # preempted and resume from what they cached.
    scarce_pool = replace(drafter, num_blocks=40, reserve_full_input=False)
    concurrent = _load(seed=11, count=12, spread=30)
    scarce = _load(seed=12, count=12, spread=20)
    aborted = _load(seed=13, count=12, spread=25)
    ranked = _load(seed=14, count=10, spread=14, late_priority=True)
    # Aborts are drawn from each load before its siblings join it, so the
    # siblings are never aborted and every one of them can read the cache.
    scarce_aborts = {seed: _aborts(seed, scarce) for seed in (12, 15)}
    ranked_aborts = _aborts(14, ranked)
    aborted_aborts = _aborts(13, aborted)
    # Siblings where the load alone leaves no hit: behind preemptions (the
    # scarce pool, async steps, C = B) and late high-priority arrivals.
    scarce += _siblings(12, scarce, 3, scarce_aborts[12] + scarce_aborts[15])
    ranked += _siblings(14, ranked, 3, ranked_aborts)
    aborted += _siblings(13, aborted, 2, aborted_aborts)
    admission = []
    if admission_setting():
        # Two running at once and 16 arrivals over 8 steps, so a queue forms;
        # siblings of cached prefixes behind cold prompts get admitted ahead of
        # them (2 such admissions in stock and every mode on 0.34.0).
        admission = [
            Workload(
                "cache-aware admission",
                replace(drafter, max_num_seqs=2, admission_window=8),
                _load(seed=16, count=16, spread=8),
                expects=("cache_hits", "admitted_ahead"),
            )
        ]
    retention = []
    if retention_setting():
        retention = [
            Workload(
                "concurrent, dense retention",
                replace(drafter, retention=None),
                concurrent,
            ),
            Workload(
                "concurrent, retention R=384",
                replace(drafter, retention=384),
                concurrent,
            ),
        ]
    checkpoints = []
    if checkpoint_setting():
        # The Mamba group as GPU backends declare it: one checkpoint block and
        # Mamba2's alignment 1; the backend writes a state inside chunks (the
        # prompt checkpoint in a prompt's final chunk) and the manager re-keys
        # the reserved block at it. Beside the concurrent load: preemptions
        # and aborts in a scarce pool, async steps, late high-priority
        # arrivals, and the alignment 0.34.0's GDN layer declares without a
        # prefix-match unit (the Mamba block, B).
        def backend(shape: Shape, alignment: int = 1) -> Shape:
            return replace(
                shape,
                num_prefill_checkpoint_blocks=1,
                prefill_checkpoint_alignment=alignment,
            )

        scarcer = replace(scarce_pool, num_blocks=30)  # the block it reserves
        checkpoints = [
            Workload(
                "concurrent, backend checkpoints",
                backend(drafter),
                concurrent,
                expects=(CHECKPOINTS,),
            ),
            Workload(
                "concurrent, checkpoints on B",
                backend(drafter, STATE_BLOCK),
                concurrent,
                expects=(CHECKPOINTS,),
            ),
            Workload(
                "scarce pool, backend checkpoints",
                backend(scarcer),
                scarce,
                scarce_aborts[12],
                expects=(CHECKPOINTS, PREEMPTED, *ABORTED),
            ),
            Workload(
                "async, backend checkpoints",
                backend(replace(scarce_pool, async_scheduling=True)),
                scarce,
                scarce_aborts[15],
                expects=(CHECKPOINTS, PREEMPTED, "aborts_in_decode"),
            ),
            Workload(
                "priority, backend checkpoints",
                backend(replace(scarce_pool, priority=True)),
                ranked,
                ranked_aborts,
                expects=(CHECKPOINTS, "priority_preemptions", "aborts_in_prefill"),
            ),
        ]
    drafting = []
    if draft_setting():
        # A real speculative config (Qwen3-Next's MTP module) whose drafter's
        # group has block C beside B: decodes verify 1 to 3 draft tokens, the
        # runner accepts a drawn number of them; siblings read what the
        # drafted requests left, in a scarce pool behind preemptions too.
        # Under dense retention vLLM keeps the boundaries decodes cross, so
        # the worker's copy after a step (the state a boundary's accepted
        # tokens reached) is judged too; vLLM's default retention keeps none.
        drafted = _load(seed=17, count=8, spread=16)
        drafted += _siblings(17, drafted, 2)
        drafting = [
            Workload(
                "drafter, 1 draft token, dense retention",
                replace(drafter, drafts=1, retention=None),
                drafted,
                expects=DRAFTED,
            ),
            Workload(
                "drafter, 2 draft tokens, scarce pool, dense retention",
                replace(scarce_pool, drafts=2, retention=None),
                drafted,
                expects=(*DRAFTED, PREEMPTED),
            ),
            Workload(
                "drafter, 3 draft tokens, scarce pool",
                replace(scarce_pool, drafts=3),
                drafted,
                expects=(*DRAFTED, PREEMPTED),
            ),
        ]
    listed = [
        Workload("concurrent", drafter, concurrent),
        *drafting,
        *retention,
        *admission,
        *checkpoints,
        Workload("scarce pool", scarce_pool, scarce, expects=(PREEMPTED,)),
        Workload("aborts", drafter, aborted, aborted_aborts, expects=ABORTED),
        Workload(
            "priority",
            replace(scarce_pool, priority=True),
            ranked,
            ranked_aborts,
            expects=("priority_preemptions", "aborts_in_prefill"),
        ),
        Workload(
            "async",
            replace(scarce_pool, async_scheduling=True),
            scarce,
            scarce_aborts[15],
            expects=(PREEMPTED, *ABORTED),
        ),
        Workload(
            "equal blocks (C = B)",
            replace(scarce_pool, drafter_block=None, num_blocks=12),
            scarce,
            scarce_aborts[12],
            expects=(PREEMPTED, *ABORTED),
            stock_wrong=False,
        ),
    ]
    # Every workload reads the cache: a request admitted with computed tokens.
    return [replace(w, expects=(*w.expects, HITS)) for w in listed]


def tokens_of(request: Any) -> list[int]:
    """A request's tokens as the worker knows them: in-flight ones (async
    scheduling's output placeholders) are the sampled token."""
    in_flight = int(getattr(request, "num_output_placeholders", 0) or 0)
    return [*request.all_token_ids, *[SAMPLED] * in_flight]


def drive(workload: Workload) -> tuple[Findings, Events]:
    """Run ``workload`` to the end under the witness."""
    from vllm.v1.request import RequestStatus

    scheduler = build_scheduler(workload.shape)
    witness = Witness(scheduler, tokens_of)
    events = Events()
    drafter = Drafter(workload.name, workload.shape.drafts)
    pending = sorted(workload.arrivals, key=lambda a: (a.step, a.req_id))
    aborts = {a.req_id: a for a in workload.aborts}
    aborted: set[str] = set()
    added: dict[str, Any] = {}
    in_flight: deque[tuple[Any, Any]] = deque()
    started: set[str] = set()
    step = 0
    try:
        while pending or scheduler.has_requests() or in_flight:
            if in_flight and not pending and not scheduler.has_requests():
                scheduler.update_from_output(*in_flight.pop())  # drain the queue
                continue
            for arrival in [a for a in pending if _due(a, step, added, scheduler)]:
                pending.remove(arrival)
                request = new_request(
                    scheduler,
                    arrival.req_id,
                    list(arrival.tokens),
                    arrival.max_tokens,
                    arrival.priority,
                )
                added[arrival.req_id] = request
                scheduler.add_request(request)
            _abort_due(scheduler, aborts, aborted, events)
            running = {
                r.request_id: (r.num_computed_tokens, r.num_prompt_tokens, r.priority)
                for r in scheduler.running
            }
            output = scheduler.schedule()
            chunks = {}
            for req_id, count in output.num_scheduled_tokens.items():
                end = scheduler.requests[req_id].num_computed_tokens
                chunks[req_id] = (end - count, end)
            for new in output.scheduled_new_reqs:
                if new.num_computed_tokens > 0:
                    events.cache_hits += 1
            count_admitted_ahead(scheduler, added, started, chunks, events)
            sampled, accepted = drafter.sample(scheduler, output, chunks)
            witness.run_step(output, chunks, accepted)
            witness.forget_evicted()
            count_preemptions(scheduler, running, chunks, events, RequestStatus)
            runner = step_output(list(chunks), sampled)
            in_flight.appendleft((output, runner))
            if (
                workload.shape.async_scheduling
                and len(in_flight) < 2
                and scheduler.has_requests()
            ):
                step += 1
                continue
            scheduler.update_from_output(*in_flight.pop())
            drafter.propose(scheduler, chunks)
            step += 1
            assert step < 20_000, f"{workload.name}: the scheduler stalled"
    finally:
        scheduler.shutdown()
    for req_id, request in added.items():
        if req_id not in aborted and request.num_output_tokens < request.max_tokens:
            events.unfinished.append(req_id)
    return witness.findings, events


class Drafter:
    """The runner's sampler and drafter: without drafts, the token
    :data:`SAMPLED` for every request whose chunk reaches its last token;
    with ``drafts`` per step (no async scheduling), a drawn number of the
    scheduled drafts accepted (seeded by the workload's name), a token other
    than the first rejected draft sampled after them, and fresh drawn drafts
    proposed after every step."""

    def __init__(self, name: str, drafts: int) -> None:
        self.drafts = drafts
        self.rng = random.Random(f"drafter/{name}")

    def sample(
        self, scheduler: Any, output: Any, chunks: dict[str, tuple[int, int]]
    ) -> tuple[list[list[int]], dict[str, int]]:
        """Each scheduled request's sampled tokens (in ``chunks``' order) and
        how many of its drafts were accepted."""
        if not self.drafts:
            sampled = [
                [SAMPLED] if end >= scheduler.requests[r].num_tokens else []
                for r, (_, end) in chunks.items()
            ]
            return sampled, {}
        scheduled = output.scheduled_spec_decode_tokens
        sampled, accepted = [], {}
        for req_id, (_, end) in chunks.items():
            request = scheduler.requests[req_id]
            drafts = list(scheduled.get(req_id, ()))
            if end - len(drafts) < request.num_tokens:
                sampled.append([])  # a prefill chunk short of the prompt's end
                continue
            # Placeholders (-1, vLLM's padding of a row to 1 + k) never match.
            real = next((i for i, t in enumerate(drafts) if t < 0), len(drafts))
            room = request.max_tokens - request.num_output_tokens - 1
            count = min(self.rng.randint(0, len(drafts)), real, max(room, 0))
            bonus = self.rng.randrange(1, 500)
            if count < real and bonus == drafts[count]:
                bonus = drafts[count] % 499 + 1
            sampled.append([*drafts[:count], bonus])
            accepted[req_id] = count
        return sampled, accepted

    def propose(self, scheduler: Any, chunks: dict[str, tuple[int, int]]) -> None:
        if not self.drafts:
            return
        live = [r for r in chunks if r in scheduler.requests]
        propose_drafts(
            scheduler,
            {r: [self.rng.randrange(1, 500) for _ in range(self.drafts)] for r in live},
        )


def _due(arrival: Arrival, step: int, added: dict[str, Any], scheduler: Any) -> bool:
    """Whether ``arrival`` arrives now: its step has come and the request it
    waits for (:attr:`Arrival.after`) has computed its prompt or is gone."""
    if arrival.step > step:
        return False
    if arrival.after is None:
        return True
    base = added.get(arrival.after)
    if base is None:
        return False
    return (
        arrival.after not in scheduler.requests
        or base.num_computed_tokens >= base.num_prompt_tokens
    )


def count_admitted_ahead(
    scheduler: Any,
    added: dict[str, Any],
    started: set[str],
    chunks: dict[str, tuple[int, int]],
    events: Events,
) -> None:
    """Count the requests this step schedules first that overtook an earlier
    arrival still waiting (``added`` is in arrival order)."""
    firsts = [r for r in chunks if r not in started]
    for req_id in firsts:
        for earlier in added:
            if earlier == req_id:
                break
            waiting = earlier not in started and earlier not in chunks
            if waiting and earlier in scheduler.requests:  # not aborted or done
                events.admitted_ahead += 1
                break
    started.update(firsts)


def _abort_due(
    scheduler: Any, aborts: dict[str, Abort], aborted: set[str], events: Events
) -> None:
    """Abort (as a client disconnecting: ``finish_requests``) every request
    whose abort point has come."""
    from vllm.v1.request import RequestStatus

    for req_id, abort in list(aborts.items()):
        request = scheduler.requests.get(req_id)
        if request is None:
            continue
        if abort.phase == "prefill":
            due = abort.at <= request.num_computed_tokens < request.num_prompt_tokens
        else:
            due = request.num_output_tokens >= abort.at
        if not due:
            continue
        scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        del aborts[req_id]
        aborted.add(req_id)
        if abort.phase == "prefill":
            events.aborts_in_prefill += 1
        else:
            events.aborts_in_decode += 1


def count_preemptions(
    scheduler: Any,
    running: dict[str, tuple[int, int, int]],
    chunks: dict[str, tuple[int, int]],
    events: Events,
    status: Any,
) -> None:
    scheduled = [scheduler.requests[r].priority for r in chunks]
    for req_id, (computed, prompt, priority) in running.items():
        request = scheduler.requests.get(req_id)
        if request is None or request.status != status.PREEMPTED:
            continue
        events.preemptions += 1
        in_prefill = computed < prompt
        events.preempted_in_prefill += in_prefill
        if in_prefill and any(p < priority for p in scheduled):
            events.priority_preemptions += 1
