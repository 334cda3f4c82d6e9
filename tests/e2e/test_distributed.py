"""Distributed ``vllm serve`` end to end: two "nodes" on one machine.

vLLM's multi-node data parallelism with the multiprocessing backend: a head node
(``--data-parallel-size 2 --data-parallel-size-local 1 --data-parallel-address
127.0.0.1 --data-parallel-rpc-port P``) runs rank 0 and two API servers
(``--api-server-count 2``), a second node (``--headless
--data-parallel-start-rank 1``) runs rank 1 and no API server. Each node is a
process group of its own with an environment of its own, as on two machines:
node 1 runs the plugin in ``full`` mode, node 0 in the default ``kept``, so each
engine core's start line shows which environment it read. Both bind 127.0.0.1
on free ports and are stopped (SIGINT, then SIGKILL to the group after a bound)
with nothing left running.

The same scenario as ``test_serve.py`` (first prompt, sibling, re-ask, the
sibling under another ``cache_salt``) runs on each rank, pinned with the header
``X-data-parallel-rank``: each rank reuses the sibling's state and its logprobs
equal a fresh run's. Then ``vllm-mamba-align probe`` runs against the head's
URL as an operator runs it (it pins its own requests to rank 0). Metrics: with
two API servers vLLM sets up multiprocess Prometheus itself, so rank 0's series
reach ``/metrics`` with no setting; rank 1's engine core on the other node
writes where no API server reads.

A second deployment gives node 1 a setting the plugin refuses
(``VLLM_MAMBA_ALIGN_MODE=bogus``): node 1 stops with the plugin's message, and
tells the head (vllm_mamba_align/headless.py), whose startup loop (vLLM's
``wait_for_engine_startup``, no bound of its own for remote engines) stops with
that message in the head's log at vLLM's default level.

A third, one node with ``--data-parallel-size 2 --api-server-count 2`` in
``audit`` mode and no ``PROMETHEUS_MULTIPROC_DIR`` of the test's: each engine's
audit series on ``/metrics`` equal its summary line.

A fourth, two replicas (two ``vllm serve`` of one engine each) behind a
round-robin balancer (``round_robin.py``): the probe through the balancer says
its requests reached more than one server (exit 5, cannot tell) and names the way
out, and the probe at one replica's own address passes it.

vLLM's Ray data-parallel backend runs in test_ray_dp.py, with a test-only Ray
device for the CPU platform (see
``test_ray_data_parallel_places_engines_on_devices_the_cpu_platform_lacks``).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from .probe_run import ProbeRun, run_probe
from .round_robin import RoundRobin
from .server import (
    VLLM_CLI,
    Completion,
    Headless,
    Server,
    free_port,
    samples,
    stop_together,
)
from .test_serve import (
    COUNTER_NAMES,
    PLUGIN_LINE,
    SERVE_OPTIONS,
    ServeRun,
    _environment,
    _scenario,
    _wait_for_audit,
    check_fix,
    counters,
    expected_prefill_tokens,
    last_summary,
    write_served_model,
)

# A group of its own: --dist loadgroup hands the groups ("serve", "engines",
# this one) to the two workers as they come free.
pytestmark = pytest.mark.xdist_group("distributed")

T = TypeVar("T")
PROBE_ARGUMENTS = ("--rounding", "0")
"""As test_serve.py probes its servers: the served model has a drafter, whose
decode steps differ from run to run, so the rounding is given, not measured."""
NODE_MODES = {0: None, 1: "full"}  # None: the default mode (kept)
REFUSED_MODE = "bogus"
REFUSAL_BOUND = 300.0  # seconds for the refusing node to exit (it fails at start)
HEAD_WATCH = 120.0
"""Seconds the head is given, after the refusing node exited, to stop."""


def data_parallel(rpc_port: int) -> dict[str, Any]:
    """The flags both nodes share: two ranks, one per node, rank 0's address."""
    return {
        "data_parallel_size": 2,
        "data_parallel_size_local": 1,
        "data_parallel_address": "127.0.0.1",
        "data_parallel_rpc_port": rpc_port,
    }


def node_environment(mode: str | None, workdir: Path) -> dict[str, str]:
    """A node's own environment: ``test_serve``'s, less PROMETHEUS_MULTIPROC_DIR
    (vLLM sets one up itself for two API servers; a headless node has none)."""
    env = _environment(mode, workdir)
    del env["PROMETHEUS_MULTIPROC_DIR"]
    return env


@dataclass
class Deployment:
    head_log: str = ""
    node_log: str = ""
    seconds: float = 0.0
    start_seconds: float = 0.0
    done: dict[str, Completion] = field(default_factory=dict)
    metrics: str = ""
    stopped_cleanly: tuple[bool, bool] = (False, False)
    stop_reports: tuple[str, ...] = ()
    """How each node's stop went (server.StopOutcome.report)."""
    left: tuple[bool, bool] = (True, True)
    node_exit: int | None = None
    head_exit: int | None = None
    head_after: float | None = None
    """Refusals in an engine core: the head had exited at most this many
    seconds after the node's refusal (read when the test looked: a bound)."""
    probe: ProbeRun | None = None
    direct: ProbeRun | None = None
    """Replicas: the probe of one replica at its own address."""
    forwarded: list[int] = field(default_factory=list)
    """Replicas: requests the round-robin balancer sent to each."""


def reused(probe: ProbeRun) -> set[str]:
    return {name for name, case in probe.cases().items() if case["cached_tokens"]}


_deployments: dict[str, Deployment] = {}


def _without_multiproc_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither node may inherit a Prometheus directory from the test's shell."""
    for name in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"):
        monkeypatch.delenv(name, raising=False)


def _isolated(
    factory: pytest.TempPathFactory, name: str, run: Callable[[Path], T]
) -> T:
    """``run`` in a fresh folder, with no Prometheus directory to inherit."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _without_multiproc_dir(monkeypatch)
        return run(factory.mktemp(name))


def two_nodes(
    root: Path,
    node_env: dict[str, str],
    head_options: dict[str, Any],
    head_env: dict[str, str],
) -> tuple[Server, Headless]:
    """Node 0 (rank 0, the API servers) and node 1 (rank 1, headless), not started."""
    model = write_served_model(root)
    shared = {**SERVE_OPTIONS, **data_parallel(free_port())}
    node = Headless(
        model,
        {**shared, "data_parallel_start_rank": 1},
        node_env,
        root / "node1.log",
    )
    head = Server(
        model, {**shared, **head_options}, head_env, root / "node0.log", entry=VLLM_CLI
    )
    return head, node


def _stop_and_record(
    found: Deployment, started: float, head: Server, node: Headless
) -> None:
    stop_together(head, node)
    found.seconds = time.monotonic() - started
    found.head_log, found.node_log = head.log(), node.log()
    found.stopped_cleanly = (head.stopped_cleanly, node.stopped_cleanly)
    found.stop_reports = (head.stop_report, node.stop_report)
    found.left = (head.group_alive(), node.group_alive())


@pytest.fixture(scope="module")
def multinode(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """Two nodes, the fix on each, started and stopped once for the module."""
    return _isolated(tmp_path_factory, "multinode", _run_multinode)


def _run_multinode(root: Path) -> Deployment:
    head, node = two_nodes(
        root,
        node_environment(NODE_MODES[1], root),
        {"api_server_count": 2},
        node_environment(NODE_MODES[0], root),
    )
    found = _deployments["multinode"] = Deployment()
    started = time.monotonic()
    try:
        node.launch()
        head.start()
        found.start_seconds = time.monotonic() - started
        run = ServeRun("multinode")
        for rank in (0, 1):
            _scenario(head, run, rank)
        found.done = run.done
        found.metrics = head.metrics()
        # As an operator would run it: the head's URL (the probe pins its
        # requests to rank 0 itself). --rounding 0 as for test_serve's servers:
        # with the drafter, decode steps differ from run to run.
        found.probe = run_probe(head.base, *PROBE_ARGUMENTS)
    finally:
        _stop_and_record(found, started, head, node)
    return found


def as_run(deployment: Deployment) -> ServeRun:
    """Both nodes' logs and the completions as ``test_serve``'s checks read them."""
    return ServeRun(
        "multinode",
        log=deployment.head_log + "\n" + deployment.node_log,
        done=deployment.done,
        metrics=deployment.metrics,
    )


def test_each_node_runs_its_rank_with_the_plugin_settings_of_its_environment(
    multinode: Deployment,
) -> None:
    on_head = [m.groupdict() for m in PLUGIN_LINE.finditer(multinode.head_log)]
    on_node = [m.groupdict() for m in PLUGIN_LINE.finditer(multinode.node_log)]
    assert [line["process"] for line in on_head] == ["EngineCore_DP0"]
    assert [line["process"] for line in on_node] == ["EngineCore_DP1"]
    assert on_head[0]["status"].startswith("ACTIVE, mode=lean"), on_head
    assert on_node[0]["status"].startswith("ACTIVE, mode=full"), on_node
    assert "headless mode" in multinode.node_log
    # Two API servers on the head, none on node 1.
    assert "(ApiServer_1 " in multinode.head_log
    assert "ApiServer" not in multinode.node_log


def test_the_fix_is_active_on_every_rank_of_both_nodes(
    multinode: Deployment,
) -> None:
    run = as_run(multinode)
    for rank in (0, 1):
        check_fix(run, rank)  # each rank its own prefix cache, on its own node


def test_two_api_servers_export_the_head_rank_not_the_headless_one(
    multinode: Deployment,
) -> None:
    info = {
        labels["engine"]: labels
        for labels, value in samples(multinode.metrics, "vllm_mamba_align_info")
        if value == 1
    }
    # vLLM's own multiprocess Prometheus (two API servers) carries rank 0's
    # series; rank 1 writes in another node's process, which no API server reads.
    assert sorted(info) == ["0"]
    assert info["0"]["mode"] == "lean" and info["0"]["status"] == "ACTIVE"


def test_the_probe_passes_the_two_node_deployment_through_the_head(
    multinode: Deployment,
) -> None:
    """The probe through the head's two API servers: every request pinned to
    rank 0 (vLLM 0.32.0 honours the header), every prompt token counted by the
    head's /metrics, cached states read and none continuing differently."""
    probe = multinode.probe
    assert probe is not None
    report = probe.report
    assert probe.exit_code == 0, report["verdict"]
    assert report["verdict"].startswith("[ok] no wrong state served")
    assert not report["reached_other_servers"]
    assert report["prompt_tokens_counted"] >= report["prompt_tokens_sent"] > 0
    assert {"pair2.second", "replay", "reask"} <= set(reused(probe))


def test_both_nodes_stop_within_bounds_leaving_no_process(
    multinode: Deployment,
) -> None:
    assert multinode.stopped_cleanly == (True, True), multinode.stop_reports
    assert multinode.left == (False, False), multinode.stop_reports


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """Node 1 with a setting the plugin refuses; one API server on the head."""
    return _isolated(tmp_path_factory, "refused", _run_refused)


def _run_refused(root: Path) -> Deployment:
    head, node = two_nodes(
        root,
        node_environment(REFUSED_MODE, root),
        {"api_server_count": 1},
        node_environment(None, root),  # vLLM's default log level
    )
    found = _deployments["refused"] = Deployment()
    started = time.monotonic()
    try:
        head.launch()
        node.launch()
        assert node.process is not None and head.process is not None
        found.node_exit = node.process.wait(timeout=REFUSAL_BOUND)
        found.start_seconds = time.monotonic() - started
        try:
            found.head_exit = head.process.wait(timeout=HEAD_WATCH)
        except subprocess.TimeoutExpired:
            found.head_exit = None  # still waiting: the test says so
    finally:
        _stop_and_record(found, started, head, node)
    return found


def test_a_refused_setting_on_the_headless_node_stops_that_node_with_the_message(
    refused: Deployment,
) -> None:
    assert refused.node_exit not in (None, 0)
    assert (
        f"VLLM_MAMBA_ALIGN_MODE='{REFUSED_MODE}' is not a valid mode"
        in refused.node_log
    )
    assert "EngineCore_DP1" not in refused.node_log  # refused before any engine


def test_the_head_stops_with_the_refusal_of_the_headless_node(
    refused: Deployment,
) -> None:
    """vLLM's startup loop has no bound for a remote engine that never
    connects; the refusing node's message for rank 1 ends it, and the head's
    log at vLLM's default level names the refusal and the node's rank."""
    assert refused.head_exit not in (None, 0), refused.head_log[-3000:]
    assert (
        f"VLLM_MAMBA_ALIGN_MODE='{REFUSED_MODE}' is not a valid mode"
        in refused.head_log
    )
    assert "refused to start on the headless node of rank(s) 1" in refused.head_log
    assert "remote engine 1" in refused.head_log
    assert refused.left == (False, False)


@pytest.fixture(scope="module")
def api_servers(tmp_path_factory: pytest.TempPathFactory) -> ServeRun:
    """One node, two ranks, ``--api-server-count 2``, the audit, and no
    PROMETHEUS_MULTIPROC_DIR of the test's: vLLM sets one up for its API servers
    and the engine cores it starts."""
    return _isolated(tmp_path_factory, "api-servers", _run_api_servers)


def _run_api_servers(root: Path) -> ServeRun:
    model = write_served_model(root)
    server = Server(
        model,
        {**SERVE_OPTIONS, "data_parallel_size": 2, "api_server_count": 2},
        node_environment("audit", root),
        root / "server.log",
        entry=VLLM_CLI,
    )
    found = _deployments["api-servers"] = Deployment()
    run = ServeRun("api-servers")
    started = time.monotonic()
    try:
        server.start()
        found.start_seconds = time.monotonic() - started
        for rank in (0, 1):
            _scenario(server, run, rank)
        _wait_for_audit(server, run, (0, 1))
        # The audit's figures as they stood after the scenario, before the
        # probe adds traffic of its own.
        audited = server.log()
        found.probe = run_probe(server.base, *PROBE_ARGUMENTS)
    finally:
        stop_together(server)
        found.seconds = time.monotonic() - started
        found.head_log = server.log()
        run.log = audited if found.probe is not None else found.head_log
        found.done, found.metrics = run.done, run.metrics
        found.stopped_cleanly = (server.stopped_cleanly, True)
        found.stop_reports = (server.stop_report,)
        found.left = (server.group_alive(), False)
    return run


def test_two_api_servers_show_each_engine_audit_series_equal_to_its_summary(
    api_servers: ServeRun,
) -> None:
    run = api_servers
    lines = run.plugin_lines()
    assert sorted(line["rank"] for line in lines) == ["0", "1"]
    assert all(line["status"].startswith("AUDIT, mode=audit") for line in lines)
    assert "(ApiServer_1 " in run.log
    # The multiprocess directory is vLLM's own (the test set none).
    assert "audit metrics: on: multiprocess Prometheus" in run.log
    for rank in (0, 1):
        summary = last_summary(run.engine_log(rank))
        assert summary is not None, f"no audit summary line from engine {rank}"
        assert summary["prefill_tokens"] == expected_prefill_tokens(run, rank)
        shown = counters(run.metrics, rank)
        assert shown == {figure: summary[figure] for figure in COUNTER_NAMES}
        assert shown["poisoned_slots"] > 0 and shown["requests"] == 4


def test_the_probe_through_two_api_servers_names_the_states_audit_mode_serves(
    api_servers: ServeRun,
) -> None:
    """``audit`` schedules as stock vLLM does: the probe, its requests pinned to
    rank 0 through either API server and every prompt token counted by their
    shared /metrics, finds the wrong states stock publishes here (C = 8 < B = 32)."""
    probe = _deployments["api-servers"].probe
    assert probe is not None
    report = probe.report
    assert probe.exit_code == 1, report["verdict"]
    assert probe.diverged(), report["verdict"]
    assert not report["reached_other_servers"]
    assert report["prompt_tokens_counted"] >= report["prompt_tokens_sent"]


def test_the_api_servers_deployment_stops_within_bounds_leaving_no_process(
    api_servers: ServeRun,
) -> None:
    found = _deployments["api-servers"]
    assert found.stopped_cleanly == (True, True), found.stop_reports
    assert found.left == (False, False), found.stop_reports


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """Two replicas (two ``vllm serve``, one engine each, the fix in the default
    mode) behind a round-robin balancer; the probe through the balancer, then
    at one replica's own address."""
    return _isolated(tmp_path_factory, "replicas", _run_replicas)


def _run_replicas(root: Path) -> Deployment:
    model = write_served_model(root)
    servers = [
        Server(
            model,
            SERVE_OPTIONS,
            node_environment(None, root),
            root / f"replica{number}.log",
            entry=VLLM_CLI,
        )
        for number in (0, 1)
    ]
    found = _deployments["replicas"] = Deployment()
    started = time.monotonic()
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_healthy()
        found.start_seconds = time.monotonic() - started
        with RoundRobin([server.base for server in servers]) as balancer:
            found.probe = run_probe(balancer.url, *PROBE_ARGUMENTS)
            found.forwarded = list(balancer.sent)
        found.direct = run_probe(servers[0].base, *PROBE_ARGUMENTS)
    finally:
        stop_together(*servers)
        found.seconds = time.monotonic() - started
        found.head_log, found.node_log = servers[0].log(), servers[1].log()
        found.stopped_cleanly = (servers[0].stopped_cleanly, servers[1].stopped_cleanly)
        found.stop_reports = (servers[0].stop_report, servers[1].stop_report)
        found.left = (servers[0].group_alive(), servers[1].group_alive())
    return found


def test_behind_a_round_robin_balancer_the_probe_says_reuse_was_split(
    replicas: Deployment,
) -> None:
    """Two prefix caches behind one URL: no header reaches one of them, so the
    probe cannot pass the deployment; it says its requests reached more than one
    server and how to point it at one, and calls no correct state wrong."""
    probe = replicas.probe
    assert probe is not None
    report = probe.report
    assert replicas.forwarded[0] > 0 and replicas.forwarded[1] > 0
    assert probe.exit_code == 5, report["verdict"]
    assert report["reached_other_servers"] is True
    assert report["prompt_tokens_counted"] < report["prompt_tokens_sent"]
    assert "reached more than one server" in report["verdict"]
    assert "probe each replica at its own address" in report["verdict"]
    assert probe.diverged() == []


def test_one_replica_at_its_own_address_passes(replicas: Deployment) -> None:
    """The way out the report names: the same probe at one replica's URL."""
    probe = replicas.direct
    assert probe is not None
    report = probe.report
    assert probe.exit_code == 0, report["verdict"]
    assert not report["reached_other_servers"]
    assert {"pair2.second", "replay", "reask"} <= set(reused(probe))


def test_each_replica_runs_the_fix_and_stops_leaving_no_process(
    replicas: Deployment,
) -> None:
    for log in (replicas.head_log, replicas.node_log):
        (line,) = [m.groupdict() for m in PLUGIN_LINE.finditer(log)]
        assert line["status"].startswith("ACTIVE, mode=lean"), line
    assert replicas.stopped_cleanly == (True, True), replicas.stop_reports
    assert replicas.left == (False, False), replicas.stop_reports


def summary_lines() -> list[str]:
    """What each deployment cost, and the probe's verdict (printed after the
    tests)."""
    lines = []
    for key, found in _deployments.items():
        probe = ""
        for where, run in (("probe", found.probe), ("one replica", found.direct)):
            if run is not None:
                probe += (
                    f"; {where}: exit {run.exit_code} in {run.seconds:.1f} s: "
                    f"{run.report.get('verdict', '')}"
                )
        lines.append(
            f"distributed {key}: {found.seconds:.1f} s in all (until ready or "
            f"refused {found.start_seconds:.1f} s"
            + (
                f", the head {found.head_after:.1f} s after the refusal"
                if found.head_after is not None
                else ""
            )
            + "); cached "
            + ", ".join(f"{name} {c.cached_tokens}" for name, c in found.done.items())
            + probe
        )
    return lines


def test_ray_data_parallel_places_engines_on_devices_the_cpu_platform_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Why the Ray backend needs a test-only device key here (test_ray_dp.py):
    vLLM's ``CoreEngineActorManager.create_dp_placement_groups`` puts each rank
    in a Ray placement group of ``current_platform.ray_device_key`` devices,
    and the real CPU platform declares none (the empty key), so a Ray cluster
    of CPU nodes has no node it can use. vLLM's real function runs here against
    Ray's resource listing of one node, CPUs only (what ``ray start --head`` on
    this machine reports), given in place of a running cluster's.
    If a later CPU build gains a device key, this fails: then test_ray_dp.py
    can drop its workaround (gap 4 of tests/support/cpu_e2e_workarounds).
    """
    import types

    import ray._private.state
    from vllm.config import ParallelConfig
    from vllm.platforms import current_platform
    from vllm.v1.engine.utils import CoreEngineActorManager

    assert current_platform.is_cpu() and current_platform.ray_device_key == ""
    # The shape Ray 2.60.0 lists for `ray start --head --num-cpus 2` here.
    one_node = {
        "node-0": {
            "CPU": 2.0,
            "node:__internal_head__": 1.0,
            "node:127.0.0.1": 1.0,
            "memory": 1.1e10,
            "object_store_memory": 4.7e9,
        }
    }
    monkeypatch.setattr(
        ray._private.state, "available_resources_per_node", lambda: one_node
    )
    # The backend is left at "mp": the function reads only the sizes and address.
    parallel = ParallelConfig(
        data_parallel_size=2,
        data_parallel_size_local=1,
        data_parallel_master_ip="127.0.0.1",
    )
    config = types.SimpleNamespace(parallel_config=parallel)
    with pytest.raises(AssertionError, match="No  found in Ray cluster"):
        CoreEngineActorManager.create_dp_placement_groups(config)  # type: ignore[arg-type]


def test_ray_actors_would_get_the_plugin_settings_but_not_the_prometheus_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What vLLM copies into an engine-core actor's Ray runtime environment
    (``get_env_vars_to_copy``, as ``CoreEngineActorManager`` calls it): every
    ``VLLM_*`` variable, so ``VLLM_PLUGINS`` and ``VLLM_MAMBA_ALIGN_*``, and
    not ``PROMETHEUS_MULTIPROC_DIR``."""
    from vllm.ray.ray_env import get_env_vars_to_copy
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    given = {
        "VLLM_PLUGINS": "mamba_align",
        "VLLM_MAMBA_ALIGN_MODE": "full",
        "VLLM_MAMBA_ALIGN_AUDIT_INTERVAL": "300",
        "VLLM_MAMBA_ALIGN_ALLOW_UNVERIFIED": "1",
        "PROMETHEUS_MULTIPROC_DIR": "/tmp/prometheus",
    }
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    copied = get_env_vars_to_copy(
        destination="EngineCoreActor", exclude_vars=WORKER_SPECIFIC_ENV_VARS
    )
    assert {name for name in given if name.startswith("VLLM_")} <= copied
    assert "PROMETHEUS_MULTIPROC_DIR" not in copied
