"""Audit mode: measure the align-mode defect on live traffic, change nothing.

``VLLM_MAMBA_ALIGN_MODE=audit`` leaves vLLM's split exactly as it is (the split
wrapper calls vLLM's own function with the same arguments and returns its answer)
and counts, per scheduler, what stock vLLM does to the Mamba state grid B, from the
positions of the prefill chunks it actually schedules:

- **would-be-poisoned slots**: a prefill chunk that starts off the grid (``start %
  B != 0``) and runs past the next boundary ``nb``. The request's running slot
  holds the state after ``start`` tokens; vLLM allocates a new running slot for
  the chunk's end and publishes the old one under the hash of ``[0, nb)``, a
  state it does not hold, when its state retention keeps ``nb``. Every later
  request that hits that hash continues from the wrong state. A chunk that ends
  exactly on ``nb`` is fine: the same slot receives the state at ``nb``.
- **skipped state boundaries**: the other boundaries strictly inside a chunk that
  vLLM's retention would keep (except the one a GPU backend with prefill
  checkpoint blocks writes into its own slot inside the chunk). The allocator
  gives such slots the null block, so those states never exist and no request
  can reuse them (lost prefix reuse, not wrong outputs). Boundaries vLLM would
  drop anyway are not counted.
- **non-canonical kept states**: states vLLM keeps (a chunk ends on a kept
  boundary) that were computed by another chunk sequence than one B block per
  chunk from the request's start. Correct, but a request that computed the same
  prefix in other chunks gets slightly different numbers: what ``full`` changes.
- requests affected and prefill tokens scheduled, for scale.

Validated against the real-scheduler oracle of the test suite
(``tests/test_audit.py``): the would-be-poisoned count equals the number of Mamba
hash publications over a wrong state, and it is 0 wherever stock is correct.

How it observes: the split observer is bound as this scheduler's split (like the
fix, but calling vLLM's function unchanged). For calls of two or more tokens it
does O(1) integer work and remembers the prefill chunks of the current step in a
dict cleared after every step; one-token calls (decodes, nearly all calls) pass
straight through. ``schedule()`` and ``shutdown()`` are observed through
attributes of the scheduler *instance* (the class is untouched, other schedulers
are not affected): the step's output confirms which remembered chunks really ran
(a chunk can be proposed and then not scheduled when its blocks do not fit),
one-token prefill chunks are picked up there for the few requests that are new
or known to be mid-prefill, and shutdown writes the final line. A daemon
thread per audited scheduler writes the summary when due (an idle server still
reports), hands the figures to the Prometheus export (``metrics``) and stops at
shutdown; the first would-be-poisoned slot is logged at once, at WARNING.
Nothing grows with traffic: per-request facts live in one integer attribute on
vLLM's ``Request``.

Parts: ``counting`` (the arithmetic, pure), ``ledger`` (proposed chunks matched
against the step's output), ``reporter`` (the thread and the log lines); this
module binds them to a scheduler (:func:`install`) and holds the summary
cadence (:class:`Audit`). The audit imports nothing from the fix but the
split's binding (split.py: the shortcut for decodes, vLLM's call).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import settings
from ..errors import MambaAlignError
from ..releases import PrefillRule, SplitBody, chunk_start
from ..retention import Retention
from ..split import (  # the binding only: nothing of the fix's stops
    FifthArgument,
    SplitFunction,
    bind_route,
    call_vllm,
    fifth_argument,
)
from .counting import (
    REQUEST_CHAIN,
    REQUEST_FLAGS,
    AuditSnapshot,
    BackendWrite,
    Counts,
    format_duration,
)
from .ledger import StepLedger
from .reporter import (
    DEFAULT_INTERVAL_SECONDS,
    LOGGER_NAME,
    REPORT_TICK_SECONDS,
    ReporterThread,
    vllm_log,
    vllm_warn,
)
from .slots import own_slot_write

if TYPE_CHECKING:
    from ..protocols import Request, Scheduler, SchedulerOutput

__all__ = [
    "ACTIVE_STATUS",
    "AUDIT_ATTRIBUTE",
    "DEFAULT_INTERVAL_SECONDS",
    "LOGGER_NAME",
    "REPORT_TICK_SECONDS",
    "REQUEST_CHAIN",
    "REQUEST_FLAGS",
    "SWITCH_THE_FIX_ON",
    "Audit",
    "AuditSnapshot",
    "audit_of",
    "format_duration",
    "install",
    "live_snapshots",
    "snapshot",
]

# Where the audit lives on a scheduler instance (next to SPLIT_ATTRIBUTE's fix).
AUDIT_ATTRIBUTE = "_vllm_mamba_align_audit"

ACTIVE_STATUS = (
    "AUDIT, mode=audit: stock vLLM schedules unchanged; counting would-be-poisoned "
    "slots and skipped state boundaries (a summary when changed, every "
    f"{DEFAULT_INTERVAL_SECONDS:.0f} s by default ({settings.AUDIT_INTERVAL_VARIABLE})"
    " and at shutdown; the first would-be-poisoned slot at once)"
)

SWITCH_THE_FIX_ON = (
    f"Switch the fix on: unset {settings.MODE_VARIABLE} (default "
    f"{settings.DEFAULT_MODE.value}) or set it to grid or full."
)
"""The advice of the first would-be-poisoned slot's WARNING line; the alert
rules in deploy/monitoring give the same (tests/unit/test_monitoring_contract.py)."""


class Audit:
    """One scheduler's audit: its counts, its step ledger, its summary cadence
    and (with an ``owner``, the scheduler) its reporter thread."""

    __slots__ = (
        "__weakref__",
        "_closed",
        "_exported_chunks",
        "_last_log",
        "_logged_chunks",
        "_report_lock",
        "_reporter",
        "_started",
        "_warned_poison",
        "clock",
        "counts",
        "export",
        "interval",
        "ledger",
        "log",
        "warn",
    )

    def __init__(
        self,
        state_block: int,
        cache_block: int,
        prefill_rule: PrefillRule = PrefillRule.BEFORE_PREFILL_END,
        retention: Retention | None = None,
        *,
        interval: float = DEFAULT_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = vllm_log,
        warn: Callable[[str], None] = vllm_warn,
        export: Callable[[AuditSnapshot], None] | None = None,
        backend_checkpoint: BackendWrite | None = None,
        live_requests: Mapping[str, Request] | None = None,
        owner: object | None = None,
    ) -> None:
        self.counts = Counts(state_block, cache_block, retention, backend_checkpoint)
        requests = {} if live_requests is None else live_requests  # vLLM's own table
        self.ledger = StepLedger(self.counts, prefill_rule, requests)
        self.interval = interval
        self.clock = clock
        self.log = log
        self.warn = warn
        self.export = export
        """Where the figures go besides the log (Prometheus counters), if any."""
        self._started = clock()
        self._last_log = self._started
        self._logged_chunks = 0
        self._exported_chunks = 0
        self._closed = False
        self._warned_poison = False
        self._report_lock = threading.Lock()
        tick = min(REPORT_TICK_SECONDS, interval)
        self._reporter = None if owner is None else ReporterThread(self, owner, tick)
        """Reports every tick while ``owner`` lives (:meth:`start_reporter`)."""

    @property
    def state_block(self) -> int:
        return self.counts.state_block

    @property
    def cache_block(self) -> int:
        return self.counts.cache_block

    @property
    def backend_checkpoint(self) -> BackendWrite | None:
        return self.counts.backend_checkpoint

    def count_chunk(self, request: Request, start: int, end: int) -> None:
        """Classify one scheduled prefill chunk ``[start, end)`` (counting.py)."""
        self.counts.count_chunk(request, start, end)

    def after_schedule(self, output: SchedulerOutput) -> None:
        """Count the prefill chunks this ``schedule()`` really scheduled
        (ledger.py); warn at once about the first would-be-poisoned slot."""
        self.ledger.after_schedule(output)
        if self.counts.poisoned_slots and not self._warned_poison:
            self._warn_first_poison()

    # -- reading and logging ----------------------------------------------------
    def snapshot(self) -> AuditSnapshot:
        return self.counts.snapshot(self.clock() - self._started)

    def _warn_first_poison(self) -> None:
        """Say at once, at WARNING, that stock vLLM published a wrong state."""
        self._warned_poison = True
        self.warn(
            "vllm-mamba-align: the audit found the first would-be-poisoned slot "
            f"(B={self.state_block}, C={self.cache_block}): a prefill chunk "
            "started off the Mamba "
            "state grid and ran past a boundary, so vLLM published a Mamba slot "
            "under the hash of a state it does not hold; requests that share that "
            f"prefix continue from a wrong state. {SWITCH_THE_FIX_ON}"
        )

    def _emit(self, now: float) -> None:
        self._last_log = now
        self._logged_chunks = self.counts.prefill_chunks
        self.log(self.snapshot().summary())

    def report(self) -> None:
        """Export the figures and log the summary when due (the reporter's tick).

        Runs on the reporter thread, so an idle server still logs what it
        counted; reads integers the scheduler thread writes (each read is
        atomic; a summary may lag one step behind).
        """
        with self._report_lock:
            if self._closed:
                return
            self._report(final=False)

    def _report(self, *, final: bool) -> None:
        chunks = self.counts.prefill_chunks
        if self.export is not None and (final or chunks != self._exported_chunks):
            self._exported_chunks = chunks
            self.export(self.snapshot())
        if final:
            self._emit(self.clock())
        elif chunks != self._logged_chunks:
            now = self.clock()
            if now - self._last_log >= self.interval:
                self._emit(now)

    def start_reporter(self) -> None:
        """Start the reporter thread (an audit built with an ``owner``)."""
        if self._reporter is not None:
            self._reporter.start()

    def stop_reporter(self) -> None:
        """Stop the reporter thread, if one runs (the counts go on)."""
        if self._reporter is not None:
            self._reporter.stop()

    def close(self) -> None:
        """Stop the reporter; export and log the final summary once."""
        self.stop_reporter()
        with self._report_lock:
            if self._closed:
                return
            self._closed = True
            self._report(final=True)


# -- process-wide registry (for `doctor` and tests) ------------------------------
_audits: weakref.WeakKeyDictionary[Any, Audit] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


@dataclass(frozen=True, eq=False)
class _ObservedSplit:
    """What the split observer reads of one scheduler (split.py: ``Bound``)."""

    scheduler: Scheduler
    stock: SplitFunction
    fifth: FifthArgument | None
    note: Callable[[Request, int], None]


def _observe_split(
    ledger: StepLedger, scheduler: Scheduler, stock: SplitFunction, body: SplitBody
) -> SplitFunction:
    """The split observer bound to one scheduler: vLLM's call, then O(1) notes.

    It has vLLM's method's parameters (``split.bind_route``) and passes every
    argument on unchanged, so the answer is vLLM's; prefill chunks are noted
    until the step's output says whether they ran. One-token calls (decodes,
    most calls) are left to the ledger's look at the output.
    """
    observed = _ObservedSplit(scheduler, stock, fifth_argument(body), ledger.note)
    return bind_route(_observed_split, observed, body.past_prefill_shortcut)


def _observed_split(
    observed: _ObservedSplit,
    request: Request,
    num_new_tokens: int,
    num_new_local_computed_tokens: int,
    num_external_computed_tokens: int,
) -> int:
    num_tokens = call_vllm(
        observed,
        request,
        num_new_tokens,
        num_new_local_computed_tokens,
        num_external_computed_tokens,
    )
    if num_new_tokens > 1 and num_tokens > 0:
        observed.note(
            request,
            chunk_start(
                request, num_new_local_computed_tokens, num_external_computed_tokens
            ),
        )
    return num_tokens


def _vllm_method(scheduler: Scheduler, name: str) -> Callable[..., Any]:
    """vLLM's own method, bound to ``scheduler``."""
    for klass in type(scheduler).__mro__:
        if name in vars(klass):
            return vars(klass)[name].__get__(scheduler, type(scheduler))  # type: ignore[no-any-return]
    raise AttributeError(f"{type(scheduler).__name__} has no {name}")


def _observe_steps(scheduler: Scheduler, audit: Audit) -> None:
    """Observe ``schedule`` and ``shutdown`` through attributes of this
    scheduler instance (the class is untouched): each calls vLLM's method and
    returns its result unchanged."""
    schedule = _vllm_method(scheduler, "schedule")
    shutdown = _vllm_method(scheduler, "shutdown")
    after_schedule = audit.after_schedule

    def observed_schedule(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        after_schedule(output)
        return output

    def observed_shutdown(*args: Any, **kwargs: Any) -> Any:
        try:
            return shutdown(*args, **kwargs)
        finally:
            audit.close()

    for name, observer in (
        ("schedule", observed_schedule),
        ("shutdown", observed_shutdown),
    ):
        scheduler.__dict__[name] = observer
        if getattr(scheduler, name) is not observer:
            raise MambaAlignError(
                f"vllm-mamba-align audit: cannot observe {type(scheduler).__name__}."
                f"{name} on this vLLM (a descriptor shadows the instance attribute);"
                " unset VLLM_MAMBA_ALIGN_MODE=audit to run stock vLLM."
            )


def install(
    scheduler: Scheduler,
    state_block: int,
    body: SplitBody,
    stock_split: SplitFunction,
    retention: Retention | None = None,
    **options: Any,
) -> SplitFunction:
    """Create the audit of one scheduler, bind its observers, register it weakly.

    Every observer returns exactly what vLLM's method returns, called with the
    same arguments: the scheduler schedules as stock. ``schedule`` and
    ``shutdown`` are observed through attributes of this scheduler instance (the
    class is untouched); the split observer (around ``stock_split``, vLLM's own
    function) is returned for ``activation`` to bind as this scheduler's split.
    """
    from .export import audit_exporter

    options.setdefault("interval", settings.audit_interval())
    options.setdefault("export", audit_exporter(scheduler))
    options.setdefault(
        "backend_checkpoint",
        own_slot_write(scheduler, stock_split, body, state_block),
    )
    audit = Audit(
        state_block,
        int(scheduler.cache_config.block_size),
        body.prefill,
        retention,
        live_requests=scheduler.requests,
        owner=scheduler,
        **options,
    )
    _observe_steps(scheduler, audit)
    with _lock:
        _audits[scheduler] = audit
    setattr(scheduler, AUDIT_ATTRIBUTE, audit)
    audit.start_reporter()
    return _observe_split(audit.ledger, scheduler, stock_split, body)


def audit_of(scheduler: object) -> Audit | None:
    """The scheduler's audit, or None when it does not run in audit mode."""
    audit = getattr(scheduler, AUDIT_ATTRIBUTE, None)
    return audit if isinstance(audit, Audit) else None


def snapshot(scheduler: object) -> AuditSnapshot | None:
    """The scheduler's audit figures now, or None when it is not audited."""
    audit = audit_of(scheduler)
    return None if audit is None else audit.snapshot()


def live_snapshots() -> list[AuditSnapshot]:
    """Figures of every audited scheduler still alive in this process."""
    with _lock:
        audits = list(_audits.values())
    return [audit.snapshot() for audit in audits]
