"""Prometheus metrics of the plugin, written where the scheduler runs.

The scheduler lives in vLLM's engine-core process; the ``/metrics`` endpoint is
served by the API server process. vLLM has no plugin slot in its scheduler
statistics, so the plugin writes ``prometheus_client`` metrics in the engine
core itself. They reach the API server's ``/metrics`` when Prometheus runs in
multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR`` set before ``vllm serve``
starts (vLLM sets it itself with ``--api-server-count`` > 1). Without it the
values stay inside the engine-core process (a one-time log line says so) and
the audit's log lines remain the way to read them.

``prometheus_client`` is optional (vLLM depends on it, the plugin does not): it
is imported lazily, and without it nothing is exported and nothing fails.
Metric errors never reach vLLM's scheduler: they are logged once and the
export stops.

Labels follow vLLM's own metrics (``vllm/v1/metrics/loggers.py``):
``model_name`` (the served model name) and ``engine`` (the engine index, which
is the data-parallel rank).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .version import __version__

PREFIX = "vllm_mamba_align_"
LABELS = ("model_name", "engine")
INFO_LABELS = (
    *LABELS,
    "mode",
    "status",
    "state_block",
    "cache_block",
    "hash_block",
    "plugin_version",
    "vllm_version",
)
INFO = PREFIX + "info"
STATUSES = ("ACTIVE", "AUDIT", "loaded", "inactive")
"""The words of the info series' ``status`` label (the first word of the status
in the plugin's start line, :func:`status_word`): the fix runs, mode audit
(stock scheduling, counted), mode off (stock scheduling), nothing to fix (no
Mamba layers in align mode, or vLLM's own fix). The alert rules and dashboard
in deploy/monitoring match these words (tests/unit/test_monitoring_contract.py),
and every one of them is what a real scheduler publishes (tests/test_metrics.py)."""
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
        prometheus_available(), multiprocess_directory(), in_ray_actor()
    )


def in_ray_actor() -> bool:
    """Whether this process runs a Ray actor (never imports Ray: an actor has)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized() and ray.get_runtime_context().get_actor_id())
    except Exception:  # any Ray of any version: no answer is "not an actor"
        return False


class Metrics:
    """The plugin's metric objects in one registry (one set per process)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        self.counters: dict[str, Any] = {
            field: Counter(
                PREFIX + name, documentation, labelnames=LABELS, registry=registry
            )
            for field, (name, documentation) in COUNTERS.items()
        }
        # An info metric as a gauge set to 1, like vLLM's cache_config_info:
        # prometheus_client's Info does not work in multiprocess mode.
        self.info = Gauge(
            INFO,
            "vllm-mamba-align on this engine: mode, grids, versions (value 1).",
            labelnames=INFO_LABELS,
            multiprocess_mode="mostrecent",
            registry=registry,
        )


_process_metrics: Metrics | None = None
_lock = threading.Lock()
_failed = False


def _warn_once(problem: BaseException) -> None:
    global _failed
    if _failed:
        return
    _failed = True
    from vllm.logger import init_logger

    init_logger("vllm.plugins.mamba_align").warning(
        "vllm-mamba-align: Prometheus metrics disabled in this process (%s: %s); "
        "the audit's log lines still carry the figures.",
        type(problem).__name__,
        problem,
    )


def process_metrics() -> Metrics | None:
    """This process's metric objects (created on first use), or None.

    None when ``prometheus_client`` is missing or a metric could not be made.
    """
    global _process_metrics
    if _failed:
        return None
    with _lock:
        if _process_metrics is None:
            try:
                _process_metrics = Metrics()
            except ImportError:
                return None
            except Exception as problem:  # never let metrics stop the scheduler
                _warn_once(problem)
                return None
        return _process_metrics


def scheduler_labels(scheduler: Any) -> dict[str, str]:
    """vLLM's labels for this scheduler's engine: served model name and index.

    The engine core sets ``parallel_config.data_parallel_index`` to its
    data-parallel rank before it builds the scheduler (vLLM 0.32.0+); older
    versions only have ``data_parallel_rank``.
    """
    config = getattr(scheduler, "vllm_config", None)
    model_config = getattr(config, "model_config", None)
    name = getattr(model_config, "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    if name is None:
        name = getattr(model_config, "model", "")
    parallel = getattr(config, "parallel_config", None)
    index = getattr(parallel, "data_parallel_index", None)
    if not isinstance(index, int):
        index = getattr(parallel, "data_parallel_rank", 0)
    return {"model_name": str(name), "engine": str(index if index else 0)}


def status_word(status: str) -> str:
    """The info series' ``status`` of a start-line status (one of :data:`STATUSES`;
    another word is published too, with a warning: alert rules would miss it)."""
    word = status.split(",")[0].split(" ")[0]
    if word not in STATUSES:
        from vllm.logger import init_logger

        init_logger("vllm.plugins.mamba_align").warning(
            "vllm-mamba-align: info status %r is none of %s, which the alert rules "
            "match (deploy/monitoring); please report it.",
            word,
            ", ".join(STATUSES),
        )
    return word


def publish_info(
    scheduler: Any,
    *,
    mode: str,
    status: str,
    state_block: int | None,
    vllm_version: str | None,
) -> None:
    """Set the info metric of this scheduler's engine (never raises)."""
    metrics = process_metrics()
    if metrics is None:
        return
    try:
        cache_block = scheduler.cache_config.block_size
        metrics.info.labels(
            **scheduler_labels(scheduler),
            mode=mode,
            status=status,
            state_block=str(state_block) if state_block is not None else "none",
            cache_block=str(cache_block),
            hash_block=str(getattr(scheduler, "hash_block_size", cache_block)),
            plugin_version=__version__,
            vllm_version=str(vllm_version),
        ).set(1)
    except Exception as problem:
        _warn_once(problem)


class AuditExporter:
    """Moves one audit's figures into its engine's counters (by differences)."""

    def __init__(self, metrics: Metrics, labels: dict[str, str]) -> None:
        self._children = {
            field: counter.labels(**labels)
            for field, counter in metrics.counters.items()
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
    metrics = process_metrics()
    if metrics is None:
        return None
    _announce_once()
    try:
        exporter = AuditExporter(metrics, scheduler_labels(scheduler))
    except Exception as problem:
        _warn_once(problem)
        return None

    def update(figures: Any) -> None:
        if _failed:
            return
        try:
            exporter.update(figures)
        except Exception as problem:
            _warn_once(problem)

    return update
