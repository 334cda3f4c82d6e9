"""What ``doctor`` says about one process of a distributed deployment.

The plugin runs inside every engine core and reads the environment of the
process that starts it. Two of vLLM's topologies start engine cores away from
the API server, and ``doctor`` cannot tell from a process that it is one of
them, so the operator names it (``doctor --headless``, ``doctor --ray``):

- a node started ``vllm serve --headless``: its engine cores read that node's
  environment only, and no API server runs there, so the audit's series reach
  no ``/metrics`` (tests/e2e/test_distributed.py runs this);
- the Ray backend (``--data-parallel-backend ray``): engine cores are Ray
  actors, whose environment is what vLLM copies from the launching process
  (``vllm.ray.ray_env.get_env_vars_to_copy``, asked here as vLLM asks it), and
  which vLLM places on the platform's Ray device (``ray_device_key``): a
  platform that names none cannot place them at all (vLLM's CPU platform;
  tests/e2e/test_ray_dp.py runs the backend with a test-only key).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

PLUGIN_PREFIX = "VLLM_MAMBA_ALIGN_"
PROMETHEUS_DIRECTORY = "PROMETHEUS_MULTIPROC_DIR"
RAY_ACTOR = "EngineCoreActor"
"""The destination vLLM's ``CoreEngineActorManager`` names when it copies the
environment into an engine core's Ray runtime environment."""


def headless_lines(mode: str | None, setting_errors: Iterable[str]) -> list[str]:
    """A ``vllm serve --headless`` node, judged from this process's environment."""
    errors = list(setting_errors)
    engines = (
        f"mode {mode}"
        if mode is not None and not errors
        else "none: a setting stops them (see the verdict)"
    )
    lines = [
        "headless node (--headless): this node's engine cores load the plugin "
        f"from this environment, not the head's ({engines}): set VLLM_PLUGINS "
        "and VLLM_MAMBA_ALIGN_* on every node",
        "no API server runs on a headless node, so the audit's series reach no "
        "/metrics whatever the metrics line says; this node's engine cores log "
        "their figures (the plugin's summary lines) in this node's log",
    ]
    if errors:
        lines.append(
            "a refused setting stops this node; it first sends the refusal to "
            "the head (waiting up to 60 s for the head to listen), whose "
            "startup then stops with this message in its log; a head that "
            "starts later waits for this rank without a bound, so read this "
            "node's log"
        )
    return lines


def _copied_to_ray_actors() -> set[str] | None:
    """The variables vLLM copies into an engine-core actor (None: this vLLM has
    no such function)."""
    try:
        from vllm.ray.ray_env import get_env_vars_to_copy
    except ImportError:
        return None
    try:
        from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS
    except ImportError:
        excluded: set[str] = set()
    else:
        excluded = set(WORKER_SPECIFIC_ENV_VARS)
    return set(get_env_vars_to_copy(exclude_vars=excluded, destination=RAY_ACTOR))


def _ray_device_key() -> str | None:
    """The current platform's Ray device (None: unknown)."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # doctor's platform line reports why
        return None
    key = getattr(current_platform, "ray_device_key", None)
    return key if isinstance(key, str) else None


def ray_lines(platform: str | None) -> list[str]:
    """The Ray data-parallel backend, launched from this process."""
    copied = _copied_to_ray_actors()
    ours = sorted(
        name
        for name in os.environ
        if name == "VLLM_PLUGINS" or name.startswith(PLUGIN_PREFIX)
    )
    if copied is None:
        lines = [
            "Ray backend (--ray): this vLLM has no vllm.ray.ray_env, so which "
            "variables reach the engine-core actors is unknown: set VLLM_PLUGINS "
            "and VLLM_MAMBA_ALIGN_* in every Ray node's environment"
        ]
    else:
        reach = [name for name in ours if name in copied]
        missing = [name for name in ours if name not in copied]
        lines = [
            "Ray backend (--ray): engine cores run as Ray actors; vLLM copies "
            "this process's "
            + (", ".join(reach) if reach else "(no plugin variable is set here)")
            + " into their environment"
            + (
                f", but not {', '.join(missing)}: set those on every Ray node"
                if missing
                else ""
            )
            + "; the plugin must be installed in every Ray node's Python",
            f"{PROMETHEUS_DIRECTORY} is "
            + ("copied" if PROMETHEUS_DIRECTORY in copied else "not copied")
            + " to the actors: the audit's series written there reach no "
            "/metrics; each engine core logs its figures (the plugin's summary "
            "lines), which Ray forwards to this process's output",
            "Ray folds lines that differ only in numbers across actors "
            '("[repeated 1x across cluster]"), the plugin\'s start and audit '
            "lines of the ranks among them: set RAY_DEDUP_LOGS=0 here to see "
            "each rank's (each start line ends with its data-parallel rank)",
        ]
    key = _ray_device_key()
    if key == "":
        lines.append(
            f"[!!] vLLM's {platform or 'current'} platform names no Ray device "
            "(ray_device_key is empty): vLLM cannot place data-parallel engine "
            "cores on a Ray cluster here (create_dp_placement_groups fails "
            "before any engine starts); use the default multiprocessing backend"
        )
    elif key is not None:
        lines.append(
            f"vLLM places each engine core on Ray resources named {key!r} "
            f"(the {platform or 'current'} platform's ray_device_key)"
        )
    return lines
