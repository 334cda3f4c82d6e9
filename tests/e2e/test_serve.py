"""``vllm serve`` end to end: vLLM's OpenAI-compatible server with the plugin.

The same model, geometry and prompts as ``test_engine.py`` (a tiny NemotronH,
the ``extract_hidden_states`` drafter giving C=8 < B=32, a 3,000-token prompt,
a sibling sharing 1,030 tokens, a re-ask), now through the HTTP API: prompts
are token ids sent with the official ``openai`` client, reuse is read from
``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``)
and the first token's top-20 logprobs are compared with a fresh run of the same
prompt in the same server under another ``cache_salt`` (which shares no cached
block with the unsalted requests).

Four servers, each started once: the default mode, ``off`` (the control that
shows the same checks fail on stock scheduling), and two with
``--data-parallel-size 2`` (two engine cores behind one API server; requests
pinned to a rank with the ``X-data-parallel-rank`` header): the default mode
(the fix on both ranks) and ``audit`` (its counters on the API server's
``/metrics``, one series per ``engine``, equal to each engine's summary line).
Each server is started and stopped inside the session: it binds
127.0.0.1 on a free port, the tests wait for ``/health`` within a bound, stop
it with SIGINT (SIGKILL to the whole process group after a bound) and check
that no process of the group is left.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .models import write_model
from .probe_run import ProbeRun, run_probe
from .release import E2E_RELEASE
from .server import (
    SERVED_NAME,
    Completion,
    Server,
    max_delta,
    samples,
    write_tokenizer,
)
from .test_engine import (
    COMMON,
    HETEROGENEOUS,
    HYBRID,
    PLUGIN,
    PROMPT_TOKENS,
    SHARED_TOKENS,
    WORKAROUNDS,
    prompts,
)

# One xdist group: the servers are started once per worker, and test_serve.py
# and test_probe.py read the same ones (conftest.served).
pytestmark = pytest.mark.xdist_group("serve")

# The engine settings of test_engine.py as CLI flags. On the command line
# --prefix-cache-retention-interval takes the literal "None" (dense retention),
# which vLLM's parser turns into Python's None, as the LLM tests pass it.
# The tokenizer the test writes replaces skip_tokenizer_init (logprobs need it).
SERVE_OPTIONS: dict[str, Any] = {
    **{key: value for key, value in COMMON.items() if key != "skip_tokenizer_init"},
    **HYBRID,
    **HETEROGENEOUS,
    "enable_prompt_tokens_details": True,
    # vLLM's default (0) kills the engine core before Scheduler.shutdown() runs.
    "shutdown_timeout": 10,
}
AUDIT_INTERVAL = "1"  # seconds between audit summary lines (when changed)
DATA_PARALLEL: dict[str, Any] = {"data_parallel_size": 2}
OMIT = object()  # a setup's option value: leave the flag out
GPU_EMULATION: dict[str, Any] = {"dtype": "bfloat16"}
GPU_EMULATION_ENV = {"MAMBA_ALIGN_E2E_BF16_STATES": "1"}
# The plugin's line at scheduler start (the audit's status has semicolons),
# with the process tag vLLM puts in front: EngineCore, or EngineCore_DP<rank>.
PLUGIN_LINE = re.compile(
    r"\((?P<process>EngineCore(?:_DP(?P<rank>\d+))?) pid=\d+\)[^\n]*"
    r"vllm-mamba-align \S+ on vLLM (?P<vllm>\S+) \([^)]*\): (?P<status>[^\n]*); "
    r"cache block C=(?P<c>\d+), Mamba state block B=(?P<b>\w+), "
    r"hash block (?P<h>\d+)"
)


def starts_in_lockstep(log: str, rank: int, size: int = 2) -> bool:
    """Whether engine core ``rank``'s start line ends with the suffix the
    plugin gives a lockstep data-parallel rank (``; data-parallel rank R of
    N``)."""
    line = re.compile(
        rf"^\(EngineCore_DP{rank} pid=\d+\)[^\n]*hash block \d+"
        rf"; data-parallel rank {rank} of {size}$",
        re.MULTILINE,
    )
    return line.search(log) is not None


@dataclass
class ServeRun:
    key: str
    log: str = ""
    start_seconds: float = 0.0
    stop_seconds: float = 0.0
    request_seconds: float = 0.0
    stopped_cleanly: bool = False
    stop_report: str = ""
    """How the stop went (server.StopOutcome.report), for the assertions."""
    group_left: bool = True
    done: dict[str, Completion] = field(default_factory=dict)
    metrics: str = ""
    probe: ProbeRun | None = None

    def plugin_lines(self) -> list[dict[str, str]]:
        return [m.groupdict() for m in PLUGIN_LINE.finditer(self.log)]

    def engine_log(self, rank: int) -> str:
        tag = f"(EngineCore_DP{rank} "
        return "\n".join(line for line in self.log.splitlines() if tag in line)


@dataclass(frozen=True)
class Setup:
    mode: str | None
    options: dict[str, Any]
    ranks: tuple[int | None, ...]  # None: no rank header
    wait_for_audit: bool = False
    plugin_loaded: bool = True  # False: VLLM_PLUGINS does not name the plugin
    probe: bool = False  # also run `vllm-mamba-align probe` against it
    probe_arguments: tuple[str, ...] = ()
    """No ``--rounding``: the probe measures the server's rounding itself
    (test_probe.py), as an operator's probe does."""
    env: dict[str, str] = field(default_factory=dict)


SETUPS = {
    "default": Setup(None, {}, (None,), probe=True),
    "off": Setup("off", {}, (None,), probe=True),
    "dp": Setup(None, DATA_PARALLEL, (0, 1), probe=True),
    "dp-audit": Setup("audit", DATA_PARALLEL, (0, 1), wait_for_audit=True),
    # For test_probe.py: the other mode, stock vLLM without the plugin, the
    # default mode at vLLM's default retention, and prefix caching off.
    "full": Setup("full", {}, (None,), probe=True),
    "default-retention0": Setup(
        None, {"prefix_cache_retention_interval": 0}, (), probe=True
    ),
    "no-plugin": Setup(None, {}, (None,), plugin_loaded=False, probe=True),
    "no-prefix-caching": Setup(
        None, {"enable_prefix_caching": False}, (None,), probe=True
    ),
    # For test_probe.py: GPU rounding emulated (bf16 model, every stored Mamba
    # state rounded to bf16 at every chunk end; tests/support/cpu_e2e_workarounds).
    # gpu-measure: no speculative method (C = B, stock serves correct states),
    # so the probe's decode steps are reproducible and measure the rounding
    # too, beside its filler measurement; the others have the drafter.
    "gpu-measure": Setup(
        "off",
        {**GPU_EMULATION, "speculative_config": OMIT},
        (),
        probe=True,
        env=GPU_EMULATION_ENV,
    ),
    "gpu-kept-retention0": Setup(
        None,
        {**GPU_EMULATION, "prefix_cache_retention_interval": 0},
        (),
        probe=True,
        env=GPU_EMULATION_ENV,
    ),
    "gpu-kept": Setup(
        None,
        GPU_EMULATION,
        (),
        probe=True,
        env=GPU_EMULATION_ENV,
    ),
    "gpu-full": Setup(
        "full",
        GPU_EMULATION,
        (),
        probe=True,
        env=GPU_EMULATION_ENV,
    ),
    "gpu-off": Setup(
        "off",
        GPU_EMULATION,
        (),
        probe=True,
        env=GPU_EMULATION_ENV,
    ),
}


def _environment(
    mode: str | None, prometheus: Path, plugin_loaded: bool = True
) -> dict[str, str]:
    env = {
        "VLLM_PLUGINS": f"{WORKAROUNDS},{PLUGIN}" if plugin_loaded else WORKAROUNDS,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        # Multiprocess Prometheus: what the engine cores count is served by
        # the API server's /metrics. An empty directory per server.
        "PROMETHEUS_MULTIPROC_DIR": str(prometheus),
        "VLLM_MAMBA_ALIGN_AUDIT_INTERVAL": AUDIT_INTERVAL,
    }
    if mode is not None:
        env["VLLM_MAMBA_ALIGN_MODE"] = mode
    return env


def step(name: str, rank: int | None) -> str:
    return name if rank is None else f"{name}-rank{rank}"


def _scenario(server: Server, run: ServeRun, rank: int | None) -> None:
    first, sibling = prompts()
    started = time.monotonic()
    run.done[step("first", rank)] = server.complete(first, rank=rank)
    run.done[step("sibling", rank)] = server.complete(sibling, rank=rank)
    run.done[step("reask", rank)] = server.complete(first, rank=rank)
    # A fresh run: another cache_salt hashes every block differently.
    run.done[step("sibling_fresh", rank)] = server.complete(
        sibling, salt=step("fresh", rank), rank=rank
    )
    run.request_seconds += time.monotonic() - started


AUDIT_SUMMARY = re.compile(
    r"vllm-mamba-align audit \(B=(?P<state_block>\d+), C=(?P<cache_block>\d+)\): "
    r"(?P<prefill_chunks>[\d,]+) prefill chunks, "
    r"(?P<poisoned_slots>[\d,]+) would-be-poisoned slots, "
    r"(?P<skipped_boundaries>[\d,]+) skipped state boundaries, "
    r"(?P<noncanonical_states>[\d,]+) non-canonical kept states, "
    r"(?P<requests_affected>[\d,]+) of (?P<requests>[\d,]+) requests affected "
    r"\((?P<requests_poisoning>[\d,]+) poisoning\), "
    r"(?P<prefill_tokens>[\d,]+) prefill tokens scheduled"
)
# Audit figure -> counter on /metrics (vllm_mamba_align.audit.export.COUNTERS).
COUNTER_NAMES = {
    "poisoned_slots": "vllm_mamba_align_audit_would_be_poisoned_slots_total",
    "skipped_boundaries": "vllm_mamba_align_audit_skipped_state_boundaries_total",
    "noncanonical_states": "vllm_mamba_align_audit_noncanonical_kept_states_total",
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


def counters(metrics: str, engine: int) -> dict[str, float]:
    values: dict[str, float] = {}
    for figure, name in COUNTER_NAMES.items():
        for labels, value in samples(metrics, name):
            if labels.get("engine") == str(engine):
                assert labels.get("model_name") == SERVED_NAME, labels
                values[figure] = value
    return values


def expected_prefill_tokens(run: ServeRun, rank: int) -> int:
    """What the scenario prefills on a rank: each prompt less its cached tokens."""
    first, sibling = prompts()
    lengths = {"first": len(first), "sibling": len(sibling), "reask": len(first)}
    lengths["sibling_fresh"] = len(sibling)
    return sum(
        length - run.done[step(name, rank)].cached_tokens
        for name, length in lengths.items()
    )


def audit_settled(run: ServeRun, rank: int, log: str) -> bool:
    summary = last_summary("\n".join(x for x in log.splitlines() if f"_DP{rank} " in x))
    shown = counters(run.metrics, rank)
    return (
        summary is not None
        and summary["prefill_tokens"] == expected_prefill_tokens(run, rank)
        and all(shown.get(figure) == summary[figure] for figure in COUNTER_NAMES)
    )


def _wait_for_audit(server: Server, run: ServeRun, ranks: tuple[int, ...]) -> None:
    """Scrape /metrics until it shows each engine's summary-line figures.

    Each engine core exports and logs on its audit reporter thread (every
    second here); both settle within a few seconds of the last request.
    """
    deadline = time.monotonic() + 60
    while True:
        run.metrics = server.metrics()
        log = server.log()
        if all(audit_settled(run, rank, log) for rank in ranks):
            return
        if time.monotonic() > deadline:
            return  # the test reports the difference
        time.sleep(0.5)


def write_served_model(root: Path) -> Path:
    """The tiny NemotronH with a tokenizer (conftest's ``served_model``)."""
    model = write_model("nemotron_h", root / "model")
    write_tokenizer(model)
    return model


_runs: dict[str, ServeRun] = {}
_failed: dict[str, str] = {}


def serving(served_model: Path, workdir: Path) -> Callable[[str], ServeRun]:
    """``get(key)``: start the server of ``SETUPS[key]`` once, run, stop
    (conftest's session fixture ``served``, shared with ``test_probe.py``)."""

    def get(key: str) -> ServeRun:
        if key in _failed:
            pytest.fail(f"the {key} server failed earlier: {_failed[key]}")
        if key in _runs:
            return _runs[key]
        setup = SETUPS[key]
        arguments = setup.probe_arguments
        run = ServeRun(key)
        options = {**SERVE_OPTIONS, **setup.options}
        server = Server(
            served_model,
            {name: value for name, value in options.items() if value is not OMIT},
            {
                **_environment(
                    setup.mode, workdir / f"{key}-prometheus", setup.plugin_loaded
                ),
                **setup.env,
            },
            workdir / f"{key}.log",
        )
        (workdir / f"{key}-prometheus").mkdir()
        started = time.monotonic()
        try:
            with server:
                run.start_seconds = server.start_seconds
                for rank in setup.ranks:
                    _scenario(server, run, rank)
                run.metrics = server.metrics()
                if setup.wait_for_audit:
                    ranks = tuple(r for r in setup.ranks if r is not None)
                    _wait_for_audit(server, run, ranks)
                if setup.probe:  # after the scenario: its figures stay its own
                    run.probe = run_probe(server.base, *arguments)
        except Exception as problem:
            _failed[key] = f"{type(problem).__name__}: {problem}"[:2000]
            raise
        finally:
            run.log = server.log()
            run.stop_seconds = server.stop_seconds
            run.stopped_cleanly = server.stopped_cleanly
            run.stop_report = server.stop_report
            run.group_left = server.group_alive()
            _seconds[key] = time.monotonic() - started
        _runs[key] = run
        return run

    return get


_seconds: dict[str, float] = {}


def check_fix(run: ServeRun, rank: int | None) -> None:
    """Reuse as the fix promises, and bit for bit what a fresh run gives."""
    names = ("first", "sibling", "reask", "sibling_fresh")
    done = {name: run.done[step(name, rank)] for name in names}
    (found,) = [
        line for line in run.plugin_lines() if rank is None or line["rank"] == str(rank)
    ]
    state_block, hash_block = int(found["b"]), int(found["h"])
    assert done["first"].cached_tokens == 0
    assert done["sibling_fresh"].cached_tokens == 0
    assert done["sibling"].cached_tokens == SHARED_TOKENS // state_block * state_block
    assert done["reask"].cached_tokens == (PROMPT_TOKENS - 1) // hash_block * hash_block
    assert done["sibling"].logprobs == done["sibling_fresh"].logprobs
    assert done["reask"].logprobs == done["first"].logprobs


def test_served_with_the_plugin_sibling_matches_a_fresh_run(
    served: Callable[[str], ServeRun],
) -> None:
    run = served("default")
    (found,) = run.plugin_lines()  # one engine core, one scheduler
    assert found["process"] == "EngineCore" and found["vllm"] == E2E_RELEASE
    assert found["status"].startswith("ACTIVE, mode=lean"), found  # the default
    assert int(found["c"]) < int(found["b"])  # the heterogeneous geometry
    check_fix(run, None)


def test_served_with_the_fix_off_the_same_check_detects_the_wrong_state(
    served: Callable[[str], ServeRun],
) -> None:
    run = served("off")
    (found,) = run.plugin_lines()
    assert found["status"].startswith("loaded, mode=off"), found
    sibling, fresh = run.done["sibling"], run.done["sibling_fresh"]
    assert sibling.cached_tokens > 0  # stock reuses a state here ...
    assert sibling.logprobs != fresh.logprobs  # ... a wrong one
    assert max_delta(sibling, fresh) > 1e-3
    with pytest.raises(AssertionError):
        check_fix(run, None)


def test_data_parallel_both_engine_cores_run_the_fix(
    served: Callable[[str], ServeRun],
) -> None:
    run = served("dp")
    lines = run.plugin_lines()
    assert sorted(line["process"] for line in lines) == [
        "EngineCore_DP0",
        "EngineCore_DP1",
    ]
    assert all(line["status"].startswith("ACTIVE, mode=lean") for line in lines)
    # vLLM counts this NemotronH as MoE (its config can route experts) and
    # runs its ranks in lockstep: each start line ends with its rank "of 2".
    for rank in (0, 1):
        assert starts_in_lockstep(run.log, rank), f"rank {rank}: no lockstep line"
    for rank in (0, 1):
        check_fix(run, rank)  # each rank has its own prefix cache
    info = sorted(
        labels["engine"]
        for labels, value in samples(run.metrics, "vllm_mamba_align_info")
        if value == 1 and labels["mode"] == "lean"
    )
    assert info == ["0", "1"]


def test_data_parallel_audit_counters_on_metrics_equal_each_engine_summary(
    served: Callable[[str], ServeRun],
) -> None:
    run = served("dp-audit")
    lines = run.plugin_lines()
    assert sorted(line["rank"] for line in lines) == ["0", "1"]
    assert all(line["status"].startswith("AUDIT, mode=audit") for line in lines)
    assert "audit metrics: on: multiprocess Prometheus" in run.log
    for rank in (0, 1):
        engine_log = run.engine_log(rank)
        # Stock scheduling: the sibling reads a wrong state ...
        sibling = run.done[step("sibling", rank)]
        assert sibling.logprobs != run.done[step("sibling_fresh", rank)].logprobs
        # ... which the audit names at once, at WARNING ...
        assert re.search(
            r"WARNING .*audit found the first would-be-poisoned", engine_log
        )
        # ... and counts: this engine's series on the API server's /metrics is
        # its own summary line (the last one: the final line at shutdown).
        summary = last_summary(engine_log)
        assert summary is not None, f"no audit summary line from engine {rank}"
        assert summary["prefill_tokens"] == expected_prefill_tokens(run, rank)
        shown = counters(run.metrics, rank)
        assert shown == {figure: summary[figure] for figure in COUNTER_NAMES}
        assert shown["poisoned_slots"] > 0 and shown["skipped_boundaries"] > 0
        assert shown["requests"] == 4
        (info,) = [
            labels
            for labels, value in samples(run.metrics, "vllm_mamba_align_info")
            if value == 1 and labels["engine"] == str(rank)
        ]
        assert info["mode"] == "audit" and info["model_name"] == SERVED_NAME
        assert info["state_block"] == str(summary["state_block"])
        assert info["cache_block"] == str(summary["cache_block"])
        assert info["vllm_version"] == E2E_RELEASE


@pytest.mark.parametrize("key", list(SETUPS))
def test_server_starts_and_stops_within_bounds_leaving_no_process(
    served: Callable[[str], ServeRun], key: str
) -> None:
    run = served(key)
    assert run.stopped_cleanly, f"SIGINT did not stop it in time: {run.stop_report}"
    assert not run.group_left, f"a process of the group survived: {run.stop_report}"
    assert re.search(r"Starting vLLM server on http://127\.0\.0\.1:\d+", run.log)


def summary_lines() -> list[str]:
    """What each server measured (printed after the tests)."""
    lines = []
    for key, run in _runs.items():
        figures = ", ".join(
            f"{name} cached {c.cached_tokens}" for name, c in run.done.items()
        )
        deltas = [
            f"{name} max |dlogprob| vs fresh {max_delta(c, run.done[fresh]):.3g}"
            for name, c in run.done.items()
            if name.startswith("sibling")
            and (fresh := name.replace("sibling", "sibling_fresh", 1)) != name
            and fresh in run.done
        ]
        audit = [
            f"engine {rank}: /metrics {counters(run.metrics, rank)}, last log line "
            f"{last_summary(run.engine_log(rank))}"
            for rank in (0, 1)
            if SETUPS[key].wait_for_audit
        ]
        lines.append(
            f"serve {key}: {_seconds.get(key, 0):.1f} s in all (start "
            f"{run.start_seconds:.1f} s, requests {run.request_seconds:.1f} s, stop "
            f"{run.stop_seconds:.1f} s); {figures}; " + "; ".join(deltas + audit)
        )
    return lines
