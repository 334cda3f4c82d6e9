"""Benefit and cost of the plugin, measured on the installed vLLM's real scheduler.

Run: ``python benchmarks/bench.py [--output benchmarks/RESULTS.md] [--quick]``
(or ``nox -s bench``). Prints one markdown report. Every mode of
``settings.Mode`` is measured next to stock vLLM, so a new mode shows up by itself.

How it measures (CPU only, no weights; see vllm_mamba_align/tools/simulation.py):

- overhead: wall time of ``schedule()`` + ``update_from_output()`` per step on a
  64-request mixed prefill/decode batch, modes interleaved round by round (stock,
  then each mode, the order rotated each round), median per-step time per run,
  median over rounds of each round's ratio to stock. The oracle is not running.
  Per split call: ``_mamba_block_aligned_split`` called in a tight loop on a
  request mid-prefill, same interleaving.
- benefit and cost: the Mamba state oracle on a workload of varied prompts and
  budgets, each prompt followed by an immediate re-ask and two shared-prefix
  siblings, at vLLM's default state retention, dense, and one interval R > 0.
- scaling: prefill steps of a lone request (its time to first token, in steps)
  against prompt length and budget / B, and steps for N concurrent prefills.
- register(): timed inside fresh interpreters, with and without vLLM's scheduler
  module already imported (0.33.0 imports it before plugins run, so the patch and
  the code fingerprint happen inside register()).
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

import vllm_mamba_align
from vllm_mamba_align.plugin import SPLIT_METHOD
from vllm_mamba_align.settings import Mode
from vllm_mamba_align.tools.modes import STOCK, scheduler_mode, simulated_modes
from vllm_mamba_align.tools.simulation import (
    Geometry,
    Simulation,
    chunk_starts,
    prompt,
)

C, B, H = 816, 1648, 16
MODES = [STOCK, *(m.value for m in Mode)]
"""Stock vLLM, then every plugin mode (``off`` measures the wrappers alone)."""
SCHEDULING_MODES = simulated_modes()


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rotations(items: list[str], rounds: int) -> Iterator[tuple[int, list[str]]]:
    """ABAB...: each round runs every item, starting one further along."""
    for r in range(rounds):
        k = r % len(items)
        yield r, items[k:] + items[:k]


Pairs = dict[str, list[tuple[float, float]]]
"""Per plugin mode: (stock, mode) measurements taken side by side, one per round."""


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


# -- overhead --------------------------------------------------------------------


def _runner_output(output: Any, finishing: set[str]) -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] if r in finishing else [] for r in ids],
    )


@dataclass
class MixedBatch:
    """64 requests in flight: 48 decoding, 16 prefilling long prompts."""

    sim: Simulation
    rng: random.Random
    serial: int = 0
    step_times: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)

    def add(self, decode: bool) -> None:
        self.serial += 1
        length = (
            self.rng.randrange(500, 3000) if decode else self.rng.randrange(4000, 40000)
        )
        # Straight into the scheduler: the oracle's bookkeeping is not timed and
        # not needed here.
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        request = Request(
            f"{'d' if decode else 'p'}{self.serial}",
            prompt(length, seed=self.serial),
            SamplingParams(max_tokens=100_000 if decode else 1, ignore_eos=True),
            None,
            block_hasher=get_request_block_hasher(
                self.sim.hash_block, self.sim.hash_fn
            ),
        )
        self.sim.scheduler.add_request(request)

    def step(self, timed: bool) -> None:
        scheduler = self.sim.scheduler
        begin = time.perf_counter()
        output = scheduler.schedule()
        prep_begin = time.perf_counter()
        starts = chunk_starts(output)
        finishing = {
            req_id
            for req_id, count in output.num_scheduled_tokens.items()
            if starts[req_id] + count >= scheduler.requests[req_id].num_tokens
        }
        runner_output = _runner_output(output, finishing)
        prep_end = time.perf_counter()
        scheduler.update_from_output(output, runner_output)
        end = time.perf_counter()
        if timed:
            self.step_times.append((prep_begin - begin) + (end - prep_end))
            self.step_tokens.append(output.total_num_scheduled_tokens)
        # vLLM reports finished ids only to some front ends: ask the scheduler.
        for req_id in finishing:
            if req_id not in scheduler.requests:
                self.add(decode=False)


@dataclass
class StepCost:
    median_step: float
    """Median wall time of one step, in seconds."""
    per_token: float
    """All timed steps' wall time over all tokens they scheduled, in seconds."""
    tokens_per_step: float

    @staticmethod
    def of(batch: MixedBatch) -> StepCost:
        tokens = sum(batch.step_tokens)
        return StepCost(
            statistics.median(batch.step_times),
            sum(batch.step_times) / tokens,
            tokens / len(batch.step_tokens),
        )


def mixed_batch(mode: str) -> MixedBatch:
    geometry = Geometry(cache_block=C, state_block=B, hash_block=H, num_blocks=30000)
    with scheduler_mode(mode):
        batch = MixedBatch(Simulation(geometry), random.Random(4))
        if mode == STOCK:
            # Bind vLLM's own split on the instance, as the plugin binds its route:
            # the stock scheduler then runs vLLM's code while the class keeps the
            # plugin's wrappers (switching the class back and forth every step
            # would reset the interpreter's attribute caches and slow stock down).
            scheduler = batch.sim.scheduler
            own = inspect.getattr_static(type(scheduler), SPLIT_METHOD)
            scheduler.__dict__[SPLIT_METHOD] = own.__get__(scheduler, type(scheduler))
    for i in range(64):
        batch.add(decode=i < 48)
    return batch


def paired_steps(mode: str, steps: int, stock_first: bool) -> tuple[StepCost, StepCost]:
    """Stock and ``mode`` stepped alternately, so load bursts hit both alike.

    Which of the two is built first matters by itself (about 1.5 % on this
    machine, in favour of the later one), so rounds alternate it.
    """
    if stock_first:
        stock, patched = mixed_batch(STOCK), mixed_batch(mode)
    else:
        patched = mixed_batch(mode)
        stock = mixed_batch(STOCK)
    for i in range(steps + 20):
        timed = i >= 20
        for batch in (stock, patched) if i % 2 else (patched, stock):
            batch.step(timed)
    return StepCost.of(stock), StepCost.of(patched)


def split_caller(mode: str, decoding: bool) -> Callable[[int], float]:
    """A timer of ``n`` split calls on one request, decoding or mid-prefill."""
    geometry = Geometry(cache_block=C, state_block=B, hash_block=H)
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        if decoding:
            request = sim.add("r", prompt(2000, seed=9), max_tokens=1000)
            while request.num_output_tokens < 2:
                sim.step()
            num_new_tokens = 1
        else:
            request = sim.add("r", prompt(30000, seed=9))
            sim.step()  # mid-prefill: num_computed_tokens = first chunk end
            num_new_tokens = 8192
        split = sim.scheduler._mamba_block_aligned_split  # bound in this mode

    def timed_calls(n: int) -> float:
        began = time.perf_counter()
        for _ in range(n):
            split(request, num_new_tokens)
        return time.perf_counter() - began

    return timed_calls


def split_calls_per_step(mode: str, steps: int = 60) -> tuple[float, float]:
    """Mean split calls per step in the mixed batch: (one-token, longer) chunks."""
    batch = mixed_batch(mode)
    scheduler = batch.sim.scheduler
    split = scheduler._mamba_block_aligned_split
    counts = [0, 0]

    def counted(request: Any, num_new_tokens: int, *rest: Any) -> int:
        counts[num_new_tokens > 1] += 1
        return int(split(request, num_new_tokens, *rest))

    scheduler.__dict__[SPLIT_METHOD] = counted
    for _ in range(steps):
        batch.step(timed=False)
    return counts[0] / steps, counts[1] / steps


def paired_calls(mode: str, calls: int, decoding: bool) -> tuple[float, float]:
    """Seconds per call, stock and ``mode``, in alternating blocks of calls."""
    stock, patched = split_caller(STOCK, decoding), split_caller(mode, decoding)
    block = max(calls // 20, 1)
    stock_time = patched_time = 0.0
    for i in range(20):
        if i % 2:
            stock_time += stock(block)
            patched_time += patched(block)
        else:
            patched_time += patched(block)
            stock_time += stock(block)
    return stock_time / (20 * block), patched_time / (20 * block)


def overhead(rounds: int, steps: int, calls: int) -> list[str]:
    plugin_modes = [m for m in MODES if m != STOCK]
    log(
        f"overhead: {rounds} rounds x {len(plugin_modes)} modes, each paired with stock"
    )
    per_step: Pairs = {m: [] for m in plugin_modes}
    per_token: Pairs = {m: [] for m in plugin_modes}
    decode_call: Pairs = {m: [] for m in plugin_modes}
    prefill_call: Pairs = {m: [] for m in plugin_modes}
    tokens: dict[str, list[float]] = {m: [] for m in MODES}
    for r, order in rotations(plugin_modes, rounds):
        for mode in order:
            stock, patched = paired_steps(mode, steps, stock_first=r % 2 == 0)
            per_step[mode].append((stock.median_step, patched.median_step))
            per_token[mode].append((stock.per_token, patched.per_token))
            tokens[STOCK].append(stock.tokens_per_step)
            tokens[mode].append(patched.tokens_per_step)
            decode_call[mode].append(paired_calls(mode, calls, decoding=True))
            prefill_call[mode].append(paired_calls(mode, calls, decoding=False))
        log(f"  round {r + 1}/{rounds} done")
    token_rows = [
        f"| {mode} | {statistics.mean(values):,.0f} |"
        for mode, values in tokens.items()
    ]
    stock_step = statistics.median(s for pairs in per_step.values() for s, _ in pairs)
    own_rows = []
    for mode in plugin_modes:
        one_token, longer = split_calls_per_step(mode)
        extra_one = statistics.median(p - s for s, p in decode_call[mode])
        extra_longer = statistics.median(p - s for s, p in prefill_call[mode])
        own = one_token * extra_one + longer * extra_longer
        own_rows.append(
            f"| {mode} | {one_token:.1f} + {longer:.1f} | {own * 1e6:.1f} µs | "
            f"{own / stock_step:.2%} |"
        )
    return [
        "### Overhead: `schedule()` + `update_from_output()`",
        "",
        f"64 requests in flight (48 decoding, 16 prefilling 4k-40k-token prompts, "
        f"replaced as they finish), C={C}, B={B}, budget 8192. Each round runs every "
        f"mode next to its own stock scheduler, the two stepped alternately for "
        f"{steps} timed steps, so load on the machine hits both alike; median "
        f"per-step time, ratio per round, {rounds} rounds. `off` and `audit` "
        "schedule exactly as stock, so their ratio is the plugin's own cost. "
        "`full` and `grid` schedule different chunks (tokens per step below), so "
        "their steps are not the same work; the per-token table puts them on a "
        "common footing.",
        "",
        "| mode | per step | ratio to stock | ratio range |",
        "|---|---|---|---|",
        *ratio_line(per_step, "µs", 1e6),
        "",
        "| mode | tokens scheduled per step (mean) |",
        "|---|---|",
        *token_rows,
        "",
        "| mode | per scheduled token | ratio to stock | ratio range |",
        "|---|---|---|---|",
        *ratio_line(per_token, "ns", 1e9),
        "",
        "The plugin's own time per step: split calls per step in this batch "
        "(one-token chunks, that is decodes, + longer ones) times the extra cost "
        "per call measured below (decoding request; request mid-prefill), next to "
        "stock's median step (audit's look at each step's output, a few "
        "integer operations per prefill chunk, is not included).",
        "",
        "| mode | split calls per step | own time per step | share of a stock step |",
        "|---|---|---|---|",
        *own_rows,
        "",
        "### Overhead per `_mamba_block_aligned_split` call",
        "",
        f"{calls} calls per run in alternating blocks with stock, {rounds} rounds. "
        "vLLM calls the split "
        "for every running request at every step, so decoding requests make most "
        "of the calls (48 of about 49 per step above).",
        "",
        "| mode | per call, decoding request | ratio to stock | ratio range |",
        "|---|---|---|---|",
        *ratio_line(decode_call, "ns", 1e9),
        "",
        "| mode | per call, request mid-prefill | ratio to stock | ratio range |",
        "|---|---|---|---|",
        *ratio_line(prefill_call, "ns", 1e9),
    ]


# -- benefit and cost ------------------------------------------------------------


@dataclass
class Tally:
    prompts: int = 0
    prompt_tokens: int = 0
    prefill_steps: int = 0
    kept_states: int = 0
    lost_kept: int = 0
    noncanonical: int = 0
    published: int = 0
    poisoned: int = 0
    wrong_reads: int = 0
    reask_reuse: int = 0
    reask_legal: int = 0
    sibling_reuse: int = 0
    sibling_shared: int = 0
    sibling_wrong: int = 0


@dataclass(frozen=True)
class RetentionCase:
    """One state retention the benefit table is measured at."""

    label: str
    retention: int | str | None
    state_block: int


RETENTION_CASES = [
    RetentionCase("vLLM's default (0: replay boundaries and junctions)", "default", B),
    RetentionCase("dense (None: every boundary)", None, B),
    # With B = 1648 the scheduler block is lcm(816, 1648) = 84,048, so no legal
    # interval falls inside these prompts; B = 1632 gives lcm 1632.
    RetentionCase("R = 6,528 (every 4th boundary; B = 1,632)", 6528, 1632),
]


def workload(seed: int, count: int) -> list[tuple[int, int, int]]:
    """(prompt length, budget, shared tokens) triples, varied."""
    rng = random.Random(seed)
    budgets = [2048, 4096, 8192, 16384]
    out = []
    for i in range(count):
        length = rng.randrange(2000, 48000)
        out.append(
            (length, budgets[i % len(budgets)], rng.randrange(length // 5, length))
        )
    return out


def benefit_run(
    mode: str, items: list[tuple[int, int, int]], case: RetentionCase
) -> Tally:
    """Each prompt alone, then a re-ask and two siblings sharing a prefix (the
    first sibling makes vLLM keep the junction state, the second reuses it)."""
    tally = Tally()
    by_budget: dict[int, list[tuple[int, int, int, int]]] = {}
    for index, (length, budget, share) in enumerate(items):
        by_budget.setdefault(budget, []).append((index, length, budget, share))
    for budget, group in by_budget.items():
        geometry = Geometry(
            cache_block=C,
            state_block=case.state_block,
            hash_block=H,
            budget=budget,
            num_blocks=8000,
            retention=case.retention,
        )
        with scheduler_mode(mode):
            sim = Simulation(geometry)
            for index, length, _budget, share in group:
                tokens = prompt(length, seed=1000 + index)
                first = f"p{index}"
                sim.add(first, tokens)
                sim.run()
                record = sim.records[first]
                tally.prompts += 1
                tally.prompt_tokens += length
                tally.prefill_steps += len(record.chunks)
                sim.add(f"{first}-reask", tokens)
                sim.run()
                tally.reask_reuse += sim.reused(f"{first}-reask")
                tally.reask_legal += length
                for sibling in (1, 2):
                    name = f"{first}-sibling{sibling}"
                    wrong_before = len(sim.wrong_reuse)
                    tail = prompt(2000, seed=5000 + 10 * index + sibling)
                    sim.add(name, tokens[:share] + tail)
                    sim.run()
                    tally.sibling_reuse += sim.reused(name)
                    tally.sibling_shared += share
                    tally.sibling_wrong += len(sim.wrong_reuse) - wrong_before
        tally.kept_states += sim.kept_writes
        tally.lost_kept += len(sim.missing_kept)
        tally.noncanonical += len(sim.noncanonical_kept)
        tally.published += len(sim.published)
        tally.poisoned += len(sim.poisoned)
        tally.wrong_reads += len(sim.wrong_reuse)
    return tally


def benefit(count: int) -> list[str]:
    items = workload(seed=7, count=count)
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
    for case in RETENTION_CASES:
        log(f"benefit/cost, {case.label}: {count} prompts x {len(SCHEDULING_MODES)}")
        tallies = {mode: benefit_run(mode, items, case) for mode in SCHEDULING_MODES}
        rows += [f"Retention {case.label}:", "", *benefit_table(tallies), ""]
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
        row("… of them non-canonical", lambda t: f"{t.noncanonical}"),
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


# -- scaling ---------------------------------------------------------------------


def lone_steps(mode: str, length: int, budget: int) -> int:
    geometry = Geometry(cache_block=C, state_block=B, hash_block=H, budget=budget)
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        sim.add("r", prompt(length, seed=length))
        sim.run()
    return len(sim.records["r"].chunks)


def concurrent(mode: str, n: int, length: int) -> tuple[int, float, float]:
    """(steps until all prefilled, mean TTFT in steps, prompt tokens per step)."""
    geometry = Geometry(
        cache_block=C, state_block=B, hash_block=H, budget=8192, num_blocks=8000
    )
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        for i in range(n):
            sim.add(f"r{i}", prompt(length, seed=300 + i))
        sim.run()
    done = [r.prefilled_at_step or 0 for r in sim.records.values()]
    return max(done), statistics.mean(done), n * length / max(done)


def scaling(quick: bool) -> list[str]:
    log("scaling: prompt length, budget / B, concurrency")
    modes = SCHEDULING_MODES
    head = "| | " + " | ".join(modes) + " |"
    rule = "|---|" + "---|" * len(modes)

    def ratio_cells(values: dict[str, int]) -> str:
        base = values[STOCK]
        return " | ".join(
            f"{values[m]}" + ("" if m == STOCK else f" ({values[m] / base:.2f}x)")
            for m in modes
        )

    lengths = [4096, 16764, 65536] if quick else [4096, 16764, 32768, 65536]
    rows = [
        "### Cost against prompt length (lone request, budget 8192)",
        "",
        "Prefill steps = the request's time to first token, in steps.",
        "",
        head.replace("| |", "| prompt |", 1),
        rule,
    ]
    for length in lengths:
        values = {m: lone_steps(m, length, 8192) for m in modes}
        rows.append(f"| {length} | {ratio_cells(values)} |")
    rows += [
        "",
        "### Cost against budget / B (lone 32,768-token prompt)",
        "",
        head.replace("| |", "| budget (÷ B) |", 1),
        rule,
    ]
    for budget in [1648, 4096, 8192, 16384, 32768]:
        values = {m: lone_steps(m, 32768, budget) for m in modes}
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
    for n in [1, 4, 16]:
        cells = []
        for m in modes:
            steps, ttft, per_step = concurrent(m, n, 16764)
            cells.append(f"{steps} / {ttft:.1f} / {per_step:.0f}")
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    return rows


# -- register() --------------------------------------------------------------------

REGISTER_CHILD = """
import os, sys, time
{pre}
t0 = time.perf_counter()
import vllm_mamba_align
t1 = time.perf_counter()
vllm_mamba_align.register()
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def register_cost(runs: int) -> list[str]:
    log(f"register(): {runs} fresh interpreters per case")
    cases = {
        "vLLM not imported yet (hooks only)": "",
        "vLLM's scheduler already imported (0.33.0's order: patch + fingerprint)": (
            "import vllm.v1.core.sched.scheduler"
        ),
    }
    results: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in cases}
    env = dict(os.environ)
    for _ in range(runs):
        for case, pre in cases.items():  # interleaved
            out = subprocess.run(
                [sys.executable, "-c", REGISTER_CHILD.format(pre=pre)],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            ).stdout.split()
            results[case][0].append(float(out[-2]))
            results[case][1].append(float(out[-1]))
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="also write the markdown report here")
    parser.add_argument(
        "--quick", action="store_true", help="fewer rounds (a smoke run)"
    )
    args = parser.parse_args()
    import vllm

    vllm_mamba_align.register()
    began = time.monotonic()
    quick = args.quick
    sections = [
        overhead(
            rounds=2 if quick else 8,
            steps=60 if quick else 200,
            calls=2000 if quick else 10000,
        ),
        benefit(count=8 if quick else 16),
        scaling(quick),
        register_cost(runs=3 if quick else 15),
    ]
    elapsed = time.monotonic() - began
    report = [
        f"## Benchmarks (vLLM {vllm.__version__}, vllm-mamba-align "
        f"{vllm_mamba_align.__version__}, {os.cpu_count()} CPUs)",
        "",
        "Produced by `benchmarks/bench.py`"
        + (" --quick" if quick else "")
        + " (what `python3 -m nox -s bench` runs), "
        + f"{elapsed / 60:.1f} minutes. Modes: "
        + ", ".join(f"`{m}`" for m in MODES)
        + " (`stock` = vLLM's own code, the plugin's wrappers removed).",
        "",
    ]
    for section in sections:
        report += [*section, ""]
    text = "\n".join(report)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    log(f"done in {elapsed:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
