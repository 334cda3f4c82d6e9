"""One probe of a server: the requests, in order, and what came back.

Serial, bounded: the completions sent are known before the first one
(``Workload.requests``, at most ``--max-requests``). Every request carries a
cache salt of the probe's own (``SALT_PREFIX``, a random run id): the cached
family shares no cache entry with the server's other traffic or with an earlier
probe, each fresh run shares none with anything, and nothing else is written on
the server; vLLM evicts the salted blocks like any others.

Every request also carries ``engine_header(rank)`` (rank 0 unless ``--rank``
or ``--ranks``). On a data-parallel server
(``--data-parallel-size N`` behind one API server) each engine core has its own
prefix cache and vLLM's load balancer sends each request to the least loaded
engine, so a salt family could be split across engines and a sibling find
nothing its writer left. vLLM's OpenAI server (read in 0.32.0: its
``_get_data_parallel_rank`` and the DP client's engine choice) sends a request
carrying ``X-data-parallel-rank: R`` to engine R, and refuses a rank out of
range naming the range ("data_parallel_rank R is out of range [0, N)", its
input processor): ``count_ranks`` reads N from that refusal, and
``run_ranks`` probes every rank in turn, each with salts of its own. Rank 0 is
valid on every server: a single engine is rank 0, and an API server of an
external or hybrid load balancer counts its local engines from 0. A release or
a proxy that does not know the header ignores it, and the report then says
reuse may be split (``report``: several engines on ``/metrics``).

Replicas behind one URL (several ``vllm serve`` servers and a load balancer)
each have their own prefix cache, and no header reaches one of them: the probe
sees them in ``vllm:prompt_tokens_total``, which grew by less than the prompt
tokens it sent (:attr:`Probe.reached_other_servers`).
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from . import workload as workloads
from .client import CannotProbe, Client, Completion
from .judge import (
    DEFAULT_THRESHOLD,
    ROUNDING_MARGIN,
    Bounds,
    CaseResult,
    Observed,
    RoundingPair,
    Sample,
    bounds,
    judge_case,
    noise_floor,
    rounding_floor,
)
from .server_metrics import ServerMetrics, read_metrics

SALT_PREFIX = "vllm-mamba-align-probe-"
RANK_HEADER = "X-data-parallel-rank"


def engine_header(rank: int) -> dict[str, str]:
    """Every request to engine core ``rank`` of a data-parallel server."""
    return {RANK_HEADER: str(rank)}


ENGINE_HEADER = engine_header(0)
"""The header of a probe of rank 0 (the default)."""
RANK_QUERY = 1 << 20
"""A rank no server has: vLLM refuses it, naming how many it has."""
OUT_OF_RANGE = re.compile(r"data_parallel_rank \d+ is out of range \[0, (\d+)\)")
DEFAULT_MAX_REQUESTS = 53
"""Completions (``Workload.requests``): 47 for the cases, 6 for the rounding."""
DEFAULT_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 1
DEFAULT_TIMEOUT = 120.0
STATS_SETTLE = 2.0
"""Seconds to wait before scraping ``/metrics`` again when it counted fewer
prompt tokens than the probe sent: vLLM's API server records a request's
statistics just after it answers, so the last request may not be counted yet."""


@dataclass(frozen=True)
class Options:
    url: str
    model: str | None = None
    api_key: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    max_requests: int = DEFAULT_MAX_REQUESTS
    seed: int = 0
    logprobs: int = DEFAULT_LOGPROBS
    max_tokens: int = DEFAULT_MAX_TOKENS
    threshold: float = DEFAULT_THRESHOLD
    state_block: int | None = None
    prompt_tokens: int | None = None
    rounding: float | None = None
    """The server's chunk-shape rounding, given (``--rounding``): not measured."""
    rank: int = 0
    """The data-parallel rank every request is sent to (``--rank``)."""


@dataclass
class Probe:
    """Everything one probe saw; ``report.decide`` turns it into a verdict."""

    options: Options
    base: str = ""
    model: str = ""
    max_model_len: int | None = None
    before: ServerMetrics = field(default_factory=lambda: ServerMetrics(False))
    after: ServerMetrics = field(default_factory=lambda: ServerMetrics(False))
    workload: workloads.Workload | None = None
    salt_prefix: str = ""
    sent: int = 0
    prompt_tokens_sent: int = 0
    """Prompt tokens of every completion sent (vLLM counts them as
    ``vllm:prompt_tokens_total``)."""
    results: list[CaseResult] = field(default_factory=list)
    floor: float = 0.0
    wild: bool = False
    rounding: list[RoundingPair] = field(default_factory=list)
    rounding_floor: float = 0.0
    """The largest decode-vs-prefill difference (chunk-shape rounding)."""
    rounding_wild: bool = False
    """A rounding measurement parted outside each other's top-k."""
    rounding_measured: bool = True
    """The rounding was given, or at least one measurement of it held."""
    rounding_unreproduced: int = 0
    """Rounding prompts whose two decode runs differed (decode pair not used)."""
    rounding_departed: int = 0
    """Rounding prompts whose decode pair was set aside
    (``RoundingPair.decode_departs``)."""
    rounding_samples: tuple[Sample, ...] = ()
    """Every rounding measurement with its trust (``judge.samples``)."""
    rounding_margin: float = ROUNDING_MARGIN
    """The wrong-state bound's multiple of the rounding (``judge.rounding_margin``)."""
    bound: Bounds = field(default_factory=lambda: Bounds(0.0, 0.0))
    problem: str | None = None
    """Why the server could not be probed (exit 2), if it could not."""
    header_ignored: str | None = None
    """Set where the probe was to reach one rank of several (``--rank R``,
    ``--ranks N``) but the server ignores the rank header: which, and why its
    requests may have reached any engine (the verdict is then 1 or 5)."""

    @property
    def prompt_tokens_counted(self) -> float | None:
        """How much ``vllm:prompt_tokens_total`` grew on the ``/metrics`` this
        URL answered while the probe ran (None: not reported)."""
        before, after = self.before.prompt_tokens, self.after.prompt_tokens
        return None if before is None or after is None else after - before

    @property
    def reached_other_servers(self) -> bool:
        """The URL's ``/metrics`` counted fewer prompt tokens than the probe
        sent: its requests, or its two scrapes, reached more than one server
        (replicas behind a load balancer), each with a prefix cache of its own."""
        counted = self.prompt_tokens_counted
        engines = self.after.hits_by_engine
        if engines and str(self.options.rank) not in engines:
            # The rank's engine reports elsewhere (a headless node's engine is
            # not on the head's /metrics): its prompt tokens are not counted.
            return False
        return counted is not None and counted < self.prompt_tokens_sent

    @property
    def rank_prompt_tokens_counted(self) -> float | None:
        """How much the probed rank's engine's ``vllm:prompt_tokens_total``
        grew while the probe ran (None: the URL's ``/metrics`` does not show
        engines apart, or not that one)."""
        before = self.before.prompt_tokens_by_engine
        after = self.after.prompt_tokens_by_engine
        rank = str(self.options.rank)
        if len(after) < 2 or rank not in after:
            return None
        return after[rank] - before.get(rank, 0.0)

    @property
    def reached_other_engines(self) -> bool:
        """The probed rank's engine counted fewer prompt tokens than the probe
        sent it, on a server whose ``/metrics`` shows several engines: some
        requests went to other engines (a proxy that drops the rank header, or
        a release that ignores it). Other clients only add to the count."""
        counted = self.rank_prompt_tokens_counted
        return (
            not self.reached_other_servers
            and counted is not None
            and counted < self.prompt_tokens_sent
        )


Progress = Callable[[int, int, str], None]


def _choose_model(client: Client, wanted: str | None) -> tuple[str, int | None]:
    cards = client.models()
    names = [str(card.get("id")) for card in cards]
    if wanted is None and len(cards) > 1:
        raise CannotProbe(
            f"the server serves {len(cards)} models ({', '.join(names)}): name "
            "one with --model"
        )
    card = (
        cards[0]
        if wanted is None
        else next((c for c in cards if c.get("id") == wanted), None)
    )
    if card is None:
        raise CannotProbe(
            f"the server does not serve {wanted!r}; it serves: {', '.join(names)}"
        )
    length = card.get("max_model_len")
    return str(card["id"]), length if isinstance(length, int) else None


def _state_block(options: Options, metrics: ServerMetrics) -> tuple[int | None, str]:
    if options.state_block is not None:
        return options.state_block, "--state-block"
    if metrics.plugin_state_block is not None:
        return metrics.plugin_state_block, "the plugin's vllm_mamba_align_info"
    if metrics.config_state_block is not None:
        return metrics.config_state_block, "vllm:cache_config_info mamba_block_size"
    return None, "unknown (no --state-block, not on /metrics)"


def _plan(options: Options, probe: Probe) -> workloads.Workload:
    limit = options.prompt_tokens or workloads.DEFAULT_WRITER_TOKENS
    if probe.max_model_len is not None:
        limit = min(limit, probe.max_model_len - options.max_tokens - 1)
    state_block, source = _state_block(options, probe.before)
    prompts = 0 if options.rounding is not None else workloads.ROUNDING_PROMPTS
    for pairs in range(workloads.PAIRS, 0, -1):
        try:
            plan = workloads.build(
                seed=options.seed,
                limit=limit,
                state_block=state_block,
                source=source,
                pairs=pairs,
                rounding_prompts=prompts,
            )
        except ValueError as problem:
            raise CannotProbe(str(problem)) from None
        if plan.requests <= options.max_requests:
            return plan
    raise CannotProbe(
        f"--max-requests {options.max_requests} is below the smallest probe "
        f"({workloads.smallest_requests(1, prompts)} requests: a writer, a "
        "re-ask, one sibling pair, one short-tail pair and a replay sibling, "
        f"each cached and fresh twice, and {prompts} rounding prompts decoded "
        "twice, prefilled, and prefilled beside a filler)"
    )


Announce = Callable[[workloads.Workload], None]
"""Told the workload once it is planned, before the first completion."""


def run(
    options: Options,
    progress: Progress | None = None,
    announce: Announce | None = None,
) -> Probe:
    """Probe the server; a server that cannot be probed sets ``problem``."""
    probe = Probe(options)
    try:
        if options.rank != 0:
            count, source = count_ranks(options)
            if count is None:
                probe.header_ignored = f"rank {options.rank}, but {source}"
            elif options.rank >= count:
                raise CannotProbe(
                    f"--rank {options.rank} is out of range: {source}; use "
                    f"--rank 0 to {count - 1}"
                )
        _run(
            options,
            probe,
            progress or (lambda done, total, what: None),
            announce or (lambda plan: None),
        )
    except CannotProbe as problem:
        probe.problem = str(problem)
    return probe


def _run(
    options: Options, probe: Probe, progress: Progress, announce: Announce
) -> None:
    client = Client(
        options.url, options.api_key, options.timeout, engine_header(options.rank)
    )
    probe.base = client.base
    probe.model, probe.max_model_len = _choose_model(client, options.model)
    probe.before = read_metrics(client.metrics(), probe.model)
    if probe.before.prefix_caching is False:
        raise CannotProbe(
            "prefix caching is off on this server (vllm:cache_config_info: "
            "enable_prefix_caching=False): there is no cached state to check. "
            "vLLM turns it on by default; start it without "
            "--no-enable-prefix-caching to serve cached states (and probe them)"
        )
    plan = probe.workload = _plan(options, probe)
    announce(plan)
    probe.salt_prefix = f"{SALT_PREFIX}{secrets.token_hex(4)}-"

    def send(
        prompt: list[int],
        salt: str,
        what: str,
        decode_steps: int = 0,
        filler: list[int] | None = None,
    ) -> Completion:
        progress(probe.sent, plan.requests, what)
        done = client.complete(
            probe.model,
            prompt if filler is None else [filler, prompt],
            salt=probe.salt_prefix + salt,
            max_tokens=decode_steps or options.max_tokens,
            logprobs=options.logprobs,
            # Every decode step is wanted, whatever the model's end token.
            extra={"ignore_eos": True} if decode_steps else None,
        )
        probe.sent += 1 if filler is None else 2
        probe.prompt_tokens_sent += len(prompt) + len(filler or ())
        if filler is not None:  # usage counts both prompts
            done = dataclasses.replace(done, prompt_tokens=len(prompt))
        if decode_steps and len(done.tokens) != decode_steps:
            raise CannotProbe(
                f"a request for {decode_steps} tokens with ignore_eos returned "
                f"{len(done.tokens)}: the probe measures the server's rounding "
                "by decode steps; is this a vLLM server?"
            )
        return done

    observed = _observe(plan, send)
    probe.rounding = _measure_rounding(plan, send)
    progress(probe.sent, plan.requests, "done")
    probe.after = read_metrics(client.metrics(), probe.model)
    if probe.reached_other_servers or probe.reached_other_engines:
        time.sleep(STATS_SETTLE)
        probe.after = read_metrics(client.metrics(), probe.model)
    settle(probe, observed)


def settle(probe: Probe, observed: list[Observed]) -> None:
    """Judge what the probe saw: the noise, the rounding samples and their
    trust, the bounds, and each case (``report.decide`` then gives the exit
    status). Everything after the last request, so a recorded probe can be
    judged again."""
    options = probe.options
    probe.floor, probe.wild = noise_floor(observed)
    if options.rounding is None:
        measured = rounding_floor(probe.rounding, options.threshold)
        probe.rounding_floor, probe.rounding_wild = measured.floor, measured.wild
        probe.rounding_measured = measured.measured
        probe.rounding_unreproduced = measured.unreproduced
        probe.rounding_departed = measured.departed
        probe.rounding_samples = measured.samples
        probe.rounding_margin = measured.margin
    else:
        probe.rounding_floor = options.rounding
    probe.bound = bounds(
        options.threshold,
        probe.floor,
        probe.rounding_floor,
        probe.rounding_measured,
        probe.rounding_margin,
    )
    probe.results = [judge_case(case, probe.bound) for case in observed]


def _fresh(done: Completion) -> Completion:
    if done.cached_tokens:
        raise CannotProbe(
            f"a request under a new cache_salt reused {done.cached_tokens} "
            "cached tokens: the server does not isolate cache_salt "
            "families, so no fresh reference can be computed"
        )
    return done


def _measure_rounding(
    plan: workloads.Workload, send: Callable[..., Completion]
) -> list[RoundingPair]:
    """Each rounding prompt continued by decode steps, twice; prefilled with
    those tokens but the last; and prefilled beside its filler; each under a
    new salt (nothing cached, so no wrong state can enter: what differs is
    rounding)."""
    pairs = []
    for number, (prompt, filler) in enumerate(
        zip(plan.rounding, plan.fillers, strict=True), 1
    ):
        runs = [
            _fresh(
                send(
                    prompt,
                    f"rounding-{number}-{salt}",
                    f"rounding {number} decode",
                    workloads.DECODE_TOKENS,
                )
            )
            for salt in ("decode", "redecode")
        ]
        ids = [_token_id(token) for token in runs[0].tokens[:-1]]
        prefilled = _fresh(
            send(prompt + ids, f"rounding-{number}-prefill", f"rounding {number}")
        )
        beside = _fresh(
            send(
                prompt,
                f"rounding-{number}-beside",
                f"rounding {number} beside a filler",
                filler=filler,
            )
        )
        pairs.append(RoundingPair(len(prompt), runs[0], prefilled, runs[1], beside))
    return pairs


def _token_id(token: str) -> int:
    """``token_id:123`` (``return_tokens_as_token_ids``) -> 123."""
    try:
        return int(token.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        raise CannotProbe(
            f"the server returned the token {token!r}, not token_id:N, though "
            "asked for return_tokens_as_token_ids (vLLM 0.6.4+ takes it)"
        ) from None


def _observe(
    plan: workloads.Workload, send: Callable[..., Completion]
) -> list[Observed]:
    """The writer and every case in one salt family, in order (each reuses what
    the requests before it left), then each case fresh, under new salts; then
    the short-tail cases the same way, in the same family."""
    send(plan.writer, "cached", "writer")
    salts = iter(range(1, plan.requests + 1))
    observed = _observe_cases(plan.cases, send, salts)
    return observed + _observe_cases(plan.short, send, salts)


def _observe_cases(
    cases: tuple[workloads.Case, ...],
    send: Callable[..., Completion],
    salts: Iterator[int],
) -> list[Observed]:
    cached = {case.name: send(case.prompt, "cached", case.name) for case in cases}
    observed = []
    for case in cases:
        fresh = []
        for _ in range(workloads.FRESH_RUNS):
            done = send(case.prompt, f"fresh-{next(salts)}", f"{case.name} fresh")
            fresh.append(_fresh(done))
        observed.append(
            Observed(
                case.name,
                case.shared,
                case.reads,
                cached[case.name],
                (fresh[0], fresh[1]),
            )
        )
    return observed


@dataclass
class Ranks:
    """A probe of every data-parallel rank of a server, in turn."""

    count: int | None
    """How many ranks; None: the server ignored the rank header (one engine
    behind a proxy, or a release that does not route by it)."""
    source: str
    """Where the count came from."""
    probes: list[Probe] = field(default_factory=list)
    problem: str | None = None
    """Why the ranks could not be counted or probed (exit 2), if not."""
    requested: int | None = None
    """``--ranks N`` as given (None: ``all``)."""


def count_ranks(options: Options) -> tuple[int | None, str]:
    """How many data-parallel ranks the server routes to, from one 1-token
    request to a rank no server has (vLLM refuses it before any engine sees
    it, naming the range); None if the server answered it anyway."""
    client = Client(
        options.url, options.api_key, options.timeout, engine_header(RANK_QUERY)
    )
    model, _ = _choose_model(client, options.model)
    try:
        client.complete(
            model,
            [workloads.TOKEN_RANGE[0]],
            salt=f"{SALT_PREFIX}{secrets.token_hex(4)}-ranks",
            max_tokens=1,
            logprobs=1,
        )
    except CannotProbe as problem:
        found = OUT_OF_RANGE.search(str(problem))
        if found is None:
            raise
        count = int(found.group(1))
        return count, f"counted by the server: {RANK_HEADER} out of range [0, {count})"
    return None, (
        f"the server answered a request to rank {RANK_QUERY}: it ignores "
        f"{RANK_HEADER} (one engine, a release that does not route by it, or a "
        "proxy that drops it)"
    )


def run_ranks(
    options: Options,
    ranks: int | None,
    progress: Progress | None = None,
    announce: Announce | None = None,
) -> Ranks:
    """Probe ranks 0 to ``ranks`` - 1 in turn (None: as many as the server
    has), each a probe of its own: its own salts, its own ``--max-requests``.

    The count is asked of the server even when given: a server that ignores
    the rank header is probed once, as the one engine it answers as, and a
    count that differs from the server's is refused."""
    try:
        count, source = count_ranks(options)
    except CannotProbe as problem:
        return Ranks(None, "", problem=str(problem), requested=ranks)
    found = Ranks(count, source, requested=ranks)
    if ranks is not None and count is not None and ranks != count:
        found.problem = (
            f"--ranks {ranks}, but the server has {count} ({source}): use "
            f"--ranks {count} or --ranks all"
        )
        return found
    for rank in range(count or 1):
        found.probes.append(
            run(dataclasses.replace(options, rank=rank), progress, announce)
        )
    if count is None and ranks is not None and ranks > 1:
        found.probes[0].header_ignored = f"{ranks} ranks, but {source}"
    return found
