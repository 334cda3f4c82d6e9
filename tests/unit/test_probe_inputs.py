"""``vllm-mamba-align probe`` on bad options and on servers that are not vLLM.

Exit 1 means "wrong states served", so every failure to probe is exit 2 with one
line naming the problem and the way out (one JSON object under ``--json``),
never a traceback, and no option can make a verdict pass a server. Each case
runs the real command against a listener started here on 127.0.0.1: a stdlib
HTTP server answering what the case says, a raw socket speaking another
protocol, or one that never answers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from vllm_mamba_align import cli
from vllm_mamba_align.cli import main
from vllm_mamba_align.probe import preflight

MODELS = {"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}
Answer = tuple[int, str, bytes]
"""Status, content type, body."""


def json_answer(value: Any, status: int = 200) -> Answer:
    return status, "application/json", json.dumps(value).encode()


class Server(ThreadingHTTPServer):
    """Answers each path as ``answers`` says (404 elsewhere), counting requests."""

    daemon_threads = True

    def __init__(self, answers: dict[str, Answer]) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.answers = answers
        self.requests: list[tuple[str, str, dict[str, str]]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    @property
    def completions(self) -> int:
        return sum(1 for method, path, _ in self.requests if method == "POST")


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.requests.append((method, self.path, dict(self.headers)))
        answer = self.server.answers.get(self.path)
        if answer is None:
            self.send_error(404)
            return
        status, kind, body = answer
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")


@pytest.fixture
def serve() -> Iterator[Callable[[dict[str, Answer]], Server]]:
    started: list[Server] = []

    def start(answers: dict[str, Answer]) -> Server:
        server = Server(answers)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


class RawListener:
    """A TCP listener that sends ``greeting`` to each connection (an SSH daemon
    says its version first), or nothing, and holds it open until closed."""

    def __init__(self, greeting: bytes | None) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.greeting = greeting
        self.accepted = threading.Event()
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.socket.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            self.held.append(connection)
            self.accepted.set()
            if self.greeting is not None:
                connection.sendall(self.greeting)

    def close(self) -> None:
        for connection in self.held:
            connection.close()
        self.socket.close()


@pytest.fixture
def listen() -> Iterator[Callable[[bytes | None], RawListener]]:
    started: list[RawListener] = []

    def start(greeting: bytes | None) -> RawListener:
        listener = RawListener(greeting)
        started.append(listener)
        return listener

    yield start
    for listener in started:
        listener.close()


def probe(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["probe", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def assert_cannot_probe(
    capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    """Exit 2 with one line naming the problem; the same, as JSON, with --json."""
    code, out, err = probe(capsys, *args)
    assert code == cli.EXIT_USAGE, out + err
    lines = [line for line in (out + err).splitlines() if words in line]
    assert len(lines) == 1, out + err
    assert lines[0].startswith(("vllm-mamba-align", "verdict: could not probe: "))
    code, out, err = probe(capsys, *args, "--json")
    assert code == cli.EXIT_USAGE
    report = json.loads(out)
    assert report["exit_code"] == cli.EXIT_USAGE
    assert words in report["problem"]
    assert report["verdict"].startswith("could not probe: ")


BAD_URLS = {
    "nonnumeric port": ("http://127.0.0.1:abc", "not a valid address"),
    "unclosed IPv6 bracket": ("http://[::1", "not a valid address"),
    "port above 65535": ("http://127.0.0.1:70000", "not a valid address"),
    "port 0": ("http://127.0.0.1:0", "port 0"),
    "a space": ("http://127.0.0.1:8000 /v1", "a space"),
    "scheme alone": ("http://", "names no host"),
    "ftp": ("ftp://127.0.0.1:21", "http:// and https:// only"),
    "one slash": ("http:/127.0.0.1:8000", "not an address"),
    "user and password": ("http://u:p@127.0.0.1:8000", "user name or password"),
    "query": ("http://127.0.0.1:8000/?key=1", "query or fragment"),
    "empty": ("", "--url is empty"),
}


@pytest.mark.parametrize(("url", "words"), list(BAD_URLS.values()), ids=list(BAD_URLS))
def test_a_bad_url_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], url: str, words: str
) -> None:
    assert_cannot_probe(capsys, ["--url", url], words)


BAD_OPTIONS = {
    "timeout -1": (["--timeout", "-1"], "--timeout -1 is not"),
    "timeout 0": (["--timeout", "0"], "--timeout 0 is not"),
    "timeout nan": (["--timeout", "nan"], "--timeout nan is not"),
    "timeout inf": (["--timeout", "inf"], "--timeout inf is not"),
    "timeout 1e9": (["--timeout", "1e9"], "--timeout 1e+09 is not"),
    "timeout abc": (["--timeout", "abc"], "invalid float value: 'abc'"),
    "threshold nan": (["--threshold", "nan"], "--threshold nan is not"),
    "threshold inf": (["--threshold", "inf"], "--threshold inf is not"),
    "threshold -1": (["--threshold", "-1"], "--threshold -1 is not"),
    "threshold 1e9": (["--threshold", "1e9"], "--threshold 1e+09 would pass"),
    "threshold 0.1": (["--threshold", "0.1"], "--threshold 0.1 would pass"),
    "rounding nan": (["--rounding", "nan"], "--rounding nan is not"),
    "rounding -1": (["--rounding", "-1"], "--rounding -1 is not"),
    "state block 1": (["--state-block", "1"], "--state-block 1 cannot"),
    "state block 0": (["--state-block", "0"], "--state-block 0 cannot"),
    "state block 12": (["--state-block", "12"], "--state-block 12 cannot"),
    "state block 33": (["--state-block", "33"], "--state-block 33 cannot"),
    "prompt tokens 0": (["--prompt-tokens", "0"], "--prompt-tokens 0 is out"),
    "prompt tokens -5": (["--prompt-tokens", "-5"], "--prompt-tokens -5 is out"),
    "prompt tokens 1e9": (
        ["--prompt-tokens", str(10**9)],
        f"--prompt-tokens {10**9} is out",
    ),
    "max requests 0": (["--max-requests", "0"], "--max-requests 0 must be 1"),
    "logprobs 0": (["--logprobs", "0"], "--logprobs 0 must be 1"),
    "max tokens -1": (["--max-tokens", "-1"], "--max-tokens -1 must be 1"),
    "unknown flag": (["--fast"], "unrecognized arguments: --fast"),
}


@pytest.mark.parametrize(
    ("options", "words"), list(BAD_OPTIONS.values()), ids=list(BAD_OPTIONS)
)
def test_a_bad_option_exits_2_before_any_request(
    capsys: pytest.CaptureFixture[str],
    serve: Callable[[dict[str, Answer]], Server],
    options: list[str],
    words: str,
) -> None:
    server = serve({"/v1/models": json_answer(MODELS)})
    assert_cannot_probe(capsys, ["--url", server.url, *options], words)
    assert server.requests == []


NOT_VLLM = {
    "non-JSON 200": ((200, "application/json", b"{not json"), "not JSON"),
    "an HTML page": (
        (200, "text/html", b"<!DOCTYPE html><html>Sign in</html>"),
        "not JSON (it begins '<!DOCTYPE html>",
    ),
    "top-level list": (json_answer([]), "lists no model"),
    "data not a list": (json_answer({"data": "m"}), "lists no model"),
    "no models": (json_answer({"data": []}), "lists no model"),
    "card without id": (json_answer({"data": [{"object": "model"}]}), "without a name"),
    "card not an object": (json_answer({"data": ["m"]}), "without a name"),
    "401": (json_answer({"error": {"message": "no"}}, 401), "set VLLM_API_KEY"),
}


def completion(top: Any, tokens: Any = ("token_id:7",)) -> dict[str, Any]:
    return {
        "choices": [{"logprobs": {"tokens": list(tokens), "top_logprobs": top}}],
        "usage": {"prompt_tokens": 10, "prompt_tokens_details": None},
    }


BAD_COMPLETIONS = {
    "non-JSON": ((200, "application/json", b"<html>"), "not JSON"),
    "no choices": (json_answer({"choices": []}), "not what an OpenAI-compatible"),
    "choice not an object": (json_answer({"choices": [3]}), "not what an OpenAI"),
    "logprob not a number": (
        json_answer(completion([{"token_id:7": "x"}])),
        "not what an OpenAI-compatible",
    ),
    "NaN logprob": (
        (
            200,
            "application/json",
            json.dumps(completion([{"t": float("nan")}])).encode(),
        ),
        "not a finite number",
    ),
    "positions not objects": (json_answer(completion([[1]])), "not what an OpenAI"),
    "HTTP 500": (json_answer({"message": "boom"}, 500), "HTTP 500: boom"),
}


ANSWERS = {
    **{
        f"models: {case}": ({"/v1/models": answer}, words)
        for case, (answer, words) in NOT_VLLM.items()
    },
    **{
        f"completion: {case}": (
            {"/v1/models": json_answer(MODELS), "/v1/completions": answer},
            words,
        )
        for case, (answer, words) in BAD_COMPLETIONS.items()
    },
}


@pytest.mark.parametrize(
    ("answers", "words"), list(ANSWERS.values()), ids=list(ANSWERS)
)
def test_a_server_answer_that_is_not_vllms_exits_2(
    capsys: pytest.CaptureFixture[str],
    serve: Callable[[dict[str, Answer]], Server],
    answers: dict[str, Answer],
    words: str,
) -> None:
    server = serve(answers)
    assert_cannot_probe(capsys, ["--url", server.url], words)


def test_a_listener_that_is_not_http_exits_2(
    capsys: pytest.CaptureFixture[str], listen: Callable[..., RawListener]
) -> None:
    ssh = listen(b"SSH-2.0-OpenSSH_9.6\r\n")
    assert_cannot_probe(capsys, ["--url", ssh.url], "does not speak HTTP")


def test_a_listener_that_never_answers_exits_2_at_the_timeout(
    capsys: pytest.CaptureFixture[str], listen: Callable[..., RawListener]
) -> None:
    silent = listen(None)
    args = ["--url", silent.url, "--timeout", "0.2"]
    assert_cannot_probe(capsys, args, "did not answer within 0.2 s: raise --timeout")


def test_the_api_key_comes_from_vllm_api_key_unless_given(
    capsys: pytest.CaptureFixture[str],
    serve: Callable[[dict[str, Answer]], Server],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = serve({"/v1/models": json_answer(MODELS)})
    monkeypatch.setenv(preflight.API_KEY_VARIABLE, "from-the-environment")
    probe(capsys, "--url", server.url)
    probe(capsys, "--url", server.url, "--api-key", "from-the-flag")
    monkeypatch.delenv(preflight.API_KEY_VARIABLE)
    probe(capsys, "--url", server.url)
    sent = [
        headers.get("Authorization")
        for _, path, headers in server.requests
        if path == "/v1/models"
    ]
    assert sent == [
        "Bearer from-the-environment",
        "Bearer from-the-flag",
        None,
    ]


def test_the_load_is_stated_before_the_first_completion(
    capsys: pytest.CaptureFixture[str],
    serve: Callable[[dict[str, Answer]], Server],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = serve(
        {
            "/v1/models": json_answer(MODELS),
            "/v1/completions": json_answer({"message": "stop here"}, 500),
        }
    )
    completions_when_stated: list[int] = []
    state = preflight.load_line

    def watched(plan: Any) -> str:
        completions_when_stated.append(server.completions)
        return state(plan)

    monkeypatch.setattr(preflight, "load_line", watched)
    code, out, err = probe(capsys, "--url", server.url, "--json")
    assert code == cli.EXIT_USAGE
    assert completions_when_stated == [0]
    workload = json.loads(out)["workload"]
    (line,) = [line for line in err.splitlines() if line.startswith("probe: ")]
    assert f"sending {workload['requests']} completions" in line
    assert f"{workload['prompt_tokens']:,} prompt tokens in all" in line
    longest = f"the longest prompt {workload['writer_tokens']:,} tokens"
    assert longest in line
    assert "--prompt-tokens N" in line


def test_a_bug_in_the_probe_exits_2_not_1(
    capsys: pytest.CaptureFixture[str],
    serve: Callable[[dict[str, Answer]], Server],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python's own exit status for an uncaught exception is 1, which reads as
    "wrong states served"."""

    def broken(*args: Any) -> Any:
        raise IndexError("list index out of range")

    monkeypatch.setattr(cli, "_run_probe", broken)
    server = serve({"/v1/models": json_answer(MODELS)})
    assert_cannot_probe(capsys, ["--url", server.url], "the probe itself failed")


@pytest.mark.parametrize("command", ["doctor", "simulate", "probe"])
def test_ctrl_c_exits_130_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    def interrupted(*args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, f"_{command}", interrupted)
    words = [command, *(["--url", "http://127.0.0.1:9"] if command == "probe" else [])]
    assert main(words) == cli.EXIT_INTERRUPTED
    out, err = capsys.readouterr()
    assert err == f"vllm-mamba-align {command}: interrupted\n"
    assert out == ""


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_sigint_during_a_probe_exits_130(
    listen: Callable[..., RawListener], as_json: bool, tmp_path: Any
) -> None:
    """A real Ctrl-C: SIGINT to the installed command while it waits on a server
    (run outside the checkout, importing the package this session imports)."""
    silent = listen(None)
    package = Path(cli.__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(package)}
    command = [sys.executable, "-m", "vllm_mamba_align", "probe", "--url", silent.url]
    running = subprocess.Popen(
        [*command, *(["--json"] if as_json else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
        # A shell's background job ignores SIGINT, and children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert silent.accepted.wait(30)
    time.sleep(0.2)
    running.send_signal(signal.SIGINT)
    out, err = running.communicate(timeout=30)
    assert running.returncode == cli.EXIT_INTERRUPTED
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "vllm-mamba-align probe: interrupted"
    if as_json:
        assert json.loads(out)["exit_code"] == cli.EXIT_INTERRUPTED
    else:
        assert out == ""
