"""A seeded random sweep: many workloads, one mode each, on the real scheduler.

The property tests (``test_property.py``) compare modes on the same case and
shrink failures, at about two cases a second. This sweep draws from the same
generator (``random_workloads.py``) through a seeded RNG, runs each case in one mode
(``full``, ``kept``, ``grid`` or the mode variable unset, drawn too) and checks
what that mode holds on its own (``random_workloads.check_mode``): cheap enough
for the 100,000 workloads per split body of ``nox -s property_long``. CI runs a
quick few hundred.

Every case is reproducible from its index: ``MAMBA_ALIGN_SWEEP_ONLY=<index>``
(with the same ``MAMBA_ALIGN_SWEEP_SEED``) runs that one case alone.
``MAMBA_ALIGN_SWEEP_REPORT=<file.json>`` writes the counts and each
dimension's share.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from random_workloads import (
    RandomDraw,
    Unrunnable,
    VllmDefect,
    Workload,
    check_mode,
    dimensions,
    draw_workload,
    simulate,
)

from vllm_mamba_align.releases import installed_version
from vllm_mamba_align.tools.modes import DEFAULT
from vllm_mamba_align.tools.sim import Simulation

pytestmark = pytest.mark.random_workloads

WORKLOADS = int(os.environ.get("MAMBA_ALIGN_SWEEP_WORKLOADS", "300"))
"""Runnable cases to check (cases this release cannot run are redrawn)."""
SEED = int(os.environ.get("MAMBA_ALIGN_SWEEP_SEED", "0"))
PROCESSES = int(os.environ.get("MAMBA_ALIGN_SWEEP_PROCESSES", "1"))
"""Worker processes (one per core): process k runs cases k, k + n, k + 2n, ..."""
ONLY = os.environ.get("MAMBA_ALIGN_SWEEP_ONLY")
REPORT = os.environ.get("MAMBA_ALIGN_SWEEP_REPORT")
MAX_FAILURES = 5
"""Stop after this many failing cases (each names its index)."""
MODES = ("full", "kept", "grid", DEFAULT)
"""Every fixing mode, and the plugin with ``VLLM_MAMBA_ALIGN_MODE`` unset."""


def case(index: int) -> tuple[str, Workload]:
    """Case ``index`` of the sweep: its mode and workload, from its own seed."""
    rng = random.Random(f"{SEED}:{index}")
    mode = rng.choice(MODES)
    return mode, draw_workload(RandomDraw(rng))


def describe(index: int, mode: str, workload: Workload) -> str:
    return (
        f"case {index} (MAMBA_ALIGN_SWEEP_SEED={SEED} MAMBA_ALIGN_SWEEP_ONLY={index}),"
        f" mode {mode}: {workload.geometry}, prompts of "
        f"{[len(p) for p in workload.prompts]} tokens, max_tokens "
        f"{workload.max_tokens}, arrivals {workload.arrivals}, store holds "
        f"{[len(h) for h in workload.held]}"
    )


@dataclass
class Tally:
    """What one process checked."""

    checked: int = 0
    unrunnable: int = 0
    schedule_calls: int = 0
    modes: collections.Counter[str] = field(default_factory=collections.Counter)
    labels: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    vllm_defects: list[str] = field(default_factory=list)
    """Cases vLLM itself failed (random_workloads.VllmDefect), with the reason."""

    def add(self, other: Tally) -> None:
        self.checked += other.checked
        self.unrunnable += other.unrunnable
        self.schedule_calls += other.schedule_calls
        self.modes.update(other.modes)
        self.labels.update(other.labels)
        self.failures.extend(other.failures)
        self.vllm_defects.extend(other.vllm_defects)


def run_cases(indices: Iterator[int], target: int) -> Tally:
    """Check cases from ``indices`` until ``target`` of them ran (or too many
    failed)."""
    import vllm_mamba_align

    vllm_mamba_align.register()  # idempotent; a worker process starts without it
    tally = Tally()
    calls = Simulation.schedule_calls
    for index in indices:
        if tally.checked >= target or len(tally.failures) >= MAX_FAILURES:
            break
        mode, workload = case(index)
        try:
            sim = simulate(mode, workload)
            tally.checked += 1
            check_mode(mode, workload, sim)
        except Unrunnable:
            tally.unrunnable += 1
            continue
        except VllmDefect as defect:
            tally.checked += 1
            tally.modes[mode] += 1
            tally.vllm_defects.append(f"case {index}: {defect}")
            continue
        except Exception as error:
            tally.failures.append(f"{describe(index, mode, workload)}\n  {error!r}")
            continue
        tally.modes[mode] += 1
        tally.labels.update(dimensions(workload, sim))
    tally.schedule_calls = Simulation.schedule_calls - calls
    return tally


def run_shard(shard: int, processes: int, target: int) -> Tally:
    return run_cases(itertools.count(shard, processes), target)


def run_in_processes(processes: int) -> Tally:
    """Shards in ``processes`` fresh interpreters (spawned: vLLM is not fork-safe)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (tests, os.environ.get("PYTHONPATH", "")) if p
    )
    targets = [
        WORKLOADS // processes + (k < WORKLOADS % processes) for k in range(processes)
    ]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        shards = [
            pool.submit(run_shard, k, processes, targets[k]) for k in range(processes)
        ]
        total = Tally()
        for shard in shards:
            total.add(shard.result())
    return total


def test_random_workloads_never_poison_and_always_finish() -> None:
    started = time.monotonic()
    if ONLY is not None:
        tally = run_cases(iter([int(ONLY)]), 1)
        if tally.unrunnable:
            pytest.skip("this release cannot run that case")
    elif PROCESSES > 1:
        tally = run_in_processes(PROCESSES)
    else:
        tally = run_cases(itertools.count(), WORKLOADS)
    seconds = time.monotonic() - started
    checked = tally.checked
    report: dict[str, Any] = {
        "vllm": installed_version(),
        "commit": os.environ.get("MAMBA_ALIGN_SWEEP_COMMIT") or None,
        "seed": SEED,
        "processes": PROCESSES,
        "workloads": checked,
        "redrawn (this release cannot run them)": tally.unrunnable,
        "failed": len(tally.failures),
        "vLLM's own defects (stock too; recorded, not failures)": sorted(
            tally.vllm_defects
        ),
        "schedule() calls": tally.schedule_calls,
        "seconds": round(seconds),
        "modes": dict(sorted(tally.modes.items())),
        "shares": {
            label: round(count / max(checked, 1), 4)
            for label, count in sorted(tally.labels.items())
        },
    }
    if REPORT:
        with open(REPORT, "w") as handle:
            json.dump(report, handle, indent=1)
    print(json.dumps(report, indent=1))
    assert not tally.failures, "\n".join(tally.failures)
