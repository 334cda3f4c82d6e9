"""Prometheus metrics of the plugin, written where the scheduler runs.

The scheduler lives in vLLM's engine-core process; the ``/metrics`` endpoint is
served by the API server process. vLLM has no plugin slot in its scheduler
statistics, so the plugin writes ``prometheus_client`` metrics in the engine
core itself. They reach the API server's ``/metrics`` when Prometheus runs in
multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR`` set before ``vllm serve``
starts (vLLM sets it itself with ``--api-server-count`` > 1).

Every scheduler's start publishes the info series (this module); the audit's
counters are the audit's (audit/export.py, loaded in audit mode only).

``prometheus_client`` is optional (vLLM depends on it, the plugin does not): it
is imported lazily, and without it nothing is exported and nothing fails.
Metric errors never reach vLLM's scheduler: they are logged once and the
export stops.

Labels follow vLLM's own metrics (``vllm/v1/metrics/loggers.py``):
``model_name`` (the served model name) and ``engine`` (the engine index, which
is the data-parallel rank).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
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


def in_ray_actor() -> bool:
    """Whether this process runs a Ray actor (never imports Ray: an actor has)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized() and ray.get_runtime_context().get_actor_id())
    except Exception:  # any Ray of any version: no answer is "not an actor"
        return False


def info_gauge() -> Any:
    """The info series: a gauge set to 1, like vLLM's cache_config_info
    (prometheus_client's Info does not work in multiprocess mode)."""
    from prometheus_client import Gauge

    return Gauge(
        INFO,
        "vllm-mamba-align on this engine: mode, grids, versions (value 1).",
        labelnames=INFO_LABELS,
        multiprocess_mode="mostrecent",
    )


_made: dict[str, Any] = {}
"""This process's metric objects, by name (one set per process)."""
_lock = threading.Lock()
_failed = False


def warn_once(problem: BaseException) -> None:
    """Stop this process's export, saying why once."""
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


def stopped() -> bool:
    """Whether a metric error stopped this process's export."""
    return _failed


def process_metric(name: str, make: Callable[[], Any]) -> Any | None:
    """This process's metric object ``name``, made by ``make`` on first use;
    None when ``prometheus_client`` is missing, the object could not be made,
    or the export stopped."""
    if _failed:
        return None
    with _lock:
        if name not in _made:
            try:
                _made[name] = make()
            except ImportError:
                return None
            except Exception as problem:  # never let metrics stop the scheduler
                warn_once(problem)
                return None
        return _made[name]


def process_info() -> Any | None:
    """This process's info series (made on first use), or None: no export."""
    return process_metric(INFO, info_gauge)


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
    info = process_info()
    if info is None:
        return
    try:
        cache_block = scheduler.cache_config.block_size
        info.labels(
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
        warn_once(problem)
