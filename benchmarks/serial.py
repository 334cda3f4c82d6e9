"""Serial prefill steps: what each mode costs a request alone, counted.

Run: ``python benchmarks/serial.py [--count 40] [--output benchmarks/SERIAL.md]``
with the plugin and a vLLM installed (a release's nox env, e.g.
``.nox/tests-vllm-0-34-0/bin/python``). Prints one markdown section.

On the installed vLLM's real scheduler (CPU, no weights;
``vllm_mamba_align.tools.sim``), for each of ``--count`` drawn geometries
(C, B, hash block 16, step budget, prompt length, shared prefix) and each
mode (stock vLLM, then every fixing mode), one request at a time: a prompt,
its immediate re-ask, then two siblings sharing a prefix of it (the first
makes vLLM keep the junction, the second reuses it). Summed over the
geometries: the prefill chunks of the four requests (each chunk a step of its
own, since nothing else runs), and the oracle's verdicts (wrong
publications, wrong reads, kept states a chunk never materialized). Twice:
at retention 0 (vLLM's default from 0.29.0: replay boundaries and junctions)
and at an interval R (every k-th boundary also kept; C divides B there so
that R, a multiple of the scheduler block, falls inside the prompts).
Counts only: the machine's load does not change them.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

import vllm_mamba_align
from vllm_mamba_align.releases import installed_version
from vllm_mamba_align.tools.modes import STOCK, scheduler_mode
from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt

MODES = (STOCK, "lean", "kept", "grid", "full")
H = 16


@dataclass(frozen=True)
class Draw:
    """One drawn geometry and its requests."""

    cache_block: int
    state_block: int
    budget: int
    length: int
    share: int
    interval_blocks: int
    """k: the interval case keeps every k-th boundary (R = k * B)."""


def draws(seed: int, count: int) -> list[Draw]:
    """``count`` geometries with C < B, C dividing B (so R = k * B is a legal
    interval), B from 256 to 2,048 tokens, budgets from one B to 16,384."""
    rng = random.Random(seed)
    found = []
    while len(found) < count:
        cache_block = H * rng.randrange(4, 65)
        state_block = cache_block * rng.randrange(2, 9)
        if not 256 <= state_block <= 2048:
            continue
        budget = rng.choice([2048, 4096, 8192, 16384])
        if budget < state_block:
            continue
        length = rng.randrange(2000, 30000)
        share = rng.randrange(length // 5, length)
        found.append(
            Draw(cache_block, state_block, budget, length, share, rng.randrange(2, 5))
        )
    return found


@dataclass
class Count:
    """Summed over the draws, for one mode and one retention."""

    steps: int = 0
    wrong_published: int = 0
    wrong_reads: int = 0
    lost_kept: int = 0


def run(mode: str, draw: Draw, retention: int, index: int) -> Count:
    """The four requests of one draw, one at a time, in one mode."""
    geometry = Geometry(
        cache_block=draw.cache_block,
        state_block=draw.state_block,
        hash_block=H,
        budget=draw.budget,
        num_blocks=8000,
        retention=retention,
    )
    count = Count()
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        tokens = prompt(draw.length, seed=1000 + index)
        names = ["p", "p-reask", "p-sibling1", "p-sibling2"]
        asks = [tokens, tokens]
        for sibling in (1, 2):
            tail = prompt(2000, seed=5000 + 10 * index + sibling)
            asks.append(tokens[: draw.share] + tail)
        for name, ask in zip(names, asks, strict=True):
            sim.add(name, ask)
            sim.run()
            count.steps += len(sim.records[name].chunks)
    count.wrong_published = len(sim.poisoned)
    count.wrong_reads = len(sim.wrong_reuse)
    count.lost_kept = len(sim.missing_kept)
    return count


def measure(count: int, seed: int) -> dict[str, dict[str, Count]]:
    """Per retention case, each mode's counts summed over the draws."""
    results: dict[str, dict[str, Count]] = {}
    chosen = draws(seed, count)
    for case in ("retention 0", "interval R = k * B"):
        totals = {mode: Count() for mode in MODES}
        for index, draw in enumerate(chosen):
            retention = (
                0
                if case == "retention 0"
                else draw.interval_blocks * (draw.state_block)
            )
            for mode in MODES:
                counted = run(mode, draw, retention, index)
                total = totals[mode]
                total.steps += counted.steps
                total.wrong_published += counted.wrong_published
                total.wrong_reads += counted.wrong_reads
                total.lost_kept += counted.lost_kept
            print(f"{case}: draw {index + 1}/{count}", file=sys.stderr, flush=True)
        results[case] = totals
    return results


def render(results: dict[str, dict[str, Count]], count: int, seed: int) -> str:
    lines = [
        f"### vLLM {installed_version()}: {count} drawn geometries (seed {seed})",
        "",
        "| retention | mode | prefill steps | vs stock | wrong publications "
        "| wrong reads | kept states lost |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, totals in results.items():
        stock = totals[STOCK].steps
        for mode, total in totals.items():
            lines.append(
                f"| {case} | {mode} | {total.steps} | {total.steps / stock:.3f}x "
                f"| {total.wrong_published} | {total.wrong_reads} "
                f"| {total.lost_kept} |"
            )
    both = {mode: sum(results[case][mode].steps for case in results) for mode in MODES}
    lines += [
        "",
        "Both retentions: "
        + ", ".join(
            f"{mode} {both[mode] / both[STOCK]:.3f}x" for mode in MODES if mode != STOCK
        )
        + f" (stock: {both[STOCK]} steps).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--seed", type=int, default=66)
    arguments = parser.parse_args()
    # Before any scheduler is built, so that "stock" is vLLM's own code.
    vllm_mamba_align.register()
    import vllm.v1.core.sched.scheduler  # noqa: F401  (the plugin patches it now)

    print(
        render(
            measure(arguments.count, arguments.seed), arguments.count, arguments.seed
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
