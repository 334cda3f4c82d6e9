"""The probe's verdict, exit status and report (a table, or JSON).

Exit status: 0 where ``judge.exit_zero_refusal`` holds (every case that read
cached tokens within a bound made of trusted measurements, that bound below
``SMALLEST_WRONG_STATE``, and usage details showing the reuse); 1 wrong
states served (the cases beyond the wrong-state bound are named);
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
    NO_REUSE,
    NO_USAGE_DETAILS,
    NOISE_BAND,
    NOISE_MARGIN,
    ROUNDING_SLACK,
    SMALLEST_WRONG_STATE,
    UNMEASURED,
    CaseResult,
    RoundingPair,
    Trust,
    Verdict,
    exit_zero_refusal,
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


def _other_engines(probe: Probe) -> str:
    counted = probe.rank_prompt_tokens_counted or 0.0
    where = probe.base or probe.options.url
    return (
        f"engine {probe.options.rank} on the /metrics of {where} "
        f"counted {counted:,.0f} prompt tokens while the probe sent "
        f"{probe.prompt_tokens_sent:,} to it ({RANK_HEADER}: {probe.options.rank}), "
        "so its requests were spread over the server's engines (a proxy that "
        "drops the header, or a release that ignores it), each with a prefix "
        "cache of its own: probe the API server directly, or a proxy that "
        "passes the header on"
    )


def decide(probe: Probe) -> Decision:
    """The verdict. Exit 0 only where ``judge.exit_zero_refusal`` finds
    nothing to refuse; any other case with a difference is 1 beyond the
    wrong-state bound (measured by a trusted measurement), else 5."""
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
    spread = (
        _several_servers(probe)
        if probe.reached_other_servers
        else _other_engines(probe)
        if probe.reached_other_engines
        else f"the probe asked for {probe.header_ignored}"
        if probe.header_ignored
        else None
    )
    if spread is not None and not diverged:
        reused = sum(1 for r in probe.results if r.cached_tokens)
        return Decision(
            EXIT_CANNOT_TELL,
            f"[??] cannot tell on this server: {spread}. "
            f"{reused} of {len(probe.results)} cases read cached states, some "
            "perhaps elsewhere than their writer's, from what the probe's other "
            "requests left there",
        )
    if diverged:
        also = f"; and {spread}, to find which serves them" if spread else ""
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
            + (
                f"but not beyond {probe.bound.wrong:.3g}, where a wrong state "
                "would be called: probe again with another --seed"
                if probe.bound.measured
                else f"and {_unmeasured_words(probe)}, so nothing is called a "
                "wrong state against it"
            )
            + "; in `full` mode a cached continuation equals a fresh one",
        )
    refusal = exit_zero_refusal(probe.results, probe.bound)
    cached = [r.cached_tokens for r in probe.results]
    reused = sum(1 for c in cached if c)
    if refusal is None:
        identical = all(
            r.verdict is Verdict.EXACT for r in probe.results if r.cached_tokens
        )
        return Decision(
            EXIT_CLEAN,
            f"[ok] no wrong state served: {reused} of {len(cached)} cases read "
            "cached states, each continuing as a fresh run does "
            + (
                "bit for bit"
                if identical
                else f"within {probe.bound.ok:.3g} (below "
                f"{SMALLEST_WRONG_STATE:g}, the smallest wrong state the probe "
                "claims to see)"
            ),
        )
    if refusal == NO_USAGE_DETAILS:
        differs = [r.name for r in probe.results if r.verdict is Verdict.ROUNDING]
        if differs:
            return Decision(
                EXIT_CANNOT_TELL,
                f"[??] cannot tell on this server: {', '.join(differs)} differed "
                f"from a fresh run within {probe.bound.ok:.3g}, but {NO_DETAILS}; "
                "vllm:prefix_cache_hits counts every client's hits, so the "
                "probe's own requests may have read nothing",
            )
        hits = _hits(probe)
        if hits is None or hits == 0:
            return Decision(EXIT_CANNOT_PROBE, f"could not probe: {NO_DETAILS}")
        return Decision(
            EXIT_CANNOT_PROBE,
            f"could not probe: {NO_DETAILS} (the server counted {hits:,.0f} "
            "prefix-cache hit tokens while the probe ran, every client's: not "
            "evidence that the probe's requests read a cached state)",
        )
    if refusal == UNMEASURED:
        differs = [
            r.name
            for r in probe.results
            if r.cached_tokens and r.versus_fresh.delta > probe.bound.threshold
        ]
        return Decision(
            EXIT_CANNOT_TELL,
            f"[??] cannot tell on this server: {', '.join(differs)} differed from "
            f"a fresh run by more than --threshold ({probe.bound.threshold:g}), "
            f"within the noise bound ({probe.bound.ok:.3g}), and "
            f"{_unmeasured_words(probe)}: the noise of runs chunked alike does "
            "not stand for it; probe at a quieter time",
        )
    if refusal == NO_REUSE:
        return Decision(
            EXIT_CANNOT_PROBE,
            f"could not probe: no request reused a cached token ({probe.sent} "
            "requests sharing prefixes): prefix caching is off, or reuses nothing "
            "(see 'Prefix caching does nothing' in the troubleshooting guide)",
        )
    return Decision(
        EXIT_CANNOT_TELL,
        f"[??] cannot tell on this server: {reused} of {len(cached)} cases read "
        f"cached states within {probe.bound.ok:.3g} of a fresh run, but a bound "
        f"that large passes wrong states of {SMALLEST_WRONG_STATE:g} and more "
        "(an H200's Mamba2 wrong states read near their boundary: 0.28-0.40): "
        "the noise or rounding (measured, or given by --rounding) is too large "
        "to separate them; probe at a quieter time",
    )


def _unmeasured_words(probe: Probe) -> str:
    """Why the rounding could not call a wrong state."""
    if probe.rounding_wild:
        return (
            "the same tokens computed in differently chunked runs (nothing "
            "cached) chose tokens outside each other's top-k: this server's "
            "rounding alone moves logprobs as far as a wrong state"
        )
    unverified = sum(1 for s in probe.rounding_samples if s.trust is Trust.UNVERIFIED)
    if unverified:
        return (
            "the rounding rests only on prefills beside a filler, which a "
            "client cannot verify moved a chunk end (batching alone differs "
            "less than a chunk end moved), with no reproducible decode steps to "
            "confirm them"
        )
    return "the runs chunked differently came out alike: no rounding was measured"


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
            f"{NOISE_MARGIN:g}x / {NOISE_BAND * NOISE_MARGIN:g}x the noise, and "
            f"{ROUNDING_SLACK:g}x / {probe.rounding_margin:.3g}x the rounding)"
            + ("" if probe.bound.measured else "; no case is called wrong")
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
    if probe.rounding_departed:
        words += (
            f", nor on {probe.rounding_departed} whose decode steps agreed but "
            "left the prefill's top-k while the prefill beside the filler did not"
        )
    counts = {
        trust: sum(1 for s in probe.rounding_samples if s.trust is trust)
        for trust in Trust
    }
    words += "; samples " + ", ".join(f"{n} {t.value}" for t, n in counts.items())
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
        "decode_used": pair.decode_used,
        "decode_departs_from_prefill": pair.decode_departs,
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
        "reached_other_engines": probe.reached_other_engines,
        "rank_prompt_tokens_counted": probe.rank_prompt_tokens_counted,
        "salt_prefix": probe.salt_prefix or None,
        "logprobs": options.logprobs,
        "max_tokens": options.max_tokens,
        "noise_floor": probe.floor,
        "rounding_floor": probe.rounding_floor,
        "rounding_given": options.rounding is not None,
        "rounding_measured": probe.rounding_measured,
        "rounding": [_rounding_json(pair) for pair in probe.rounding],
        "rounding_samples": [sample.to_json() for sample in probe.rounding_samples],
        "rounding_margin": probe.rounding_margin,
        "smallest_wrong_state": SMALLEST_WRONG_STATE,
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
    if ranks.count is None:  # --ranks all (a count given was checked: 5)
        return Decision(
            EXIT_CLEAN,
            "[ok] no wrong state served by the one engine the server answers "
            f"as: {ranks.source}; {reused} cases read cached states, each within "
            "its rounding",
        )
    return Decision(
        EXIT_CLEAN,
        f"[ok] no wrong state served on any of {len(decided)} ranks: "
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
