"""What the probe checks and says before its first completion.

Exit 1 of ``probe`` means "this server serves wrong states", so an option that
could make a verdict meaningless, or make the probe fail half-way, is refused
here, before any request: one line naming the flag and the way out, exit 2.
Every limit below is a fact about the probe or about what a vLLM server can be,
not a preference:

- ``--threshold`` is a |Δ logprob| bound: NaN compares false with everything and
  passes any server, a negative bound reads as 0, and a bound of
  :data:`MAX_THRESHOLD` or more passes wrong states the probe exists to catch.
- ``--timeout`` goes to the socket: 0 makes it non-blocking (every server then
  looks unreachable), negatives and infinities are refused by the socket layer.
- ``--state-block`` is the Mamba state block B, a multiple of
  :data:`STATE_BLOCK_STEP` tokens and at least :data:`MIN_STATE_BLOCK` (the
  probe places its siblings at B/4 and B/2 offsets, which need room).
- ``--prompt-tokens`` bounds the writer, which is drawn in memory and sent as
  JSON token ids.

The API key comes from ``--api-key`` or from ``VLLM_API_KEY``, the variable
``vllm serve`` itself reads, so it need not appear in ``ps`` or a CI log.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from .client import base_url

API_KEY_VARIABLE = "VLLM_API_KEY"
"""Where ``vllm serve`` reads its API key when ``--api-key`` is not given."""
MAX_THRESHOLD = 0.1
"""Refused from here up. Wrong states measured on vLLM's CPU engine moved the
first token's logprob by 9.8e-5 to 2.2e-2 (``judge.DEFAULT_THRESHOLD``); a bound
of 0.1 (a 10% change of a token's probability) already passes most of them.
A server whose own noise is larger raises the bound by itself (ten times the
fresh-vs-fresh noise), without this option."""
MAX_TIMEOUT = 86400.0
"""A day: beyond it a request has not been slow, it has hung."""
MIN_STATE_BLOCK = 16
STATE_BLOCK_STEP = 8
MAX_PROMPT_TOKENS = 1 << 20
"""1,048,576 tokens, more than any served context the probe needs to reach."""
EXAMPLE_URL = "http://127.0.0.1:8000"
_SCHEME_WITHOUT_SLASHES = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:(?!\d)")


class BadOption(ValueError):
    """An option the probe refuses: the message names it and the way out."""


def check_url(raw: str) -> str:
    """The server's base address (``http[s]://HOST[:PORT][/PATH]``), or BadOption."""
    text = raw.strip()
    if not text:
        raise BadOption(
            f"--url is empty: give the server's address, e.g. {EXAMPLE_URL}"
        )
    if any(c.isspace() or not c.isprintable() for c in text):
        raise BadOption(
            f"--url {raw!r} contains a space or a control character: give the "
            f"server's address alone, e.g. {EXAMPLE_URL}"
        )
    if "://" not in text and _SCHEME_WITHOUT_SLASHES.match(text):
        raise BadOption(
            f"--url {raw!r} is not an address: write it as http://HOST:PORT, "
            f"e.g. {EXAMPLE_URL}"
        )
    full = text if "://" in text else "http://" + text
    try:
        parts = urlsplit(full)
        port = parts.port
    except ValueError as error:
        raise BadOption(
            f"--url {raw!r} is not a valid address ({error}): write it as "
            f"http://HOST:PORT with a port from 1 to 65535, e.g. {EXAMPLE_URL}"
        ) from None
    if parts.scheme.lower() not in ("http", "https"):
        raise BadOption(
            f"--url {raw!r}: the probe speaks http:// and https:// only, not "
            f"{parts.scheme}://: give the address `vllm serve` listens on, e.g. "
            f"{EXAMPLE_URL}"
        )
    if not parts.hostname:
        raise BadOption(
            f"--url {raw!r} names no host: write it as http://HOST:PORT, e.g. "
            f"{EXAMPLE_URL}"
        )
    if port == 0:
        raise BadOption(
            f"--url {raw!r}: port 0 is not a port a server listens on: give "
            "vllm serve's --port (default 8000)"
        )
    if parts.username is not None or parts.password is not None:
        raise BadOption(
            f"--url {raw!r} carries a user name or password: the probe sends only "
            f"a bearer token: give it with --api-key or {API_KEY_VARIABLE}"
        )
    if parts.query or parts.fragment:
        raise BadOption(
            f"--url {raw!r} has a query or fragment (?, #): give the server's "
            f"base address, e.g. {EXAMPLE_URL} (the probe adds /v1/... itself)"
        )
    return base_url(full)


def check_threshold(value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise BadOption(
            f"--threshold {value:g} is not a finite number >= 0: give a |delta "
            f"logprob| below {MAX_THRESHOLD:g}, or leave it out (the default rises "
            "with the server's own noise)"
        )
    if value >= MAX_THRESHOLD:
        raise BadOption(
            f"--threshold {value:g} would pass wrong states (on vLLM's CPU engine "
            "they move logprobs by 1e-4 to 1e-2): give a value below "
            f"{MAX_THRESHOLD:g}, or leave it out (the bound rises with the "
            "server's own noise and measured rounding)"
        )
    return value


def check_rounding(value: float | None) -> float | None:
    """``--rounding``: the server's chunk-shape rounding, given instead of measured."""
    if value is not None and (not math.isfinite(value) or value < 0):
        raise BadOption(
            f"--rounding {value:g} is not a finite number >= 0: give the |delta "
            "logprob| an earlier probe of the same kernels measured (0 for "
            "chunk-invariant kernels such as vLLM's CPU engine), or leave it out "
            "to measure it"
        )
    return value


def check_rank(value: int) -> int:
    """``--rank``: a data-parallel rank, from 0."""
    if value < 0:
        raise BadOption(
            f"--rank {value} is not a data-parallel rank: ranks count from 0 "
            "(--ranks all probes every rank the server has)"
        )
    return value


def check_ranks(value: str | None) -> int | None:
    """``--ranks N`` or ``--ranks all`` -> N, or None for all (and not given)."""
    if value is None or value == "all":
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise BadOption(
            f"--ranks {value} is neither a count of ranks from 1 nor `all`: "
            "give the server's --data-parallel-size, or `all` to ask the server"
        )
    return count


def check_timeout(value: float) -> float:
    if not math.isfinite(value) or value <= 0 or value > MAX_TIMEOUT:
        raise BadOption(
            f"--timeout {value:g} is not a number of seconds > 0 and at most "
            f"{MAX_TIMEOUT:g}: give e.g. --timeout 300 (a long prompt on a busy "
            "server takes minutes)"
        )
    return value


def check_state_block(value: int | None) -> int | None:
    if value is None:
        return None
    if value < MIN_STATE_BLOCK or value % STATE_BLOCK_STEP:
        raise BadOption(
            f"--state-block {value} cannot be a Mamba state block (a multiple of "
            f"{STATE_BLOCK_STEP} tokens, {MIN_STATE_BLOCK} or more): give the B "
            "the plugin's start line or vllm:cache_config_info's mamba_block_size "
            "names, or leave it out to read it from /metrics"
        )
    return value


def check_prompt_tokens(value: int | None) -> int | None:
    if value is None:
        return None
    if not 1 <= value <= MAX_PROMPT_TOKENS:
        raise BadOption(
            f"--prompt-tokens {value} is out of range: give 1 to "
            f"{MAX_PROMPT_TOKENS:,} (the server's max_model_len caps it too), "
            "or leave it out"
        )
    return value


def check_at_least_one(flag: str, value: int) -> int:
    if value < 1:
        raise BadOption(f"{flag} {value} must be 1 or more (see --help)")
    return value


def api_key(given: str | None, environ: Mapping[str, str]) -> str | None:
    """``--api-key``, else ``VLLM_API_KEY``, else none."""
    if given:
        return given
    return environ.get(API_KEY_VARIABLE) or None


def load_line(plan: Any) -> str:
    """What the probe is about to send, and how to send less (one line).

    ``plan`` is the probe's ``workload.Workload``: its writer and its cases, each
    sent once in the cached family and ``FRESH_RUNS`` times fresh."""
    longest = max([len(plan.writer), *(len(case.prompt) for case in plan.cases)])
    beside = len(plan.rounding)
    return (
        f"probe: sending {plan.requests} completions, one request at a time"
        + (f" ({beside} of them with a filler prompt beside)" if beside else "")
        + ", "
        f"{plan.prompt_tokens:,} prompt tokens in all, the longest prompt "
        f"{longest:,} tokens (--prompt-tokens N sends shorter prompts, "
        "--max-requests N fewer)"
    )
