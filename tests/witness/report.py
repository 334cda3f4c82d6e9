"""Run the witness in every mode, each in a fresh process (``run.py``), and
show the counts side by side: ``python -m witness.report`` with ``tests`` on
``PYTHONPATH``, in an environment where vLLM and the plugin are installed.

A mode is what a user sets: which plugins vLLM loads (``VLLM_PLUGINS``) and
``VLLM_MAMBA_ALIGN_MODE``. Stock is vLLM without the plugin.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

PLUGIN = "mamba_align"
FAULT_PLUGIN = "mamba_align_witness_fault"
"""tests/support/witness_fault_plugin: breaks the plugin on purpose."""
FAULT_SWITCH = "MAMBA_ALIGN_WITNESS_FAULT"
"""The fault plugin acts only where this names a fault (it is installed in
every suite's environment, where vLLM may load every general plugin)."""

MODES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "stock": ((), None),
    "kept": ((PLUGIN,), "kept"),
    "full": ((PLUGIN,), "full"),
    "grid": ((PLUGIN,), "grid"),
    "mode unset": ((PLUGIN,), None),
    "kept, retention model broken": ((PLUGIN, FAULT_PLUGIN), "kept"),
    "unset, split on C's grid": ((PLUGIN, FAULT_PLUGIN), None),
    "unset, no junction stop": ((PLUGIN, FAULT_PLUGIN), None),
    "unset, no replay stop": ((PLUGIN, FAULT_PLUGIN), None),
}
"""Mode -> (general plugins vLLM loads, VLLM_MAMBA_ALIGN_MODE or None: unset)."""

FAULTS = {
    "kept, retention model broken": "retention",
    "unset, split on C's grid": "cache-grid",
    "unset, no junction stop": "no-junction-stop",
    "unset, no replay stop": "no-replay-stop",
}
"""Mode -> the fault it switches on (``MAMBA_ALIGN_WITNESS_FAULT``)."""
PUBLISHING_FAULTS = (
    "unset, split on C's grid",
    "unset, no junction stop",
    "unset, no replay stop",
)
"""Faults that make the plugin publish wrong states (the other one loses kept
states)."""

FIXING = ("kept", "full", "grid", "mode unset")
MATERIALIZING = ("kept", "full", "mode unset")
"""Modes that also write every state vLLM keeps (``grid`` ends chunks on the
grid only: it may run past a kept boundary)."""

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def run_mode(mode: str) -> dict[str, dict[str, Any]]:
    """Every workload's findings and events in ``mode`` (one process)."""
    plugins, chosen = MODES[mode]
    platform = os.environ.get("MAMBA_ALIGN_TEST_PLATFORM_PLUGINS", "")
    env = dict(os.environ)
    env["VLLM_PLUGINS"] = ",".join(p for p in (*plugins, *platform.split(",")) if p)
    env.pop("VLLM_MAMBA_ALIGN_MODE", None)
    env.pop(FAULT_SWITCH, None)
    if mode in FAULTS:
        env[FAULT_SWITCH] = FAULTS[mode]
    if chosen is not None:
        env["VLLM_MAMBA_ALIGN_MODE"] = chosen
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (TESTS, env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    done = subprocess.run(
        [sys.executable, "-m", "witness.run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=TESTS,
    )
    lines = [
        json.loads(line.removeprefix("WITNESS "))
        for line in done.stdout.splitlines()
        if line.startswith("WITNESS ")
    ]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"the witness failed in mode {mode!r} (exit {done.returncode}):\n"
            f"{done.stderr[-4000:]}"
        )
    return {line["workload"]: line for line in lines}


COLUMNS = (
    ("wrong pub", "findings", "wrong_publications"),
    ("pub", "findings", "publications"),
    ("wrong read", "findings", "wrong_reads"),
    ("reads", "findings", "reads"),
    ("lost kept", "findings", "lost_kept_states"),
    ("ckpt written", "findings", "backend_checkpoints"),
    ("preempt", "events", "preemptions"),
    ("prio preempt", "events", "priority_preemptions"),
    ("abort prefill", "events", "aborts_in_prefill"),
    ("abort decode", "events", "aborts_in_decode"),
    ("hits", "events", "cache_hits"),
    ("draft steps", "findings", "draft_steps"),
    ("drafts rejected", "findings", "drafts_rejected"),
)


def table(modes: tuple[str, ...]) -> str:
    """One row per workload and mode."""
    results = {mode: run_mode(mode) for mode in modes}
    width = max(len("workload"), *(len(name) for name in results[modes[0]]))
    header = f"{'workload':<{width}} {'mode':<30} " + " ".join(
        f"{name:>{len(name)}}" for name, _, _ in COLUMNS
    )
    rows = [header]
    for workload in results[modes[0]]:
        for mode in modes:
            line = results[mode][workload]
            cells = " ".join(
                f"{line[part][key]:>{len(name)}}" for name, part, key in COLUMNS
            )
            rows.append(f"{workload:<{width}} {mode:<30} {cells}")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(tuple(MODES)))
