"""A hybrid MoE model with ``vllm serve --data-parallel-size 2`` on one node.

Run by ``nox -s e2e_deployments`` (outside CI's default list, which collects
and skips these tests: docs/maintaining says why and when to run them).

vLLM runs the data-parallel ranks of an MoE model in lockstep: each rank is a
``DPEngineCoreProc`` (``vllm/v1/engine/core.py``), a ``DPCoordinator``
(``vllm/v1/engine/coordinator.py``) starts and ends request "waves" across the
ranks, and a rank with nothing scheduled steps a dummy batch
(``execute_dummy_batch``) so that the other rank's experts can exchange tokens
with it. The model: a tiny GraniteMoeHybrid (Mamba2, attention, routed experts
and a shared MLP; tests/e2e/models.py), random weights; the CPU build needs one
test-only workaround for the MoE exchange (gap 4 of
tests/support/cpu_e2e_workarounds). No speculative method: GraniteMoeHybrid has
no EAGLE3 interface, so the cache block equals the Mamba block here (C = B = 64),
and stock vLLM would also publish correct states: these tests show the plugin's
start, fix and audit in the lockstep path, not a wrong state it prevents (the
dense model's tests do that).

Two deployments, each started once and stopped with nothing left running:
``kept`` (the default): the scenario of test_serve.py on rank 0 while rank 1 has
nothing to do (it steps dummy batches), then on rank 1; the probe through the
server (rank 0). ``audit``: the scenario on rank 0 only; rank 1's audit counts
nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .models import write_model
from .probe_run import ProbeRun, run_probe
from .server import VLLM_CLI, Server, samples, stop_together, write_tokenizer
from .sessions import DEPLOYMENTS_VARIABLE, outside_ci
from .test_serve import (
    COUNTER_NAMES,
    SERVE_OPTIONS,
    ServeRun,
    _environment,
    _scenario,
    check_fix,
    counters,
    expected_prefill_tokens,
    last_summary,
    starts_in_lockstep,
)

pytestmark = [
    pytest.mark.xdist_group("moe"),
    outside_ci(
        DEPLOYMENTS_VARIABLE,
        "a hybrid MoE model's lockstep data-parallel ranks, two deployments",
        "e2e_deployments",
    ),
]

DRAFTER = "speculative_config"
MOE_OPTIONS: dict[str, Any] = {
    **{key: value for key, value in SERVE_OPTIONS.items() if key != DRAFTER},
    "data_parallel_size": 2,
}
PROBE_ARGUMENTS = ("--rounding", "0")  # fp32 on CPU: chunk-invariant
DUMMY_STEPS = "MAMBA_ALIGN_E2E_DUMMY_STEPS"
"""tests/support/cpu_e2e_workarounds prints a line per dummy batch stepped."""
DUMMY_STEP_LINE = "e2e: dummy batch stepped on data-parallel rank"


def dummy_steps(log: str, rank: int) -> int:
    """Dummy batches rank ``rank`` stepped: the plugin's lines name the rank
    (the engine core's own ``dp_rank``; a bare print carries no process tag)."""
    return sum(
        1 for line in log.splitlines() if line.endswith(f"{DUMMY_STEP_LINE} {rank}")
    )


@dataclass
class MoeRun:
    run: ServeRun
    probe: ProbeRun | None = None
    seconds: float = 0.0
    idle_log: str = ""
    """Rank 1's engine-core lines while only rank 0 had requests."""
    left: bool = True
    stopped_cleanly: bool = False
    stop_report: str = ""
    metrics_during: list[str] = field(default_factory=list)


_runs: dict[str, MoeRun] = {}


def write_moe_model(root: Path) -> Path:
    model = write_model("granite_moe_hybrid", root / "model")
    write_tokenizer(model)
    return model


def _deploy(root: Path, mode: str | None, both_ranks: bool) -> MoeRun:
    model = write_moe_model(root)
    env = _environment(mode, root / "prometheus")
    # `vllm serve` starts one API server per rank and sets up multiprocess
    # Prometheus itself.
    del env["PROMETHEUS_MULTIPROC_DIR"]
    env[DUMMY_STEPS] = "1"  # each dummy batch a rank steps, printed
    server = Server(model, MOE_OPTIONS, env, root / "server.log", entry=VLLM_CLI)
    found = MoeRun(ServeRun(mode or "default"))
    started = time.monotonic()
    try:
        server.start()
        found.run.start_seconds = time.monotonic() - started
        _scenario(server, found.run, 0)  # rank 1 idle: dummy steps
        found.idle_log = server.log()
        if both_ranks:
            _scenario(server, found.run, 1)
            found.probe = run_probe(server.base, *PROBE_ARGUMENTS)
        else:
            _settle_audit(server, found.run)
        found.run.metrics = found.run.metrics or server.metrics()
    finally:
        stop_together(server)
        found.seconds = time.monotonic() - started
        found.run.log = server.log()
        found.stopped_cleanly = server.stopped_cleanly
        found.stop_report = server.stop_report
        found.left = server.group_alive()
    return found


def _settle_audit(server: Server, run: ServeRun) -> None:
    """Scrape until rank 0's summary line and series show the scenario."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        run.metrics = server.metrics()
        summary = last_summary(_rank_log(server, 0))
        if (
            summary is not None
            and summary["prefill_tokens"] == expected_prefill_tokens(run, 0)
            and counters(run.metrics, 0).get("prefill_tokens")
            == summary["prefill_tokens"]
        ):
            return
        time.sleep(0.5)


def _rank_log(server: Server, rank: int) -> str:
    tag = f"(EngineCore_DP{rank} "
    return "\n".join(line for line in server.log().splitlines() if tag in line)


def _isolated(factory: pytest.TempPathFactory, key: str, *args: Any) -> MoeRun:
    if key not in _runs:
        with pytest.MonkeyPatch.context() as monkeypatch:
            for name in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"):
                monkeypatch.delenv(name, raising=False)
            _runs[key] = _deploy(factory.mktemp(f"moe-{key}"), *args)
    return _runs[key]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> MoeRun:
    return _isolated(tmp_path_factory, "default", None, True)


@pytest.fixture(scope="module")
def moe_audit(tmp_path_factory: pytest.TempPathFactory) -> MoeRun:
    return _isolated(tmp_path_factory, "audit", "audit", False)


def test_each_lockstep_rank_starts_with_the_fix(moe: MoeRun) -> None:
    lines = moe.run.plugin_lines()
    assert sorted(line["process"] for line in lines) == [
        "EngineCore_DP0",
        "EngineCore_DP1",
    ]
    for line in lines:
        assert line["status"].startswith("ACTIVE, mode=lean"), line
        assert line["c"] == line["b"] == "64", line  # no drafter: C = B = 64
    # vLLM ran the MoE path: a coordinator for the waves (vLLM starts one for
    # any DP > 1 behind its own balancer) and each rank's engine core in
    # lockstep: the start line ends with "of 2" only where the scheduler's
    # data-parallel size is above 1, which vLLM leaves so for lockstep ranks
    # alone (ranks of a model vLLM does not count as MoE get 1: read from
    # code; test_serve.py's NemotronH counts as MoE and runs in lockstep too).
    assert "Started DP Coordinator process" in moe.run.log
    for rank in (0, 1):
        assert starts_in_lockstep(moe.run.log, rank), f"rank {rank}: no lockstep line"


def test_the_fix_holds_on_each_rank_after_the_other_ran_alone(moe: MoeRun) -> None:
    """Rank 1 had nothing to schedule while rank 0 prefilled, and stepped
    dummy batches in lockstep with it (seen through the test-only plugin's
    line per ``execute_dummy_batch``: vLLM 0.32.0 reports dummy iterations only
    where no DP coordinator runs, and lockstep ranks have one), then served
    the same scenario: each rank reuses what a fresh run computes, bit for
    bit."""
    assert dummy_steps(moe.idle_log, 1) > 0, "rank 1 stepped no dummy batch"
    for rank in (0, 1):
        check_fix(moe.run, rank)
    # While rank 0 served, rank 1 scheduled nothing of its own (it logged no
    # audit or error line and its engine core stayed up).
    assert "ERROR" not in "\n".join(
        line for line in moe.idle_log.splitlines() if "(EngineCore_DP1 " in line
    )


def test_the_probe_passes_the_moe_deployment(moe: MoeRun) -> None:
    """The probe through the server's API servers, its requests pinned to rank 0."""
    probe = moe.probe
    assert probe is not None
    assert probe.exit_code == 0, probe.report["verdict"]
    assert probe.report["verdict"].startswith("[ok] no wrong state served")
    assert not probe.report["reached_other_servers"]


def test_an_idle_lockstep_rank_counts_nothing_in_audit(moe_audit: MoeRun) -> None:
    """Only rank 0 had requests; rank 1 stepped dummy batches for each of its
    steps. Rank 0's series equal its summary line; rank 1's show no request,
    no chunk and no prefill token."""
    run = moe_audit.run
    lines = run.plugin_lines()
    assert sorted(line["rank"] for line in lines) == ["0", "1"]
    assert all(line["status"].startswith("AUDIT, mode=audit") for line in lines)
    summary = last_summary(run.engine_log(0))
    assert summary is not None
    assert summary["prefill_tokens"] == expected_prefill_tokens(run, 0)
    assert summary["requests"] == 4
    assert counters(run.metrics, 0) == {f: summary[f] for f in COUNTER_NAMES}
    idle = counters(run.metrics, 1)  # every series exported, at 0
    assert idle == dict.fromkeys(COUNTER_NAMES, 0.0), idle
    idle_summary = last_summary(run.engine_log(1))
    assert idle_summary is None or not any(idle_summary.values()), idle_summary
    assert dummy_steps(run.log, 1) > 0, "the idle rank stepped no dummy batch"
    info = {
        labels["engine"]
        for labels, value in samples(run.metrics, "vllm_mamba_align_info")
        if value == 1
    }
    assert info == {"0", "1"}


def test_both_moe_deployments_stop_leaving_no_process(
    moe: MoeRun, moe_audit: MoeRun
) -> None:
    for found in (moe, moe_audit):
        assert found.stopped_cleanly, found.stop_report
        assert not found.left, found.stop_report


def summary_lines() -> list[str]:
    return [
        f"moe {key}: {found.seconds:.1f} s in all (ready in "
        f"{found.run.start_seconds:.1f} s)"
        + (
            f"; probe exit {found.probe.exit_code}: {found.probe.report['verdict']}"
            if found.probe is not None
            else ""
        )
        for key, found in _runs.items()
    ]
