"""Test-only faults in the mamba_align plugin, so tests/witness can show that
its judge, which shares no code with the plugin, fails a plugin that breaks.

``MAMBA_ALIGN_WITNESS_FAULT`` chooses the fault (unset: inert):

- ``retention``: the plugin's model of vLLM's state retention believes vLLM
  keeps no boundary state at all (not dense, no interval, no replay boundary,
  no junction), whatever the scheduler's setting is. ``kept`` mode then never
  stops at a boundary, so under dense retention or an interval R a chunk runs
  past boundaries whose states vLLM keeps: their slots stay null (lost kept
  states, not wrong publications).
- ``cache-grid``: every scheduler's stop policy runs on C, the cache config's
  block, instead of B: the plugin's B-grid view of vLLM's split is dropped
  (the view is built from the policy's grid), and its stops fall on C's grid
  too. Chunks end where no Mamba state boundary is, and blocks get published
  as states they do not hold wherever the plugin stops on every boundary
  (dense retention, ``full``).
- ``no-junction-stop``: lean leaves out its stops at shared-prefix junctions:
  a chunk runs past a junction vLLM keeps, and the junction's block, written
  mid-block by an earlier chunk that ended on C's grid, is published as the
  junction's state.
- ``no-replay-stop``: lean leaves out its stops at replay boundaries. The
  witness's workloads run on the CPU scheduler, whose backend declares no
  prefill checkpoint, so no checkpoint covers the replay boundary there, and
  its block is published over another state.

Each fault is built from the plugin's own public pieces, outside its serving
code: the stop policy it builds per scheduler (``StopPolicy.for_scheduler``,
wrapped here to return a policy on another ``grid``), lean's rule
(``split.lean``, which the route looks up on each call: here given the
scheduler's record with a view of vLLM's retention blind to the junctions or
the replay boundaries, as the benchmarks' ablation does in
benchmarks/ablation.py) and
the retention model's class. vLLM loads every general plugin before it builds
a scheduler, and the plugin binds its route when a scheduler starts, so the
order in which the two plugins load does not matter.

Inert unless the switch is set: with ``VLLM_PLUGINS`` unset vLLM loads every
installed general plugin, and the suites' environments have this one
installed beside the plugin. An unknown value raises inside ``register()``,
which vLLM propagates: a misspelt fault never runs as an intact plugin.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

SWITCH = "MAMBA_ALIGN_WITNESS_FAULT"


def _break_retention() -> None:
    from vllm_mamba_align import retention

    model: Any = retention.Retention
    model.dense = property(lambda self: False)
    model.keeps_segment = lambda self, boundary: False
    model.reachable = lambda self, request: ()


def _change_policy(change: Callable[[Any, Any], Any]) -> None:
    """Every policy the plugin builds for a scheduler passes through
    ``change(policy, scheduler)``."""
    from vllm_mamba_align.policy import StopPolicy

    shipped = StopPolicy.__dict__["for_scheduler"].__func__

    def for_scheduler(
        cls: Any, mode: Any, body: Any, retention: Any, scheduler: Any, grid: int
    ) -> Any:
        policy = shipped(cls, mode, body, retention, scheduler, grid)
        return change(policy, scheduler)

    StopPolicy.for_scheduler = classmethod(for_scheduler)  # type: ignore[method-assign,assignment]


def _on_cache_grid(policy: Any, scheduler: Any) -> Any:
    return replace(policy, grid=int(scheduler.cache_config.block_size))


def _lean_blind_to(replay: bool) -> None:
    """Lean reads a retention blind to the replay boundaries (``replay``) or
    to the junctions: its rule runs vLLM's own chunk past them."""
    from vllm_mamba_align import split
    from vllm_mamba_align.retention import Retention

    @dataclass(frozen=True)
    class Blind(Retention):
        def first_kept_after(self, request: Any, start: int) -> int | None:
            if self.dense:
                return super().first_kept_after(request, start)
            replays = set(self.replay_boundaries(request))
            candidates = [
                boundary
                for boundary in self.reachable(request)
                if boundary > start and (boundary in replays) != replay
            ]
            if self.interval:
                candidates.append((start // self.interval + 1) * self.interval)
            return min(candidates, default=None)

    shipped = split.lean
    blind: dict[int, Any] = {}  # per scheduler's record: lean's own record

    def lean(fix: Any, *arguments: Any) -> Any:
        if id(fix) not in blind:
            retention = fix.retention
            values = {f.name: getattr(retention, f.name) for f in fields(retention)}
            blind[id(fix)] = (fix, replace(fix, retention=Blind(**values)))
        return shipped(blind[id(fix)][1], *arguments)

    split.lean = lean


FAULTS: dict[str, Callable[[], None]] = {
    "retention": _break_retention,
    "cache-grid": lambda: _change_policy(_on_cache_grid),
    "no-junction-stop": lambda: _lean_blind_to(replay=False),
    "no-replay-stop": lambda: _lean_blind_to(replay=True),
}


def register() -> None:
    fault = os.environ.get(SWITCH)
    if not fault:
        return
    if fault not in FAULTS:
        raise ValueError(f"{SWITCH}={fault!r}: no such fault (known: {sorted(FAULTS)})")
    FAULTS[fault]()
