"""The serving path stays apart from the tools, and a lean scheduler's process
loads only the fix.

``register()``, a real scheduler built and started with the plugin active, and a
``schedule()`` step must not import ``vllm_mamba_align.tools`` (sim, modes,
simulate), the probe, ``doctor`` or the CLI. The first test builds its scheduler
with the tools, then removes them from ``sys.modules`` and blocks their names,
so any import of them from the serving path fails loudly, and it records every
package module imported from then on.

The others read what ``python -m maintainers.serving_path --loaded`` measures:
the package modules in ``sys.modules`` after ``register()`` and a real lean
scheduler's start, in a fresh process whose tools left before the plugin loaded
(maintainers/serving_path.py).
"""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
from helpers import run_python

from maintainers import serving_path

CHILD = textwrap.dedent(
    """
    import sys
    import vllm_mamba_align
    from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt

    APART = ("vllm_mamba_align.tools", "vllm_mamba_align.doctor",
             "vllm_mamba_align.cli", "vllm_mamba_align.__main__",
             "vllm_mamba_align.probe")
    for name in [n for n in sys.modules if n.startswith(APART)]:
        del sys.modules[name]
    for name in (*APART, "vllm_mamba_align.tools.sim",
                 "vllm_mamba_align.tools.modes", "vllm_mamba_align.tools.simulate"):
        sys.modules[name] = None  # importing it now raises ImportError
    del vllm_mamba_align.tools

    imported = []

    class Recorder:
        def find_spec(self, name, path=None, target=None):
            if name.startswith("vllm_mamba_align"):
                imported.append(name)
            return None

    sys.meta_path.insert(0, Recorder())
    vllm_mamba_align.register()
    sim = Simulation(Geometry(cache_block=1648, state_block=1648))
    sim.add("a", prompt(5000, 1))
    sim.step()
    route = vars(sim.scheduler).get("_vllm_mamba_align_split")
    print("route bound:", route is not None)
    print("imported:", sorted(set(imported)))
    loaded = [n for n, m in sys.modules.items() if n.startswith(APART) and m]
    print("apart loaded:", loaded)
    """
)


@pytest.mark.parametrize("mode", ["full", "audit"])
def test_register_and_a_running_scheduler_import_no_tool(mode: str) -> None:
    result = run_python(CHILD, VLLM_MAMBA_ALIGN_MODE=mode)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "route bound: True" in out, out
    assert "apart loaded: []" in out, out
    imported = next(line for line in out.splitlines() if line.startswith("imported:"))
    for apart in ("tools", "doctor", "cli", "probe"):
        assert f"vllm_mamba_align.{apart}" not in imported, imported


APART_FROM_A_LEAN_START = {
    "audit": "audit mode's observers",
    "headless": "a refusal told to a headless node's head",
    "defects": "the hazard table, for a drafter with async scheduling only",
    "worker_seed": "the worker's re-seed, where vLLM's worker module is imported",
    "subclass_code": "the reader of another distribution's scheduler subclass",
    "refusals": "the refusals' words, loaded only to refuse",
    "batch_invariance": "the batch-invariance readers, when VLLM_BATCH_INVARIANT is on",
    "unverified": "the readers of opted-in unverified split code",
    "protocols": "typing protocols, read by type checkers only",
    "tools": "the operator's simulation",
    "probe": "the operator's probe",
    "doctor": "the operator's report",
    "cli": "the command line",
    "__main__": "the command line",
    "topology": "doctor's deployment notes",
}
"""Package modules a lean scheduler's process must not load, and what they are for."""
LOADED_CODE_LINES = 2800
"""Issue 66's bound on the code lines a lean scheduler's process loads."""


@pytest.fixture(scope="module")
def lean_start() -> dict[str, Any]:
    """What ``register()`` and a lean scheduler's start loaded (one process)."""
    result = run_python(serving_path.LEAN_START, VLLM_MAMBA_ALIGN_MODE="lean")
    assert result.returncode == 0, result.stderr
    return serving_path.loaded_record(result.stdout)


def test_the_measure_sees_the_fix_a_lean_scheduler_binds(
    lean_start: dict[str, Any],
) -> None:
    """The control: the process bound the fix, and the measure sees it."""
    assert lean_start["fixing"], lean_start
    assert {
        "vllm_mamba_align.plugin",
        "vllm_mamba_align.activation",
        "vllm_mamba_align.split",
    } <= set(lean_start["modules"])


@pytest.mark.parametrize("apart", list(APART_FROM_A_LEAN_START))
def test_a_lean_scheduler_loads_only_the_fix(
    lean_start: dict[str, Any], apart: str
) -> None:
    loaded = [m for m in lean_start["modules"] if m.split(".")[1:2] == [apart]]
    assert loaded == [], f"{loaded}: {APART_FROM_A_LEAN_START[apart]}"


def test_a_lean_scheduler_loads_at_most_2800_code_lines(
    lean_start: dict[str, Any],
) -> None:
    modules = serving_path.measure(list(lean_start["modules"]))
    total = serving_path.totals(modules)["code_lines"]
    assert total <= LOADED_CODE_LINES, serving_path.summary(modules)
