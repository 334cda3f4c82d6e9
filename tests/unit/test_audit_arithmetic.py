"""Audit arithmetic on plain objects: no scheduler, no vLLM.

The audit counts from chunk positions alone; the real-scheduler tests
(``tests/test_audit.py``) hold those counts against the oracle. Here the
arithmetic itself: boundaries crossed, would-be-poisoned slots, the prefill
predicate applied to the step's output, the summary line and its cadence.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_mamba_align import audit
from vllm_mamba_align.releases import PrefillRule
from vllm_mamba_align.retention import Retention

B, C = 1648, 816


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_audit(lines: list[str], clock: Clock) -> audit.Audit:
    return audit.Audit(
        B, C, interval=60.0, clock=clock, log=lines.append, warn=lambda line: None
    )


def test_summary_line_format() -> None:
    lines: list[str] = []
    clock = Clock()
    found = fake_audit(lines, clock)
    request = SimpleNamespace()
    for start, end in ((0, 8160), (8160, 16320), (16320, 16752), (16752, 16764)):
        found.count_chunk(request, start, end)
    clock.now += 3 * 3600 + 12 * 60 + 5
    found.count_chunk(SimpleNamespace(), 0, 1_000_000)  # aligned start: skips only
    found.close()
    assert lines == [
        "vllm-mamba-align audit (B=1648, C=816): 5 prefill chunks, "
        "2 would-be-poisoned slots, 614 skipped state boundaries, "
        "0 non-canonical kept states, 2 of 2 requests affected (1 poisoning), "
        "1,016,764 prefill tokens scheduled in 3h12m"
    ]


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.4, "0s"), (59, "59s"), (725, "12m05s"), (11525, "3h12m")]
)
def test_durations_are_short(seconds: float, text: str) -> None:
    assert audit.format_duration(seconds) == text


def test_summary_cadence_is_time_based_and_only_when_counts_changed() -> None:
    lines: list[str] = []
    clock = Clock()
    found = fake_audit(lines, clock)
    quiet = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[])
    found.count_chunk(SimpleNamespace(), 8160, 16320)
    found.after_schedule(quiet)
    clock.now += 59
    found.report()  # the reporter thread's tick
    assert lines == [], "not before the interval"
    clock.now += 1
    found.report()
    assert len(lines) == 1 and "1 would-be-poisoned slots" in lines[0]
    clock.now += 600
    found.report()
    assert len(lines) == 1, "nothing changed: no line"
    found.count_chunk(SimpleNamespace(), 0, 816)
    found.report()
    assert len(lines) == 2, "changed and the interval has passed: a line"


def test_first_would_be_poisoned_slot_is_warned_at_once_and_only_once() -> None:
    warnings: list[str] = []
    found = audit.Audit(B, C, clock=Clock(), log=[].append, warn=warnings.append)
    quiet = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[])
    found.count_chunk(SimpleNamespace(), 0, 8160)  # skips boundaries, no poison
    found.after_schedule(quiet)
    assert warnings == []
    found.count_chunk(SimpleNamespace(), 8160, 16320)
    found.after_schedule(quiet)
    assert len(warnings) == 1
    assert "first would-be-poisoned slot" in warnings[0]
    assert "VLLM_MAMBA_ALIGN_MODE" in warnings[0]
    found.count_chunk(SimpleNamespace(), 8160, 16320)
    found.after_schedule(quiet)
    assert len(warnings) == 1


def test_the_reporter_thread_logs_while_the_scheduler_is_idle() -> None:
    lines: list[str] = []
    exported: list[audit.AuditSnapshot] = []

    class Scheduler:  # weakly referenced, like vLLM's
        pass

    owner = Scheduler()
    found = audit.Audit(
        B, C, interval=0.05, log=lines.append, export=exported.append, owner=owner
    )
    found.start_reporter()
    found.count_chunk(SimpleNamespace(), 8160, 16320)  # then nothing is scheduled
    deadline = time.monotonic() + 10
    while not lines and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lines and "1 would-be-poisoned slots" in lines[0]
    assert exported and exported[-1].poisoned_slots == 1
    found.close()
    assert found._reporter is not None and not found._reporter.is_alive()
    assert len(lines) == 2, "the final line at close"
    found.close()
    assert len(lines) == 2


def test_the_audit_interval_setting_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_mamba_align import settings as plugin_settings
    from vllm_mamba_align.errors import MambaAlignError

    monkeypatch.delenv(plugin_settings.AUDIT_INTERVAL_VARIABLE, raising=False)
    assert plugin_settings.audit_interval() == 60.0
    monkeypatch.setenv(plugin_settings.AUDIT_INTERVAL_VARIABLE, "2.5")
    assert plugin_settings.audit_interval() == 2.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv(plugin_settings.AUDIT_INTERVAL_VARIABLE, bad)
        with pytest.raises(MambaAlignError, match="VLLM_MAMBA_ALIGN_AUDIT_INTERVAL"):
            plugin_settings.audit_interval()


def test_a_chunk_from_off_the_grid_across_a_boundary_poisons_one_slot() -> None:
    found = audit.Audit(B, C, log=lambda line: None)
    found.count_chunk(SimpleNamespace(), 0, 8160)  # aligned start: skips 4
    assert (found.counts.poisoned_slots, found.counts.skipped_boundaries) == (0, 4)
    found.count_chunk(SimpleNamespace(), 8160, 16320)  # off-grid start, crosses 5
    assert (found.counts.poisoned_slots, found.counts.skipped_boundaries) == (1, 8)
    found.count_chunk(SimpleNamespace(), 16320, 16480)  # ends on the boundary
    assert (found.counts.poisoned_slots, found.counts.skipped_boundaries) == (1, 8)


def test_only_boundaries_the_retention_keeps_are_counted() -> None:
    request = SimpleNamespace(num_prompt_tokens=16764)
    # Retention 0: only the replay boundary (16,480) is kept for this request.
    sparse = Retention(0, B, 16, "test")
    found = audit.Audit(B, C, retention=sparse, log=lambda line: None)
    found.count_chunk(request, 0, 8160)
    found.count_chunk(request, 8160, 16320)
    assert (found.counts.poisoned_slots, found.counts.skipped_boundaries) == (0, 0)
    found.count_chunk(request, 16320, 16752)  # crosses 16,480 from off the grid
    assert (found.counts.poisoned_slots, found.counts.skipped_boundaries) == (1, 0)


def test_the_boundary_the_backend_writes_counts_as_written() -> None:
    """A GPU backend with checkpoint blocks writes one state inside a chunk; the
    audit is told which boundary goes into its own slot (``backend_checkpoint``,
    from vLLM's rule and the block table): neither skipped nor poisoned."""
    writes = {(0, 8160): 6592, (8160, 16320): 8240, (16320, 16752): 0}
    found = audit.Audit(
        B,
        C,
        log=lambda line: None,
        backend_checkpoint=lambda request, start, end: writes[start, end],
    )
    found.count_chunk(SimpleNamespace(), 0, 8160)  # 4 inside, 6,592 written
    assert (found.counts.poisoned_slots, found.counts.skipped_boundaries) == (0, 3)
    found.count_chunk(SimpleNamespace(), 8160, 16320)  # 8,240 is the start's slot
    assert (found.counts.poisoned_slots, found.counts.skipped_boundaries) == (0, 7)
    found.count_chunk(SimpleNamespace(), 16320, 16752)  # nothing written
    assert (found.counts.poisoned_slots, found.counts.skipped_boundaries) == (1, 7)


class Output:
    """The parts of vLLM's SchedulerOutput the audit reads."""

    def __init__(self, scheduled: dict[str, int], new: tuple[str, ...] = ()) -> None:
        self.num_scheduled_tokens = scheduled
        self.scheduled_new_reqs = [SimpleNamespace(req_id=r) for r in new]


def live_request(prompt: int, computed: int, outputs: int = 0) -> Any:
    return SimpleNamespace(
        request_id="r",
        num_prompt_tokens=prompt,
        num_computed_tokens=computed,
        num_output_tokens=outputs,
        num_tokens=prompt + outputs,
    )


@pytest.mark.parametrize("rule", list(PrefillRule))
def test_one_token_chunks_are_counted_while_the_body_calls_them_prefill(
    rule: PrefillRule,
) -> None:
    """One-token chunks skip the split observer: the step's output shows them,
    judged by the body's own prefill rule (releases.in_prefill)."""
    request = live_request(prompt=3, computed=1)  # vLLM advanced it by 1
    found = audit.Audit(B, C, rule, log=lambda line: None, live_requests={"r": request})
    found.after_schedule(Output({"r": 1}, new=("r",)))
    request.num_computed_tokens = 2
    found.after_schedule(Output({"r": 1}))
    request.num_computed_tokens = 3  # the prompt's last token
    found.after_schedule(Output({"r": 1}))
    assert found.counts.prefill_chunks == 3
    # The first decode: after update_from_output the request has an output.
    request.num_output_tokens, request.num_tokens = 1, 4
    request.num_computed_tokens = 4
    found.after_schedule(Output({"r": 1}))
    assert found.counts.prefill_chunks == 3, "a decode is not a prefill chunk"
    assert found.counts.prefill_tokens == 3 and found.counts.requests == 1


def test_a_replay_is_prefill_only_where_the_body_says_so() -> None:
    """A preempted request replaying its outputs: prefill from 0.17.1 on, not
    on 0.15.1-0.16.0 (whose split never touches it)."""
    for rule, counted in (
        (PrefillRule.BEFORE_PREFILL_END, 1),
        (PrefillRule.NO_OUTPUT_YET, 0),
    ):
        request = live_request(prompt=3000, computed=2000, outputs=40)
        found = audit.Audit(
            B, C, rule, log=lambda line: None, live_requests={"r": request}
        )
        found.ledger.pending["r"] = request  # as if the observer had noted it
        found.ledger.count_scheduled(request, 2000)
        assert found.counts.prefill_chunks == counted


def test_the_ledger_reads_the_schedulers_own_request_table() -> None:
    """vLLM's ``requests`` table is empty when the audit is built and fills as
    requests arrive: the audit reads that table itself, not a copy."""
    requests: dict[str, Any] = {}
    found = audit.Audit(B, C, log=lambda line: None, live_requests=requests)
    requests["r"] = live_request(prompt=3, computed=1)  # vLLM advanced it by 1
    found.after_schedule(Output({"r": 1}, new=("r",)))
    assert found.counts.prefill_chunks == 1
