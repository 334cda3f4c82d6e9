"""vLLM's Ray data-parallel backend with the plugin (vLLM's CPU build 0.32.0).

Run by ``nox -s e2e_deployments`` (outside CI's default list, which collects
and skips these tests: docs/maintaining says why and when to run them).

``vllm serve --data-parallel-size 2 --data-parallel-backend ray`` on a local
Ray cluster (``ray start --head``) that the test starts: vLLM's
``CoreEngineActorManager`` places each rank in a Ray placement group and runs
its engine core as a Ray actor (``DPMoEEngineCoreActor``; vLLM picks that class
for this model too); the scheduler, and so the plugin, lives in that actor.
The model, geometry and scenario of ``test_serve.py`` (a tiny NemotronH with
the ``extract_hidden_states`` drafter, C = 8 < B = 32).

What this machine needs that a GPU cluster does not, each test-only:
- the CPU platform names no Ray device; ``MAMBA_ALIGN_E2E_RAY_DEVICE_KEY=CPU``
  in the launching process gives it Ray's ``CPU`` resource (gap 4 of
  tests/support/cpu_e2e_workarounds; 4 CPUs: two bundles per rank);
- Ray and the server run in a network namespace holding only ``lo``
  (``netns.py``): Ray registers its node under the machine's address otherwise,
  where this machine allows no server, and vLLM finds no DP master node at
  ``node:127.0.0.1``; ``--data-parallel-address 127.0.0.1`` likewise (vLLM
  otherwise guesses the address from the network and finds none there);
- ``--distributed-executor-backend uni``: with the Ray DP backend vLLM defaults
  each rank's executor to Ray's too, whose workers need a Ray device inside the
  actor as well (``initialize_ray_cluster``: "current platform cpu does not
  support ray"; the launching process's test-only variable is not copied into
  actors). The engine core, its scheduler and the plugin are in the actor
  either way; each rank's model runs in a worker process the actor starts.
- ``RAY_DEDUP_LOGS=0`` in the launching process: Ray folds lines that differ
  only in numbers across actors ("[repeated 1x across cluster]"), the two
  ranks' start lines among them.

The Ray node (``ray start``) is given ``VLLM_MAMBA_ALIGN_MODE=bogus`` in its
environment. Four deployments, in turn, on that one cluster: ``full``: the mode
set only in the launching process reaches each actor (vLLM copies ``VLLM_*``
variables into the actors' runtime environment, over the node's); the scenario
on rank 0, then rank 1, each reusing what a fresh run computes; the probe with
``--ranks 2``. ``audit``: each rank's counts appear in its audit lines,
forwarded by Ray to the launching process's output, and not on the API server's
``/metrics``: the launching process has ``PROMETHEUS_MULTIPROC_DIR`` (an empty
directory the API server reads, as the docs advise), and Ray actors do not
receive it. ``refused``: no mode in the launching process, so each actor reads
the node's ``bogus`` and the plugin refuses inside the actor; ``vllm serve``
exits with the plugin's message. ``executor``: Ray's executor instead
(``--distributed-executor-backend ray``, one rank, the CPU platform without
the test-only Ray device): vLLM's CPU build fails building it, before any
scheduler, and ``vllm serve`` exits. After each deployment no engine-core actor may
be left in the namespace. Then every process in the namespace (Ray's daemons and
idle workers) is ended by process id, SIGTERM and SIGKILL after 10 s, as ``ray
stop`` does (which is not used: it finds Ray's processes by name on the whole
machine), the namespace is deleted, and the tests check that nothing was left.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .netns import Forward, Namespace, NamespaceUnavailable
from .probe_run import ProbeRun, run_probe
from .server import VLLM_CLI, Server, stop_together
from .sessions import DEPLOYMENTS_VARIABLE, outside_ci
from .test_serve import (
    COUNTER_NAMES,
    SERVE_OPTIONS,
    ServeRun,
    _environment,
    _scenario,
    check_fix,
    expected_prefill_tokens,
    last_summary,
    write_served_model,
)

pytestmark = [
    pytest.mark.xdist_group("ray"),
    outside_ci(
        DEPLOYMENTS_VARIABLE,
        "vLLM's Ray backends, four deployments",
        "e2e_deployments",
    ),
]

RAY_OPTIONS: dict[str, Any] = {
    **SERVE_OPTIONS,
    "data_parallel_size": 2,
    "data_parallel_backend": "ray",
    "data_parallel_address": "127.0.0.1",
    "distributed_executor_backend": "uni",
    # One API server (vLLM's default here is one per rank): a process less to
    # start; the scenario pins each request to its rank anyway.
    "api_server_count": 1,
}
EXECUTOR_OPTIONS: dict[str, Any] = {
    **SERVE_OPTIONS,
    "distributed_executor_backend": "ray",
}
"""One rank, its engine core an ordinary process, its workers Ray actors."""
EXECUTOR_REFUSAL = "ValueError: current platform cpu does not support ray."
"""vLLM's CPU build, building the Ray executor (``initialize_ray_cluster``)."""
RAY_PORT = 6379  # Ray's default: the namespace is the test's alone
NODE_MODE = "bogus"  # in the Ray node's environment only
DEPLOYMENTS = (
    ("full", "full"),
    ("audit", "audit"),
    ("refused", None),
    ("executor", "full"),
)
"""Each deployment's name and the mode set where ``vllm serve`` is launched."""
EXITING = ("refused", "executor")
"""Deployments expected to exit on their own, never to answer /health."""
REFUSAL = "VLLM_MAMBA_ALIGN_MODE='bogus' is not a valid mode"
REFUSAL_BOUND = 300.0  # seconds for the refused deployment to exit
ACTOR = r"\x1b\[\d+m|\x1b\[0m"  # Ray colours the actor tag
ACTOR_TAG = re.compile(r"\((?P<actor>\w+Actor) pid=(?P<pid>\d+)(?:, ip=[^)]*)?\)")
# The plugin's start line as an engine-core actor logs it: the actor's class
# and process id in Ray's tag, the rank at the end of the plugin's line.
RAY_PLUGIN_LINE = re.compile(
    r"\((?P<process>\w+Actor) pid=(?P<pid>\d+)(?:, ip=[^)]*)?\)[^\n]*"
    r"vllm-mamba-align \S+ on vLLM (?P<vllm>\S+) \([^)]*\): (?P<status>[^\n]*); "
    r"cache block C=(?P<c>\d+), Mamba state block B=(?P<b>\w+), "
    r"hash block (?P<h>\d+); data-parallel rank (?P<rank>\d+) of (?P<size>\d+)"
)


class RayServeRun(ServeRun):
    """A ServeRun whose engine cores are Ray actors: a rank's lines are those
    of the actor whose start line names that rank."""

    def plugin_lines(self) -> list[dict[str, str]]:
        return [m.groupdict() for m in RAY_PLUGIN_LINE.finditer(_plain(self.log))]

    def engine_log(self, rank: int) -> str:
        pids = {
            line["pid"] for line in self.plugin_lines() if line["rank"] == str(rank)
        }
        return "\n".join(
            line
            for line in _plain(self.log).splitlines()
            if (tag := ACTOR_TAG.search(line)) and tag["pid"] in pids
        )


def _plain(text: str) -> str:
    return re.sub(ACTOR, "", text)


class NamespacedServer(Server):
    """A ``vllm serve`` inside ``namespace``, reached through a :class:`Forward`."""

    def __init__(self, namespace: Namespace, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.namespace = namespace
        self.command = namespace.command(self.command)
        self.forward = Forward(namespace, self.port)
        self.base = f"http://127.0.0.1:{self.forward.port}"


@dataclass
class RayRun:
    run: RayServeRun
    probe: ProbeRun | None = None
    seconds: float = 0.0
    exit_code: int | None = None
    stopped_cleanly: bool = False
    stop_report: str = ""
    group_left: bool = True
    actors_left: list[str] = field(default_factory=list)
    """Engine-core actor processes still in the namespace once it stopped."""


@dataclass
class RayCluster:
    namespace: Namespace
    start_log: str = ""
    start_seconds: float = 0.0
    runs: dict[str, RayRun] = field(default_factory=dict)
    killed: list[str] = field(default_factory=list)
    """Processes that did not exit within 10 s of SIGTERM, then SIGKILLed (as
    ``ray stop`` does after its grace period)."""
    left: list[int] = field(default_factory=list)
    namespace_left: bool = True
    failure: str = ""


_cluster: list[RayCluster] = []


def _ray_command(*words: str) -> list[str]:
    return [str(Path(sys.executable).with_name("ray")), *words]


def _node_environment() -> dict[str, str]:
    """The Ray node's environment: the test's, with the refused mode."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("VLLM_MAMBA_ALIGN_") and name != "VLLM_PLUGINS"
    }
    env["VLLM_MAMBA_ALIGN_MODE"] = NODE_MODE
    return env


def _launch_environment(mode: str | None, root: Path) -> dict[str, str]:
    """The launching process's: the plugin's settings, and multiprocess
    Prometheus set up as the docs advise (an empty directory), which the API
    server reads and the actors never receive."""
    (root / "prometheus").mkdir()
    env = _environment(mode, root / "prometheus")
    env.update(
        {
            "RAY_ADDRESS": f"127.0.0.1:{RAY_PORT}",
            "RAY_DEDUP_LOGS": "0",
            "MAMBA_ALIGN_E2E_RAY_DEVICE_KEY": "CPU",
        }
    )
    return env


def _actors(namespace: Namespace) -> list[str]:
    """Engine-core actor processes in the namespace (``ray::<class>`` titles)."""
    found = []
    for pid in namespace.pids():
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if b"EngineCoreActor" in title:
            found.append(f"{pid} {title.decode(errors='replace')}")
    return found


def _settle_actors(namespace: Namespace, bound: float = 60.0) -> list[str]:
    deadline = time.monotonic() + bound
    while (left := _actors(namespace)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _serve(
    cluster: RayCluster, root: Path, key: str, mode: str | None, model: Path
) -> RayRun:
    environment = _launch_environment(mode, root)
    options = RAY_OPTIONS
    if key == "executor":
        # vLLM's own CPU platform, without the test-only Ray device.
        options = EXECUTOR_OPTIONS
        del environment["MAMBA_ALIGN_E2E_RAY_DEVICE_KEY"]
    server = NamespacedServer(
        cluster.namespace,
        model,
        options,
        environment,
        root / f"{key}.log",
        entry=VLLM_CLI,
    )
    found = RayRun(RayServeRun(key))
    started = time.monotonic()
    try:
        if key in EXITING:
            server.launch()
            assert server.process is not None
            try:
                found.exit_code = server.process.wait(timeout=REFUSAL_BOUND)
            except Exception:
                found.exit_code = None
        else:
            server.start()
            found.run.start_seconds = time.monotonic() - started
            for rank in (0, 1):
                _scenario(server, found.run, rank)
            if key == "audit":
                _settle_audit(server, found.run)
            else:
                found.run.metrics = server.metrics()
                found.probe = run_probe(server.base, "--ranks", "2", "--rounding", "0")
    finally:
        if server.process is not None and server.process.poll() is None:
            stop_together(server)
        else:
            server.stop()
        server.forward.close()
        found.seconds = time.monotonic() - started
        found.run.log = server.log()
        found.stopped_cleanly = server.stopped_cleanly
        found.stop_report = server.stop_report
        found.group_left = server.group_alive()
        found.actors_left = _settle_actors(cluster.namespace)
    return found


def _settle_audit(server: Server, run: RayServeRun) -> None:
    """Read the log until each rank's last summary line shows the scenario."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        run.log = server.log()
        summaries = [last_summary(run.engine_log(rank)) for rank in (0, 1)]
        if all(
            summary is not None
            and summary["prefill_tokens"] == expected_prefill_tokens(run, rank)
            for rank, summary in enumerate(summaries)
        ):
            break
        time.sleep(0.5)
    run.metrics = server.metrics()


def _run_all(root: Path) -> RayCluster:
    try:
        namespace = Namespace(f"mamba-align-ray-{os.getpid()}").create()
    except NamespaceUnavailable as why:
        pytest.skip(f"the Ray tests need a network namespace of their own: {why}")
    cluster = RayCluster(namespace)
    temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths
    model = write_served_model(root)
    started = time.monotonic()
    try:
        with open(root / "ray-start.log", "wb") as log:
            done = subprocess.run(
                namespace.command(
                    _ray_command(
                        "start",
                        "--head",
                        "--num-cpus",
                        "4",
                        "--node-ip-address",
                        "127.0.0.1",
                        "--port",
                        str(RAY_PORT),
                        "--temp-dir",
                        temp,
                        "--include-dashboard",
                        "false",
                        "--disable-usage-stats",
                    )
                ),
                env=_node_environment(),
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                timeout=180,
            )
        cluster.start_log = (root / "ray-start.log").read_text(errors="replace")
        cluster.start_seconds = time.monotonic() - started
        assert done.returncode == 0, cluster.start_log[-3000:]
        for key, mode in DEPLOYMENTS:
            cluster.runs[key] = _serve(cluster, root / key, key, mode, model)
    except BaseException as problem:
        cluster.failure = f"{type(problem).__name__}: {problem}"[:3000]
    finally:
        cluster.killed = namespace.end_processes(bound=10.0)
        cluster.left = namespace.pids()
        namespace.delete()
        cluster.namespace_left = namespace.exists()
        shutil.rmtree(temp, ignore_errors=True)
    return cluster


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> RayCluster:
    if not _cluster:
        root = tmp_path_factory.mktemp("ray")
        for key, _ in DEPLOYMENTS:
            (root / key).mkdir()
        with pytest.MonkeyPatch.context() as monkeypatch:
            for name in list(os.environ):
                if name.startswith("VLLM_MAMBA_ALIGN_") or name.lower() in (
                    "prometheus_multiproc_dir",
                ):
                    monkeypatch.delenv(name)
            _cluster.append(_run_all(root))
    return _cluster[0]


def _run(cluster: RayCluster, key: str) -> RayRun:
    if key not in cluster.runs:
        pytest.fail(f"the {key} deployment did not run: {cluster.failure}")
    return cluster.runs[key]


def test_each_engine_actor_starts_the_plugin_in_the_launching_process_mode(
    ray_cluster: RayCluster,
) -> None:
    """Two start lines, one per rank, each from an engine-core Ray actor, in
    ``full``: set only where ``vllm serve`` was launched, over the node's
    ``bogus``."""
    found = _run(ray_cluster, "full")
    lines = found.run.plugin_lines()
    assert sorted(line["rank"] for line in lines) == ["0", "1"], found.run.log[-4000:]
    assert len({line["pid"] for line in lines}) == 2
    for line in lines:
        assert line["process"].endswith("EngineCoreActor"), line
        assert line["size"] == "2"
        assert line["status"].startswith("ACTIVE, mode=full"), line
        assert int(line["c"]) < int(line["b"])  # the heterogeneous geometry
    assert "Starting ray-based data parallel backend" in found.run.log


def test_the_fix_holds_on_each_ray_rank(ray_cluster: RayCluster) -> None:
    """Each rank reuses the sibling's state and its logprobs equal a fresh run's."""
    found = _run(ray_cluster, "full")
    for rank in (0, 1):
        check_fix(found.run, rank)


def test_the_probe_passes_each_ray_rank(ray_cluster: RayCluster) -> None:
    probe = _run(ray_cluster, "full").probe
    assert probe is not None
    assert probe.exit_code == 0, probe.report.get("verdict")
    assert [rank["rank"] for rank in probe.report["ranks"]] == [0, 1]
    for rank in probe.report["ranks"]:
        assert rank["exit_code"] == 0, rank["verdict"]
        assert any(case["cached_tokens"] for case in rank["cases"]), rank["cases"]


def test_ray_actors_audit_in_their_log_lines_not_on_metrics(
    ray_cluster: RayCluster,
) -> None:
    """Each rank's audit counts its own requests in its own summary lines
    (forwarded by Ray to the launching process's output); the API server's
    ``/metrics`` shows none of the plugin's series, and each actor says why."""
    found = _run(ray_cluster, "audit")
    run = found.run
    lines = run.plugin_lines()
    assert sorted(line["rank"] for line in lines) == ["0", "1"]
    assert all(line["status"].startswith("AUDIT, mode=audit") for line in lines)
    for rank in (0, 1):
        engine_log = run.engine_log(rank)
        summary = last_summary(engine_log)
        assert summary is not None, f"no audit summary line from rank {rank}"
        assert summary["prefill_tokens"] == expected_prefill_tokens(run, rank)
        assert summary["requests"] == 4
        assert summary["poisoned_slots"] > 0  # stock scheduling, C < B
        assert "audit metrics: engine-core only: this engine core is a Ray actor" in (
            engine_log
        )
    assert "vllm_mamba_align_" not in run.metrics
    assert all(name not in run.metrics for name in COUNTER_NAMES.values())
    assert "vllm:" in run.metrics  # vLLM's own series are there


def test_a_refusal_inside_an_actor_stops_the_deployment_with_its_message(
    ray_cluster: RayCluster,
) -> None:
    found = _run(ray_cluster, "refused")
    assert found.exit_code is not None, "vllm serve did not exit after the refusal"
    assert found.exit_code == 1, found.exit_code  # docs/production.md: exits 1
    log = _plain(found.run.log)
    refusals = [
        line for line in log.splitlines() if REFUSAL in line and ACTOR_TAG.search(line)
    ]
    assert refusals, log[-6000:]
    assert not found.run.plugin_lines()  # no scheduler started


def test_the_ray_executor_does_not_start_on_the_cpu_build(
    ray_cluster: RayCluster,
) -> None:
    """``--distributed-executor-backend ray`` with one rank (the engine core an
    ordinary process, its workers Ray actors), as vLLM's CPU build ships it:
    the engine core fails building the Ray executor, before any scheduler
    exists, so the plugin never starts there; ``vllm serve`` exits 1 with
    vLLM's reason. Where a platform names a Ray device this path runs; the
    docs list it as not run (docs/production.md, "The Ray backend")."""
    found = _run(ray_cluster, "executor")
    assert found.exit_code == 1, found.exit_code
    log = _plain(found.run.log)
    assert EXECUTOR_REFUSAL in log, log[-6000:]
    assert not found.run.plugin_lines() and "vllm-mamba-align" not in log


def test_every_ray_deployment_and_the_cluster_stop_leaving_nothing(
    ray_cluster: RayCluster,
) -> None:
    assert not ray_cluster.failure, ray_cluster.failure
    for key, found in ray_cluster.runs.items():
        assert not found.group_left, (key, found.stop_report)
        assert not found.actors_left, (key, found.actors_left)
        if key not in EXITING:
            assert found.stopped_cleanly, (key, found.stop_report)
    assert not ray_cluster.left, ray_cluster.left
    assert not ray_cluster.namespace_left


def summary_lines() -> list[str]:
    lines = []
    for cluster in _cluster:
        lines.append(
            f"ray cluster: started in {cluster.start_seconds:.1f} s; "
            f"{len(cluster.killed)} of its processes SIGKILLed 10 s after SIGTERM"
        )
        for key, found in cluster.runs.items():
            lines.append(
                f"ray {key}: {found.seconds:.1f} s in all (ready in "
                f"{found.run.start_seconds:.1f} s)"
                + (f"; exit {found.exit_code}" if key in EXITING else "")
                + (
                    f"; probe exit {found.probe.exit_code} in "
                    f"{found.probe.seconds:.1f} s: {found.probe.report['verdict']}"
                    if found.probe is not None
                    else ""
                )
            )
    return lines
