"""The serving path stays apart from the tools: it never imports them.

``register()``, a real scheduler built and started with the plugin active, and a
``schedule()`` step must not import ``vllm_mamba_align.tools`` (sim, modes,
simulate), the probe, ``doctor`` or the CLI. The test builds its scheduler with
the tools, then removes them from ``sys.modules`` and blocks their names, so any
import of them from the serving path fails loudly, and it records every package
module imported from then on.
"""

from __future__ import annotations

import textwrap

import pytest
from helpers import run_python

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
