"""A stand-in vLLM server for the probe's adversaries: it answers every
request the probe sends with logprobs set by a ``Serving`` (the numbers of one
scenario: how far its cached continuations, its fresh runs and its rounding
measurements differ), over real HTTP on 127.0.0.1.

It knows the probe's requests only by what any server sees: the cache salt's
last words (``cached``, ``fresh-N``, ``rounding-N-decode`` and so on, the
probe's own naming, which a server is free to read), the prompt, and the rank
header. Every answer carries one top-5 list, shifted as the scenario says.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOP = {
    "token_id:101": -0.2,
    "token_id:102": -2.5,
    "token_id:103": -3.0,
    "token_id:104": -3.5,
    "token_id:105": -4.0,
}
"""Every position's top-5, before a scenario shifts it (scenario 3's fresh list)."""
CHOSEN = "token_id:101"
OTHER_TOP = {
    "token_id:101": -0.2,
    "token_id:106": -2.6,
    "token_id:107": -3.1,
    "token_id:108": -3.4,
    "token_id:109": -3.9,
}
"""Scenario 3's cached list: the same first token, the rest replaced, each
logprob within 0.1 of the fresh list's at its rank (token 102 fell by at
least 1.4)."""
PARTED = {"token_id:98": -0.5, "token_id:97": -3.0}
"""A top list sharing no token with ``TOP``: a measurement parted outside the top-k."""


@dataclass
class Serving:
    """One server's numbers, as differences from ``TOP`` (each a shift of every
    logprob of a top list, so the probe's comparison of two lists sees it
    whole)."""

    resume: float = 0.0
    """Every cached-family run that reused tokens (the cases), against fresh."""
    resume_list: dict[str, float] | None = None
    """Replaces those runs' top list instead (``resume`` ignored)."""
    wrong_cases: int | None = None
    """Only the first N reusing cached runs carry ``resume`` (None: all)."""
    noise: float = 0.0
    """Every second fresh run of a case, shifted: fresh-vs-fresh noise."""
    decode: float = 0.0
    """The prefill of the decoded tokens against the last decode step."""
    decode_parted: bool = False
    """That prefill chooses a token outside the decode step's top-k."""
    reproducible: bool = True
    """The two decode runs of a rounding prompt agree (else the second is 0.7 off)."""
    beside: float | tuple[float, ...] = 0.0
    """The prompt beside its filler against its serial prefill (per rounding
    prompt when a tuple; 0: the filler moved nothing)."""
    beside_parted: bool = False
    details: bool = True
    """``usage.prompt_tokens_details.cached_tokens`` reported."""
    ranks: int | None = None
    """Refuse a rank header at or beyond it, naming the range (None: ignore it)."""
    engines: tuple[float, ...] = ()
    """``/metrics`` shows ``vllm:prompt_tokens_total`` per engine, each counting
    this share of the prompt tokens sent (empty: no such series)."""
    seen: list[dict[str, Any]] = field(default_factory=list)
    """The request bodies, with the rank header as ``_rank``."""


def _shifted(top: dict[str, float], by: float) -> dict[str, float]:
    return {token: value - by for token, value in top.items()}


def _choice(
    tokens: int, top: dict[str, float], index: int = 0, chosen: str = CHOSEN
) -> dict[str, Any]:
    return {
        "index": index,
        "logprobs": {"tokens": [chosen] * tokens, "top_logprobs": [top] * tokens},
    }


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, payload: Any, status: int = 200, kind: str = "json") -> None:
        body = (payload if kind == "text" else json.dumps(payload)).encode()
        self.send_response(status)
        self.send_header(
            "Content-Type", "text/plain" if kind == "text" else "application/json"
        )
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send({"data": [{"id": "standin", "max_model_len": 65536}]})
        elif self.path == "/metrics":
            self._send(self.server.metrics(), kind="text")
        else:
            self._send({"error": {"message": "not found"}}, 404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        serving = self.server.serving
        rank = self.headers.get("X-data-parallel-rank")
        if (
            rank is not None
            and serving.ranks is not None
            and int(rank) >= serving.ranks
        ):
            message = f"data_parallel_rank {rank} is out of range [0, {serving.ranks})."
            self._send({"error": {"message": message}}, 400)
            return
        serving.seen.append({**body, "_rank": rank})
        self._send(self.server.answer(body))


class _Server(ThreadingHTTPServer):
    def __init__(self, serving: Serving) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.serving = serving
        self.prompt_tokens = 0
        self.writer_seen = False
        self.reusing = 0
        self.fresh = 0
        self.lock = threading.Lock()

    def metrics(self) -> str:
        lines = [
            'vllm:cache_config_info{enable_prefix_caching="True",'
            'mamba_block_size="32"} 1.0'
        ]
        for engine, share in enumerate(self.serving.engines):
            lines.append(
                f'vllm:prompt_tokens_total{{engine="{engine}",model_name="standin"}} '
                f"{int(self.prompt_tokens * share)}.0"
            )
        return "\n".join(lines) + "\n"

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        serving, salt, prompt = self.serving, body["cache_salt"], body["prompt"]
        with self.lock:
            several = isinstance(prompt[0], list)
            self.prompt_tokens += sum(map(len, prompt)) if several else len(prompt)
        cached = 0
        steps = int(body["max_tokens"])
        if salt.endswith("-beside"):
            number = int(salt.rsplit("-", 2)[-2]) - 1
            shifts = serving.beside
            shift = shifts[number] if isinstance(shifts, tuple) else shifts
            top = PARTED if serving.beside_parted else _shifted(TOP, shift)
            chosen = "token_id:98" if serving.beside_parted else CHOSEN
            choices = [_choice(1, TOP, 0), _choice(1, top, 1, chosen)]
            return self._usage({"choices": choices}, sum(map(len, prompt)), 0)
        if salt.endswith("-decode"):
            choices = [_choice(steps, TOP)]
        elif salt.endswith("-redecode"):
            shift = 0.0 if serving.reproducible else 0.7
            choices = [_choice(steps, _shifted(TOP, shift))]
        elif salt.endswith("-prefill"):
            if serving.decode_parted:
                choices = [_choice(1, PARTED, chosen="token_id:98")]
            else:
                choices = [_choice(1, _shifted(TOP, serving.decode))]
        elif salt.endswith("-ranks"):
            choices = [_choice(1, TOP)]
        elif salt.endswith("cached"):
            with self.lock:
                first, self.writer_seen = not self.writer_seen, True
                self.reusing += 0 if first else 1
                number = self.reusing
            cached = 0 if first else max(1, len(prompt) - 16)
            wrong = serving.wrong_cases is None or number <= serving.wrong_cases
            if first or not wrong:
                top = TOP
            elif serving.resume_list is not None:
                top = serving.resume_list
            else:
                top = _shifted(TOP, serving.resume)
            choices = [_choice(steps, top)]
        else:  # a case's fresh run
            with self.lock:
                self.fresh += 1
                noisy = self.fresh % 2 == 0
            choices = [_choice(steps, _shifted(TOP, serving.noise if noisy else 0.0))]
        return self._usage({"choices": choices}, len(prompt), cached)

    def _usage(
        self, answer: dict[str, Any], tokens: int, cached: int
    ) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": tokens}
        if self.serving.details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return {**answer, "usage": usage}


@contextmanager
def standin(serving: Serving) -> Iterator[str]:
    """Serve ``serving`` on 127.0.0.1 while the block runs; yields its URL."""
    server = _Server(serving)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
