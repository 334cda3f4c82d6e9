"""The audit's reporter thread and where its lines go.

A daemon thread per audited scheduler calls the audit's ``report()`` every
tick, so an idle server still exports and logs what it counted; it ends when
the audit closes (the scheduler's ``shutdown()``) or when the scheduler is
garbage-collected without one.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

LOGGER_NAME = "vllm.plugins.mamba_align"

DEFAULT_INTERVAL_SECONDS = 60.0
"""A summary line at most this often, and only when the counts changed."""
REPORT_TICK_SECONDS = 1.0
"""How often the reporter thread looks at the counts (export; summary when due)."""


def vllm_log(line: str) -> None:
    """An INFO line through vLLM's logger."""
    from vllm.logger import init_logger

    init_logger(LOGGER_NAME).info("%s", line)


def vllm_warn(line: str) -> None:
    """A WARNING line through vLLM's logger."""
    from vllm.logger import init_logger

    init_logger(LOGGER_NAME).warning("%s", line)


class Reported(Protocol):
    """What the thread drives: the audit's report, each tick."""

    def report(self) -> None: ...


class ReporterThread(threading.Thread):
    """One audited scheduler's timer: ``audit.report()`` every tick while the
    scheduler (``owner``, weakly held) lives and until :meth:`stop`."""

    def __init__(self, audit: Reported, owner: object, tick: float) -> None:
        super().__init__(name="vllm-mamba-align-audit", daemon=True)
        self._audit = audit
        self._owner = weakref.ref(owner)
        self._stopped = threading.Event()
        self._tick = tick

    def run(self) -> None:
        while not self._stopped.wait(self._tick):
            if self._owner() is None:
                return  # the scheduler is gone without a shutdown
            self._audit.report()

    def stop(self) -> None:
        self._stopped.set()
        if self is not threading.current_thread() and self.is_alive():
            self.join(timeout=5)
