"""Markdown for the benchmark report, from the data ``measure.py`` returns.

Nothing here runs vLLM: each section renders one measurement's data.
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable

from measure import (
    BUDGET_ONE_BLOCK,
    CACHING_OFF,
    FAMILIES,
    FAMILY_SHARE,
    LOAD_BUDGET,
    LOAD_GAPS,
    LOAD_OUTPUTS,
    LOAD_PREEMPTION_BLOCKS,
    LOAD_PRESSURE_BLOCKS,
    LOAD_PROMPTS,
    LOAD_REQUESTS,
    MODES,
    PREFILLING,
    SCHEDULING_MODES,
    STOCK,
    AlternativeTally,
    B,
    C,
    H,
    LoadTally,
    Overhead,
    Pairs,
    Scaling,
    Tally,
    summed,
)

from vllm_mamba_align.settings import DEFAULT_MODE


def ratio_line(pairs: Pairs, unit: str, scale: float) -> list[str]:
    """Stock's median over all pairings, then each mode with its paired ratios.

    The ratio is the geometric mean of the rounds' ratios: the rounds alternate
    which scheduler is built first, and the mean weighs both orders equally.
    """
    stock = [s for measured in pairs.values() for s, _ in measured]
    rows = [
        f"| {STOCK} | {statistics.median(stock) * scale:.1f} {unit} | 1.000 | "
        "(paired runs) |"
    ]
    for mode, measured in pairs.items():
        values = [v for _, v in measured]
        ratios = [v / s for s, v in measured]
        rows.append(
            f"| {mode} | {statistics.median(values) * scale:.1f} {unit} | "
            f"{statistics.geometric_mean(ratios):.3f} | "
            f"{min(ratios):.3f} - {max(ratios):.3f} |"
        )
    return rows


OWN_TIME_GOAL = 0.003
"""The plugin's own time per step the project holds itself to: 0.3 % of a
stock step, at every batch size."""
DECODE_CALL_GOAL = 1.1
"""A decode split call may cost at most 1.1x stock's."""


def overhead_section(data: Overhead) -> list[str]:
    """The plugin's own time per step at each batch, then per split call."""
    rows = []
    for batch in data.batches:
        stock_step = statistics.median(
            s for pairs in batch.per_step.values() for s, _ in pairs
        )
        label = batch.shape.label
        for mode, measured in batch.per_step.items():
            one_token = statistics.median(c[0] for c in batch.calls_per_step[mode])
            longer = statistics.median(c[1] for c in batch.calls_per_step[mode])
            own = data.own_time(batch, mode)
            ratios = [v / s for s, v in measured]
            rows.append(
                f"| {label} | {stock_step * 1e3:.2f} ms | {mode} | "
                f"{one_token:.0f} + {longer:.1f} | {own * 1e6:.1f} µs | "
                f"{own / stock_step:.3%} | {statistics.geometric_mean(ratios):.3f} "
                f"({min(ratios):.3f} - {max(ratios):.3f}) |"
            )
            label = ""
    decode_ratios = {
        mode: statistics.geometric_mean(p / s for s, p in pairs)
        for mode, pairs in data.decode_call.items()
    }
    worst_share = max(
        data.own_time(batch, mode)
        / statistics.median(s for pairs in batch.per_step.values() for s, _ in pairs)
        for batch in data.batches
        if not batch.shape.mixed
        for mode in batch.per_step
    )
    worst_decode = max(decode_ratios.values())
    verdict = (
        f"Largest own time on a decoding batch: {worst_share:.3%} of a stock step "
        f"(goal {OWN_TIME_GOAL:.1%}); largest decode call ratio: {worst_decode:.3f}x "
        f"stock's (goal {DECODE_CALL_GOAL}x)."
    )
    return [
        "### Hot path: the plugin's own time per step",
        "",
        f"Batches of 64, 256 and 1,024 running requests on the real scheduler, C={C}, "
        f"B={B}, budget 8192: all decoding, or mixed ({PREFILLING} prefilling "
        "4k-40k-token prompts, replaced as they finish). vLLM calls the split for "
        "every running request at every step. The plugin's own time per step is its "
        "split calls per step (one-token chunks, that is decodes, + longer ones, "
        "counted in the mode's own batch) times each call's extra cost over stock's "
        "(the per-call tables below; the median of the rounds' paired differences), "
        "plus, in audit, its look at each step's output (timed on the audited "
        "scheduler itself). The paired step ratio is wall time of `schedule()` + "
        "`update_from_output()`, the mode's scheduler and its own stock scheduler "
        "stepped alternately (the order alternating, which is built first "
        f"alternating by round), {data.rounds} rounds; `full`, `kept` and `grid` "
        "schedule other chunks than stock in mixed batches, so their steps there "
        "are not the same work.",
        "",
        verdict,
        "",
        "| batch | stock step (median) | mode | split calls per step | own time per "
        "step | share of a stock step | paired step ratio (range) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "### Overhead per `_mamba_block_aligned_split` call",
        "",
        f"{data.calls} calls per run in alternating blocks with stock, "
        f"{data.rounds} rounds. A decode is answered by the body's own past-prefill "
        "test before the route does any work; `off` binds vLLM's own function.",
        "",
        "| mode | per call, decoding request | ratio to stock | ratio range |",
        "|---|---|---|---|",
        *ratio_line(data.decode_call, "ns", 1e9),
        "",
        "| mode | per call, request mid-prefill | ratio to stock | ratio range |",
        "|---|---|---|---|",
        *ratio_line(data.prefill_call, "ns", 1e9),
    ]


def benefit_section(count: int, results: dict[str, dict[str, Tally]]) -> list[str]:
    """The workload's benefit and cost, one table per retention case."""
    rows = [
        "### Benefit and cost on a varied workload, per state retention",
        "",
        f"{count} prompts of 2k-48k tokens at budgets 2048/4096/8192/16384 (C={C}, "
        f"B={B} unless said, hash block {H}), each prompt alone, then an immediate "
        "re-ask and two siblings sharing the same random 20-100 % of it (the first "
        "makes vLLM keep the junction state, the second can reuse it). "
        '"kept states" are the boundary states vLLM\'s retention keeps that a '
        'prefill chunk materialized; "lost" those it would keep that fell inside '
        'a chunk; "non-canonical" kept states not computed one B block per '
        "chunk from token 0 (a cached continuation of those can differ from a "
        "fresh run in the last bits; `full` has none).",
        "",
    ]
    for label, tallies in results.items():
        rows += [f"Retention {label}:", "", *benefit_table(tallies), ""]
    return rows


def benefit_table(tallies: dict[str, Tally]) -> list[str]:
    stock = tallies[STOCK]
    rows = [
        "| | " + " | ".join(SCHEDULING_MODES) + " |",
        "|---|" + "---|" * len(SCHEDULING_MODES),
    ]

    def row(label: str, fn: Callable[[Tally], str]) -> str:
        return (
            f"| {label} | "
            + " | ".join(fn(tallies[m]) for m in SCHEDULING_MODES)
            + " |"
        )

    rows += [
        row("Mamba hashes published", lambda t: f"{t.published}"),
        row("… naming a wrong state (poisoned)", lambda t: f"**{t.poisoned}**"),
        row("requests that read a wrong state", lambda t: f"{t.wrong_reads}"),
        row("kept states materialized", lambda t: f"{t.kept_states}"),
        row("kept states lost inside a chunk", lambda t: f"{t.lost_kept}"),
        row("kept states materialized non-canonically", lambda t: f"{t.noncanonical}"),
        row(
            "re-ask reuse (of the prompt)",
            lambda t: f"{100 * t.reask_reuse / max(1, t.reask_legal):.1f} %",
        ),
        row(
            "sibling reuse (of the shared tokens)",
            lambda t: (
                f"{100 * t.sibling_reuse / max(1, t.sibling_shared):.1f} %"
                + (f" ({t.sibling_wrong} wrong)" if t.sibling_wrong else "")
            ),
        ),
        row("prefill steps per prompt", lambda t: f"{t.prefill_steps / t.prompts:.2f}"),
        row(
            "prefill steps vs stock",
            lambda t: f"{t.prefill_steps / stock.prefill_steps:.2f}x",
        ),
    ]
    return rows


def scaling_section(data: Scaling) -> list[str]:
    """Prefill steps against prompt length, budget / B and concurrency."""
    modes = SCHEDULING_MODES
    head = "| | " + " | ".join(modes) + " |"
    rule = "|---|" + "---|" * len(modes)

    def ratio_cells(values: dict[str, int]) -> str:
        base = values[STOCK]
        return " | ".join(
            f"{values[m]}" + ("" if m == STOCK else f" ({values[m] / base:.2f}x)")
            for m in modes
        )

    rows = [
        "### Cost against prompt length (lone request, budget 8192)",
        "",
        "Prefill steps = the request's time to first token, in steps.",
        "",
        head.replace("| |", "| prompt |", 1),
        rule,
    ]
    for length, values in data.by_length.items():
        rows.append(f"| {length} | {ratio_cells(values)} |")
    rows += [
        "",
        "### Cost against budget / B (lone 32,768-token prompt)",
        "",
        head.replace("| |", "| budget (÷ B) |", 1),
        rule,
    ]
    for budget, values in data.by_budget.items():
        rows.append(f"| {budget} ({budget / B:.1f}) | {ratio_cells(values)} |")
    rows += [
        "",
        "### Cost under load: N concurrent 16,764-token prefills, budget 8192",
        "",
        "Steps until every prompt has prefilled (throughput), the mean step at which "
        "a prompt finished its prefill (time to first token) and prompt tokens per "
        "step. Other requests fill the budget around the extra stops.",
        "",
        "| N | "
        + " | ".join(f"{m}: all / mean TTFT / tok per step" for m in modes)
        + " |",
        rule,
    ]
    for n, by_mode in data.concurrent.items():
        cells = []
        for m in modes:
            steps, ttft, per_step = by_mode[m]
            cells.append(f"{steps} / {ttft:.1f} / {per_step:.0f}")
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    return rows


def register_section(
    runs: int, results: dict[str, tuple[list[float], list[float]]]
) -> list[str]:
    """Medians of the import and ``register()`` times in fresh interpreters."""
    rows = [
        "### `register()` cost at process start",
        "",
        f"Timed inside {runs} fresh interpreters per case (interleaved), medians. "
        "`import` is `import vllm_mamba_align` (wrapt, packaging); `register()` is the "
        "entry point vLLM calls.",
        "",
        "| case | import | register() |",
        "|---|---|---|",
    ]
    for case, (imports, registers) in results.items():
        rows.append(
            f"| {case} | {statistics.median(imports) * 1e3:.1f} ms | "
            f"{statistics.median(registers) * 1e3:.2f} ms |"
        )
    return rows


def render(header: str, sections: list[list[str]]) -> str:
    """The whole report: a header paragraph, then each section."""
    lines = [header, ""]
    for section in sections:
        lines += [*section, ""]
    return "\n".join(lines)


def header(
    vllm_version: str,
    plugin_version: str,
    cpus: int | None,
    minutes: float,
    quick: bool,
    commit: str = "unknown",
    load: tuple[float, float] | None = None,
) -> str:
    busy = ""
    if load is not None:
        busy = (
            f"\n\n1-minute load average {load[0]:.2f} before the run and "
            f"{load[1]:.2f} after it, on {cpus} CPUs"
            + (
                " (the machine was shared: wall-time figures carry that noise; "
                "counts do not depend on load)."
                if max(load) > (cpus or 1) / 2 + 1
                else "."
            )
        )
    return (
        f"## Benchmarks (vLLM {vllm_version}, vllm-mamba-align {plugin_version}, "
        f"{cpus} CPUs)\n\n"
        "Produced by `benchmarks/bench.py`"
        + (" --quick" if quick else "")
        + f" (what `python3 -m nox -s bench` runs) at commit {commit} on "
        + f"{platform.machine()} with {cpus} CPUs, "
        + f"{minutes:.1f} minutes. Modes: "
        + ", ".join(f"`{m}`" for m in MODES)
        + " (`stock` = vLLM's own code, the plugin's wrappers removed)."
        + busy
    )


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "-"


def alternatives_table(rows: dict[str, AlternativeTally]) -> list[str]:
    """One retention case: every row's steps, tokens and correctness."""
    stock = next(iter(rows.values()))
    lines = [
        "| what runs | prefill steps | vs stock | prompt tokens computed "
        "| tokens per step | correctly reused tokens | resumed from a wrong state "
        "| wrong publications |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, t in rows.items():
        lines.append(
            f"| {label} | {t.steps} | {t.steps / stock.steps:.2f}x | "
            f"{t.computed:,} | {t.computed / t.steps:,.0f} | "
            f"{t.reused:,} ({_share(t.reused, t.reusable)}) | "
            f"{t.wrong_reused:,} | **{t.poisoned}** of {t.published} |"
        )
    return lines


def _row(rows: dict[str, AlternativeTally], start: str) -> AlternativeTally:
    return next(t for label, t in rows.items() if label.startswith(start))


def alternatives_headline(results: dict[str, dict[str, AlternativeTally]]) -> str:
    """One sentence from the first case (vLLM's default retention)."""
    rows = next(iter(results.values()))
    unset = _row(rows, "plugin, mode unset")
    stock = _row(rows, "stock vLLM")
    full = _row(rows, "plugin `full`")
    budget = _row(rows, BUDGET_ONE_BLOCK)
    off = _row(rows, CACHING_OFF)
    return (
        f"At vLLM's default state retention the plugin's default mode "
        f"(`{DEFAULT_MODE.value}`) serves this "
        f"workload in {unset.steps / stock.steps:.2f}x stock's prefill steps "
        f"({unset.steps / full.steps:.2f}x `full`'s, "
        f"{unset.steps / budget.steps:.2f}x those of a one-block step budget), "
        f"computes {unset.computed / off.computed:.2f}x the prompt tokens of "
        f"prefix caching off, reuses {_share(unset.reused, unset.reusable)} of "
        f"the shareable tokens correctly (stock: "
        f"{_share(stock.reused, stock.reusable)}, with "
        f"{stock.wrong_reused:,} more tokens resumed from wrong states) and "
        f"publishes {unset.poisoned} wrong states (stock: {stock.poisoned})."
    )


def alternatives_section(
    count: int, results: dict[str, dict[str, AlternativeTally]]
) -> list[str]:
    """The headline, then one table per retention case."""
    lines = [
        "### What users do instead, side by side",
        "",
        alternatives_headline(results),
        "",
        f"{count} prompts of 2k-48k tokens (C={C}, B={B} unless said, hash block "
        f"{H}), grouped by their step budget (2048/4096/8192/16384); per group "
        "four rounds of concurrent requests: every prompt, then every prompt's "
        "re-ask, then a first and a second sibling sharing a random 20-100 % of "
        "it (the first makes vLLM keep the junction state, the second can reuse "
        "it). Every row serves the same requests in the same order on the real "
        "scheduler. Rows: stock vLLM; prefix caching off (vLLM's Mamba cache "
        f"mode `none`); `{BUDGET_ONE_BLOCK}`: stock with "
        "`--max-num-batched-tokens` B, within [B, 2B), so a prefill step "
        "advances at most one state block (this caps every step, so it also "
        "replaces each group's budget; with C < B it does not keep stock's "
        "chunks on the state grid, see docs/modes.md); the plugin's fixing "
        "modes; the plugin "
        "with `VLLM_MAMBA_ALIGN_MODE` unset. One output token per request, so "
        "every step is a prefill step. *Correctly reused*: prompt tokens a "
        "request skipped by resuming from a cached state that holds what its "
        "hash names (share: of the tokens it shares with requests served "
        "before); *wrong publications*: Mamba hashes naming a state their block "
        "does not hold, of all published.",
        "",
    ]
    for label, rows in results.items():
        lines += [f"Retention {label}:", "", *alternatives_table(rows), ""]
    return lines


def _ratio(value: float, stock: float) -> str:
    return f"{value / stock:.3f}x" if stock else "-"


def load_table(rows: dict[str, list[LoadTally]]) -> list[str]:
    """One concurrent workload: each mode's counts summed over the seeds, its
    TTFT against stock's, and its correctness counts."""
    stock = summed(rows[STOCK])
    lines = [
        "| mode | steps to drain | TTFT, steps (summed) | vs stock | per seed "
        "| prefill chunks / request | prefill tokens / step | reused tokens "
        "| preemptions | wrong publications | wrong reads | kept states lost |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, tallies in rows.items():
        total = summed(tallies)
        lines.append(
            f"| {mode} | {total.steps:,} | {total.ttft:,} "
            f"| {_ratio(total.ttft, stock.ttft)} "
            f"| {_per_seed(tallies, rows[STOCK])} | {total.chunks_per_request:.2f} "
            f"| {total.prefill_tokens_per_step:,.0f} | {total.reused:,} "
            f"| {total.preemptions:,} | {total.poisoned} of {total.published:,} "
            f"| {total.wrong_reads} | {total.lost_kept} |"
        )
    return lines


def ablation_table(rows: dict[str, list[LoadTally]]) -> list[str]:
    """Lean, and lean with one change each: what each of its stops costs in
    time to first token, and what goes wrong without it."""
    stock = summed(rows[STOCK])
    lines = [
        "| run | TTFT, steps (summed) | vs stock | per seed "
        "| prefill chunks / request | reused tokens | wrong publications "
        "| wrong reads | kept states lost | prompt checkpoints published |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run, tallies in rows.items():
        total = summed(tallies)
        lines.append(
            f"| {run} | {total.ttft:,} | {_ratio(total.ttft, stock.ttft)} "
            f"| {_per_seed(tallies, rows[STOCK])} | {total.chunks_per_request:.2f} "
            f"| {total.reused:,} | {total.poisoned} of {total.published:,} "
            f"| {total.wrong_reads} | {total.lost_kept} "
            f"| {total.prompt_checkpoints} of {total.requests} |"
        )
    return lines


def _per_seed(tallies: list[LoadTally], stock: list[LoadTally]) -> str:
    """Each seed's TTFT against stock's on the same seed."""
    return " / ".join(
        _ratio(t.ttft, s.ttft) for t, s in zip(tallies, stock, strict=True)
    )


def ablation_section(ablations: dict[str, dict[str, list[LoadTally]]]) -> list[str]:
    """What each of lean's stops costs where the backend checkpoints."""
    lines = [
        "### What each of lean's stops costs, with backend checkpoints",
        "",
        "The same workloads and seeds, lean run again with one change each "
        "(composed outside the package in benchmarks/ablation.py from the "
        "split's public pieces: lean's rule reading a retention blind to the "
        "replay boundaries or the junctions, its route run past the tail stop, "
        "or one decision of the policy turned off). The backend's in-chunk write "
        "is the prompt checkpoint (vLLM's partial tail, the prompt length "
        "minus one floored to the hash block), into the slot of the replay "
        "boundary (the same length floored to B); vLLM then publishes that "
        "slot under the checkpoint's hash instead of the boundary's. Lean "
        "leaves that boundary to the checkpoint, as stock does "
        "(`StopPolicy.yield_replay_to_checkpoint`); *with a replay-boundary "
        "stop where the backend checkpoints* ends a chunk on the boundary "
        "there too, as `kept` does: from that boundary no backend can "
        "checkpoint the tail (its slot is the boundary's own), so vLLM stops "
        "at the tail as well, two more chunks to keep the boundary's state "
        "beside the checkpoint's. Its *kept states lost* are exactly those "
        "boundaries in lean's row. *Tail stops after a kept stop*: vLLM's own "
        "stop at the partial tail in the chunk that starts on a kept boundary. "
        "*Prompt checkpoints published*: requests whose partial-tail state a "
        "Mamba hash published (what a re-ask of the same prompt resumes from).",
        "",
    ]
    for label, rows in ablations.items():
        lines += [f"{label[0].upper()}{label[1:]}:", "", *ablation_table(rows), ""]
    return lines


def load_section(
    seeds: tuple[int, ...], results: dict[str, dict[str, list[LoadTally]]]
) -> list[str]:
    """Every concurrent workload's table, after what was run."""
    lines = [
        "### Concurrent load, counted on the scheduler",
        "",
        f"{LOAD_REQUESTS} requests per workload arriving over time (a new one "
        f"every {LOAD_GAPS[0]}-{LOAD_GAPS[1]} steps, uniform; the engine waits "
        "without stepping when nothing is queued), prompts of "
        f"{LOAD_PROMPTS[0]:,}-{LOAD_PROMPTS[1]:,} tokens (uniform), "
        f"{LOAD_OUTPUTS[0]}-{LOAD_OUTPUTS[1]} output tokens each (uniform), so "
        "decodes share every step's budget; C = "
        f"{C}, B = {B}, hash block {H}, budget {LOAD_BUDGET:,}, vLLM's default "
        f"state retention (0); seeds {', '.join(map(str, seeds))}, each mode "
        "serving the same requests in the same order. *Prefix families*: "
        f"{FAMILY_SHARE:.0%} of the requests extend one of {FAMILIES} shared "
        "prefixes of 4,000-12,000 tokens. *KV pressure*: a pool of "
        f"{LOAD_PRESSURE_BLOCKS} blocks; *preemption*: {LOAD_PREEMPTION_BLOCKS} "
        "blocks with requests admitted without reserving their input. *Backend "
        "checkpoints*: `num_prefill_checkpoint_blocks` = 1, alignment "
        "lcm(hash block, 64), as Qwen3-Next's GDN declares on FlashInfer, "
        "vLLM's `compute_mamba_prefill_checkpoints` placing the backend's "
        "in-chunk write (else none, as on the CPU engine). *TTFT*: steps from a "
        "request's arrival to its first token, summed over requests and seeds "
        "(*per seed*: each seed's ratio to stock). *Wrong publications*: Mamba "
        "hashes naming a state their block does not hold; *wrong reads*: "
        "requests that resumed from such a state; *kept states lost*: "
        "boundaries vLLM keeps whose state was never written. Counts, not "
        "times: they do not depend on the machine's load.",
        "",
    ]
    for label, rows in results.items():
        lines += [f"{label[0].upper()}{label[1:]}:", "", *load_table(rows), ""]
    return lines
