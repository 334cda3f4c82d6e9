"""The probe's verdict, exit status and report (a table, or JSON).

Exit status: 0 no cached continuation differs from a fresh one beyond the
server's measured rounding (and the server did reuse cached tokens); 1 wrong
states served (the cases beyond ``ROUNDING_MARGIN`` x that rounding are named);
2 the server could not be probed (the reason and the way out are printed); 5
cannot tell on this server: a case differs by more than rounding but not by
enough to call it wrong, or the rounding measurement itself parted outside the
top-k, so that nothing can be called wrong against it (the cases are named,
with the bound a wrong state must pass there), or its requests reached more
than one server behind the URL (replicas behind a load balancer: each has a
prefix cache of its own, so the probe is pointed at one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..version import __version__
from .judge import (
    NOISE_MARGIN,
    ROUNDING_MARGIN,
    ROUNDING_SLACK,
    SEES_NOTHING_BEYOND,
    CaseResult,
    RoundingPair,
    Verdict,
)
from .run import RANK_HEADER, Probe, Ranks

EXIT_CLEAN = 0
EXIT_WRONG_STATES = 1
EXIT_CANNOT_PROBE = 2
EXIT_CANNOT_TELL = 5
NO_DETAILS = (
    "the server does not report usage.prompt_tokens_details.cached_tokens, so "
    "the probe cannot see what each request reused: start vLLM with "
    "--enable-prompt-tokens-details"
)


@dataclass(frozen=True)
class Decision:
    exit_code: int
    verdict: str


def _hits(probe: Probe) -> float | None:
    before, after = probe.before.hits, probe.after.hits
    return None if before is None or after is None else after - before


def _several_servers(probe: Probe) -> str:
    counted = probe.prompt_tokens_counted or 0.0
    return (
        f"the /metrics behind {probe.base or probe.options.url} counted "
        f"{counted:,.0f} prompt tokens while the probe sent "
        f"{probe.prompt_tokens_sent:,}, so its requests reached more than one "
        "server (replicas behind a load balancer?), each with a prefix cache of "
        "its own: probe each replica at its own address (--url "
        "http://REPLICA_HOST:PORT)"
    )


def decide(probe: Probe) -> Decision:
    if probe.problem is not None:
        return Decision(EXIT_CANNOT_PROBE, f"could not probe: {probe.problem}")
    if probe.wild:
        return Decision(
            EXIT_CANNOT_PROBE,
            "could not probe: two fresh runs of one prompt chose tokens outside "
            "each other's top-k, so the server's own noise hides any wrong state "
            "(concurrent load on GPU kernels that are not batch-invariant): probe "
            "at a quieter time, or with --max-tokens 1",
        )
    diverged = [r.name for r in probe.results if r.verdict is Verdict.DIVERGED]
    if probe.reached_other_servers and not diverged:
        reused = sum(1 for r in probe.results if r.cached_tokens)
        return Decision(
            EXIT_CANNOT_TELL,
            f"[??] cannot tell on this server: {_several_servers(probe)}. "
            f"{reused} of {len(probe.results)} cases read cached states, some "
            "perhaps on another replica than their writer's, from what the "
            "probe's other requests left there",
        )
    if probe.rounding_wild:
        return Decision(
            EXIT_CANNOT_TELL,
            "[??] cannot tell on this server: the same tokens computed in "
            "differently chunked runs (nothing cached) chose tokens outside "
            "each other's top-k, so this server's chunk-shape rounding alone "
            "moves logprobs as far as a wrong state, and no case is called "
            "wrong against it: probe at a quieter time; `full` mode makes a "
            "cached continuation equal a fresh one",
        )
    if diverged:
        also = (
            f"; and {_several_servers(probe)}, to find which serves them"
            if probe.reached_other_servers
            else ""
        )
        return Decision(
            EXIT_WRONG_STATES,
            f"[!!] wrong states served: {', '.join(diverged)} continued from a "
            "cached state differently from a fresh run of the same prompt" + also,
        )
    unresolved = [r.name for r in probe.results if r.verdict is Verdict.UNRESOLVED]
    if unresolved:
        return Decision(
            EXIT_CANNOT_TELL,
            f"[??] cannot tell on this server: {', '.join(unresolved)} differed "
            f"from a fresh run by more than its rounding ({probe.bound.ok:.3g}) "
            f"but not beyond {probe.bound.wrong:.3g} ({ROUNDING_MARGIN:g}x the "
            "chunk-shape rounding measured with nothing cached), where a "
            "wrong state would be called: probe again with another --seed; "
            "in `full` mode a cached continuation equals a fresh one",
        )
    cached = [r.cached_tokens for r in probe.results]
    if all(c is None for c in cached):
        hits = _hits(probe)
        if hits is None:
            return Decision(EXIT_CANNOT_PROBE, f"could not probe: {NO_DETAILS}")
        if hits == 0:
            return Decision(
                EXIT_CANNOT_PROBE,
                "could not probe: vllm:prefix_cache_hits did not grow while the "
                "probe ran: nothing was served from the cache (prefix caching is "
                f"off or reuses nothing); and {NO_DETAILS}",
            )
        return Decision(
            EXIT_CLEAN,
            "[ok] no cached continuation differs from a fresh run beyond the "
            f"noise; the server counted {hits:,.0f} prefix-cache hit tokens "
            f"(every client's) while the probe ran, but {NO_DETAILS}",
        )
    if not any(cached):
        return Decision(
            EXIT_CANNOT_PROBE,
            f"could not probe: no request reused a cached token ({probe.sent} "
            "requests sharing prefixes): prefix caching is off, or reuses nothing "
            "(see 'Prefix caching does nothing' in the troubleshooting guide)",
        )
    reused = sum(1 for c in cached if c)
    if probe.bound.wrong > SEES_NOTHING_BEYOND:
        return Decision(
            EXIT_CANNOT_TELL,
            f"[??] cannot tell on this server: {reused} of {len(cached)} cases "
            f"read cached states within {probe.bound.ok:.3g} of a fresh run, but "
            f"only a difference beyond {probe.bound.wrong:.3g} would be called a "
            f"wrong state, above {SEES_NOTHING_BEYOND:g}, the largest wrong state "
            "measured on a GPU's Mamba2 kernels: the rounding (measured, or "
            "given by --rounding) is too large to separate them",
        )
    if not probe.bound.measured:
        # Every case within the noise threshold of its fresh run, with no
        # rounding measured to call anything beyond it wrong: the continuations
        # themselves are the evidence, and a difference would have been exit 5.
        return Decision(
            EXIT_CLEAN,
            f"[ok] no wrong state served: {reused} of {len(cached)} cases read "
            "cached states, each continuing as a fresh run does within "
            f"{probe.bound.ok:.3g}; the chunk-shape rounding could not be "
            "measured (the runs chunked differently came out alike), so a "
            "larger difference would have been reported as cannot tell",
        )
    return Decision(
        EXIT_CLEAN,
        f"[ok] no wrong state served: {reused} of {len(cached)} cases read "
        "cached states, each continuing as a fresh run does within "
        f"{probe.bound.ok:.3g}; the smallest wrong state it would have caught "
        f"differs by more than {probe.bound.wrong:.3g}",
    )


def _server_lines(probe: Probe) -> list[str]:
    metrics = probe.before
    if not metrics.available:
        return ["server     no /metrics endpoint: mode and geometry unknown"]
    lines = []
    for info in metrics.plugin:
        lines.append(
            f"server     vllm-mamba-align {info.get('plugin_version', '?')} "
            f"mode={info.get('mode', '?')} ({info.get('status', '?')}) on vLLM "
            f"{info.get('vllm_version', '?')}, engine {info.get('engine', '?')}: "
            f"C={info.get('cache_block', '?')} B={info.get('state_block', '?')} "
            f"hash block {info.get('hash_block', '?')}"
        )
    if not metrics.plugin:
        lines.append(
            "server     no vllm_mamba_align_info on /metrics: the plugin is not "
            "loaded, or Prometheus is not in multiprocess mode "
            "(PROMETHEUS_MULTIPROC_DIR)"
        )
    config = metrics.cache_config
    if config:
        lines.append(
            "           prefix caching "
            f"{'on' if metrics.prefix_caching else 'off'}, mamba_cache_mode "
            f"{config.get('mamba_cache_mode', '?')}, mamba_block_size "
            f"{config.get('mamba_block_size', '?')}, retention "
            f"{_retention_words(metrics.retention)} (vllm:cache_config_info)"
        )
    return lines


def engine_lines(probe: Probe) -> list[str]:
    """On a data-parallel server: where the probe's reuse happened."""
    before, after = probe.before.hits_by_engine, probe.after.hits_by_engine
    if len(after) < 2:
        return []
    rank = str(probe.options.rank)
    grew = {engine: after[engine] - before.get(engine, 0.0) for engine in sorted(after)}
    counts = ", ".join(f"engine {e} +{v:,.0f}" for e, v in grew.items())
    others = [e for e, v in grew.items() if e != rank and v]
    where = (
        "other clients' traffic, or the header was not honoured: the probe's "
        f"reuse may be split across engines ({', '.join(others)})"
        if others
        else f"all on engine {rank}"
    )
    return [
        f"  engines    {len(after)} engine cores (data parallel); every request "
        f"sent with {RANK_HEADER}: {rank}; prefix-cache hits {counts}: {where}"
    ]


def _retention_words(value: str | None) -> str:
    if value is None:
        return "not reported (before 0.29.0: VLLM_PREFIX_CACHE_RETENTION_INTERVAL)"
    if value == "None":
        return "None (every state kept)"
    if value == "0":
        return "0 (replay boundaries and shared-prefix junctions)"
    return value


def _number(value: float) -> str:
    return "0" if value == 0 else f"{value:.2g}"


def _tokens(result: CaseResult) -> str:
    parted = result.versus_fresh.parted_at
    if parted is None:
        return "same"
    return f"part@{parted}" + ("!" if result.versus_fresh.outside_top_k else "")


def render_text(probe: Probe) -> str:
    decision = decide(probe)
    options = probe.options
    lines = [
        f"vllm-mamba-align {__version__} probe of {probe.base or options.url}"
        + (
            f" (model {probe.model}, max_model_len {probe.max_model_len})"
            if probe.model
            else ""
        )
    ]
    if probe.model:
        lines += ["  " + line for line in _server_lines(probe)]
    plan = probe.workload
    if plan is not None:
        b = "unknown" if plan.state_block is None else str(plan.state_block)
        lines.append(
            f"  workload   writer {len(plan.writer):,} tokens, B={b} "
            f"({plan.state_block_source}); seed {plan.seed}; {probe.sent} of "
            f"{plan.requests} completions sent, one request at a time; "
            f"rank {options.rank}; top-{options.logprobs} "
            f"logprobs of {options.max_tokens} greedy "
            f"token{'s' if options.max_tokens > 1 else ''}; salts "
            f"{probe.salt_prefix}*"
        )
    if probe.results:
        lines.append(
            f"  noise      fresh vs fresh: max |dlogprob| {_number(probe.floor)}; "
            f"rounding {_number(probe.rounding_floor)} "
            + (
                "(given: --rounding)"
                if options.rounding is not None
                else f"({_rounding_words(probe)})"
            )
        )
        lines.append(
            f"  bounds     rounding up to {probe.bound.ok:.3g}, wrong state beyond "
            f"{probe.bound.wrong:.3g} (max of --threshold {options.threshold:g}, "
            f"{NOISE_MARGIN:g}x the noise, and {ROUNDING_SLACK:g}x / "
            f"{ROUNDING_MARGIN:g}x the rounding)"
        )
        hits = _hits(probe)
        if hits is not None:
            queries = (probe.after.queries or 0) - (probe.before.queries or 0)
            lines.append(
                f"  reuse      vllm:prefix_cache_hits +{hits:,.0f} of "
                f"+{queries:,.0f} queried tokens while the probe ran (every client)"
            )
        if probe.reached_other_servers:  # said only when it matters
            lines.append(
                f"  servers    vllm:prompt_tokens "
                f"+{probe.prompt_tokens_counted or 0:,.0f} while the probe sent "
                f"{probe.prompt_tokens_sent:,} prompt tokens: its requests "
                "reached more than one server"
            )
        engines = engine_lines(probe)
        lines += engines
        lines += ["", _table(probe)]
    lines += ["", f"verdict: {decision.verdict} (exit {decision.exit_code})"]
    return "\n".join(lines)


def _rounding_words(probe: Probe) -> str:
    """How the rounding was measured, and which measurements were not used."""
    prompts = len(probe.rounding)
    reproduced = prompts - probe.rounding_unreproduced
    words = (
        f"{prompts} prompts, nothing cached: serial prefill vs prefill beside a "
        f"filler; decode steps vs prefill on {reproduced} of {prompts}"
    )
    if probe.rounding_unreproduced:
        words += (
            f", not on {probe.rounding_unreproduced}, whose two fresh decode runs "
            "differed: decode steps are not reproducible on this server"
        )
    if not probe.rounding_measured:
        words += "; NOT MEASURED: no case is called wrong against it"
    return words


def _table(probe: Probe) -> str:
    header = (
        "case",
        "prompt",
        "shared",
        "cached",
        "vs fresh",
        "fresh/fresh",
        "tokens",
        "verdict",
    )
    rows = [header]
    for r in probe.results:
        rows.append(
            (
                r.name,
                f"{r.prompt_tokens:,}",
                f"{r.shared:,}",
                "?" if r.cached_tokens is None else f"{r.cached_tokens:,}",
                _number(r.versus_fresh.delta),
                _number(r.fresh_versus_fresh.delta),
                _tokens(r),
                r.verdict.value,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  "
        + "  ".join(
            cell.ljust(w) if i in (0, 6, 7) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    )


def _rounding_json(pair: RoundingPair) -> dict[str, Any]:
    agreement = pair.decode_agreement()
    beside = pair.beside_difference()
    return {
        "prompt_tokens": pair.prompt_tokens,
        "decode_steps": len(pair.decoded.tokens),
        "decode_vs_prefill": pair.difference().to_json(),
        "decode_vs_decode": None if agreement is None else agreement.to_json(),
        "decode_used": pair.reproduced,
        "serial_vs_beside_filler": None if beside is None else beside.to_json(),
    }


def to_json(probe: Probe) -> str:
    return json.dumps(_report(probe), indent=1)


def _report(probe: Probe) -> dict[str, Any]:
    decision = decide(probe)
    options = probe.options
    plan = probe.workload
    data: dict[str, Any] = {
        "probe_version": __version__,
        "url": probe.base or options.url,
        "rank": options.rank,
        "model": probe.model or None,
        "max_model_len": probe.max_model_len,
        "exit_code": decision.exit_code,
        "verdict": decision.verdict,
        "problem": probe.problem,
        "metrics_before": probe.before.to_json(),
        "metrics_after": probe.after.to_json(),
        "workload": None
        if plan is None
        else {
            "writer_tokens": len(plan.writer),
            "state_block": plan.state_block,
            "state_block_source": plan.state_block_source,
            "seed": plan.seed,
            "requests": plan.requests,
            "prompt_tokens": plan.prompt_tokens,
        },
        "requests_sent": probe.sent,
        "prompt_tokens_sent": probe.prompt_tokens_sent,
        "prompt_tokens_counted": probe.prompt_tokens_counted,
        "reached_other_servers": probe.reached_other_servers,
        "salt_prefix": probe.salt_prefix or None,
        "logprobs": options.logprobs,
        "max_tokens": options.max_tokens,
        "noise_floor": probe.floor,
        "rounding_floor": probe.rounding_floor,
        "rounding_given": options.rounding is not None,
        "rounding_measured": probe.rounding_measured,
        "rounding": [_rounding_json(pair) for pair in probe.rounding],
        "threshold": options.threshold,
        "effective_threshold": probe.bound.wrong,
        "bounds": probe.bound.to_json(),
        "cases": [r.to_json() for r in probe.results],
    }
    return data


def decide_ranks(ranks: Ranks) -> Decision:
    """Every rank's verdict in one: 1 if any rank serves a wrong state; else
    2 if one could not be probed; else 5 if one cannot be told; else 0."""
    if ranks.problem is not None:
        return Decision(
            EXIT_CANNOT_PROBE, f"could not count the ranks: {ranks.problem}"
        )
    decided = [(p.options.rank, decide(p)) for p in ranks.probes]
    for code in (EXIT_WRONG_STATES, EXIT_CANNOT_PROBE, EXIT_CANNOT_TELL):
        named = [(rank, d) for rank, d in decided if d.exit_code == code]
        if named:
            which = ", ".join(str(rank) for rank, _ in named)
            first_rank, first = named[0]
            several = f"s {which} of {len(decided)} (rank {first_rank}'s verdict)"
            return Decision(
                code,
                f"rank{several if len(named) > 1 else f' {which} of {len(decided)}'}"
                f": {first.verdict}",
            )
    reused = sum(1 for p in ranks.probes for r in p.results if r.cached_tokens)
    counted = (
        ""
        if ranks.count is not None
        else f" (one rank: {ranks.source}; the probe sent to rank 0)"
    )
    return Decision(
        EXIT_CLEAN,
        f"[ok] no wrong state served on any of {len(decided)} ranks{counted}: "
        f"{reused} cases read cached states, each within its rank's rounding",
    )


def render_ranks_text(ranks: Ranks) -> str:
    decision = decide_ranks(ranks)
    lines = []
    if ranks.problem is None:
        lines.append(
            f"ranks      {ranks.count if ranks.count is not None else 1} "
            f"({ranks.source}), probed in turn, each under salts of its own"
        )
    for probe in ranks.probes:
        lines += ["", f"== rank {probe.options.rank} ==", render_text(probe)]
    lines += ["", f"verdict: {decision.verdict} (exit {decision.exit_code})"]
    return "\n".join(lines)


def ranks_to_json(ranks: Ranks) -> str:
    decision = decide_ranks(ranks)
    return json.dumps(
        {
            "probe_version": __version__,
            "exit_code": decision.exit_code,
            "verdict": decision.verdict,
            "problem": ranks.problem,
            "ranks_count": ranks.count,
            "ranks_source": ranks.source,
            "ranks": [_report(probe) for probe in ranks.probes],
        },
        indent=1,
    )
