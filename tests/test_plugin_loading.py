"""Loading through vLLM's real plugin machinery, in fresh processes."""

from __future__ import annotations

import inspect
import textwrap

import pytest
from helpers import plugins, run_python, scheduler_mode

from vllm_mamba_align import __version__, register
from vllm_mamba_align.plugin import is_patched, patch_scheduler_module
from vllm_mamba_align.subclasses import SCHEDULER_MODULE

# Equal geometry (C == B == 1648), reachable on every release: stock runs the
# 4,000-token prompt's first chunk across two boundaries, mode=full stops at each
# (the default, kept, stops only where vLLM keeps the state: at retention 0,
# where stock ends anyway).
LOAD_AND_START = textwrap.dedent(
    """
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm_mamba_align.plugin import is_patched
    from vllm.v1.core.sched.scheduler import Scheduler
    print("init patched:", is_patched(vars(Scheduler)["__init__"]))
    print("split patched:", is_patched(vars(Scheduler)["_mamba_block_aligned_split"]))
    from vllm_mamba_align.tools.sim import Simulation, Geometry, prompt
    sim = Simulation(Geometry(cache_block=1648, state_block=1648))
    sim.add("a", prompt(4000, 1))
    sim.run()
    print("chunk ends:", sim.chunk_ends("a"))
    """
)


def test_vllm_plugins_naming_mamba_align_activates_it() -> None:
    import vllm

    result = run_python(
        LOAD_AND_START,
        VLLM_PLUGINS=plugins("mamba_align"),
        VLLM_MAMBA_ALIGN_MODE="full",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert "init patched: True" in out
    assert "split patched: True" in out
    assert "chunk ends: [1648, 3296, " in out
    lines = [line for line in out.splitlines() if "vllm-mamba-align" in line]
    assert len(lines) == 1, lines
    assert f"vllm-mamba-align {__version__} on vLLM {vllm.__version__}" in lines[0]
    assert "ACTIVE, mode=full" in lines[0]
    assert "C=1648, Mamba state block B=1648, hash block" in lines[0]
    assert "data-parallel rank" not in lines[0]  # one engine, not a Ray actor
    assert "Unknown vLLM environment variable" not in out


def test_without_a_mode_setting_the_plugin_starts_in_lean_mode() -> None:
    result = run_python(
        LOAD_AND_START, VLLM_PLUGINS=plugins("mamba_align"), VLLM_MAMBA_ALIGN_MODE=""
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    lines = [line for line in out.splitlines() if "vllm-mamba-align" in line]
    assert len(lines) == 1, lines
    assert "ACTIVE, mode=lean: " in lines[0]


def test_our_settings_are_known_to_vllm() -> None:
    result = run_python(
        LOAD_AND_START,
        VLLM_PLUGINS=plugins("mamba_align"),
        VLLM_MAMBA_ALIGN_MODE="grid",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert "ACTIVE, mode=grid" in out
    assert "Unknown vLLM environment variable" not in out


def test_vllm_plugins_naming_only_another_plugin_leaves_vllm_untouched() -> None:
    result = run_python(LOAD_AND_START, VLLM_PLUGINS=plugins("some_other_plugin"))
    assert result.returncode == 0, result.stderr
    assert "init patched: False" in result.stdout
    assert "split patched: False" in result.stdout
    assert "chunk ends: [3296, " in result.stdout
    assert "vllm-mamba-align" not in result.stdout + result.stderr


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_register_works_before_and_after_the_scheduler_import(
    scheduler_first: bool,
) -> None:
    imports = "import vllm.v1.core.sched.scheduler\n"
    code = textwrap.dedent(
        f"""
        {imports if scheduler_first else ""}
        import sys, vllm_mamba_align
        vllm_mamba_align.register()
        print("imported before register:", {scheduler_first})
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm_mamba_align.plugin import is_patched
        print("patched:", is_patched(vars(Scheduler)["__init__"]))
        """
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "patched: True" in result.stdout


def test_register_three_times_wraps_once() -> None:
    import importlib

    module = importlib.import_module(SCHEDULER_MODULE)
    register()
    register()
    register()
    patch_scheduler_module(module)  # even a repeated hook call must not stack
    for name in ("__init__", "_mamba_block_aligned_split"):
        wrapper = vars(module.Scheduler)[name]
        assert is_patched(wrapper)
        assert not is_patched(wrapper.__wrapped__), f"{name} wrapped twice"


def test_importing_the_package_touches_nothing() -> None:
    code = textwrap.dedent(
        """
        import sys
        import vllm_mamba_align
        print("vllm imported:", "vllm" in sys.modules)
        print("torch imported:", "torch" in sys.modules)
        """
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "vllm imported: False" in result.stdout
    assert "torch imported: False" in result.stdout


@pytest.mark.parametrize("mode", ["full", "grid", "off", "audit"])
def test_split_calls_through_the_class_take_the_instance_route(mode: str) -> None:
    """A scheduler's own calls skip the class wrapper; calls through it agree."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt

    stock = vars(Scheduler)["_mamba_block_aligned_split"].__wrapped__
    with scheduler_mode(mode):
        sim = Simulation(Geometry(cache_block=1648, state_block=1648, budget=8192))
    scheduler = sim.scheduler
    request = sim.add("a", prompt(16764, seed=3))
    own = scheduler._mamba_block_aligned_split
    through_class = Scheduler._mamba_block_aligned_split(scheduler, request, 8192)
    assert own(request, 8192) == through_class
    # Nothing to fix: vLLM's own function, no plugin frame (off; grid where
    # C == B and the body needs no added stop, test_decode_shortcut.py).
    vllms_own = hasattr(own, "__func__")
    if mode == "off" or vllms_own:
        assert vllms_own and mode in ("off", "grid")
        assert own.__func__ is stock
        assert through_class == stock(scheduler, request, 8192)
    else:
        assert own is vars(scheduler)["_vllm_mamba_align_split"]
    # The bound route presents itself as vLLM's method, with its parameters.
    for attribute in ("__name__", "__qualname__", "__doc__"):
        assert getattr(own, attribute) == getattr(stock, attribute)
    vllm_parameters = list(inspect.signature(stock).parameters)[1:]
    if vllms_own:
        assert list(inspect.signature(own).parameters) == vllm_parameters
    else:
        assert own.__wrapped__ is stock
        code = own.__code__  # the closure's own parameters, not a signature copy
        assert list(code.co_varnames[: code.co_argcount]) == vllm_parameters
        assert list(inspect.signature(own).parameters) == vllm_parameters
    internal = getattr(scheduler, "mamba_has_prefill_checkpoint_blocks", False)
    if mode == "full" and not internal:  # the fix really ran on both routes
        assert through_class == 1648 != stock(scheduler, request, 8192)


def test_the_start_line_names_the_rank_of_lockstep_engines_and_of_ray_actors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM tags an engine core's lines with its rank (``EngineCore_DP1``) except
    under the Ray backend, where the tag is the actor's class and process id;
    a rank vLLM runs independently has its data-parallel size reset to 1."""
    import sys
    import types

    from vllm_mamba_align.messages import _data_parallel_rank

    def scheduler(size: int, index: int) -> types.SimpleNamespace:
        parallel = types.SimpleNamespace(
            data_parallel_size=size, data_parallel_index=index
        )
        model = types.SimpleNamespace(served_model_name="m")
        return types.SimpleNamespace(
            vllm_config=types.SimpleNamespace(
                parallel_config=parallel, model_config=model
            )
        )

    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert _data_parallel_rank(scheduler(2, 1)) == "; data-parallel rank 1 of 2"
    assert _data_parallel_rank(scheduler(1, 1)) == ""
    actor = types.SimpleNamespace(get_actor_id=lambda: "a1b2")
    ray = types.SimpleNamespace(
        is_initialized=lambda: True, get_runtime_context=lambda: actor
    )
    monkeypatch.setitem(sys.modules, "ray", ray)
    assert _data_parallel_rank(scheduler(1, 1)) == "; data-parallel rank 1"
    assert _data_parallel_rank(scheduler(1, 0)) == "; data-parallel rank 0"
    assert _data_parallel_rank(scheduler(2, 0)) == "; data-parallel rank 0 of 2"
