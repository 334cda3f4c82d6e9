"""The audit's figures as Prometheus counters, beside the info series every
scheduler publishes (metrics.py); loaded in audit mode only.

The counters reach the API server's ``/metrics`` when Prometheus runs in
multiprocess mode (metrics.py says how). Without it the values stay inside the
engine-core process (a one-time log line says so, :func:`export_status` tells
``doctor``) and the audit's log lines remain the way to read them.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import metrics

MULTIPROC_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")

# AuditSnapshot field -> (counter name without prefix and "_total", help).
COUNTERS: dict[str, tuple[str, str]] = {
    "poisoned_slots": (
        "audit_would_be_poisoned_slots",
        "Mamba slots stock vLLM published under the hash of a state boundary "
        "they do not hold (audit mode): each serves a wrong state to requests "
        "that hit it.",
    ),
    "skipped_boundaries": (
        "audit_skipped_state_boundaries",
        "Mamba state boundaries crossed inside a prefill chunk whose state is "
        "never saved (audit mode): lost prefix reuse.",
    ),
    "noncanonical_states": (
        "audit_noncanonical_kept_states",
        "Kept Mamba states computed by another chunk sequence than one state "
        "block per chunk (audit mode): correct, but not bit-identical to what "
        "the fix computes.",
    ),
    "requests": (
        "audit_requests",
        "Requests with at least one prefill chunk scheduled (audit mode).",
    ),
    "requests_affected": (
        "audit_requests_affected",
        "Requests with a would-be-poisoned slot or a skipped state boundary "
        "(audit mode).",
    ),
    "requests_poisoning": (
        "audit_requests_poisoning",
        "Requests with at least one would-be-poisoned slot (audit mode).",
    ),
    "prefill_chunks": (
        "audit_prefill_chunks",
        "Prefill chunks scheduled (audit mode).",
    ),
    "prefill_tokens": (
        "audit_prefill_tokens",
        "Prefill tokens scheduled (audit mode).",
    ),
}


def prometheus_available() -> bool:
    """Whether ``prometheus_client`` can be imported in this Python."""
    try:
        return importlib.util.find_spec("prometheus_client") is not None
    except (ImportError, ValueError):
        return False


def multiprocess_directory() -> str | None:
    """Where multiprocess Prometheus writes its values, if it is configured."""
    for name in MULTIPROC_VARIABLES:
        value = os.environ.get(name)
        if value:
            return value
    return None


@dataclass(frozen=True)
class ExportStatus:
    """Whether the plugin's metrics can reach a ``/metrics`` endpoint."""

    available: bool
    """``prometheus_client`` is importable."""
    multiprocess: str | None
    """``PROMETHEUS_MULTIPROC_DIR``, when set."""
    ray_actor: bool = False
    """This process is a Ray actor (vLLM's Ray backend runs engine cores so)."""

    @property
    def exported(self) -> bool:
        return self.available and self.multiprocess is not None

    def describe(self) -> str:
        if not self.available:
            return (
                "off: prometheus_client is not importable in this Python (vLLM "
                "depends on it; the audit still logs its figures)"
            )
        if self.multiprocess is None and self.ray_actor:
            return (
                "engine-core only: this engine core is a Ray actor, and vLLM "
                "copies VLLM_* variables into it but not PROMETHEUS_MULTIPROC_DIR, "
                "so its values stay in the actor and the API server's /metrics "
                "does not show them; read this engine's audit lines, which Ray "
                "forwards to the output of the process that launched `vllm serve`"
            )
        if self.multiprocess is None:
            return (
                "engine-core only: PROMETHEUS_MULTIPROC_DIR is not set, so values "
                "written in the engine core do not reach the API server's /metrics "
                "(set it to an empty directory before `vllm serve`, or run with "
                "--api-server-count > 1)"
            )
        return (
            f"on: multiprocess Prometheus (PROMETHEUS_MULTIPROC_DIR="
            f"{self.multiprocess}); the API server's /metrics shows them"
        )


def export_status() -> ExportStatus:
    return ExportStatus(
        prometheus_available(), multiprocess_directory(), metrics.in_ray_actor()
    )


class AuditCounters:
    """The audit's counters in one registry (one set per process)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter

        registry = REGISTRY if registry is None else registry
        self.counters: dict[str, Any] = {
            field: Counter(
                metrics.PREFIX + name,
                documentation,
                labelnames=metrics.LABELS,
                registry=registry,
            )
            for field, (name, documentation) in COUNTERS.items()
        }


COUNTERS_NAME = "audit counters"
"""The counters' name among this process's metric objects."""


class AuditExporter:
    """Moves one audit's figures into its engine's counters (by differences)."""

    def __init__(self, counters: AuditCounters, labels: dict[str, str]) -> None:
        self._children = {
            field: counter.labels(**labels)
            for field, counter in counters.counters.items()
        }
        self._exported = dict.fromkeys(self._children, 0)

    def update(self, figures: Any) -> None:
        """Add to each counter what ``figures`` (an AuditSnapshot) adds."""
        for field, child in self._children.items():
            value = int(getattr(figures, field))
            delta = value - self._exported[field]
            if delta > 0:
                child.inc(delta)
                self._exported[field] = value


_announced = False


def _announce_once() -> None:
    """Log once per process whether the counters can reach ``/metrics``."""
    global _announced
    if _announced:
        return
    _announced = True
    status = export_status()
    detail = status.describe()
    if status.exported:
        from prometheus_client import values

        if values.ValueClass is values.MutexValue:
            detail = (
                "engine-core only: PROMETHEUS_MULTIPROC_DIR is set, but this "
                "process imported prometheus_client before it was set, so its "
                "values stay in memory (set the variable before `vllm serve` starts)"
            )
    from vllm.logger import init_logger

    init_logger("vllm.plugins.mamba_align").info(
        "vllm-mamba-align audit metrics: %s", detail
    )


def audit_exporter(scheduler: Any) -> Callable[[Any], None] | None:
    """An ``update(snapshot)`` for this scheduler's audit, or None (no export)."""
    counters = metrics.process_metric(COUNTERS_NAME, AuditCounters)
    if counters is None:
        return None
    _announce_once()
    try:
        exporter = AuditExporter(counters, metrics.scheduler_labels(scheduler))
    except Exception as problem:
        metrics.warn_once(problem)
        return None

    def update(figures: Any) -> None:
        if metrics.stopped():
            return
        try:
            exporter.update(figures)
        except Exception as problem:
            metrics.warn_once(problem)

    return update
