"""One probe of a server: the requests, in order, and what came back.

Serial, bounded: the completions sent are known before the first one
(``Workload.requests``, at most ``--max-requests``). Every request carries a
cache salt of the probe's own (``SALT_PREFIX``, a random run id): the cached
family shares no cache entry with the server's other traffic or with an earlier
probe, each fresh run shares none with anything, and nothing else is written on
the server; vLLM evicts the salted blocks like any others.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from . import workload as workloads
from .client import CannotProbe, Client, Completion
from .judge import (
    DEFAULT_THRESHOLD,
    CaseResult,
    Observed,
    effective_threshold,
    judge_case,
    noise_floor,
)
from .server_metrics import ServerMetrics, read_metrics

SALT_PREFIX = "vllm-mamba-align-probe-"
DEFAULT_MAX_REQUESTS = 40
DEFAULT_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 1
DEFAULT_TIMEOUT = 120.0


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
    results: list[CaseResult] = field(default_factory=list)
    floor: float = 0.0
    wild: bool = False
    bound: float = 0.0
    problem: str | None = None
    """Why the server could not be probed (exit 2), if it could not."""


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
    for pairs in range(workloads.PAIRS, 0, -1):
        try:
            plan = workloads.build(
                seed=options.seed,
                limit=limit,
                state_block=state_block,
                source=source,
                pairs=pairs,
            )
        except ValueError as problem:
            raise CannotProbe(str(problem)) from None
        if plan.requests <= options.max_requests:
            return plan
    raise CannotProbe(
        f"--max-requests {options.max_requests} is below the smallest probe "
        f"({workloads.smallest_requests()} requests: a writer, a re-ask, one "
        "sibling pair and a replay sibling, each cached and fresh twice)"
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
    client = Client(options.url, options.api_key, options.timeout)
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

    def send(prompt: list[int], salt: str, what: str) -> Completion:
        progress(probe.sent, plan.requests, what)
        done = client.complete(
            probe.model,
            prompt,
            salt=probe.salt_prefix + salt,
            max_tokens=options.max_tokens,
            logprobs=options.logprobs,
        )
        probe.sent += 1
        return done

    observed = _observe(plan, send)
    progress(probe.sent, plan.requests, "done")
    probe.after = read_metrics(client.metrics(), probe.model)
    probe.floor, probe.wild = noise_floor(observed)
    probe.bound = effective_threshold(options.threshold, probe.floor)
    probe.results = [judge_case(case, probe.bound) for case in observed]


def _observe(
    plan: workloads.Workload, send: Callable[[list[int], str, str], Completion]
) -> list[Observed]:
    """The writer and every case in one salt family, in order (each reuses what
    the requests before it left), then each case fresh, under new salts."""
    send(plan.writer, "cached", "writer")
    cached = {case.name: send(case.prompt, "cached", case.name) for case in plan.cases}
    observed, salts = [], iter(range(1, plan.requests + 1))
    for case in plan.cases:
        fresh = []
        for _ in range(workloads.FRESH_RUNS):
            done = send(case.prompt, f"fresh-{next(salts)}", f"{case.name} fresh")
            if done.cached_tokens:
                raise CannotProbe(
                    f"a request under a new cache_salt reused {done.cached_tokens} "
                    "cached tokens: the server does not isolate cache_salt "
                    "families, so no fresh reference can be computed"
                )
            fresh.append(done)
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
