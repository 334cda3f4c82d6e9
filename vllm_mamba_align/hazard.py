"""The start line's warning about vLLM's own defects (defects.py) that corrupt
output with this engine's settings, where a setting avoids them.

Why apart from activation.py: one call there, a few cheap attribute reads
here, and the defects table is imported only when a drafter and async
scheduling are both configured (the only settings its start-time rows need),
never on a step.
"""

from __future__ import annotations

from typing import Any

_warned: set[str] = set()
"""Defects already warned about in this process (one warning each)."""


def warn_known_defects(
    scheduler: Any, version: str | None, logger: Any, state_grid: int | None
) -> None:
    """Warn once per defect when this align-mode engine (``state_grid`` not
    None) runs a combination known to corrupt output that a setting avoids."""
    config = getattr(scheduler, "vllm_config", None)
    drafter = getattr(config, "speculative_config", None)
    asynchronous = getattr(
        getattr(config, "scheduler_config", None), "async_scheduling", False
    )
    if state_grid is None or drafter is None or not asynchronous:
        return
    from . import defects

    setting = defects.Setting(
        version,
        _runner(config, version),
        True,
        str(getattr(drafter, "method", "") or "drafter"),
    )
    for defect in defects.strict_failures(setting):
        if defect.key not in _warned:
            _warned.add(defect.key)
            logger.warning("%s", defects.start_warning(defect))


def _runner(config: Any, version: str | None) -> str | None:
    """The runner this engine's workers build: vLLM's own decision where its
    config has one (0.27.1-0.33.0), else the release's only runner."""
    from . import defects

    try:
        uses_v2 = getattr(config, "use_v2_model_runner", None)
    except Exception:  # vLLM's property may raise on settings it refuses
        uses_v2 = None
    if isinstance(uses_v2, bool):
        return defects.V2 if uses_v2 else defects.V1
    return defects.default_runner(version, None)
