"""Another plugin's code in the split vLLM calls: refused by name, never run
inside the fix, left unchanged in mode off.

The other plugin is ``tests/support/foreign_split_plugin`` (distribution
``vllm-test-foreign-split``), installed in the test environments and loaded by
vLLM's own plugin machinery in a fresh interpreter: a ``functools.wraps``
wrapper installed by its platform before the general plugins load (as
vllm-ascend's users get it) or in ``pre_register_and_update`` after them, a
plain wrapt wrapper from its general plugin, and a subclass of
``AsyncScheduler`` with its own split (as vllm-gaudi's ``HPUAsyncScheduler``).

The judge reads the class attributes itself (types, code files, ``__wrapped__``)
and the stand-in's own call counts, never the plugin's layer walk.
"""

from __future__ import annotations

import importlib.util
import json
import os
import textwrap

import pytest
from helpers import cache_block_for, run_python

from vllm_mamba_align import __version__

if importlib.util.find_spec("vllm_test_foreign_split") is None:
    # A nox release session (vLLM installed) installs it; the unit session
    # (no vLLM) collects this module and skips it.
    vllm = importlib.util.find_spec("vllm") is not None
    if vllm and os.environ.get("MAMBA_ALIGN_WHEEL"):
        raise RuntimeError("tests/support/foreign_split_plugin is not installed")
    pytest.skip(
        "pip install tests/support/foreign_split_plugin", allow_module_level=True
    )

WAY = "MAMBA_ALIGN_TEST_FOREIGN_SPLIT"
STAND_IN = "distribution vllm-test-foreign-split 0.1.0"
PATCHES = "module vllm_test_foreign_split.patches"
# vLLM 0.33.0 consults platform plugins only when the target is not "cpu".
PLATFORM_TARGET = {"VLLM_TARGET_DEVICE": "cuda"}

# Everything vLLM builds, then a snapshot of what the plugin could have patched,
# then a hybrid scheduler; then the class attribute as the judge reads it.
START = """
import json, types
import vllm_test_foreign_split.patches as patches
from vllm_mamba_align import MambaAlignError
from vllm_mamba_align.tools.sim import Geometry, Simulation, build_scheduler, prompt
{prepare}
build_scheduler(Geometry(cache_block=1648, state_block=1648, hybrid=False))
print("non-hybrid started")
import vllm.v1.core.sched.scheduler as module
SPLIT = "_mamba_block_aligned_split"
# The classes from the one vLLM builds down to vLLM's own Scheduler.
CLASSES = []
for klass in module.Scheduler.__mro__:
    CLASSES.append(klass)
    if klass.__module__ == module.__name__ and klass.__name__ == "Scheduler":
        break
print("scheduler classes:", ",".join(k.__qualname__ for k in CLASSES))
def sites():
    return [
        id(vars(klass).get(name)) for klass in CLASSES for name in ("__init__", SPLIT)
    ] + [id(getattr(module, "is_mamba_prefill_checkpoint_valid", None))]
before = sites()
try:
    sim = Simulation(Geometry(cache_block={cache_block}, state_block=1648{geometry}))
except MambaAlignError as error:
    print("refused:", error)
else:
    sim.add("a", prompt({length}, 1))
    sim.run()
    print("started, chunk ends:", sim.chunk_ends("a"))
    print("bound by the plugin:", "_vllm_mamba_align_split" in vars(sim.scheduler))
print("sites unchanged:", sites() == before)
from vllm_mamba_align.plugin import split_wrapper
def describe(layer):
    wrapper = getattr(layer, "_self_wrapper", None)  # a wrapt wrapper's function
    if wrapper is not None:
        names = [(split_wrapper, "mamba_align"), (patches.counting_wrapper, "stand-in")]
        return next((name for known, name in names if wrapper is known), "?")
    if type(layer) is not types.FunctionType:
        return "?"
    for folder, name in (
        ("vllm_test_foreign_split/patches.py", "stand-in"),
        ("vllm_test_foreign_split/swap.py", "stand-in"),
        ("vllm/v1/core/sched/scheduler.py", "vllm"),
    ):
        if layer.__code__.co_filename.endswith(folder):
            return name
    return "?"
owner = next(klass for klass in CLASSES if SPLIT in vars(klass))
print("split defined by:", owner.__qualname__)
chain, layer = [], vars(owner)[SPLIT]
while layer is not None:
    chain.append(describe(layer))
    layer = getattr(layer, "__wrapped__", None)
print("chain:", ",".join(chain))
print("calls:", json.dumps(dict(patches.CALLS)))
"""


def start(
    way: str | None,
    mode: str,
    prepare: str = "",
    geometry: str = "",
    cache_block: int = 1648,
    length: int = 5000,
    **env: str,
):  # type: ignore[no-untyped-def]
    code = START.format(
        prepare=textwrap.dedent(prepare),
        geometry=geometry,
        cache_block=cache_block,
        length=length,
    )
    result = run_python(code, **{WAY: way or ""}, VLLM_MAMBA_ALIGN_MODE=mode, **env)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout + result.stderr
    assert "non-hybrid started" in out, "models without align split are never blocked"
    return out


def line(out: str, prefix: str) -> str:
    return next(x for x in out.splitlines() if x.startswith(prefix))


def calls(out: str) -> dict[str, int]:
    return json.loads(line(out, "calls: ").removeprefix("calls: "))  # type: ignore[no-any-return]


def assert_refused(out: str) -> str:
    """The refusal; nothing started, nothing the plugin installs was changed."""
    assert "ACTIVE" not in out
    assert "started, chunk ends" not in out
    assert "sites unchanged: True" in out
    refusal = line(out, "refused: ")
    for way_out in (
        f"refused: vllm-mamba-align {__version__}: ",
        "set VLLM_MAMBA_ALIGN_MODE=off: the plugin binds nothing on this scheduler "
        "and that split runs unchanged",
        "leave mamba_align out of VLLM_PLUGINS",
        "`vllm-mamba-align doctor --json`",
        "NOT VERIFIED",
    ):
        assert way_out in refusal
    return refusal


def assert_runs_unchanged(out: str, layer: str) -> None:
    """Mode off: the other plugin's layer ran, the plugin bound nothing."""
    assert "ACTIVE" not in out
    assert "started, chunk ends" in out
    assert "bound by the plugin: False" in out
    assert calls(out).get(layer, 0) > 0, "the other plugin's split ran"
    (start_line,) = [
        x for x in out.splitlines() if "vllm-mamba-align" in x and "inactive" not in x
    ]
    assert "mode=off (the split runs unchanged, with layers the plugin has not " in (
        start_line
    )


WRAPPER = "wrap_with_functools.<locals>.split_keeping_verifier_width"


def test_a_wrapper_installed_before_the_plugin_is_refused_by_name() -> None:
    """vllm-ascend's order: its platform patches the class before general
    plugins load; the wrapper reads as vLLM's body to inspect.getsource."""
    out = start("wraps-at-platform", "kept", **PLATFORM_TARGET)
    assert "chain: stand-in,vllm" in out, "the plugin wrapped nothing over it"
    refusal = assert_refused(out)
    assert (
        "another plugin patched vLLM's Scheduler._mamba_block_aligned_split with "
        f"code the plugin has not verified ({STAND_IN})"
    ) in refusal
    assert f"1. functools.wraps wrapper {WRAPPER.split('.')[-1]}" in refusal or (
        f"1. functools.wraps wrapper {WRAPPER}" in refusal  # 3.11+: co_qualname
    )
    assert f"({PATCHES}, {STAND_IN}; " in refusal
    assert "the class attribute of vllm.v1.core.sched.scheduler.Scheduler" in refusal
    assert "NOT VERIFIED, installed before this plugin loaded" in refusal
    assert "vLLM's own function, split body" in refusal
    assert calls(out) == {}, "the wrapper never ran"


def test_a_wrapper_installed_after_the_plugin_is_refused_by_name() -> None:
    """The platform's pre_register_and_update patches after the general plugins
    loaded (vLLM's EngineArgs order): it wraps the plugin's wrapper."""
    out = start("wraps-at-pre-register", "kept", **PLATFORM_TARGET)
    assert "chain: stand-in,mamba_align,vllm" in out
    refusal = assert_refused(out)
    assert f"({PATCHES}, {STAND_IN}; " in refusal
    assert (
        "NOT VERIFIED, installed after this plugin loaded, around this plugin's wrapper"
    ) in refusal
    assert "2. wrapt wrapper split_wrapper (module vllm_mamba_align.plugin" in refusal
    assert calls(out) == {}


@pytest.mark.parametrize("mode", ["full", "audit"])
def test_every_fixing_and_counting_mode_refuses(mode: str) -> None:
    out = start("wraps-at-platform", mode, **PLATFORM_TARGET)
    assert_refused(out)


def test_a_plain_wrapt_wrapper_by_another_general_plugin_is_refused() -> None:
    """The order is vLLM's entry-point order; the refusal names the one found."""
    out = start("wrapt-at-general", "kept")
    refusal = assert_refused(out)
    chain = line(out, "chain: ")
    assert chain in ("chain: stand-in,vllm", "chain: stand-in,mamba_align,vllm")
    order = (
        "installed before this plugin loaded"
        if chain == "chain: stand-in,vllm"
        else "installed after this plugin loaded, around this plugin's wrapper"
    )
    assert f"1. wrapt wrapper counting_wrapper ({PATCHES}, {STAND_IN}; " in refusal
    assert f"NOT VERIFIED, {order}" in refusal


SUBCLASS = """
import vllm.v1.core.sched.async_scheduler as async_module
from vllm_test_foreign_split.scheduler import ForeignAsyncScheduler
async_module.AsyncScheduler = ForeignAsyncScheduler
"""


def _async_scheduler_or_skip() -> None:
    pytest.importorskip("vllm.v1.core.sched.async_scheduler")


def test_a_subclass_override_is_refused_by_name() -> None:
    """vllm-gaudi's shape: an AsyncScheduler subclass with its own split."""
    _async_scheduler_or_skip()
    out = start(None, "kept", SUBCLASS, ", async_scheduling=True")
    refusal = assert_refused(out)
    assert (
        "ForeignAsyncScheduler overrides _mamba_block_aligned_split with code the "
        f"plugin has not verified ({STAND_IN})"
    ) in refusal
    assert "module vllm_test_foreign_split.scheduler" in refusal
    assert "NOT VERIFIED, a subclass's own method" in refusal
    assert calls(out) == {}


@pytest.mark.parametrize(
    ("way", "layer", "env"),
    [
        ("wraps-at-platform", "wraps", PLATFORM_TARGET),
        ("wraps-at-pre-register", "wraps", PLATFORM_TARGET),
        ("wrapt-at-general", "wrapt", {}),
    ],
)
def test_mode_off_runs_the_other_plugins_split_unchanged(
    way: str, layer: str, env: dict[str, str]
) -> None:
    out = start(way, "off", **env)
    assert "refused:" not in out
    assert_runs_unchanged(out, layer)


def test_mode_off_runs_a_subclass_override_unchanged() -> None:
    _async_scheduler_or_skip()
    out = start(None, "off", SUBCLASS, ", async_scheduling=True")
    assert "refused:" not in out
    assert_runs_unchanged(out, "override")


DOCTOR = """
import contextlib, io, json
from vllm_mamba_align.cli import main
from vllm_mamba_align import MambaAlignError
from vllm_mamba_align.tools.sim import Geometry, build_scheduler
output = io.StringIO()
with contextlib.redirect_stdout(output):
    code = main(["doctor", "--json"])
print("exit:", code)
print("report:", json.dumps(json.loads(output.getvalue())))
try:
    build_scheduler(Geometry(cache_block=1648, state_block=1648))
except MambaAlignError as error:
    print("refused:", error)
"""


@pytest.mark.parametrize(
    ("way", "order"),
    [
        ("wraps-at-platform", "installed before this plugin loaded"),
        (
            "wraps-at-pre-register",
            "installed after this plugin loaded, around this plugin's wrapper",
        ),
    ],
)
def test_doctor_reports_the_other_plugins_layer(way: str, order: str) -> None:
    """doctor loads the platform and plugins as vLLM does, finds the same
    layers, and says exactly what the scheduler's start then says."""
    result = run_python(DOCTOR, **{WAY: way}, **PLATFORM_TARGET)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(line(result.stdout, "report: ").removeprefix("report: "))
    assert line(result.stdout, "exit: ") == "exit: 1"
    assert report["platform"] == "vllm_test_foreign_split.platform.ForeignCpuPlatform"
    assert report["split_foreign"] is True
    outer = report["split_layers"][0]
    assert outer["module"] == "vllm_test_foreign_split.patches"
    assert outer["distribution"] == "vllm-test-foreign-split 0.1.0"
    assert outer["kind"] == "functools.wraps wrapper"
    assert outer["order"] == order
    assert report["split_layers"][-1]["role"] == "vLLM's own function"
    assert report["would_refuse"] is True
    refusal = line(result.stdout, "refused: ").removeprefix("refused: ")
    assert report["refusal"] == refusal


def test_doctor_in_mode_off_says_the_split_starts_unchanged() -> None:
    result = run_python(
        DOCTOR,
        **{WAY: "wraps-at-platform"},
        **PLATFORM_TARGET,
        VLLM_MAMBA_ALIGN_MODE="off",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(line(result.stdout, "report: ").removeprefix("report: "))
    assert line(result.stdout, "exit: ") == "exit: 0"
    assert report["split_foreign"] is True
    assert report["would_refuse"] is False
    assert "refused:" not in result.stdout


def test_the_stand_in_is_inert_unless_asked() -> None:
    """Installed in every release environment, it must change nothing there."""
    out = start(None, "kept")
    assert "chain: mamba_align,vllm" in out
    assert "started, chunk ends" in out
    assert "bound by the plugin: True" in out
    assert calls(out) == {}


# vllm-ascend's platform patches put BalanceScheduler, a subclass of vLLM's
# Scheduler that inherits the split and has a copied schedule(), in the module's
# place; 0.30.0rc2 wraps the split first. The stand-in does the same
# (tests/support/foreign_split_plugin/vllm_test_foreign_split/swap.py), at
# platform resolution (before the general plugins load) or in
# pre_register_and_update (after).
SWAPPED = "SwappedScheduler (module vllm_test_foreign_split.swap, " + STAND_IN + ")"
WHEN = ["platform", "pre-register"]
B = 1648
# A prompt whose first chunk ends at 2 B with the fix and on the C grid past it
# in stock vLLM (C < B where the release starts one).
LENGTH = 4200


def c_below_b() -> int:
    return cache_block_for(B)


def start_swapped(way: str, mode: str, geometry: str = "") -> str:
    """A start over a swapped-in subclass, with C < B and :data:`LENGTH`."""
    return start(  # type: ignore[no-any-return]
        way,
        mode,
        geometry=geometry,
        cache_block=c_below_b(),
        length=LENGTH,
        **PLATFORM_TARGET,
    )


def first_chunk_on_state_grid(out: str) -> bool:
    return chunk_ends(out)[0] % B == 0


def chunk_ends(out: str) -> list[int]:
    return json.loads(line(out, "started, chunk ends: ").split(": ", 1)[1])  # type: ignore[no-any-return]


def start_line(out: str) -> str:
    (found,) = [
        x
        for x in out.splitlines()
        if f"vllm-mamba-align {__version__} on vLLM" in x and "inactive" not in x
    ]
    return found


def assert_never_blames_vllm(out: str) -> None:
    """vLLM's own function is never called unverified or an override."""
    assert "unverified split" not in out
    assert "overrides _mamba_block_aligned_split" not in out
    assert "(distribution vllm 0." not in out.replace(
        "function Scheduler._mamba_block_aligned_split (module "
        "vllm.v1.core.sched.scheduler, distribution vllm 0.",
        "",
    )


@pytest.mark.parametrize("when", WHEN)
def test_a_swapped_in_subclass_that_inherits_the_split_runs_the_fix(
    when: str,
) -> None:
    """The split is vLLM's own function, reached through inheritance; the
    subclass's copied schedule() calls it with vLLM's arguments: the fix runs
    inside the subclass, and the start line names it."""
    out = start_swapped(f"swap-at-{when}", "kept")
    assert "scheduler classes: SwappedScheduler,Scheduler" in out
    assert "split defined by: Scheduler" in out, "the subclass inherits vLLM's split"
    assert "chain: mamba_align,vllm" in out
    assert "sites unchanged: True" in out
    assert "refused:" not in out
    found = start_line(out)
    assert "ACTIVE, mode=kept" in found
    assert f"scheduler class {SWAPPED}, a subclass of vLLM's Scheduler" in found
    assert "split body " in found
    assert calls(out).get("schedule", 0) > 0, "the subclass's schedule() ran"
    assert first_chunk_on_state_grid(out), chunk_ends(out)
    assert_never_blames_vllm(out)


def test_stock_chunks_in_the_swapped_in_subclass_are_off_the_state_grid() -> None:
    """Mode off: the same subclass schedules as stock vLLM (chunks end on the C
    grid), so the fix's chunk ends above are the fix's doing."""
    out = start_swapped("swap-at-platform", "off")
    if c_below_b() < B:
        assert not first_chunk_on_state_grid(out), chunk_ends(out)
    assert calls(out).get("schedule", 0) > 0
    found = start_line(out)
    assert "mode=off (stock vLLM split)" in found
    assert f"scheduler class {SWAPPED}" in found
    assert "NOT VERIFIED" not in out and "not verified" not in found
    assert_never_blames_vllm(out)


def test_the_audit_starts_inside_the_swapped_in_subclass() -> None:
    """The audit's schedule() observer calls the subclass's schedule()."""
    out = start_swapped("swap-at-platform", "audit")
    found = start_line(out)
    assert "AUDIT, mode=audit" in found
    assert f"scheduler class {SWAPPED}" in found
    assert calls(out).get("schedule", 0) > 0
    assert_never_blames_vllm(out)


def test_an_async_scheduler_built_on_the_swapped_in_subclass_runs_the_fix() -> None:
    """vLLM's AsyncScheduler, imported after the swap, subclasses the swapped-in
    class: the fix runs there too, and the start line names both."""
    _async_scheduler_or_skip()
    out = start_swapped("swap-at-platform", "kept", ", async_scheduling=True")
    found = start_line(out)
    assert "ACTIVE, mode=kept" in found
    assert f"scheduler class AsyncScheduler (vLLM's), built on {SWAPPED}" in found
    assert calls(out).get("schedule", 0) > 0
    assert first_chunk_on_state_grid(out), chunk_ends(out)


@pytest.mark.parametrize(
    ("when", "order"),
    [
        ("platform", "installed before this plugin loaded"),
        (
            "pre-register",
            "installed after this plugin loaded, around this plugin's wrapper",
        ),
    ],
)
def test_a_split_wrapper_then_the_swap_is_refused_naming_only_the_wrapper(
    when: str, order: str
) -> None:
    """vllm-ascend 0.30.0rc2's order: the wrapper is the one unverified layer;
    vLLM's function below it is vLLM's own, inherited, not an override."""
    out = start(f"wraps-swap-at-{when}", "kept", **PLATFORM_TARGET)
    assert "split defined by: Scheduler" in out
    refusal = assert_refused(out)
    assert (
        "another plugin patched vLLM's Scheduler._mamba_block_aligned_split with "
        f"code the plugin has not verified ({STAND_IN})"
    ) in refusal
    assert f"The split a {SWAPPED} calls" in refusal
    assert refusal.count("NOT VERIFIED") == 1
    assert f"({PATCHES}, {STAND_IN}; " in refusal
    assert f"NOT VERIFIED, {order}" in refusal
    assert "inherited by SwappedScheduler" in refusal
    assert "vLLM's own function, split body" in refusal
    assert calls(out) == {}
    assert_never_blames_vllm(out)


def test_mode_off_names_only_the_wrapper_as_unverified() -> None:
    out = start("wraps-swap-at-platform", "off", **PLATFORM_TARGET)
    assert_runs_unchanged(out, "wraps")
    found = start_line(out)
    assert "split body " in found
    assert f"scheduler class {SWAPPED}" in found
    unverified = found.split("layers the plugin has not verified: ")[1]
    assert unverified.startswith("functools.wraps wrapper ")
    assert "vllm.v1.core.sched.scheduler" not in unverified
    assert_never_blames_vllm(out)


def test_a_swapped_in_subclass_overriding_the_split_is_refused_by_name() -> None:
    out = start("override-swap-at-platform", "kept", **PLATFORM_TARGET)
    assert "split defined by: OverridingScheduler" in out
    refusal = assert_refused(out)
    assert (
        "OverridingScheduler overrides _mamba_block_aligned_split with code the "
        f"plugin has not verified ({STAND_IN})"
    ) in refusal
    assert "NOT VERIFIED, a subclass's own method" in refusal
    assert calls(out) == {}


def test_a_swapped_in_subclass_passing_other_arguments_is_refused_by_name() -> None:
    """Its schedule() calls the split with arguments vLLM's never passes: the
    plugin cannot know what those calls mean, so it starts nothing there."""
    out = start_swapped("altered-swap-at-platform", "kept")
    assert "ACTIVE" not in out
    assert "started, chunk ends" not in out
    assert "sites unchanged: True" in out
    refusal = line(out, "refused: ")
    assert f"the scheduler vLLM builds is {SWAPPED}, a subclass of vLLM's" in refusal
    assert "SwappedScheduler.schedule (line " in refusal
    assert "with arguments none of vLLM's calls pass" in refusal
    assert "set VLLM_MAMBA_ALIGN_MODE=off" in refusal
    assert "`vllm-mamba-align doctor --json`" in refusal
    assert calls(out) == {}
    assert_never_blames_vllm(out)


DOCTOR_TEXT = """
from vllm_mamba_align.doctor import collect, render_text
print(render_text(collect()))
"""


@pytest.mark.parametrize("way", ["swap-at-platform", "wraps-swap-at-platform"])
def test_doctor_names_the_swapped_in_subclass(way: str) -> None:
    result = run_python(DOCTOR + DOCTOR_TEXT, **{WAY: way}, **PLATFORM_TARGET)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(line(result.stdout, "report: ").removeprefix("report: "))
    assert report["scheduler_class"] == "vllm_test_foreign_split.swap.SwappedScheduler"
    assert report["scheduler_class_note"].startswith(f"{SWAPPED}, a subclass of")
    assert f"  scheduler class {SWAPPED}, a subclass of" in result.stdout
    verdicts = [layer["order"] for layer in report["split_layers"]]
    assert report["split_layers"][-1]["role"] == "vLLM's own function"
    assert report["split_verified"] is True
    if way == "swap-at-platform":
        assert verdicts == [None, None]
        assert report["would_refuse"] is False
        assert line(result.stdout, "exit: ") == "exit: 0"
        assert "NOT VERIFIED" not in result.stdout
        assert "verdict: [ok] a hybrid model in align mode starts with the fix" in (
            result.stdout
        )
    else:
        assert verdicts == ["installed before this plugin loaded", None]
        assert report["split_layers"][0]["module"] == "vllm_test_foreign_split.patches"
        assert report["would_refuse"] is True
        refusal = line(result.stdout, "refused: ").removeprefix("refused: ")
        assert report["refusal"] == refusal
        assert refusal.count("NOT VERIFIED") == 1
        assert result.stdout.count("[!!] NOT VERIFIED") == 1  # the text's layers
    assert_never_blames_vllm(result.stdout)
