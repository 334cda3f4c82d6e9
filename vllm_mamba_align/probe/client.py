"""HTTP to an OpenAI-compatible vLLM server, with the standard library only.

The probe needs three things from a server: the served models
(``GET /v1/models``), greedy completions of token-id prompts with top-k
logprobs (``POST /v1/completions``), and, when it is there, the Prometheus text
of ``GET /metrics``. Every failure becomes a ``CannotProbe`` that says what went
wrong and the way out, so the command can exit 2 with one clear message: a
refused or dropped connection, a listener that does not speak HTTP, an answer
that is not JSON (a proxy's login page), JSON of another shape, a logprob that
is not a finite number (it would compare as "no difference").
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

MAX_ANSWER_BYTES = 64 << 20
"""The largest answer read: a completion of a few tokens is kilobytes, vLLM's
/metrics a few megabytes; a server streaming more is not one the probe knows."""


class CannotProbe(Exception):
    """The server cannot be probed: the message names why and the way out."""


@dataclass(frozen=True)
class Completion:
    """What one greedy completion returned, as the judge reads it."""

    tokens: tuple[str, ...]
    """The generated tokens (``token_id:N`` with ``return_tokens_as_token_ids``)."""
    top_logprobs: tuple[dict[str, float], ...]
    """Per generated position: the top-k tokens and their logprobs."""
    cached_tokens: int | None
    """``usage.prompt_tokens_details.cached_tokens``; None when the server does
    not report it (``--enable-prompt-tokens-details`` is off)."""
    prompt_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": list(self.tokens),
            "top_logprobs": [dict(p) for p in self.top_logprobs],
            "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
        }


NO_LOGPROBS = (
    "the server returned no logprobs: it cannot be probed without them. vLLM "
    "returns none when it runs with --skip-tokenizer-init (start it with the "
    "model's tokenizer) or when --max-logprobs is below {k} (lower --logprobs, "
    "or raise --max-logprobs)"
)


NOT_A_COMPLETION = (
    "the server's completion response is not what an OpenAI-compatible vLLM "
    "server sends ({detail}): check --url (the probe adds /v1/completions itself)"
)


def parse_completion(body: Any, logprobs: int, index: int = 0) -> Completion:
    """A completions response -> ``Completion`` (its choice for prompt
    ``index`` of the request); anything else -> CannotProbe."""
    try:
        choice = next(c for c in body["choices"] if c.get("index", 0) == index)
        usage = body.get("usage") or {}
        found = choice.get("logprobs") or {}
        tokens, top = found.get("tokens"), found.get("top_logprobs")
    except StopIteration:
        raise CannotProbe(
            NOT_A_COMPLETION.format(detail=f"no choice for prompt {index}")
        ) from None
    except (KeyError, IndexError, TypeError, AttributeError) as missing:
        raise CannotProbe(NOT_A_COMPLETION.format(detail=f"no {missing!r}")) from None
    if not tokens or not top or any(not position for position in top):
        raise CannotProbe(NO_LOGPROBS.format(k=logprobs))
    try:
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        completion = Completion(
            tokens=tuple(str(t) for t in tokens),
            top_logprobs=tuple(
                {str(t): float(v) for t, v in position.items()} for position in top
            ),
            cached_tokens=None if cached is None else int(cached),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
        )
    except (TypeError, ValueError, AttributeError, OverflowError) as error:
        raise CannotProbe(NOT_A_COMPLETION.format(detail=str(error))) from None
    if not all(math.isfinite(v) for p in completion.top_logprobs for v in p.values()):
        raise CannotProbe(
            "the server returned a logprob that is not a finite number (NaN or "
            "infinite): differences cannot be judged on it; vLLM's OpenAI server "
            "sends finite logprobs (check --url, or the server's dtype)"
        )
    return completion


def base_url(url: str) -> str:
    """``http://host:8000/v1/`` and ``http://host:8000`` -> ``http://host:8000``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url.removesuffix("/v1")


class Client:
    """One server: its base address, an optional API key, a request timeout."""

    def __init__(
        self,
        url: str,
        api_key: str | None,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.base = base_url(url)
        self.api_key = api_key
        self.timeout = timeout
        self.headers = dict(headers or {})
        """Sent with every request (``run.ENGINE_HEADER``)."""

    def _request(self, path: str, body: dict[str, Any] | None = None) -> bytes:
        headers = {"Accept": "application/json", **self.headers}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.base + path, data, headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = bytes(response.read(MAX_ANSWER_BYTES + 1))
        except urllib.error.HTTPError as error:
            raise self._http_problem(path, error) from None
        except (OSError, http.client.HTTPException, ValueError) as error:
            raise self._transport_problem(path, error) from None
        if len(answer) > MAX_ANSWER_BYTES:
            raise CannotProbe(
                f"{self.base}{path} answered more than {MAX_ANSWER_BYTES >> 20} MB: "
                "not a vLLM server's answer (check --url)"
            )
        return answer

    def _transport_problem(self, path: str, error: Exception) -> CannotProbe:
        """A failure below HTTP's status codes, in words an operator acts on."""
        reason = getattr(error, "reason", error)
        if isinstance(reason, TimeoutError) or isinstance(error, TimeoutError):
            return CannotProbe(
                f"{self.base}{path} did not answer within {self.timeout:g} s: "
                "raise --timeout (a long prompt on a busy server takes longer)"
            )
        if isinstance(reason, http.client.BadStatusLine) and not isinstance(
            reason, ConnectionError
        ):
            return CannotProbe(
                f"{self.base} does not speak HTTP (it answered "
                f"{str(reason)[:60]!r}): check --url, the port `vllm serve` "
                "listens on (its --port, default 8000)"
            )
        if isinstance(reason, http.client.HTTPException | ValueError):
            return CannotProbe(
                f"{self.base}{path} answered something that is not valid HTTP "
                f"({type(reason).__name__}: {reason}): check --url, the address "
                "`vllm serve` listens on (http://HOST:PORT)"
            )
        return CannotProbe(
            f"cannot reach {self.base} ({reason}): check --url, the address "
            "`vllm serve` listens on (http://HOST:PORT)"
        )

    def _http_problem(self, path: str, error: urllib.error.HTTPError) -> CannotProbe:
        detail = _error_message(error)
        if error.code in (401, 403):
            return CannotProbe(
                f"{path}: HTTP {error.code} ({detail}): the server wants an API "
                "key: set VLLM_API_KEY or pass --api-key (the value of vllm "
                "serve's --api-key)"
            )
        if error.code == 404 and path.startswith("/v1"):
            return CannotProbe(
                f"{self.base}{path}: HTTP 404: not an OpenAI-compatible vLLM "
                "server (check --url: the probe adds /v1/... itself)"
            )
        return CannotProbe(f"{path}: HTTP {error.code}: {detail}")

    def get_json(self, path: str) -> Any:
        return self._json(path, self._request(path))

    def _json(self, path: str, answer: bytes) -> Any:
        try:
            return json.loads(answer)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            start = answer[:40].decode(errors="replace").strip()
            raise CannotProbe(
                f"{self.base}{path} answered something that is not JSON "
                f"(it begins {start!r}): not a vLLM server (a proxy's login "
                "page?): check --url"
            ) from None

    def models(self) -> list[dict[str, Any]]:
        """The model cards of ``/v1/models``, each with a string ``id``."""
        listing = self.get_json("/v1/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        where = f"{self.base}/v1/models"
        if not isinstance(data, list) or not data:
            raise CannotProbe(
                f'{where} lists no model (no non-empty "data" list): not an '
                "OpenAI-compatible vLLM server, or it serves nothing: check --url"
            )
        cards = [m for m in data if isinstance(m, dict)]
        if len(cards) < len(data) or any(
            not isinstance(card.get("id"), str) or not card["id"] for card in cards
        ):
            raise CannotProbe(
                f'{where} lists a model without a name ("id"): not an '
                "OpenAI-compatible vLLM server: check --url"
            )
        return cards

    def complete(
        self,
        model: str,
        prompt: list[int] | list[list[int]],
        *,
        salt: str,
        max_tokens: int,
        logprobs: int,
        extra: dict[str, Any] | None = None,
    ) -> Completion:
        """One greedy completion of a token-id prompt under a cache salt
        (``extra``: more fields of the request body). Given several prompts,
        the completion of the last: vLLM takes them as requests of their own,
        submitted together in the order given."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": logprobs,
            "cache_salt": salt,
            "return_tokens_as_token_ids": True,
            **(extra or {}),
        }
        try:
            answer = self._json(
                "/v1/completions", self._request("/v1/completions", body)
            )
        except CannotProbe as problem:
            text = str(problem)
            if "logprobs" in text.lower():
                raise CannotProbe(
                    f"{text}\nthe server refuses {logprobs} logprobs: pass a "
                    "smaller --logprobs (vLLM allows up to its --max-logprobs, "
                    "default 20), or start it with a tokenizer"
                ) from None
            if "cache_salt" in text:
                raise CannotProbe(
                    f"{text}\nthe server does not take cache_salt, which the "
                    "probe needs for fresh runs (vLLM 0.9+ takes it)"
                ) from None
            raise
        several = bool(prompt) and isinstance(prompt[0], list)
        return parse_completion(answer, logprobs, len(prompt) - 1 if several else 0)

    def metrics(self) -> str | None:
        """The Prometheus text of ``/metrics``, or None where there is none."""
        try:
            return self._request("/metrics").decode(errors="replace")
        except CannotProbe:
            return None


def _error_message(error: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(error.read(MAX_ANSWER_BYTES) or b"{}")
    except (ValueError, OSError, http.client.HTTPException):
        return str(error.reason)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(error.reason)
