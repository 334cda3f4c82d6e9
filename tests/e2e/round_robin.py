"""A load balancer in a few lines: every HTTP request to it goes to the next
upstream in turn, whatever its path or headers (``/v1/models``, ``/metrics`` and
completions alike), as a round-robin balancer in front of replicas does.

Used by ``test_distributed.py`` to put two ``vllm serve`` replicas behind one
URL. Serial clients only (the probe is one): requests are forwarded one at a
time, so the turn order is the order they arrived in.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

FORWARD_TIMEOUT = 600.0  # seconds for one upstream answer (a long prefill on CPU)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host"}


class RoundRobin(ThreadingHTTPServer):
    """Listens on 127.0.0.1 (a free port); ``url`` is its address."""

    daemon_threads = True

    def __init__(self, upstreams: list[str]) -> None:
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstreams = [urlsplit(url) for url in upstreams]
        self.turn = 0
        self.sent = [0] * len(upstreams)
        """Requests forwarded to each upstream."""
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> RoundRobin:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=10)


class _Forward(BaseHTTPRequestHandler):
    server: RoundRobin

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._forward()

    def do_POST(self) -> None:
        self._forward()

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {
            name: value
            for name, value in self.headers.items()
            if name.lower() not in HOP_BY_HOP
        }
        with self.server.lock:  # one at a time: the turn is the arrival order
            index = self.server.turn % len(self.server.upstreams)
            self.server.turn += 1
            self.server.sent[index] += 1
            upstream = self.server.upstreams[index]
            connection = http.client.HTTPConnection(
                upstream.hostname or "127.0.0.1",
                upstream.port,
                timeout=FORWARD_TIMEOUT,
            )
            try:
                connection.request(self.command, self.path, body, headers)
                answer = connection.getresponse()
                payload = answer.read()
                status, answer_headers = answer.status, answer.getheaders()
            finally:
                connection.close()
        self.send_response(status)
        for name, value in answer_headers:
            if name.lower() not in HOP_BY_HOP | {"content-length"}:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
