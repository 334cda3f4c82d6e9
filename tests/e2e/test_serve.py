"""``vllm serve`` end to end: vLLM's OpenAI-compatible server with the plugin.

The same model, geometry and prompts as ``test_engine.py`` (a tiny NemotronH,
the ``extract_hidden_states`` drafter giving C=8 < B=32, a 3,000-token prompt,
a sibling sharing 1,030 tokens, a re-ask), now through the HTTP API: prompts
are token ids sent with the official ``openai`` client, reuse is read from
``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``)
and the first token's top-20 logprobs are compared with a fresh run of the same
prompt in the same server under another ``cache_salt`` (which shares no cached
block with the unsalted requests).

One server per mode, started and stopped inside the session: it binds
127.0.0.1 on a free port, the tests wait for ``/health`` within a bound, stop
it with SIGINT (SIGKILL to the whole process group after a bound) and check
that no process of the group is left.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .models import write_model
from .server import Completion, Server, max_delta, write_tokenizer
from .test_engine import (
    BUDGET,
    HETEROGENEOUS,
    HYBRID,
    LOG_LINE,
    PLUGIN,
    PROMPT_TOKENS,
    SHARED_TOKENS,
    WORKAROUNDS,
    prompts,
)

# The engine settings of test_engine.py as CLI flags. On the command line
# --prefix-cache-retention-interval takes the literal "None" (dense retention),
# which vLLM's parser turns into Python's None, as the LLM tests pass it.
SERVE_OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "seed": 0,
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "max_model_len": 4096,
    "max_num_batched_tokens": BUDGET,
    **HYBRID,
    **HETEROGENEOUS,
    "enable_prompt_tokens_details": True,
    # vLLM's default (0) kills the engine core before Scheduler.shutdown() runs.
    "shutdown_timeout": 10,
}
AUDIT_INTERVAL = "1"  # seconds between audit summary lines (when changed)


@dataclass
class ServeRun:
    mode: str
    log: str = ""
    start_seconds: float = 0.0
    stop_seconds: float = 0.0
    request_seconds: float = 0.0
    stopped_cleanly: bool = False
    group_left: bool = True
    done: dict[str, Completion] = field(default_factory=dict)
    metrics: str = ""

    def plugin_lines(self) -> list[dict[str, str]]:
        return [m.groupdict() for m in LOG_LINE.finditer(self.log)]


def _environment(mode: str | None) -> dict[str, str]:
    env = {
        "VLLM_PLUGINS": f"{WORKAROUNDS},{PLUGIN}",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        # Multiprocess Prometheus: what the engine core counts is served by
        # the API server's /metrics. An empty directory per server.
        "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="prometheus-"),
        "VLLM_MAMBA_ALIGN_AUDIT_INTERVAL": AUDIT_INTERVAL,
    }
    if mode is not None:
        env["VLLM_MAMBA_ALIGN_MODE"] = mode
    return env


def _scenario(server: Server, run: ServeRun, rank: int | None = None) -> None:
    first, sibling = prompts()
    suffix = "" if rank is None else f"@{rank}"
    started = time.monotonic()
    run.done["first" + suffix] = server.complete(first, rank=rank)
    run.done["sibling" + suffix] = server.complete(sibling, rank=rank)
    run.done["reask" + suffix] = server.complete(first, rank=rank)
    # A fresh run: another cache_salt hashes every block differently.
    run.done["sibling_fresh" + suffix] = server.complete(
        sibling, salt=f"fresh{suffix}", rank=rank
    )
    run.request_seconds += time.monotonic() - started


@pytest.fixture(scope="session")
def served_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = write_model("nemotron_h", tmp_path_factory.mktemp("served") / "model")
    write_tokenizer(model)
    return model


_runs: dict[str, ServeRun] = {}


def serve(
    model: Path,
    workdir: Path,
    key: str,
    mode: str | None,
    *,
    options: dict[str, Any] | None = None,
    body: Callable[[Server, ServeRun], None] = lambda s, r: _scenario(s, r),
) -> ServeRun:
    if key in _runs:
        return _runs[key]
    run = ServeRun(mode=mode or "default")
    server = Server(
        model,
        {**SERVE_OPTIONS, **(options or {})},
        _environment(mode),
        workdir / f"{key}.log",
    )
    try:
        with server:
            run.start_seconds = server.start_seconds
            body(server, run)
    finally:
        run.log = server.log()
        run.stop_seconds = server.stop_seconds
        run.stopped_cleanly = server.stopped_cleanly
        run.group_left = server.group_alive()
    _runs[key] = run
    return run


@pytest.fixture(scope="session")
def served(
    served_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str | None], ServeRun]]:
    workdir = tmp_path_factory.mktemp("serve-logs")

    def get(mode: str | None) -> ServeRun:
        key = mode or "default"
        return serve(served_model, workdir, key, mode)

    yield get


def test_served_with_the_plugin_sibling_matches_a_fresh_run(
    served: Callable[[str | None], ServeRun],
) -> None:
    run = served(None)
    (found,) = run.plugin_lines()  # one engine core, one scheduler
    assert found["vllm"] == "0.32.0"
    assert found["status"].startswith("ACTIVE, mode=full"), found
    state_block, hash_block = int(found["b"]), int(found["h"])
    assert int(found["c"]) < state_block  # the heterogeneous geometry
    done = run.done
    assert done["first"].cached_tokens == 0
    assert done["sibling_fresh"].cached_tokens == 0
    assert done["sibling"].cached_tokens == SHARED_TOKENS // state_block * state_block
    assert done["reask"].cached_tokens == (PROMPT_TOKENS - 1) // hash_block * hash_block
    # Bit for bit what a fresh prefill of the same prompt gives.
    assert done["sibling"].logprobs == done["sibling_fresh"].logprobs
    assert done["reask"].logprobs == done["first"].logprobs


def test_served_with_the_fix_off_the_same_check_detects_the_wrong_state(
    served: Callable[[str | None], ServeRun],
) -> None:
    run = served("off")
    (found,) = run.plugin_lines()
    assert found["status"].startswith("loaded, mode=off"), found
    done = run.done
    assert done["sibling"].cached_tokens > 0  # stock reuses a state here ...
    assert done["sibling"].logprobs != done["sibling_fresh"].logprobs  # a wrong one
    assert max_delta(done["sibling"], done["sibling_fresh"]) > 1e-3


@pytest.mark.parametrize("mode", [None, "off"], ids=["default", "off"])
def test_server_starts_and_stops_within_bounds_leaving_no_process(
    served: Callable[[str | None], ServeRun], mode: str | None
) -> None:
    run = served(mode)
    assert run.stopped_cleanly, "SIGINT did not stop the server in time"
    assert not run.group_left, "a process of the server's group survived"
    assert re.search(r"Starting vLLM server on http://127\.0\.0\.1:\d+", run.log)


def summary_lines() -> list[str]:
    lines = []
    for key, run in _runs.items():
        figures = ", ".join(
            f"{name} cached {c.cached_tokens}" for name, c in run.done.items()
        )
        deltas = [
            f"{name} max |dlogprob| vs fresh {max_delta(c, run.done[fresh]):.3g}"
            for name, c in run.done.items()
            if (fresh := name.replace("sibling", "sibling_fresh", 1)) != name
            and fresh in run.done
        ]
        lines.append(
            f"serve {key}: start {run.start_seconds:.1f} s, requests "
            f"{run.request_seconds:.1f} s, stop {run.stop_seconds:.1f} s; {figures}; "
            + "; ".join(deltas)
        )
    return lines
