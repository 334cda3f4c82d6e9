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
from .server import (
    SERVED_NAME,
    Completion,
    Server,
    max_delta,
    samples,
    write_tokenizer,
)
from .test_engine import (
    BUDGET,
    HETEROGENEOUS,
    HYBRID,
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
AUDIT_INTERVAL = "1"
# The plugin's line at scheduler start (the audit's status has semicolons).
PLUGIN_LINE = re.compile(
    r"vllm-mamba-align \S+ on vLLM (?P<vllm>\S+) \([^)]*\): (?P<status>[^\n]*); "
    r"cache block C=(?P<c>\d+), Mamba state block B=(?P<b>\w+), "
    r"hash block (?P<h>\d+)"
)  # seconds between audit summary lines (when changed)


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
        return [m.groupdict() for m in PLUGIN_LINE.finditer(self.log)]


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


AUDIT_SUMMARY = re.compile(
    r"vllm-mamba-align audit \(B=(?P<state_block>\d+), C=(?P<cache_block>\d+)\): "
    r"(?P<prefill_chunks>[\d,]+) prefill chunks, "
    r"(?P<poisoned_slots>[\d,]+) would-be-poisoned slots, "
    r"(?P<skipped_boundaries>[\d,]+) skipped state boundaries, "
    r"(?P<requests_affected>[\d,]+) of (?P<requests>[\d,]+) requests affected "
    r"\((?P<requests_poisoning>[\d,]+) poisoning\), "
    r"(?P<prefill_tokens>[\d,]+) prefill tokens scheduled"
)
# Audit figure -> counter on /metrics (vllm_mamba_align.metrics.COUNTERS).
COUNTER_NAMES = {
    "poisoned_slots": "vllm_mamba_align_audit_would_be_poisoned_slots_total",
    "skipped_boundaries": "vllm_mamba_align_audit_skipped_state_boundaries_total",
    "requests": "vllm_mamba_align_audit_requests_total",
    "requests_affected": "vllm_mamba_align_audit_requests_affected_total",
    "requests_poisoning": "vllm_mamba_align_audit_requests_poisoning_total",
    "prefill_chunks": "vllm_mamba_align_audit_prefill_chunks_total",
    "prefill_tokens": "vllm_mamba_align_audit_prefill_tokens_total",
}


def last_summary(log: str) -> dict[str, int] | None:
    found = list(AUDIT_SUMMARY.finditer(log))
    if not found:
        return None
    return {k: int(v.replace(",", "")) for k, v in found[-1].groupdict().items()}


def counters(metrics: str, engine: str = "0") -> dict[str, float]:
    values: dict[str, float] = {}
    for figure, name in COUNTER_NAMES.items():
        for labels, value in samples(metrics, name):
            if labels.get("engine") == engine:
                assert labels.get("model_name") == SERVED_NAME, labels
                values[figure] = value
    return values


def expected_prefill_tokens(run: ServeRun) -> int:
    """What the scenario prefills: each prompt less the tokens served cached."""
    first, sibling = prompts()
    lengths = {"first": len(first), "sibling": len(sibling), "reask": len(first)}
    lengths["sibling_fresh"] = len(sibling)
    return sum(lengths[name] - c.cached_tokens for name, c in run.done.items())


def _audited_scenario(server: Server, run: ServeRun) -> None:
    """The scenario, then /metrics until it shows the summary line's figures.

    The engine core exports and logs on the audit's reporter thread (every
    second here); both settle within a few seconds of the last request.
    """
    _scenario(server, run)
    deadline = time.monotonic() + 60
    while True:
        run.metrics = server.metrics()
        summary = last_summary(server.log())
        shown = counters(run.metrics)
        if (
            summary is not None
            and summary["prefill_tokens"] == expected_prefill_tokens(run)
            and all(shown.get(figure) == summary[figure] for figure in COUNTER_NAMES)
        ):
            return
        if time.monotonic() > deadline:
            return  # the test reports the difference
        time.sleep(0.5)


def test_audit_counters_on_metrics_equal_the_audit_summary_line(
    served_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = serve(
        served_model,
        tmp_path_factory.mktemp("serve-audit"),
        "audit",
        "audit",
        body=_audited_scenario,
    )
    (found,) = run.plugin_lines()
    assert found["status"].startswith("AUDIT, mode=audit"), found
    # Stock scheduling, so the sibling reads a wrong state ...
    done = run.done
    assert done["sibling"].logprobs != done["sibling_fresh"].logprobs
    # ... which the audit names at once, at WARNING ...
    assert re.search(r"WARNING .*the audit found the first would-be-poisoned", run.log)
    # ... and counts, on the API server's /metrics as in its log line.
    summary = last_summary(run.log)
    assert summary is not None, "no audit summary line in the server log"
    shown = counters(run.metrics)
    assert shown == {figure: summary[figure] for figure in COUNTER_NAMES}
    assert summary["prefill_tokens"] == expected_prefill_tokens(run)
    assert shown["poisoned_slots"] > 0 and shown["skipped_boundaries"] > 0
    assert shown["requests"] == 4 and shown["prefill_chunks"] > 0
    (info,) = [
        labels
        for labels, value in samples(run.metrics, "vllm_mamba_align_info")
        if value == 1
    ]
    assert info["mode"] == "audit" and info["engine"] == "0"
    assert info["state_block"] == found["b"] and info["cache_block"] == found["c"]
    assert info["vllm_version"] == "0.32.0" and info["model_name"] == SERVED_NAME
    assert "audit metrics: on: multiprocess Prometheus" in run.log
    # Clean shutdown ran Scheduler.shutdown(): the final line is the same figures.
    assert run.stopped_cleanly and not run.group_left


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
        if run.metrics:
            figures += f"; /metrics {counters(run.metrics)}"
            figures += f"; last audit line {last_summary(run.log)}"
        lines.append(
            f"serve {key}: start {run.start_seconds:.1f} s, requests "
            f"{run.request_seconds:.1f} s, stop {run.stop_seconds:.1f} s; {figures}; "
            + "; ".join(deltas)
        )
    return lines
