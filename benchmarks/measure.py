"""Measurements of the plugin's benefit and cost: functions that return data.

Every measurement runs the installed vLLM's real scheduler on CPU (no weights;
``vllm_mamba_align.tools.sim``), stock and each plugin mode in one
process (``vllm_mamba_align.tools.modes``). ``report.py`` turns the data into
markdown; ``bench.py`` runs both.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

from ablation import (
    Change,
    LeanStop,
    keeping_replay_over_checkpoint,
    policy_changed,
    without,
)

from vllm_mamba_align import settings
from vllm_mamba_align.recognition import SPLIT_METHOD
from vllm_mamba_align.settings import Mode
from vllm_mamba_align.tools.installed import requests_need_eos_token_id
from vllm_mamba_align.tools.modes import (
    DEFAULT,
    STOCK,
    scheduler_mode,
    simulated_modes,
)
from vllm_mamba_align.tools.sim import (
    MAX_MODEL_LEN,
    Geometry,
    Simulation,
    available_checkpoint_backends,
    chunk_starts,
    prompt,
)
from vllm_mamba_align.tools.sim.engine import model_dir, runner_output
from vllm_mamba_align.tools.sim.states import state_id

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


# -- overhead --------------------------------------------------------------------


def _runner_output(output: Any, finishing: set[str]) -> Any:
    ids = list(output.num_scheduled_tokens)
    return runner_output(ids, [[7] if r in finishing else [] for r in ids])


BATCH_SIZES = (64, 256, 1024)
"""Running requests per scheduler in the hot-path measurement."""
PREFILLING = 16
"""Requests prefilling 4k-40k-token prompts in a mixed batch (the rest decode)."""


@dataclass(frozen=True)
class BatchShape:
    """A batch of running requests: all decoding, or mixed with prefills."""

    size: int
    mixed: bool

    @property
    def decoding(self) -> int:
        return self.size - PREFILLING if self.mixed else self.size

    @property
    def label(self) -> str:
        if self.mixed:
            return (
                f"{self.size} mixed ({self.decoding} decoding, {PREFILLING} prefilling)"
            )
        return f"{self.size} decoding"

    @property
    def steps(self) -> int:
        """Timed steps per run: about 12,800 request-steps, at least 20."""
        return max(20, 12_800 // self.size)


BATCHES = tuple(
    BatchShape(size, mixed) for mixed in (False, True) for size in BATCH_SIZES
)


@dataclass
class Batch:
    """Requests in flight on one scheduler: ``shape.decoding`` decoding, the
    rest prefilling long prompts (replaced as they finish)."""

    sim: Simulation
    rng: random.Random
    shape: BatchShape
    serial: int = 0
    step_times: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)

    def add(self, decode: bool) -> None:
        self.serial += 1
        # A decoding request's prompt length does not change what its split
        # call costs; short prompts keep the warm-up of large batches short.
        length = (
            self.rng.randrange(100, 600) if decode else self.rng.randrange(4000, 40000)
        )
        # Straight into the scheduler: the oracle's bookkeeping is not timed and
        # not needed here.
        request = self.sim.new_request(
            f"{'d' if decode else 'p'}{self.serial}",
            prompt(length, seed=self.serial),
            max_tokens=100_000 if decode else 1,
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

    def warm_up(self) -> None:
        """Step until every decoding request has finished its prefill."""
        requests = self.sim.scheduler.requests
        while any(r.num_output_tokens == 0 for k, r in requests.items() if k[0] == "d"):
            self.step(timed=False)

    def split_calls_per_step(self, steps: int = 10) -> tuple[float, float]:
        """Split calls per step, untimed: (one-token, longer) chunks."""
        scheduler = self.sim.scheduler
        split = scheduler._mamba_block_aligned_split
        counts = [0, 0]

        def counted(request: Any, num_new_tokens: int, *rest: Any) -> int:
            counts[num_new_tokens > 1] += 1
            return int(split(request, num_new_tokens, *rest))

        scheduler.__dict__[SPLIT_METHOD] = counted
        try:
            for _ in range(steps):
                self.step(timed=False)
        finally:
            scheduler.__dict__[SPLIT_METHOD] = split
        return counts[0] / steps, counts[1] / steps


@dataclass
class StepCost:
    median_step: float
    """Median wall time of one step, in seconds."""
    per_token: float
    """All timed steps' wall time over all tokens they scheduled, in seconds."""
    tokens_per_step: float

    @staticmethod
    def of(batch: Batch) -> StepCost:
        tokens = sum(batch.step_tokens)
        return StepCost(
            statistics.median(batch.step_times),
            sum(batch.step_times) / tokens,
            tokens / len(batch.step_tokens),
        )


class ObserverClock:
    """The wall time audit mode's look at each step's output takes
    (``Audit.after_schedule``), summed while :attr:`running`.

    Installed on the class before an audited scheduler is built (its
    ``schedule`` observer binds the method then); the clock's own two timer
    reads are counted too, so the figure errs high.
    """

    def __init__(self) -> None:
        from vllm_mamba_align.audit import Audit

        self.seconds = 0.0
        self.steps = 0
        self.running = False
        original = Audit.after_schedule
        clock = self

        def after_schedule(audit: Any, output: Any) -> None:
            if not clock.running:
                original(audit, output)
                return
            began = time.perf_counter()
            original(audit, output)
            clock.seconds += time.perf_counter() - began
            clock.steps += 1

        self.original = original
        Audit.after_schedule = after_schedule  # type: ignore[method-assign]

    def remove(self) -> None:
        from vllm_mamba_align.audit import Audit

        Audit.after_schedule = self.original  # type: ignore[method-assign]


def batch_of(mode: str, shape: BatchShape) -> Batch:
    geometry = Geometry(
        cache_block=C,
        state_block=B,
        hash_block=H,
        num_blocks=40000,
        max_num_seqs=max(256, shape.size),
    )
    with scheduler_mode(mode):
        batch = Batch(Simulation(geometry), random.Random(4), shape)
        if mode == STOCK:
            # Bind vLLM's own split on the instance, as the plugin binds its route:
            # the stock scheduler then runs vLLM's code while the class keeps the
            # plugin's wrappers (switching the class back and forth every step
            # would reset the interpreter's attribute caches and slow stock down).
            scheduler = batch.sim.scheduler
            own = inspect.getattr_static(type(scheduler), SPLIT_METHOD)
            scheduler.__dict__[SPLIT_METHOD] = own.__get__(scheduler, type(scheduler))
    for i in range(shape.size):
        batch.add(decode=i < shape.decoding)
    batch.warm_up()
    return batch


def paired_steps(
    mode: str, shape: BatchShape, stock_first: bool
) -> tuple[StepCost, StepCost, tuple[float, float], float]:
    """Stock and ``mode`` stepped alternately, so load bursts hit both alike.

    Which of the two is built first matters by itself (about 1.5 % on this
    machine, in favour of the later one), so rounds alternate it. Returns both
    step costs, the mode's split calls per step and (audit) its observer's
    seconds per timed step.
    """
    clock = ObserverClock() if mode == Mode.AUDIT.value else None
    try:
        if stock_first:
            stock, patched = batch_of(STOCK, shape), batch_of(mode, shape)
        else:
            patched = batch_of(mode, shape)
            stock = batch_of(STOCK, shape)
        for i in range(shape.steps + 5):
            timed = i >= 5
            if clock is not None:  # only the audited scheduler reaches it
                clock.running = timed
            for batch in (stock, patched) if i % 2 else (patched, stock):
                batch.step(timed)
        observer = clock.seconds / clock.steps if clock and clock.steps else 0.0
        if clock is not None:
            clock.running = False
        calls = patched.split_calls_per_step()
    finally:
        if clock is not None:
            clock.remove()
    for batch in (stock, patched):
        batch.sim.scheduler.shutdown()
    return StepCost.of(stock), StepCost.of(patched), calls, observer


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


@dataclass
class BatchOverhead:
    """One batch shape, each plugin mode paired with stock, one pair a round."""

    shape: BatchShape
    per_step: Pairs
    """Median step time (s) of stock and the mode."""
    per_token: Pairs
    """Step time over scheduled tokens (s per token)."""
    tokens: dict[str, list[float]]
    """Mean tokens scheduled per step, per mode (stock included), per run."""
    calls_per_step: dict[str, list[tuple[float, float]]]
    """Split calls per step: (one-token, longer) chunks, per run."""
    observer: dict[str, list[float]]
    """Seconds per step of audit's look at the step's output, per run."""


@dataclass
class Overhead:
    """Per-step and per-call costs, each plugin mode paired with stock."""

    rounds: int
    calls: int
    batches: list[BatchOverhead]
    decode_call: Pairs
    """Seconds per split call for a decoding request."""
    prefill_call: Pairs
    """Seconds per split call for a request mid-prefill."""

    def own_time(self, batch: BatchOverhead, mode: str) -> float:
        """The plugin's own seconds per step in ``mode`` on this batch: its
        split calls per step times each call's extra cost over stock's (the
        median of the paired differences), plus audit's observer."""
        one_token = statistics.median(c[0] for c in batch.calls_per_step[mode])
        longer = statistics.median(c[1] for c in batch.calls_per_step[mode])
        extra_one = statistics.median(p - s for s, p in self.decode_call[mode])
        extra_longer = statistics.median(p - s for s, p in self.prefill_call[mode])
        observer = statistics.median(batch.observer[mode])
        return one_token * extra_one + longer * extra_longer + observer


def measure_overhead(
    rounds: int, calls: int, shapes: tuple[BatchShape, ...] = BATCHES
) -> Overhead:
    plugin_modes = [m for m in MODES if m != STOCK]
    log(
        f"overhead: {rounds} rounds x {len(plugin_modes)} modes x {len(shapes)} "
        "batches, each paired with stock"
    )
    data = Overhead(
        rounds,
        calls,
        batches=[
            BatchOverhead(
                shape,
                per_step={m: [] for m in plugin_modes},
                per_token={m: [] for m in plugin_modes},
                tokens={m: [] for m in MODES},
                calls_per_step={m: [] for m in plugin_modes},
                observer={m: [] for m in plugin_modes},
            )
            for shape in shapes
        ],
        decode_call={m: [] for m in plugin_modes},
        prefill_call={m: [] for m in plugin_modes},
    )
    for r, order in rotations(plugin_modes, rounds):
        for mode in order:
            data.decode_call[mode].append(paired_calls(mode, calls, decoding=True))
            data.prefill_call[mode].append(paired_calls(mode, calls, decoding=False))
            for batch in data.batches:
                stock, patched, per_step, observer = paired_steps(
                    mode, batch.shape, stock_first=r % 2 == 0
                )
                batch.per_step[mode].append((stock.median_step, patched.median_step))
                batch.per_token[mode].append((stock.per_token, patched.per_token))
                batch.tokens[STOCK].append(stock.tokens_per_step)
                batch.tokens[mode].append(patched.tokens_per_step)
                batch.calls_per_step[mode].append(per_step)
                batch.observer[mode].append(observer)
        log(f"  round {r + 1}/{rounds} done")
    return data


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


def measure_benefit(count: int) -> dict[str, dict[str, Tally]]:
    """Per retention case (its label): each scheduling mode's tally."""
    items = workload(seed=7, count=count)
    results = {}
    for case in RETENTION_CASES:
        log(f"benefit/cost, {case.label}: {count} prompts x {len(SCHEDULING_MODES)}")
        results[case.label] = {
            mode: benefit_run(mode, items, case) for mode in SCHEDULING_MODES
        }
    return results


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


PROMPT_LENGTHS = [4096, 16764, 32768, 65536]
BUDGETS = [1648, 4096, 8192, 16384, 32768]
CONCURRENCY = [1, 4, 16]


@dataclass
class Scaling:
    """Prefill steps per mode against prompt length, budget and concurrency."""

    by_length: dict[int, dict[str, int]] = field(default_factory=dict)
    """Lone request, budget 8192: prompt length -> mode -> prefill steps."""
    by_budget: dict[int, dict[str, int]] = field(default_factory=dict)
    """Lone 32,768-token prompt: budget -> mode -> prefill steps."""
    concurrent: dict[int, dict[str, tuple[int, float, float]]] = field(
        default_factory=dict
    )
    """N concurrent 16,764-token prompts: N -> mode -> :func:`concurrent`."""


def measure_scaling(quick: bool) -> Scaling:
    log("scaling: prompt length, budget / B, concurrency")
    modes = SCHEDULING_MODES
    lengths = [4096, 16764, 65536] if quick else PROMPT_LENGTHS
    data = Scaling()
    for length in lengths:
        data.by_length[length] = {m: lone_steps(m, length, 8192) for m in modes}
    for budget in BUDGETS:
        data.by_budget[budget] = {m: lone_steps(m, 32768, budget) for m in modes}
    for n in CONCURRENCY:
        data.concurrent[n] = {m: concurrent(m, n, 16764) for m in modes}
    return data


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


REGISTER_CASES = {
    "vLLM not imported yet (hooks only)": "",
    "vLLM's scheduler already imported (0.33.0's order: patch + fingerprint)": (
        "import vllm.v1.core.sched.scheduler"
    ),
}


def measure_register(runs: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per case: seconds of ``import vllm_mamba_align`` and of ``register()``,
    each timed inside a fresh interpreter, cases interleaved."""
    log(f"register(): {runs} fresh interpreters per case")
    results: dict[str, tuple[list[float], list[float]]] = {
        c: ([], []) for c in REGISTER_CASES
    }
    env = dict(os.environ)
    for _ in range(runs):
        for case, pre in REGISTER_CASES.items():  # interleaved
            out = subprocess.run(
                [sys.executable, "-c", REGISTER_CHILD.format(pre=pre)],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            ).stdout.split()
            results[case][0].append(float(out[-2]))
            results[case][1].append(float(out[-1]))
    return results


# -- what users do instead ---------------------------------------------------------

CACHING_OFF = "prefix caching off"
BUDGET_ONE_BLOCK = "stock, budget = B"


@dataclass(frozen=True)
class Alternative:
    """One row of the comparison: what a user runs for a hybrid model."""

    label: str
    mode: str
    """``stock``, a plugin mode, ``default`` (the plugin with
    ``VLLM_MAMBA_ALIGN_MODE`` unset) or :data:`CACHING_OFF`."""
    one_block_budget: bool = False
    """The step budget set to B, within [B, 2B): every prefill step advances at
    most one state block (``--max-num-batched-tokens`` B)."""


def alternatives() -> list[Alternative]:
    """Stock, the two workarounds users apply, then the plugin's fixing modes."""
    default = settings.DEFAULT_MODE.value
    return [
        Alternative("stock vLLM", STOCK),
        Alternative(CACHING_OFF, CACHING_OFF),
        Alternative(BUDGET_ONE_BLOCK, STOCK, one_block_budget=True),
        Alternative("plugin `grid`", Mode.GRID.value),
        Alternative("plugin `kept`", Mode.KEPT.value),
        Alternative("plugin `full`", Mode.FULL.value),
        Alternative(f"plugin, mode unset (default `{default}`)", DEFAULT),
    ]


@dataclass
class AlternativeTally:
    """What one row served: the same requests in the same order for every row."""

    steps: int = 0
    """Engine steps (``schedule()`` calls) until every request finished: with
    one output token per request, all of them prefill steps."""
    computed: int = 0
    """Prompt tokens the steps computed (those not reused from the cache)."""
    reused: int = 0
    """Prompt tokens requests skipped by resuming from a cached state that
    holds what its hash names."""
    wrong_reused: int = 0
    """Prompt tokens skipped by resuming from a state that does not."""
    reusable: int = 0
    """Tokens the re-asks and siblings share with a request served before."""
    published: int = 0
    """Mamba hashes published."""
    poisoned: int = 0
    """... naming a state their block does not hold."""
    requests: int = 0


ALTERNATIVE_CASES = [
    RetentionCase("vLLM's default (0)", "default", B),
    RetentionCase("dense (every boundary kept)", None, B),
    # C divides B: the geometry where a budget of B ends every stock chunk on
    # the state grid (with C = 816, B = 1,648 it ends them on 816's grid).
    RetentionCase("vLLM's default (0), B = 1,632 (C divides B)", "default", 1632),
    RetentionCase("dense, B = 1,632 (C divides B)", None, 1632),
]


def _rounds(
    index: int, length: int, share: int
) -> tuple[list[int], list[int], list[int]]:
    """A prompt and its two shared-prefix siblings (the re-ask is the prompt)."""
    tokens = prompt(length, seed=1000 + index)
    siblings = [
        tokens[:share] + prompt(2000, seed=5000 + 10 * index + s) for s in (1, 2)
    ]
    return tokens, siblings[0], siblings[1]


def _grouped(
    items: list[tuple[int, int, int]],
) -> dict[int, list[tuple[int, int, int, int]]]:
    groups: dict[int, list[tuple[int, int, int, int]]] = {}
    for index, (length, budget, share) in enumerate(items):
        groups.setdefault(budget, []).append((index, length, budget, share))
    return groups


def alternative_run(
    row: Alternative, items: list[tuple[int, int, int]], case: RetentionCase
) -> AlternativeTally:
    """Per budget, four rounds of concurrent requests: every prompt at once,
    then every prompt's re-ask, then its first sibling (vLLM keeps the junction
    state), then its second sibling (which can reuse it)."""
    if row.mode == CACHING_OFF:
        return caching_off_run(items)
    tally = AlternativeTally()
    for budget, group in _grouped(items).items():
        geometry = Geometry(
            cache_block=C,
            state_block=case.state_block,
            hash_block=H,
            budget=case.state_block if row.one_block_budget else budget,
            num_blocks=8000,
            retention=case.retention,
        )
        with scheduler_mode(row.mode):
            sim = Simulation(geometry)
            for kind in range(4):
                names = []
                for index, length, _budget, share in group:
                    tokens, sibling1, sibling2 = _rounds(index, length, share)
                    name = f"p{index}-{kind}"
                    sim.add(name, (tokens, tokens, sibling1, sibling2)[kind])
                    names.append((name, (0, length, share, share)[kind]))
                sim.run()
                wrong = {entry.split(" ", 1)[0] for entry in sim.wrong_reuse}
                for name, reusable in names:
                    record = sim.records[name]
                    reused = sim.reused(name)
                    tally.requests += 1
                    tally.reusable += reusable
                    tally.computed += record.request.num_prompt_tokens - reused
                    if name in wrong:
                        tally.wrong_reused += reused
                    else:
                        tally.reused += reused
        tally.steps += sim.steps
        tally.published += len(sim.published)
        tally.poisoned += len(sim.poisoned)
    return tally


@functools.cache
def _caching_off_config() -> Any:
    """vLLM's own config of the tiny hybrid with prefix caching off (Mamba
    cache mode ``none``: one state per request, no hashes)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=model_dir(),
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=8192,
        max_model_len=MAX_MODEL_LEN,
    )
    config = args.create_engine_config()
    assert config.cache_config.mamba_cache_mode == "none"
    return config


def _caching_off_scheduler(budget: int) -> Any:
    import torch
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    config = copy.deepcopy(_caching_off_config())
    groups = [
        KVCacheGroupSpec(
            ["model.layers.3.self_attn.attn"],
            FullAttentionSpec(
                block_size=C, num_kv_heads=1, head_size=16, dtype=torch.float32
            ),
        ),
        KVCacheGroupSpec(
            [f"model.layers.{i}.linear_attn" for i in range(3)],
            MambaSpec(
                block_size=config.cache_config.mamba_block_size,
                shapes=((1,),),
                dtypes=(torch.float32,),
                mamba_cache_mode="none",
            ),
        ),
    ]
    kv_config = KVCacheConfig(
        num_blocks=8000, kv_cache_tensors=[], kv_cache_groups=groups
    )
    config.cache_config.block_size = C
    config.cache_config.num_gpu_blocks = 8000
    config.scheduler_config.max_num_batched_tokens = budget
    if getattr(config.scheduler_config, "max_num_scheduled_tokens", None):
        config.scheduler_config.max_num_scheduled_tokens = budget
    sizes: dict[str, int] = {"block_size": C}
    resolve = getattr(kv_cache_utils, "resolve_kv_cache_block_sizes", None)
    if resolve is not None:
        scheduler_block, hash_block = resolve(kv_config, config)
        sizes = {"block_size": scheduler_block, "hash_block_size": hash_block}
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        **sizes,
        log_stats=True,
    )
    assert not scheduler.kv_cache_manager.enable_caching
    return scheduler


def caching_off_run(items: list[tuple[int, int, int]]) -> AlternativeTally:
    """The same rounds as :func:`alternative_run` on a scheduler with prefix
    caching off, stock vLLM (the plugin finds no align mode and stands aside)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    tally = AlternativeTally()
    for budget, group in _grouped(items).items():
        with scheduler_mode(STOCK):
            scheduler = _caching_off_scheduler(budget)
            for kind in range(4):
                for index, length, _budget, share in group:
                    tokens = _rounds(index, length, share)[(0, 0, 1, 2)[kind]]
                    scheduler.add_request(
                        Request(
                            f"p{index}-{kind}",
                            list(tokens),
                            SamplingParams(max_tokens=1, ignore_eos=True),
                            None,
                            **(
                                {"eos_token_id": None}
                                if requests_need_eos_token_id()
                                else {}
                            ),
                        )
                    )
                    tally.requests += 1
                    tally.reusable += (0, length, share, share)[kind]
                while scheduler.has_requests():
                    output = scheduler.schedule()
                    tally.steps += 1
                    starts = chunk_starts(output)
                    for new in output.scheduled_new_reqs:
                        tally.reused += new.num_computed_tokens
                    finishing = {
                        req_id
                        for req_id, count in output.num_scheduled_tokens.items()
                        if starts[req_id] + count
                        >= scheduler.requests[req_id].num_tokens
                    }
                    tally.computed += output.total_num_scheduled_tokens
                    scheduler.update_from_output(
                        output, _runner_output(output, finishing)
                    )
            pool = scheduler.kv_cache_manager.block_pool
            tally.published += sum(b.block_hash is not None for b in pool.blocks)
    return tally


def measure_alternatives(count: int) -> dict[str, dict[str, AlternativeTally]]:
    """Per retention case (its label): each row's tally, one run."""
    items = workload(seed=7, count=count)
    rows = alternatives()
    results = {}
    for case in ALTERNATIVE_CASES:
        log(f"what users do instead, {case.label}: {count} prompts x {len(rows)}")
        results[case.label] = {
            row.label: alternative_run(row, items, case) for row in rows
        }
    return results


# -- concurrent load ---------------------------------------------------------------

LOAD_REQUESTS = 48
LOAD_SEEDS = (1, 2, 3)
LOAD_BUDGET = 8192
LOAD_PROMPTS = (1_000, 20_000)
"""Prompt lengths, uniform in this range (tokens), per seed."""
LOAD_OUTPUTS = (16, 256)
"""Output lengths, uniform in this range (tokens): decodes share every step."""
LOAD_GAPS = (0, 4)
"""Steps between two arrivals, uniform in this range (mean 2)."""
FAMILIES = 4
FAMILY_SHARE = 0.7
"""Prefix families: this share of requests extends one of :data:`FAMILIES`
shared prefixes (each 4k-12k tokens) by a suffix of its own."""
CHECKPOINT_BACKEND = "gdn-flashinfer"
"""The backend whose in-chunk prefill checkpoint the loaded runs model
(``num_prefill_checkpoint_blocks`` = 1, alignment lcm(hash block, 64), as
Qwen3-Next's GDN declares on FlashInfer; vLLM's own
``compute_mamba_prefill_checkpoints`` places the write)."""


@dataclass(frozen=True)
class LoadCase:
    """One concurrent workload: its requests, pool and backend."""

    label: str
    families: bool = False
    num_blocks: int = 8000
    reserve_full_input: bool = True
    """False admits more than the pool can finish: running requests preempted."""
    checkpoint: str | None = None


def load_cases() -> list[LoadCase]:
    """Unique prompts, prefix families, KV pressure and preemption; with and
    without the backend's in-chunk checkpoint where the installed vLLM has it."""
    backends: list[str | None] = [None]
    if CHECKPOINT_BACKEND in available_checkpoint_backends():
        backends.append(CHECKPOINT_BACKEND)
    cases = []
    for backend in backends:
        tag = "backend checkpoints" if backend else "no backend checkpoints"
        cases += [
            LoadCase(f"unique prompts, {tag}", checkpoint=backend),
            LoadCase(f"prefix families, {tag}", families=True, checkpoint=backend),
            LoadCase(
                f"prefix families, KV pressure, {tag}",
                families=True,
                num_blocks=LOAD_PRESSURE_BLOCKS,
                checkpoint=backend,
            ),
            LoadCase(
                f"prefix families, preemption, {tag}",
                families=True,
                num_blocks=LOAD_PREEMPTION_BLOCKS,
                reserve_full_input=False,
                checkpoint=backend,
            ),
        ]
    return cases


LOAD_PRESSURE_BLOCKS = 450
"""A pool of 450 blocks (C tokens of attention each), with vLLM reserving a
request's whole input before admitting it: cached prefixes are evicted while
requests run, and admission waits for room."""
LOAD_PREEMPTION_BLOCKS = 300
"""A pool of 300 blocks, requests admitted without reserving their input
(``scheduler_reserve_full_isl`` off): running requests are preempted."""


@dataclass(frozen=True)
class LoadRequest:
    name: str
    arrival: int
    """The step before which it arrives."""
    tokens: tuple[int, ...]
    max_tokens: int


def load_workload(seed: int, families: bool) -> list[LoadRequest]:
    """:data:`LOAD_REQUESTS` requests arriving over time (the mix above)."""
    rng = random.Random(seed)
    prefixes = [
        prompt(rng.randrange(4_000, 12_000), seed=90_000 + 100 * seed + f)
        for f in range(FAMILIES)
    ]
    requests, arrival = [], 0
    for i in range(LOAD_REQUESTS):
        arrival += rng.randint(*LOAD_GAPS)
        length = rng.randint(*LOAD_PROMPTS)
        own = prompt(length, seed=10_000 * seed + i)
        if families and rng.random() < FAMILY_SHARE:
            prefix = prefixes[rng.randrange(FAMILIES)]
            tokens = prefix + own[: max(length - len(prefix), 500)]
        else:
            tokens = own
        requests.append(
            LoadRequest(f"q{i}", arrival, tuple(tokens), rng.randint(*LOAD_OUTPUTS))
        )
    return requests


@dataclass
class LoadTally:
    """What one mode did with one concurrent workload."""

    steps: int = 0
    """Steps until every request finished (drained)."""
    ttft: int = 0
    """Steps from each request's arrival to its first token, summed."""
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    """Prompt tokens computed in prefill chunks (a preempted request's again)."""
    reused: int = 0
    requests: int = 0
    preemptions: int = 0
    published: int = 0
    poisoned: int = 0
    wrong_reads: int = 0
    lost_kept: int = 0
    """Kept boundaries whose state was never written (the oracle's count)."""
    prompt_checkpoints: int = 0
    """Requests whose prompt checkpoint (vLLM's partial-tail state, where a
    re-ask of the same prompt resumes) a Mamba hash published."""

    @property
    def chunks_per_request(self) -> float:
        return self.prefill_chunks / max(self.requests, 1)

    @property
    def prefill_tokens_per_step(self) -> float:
        return self.prefill_tokens / max(self.steps, 1)


def summed(tallies: Iterable[LoadTally]) -> LoadTally:
    """One mode's counts over every seed of a workload: what each row of the
    concurrent-load tables reports."""
    total = LoadTally()
    for tally in tallies:
        for name in (f.name for f in fields(LoadTally)):
            setattr(total, name, getattr(total, name) + getattr(tally, name))
    return total


def load_run(
    mode: str, case: LoadCase, seed: int, change: Change | None = None
) -> LoadTally:
    """One mode serving one workload on the real scheduler, requests added
    at their arrival step, one output token per step per decoding request;
    lean changed by ``change`` (ablation.py)."""
    items = load_workload(seed, case.families)
    geometry = Geometry(
        cache_block=C,
        state_block=B,
        hash_block=H,
        budget=LOAD_BUDGET,
        num_blocks=case.num_blocks,
        reserve_full_input=case.reserve_full_input,
        prefill_checkpoint=case.checkpoint,
    )
    tally = LoadTally(requests=len(items))
    with scheduler_mode(mode), change() if change else nullcontext():
        sim = Simulation(geometry)
        scheduler = sim.scheduler
        preempt = scheduler._preempt_request

        def counted(*args: Any, **kwargs: Any) -> Any:
            tally.preemptions += 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counted
        pending, offset, arrived = list(items), 0, {}
        while pending or sim.busy():
            if not sim.busy() and pending[0].arrival - offset > sim.steps:
                # Nothing to run until the next arrival: the engine waits
                # without stepping, so the later arrivals move up.
                offset = pending[0].arrival - sim.steps
            while pending and pending[0].arrival - offset <= sim.steps:
                request = pending.pop(0)
                arrived[request.name] = sim.steps
                sim.add(request.name, request.tokens, max_tokens=request.max_tokens)
            if sim.steps > 20_000:
                raise AssertionError(f"{mode}, {case.label}: not drained")
            sim.step()
        for name, record in sim.records.items():
            assert record.prefilled_at_step is not None, name
            tally.ttft += record.prefilled_at_step - arrived[name]
            tally.prefill_chunks += len(record.chunks)
            tally.prefill_tokens += sum(c.end - c.start for c in record.chunks)
            tally.reused += sim.reused(name)
            tokens = record.request.prompt_token_ids
            tail = (len(tokens) - 1) // H * H
            tally.prompt_checkpoints += state_id(tokens, tail) in sim.published_states
        tally.steps = sim.steps
        tally.published = len(sim.published)
        tally.poisoned = len(sim.poisoned)
        tally.wrong_reads = len(sim.wrong_reuse)
        tally.lost_kept = len(sim.missing_kept)
    return tally


LEAN_ABLATION: tuple[tuple[str, Change, bool], ...] = (
    (
        "lean with a replay-boundary stop where the backend checkpoints",
        policy_changed(keeping_replay_over_checkpoint),
        False,
    ),
    (f"lean without its {LeanStop.REPLAY.value}", without(LeanStop.REPLAY), False),
    (f"lean without its {LeanStop.TAIL.value}", without(LeanStop.TAIL), False),
    (f"lean without its {LeanStop.JUNCTION.value}", without(LeanStop.JUNCTION), True),
)
"""The ablation's runs, one change to lean each: label, change, and whether
it applies only to workloads with prefix families."""


LoadRows = dict[str, dict[str, list[LoadTally]]]
"""Per workload (its label), per run (a mode): one tally per seed."""


def measure_load(
    seeds: tuple[int, ...] = LOAD_SEEDS,
) -> tuple[LoadRows, LoadRows]:
    """Per workload (its label), per scheduling mode: one tally per seed; and
    for the workloads with backend checkpoints, stock, lean, and lean with
    each change of :data:`LEAN_ABLATION`."""
    results: LoadRows = {}
    ablations: LoadRows = {}
    for case in load_cases():
        log(f"concurrent load, {case.label}: {len(seeds)} seeds x modes")
        results[case.label] = {
            mode: [load_run(mode, case, seed) for seed in seeds]
            for mode in SCHEDULING_MODES
        }
        if case.checkpoint is None or case.num_blocks != LoadCase.num_blocks:
            continue
        log(f"concurrent load, {case.label}: lean with one change at a time")
        rows = {STOCK: results[case.label][STOCK], "lean": results[case.label]["lean"]}
        for label, change, families_only in LEAN_ABLATION:
            if families_only and not case.families:
                continue
            rows[label] = [load_run("lean", case, seed, change) for seed in seeds]
        ablations[case.label] = rows
    return results, ablations
