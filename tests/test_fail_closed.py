"""Refusals: each gives one clear error and leaves vLLM's scheduler unpatched."""

from __future__ import annotations

import platform
import textwrap

import pytest
from decision_rows import PRINT_ROWS, Decisions, row
from helpers import (
    StartLines,
    built_or_skipped,
    run_python,
    scheduler_mode,
    vllm_refuses,
)

from vllm_mamba_align import MambaAlignError, __version__, activation, register
from vllm_mamba_align.recognition import SPLIT_METHOD
from vllm_mamba_align.releases import (
    SUPPORTED_RELEASES,
    V1_RUNNER_REMOVED_IN,
    WORKER_CHECKS_GROUPS_AT_START_SINCE,
    release_range,
)
from vllm_mamba_align.tools.sim import (
    Geometry,
    Simulation,
    build_scheduler,
    prompt,
)


@pytest.mark.parametrize("mode", ["full", "off"])
def test_disagreeing_mamba_groups_refuse_to_start_except_in_off(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mamba groups that disagree on their block size (which stock vLLM cannot
    build: the KV-cache config is crafted) refuse a fixing mode; ``off``
    changes nothing whatever it finds: vLLM's own split, no attribute set, and
    a start line that says why it stands aside. A fixing mode refuses as a
    worker that checks the groups only at its first step lets vLLM build it
    (0.15.0-0.31.0, Model Runner V1 on 0.32.0-0.33.0), naming ways out that
    work there."""
    geometry = Geometry(cache_block=816, state_block=1648, extra_mamba_block=1600)
    lines = StartLines()
    monkeypatch.setattr(activation, "_logger", lambda: lines)
    decisions = Decisions(monkeypatch)
    if mode == "off":
        with built_or_skipped(), scheduler_mode("off"):
            scheduler = build_scheduler(geometry)
        assert decisions.keys == [row("off")]
        own = vars(type(scheduler))[SPLIT_METHOD].__wrapped__
        assert scheduler._mamba_block_aligned_split.__func__ is own
        assert activation.STATE_BLOCK_ATTRIBUTE not in vars(scheduler)
        assert scheduler.cache_config.block_size == 816
        (line,) = lines.lines
        assert "mode=off (stock vLLM split)" in line
        assert "disagree on their block size" in line
        assert "block_size=1648" in line and "block_size=1600" in line
        assert "mode off leaves vLLM as it is" in line
        return
    with (
        built_or_skipped(),
        scheduler_mode(mode),
        pytest.raises(MambaAlignError) as error,
    ):
        build_scheduler(geometry)
    assert decisions.keys == [row("disagreeing_groups")]
    message = str(error.value)
    assert "disagree" in message
    assert "block_size=1648" in message and "block_size=1600" in message
    assert "mtp.layers.0.linear_attn" in message
    # Align mode overrides --mamba-block-size on every release: not a way out.
    assert "whatever --mamba-block-size says" in message
    assert "Ways out: turn prefix caching off for this model" in message
    assert "(--no-enable-prefix-caching)" in message
    # Where vLLM's own worker stops such a model first, read from the release
    # table (the range is generated, never a copy).
    since = WORKER_CHECKS_GROUPS_AT_START_SINCE
    assert f"vLLM {release_range(before=since)} starts such a model" in message
    assert f"from {since} Model Runner V2 stops it" in message
    assert release_range(since, before=V1_RUNNER_REMOVED_IN) in message
    assert lines.lines == []


@pytest.mark.parametrize("mode", ["bogus", "FULLY"])
def test_a_bad_mode_is_a_clear_error(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_MODE", mode)
    with pytest.raises(MambaAlignError, match="VLLM_MAMBA_ALIGN_MODE") as error:
        register()
    assert "full, kept, grid, lean, off" in str(error.value)
    # A scheduler started with the bad value in place refuses too.
    with pytest.raises(MambaAlignError, match="not a valid mode"):
        build_scheduler(Geometry(cache_block=1648, state_block=1648))


def test_a_bad_mode_patches_nothing() -> None:
    result = run_python(
        textwrap.dedent(
            """
            import vllm_mamba_align
            from vllm_mamba_align.plugin import is_patched
            try:
                vllm_mamba_align.register()
            except vllm_mamba_align.MambaAlignError as e:
                print("refused:", e)
            from vllm.v1.core.sched.scheduler import Scheduler
            print("patched:", any(is_patched(v) for v in vars(Scheduler).values()))
            """
        ),
        VLLM_MAMBA_ALIGN_MODE="sideways",
    )
    assert result.returncode == 0, result.stderr
    assert "refused: VLLM_MAMBA_ALIGN_MODE='sideways' is not a valid mode" in (
        result.stdout
    )
    assert "patched: False" in result.stdout


# Re-create vLLM's split from an edited copy of its source, the way a vendor
# patch would, before the plugin sees it. The copy is written to a file so its
# source stays readable (and fingerprintable) like the original's.
EDIT_THE_SPLIT = """
import ast, inspect, tempfile, textwrap
import vllm.v1.core.sched.scheduler as module
source = textwrap.dedent(inspect.getsource(module.Scheduler._mamba_block_aligned_split))
tree = ast.parse(source)
tree.body[0].body.insert(0, ast.parse("vendor_marker = 1").body[0])
edited = ast.unparse(tree)
path = tempfile.mktemp(suffix="_edited_split.py")
open(path, "w").write(edited)
namespace = {}
exec(compile(edited, path, "exec"), module.__dict__, namespace)
module.Scheduler._mamba_block_aligned_split = namespace["_mamba_block_aligned_split"]
"""

BUILD = (
    PRINT_ROWS
    + """
import vllm_mamba_align
from vllm_mamba_align.plugin import is_patched
from vllm_mamba_align.tools.sim import (
    Geometry, Simulation, build_scheduler, prompt
)
vllm_mamba_align.register()
from vllm.v1.core.sched.scheduler import Scheduler
split_patched = is_patched(vars(Scheduler)["_mamba_block_aligned_split"])
print("split patched:", split_patched)
build_scheduler(Geometry(cache_block=816, state_block=1648, hybrid=False))
print("non-hybrid started")
try:
    sim = Simulation(Geometry(cache_block=1648, state_block=1648))
except vllm_mamba_align.MambaAlignError as e:
    print("refused:", e)
else:
    sim.add("a", prompt(5000, 1))
    sim.run()
    print("chunk ends:", sim.chunk_ends("a"))
"""
)


def rows(out: str) -> list[str]:
    """The rows that decided each scheduler a child built (PRINT_ROWS)."""
    return [line.split()[1] for line in out.splitlines() if line.startswith("row: ")]


def test_unknown_code_in_align_mode_refuses_to_start() -> None:
    result = run_python(EDIT_THE_SPLIT + BUILD)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert rows(out) == [row("no_align_split"), row("unknown_code")]
    assert "split patched: False" in out
    assert "non-hybrid started" in out, "models without align split are never blocked"
    refusal = next(line for line in out.splitlines() if line.startswith("refused:"))
    newest = SUPPORTED_RELEASES[-1]
    for needed in (
        f"refused: vllm-mamba-align {__version__}: ",  # the plugin's version
        f"The newest vLLM release vllm-mamba-align {__version__} has verified is "
        f"{newest}.",
        f"(1) pin vLLM to a verified release (pip install vllm=={newest})",
        "(2) set VLLM_MAMBA_ALIGN_ALLOW_UNVERIFIED=1 to run the fix on this code "
        "anyway: the plugin then checks only that the function reads "
        "self.cache_config.block_size exactly once and takes the released parameters",
        "(3) set VLLM_MAMBA_ALIGN_MODE=off",
        "on the plugin's issue tracker with the output of "
        "`vllm-mamba-align doctor --json` attached",
        "has not verified",
        "fingerprint",
        "as released has split fingerprint",
        f"this Python {platform.python_version()} computed",
        "differs from the release's",
        f"Verified releases: {', '.join(SUPPORTED_RELEASES[:2])},",
        "VLLM_MAMBA_ALIGN_ALLOW_UNVERIFIED=1",
    ):
        assert needed in refusal


def test_unknown_code_in_mode_off_runs_vllms_own_split() -> None:
    """The refusal's third way out: mode off starts the scheduler, unwrapped."""
    result = run_python(EDIT_THE_SPLIT + BUILD, VLLM_MAMBA_ALIGN_MODE="off")
    assert result.returncode == 0, result.stderr
    assert "split patched: False" in result.stdout
    assert "refused:" not in result.stdout
    assert rows(result.stdout) == ["no_align_split", "off"]
    # Stock's first chunk crosses boundaries (equal geometry); the fix's would
    # end at the first one.
    assert "chunk ends: [" in result.stdout
    assert "chunk ends: [1648, " not in result.stdout


def test_unverified_code_runs_only_with_the_opt_in() -> None:
    result = run_python(
        EDIT_THE_SPLIT + BUILD,
        VLLM_MAMBA_ALIGN_ALLOW_UNVERIFIED="1",
        VLLM_MAMBA_ALIGN_MODE="full",
    )
    assert result.returncode == 0, result.stderr
    assert "split patched: True" in result.stdout
    assert rows(result.stdout) == ["no_align_split", "fix"]
    # Equal geometry: stock's first chunk would end at 4944, crossing 2 boundaries;
    # full stops at each.
    assert "chunk ends: [1648, 3296, 4944, " in result.stdout


def test_unverified_code_must_pass_the_structural_check() -> None:
    # Two reads of the grid: the fix cannot know which one to redirect.
    twice = EDIT_THE_SPLIT.replace(
        '"vendor_marker = 1"', '"vendor_marker = self.cache_config.block_size"'
    )
    result = run_python(twice + BUILD, VLLM_MAMBA_ALIGN_ALLOW_UNVERIFIED="1")
    assert result.returncode == 0, result.stderr
    assert "split patched: False" in result.stdout
    assert "does NOT pass the structural check" in result.stdout
    assert rows(result.stdout) == ["no_align_split", "unknown_code"]


def _accepted(*geometries: Geometry) -> Geometry:
    """The first geometry the installed vLLM itself starts with."""
    for geometry in geometries:
        try:
            with scheduler_mode("stock"):
                build_scheduler(geometry)
        except Exception as error:
            if vllm_refuses(error):
                continue
            raise
        return geometry
    pytest.skip("this vLLM starts none of these geometries")


@pytest.mark.parametrize("mode", ["full", "off"])
def test_a_state_block_wider_than_the_step_budget(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stall guard: bodies without vLLM's wide-block rule (0.15.0-0.26.0)
    refuse a fixing mode; others finish. ``off`` starts either, unchanged."""
    import vllm.v1.core.sched.scheduler as module

    from vllm_mamba_align.recognition import recognize

    geometry = _accepted(
        Geometry(cache_block=412, state_block=1648, budget=1024),
        Geometry(cache_block=1648, state_block=1648, budget=1024),
    )
    body = recognize(module.Scheduler).body
    assert body is not None
    decisions = Decisions(monkeypatch)
    if mode == "off":
        with scheduler_mode("off"):
            build_scheduler(geometry)
        assert decisions.keys == ["off"]
        return
    if not body.wide_block_exemption:
        with scheduler_mode("full"), pytest.raises(MambaAlignError) as error:
            build_scheduler(geometry)
        assert decisions.keys == [row("stall")]
        message = str(error.value)
        assert "B=1648 is larger than the per-step prefill budget 1024" in message
        assert "--max-num-batched-tokens=1024" in message
        return
    for fixing in ("full", "grid"):
        with scheduler_mode(fixing):
            sim = Simulation(geometry)
            sim.add("wide", prompt(5000, seed=4))
            sim.run()
        assert sim.records["wide"].prefilled_at_step is not None
        assert not sim.poisoned
    assert "stall" not in decisions.keys


def test_a_vendor_build_with_a_known_body_is_accepted() -> None:
    """Recognized by its code: a dev/vendor version string does not matter."""
    code = textwrap.dedent(
        """
        import vllm
        vllm.__version__ = "0.1.dev20073+g8e685d198"
        import vllm_mamba_align
        from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt
        vllm_mamba_align.register()
        sim = Simulation(Geometry(cache_block=1648, state_block=1648))
        sim.add("a", prompt(5000, 1))
        sim.run()
        print("chunk ends:", sim.chunk_ends("a"))
        """
    )
    result = run_python(code, VLLM_MAMBA_ALIGN_MODE="full")
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    line = next(x for x in out.splitlines() if "vllm-mamba-align" in x)
    assert "on vLLM 0.1.dev20073+g8e685d198 (dev/vendor build)" in line
    assert "ACTIVE, mode=full" in line
    assert "chunk ends: [1648, 3296, 4944, " in out


@pytest.mark.parametrize("mode", ["full", "grid", "audit", "off"])
def test_a_scheduler_class_with_its_own_split(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subclass overriding the split runs unverified code: refused, or untouched.

    The fix and the audit bind vLLM's recognized function on each scheduler; a
    subclass's own split would be bypassed, so the plugin refuses to start it.
    With the plugin off the subclass's split runs exactly as written.
    """
    import vllm.v1.core.sched.scheduler as module

    calls: list[int] = []

    class OwnSplitScheduler(module.Scheduler):  # type: ignore[misc,name-defined]
        def _mamba_block_aligned_split(
            self, request: object, num_new_tokens: int, *rest: int
        ) -> int:
            calls.append(num_new_tokens)
            return num_new_tokens

    monkeypatch.setattr(module, "Scheduler", OwnSplitScheduler)
    geometry = Geometry(cache_block=1648, state_block=1648, budget=8192)
    decisions = Decisions(monkeypatch)
    if mode != "off":
        with scheduler_mode(mode), pytest.raises(MambaAlignError) as error:
            build_scheduler(geometry)
        assert decisions.keys == [row("unverified_layers")]
        message = str(error.value)
        assert "OwnSplitScheduler overrides _mamba_block_aligned_split" in message
        assert "VLLM_MAMBA_ALIGN_MODE=off" in message
        return
    with scheduler_mode(mode):
        sim = Simulation(geometry)
    assert decisions.keys == ["off"]
    sim.add("a", prompt(5000, seed=2))
    sim.step()
    assert calls == [5000], "the subclass's own split ran, unchanged"
