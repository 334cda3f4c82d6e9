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
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import settings
from .checkpoints import own_slot_write
from .errors import MambaAlignError
from .releases import PrefillRule, SplitBody, in_prefill
from .retention import Retention
from .signature import SplitFunction, present_as

# Where the audit lives on a scheduler instance (next to SPLIT_ATTRIBUTE's fix).
AUDIT_ATTRIBUTE = "_vllm_mamba_align_audit"
# Per-request bits, on vLLM's Request object (dies with the request).
REQUEST_FLAGS = "_vllm_mamba_align_audit_flags"
# (end of the request's last prefill chunk, whether its chunks were canonical).
REQUEST_CHAIN = "_vllm_mamba_align_audit_chain"
_SEEN = 1
_AFFECTED = 2
_POISONING = 4

DEFAULT_INTERVAL_SECONDS = 60.0
"""A summary line at most this often, and only when the counts changed."""

LOGGER_NAME = "vllm.plugins.mamba_align"

ACTIVE_STATUS = (
    "AUDIT, mode=audit: stock vLLM schedules unchanged; counting would-be-poisoned "
    "slots and skipped state boundaries (a summary when changed, every "
    f"{DEFAULT_INTERVAL_SECONDS:.0f} s by default ({settings.AUDIT_INTERVAL_VARIABLE})"
    " and at shutdown; the first would-be-poisoned slot at once)"
)
REPORT_TICK_SECONDS = 1.0
"""How often the reporter thread looks at the counts (export; summary when due)."""


@dataclass(frozen=True)
class AuditSnapshot:
    """The figures of one scheduler's audit at one moment."""

    state_block: int
    """B: the Mamba state grid (``MambaSpec.block_size``)."""
    cache_block: int
    """C: the grid stock vLLM ends chunks on (``cache_config.block_size``)."""
    prefill_chunks: int
    prefill_tokens: int
    poisoned_slots: int
    """Slots vLLM publishes under the hash of a boundary whose state they do not
    hold: each one serves a wrong state to every request that hits it."""
    skipped_boundaries: int
    """Kept B boundaries crossed inside a chunk: their state is never materialized."""
    noncanonical_states: int
    """Kept states computed by other chunks than one B block per chunk."""
    requests: int
    """Requests with at least one prefill chunk scheduled."""
    requests_affected: int
    """Requests with a would-be-poisoned slot or a skipped boundary."""
    requests_poisoning: int
    """Requests with a would-be-poisoned slot."""
    elapsed_seconds: float

    def summary(self) -> str:
        """The one-line summary the audit logs."""
        return (
            f"vllm-mamba-align audit (B={self.state_block}, C={self.cache_block}): "
            f"{self.prefill_chunks:,} prefill chunks, "
            f"{self.poisoned_slots:,} would-be-poisoned slots, "
            f"{self.skipped_boundaries:,} skipped state boundaries, "
            f"{self.noncanonical_states:,} non-canonical kept states, "
            f"{self.requests_affected:,} of {self.requests:,} requests affected "
            f"({self.requests_poisoning:,} poisoning), "
            f"{self.prefill_tokens:,} prefill tokens scheduled in "
            f"{format_duration(self.elapsed_seconds)}"
        )


def format_duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h12m``: short and unambiguous in a log line."""
    total = int(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _vllm_log(line: str) -> None:
    from vllm.logger import init_logger

    init_logger(LOGGER_NAME).info("%s", line)


def _vllm_warn(line: str) -> None:
    from vllm.logger import init_logger

    init_logger(LOGGER_NAME).warning("%s", line)


class Audit:
    """One scheduler's counters and its summary cadence."""

    __slots__ = (
        "__weakref__",
        "_closed",
        "_exported_chunks",
        "_last_log",
        "_logged_chunks",
        "_pending",
        "_prefilling",
        "_report_lock",
        "_reporter",
        "_started",
        "_warned_poison",
        "backend_checkpoint",
        "cache_block",
        "clock",
        "export",
        "interval",
        "live_requests",
        "log",
        "noncanonical_states",
        "poisoned_slots",
        "prefill_chunks",
        "prefill_rule",
        "prefill_tokens",
        "requests",
        "requests_affected",
        "requests_poisoning",
        "retention",
        "skipped_boundaries",
        "state_block",
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
        log: Callable[[str], None] = _vllm_log,
        warn: Callable[[str], None] = _vllm_warn,
        export: Callable[[AuditSnapshot], None] | None = None,
        backend_checkpoint: Callable[[Any, int, int], int] | None = None,
    ) -> None:
        self.state_block = state_block
        self.backend_checkpoint = backend_checkpoint
        """The B boundary inside a request's chunk ``(start, end)`` whose state
        the GPU backend writes into that boundary's own slot (0: none), where
        the Mamba spec reserves checkpoint blocks
        (:func:`checkpoints.own_slot_write`);
        None: no in-chunk state is counted as written (upper bounds)."""
        self.cache_block = cache_block
        self.prefill_rule = prefill_rule
        self.retention = retention or Retention(None, state_block, state_block, "dense")
        self.interval = interval
        self.clock = clock
        self.log = log
        self.warn = warn
        self.export = export
        """Where the figures go besides the log (Prometheus counters), if any."""
        self.prefill_chunks = 0
        self.prefill_tokens = 0
        self.poisoned_slots = 0
        self.skipped_boundaries = 0
        self.noncanonical_states = 0
        self.requests = 0
        self.requests_affected = 0
        self.requests_poisoning = 0
        self._pending: dict[str, Any] = {}
        self._prefilling: dict[str, Any] = {}
        self.live_requests: dict[str, Any] = {}
        """The scheduler's own ``requests`` table (set by :func:`install`)."""
        self._started = clock()
        self._last_log = self._started
        self._logged_chunks = 0
        self._exported_chunks = 0
        self._closed = False
        self._warned_poison = False
        self._report_lock = threading.Lock()
        self._reporter: _Reporter | None = None

    def after_schedule(self, output: Any) -> None:
        """Count the prefill chunks this ``schedule()`` really scheduled.

        Chunks the split observer noted are confirmed by the output (a chunk can
        be proposed and then not scheduled when its blocks do not fit). The
        observer skips one-token calls, which are mostly decodes; a one-token
        chunk crosses no boundary, but it is a prefill chunk when its request is
        new or known to be mid-prefill, and those are few: they are looked up
        here.
        """
        scheduled = output.num_scheduled_tokens
        pending = self._pending
        prefilling = self._prefilling
        for new in output.scheduled_new_reqs:
            request_id = new.req_id
            if request_id not in pending and scheduled.get(request_id) == 1:
                prefilling[request_id] = self.live_requests[request_id]
        for request_id, request in pending.items():
            count = scheduled.get(request_id, 0)
            if count > 0:
                self._count_scheduled(request, count)
        if prefilling:
            for request_id in [r for r in prefilling if r not in pending]:
                count = scheduled.get(request_id, 0)
                if count == 1:
                    self._count_scheduled(prefilling[request_id], 1)
                elif count == 0 and request_id not in self.live_requests:
                    del prefilling[request_id]  # finished or aborted
        pending.clear()
        if self.poisoned_slots and not self._warned_poison:
            self._warn_first_poison()

    def _count_scheduled(self, request: Any, count: int) -> None:
        """Count a scheduled chunk of ``count`` tokens if it is prefill, and note
        whether prefill goes on after it.

        Both judged by the installed body's rule (:func:`releases.in_prefill`),
        the same predicate the split observer and the fix use. Between the split
        call and this look at the step's output vLLM changes only
        ``num_computed_tokens``, so the judgement at ``start`` is the body's own.
        """
        end = request.num_computed_tokens  # vLLM advanced it by the scheduled count
        start = end - count
        rule = self.prefill_rule
        if in_prefill(rule, request, start):
            self.count_chunk(request, start, end)
            if in_prefill(rule, request, end):
                self._prefilling[request.request_id] = request
                return
        self._prefilling.pop(request.request_id, None)

    def count_chunk(self, request: Any, start: int, end: int) -> None:
        """Classify one scheduled prefill chunk ``[start, end)``."""
        grid = self.state_block
        retention = self.retention
        self.prefill_chunks += 1
        self.prefill_tokens += end - start
        flags = getattr(request, REQUEST_FLAGS, 0)
        new_flags = flags | _SEEN
        # Boundaries k * B with start < k * B < end, and which of them vLLM keeps.
        crossed = (end - 1) // grid - start // grid
        if crossed > 0:
            kept = retention.count_kept_between(request, start, end)
            first = (start // grid + 1) * grid
            poisoned = 1 if start % grid and retention.keeps(request, first) else 0
            backend = self.backend_checkpoint
            written = backend(request, start, end) if backend is not None else 0
            if written and retention.keeps(request, written):
                # The backend writes that boundary's state into its own slot:
                # neither skipped nor (the start's block, when it is that slot)
                # poisoned.
                kept -= 1
                if written == first:
                    poisoned = 0
            self.poisoned_slots += poisoned
            self.skipped_boundaries += kept - poisoned
            if kept:
                new_flags |= _AFFECTED | (_POISONING if poisoned else 0)
        # Canonical: one B block per chunk, from a start on the grid.
        chain: tuple[int, bool] | None = getattr(request, REQUEST_CHAIN, None)
        continues = chain is not None and chain[0] == start
        canonical = (chain[1] if chain and continues else start % grid == 0) and (
            start % grid == 0 and end - start == grid
        )
        setattr(request, REQUEST_CHAIN, (end, canonical))
        if not canonical and end % grid == 0 and retention.keeps(request, end):
            self.noncanonical_states += 1
        if new_flags != flags:
            setattr(request, REQUEST_FLAGS, new_flags)
            gained = new_flags & ~flags
            self.requests += gained & _SEEN
            self.requests_affected += (gained & _AFFECTED) >> 1
            self.requests_poisoning += (gained & _POISONING) >> 2

    # -- reading and logging ----------------------------------------------------
    def snapshot(self) -> AuditSnapshot:
        return AuditSnapshot(
            state_block=self.state_block,
            cache_block=self.cache_block,
            prefill_chunks=self.prefill_chunks,
            prefill_tokens=self.prefill_tokens,
            poisoned_slots=self.poisoned_slots,
            skipped_boundaries=self.skipped_boundaries,
            noncanonical_states=self.noncanonical_states,
            requests=self.requests,
            requests_affected=self.requests_affected,
            requests_poisoning=self.requests_poisoning,
            elapsed_seconds=self.clock() - self._started,
        )

    def _warn_first_poison(self) -> None:
        """Say at once, at WARNING, that stock vLLM published a wrong state."""
        self._warned_poison = True
        self.warn(
            "vllm-mamba-align: the audit found the first would-be-poisoned slot "
            f"(B={self.state_block}, C={self.cache_block}): a prefill chunk "
            "started off the Mamba "
            "state grid and ran past a boundary, so vLLM published a Mamba slot "
            "under the hash of a state it does not hold; requests that share that "
            "prefix continue from a wrong state. Switch the fix on: unset "
            f"{settings.MODE_VARIABLE} (default {settings.DEFAULT_MODE.value}) or set "
            "it to grid or full."
        )

    def _emit(self, now: float) -> None:
        self._last_log = now
        self._logged_chunks = self.prefill_chunks
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
        chunks = self.prefill_chunks
        if self.export is not None and (final or chunks != self._exported_chunks):
            self._exported_chunks = chunks
            self.export(self.snapshot())
        if final:
            self._emit(self.clock())
        elif chunks != self._logged_chunks:
            now = self.clock()
            if now - self._last_log >= self.interval:
                self._emit(now)

    def start_reporter(self, owner: Any) -> None:
        """Report every ``REPORT_TICK_SECONDS`` on a daemon thread while ``owner``
        (the scheduler, weakly held) lives and until :meth:`close`."""
        self._reporter = _Reporter(self, owner)
        self._reporter.start()

    def stop_reporter(self) -> None:
        """Stop the reporter thread, if one runs (the counts go on)."""
        reporter = self._reporter
        if reporter is not None:
            reporter.stop()

    def close(self) -> None:
        """Stop the reporter; export and log the final summary once."""
        self.stop_reporter()
        with self._report_lock:
            if self._closed:
                return
            self._closed = True
            self._report(final=True)


class _Reporter(threading.Thread):
    """One audited scheduler's timer: :meth:`Audit.report` every tick."""

    def __init__(self, audit: Audit, owner: Any) -> None:
        super().__init__(name="vllm-mamba-align-audit", daemon=True)
        self._audit = audit
        self._owner = weakref.ref(owner)
        self._stopped = threading.Event()
        self._tick = min(REPORT_TICK_SECONDS, audit.interval)

    def run(self) -> None:
        while not self._stopped.wait(self._tick):
            if self._owner() is None:
                return  # the scheduler is gone without a shutdown
            self._audit.report()

    def stop(self) -> None:
        self._stopped.set()
        if self is not threading.current_thread():
            self.join(timeout=5)


# -- process-wide registry (for `doctor` and tests) ------------------------------
_audits: weakref.WeakKeyDictionary[Any, Audit] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _observe_split(
    audit: Audit, scheduler: Any, stock: SplitFunction, body: SplitBody
) -> SplitFunction:
    """The split observer bound to one scheduler: vLLM's call, then O(1) notes.

    It has vLLM's method's parameters (one variant per signature, chosen here)
    and passes every argument on unchanged, so the answer is vLLM's; prefill
    chunks are remembered until the step's output says whether they ran.
    One-token calls (decodes, most calls) are left to ``after_schedule``.
    """
    pending = audit._pending
    prefill_rule = audit.prefill_rule

    def note(request: Any, start: int) -> None:
        if in_prefill(prefill_rule, request, start):
            pending[request.request_id] = request

    def observed_split(
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        num_tokens: int = stock(
            scheduler,
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )
        if num_new_tokens > 1 and num_tokens > 0:
            start = (
                request.num_computed_tokens
                + num_new_local_computed_tokens
                + num_external_computed_tokens
            )
            note(request, start)
        return num_tokens

    def observed_split_with_prefix_tokens(
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        num_uncached_common_prefix_tokens: int = 0,
    ) -> int:
        num_tokens: int = stock(
            scheduler,
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
            num_uncached_common_prefix_tokens,
        )
        if num_new_tokens > 1 and num_tokens > 0:
            start = (
                request.num_computed_tokens
                + num_new_local_computed_tokens
                + num_external_computed_tokens
            )
            note(request, start)
        return num_tokens

    route = (
        observed_split
        if body.extra_parameter is None
        else observed_split_with_prefix_tokens
    )
    return present_as(route, stock)


def _vllm_method(scheduler: Any, name: str) -> Any:
    """vLLM's own method, bound to ``scheduler``."""
    for klass in type(scheduler).__mro__:
        if name in vars(klass):
            return vars(klass)[name].__get__(scheduler, type(scheduler))
    raise AttributeError(f"{type(scheduler).__name__} has no {name}")


def install(
    scheduler: Any,
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
    from . import metrics

    options.setdefault("interval", settings.audit_interval())
    options.setdefault("export", metrics.audit_exporter(scheduler))
    options.setdefault(
        "backend_checkpoint",
        own_slot_write(scheduler, stock_split, body, state_block),
    )
    audit = Audit(
        state_block,
        int(scheduler.cache_config.block_size),
        body.prefill,
        retention,
        **options,
    )
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
    audit.live_requests = scheduler.requests
    with _lock:
        _audits[scheduler] = audit
    setattr(scheduler, AUDIT_ATTRIBUTE, audit)
    audit.start_reporter(scheduler)
    return _observe_split(audit, scheduler, stock_split, body)


def audit_of(scheduler: Any) -> Audit | None:
    """The scheduler's audit, or None when it does not run in audit mode."""
    audit = getattr(scheduler, AUDIT_ATTRIBUTE, None)
    return audit if isinstance(audit, Audit) else None


def snapshot(scheduler: Any) -> AuditSnapshot | None:
    """The scheduler's audit figures now, or None when it is not audited."""
    audit = audit_of(scheduler)
    return None if audit is None else audit.snapshot()


def live_snapshots() -> list[AuditSnapshot]:
    """Figures of every audited scheduler still alive in this process."""
    with _lock:
        audits = list(_audits.values())
    return [audit.snapshot() for audit in audits]
