"""Test-only: the witness (tests/witness, found on ``PYTHONPATH``) watches every
scheduler a served engine core builds.

Inert unless ``MAMBA_ALIGN_WITNESS_DIR`` names a folder, where each engine
core writes what the witness found (``witness-<pid>.json``). It touches no
method the mamba_align plugin patches: it attaches to a scheduler at its first
``schedule()`` call, through the instance, so the two load in either order.
"""

from __future__ import annotations

import os
from typing import Any

FOLDER = "MAMBA_ALIGN_WITNESS_DIR"


def register() -> None:
    folder = os.environ.get(FOLDER)
    if not folder:
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, "_witness_engine_registered", False):
        return
    schedule = Scheduler.schedule

    def first_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "schedule" not in vars(self):  # not yet watched
            from witness.served import watch

            watch(self, folder)
            return self.schedule(*args, **kwargs)
        return schedule(self, *args, **kwargs)

    Scheduler.schedule = first_schedule  # type: ignore[method-assign]
    Scheduler._witness_engine_registered = True  # type: ignore[attr-defined]
