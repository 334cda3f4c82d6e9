"""The per-scheduler decision (``activation.attach``) on a real scheduler: one
walk of the split per attach, and the rows of the decision table that only a
crafted scheduler reaches, each in ``off`` and in a fixing mode (the other rows'
tests name them through ``decision_rows.row``)."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from decision_rows import Decisions, row
from helpers import StartLines, built_or_skipped, installed_body, scheduler_mode

from vllm_mamba_align import MambaAlignError, activation
from vllm_mamba_align.layers import Chain
from vllm_mamba_align.tools.sim import Geometry, Simulation, build_scheduler

B = 1648


@pytest.mark.parametrize(
    ("mode", "decided"),
    [
        ("off", row("off")),
        ("lean", row("fix")),
        ("kept", "fix"),
        ("full", "fix"),
        ("grid", row("as_vllm")),
        ("audit", row("audit")),
    ],
)
def test_the_split_is_walked_once_per_attach_in_every_mode(
    mode: str, decided: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal checks, mode off's binding and the start line read one walk
    of the split's layers. C = B: where vLLM's split stops a chunk from a
    mid-block start at the next boundary itself (the release table's body),
    grid mode's route would answer as vLLM's own split does, so vLLM's function
    is bound itself; every other fixing mode stops at kept boundaries, which
    vLLM's split does not."""
    if decided == "as_vllm" and not installed_body().stops_after_mid_block_start:
        decided = "fix"  # grid adds the stop this body lacks
    walked: list[str] = []
    walk = activation.walk

    def counted(scheduler_class: type, name: str) -> Chain:
        walked.append(name)
        return walk(scheduler_class, name)

    monkeypatch.setattr(activation, "walk", counted)
    decisions = Decisions(monkeypatch)
    with scheduler_mode(mode):
        sim: Any = Simulation(Geometry(cache_block=B, state_block=B, budget=8192))
    scheduler = sim.scheduler
    assert walked == [activation.SPLIT_METHOD]
    assert decisions.keys == [decided]
    bound = vars(scheduler).get(activation.SPLIT_METHOD)
    own = vars(type(scheduler))[activation.SPLIT_METHOD].__wrapped__
    vllms = getattr(bound, "__func__", None) is own
    # off and grid (here) bind vLLM's own function; the fix and the audit
    # bind their route.
    assert vllms is (decided in ("off", "as_vllm"))


# -- rows only a crafted scheduler reaches ---------------------------------------

UPSTREAM_SCHEDULER = '''
from vllm.v1.core.sched import scheduler


class UpstreamScheduler(scheduler.Scheduler):
    """Stands in for a vLLM with PR #54076: its scheduler derives B itself."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        groups = self.kv_cache_config.kv_cache_groups
        self.mamba_state_block_size = groups[-1].kv_cache_spec.block_size
'''


def _upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Geometry:
    """vLLM's scheduler with upstream's fix: no release has it (PR #54076 is
    open), so a subclass whose module assigns the attribute stands in."""
    import vllm.v1.core.sched.scheduler as module

    (tmp_path / "upstream_scheduler.py").write_text(textwrap.dedent(UPSTREAM_SCHEDULER))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "upstream_scheduler", raising=False)
    from upstream_scheduler import UpstreamScheduler  # type: ignore[import-not-found]

    monkeypatch.setattr(module, "Scheduler", UpstreamScheduler)
    return Geometry(cache_block=B, state_block=B)


def _attention_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Geometry:
    return Geometry(cache_block=B, state_block=B, hybrid=False)


def _align_without_mamba_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Geometry:
    """A scheduler that asks for the aligned split with no Mamba spec among its
    groups. No release builds one (vLLM derives the flag from a Mamba spec
    among the groups, where the plugin finds B): a class whose flag is always
    set stands in."""
    import vllm.v1.core.sched.scheduler as module

    class AlignWithoutMamba(module.Scheduler):  # type: ignore[misc,name-defined]
        need_mamba_block_aligned_split = property(
            lambda self: True, lambda self, value: None
        )

    monkeypatch.setattr(module, "Scheduler", AlignWithoutMamba)
    return Geometry(cache_block=B, state_block=B, hybrid=False)


def _unreadable_subclass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Geometry:
    """Another distribution's subclass the fix cannot run in: its
    ``__getattribute__`` hides what the scheduler's calls resolve to."""
    import vllm.v1.core.sched.scheduler as module

    class Peeking(module.Scheduler):  # type: ignore[misc,name-defined]
        def __getattribute__(self, name: str) -> Any:
            return super().__getattribute__(name)

    monkeypatch.setattr(module, "Scheduler", Peeking)
    return Geometry(cache_block=B, state_block=B)


CRAFTED: dict[str, Callable[[Path, pytest.MonkeyPatch], Geometry]] = {
    row("no_align_split"): _attention_only,
    row("upstream_fix"): _upstream,
    row("no_mamba_spec"): _align_without_mamba_spec,
    row("foreign_subclass"): _unreadable_subclass,
}
STARTED = {
    "no_align_split": "inactive (no Mamba layers in align mode)",
    "upstream_fix": "the upstream fix is present",
    "no_mamba_spec": "inactive (no Mamba spec among KV groups)",
}
"""What the start line says where a row stands aside in every mode."""


@pytest.mark.parametrize("mode", ["off", "lean"])
@pytest.mark.parametrize("crafted", CRAFTED)
def test_a_row_only_a_crafted_scheduler_reaches(
    crafted: str, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows above ``off`` stand aside in every mode, binding nothing and
    setting no attribute; a refusing row below it refuses only a fixing mode,
    and ``off`` starts that scheduler with vLLM's split as it is."""
    geometry = CRAFTED[crafted](tmp_path, monkeypatch)
    lines = StartLines()
    monkeypatch.setattr(activation, "_logger", lambda: lines)
    decisions = Decisions(monkeypatch)
    if crafted == "foreign_subclass" and mode != "off":
        with (
            built_or_skipped(),
            scheduler_mode(mode),
            pytest.raises(MambaAlignError, match="defines __getattribute__"),
        ):
            build_scheduler(geometry)
        assert decisions.keys == [crafted]
        assert lines.lines == []
        return
    with built_or_skipped(), scheduler_mode(mode):
        scheduler = build_scheduler(geometry)
    (line,) = lines.lines
    if crafted == "foreign_subclass":  # off, above the refusing row
        assert decisions.keys == ["off"]
        assert "mode=off (stock vLLM split)" in line
        return
    assert decisions.keys == [crafted]
    assert STARTED[crafted] in line
    assert activation.SPLIT_ATTRIBUTE not in vars(scheduler)
    assert activation.SPLIT_METHOD not in vars(scheduler)
    # The plugin sets no attribute; upstream's own scheduler sets B itself.
    assert getattr(scheduler, activation.STATE_BLOCK_ATTRIBUTE, None) == (
        B if crafted == "upstream_fix" else None
    )
