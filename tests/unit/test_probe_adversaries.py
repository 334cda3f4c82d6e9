"""The probe's exit 0 attacked: servers that serve wrong states at a GPU's
magnitudes, and correct servers at the edge of its rounding.

Two parts:

- **Scenarios**: each way a poisoned server could get exit 0, and each false
  alarm, with the numbers of the case against it, through the whole command
  (client, workload, judge, report) against ``probe_standin``'s HTTP server.
- **Properties**: the judge's functions (``run.settle``, ``report.decide``,
  what the command runs after its last request) on drawn servers: a server
  that serves a wrong state of ``judge.SMALLEST_WRONG_STATE`` or more never
  gets exit 0, and a correct server never gets exit 1. CI draws
  ``DRAWS`` (fixed seed, seconds); ``nox -s probe_adversaries`` draws more and
  runs the HTTP version through the stand-in.

The model of a server the properties draw (stated in docs/probe.md):

- its largest chunk-shape rounding ``r``; a correct resume differs from a
  fresh run by at most ``CORRECT_TO_ROUNDING`` x ``r`` (the H200's largest
  ratio of a correct resume to the decode-vs-prefill rounding, 1.22);
- a decode-vs-prefill sample (chunk shapes differ by construction) lies in
  [``r`` / ``ROUNDING_SPREAD``, ``r``] (the H200's correct resumes spread 3.9x);
- a sample beside the filler lies there where the filler moved a chunk end,
  or anywhere below where it moved none but batching changed shapes (0 where
  nothing changed);
- numerics: fp32 (``r`` at most ``--threshold`` / 1.22: vLLM's CPU engine
  measured 1.4e-6) or bf16 (``r`` from ``--threshold`` up; a difference that
  is not 0 is at least ``--threshold``: bf16 carries 8 bits of mantissa).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any

import pytest
from probe_standin import OTHER_TOP, TOP, Serving, standin

from vllm_mamba_align.cli import main
from vllm_mamba_align.probe import judge
from vllm_mamba_align.probe import run as probe_run
from vllm_mamba_align.probe.client import Completion
from vllm_mamba_align.probe.judge import (
    CORRECT_TO_ROUNDING,
    DEFAULT_THRESHOLD,
    ROUNDING_SPREAD,
    SMALLEST_WRONG_STATE,
    Observed,
    RoundingPair,
)
from vllm_mamba_align.probe.report import decide
from vllm_mamba_align.probe.run import Options, Probe, settle

DRAWS = int(os.environ.get("MAMBA_ALIGN_PROBE_DRAWS", "2000"))
"""Servers drawn per property (CI's default; ``nox -s probe_adversaries`` more)."""
HTTP_DRAWS = int(os.environ.get("MAMBA_ALIGN_PROBE_HTTP_DRAWS", "0"))
"""Servers drawn through the HTTP stand-in (0: not run)."""


@pytest.fixture
def probe(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    # The stand-in's /metrics is exact at once: no wait for late statistics.
    monkeypatch.setattr(probe_run, "STATS_SETTLE", 0.0)

    def run(serving: Serving, *options: str) -> dict[str, Any]:
        with standin(serving) as url:
            args = ["probe", "--url", url, "--json", "--prompt-tokens", "320"]
            code = main([*args, *options])
        out = capsys.readouterr().out
        report: dict[str, Any] = json.loads(out)
        assert report["exit_code"] == code
        return report

    return run


def reading(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The cases whose cached run read cached tokens (or may have: no details)."""
    return [c for c in report["cases"] if c["cached_tokens"] != 0]


# -- scenario 1: no usage details -------------------------------------------------


def test_no_usage_details_never_passes_a_wrong_state(probe: Any) -> None:
    """Rounding measured at 0.2 within the top-k, every cached continuation
    0.38 off, no ``--enable-prompt-tokens-details``: not 0 (it was)."""
    server = Serving(resume=0.38, decode=0.2, beside=0.2, details=False)
    report = probe(server)
    assert report["exit_code"] in (1, 5), report["verdict"]
    with_details = probe(Serving(resume=0.38, decode=0.2, beside=0.2))
    assert with_details["exit_code"] in (1, 5), with_details["verdict"]


def test_no_usage_details_and_no_difference_cannot_probe(probe: Any) -> None:
    """Nothing differs, but nothing shows the probe's own requests read a
    cached state: exit 2 naming the setting, not 0."""
    report = probe(Serving(decode=0.05, beside=0.05, details=False))
    assert report["exit_code"] == 2, report["verdict"]
    assert "--enable-prompt-tokens-details" in report["verdict"]


# -- scenario 2: the noise bound --------------------------------------------------


def test_a_noise_bound_never_passes_a_wrong_state(probe: Any) -> None:
    """Fresh runs 0.035 apart, rounding 0.06, every cached continuation 0.30
    off: the noise bound (0.35) passes wrong states, so it does not pass."""
    report = probe(Serving(resume=0.30, noise=0.035, decode=0.06, beside=0.06))
    assert report["exit_code"] in (1, 5), report["verdict"]
    assert report["bounds"]["within_rounding_up_to"] >= SMALLEST_WRONG_STATE


def test_a_noise_bound_does_not_stand_for_an_unmeasured_rounding(probe: Any) -> None:
    """The filler moved nothing, decode not reproducible: no rounding measured.
    Cached continuations 0.30 (and 0.12, within a noise bound of 0.12) off:
    never 0."""
    for resume, noise in ((0.30, 0.035), (0.12, 0.012)):
        server = Serving(resume=resume, noise=noise, reproducible=False, beside=0.0)
        report = probe(server)
        assert report["exit_code"] in (1, 5), (resume, report["verdict"])
        assert report["rounding_measured"] is False


# -- scenario 3: top-k lists compared whole ---------------------------------------


def test_a_changed_top_k_counts_its_gap(probe: Any) -> None:
    """Fresh top-5 {101: -0.2, 102: -2.5, ...}, cached {101: -0.2, 106: -2.6,
    ...}: token 102 fell by at least 1.4, and the case says so."""
    report = probe(Serving(resume_list=OTHER_TOP, decode=0.06, beside=0.06))
    assert report["exit_code"] == 1, report["verdict"]
    for case in reading(report):
        assert case["cached_vs_fresh"]["max_abs_delta_logprob"] == pytest.approx(1.4)
        assert case["verdict"] == "DIVERGED"


def test_the_gap_is_a_lower_bound_on_both_sides() -> None:
    top_b = dict(OTHER_TOP)
    a = Completion(("token_id:101",), (TOP,), 0, 10)
    b = Completion(("token_id:101",), (top_b,), 0, 10)
    assert judge.compare(a, b).delta == pytest.approx(1.4)
    assert judge.compare(b, a).delta == pytest.approx(1.4)
    # A token below the other list's k-th logprob says nothing: 0 there.
    low = {**TOP, "token_id:110": -9.0}
    c = Completion(("token_id:101",), (low,), 0, 10)
    assert judge.compare(a, c).delta == 0


# -- scenario 4: a rounding the probe distrusts -----------------------------------


def test_a_distrusted_rounding_sets_no_bound(probe: Any) -> None:
    """A rounding measurement that parted outside the top-k (the filler pair
    here, beside a decode pair 0.08 off; or the decode pair, where the filler
    pair moved 0.08 within the top-k and the decode pair is set aside): neither
    widens the bound, and a 0.15 wrong state is 'cannot tell' in the table
    (not 'rounding') and the exit 5 (not 0)."""
    for server in (
        Serving(resume=0.15, beside_parted=True, decode=0.08),
        Serving(resume=0.15, decode_parted=True, beside=0.08),
    ):
        report = probe(server)
        assert report["exit_code"] == 5, report["verdict"]
        assert report["bounds"]["within_rounding_up_to"] < 0.15
        assert report["rounding_measured"] is False
        assert {c["verdict"] for c in reading(report)} == {"cannot tell"}
    trust = {(s["kind"], s["trust"]) for s in report["rounding_samples"]}
    assert trust == {("beside the filler", "unverified")}, trust
    assert all(p["decode_departs_from_prefill"] for p in report["rounding"])
    first = probe(Serving(resume=0.15, beside_parted=True, decode=0.08))
    trust = {(s["kind"], s["trust"]) for s in first["rounding_samples"]}
    assert ("beside the filler", "distrusted") in trust, trust


def test_a_wild_rounding_passes_only_what_needs_no_rounding(probe: Any) -> None:
    """Wild rounding, cached continuations 0.12 off within a noise bound of
    0.12: 5. The same server with its continuations bit-identical to fresh
    runs: 0 (``full`` mode's shape), whatever the rounding."""
    wild = Serving(resume=0.12, noise=0.012, decode_parted=True, beside=0.08)
    assert probe(wild)["exit_code"] == 5
    exact = Serving(resume=0.0, decode_parted=True, beside=0.08)
    report = probe(exact)
    assert report["exit_code"] == 0, report["verdict"]
    assert "bit for bit" in report["verdict"]


# -- scenario 5: false alarms -----------------------------------------------------


def test_a_filler_pair_of_batching_alone_calls_nothing_wrong(probe: Any) -> None:
    """Decode not reproducible, the filler pair 0.003 apart (batching beside
    the filler, no chunk end moved), correct resumes 0.03 off: never 1."""
    server = Serving(resume=0.03, reproducible=False, beside=0.003)
    report = probe(server)
    assert report["exit_code"] == 5, report["verdict"]
    assert [s["trust"] for s in report["rounding_samples"]] == ["unverified"] * 2


def test_one_sample_size_widens_the_margin_to_the_h200_spread(probe: Any) -> None:
    """Decode samples 0.016 (the low end of the H200's correct resumes),
    correct resumes at 0.062 (its high end): 3.9x the samples, never 1."""
    report = probe(Serving(resume=0.062, decode=0.016, beside=0.016))
    assert report["exit_code"] != 1, report["verdict"]
    margin = report["rounding_margin"]
    assert margin == pytest.approx(CORRECT_TO_ROUNDING * ROUNDING_SPREAD)


# -- scenario 6: ranks ------------------------------------------------------------


def test_ranks_asked_of_a_server_that_ignores_the_header(probe: Any) -> None:
    """``--ranks 2`` against a server that ignores the rank header: one probe,
    exit 5 naming why, never "no wrong state on any of 2 ranks"."""
    report = probe(Serving(decode=0.01, beside=0.01), "--ranks", "2")
    assert report["exit_code"] == 5, report["verdict"]
    assert len(report["ranks"]) == 1
    assert "any of 2 ranks" not in report["verdict"]
    single = probe(Serving(decode=0.01, beside=0.01), "--rank", "1")
    assert single["exit_code"] == 5, single["verdict"]
    assert "asked for rank 1" in single["verdict"]


def test_a_rank_count_given_is_checked(probe: Any) -> None:
    report = probe(Serving(ranks=3, decode=0.01, beside=0.01), "--ranks", "2")
    assert report["exit_code"] == 2 and report["ranks"] == []
    assert "--ranks 2, but the server has 3" in report["verdict"]
    report = probe(Serving(ranks=2, decode=0.01, beside=0.01), "--rank", "5")
    assert report["exit_code"] == 2, report["verdict"]


def test_requests_spread_over_engines_cannot_be_told(probe: Any) -> None:
    """A proxy that drops the rank header: /metrics shows two engines, each
    counting half the prompt tokens: exit 5 with the reason."""
    report = probe(Serving(decode=0.01, beside=0.01, engines=(0.5, 0.5)))
    assert report["exit_code"] == 5, report["verdict"]
    assert report["reached_other_engines"] is True
    assert "spread over the server's engines" in report["verdict"]
    one = probe(Serving(decode=0.01, beside=0.01, engines=(1.0, 0.0)))
    assert one["exit_code"] == 0, one["verdict"]


# -- the properties ---------------------------------------------------------------


def _loguniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _run(
    tokens: str, top: dict[str, float], cached: int | None, prompt: int = 64
) -> Completion:
    return Completion((tokens,), (top,), cached, prompt)


def _shift(by: float) -> dict[str, float]:
    return {token: value - by for token, value in TOP.items()}


@dataclass
class Drawn:
    """One drawn server: its truth, and what the probe saw of it."""

    rounding: float
    largest_resume: float
    details: bool
    probe: Probe
    observed: list[Observed]

    def decide(self) -> int:
        settle(self.probe, self.observed)
        return decide(self.probe).exit_code


def _sample(rng: random.Random, r: float) -> float:
    return rng.uniform(r / ROUNDING_SPREAD, r)


def _beside(rng: random.Random, r: float, fp32: bool) -> float:
    kind = rng.random()
    if kind < 0.5:
        return _sample(rng, r)  # the filler moved a chunk end
    if kind < 0.7:
        return 0.0  # nothing moved, nothing batched differently
    if fp32:
        return rng.uniform(0.0, r)  # batching alone
    return rng.uniform(min(DEFAULT_THRESHOLD, r), r)


def draw(rng: random.Random, wrong: float | None) -> Drawn:
    """A server: correct (``wrong`` None) or serving a wrong state of
    ``wrong`` on at least one case that read cached tokens."""
    fp32 = rng.random() < 0.3
    r = (
        _loguniform(rng, 1e-8, DEFAULT_THRESHOLD / CORRECT_TO_ROUNDING)
        if fp32
        else _loguniform(rng, DEFAULT_THRESHOLD, 0.2)
    )
    details = rng.random() < 0.85
    noise = 0.0 if rng.random() < 0.6 else _loguniform(rng, 1e-8, 0.05)
    pairs = []
    for _ in range(2):
        decode = _shift(_sample(rng, r))
        if rng.random() < 0.1:  # a near tie decided by rounding
            decode = {"token_id:98": -0.5, "token_id:97": -3.0}
        second = _shift(0.0 if rng.random() < 0.6 else rng.uniform(0.01, 0.7))
        beside = _shift(_beside(rng, r, fp32))
        pairs.append(
            RoundingPair(
                64,
                Completion(("token_id:101",) * 2, (TOP, TOP), 0, 64),
                _run(
                    "token_id:98" if "token_id:98" in decode else "token_id:101",
                    decode,
                    0,
                ),
                Completion(("token_id:101",) * 2, (second, second), 0, 64),
                _run("token_id:101", beside, 0),
            )
        )
    observed, largest = [], 0.0
    cases = rng.randint(3, 14)
    wrong_at = rng.randrange(cases)
    for number in range(cases):
        cached: int | None = 0 if rng.random() < 0.15 else 100
        if number == wrong_at:
            cached = 100
        if not details:
            cached = None
        if wrong is not None and number == wrong_at:
            if rng.random() < 0.3:  # the lower tokens replaced, a gap of `wrong`
                floor = TOP["token_id:102"] - wrong
                top = {"token_id:101": -0.2, "token_id:120": floor + 0.05}
                top |= {"token_id:121": floor}
            else:
                top = _shift(wrong * rng.choice((1.0, -1.0)))
        else:
            resume = rng.uniform(0, CORRECT_TO_ROUNDING * r)
            largest = max(largest, resume) if cached != 0 else largest
            top = _shift(resume)
        fresh_second = _shift(noise * rng.choice((1.0, -1.0)))
        observed.append(
            Observed(
                f"case{number}",
                32,
                "a state",
                _run("token_id:101", top, cached),
                (_run("token_id:101", TOP, 0), _run("token_id:101", fresh_second, 0)),
            )
        )
    found = Probe(Options(url="http://standin"))
    found.rounding = pairs
    return Drawn(r, largest, details, found, observed)


def test_a_wrong_state_of_the_smallest_claimed_size_never_gets_exit_0() -> None:
    rng = random.Random(20261206)
    seen = {0: 0, 1: 0, 2: 0, 5: 0}
    for _ in range(DRAWS):
        wrong = SMALLEST_WRONG_STATE * _loguniform(rng, 1.0, 20.0)
        drawn = draw(rng, wrong)
        code = drawn.decide()
        seen[code] += 1
        assert code != 0, (wrong, drawn.rounding, decide(drawn.probe).verdict)
    # The draws reach both other verdicts, so the property is not vacuous.
    assert seen[1] > 0 and seen[5] > 0, seen


def test_a_correct_server_never_gets_exit_1() -> None:
    rng = random.Random(61202026)
    seen = {0: 0, 1: 0, 2: 0, 5: 0}
    for _ in range(DRAWS):
        drawn = draw(rng, None)
        code = drawn.decide()
        seen[code] += 1
        assert code != 1, (drawn.rounding, drawn.largest_resume, decide(drawn.probe))
    assert seen[0] > DRAWS // 10 and seen[5] > 0, seen


def test_the_margin_covers_the_h200_spread() -> None:
    """The wrong-state bound over the largest decode sample is at least what a
    correct resume may reach over it, for samples of any spread."""
    for spread in (1.0, 1.5, 2.0, 3.0, 3.9, 10.0):
        low = 0.01
        margin = judge.rounding_margin([low, low * spread])
        largest = low * spread
        worst_rounding = low * ROUNDING_SPREAD if spread < ROUNDING_SPREAD else largest
        assert margin * largest >= CORRECT_TO_ROUNDING * worst_rounding - 1e-12


@pytest.mark.skipif(
    not HTTP_DRAWS, reason="the HTTP draws run in nox -s probe_adversaries"
)
def test_the_properties_through_the_http_standin(probe: Any) -> None:
    """The same properties through the whole command and a stand-in server:
    ``HTTP_DRAWS`` servers, each with one kind of difference on every reading
    case (``probe_standin.Serving``)."""
    rng = random.Random(6122026)
    for _ in range(HTTP_DRAWS):
        r = _loguniform(rng, DEFAULT_THRESHOLD, 0.2)
        wrong = rng.random() < 0.5
        reproducible = rng.random() < 0.6
        serving = Serving(
            resume=(
                SMALLEST_WRONG_STATE * _loguniform(rng, 1.0, 20.0)
                if wrong
                else rng.uniform(0, CORRECT_TO_ROUNDING * r)
            ),
            noise=0.0 if rng.random() < 0.6 else _loguniform(rng, 1e-8, 0.05),
            decode=_sample(rng, r),
            reproducible=reproducible,
            beside=_beside(rng, r, False),
            details=rng.random() < 0.85,
        )
        report = probe(serving)
        code = report["exit_code"]
        if wrong:
            assert code != 0, (serving, report["verdict"])
        else:
            assert code != 1, (serving, report["verdict"])
