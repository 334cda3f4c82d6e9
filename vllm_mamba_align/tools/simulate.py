"""``vllm-mamba-align simulate``: stock and patched vLLM side by side on one geometry.

Runs the installed vLLM's real scheduler on CPU (tools/sim: no GPU, no weights)
once per mode on the same scenario: ``requests`` prompts of ``prompt`` tokens
prefilled together, then an immediate re-ask of the first and two siblings sharing
its first ``share`` tokens (at vLLM's default state retention the first sibling
makes vLLM keep the junction state, the second reads it). What operators asked
upstream, answered per mode: where chunks end, which states get saved, how many
published hashes lie, what a re-ask and the siblings reuse, and how many prefill
steps it took.
"""

from __future__ import annotations

import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Any, TextIO

from .modes import simulated_modes

__all__ = ["simulated_modes"]


@dataclass(frozen=True)
class Scenario:
    """What the user asked for (validated by the CLI)."""

    cache_block: int = 816
    state_block: int = 1648
    hash_block: int = 16
    prompt: int = 16764
    budget: int = 8192
    share: int = 9000
    requests: int = 1
    retention: int | str | None = "default"
    """vLLM's state retention: "default" (what the installed vLLM uses when
    nothing is set), None (dense) or an interval (0 or R > 0)."""
    async_scheduling: bool = False
    """vLLM's AsyncScheduler, one step in flight (vLLM's default on GPU)."""
    drafter: tuple[str, int] | None = None
    """A speculative drafter, (method, tokens per step); None: none."""
    checkpoint_backend: str | None = None
    """A GPU backend that writes one state inside a prefill chunk
    (``tools.installed.CHECKPOINT_BACKEND_FILES``), by its alignment; None: none
    (the CPU backend)."""


@dataclass
class ModeResult:
    mode: str
    chunk_ends: list[int]
    materialized: list[int]
    published: int
    poisoned: int
    kept_states: int
    """Boundary states vLLM keeps that the prefill chunks materialized."""
    lost_kept: int
    """Boundary states vLLM would keep that no chunk materialized."""
    noncanonical: int
    """Kept states not computed one B block per chunk from token 0."""
    retention: str
    wrong_reuse: list[str]
    reask_reuse: int
    sibling_reuse: int
    second_sibling_reuse: int
    prefill_steps: int
    """Steps the first request needed to finish its prefill."""
    all_prefilled_steps: int
    """Steps until every one of the concurrent prompts had finished its prefill."""
    seconds: float


RETENTION_FORMS = "default (vLLM's own default), dense (keep every state) or N >= 0"


def parse_retention(raw: str) -> int | str | None:
    """``--retention``: ``default``, ``dense`` or a non-negative interval."""
    value = raw.strip().lower()
    if value == "default":
        return "default"
    if value in ("dense", "none"):
        return None
    try:
        interval = int(value)
    except ValueError:
        interval = -1
    if interval < 0:
        raise ValueError(f"--retention {raw!r} is not valid: use {RETENTION_FORMS}")
    return interval


DRAFTER_FORMS = "METHOD:K with METHOD mtp, multi-mtp or eagle and K from 1 to 8"


def parse_drafter(raw: str) -> tuple[str, int]:
    """``--drafter``: ``mtp:2``, ``eagle:3``... (K defaults to 1)."""
    from .sim import SPECULATIVE_METHODS

    method, _, count = raw.strip().lower().partition(":")
    try:
        k = int(count) if count else 1
    except ValueError:
        k = 0
    if method not in SPECULATIVE_METHODS or not 1 <= k <= 8:
        raise ValueError(f"--drafter {raw!r} is not valid: use {DRAFTER_FORMS}")
    return method, k


def validate(s: Scenario) -> list[str]:
    """Everything wrong with a scenario, as sentences (empty: fine)."""
    from .sim import MAX_MODEL_LEN

    problems = []
    for name, value in (
        ("--cache-block", s.cache_block),
        ("--mamba-block", s.state_block),
        ("--hash-block", s.hash_block),
        ("--prompt", s.prompt),
        ("--budget", s.budget),
    ):
        if value <= 0:
            problems.append(f"{name} must be a positive number of tokens, not {value}")
    if s.requests <= 0:
        problems.append(
            f"--requests must be a positive number of prompts, not {s.requests}"
        )
    if problems:
        return problems
    if s.state_block % s.hash_block:
        problems.append(
            f"--mamba-block {s.state_block} is not a multiple of --hash-block "
            f"{s.hash_block}: vLLM hashes prefixes in hash blocks, so every group's "
            "block must be a multiple of it"
        )
    if s.cache_block % s.hash_block:
        problems.append(
            f"--cache-block {s.cache_block} is not a multiple of --hash-block "
            f"{s.hash_block}"
        )
    if s.share < 0 or s.share > s.prompt:
        problems.append(f"--share must be between 0 and --prompt ({s.prompt})")
    if s.prompt + 1 > MAX_MODEL_LEN:
        problems.append(f"--prompt must be below {MAX_MODEL_LEN} (the model length)")
    if s.requests > 64:
        problems.append("--requests is limited to 64 (the simulated pool size)")
    if s.checkpoint_backend is not None:
        from ..releases import installed_version
        from .sim import available_checkpoint_backends

        found = available_checkpoint_backends()
        if s.checkpoint_backend not in found:
            problems.append(
                f"--checkpoint-backend {s.checkpoint_backend}: vLLM "
                f"{installed_version()} declares no prefill checkpoint blocks "
                f"for it (it does for: {', '.join(found) or 'none'})"
            )
    return problems


def _geometry(s: Scenario) -> Any:
    from .sim import Geometry

    # Enough blocks that nothing is evicted: every prompt's attention and Mamba
    # blocks, plus the re-ask and the sibling, twice over.
    per_request = -(-s.prompt // s.cache_block) + -(-s.prompt // s.state_block) + 4
    return Geometry(
        cache_block=s.cache_block,
        state_block=s.state_block,
        budget=s.budget,
        hash_block=s.hash_block,
        num_blocks=max(4000, 2 * per_request * (s.requests + 3)),
        retention=s.retention,
        async_scheduling=s.async_scheduling,
        speculative=s.drafter,
        prefill_checkpoint=s.checkpoint_backend,
    )


MAX_STEPS = 200_000
"""A scenario still unfinished after this many steps has stalled."""


class Progress:
    """A line on stderr every couple of seconds, only once a run takes a while."""

    def __init__(self, stream: TextIO, label: str) -> None:
        self.stream = stream
        self.label = label
        self.start = time.monotonic()
        self.last = self.start

    def tick(self, sim: Any) -> None:
        """After a step of ``sim``: a line if the run has taken a while."""
        now = time.monotonic()
        if now - self.start > 2 and now - self.last > 2:
            self.last = now
            records = sim.records.values()
            done = sum(1 for r in records if r.prefilled_at_step is not None)
            print(
                f"  {self.label}: step {sim.steps}, {done}/{len(records)} prompts "
                "prefilled, "
                f"{now - self.start:.0f}s",
                file=self.stream,
                flush=True,
            )


def run_mode(s: Scenario, mode: str, progress_stream: TextIO) -> ModeResult:
    """The scenario on a fresh real scheduler in one mode."""
    from ..retention import read_retention
    from .modes import scheduler_mode
    from .sim import Simulation, prompt

    began = time.monotonic()
    first = prompt(s.prompt, seed=1)
    with scheduler_mode(mode):
        sim = Simulation(_geometry(s))
        progress = Progress(progress_stream, mode)
        sim.add("r0", first)
        for i in range(1, s.requests):
            sim.add(f"r{i}", prompt(s.prompt, seed=100 + i))
        sim.run(MAX_STEPS, progress.tick)
        all_prefilled = max(r.prefilled_at_step or 0 for r in sim.records.values())
        ends = sim.chunk_ends("r0")
        materialized = sim.materialized_boundaries("r0")
        sim.add("re-ask", first)
        sim.run(MAX_STEPS, progress.tick)
        sim.add("sibling", first[: s.share] + prompt(max(1, s.prompt - s.share), 2))
        sim.run(MAX_STEPS, progress.tick)
        sim.add("sibling-2", first[: s.share] + prompt(max(1, s.prompt - s.share), 3))
        sim.run(MAX_STEPS, progress.tick)
    first_record = sim.records["r0"]
    return ModeResult(
        mode=mode,
        chunk_ends=ends,
        materialized=materialized,
        published=len(sim.published),
        poisoned=len(sim.poisoned),
        kept_states=sim.kept_writes,
        lost_kept=len(sim.missing_kept),
        noncanonical=len(sim.noncanonical_kept),
        retention=read_retention(sim.scheduler, sim.state_block).describe(),
        wrong_reuse=list(sim.wrong_reuse),
        reask_reuse=sim.reused("re-ask"),
        sibling_reuse=sim.reused("sibling"),
        second_sibling_reuse=sim.reused("sibling-2"),
        prefill_steps=first_record.prefilled_at_step or 0,
        all_prefilled_steps=all_prefilled,
        seconds=time.monotonic() - began,
    )


# -- rendering ---------------------------------------------------------------------

PICTURE_WIDTH = 80


def picture(s: Scenario, results: list[ModeResult]) -> list[str]:
    """Chunk ends of the first request against the state grid, one line per mode.

    ``|`` marks a B boundary; ``*`` a chunk end on a boundary (a state is saved
    there), ``^`` a chunk end off the grid (nothing saved), ``#`` both in one cell.
    """
    width = PICTURE_WIDTH
    scale = s.prompt / width

    def column(position: int) -> int:
        return min(width - 1, max(0, round(position / scale) - 1))

    grid = ["-"] * width
    from .sim import cacheable_boundaries

    for boundary in cacheable_boundaries(s.prompt, s.state_block):
        grid[column(boundary)] = "|"
    label = 8
    lines = [
        f"{'B grid':<{label}}{''.join(grid)}",
    ]
    for result in results:
        row = [" "] * width
        for end in result.chunk_ends:
            mark = "*" if end % s.state_block == 0 else "^"
            cell = column(end)
            row[cell] = mark if row[cell] in (" ", mark) else "#"
        lines.append(f"{result.mode:<{label}}{''.join(row).rstrip()}")
    lines.append(
        f"{'':<{label}}0{'':<{width - 2 - len(str(s.prompt))}}{s.prompt} tokens"
    )
    lines.append(
        f"{'':<{label}}| = a multiple of B={s.state_block}   * = chunk end on it "
        "(state written)   ^ = chunk end off it"
    )
    return lines


def _ends(ends: list[int], limit: int = 12) -> str:
    shown = ", ".join(str(e) for e in ends[:limit])
    return shown + (f", … ({len(ends)} chunks)" if len(ends) > limit else "")


def _serving(s: Scenario) -> str:
    """The serving options the scenario adds, as one line."""
    parts = []
    if s.async_scheduling:
        parts.append("async scheduling")
    if s.drafter:
        parts.append(
            f"a drafter ({s.drafter[0]}) proposing {s.drafter[1]} token(s) a step "
            "(every draft accepted)"
        )
    if s.checkpoint_backend:
        parts.append(
            f"the {s.checkpoint_backend} backend's in-chunk prefill checkpoint"
        )
    return "With " + " and ".join(parts) + "."


def _reuse(tokens: int, result: ModeResult, request_id: str) -> str:
    """Tokens a request reused, marked WRONG when it resumed from a wrong state."""
    wrong = any(w.startswith(f"{request_id} ") for w in result.wrong_reuse)
    return f"{tokens}" + (" WRONG" if wrong else "")


def render(s: Scenario, results: list[ModeResult]) -> str:
    from .sim import cacheable_boundaries

    boundaries = len(cacheable_boundaries(s.prompt, s.state_block))
    legal_reask = (s.prompt - 1) // s.state_block * s.state_block
    lines = [
        f"Real vLLM scheduler, C={s.cache_block}, B={s.state_block}, hash block "
        f"{s.hash_block}, budget {s.budget}:",
        f"{s.requests} prompt(s) of {s.prompt} tokens, then a re-ask and two "
        f"siblings sharing its first {s.share} tokens.",
        *(
            [_serving(s)]
            if s.async_scheduling or s.drafter or s.checkpoint_backend
            else []
        ),
        *(textwrap.wrap(f"vLLM's {results[0].retention}.", 100) if results else [""]),
        "",
        *picture(s, results),
        "",
        "chunk ends of the first prompt:",
        *(f"  {r.mode:<7} {_ends(r.chunk_ends)}" for r in results),
        "",
    ]
    header = ["", *(r.mode for r in results)]
    rows: list[list[str]] = [
        [
            f"B boundaries in the cache (of {boundaries})",
            *(str(len(r.materialized)) for r in results),
        ],
        ["states vLLM keeps, saved", *(str(r.kept_states) for r in results)],
        ["  ... lost (inside a chunk)", *(str(r.lost_kept) for r in results)],
        [
            "  ... non-canonical (not 1 block/chunk)",
            *(str(r.noncanonical) for r in results),
        ],
        ["Mamba hashes published", *(str(r.published) for r in results)],
        ["  ... naming a wrong state", *(str(r.poisoned) for r in results)],
        [
            f"re-ask reuses (last B boundary {legal_reask})",
            *(str(r.reask_reuse) for r in results),
        ],
        [
            f"sibling (shares {s.share}) reuses",
            *(_reuse(r.sibling_reuse, r, "sibling") for r in results),
        ],
        [
            f"second sibling (same {s.share}) reuses",
            *(_reuse(r.second_sibling_reuse, r, "sibling-2") for r in results),
        ],
        ["reads of a wrong state", *(str(len(r.wrong_reuse)) for r in results)],
        ["prefill steps, first prompt", *(str(r.prefill_steps) for r in results)],
    ]
    if s.requests > 1:
        rows.append(
            [
                f"steps until all {s.requests} prefilled",
                *(str(r.all_prefilled_steps) for r in results),
            ]
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append(
            "  ".join(
                cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
                for i, cell in enumerate(row)
            ).rstrip()
        )
    if results and results[0].retention.startswith("state retention 0 "):
        lines += [
            "",
            "At this retention vLLM keeps a prompt's replay boundary and the junctions "
            "of shared",
            "prefixes: the first sibling makes it keep the junction state, the second "
            "reads it.",
        ]
    poisoned = [r.mode for r in results if r.poisoned]
    if poisoned:
        lines += [
            "",
            f"{', '.join(poisoned)}: a hash naming a wrong state is a Mamba block "
            "published for a prefix",
            "whose state it does not hold; a request that hits it continues from "
            "that wrong state",
            "(silently wrong output).",
        ]
    return "\n".join(lines)


def simulate(
    s: Scenario, modes: list[str], progress_stream: TextIO = sys.stderr
) -> list[ModeResult]:
    """Register the plugin in this process and run each mode in turn."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if "vllm" not in sys.modules:
        # vLLM's log lines (one per scheduler built, CPU-platform warnings) would
        # bury the comparison on stdout: leave them to Python's default (stderr,
        # warnings and up). Only before vLLM configures its logging, so a process
        # that already runs vLLM (a test session) keeps its settings.
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from .. import register

    register()
    return [run_mode(s, mode, progress_stream) for mode in modes]
