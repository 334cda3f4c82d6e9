"""Prometheus export of the audit (``vllm_mamba_align.audit.export``) and the
info series (``vllm_mamba_align.metrics``).

The counters must say what the audit's summary line says; labels follow vLLM's
own metrics (``model_name``, ``engine``). The e2e test ``tests/e2e/test_serve.py``
checks the same through a real API server's ``/metrics``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from helpers import cache_block_for, geometry_rule, scheduler_mode

from vllm_mamba_align import audit, metrics
from vllm_mamba_align.audit import export
from vllm_mamba_align.tools.sim import Geometry, Simulation, build_scheduler, prompt

prometheus_client = pytest.importorskip("prometheus_client")

B, C = 1648, 816
HETEROGENEOUS = Geometry(cache_block=C, state_block=B, budget=8192)
LABELS = {"model_name": "m", "engine": "3"}


def exported(registry: Any, field: str, labels: dict[str, str]) -> float | None:
    name = metrics.PREFIX + export.COUNTERS[field][0] + "_total"
    value = registry.get_sample_value(name, labels)
    return None if value is None else float(value)


def test_counters_follow_the_audit_by_differences() -> None:
    registry = prometheus_client.CollectorRegistry()
    exporter = export.AuditExporter(export.AuditCounters(registry), LABELS)
    found = audit.Audit(B, C, log=[].append, warn=[].append, export=exporter.update)
    found.count_chunk(SimpleNamespace(), 8160, 16320)  # 1 poisoned, 4 skipped
    found.report()
    found.count_chunk(SimpleNamespace(), 0, 8160)  # another request: 4 skipped
    found.close()
    figures = found.snapshot()
    for field in export.COUNTERS:
        assert exported(registry, field, LABELS) == getattr(figures, field), field
    assert figures.poisoned_slots == 1 and figures.skipped_boundaries == 8
    assert figures.requests == figures.requests_affected == 2


def test_each_engine_has_its_own_series() -> None:
    registry = prometheus_client.CollectorRegistry()
    made = export.AuditCounters(registry)
    for engine, chunks in (("0", 1), ("1", 2)):
        labels = {"model_name": "m", "engine": engine}
        exporter = export.AuditExporter(made, labels)
        found = audit.Audit(B, C, log=[].append, warn=[].append)
        for _ in range(chunks):
            found.count_chunk(SimpleNamespace(), 8160, 16320)
        exporter.update(found.snapshot())
        assert exported(registry, "poisoned_slots", labels) == chunks


@pytest.mark.skipif(geometry_rule() != "any", reason="this vLLM refuses C=816 < B=1648")
def test_a_real_audited_scheduler_exports_its_summary_figures() -> None:
    """Real vLLM scheduler in audit mode: the process's counters, per engine."""
    with scheduler_mode("audit"):
        sim = Simulation(HETEROGENEOUS)
    observer = audit.audit_of(sim.scheduler)
    assert observer is not None and observer.export is not None
    labels = metrics.scheduler_labels(sim.scheduler)
    assert labels["engine"] == "0"
    registry = prometheus_client.REGISTRY
    before = {f: exported(registry, f, labels) or 0.0 for f in export.COUNTERS}
    sim.add("first", prompt(16764, seed=1))
    sim.run()
    sim.scheduler.shutdown()
    figures = observer.snapshot()
    assert figures.poisoned_slots > 0
    for field in export.COUNTERS:
        gained = (exported(registry, field, labels) or 0.0) - before[field]
        assert gained == getattr(figures, field), field
    info = {
        (sample.labels["state_block"], sample.labels["cache_block"])
        for family in registry.collect()
        if family.name == metrics.INFO
        for sample in family.samples
        if sample.labels["mode"] == "audit" and sample.labels["status"] == "AUDIT"
    }
    assert (str(observer.state_block), str(observer.cache_block)) in info


def published_statuses(**labels: str) -> set[str]:
    """The status of each info sample in this process with ``labels``."""
    return {
        sample.labels["status"]
        for family in prometheus_client.REGISTRY.collect()
        if family.name == metrics.INFO
        for sample in family.samples
        if all(sample.labels[name] == value for name, value in labels.items())
    }


@pytest.mark.parametrize(
    ("mode", "hybrid", "word"),
    [
        ("lean", True, "ACTIVE"),
        ("audit", True, "AUDIT"),
        ("off", True, "loaded"),
        ("lean", False, "inactive"),
    ],
)
def test_the_info_status_is_a_word_the_alert_rules_know(
    mode: str, hybrid: bool, word: str
) -> None:
    """Real schedulers publish each of metrics.STATUSES, which the alert rules
    and the dashboard match (tests/unit/test_monitoring_contract.py): a status
    renamed in a start line fails here, not in an operator's silent alert."""
    state_block = 1648
    cache_block = cache_block_for(state_block)
    geometry = Geometry(cache_block=cache_block, state_block=state_block, hybrid=hybrid)
    with scheduler_mode(mode):
        scheduler = build_scheduler(geometry)
    scheduler.shutdown()
    found = published_statuses(
        mode=mode,
        cache_block=str(cache_block),
        state_block=str(state_block) if hybrid else "none",
    )
    assert found == {word}, found
    assert word in metrics.STATUSES


def test_export_status_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in export.MULTIPROC_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    status = export.export_status()
    assert status.available and not status.exported
    assert "PROMETHEUS_MULTIPROC_DIR is not set" in status.describe()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/x")
    assert export.export_status().exported
    missing = export.ExportStatus(available=False, multiprocess="/tmp/x")
    assert not missing.exported and "not importable" in missing.describe()


def test_in_a_ray_actor_the_status_says_ray_withholds_the_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's Ray backend copies VLLM_* variables into an engine-core actor,
    not PROMETHEUS_MULTIPROC_DIR: the advice to set the variable before
    `vllm serve` would not help there, so the line says where the figures are."""
    import sys
    import types

    for name in export.MULTIPROC_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    context = types.SimpleNamespace(get_actor_id=lambda: "a1b2")
    ray = types.SimpleNamespace(
        is_initialized=lambda: True, get_runtime_context=lambda: context
    )
    monkeypatch.setitem(sys.modules, "ray", ray)
    status = export.export_status()
    assert status.ray_actor and not status.exported
    assert "Ray actor" in status.describe()
    assert "audit lines" in status.describe()
    context.get_actor_id = lambda: None  # the driver: the launching process
    assert not metrics.in_ray_actor()
    assert "PROMETHEUS_MULTIPROC_DIR is not set" in export.export_status().describe()
    monkeypatch.delitem(sys.modules, "ray")
    assert not metrics.in_ray_actor()
