"""Per-scheduler decision: stand aside, refuse to start, or bind a route.

Runs right after vLLM's own ``Scheduler.__init__``, when the KV-cache groups are
known. :func:`attach` reads the mode once and walks :data:`DECISION`, one ordered
table of (condition, outcome); the first row whose condition holds decides.
``vllm-mamba-align doctor`` walks the same table on the installed vLLM (with no
scheduler built, the rows that read one are "decided at start"), so its account
cannot disagree with what a scheduler does. Every scheduler logs exactly one line
through vLLM's logger; the words are messages.py's (refusals.py's, loaded only
to refuse).
"""

from __future__ import annotations

import ast
import enum
import functools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import hazard, messages, metrics, settings
from .errors import MambaAlignError
from .geometry import MambaGroup, mamba_groups
from .layers import Chain, Finding, walk
from .policy import StopPolicy, step_budget
from .recognition import SPLIT_METHOD as SPLIT_METHOD  # re-exported
from .recognition import Recognition, split_findings
from .releases import SplitBody
from .retention import Retention, read_retention
from .settings import Mode
from .split import SplitFunction, state_grid_split
from .subclasses import foreign_classes, problems

if TYPE_CHECKING:
    from .protocols import Scheduler

# The attribute upstream's fix (PR #54076) adds; if vLLM set it itself, the fix landed.
STATE_BLOCK_ATTRIBUTE = "mamba_state_block_size"
# Where the installed fix lives on a scheduler instance.
SPLIT_ATTRIBUTE = "_vllm_mamba_align_split"


def attach(scheduler: Scheduler, recognition: Recognition) -> None:
    """Decide for one freshly built scheduler; raise to refuse it, never half-apply.

    The mode is read once, first; each fact a row reads is read once, when a
    row first asks (:class:`Facts`).
    """
    facts = Facts(settings.read_mode(), recognition, type(scheduler), scheduler)
    refusal = decide(facts).act(facts)
    if refusal is not None:
        raise refusal


class Outcome(enum.Enum):
    """What a row of :data:`DECISION` does to the scheduler."""

    STAND_ASIDE = "stand aside"
    """vLLM's split runs as it would without the plugin; no attribute is set."""
    REFUSE = "refuse"
    """The scheduler does not start: its error names the ways out."""
    BIND = "bind a route"
    """The scheduler's split calls go to the route bound on it."""


class Facts:
    """What the rows' conditions read about one scheduler, each read when a
    row first asks and then kept: a row's condition and its act read the same.

    ``scheduler`` is None for ``doctor``, which judges the installed vLLM
    without building a scheduler; a condition that reads one then answers None
    (decided at start, :func:`at_start`)."""

    def __init__(
        self,
        mode: Mode,
        recognition: Recognition,
        scheduler_class: type,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.mode = mode
        self.recognition = recognition
        self.scheduler_class = scheduler_class
        self.scheduler = scheduler

    @property
    def built(self) -> Scheduler:
        """The scheduler (only a condition under :func:`at_start` reads it)."""
        assert self.scheduler is not None, "a row reads a scheduler doctor has not"
        return self.scheduler

    @property
    def body(self) -> SplitBody:
        """The split body's rules (every row below unknown code has them)."""
        body = self.recognition.body
        assert body is not None
        return body

    @functools.cached_property
    def upstream(self) -> bool:
        return upstream_fix_present(self.scheduler_class)

    @functools.cached_property
    def chain(self) -> Chain:
        """The split's layers, walked once: the refusal checks, mode ``off``'s
        binding and its start line read this one walk."""
        return walk(self.scheduler_class, SPLIT_METHOD)

    @functools.cached_property
    def findings(self) -> tuple[Finding, ...]:
        return split_findings(self.recognition, self.chain)

    @functools.cached_property
    def subclass_problems(self) -> tuple[type, list[str]] | None:
        """Another distribution's class in the scheduler's MRO whose code the
        fix cannot run in, and why (subclasses.py); None when there is none."""
        for klass in foreign_classes(self.scheduler_class):
            reasons = problems(klass, self.mode is Mode.AUDIT)
            if reasons:
                return klass, reasons
        return None

    @functools.cached_property
    def groups(self) -> list[MambaGroup]:
        return mamba_groups(self.built.kv_cache_config)

    @functools.cached_property
    def state_grid(self) -> int | None:
        """B: the one block size of the Mamba groups (None: they disagree, or
        there are none)."""
        sizes = {group.block_size for group in self.groups}
        return next(iter(sizes)) if len(sizes) == 1 else None

    @property
    def grid(self) -> int:
        """B, for the rows after the groups were found to agree."""
        assert self.state_grid is not None
        return self.state_grid

    @functools.cached_property
    def retention(self) -> Retention:
        return read_retention(self.built, self.grid)

    @functools.cached_property
    def policy(self) -> StopPolicy:
        return StopPolicy.for_scheduler(
            self.mode, self.body, self.retention, self.built, self.grid
        )


Condition = Callable[[Facts], bool | None]


def at_start(condition: Callable[[Facts], bool]) -> Condition:
    """A condition on the scheduler vLLM builds for a model: None (decided at
    start) where there is none, as in ``doctor``."""

    def holds(facts: Facts) -> bool | None:
        return None if facts.scheduler is None else condition(facts)

    return holds


@dataclass(frozen=True)
class Row:
    """One row of :data:`DECISION`."""

    key: str
    """Names the row for ``doctor`` and the tests."""
    holds: Condition
    outcome: Outcome
    act: Callable[[Facts], MambaAlignError | None]
    """A refusing row's act returns its error and changes nothing (``doctor``
    calls it for the words); any other row's binds its route, if any, and logs
    the start line."""


def decide(facts: Facts) -> Row:
    """The first row of :data:`DECISION` whose condition holds."""
    for row in DECISION:
        if row.holds(facts):
            return row
    raise AssertionError("the table's last row holds for every scheduler")


def rows_walked(facts: Facts) -> list[tuple[Row, bool | None]]:
    """The rows ``doctor`` reads, in order, up to the one that decides, each
    with whether its condition holds (None: decided at start). A row decided at
    start is passed over, as for a hybrid model in align mode whose Mamba groups
    agree and whose B fits the step budget."""
    walked: list[tuple[Row, bool | None]] = []
    for row in DECISION:
        held = row.holds(facts)
        walked.append((row, held))
        if held:
            return walked
    raise AssertionError("the table's last row holds for every scheduler")


# -- the rows' conditions ------------------------------------------------------


@at_start
def _no_align_split(facts: Facts) -> bool:
    scheduler = facts.built
    flag = getattr(scheduler, "need_mamba_block_aligned_split", None)
    if flag is not None:
        return not flag
    has_mamba = bool(getattr(scheduler.kv_cache_config, "has_mamba_layers", False))
    mode = getattr(scheduler.cache_config, "mamba_cache_mode", None)
    return not (has_mamba and mode == "align")


@at_start
def _no_mamba_spec(facts: Facts) -> bool:
    return not facts.groups


@at_start
def _groups_disagree(facts: Facts) -> bool:
    # No single grid can keep every slot's state at its boundary: guessing
    # one would publish wrong states.
    return len({group.block_size for group in facts.groups}) > 1


def _stalls(facts: Facts) -> bool | None:
    # Bodies without vLLM's "block too wide for one chunk" rule floor every
    # non-final chunk to the grid; on the B grid a B wider than the step budget
    # floors to 0 tokens forever. Known without a scheduler where the body has it.
    return False if facts.body.wide_block_exemption else _wider_than_budget(facts)


@at_start
def _wider_than_budget(facts: Facts) -> bool:
    return facts.grid > step_budget(facts.built)[0]


@at_start
def _schedules_as_vllm(facts: Facts) -> bool:
    return facts.policy.schedules_as_vllm(facts.built.cache_config.block_size)


def _has_unverified_layer(facts: Facts) -> bool:
    return any(not finding.verified for finding in facts.findings)


# -- the rows' acts ------------------------------------------------------------


def _inactive(status: str) -> Callable[[Facts], None]:
    def act(facts: Facts) -> None:
        _log(facts, status)

    return act


def _upstream_stands_aside(facts: Facts) -> None:
    _log(
        facts,
        messages.UPSTREAM_STATUS,
        getattr(facts.built, STATE_BLOCK_ATTRIBUTE, None),
    )


def _off(facts: Facts) -> None:
    """Mode ``off``: refuse nothing, bind vLLM's own split (or leave another
    plugin's layer in place), and say on the start line what a fixing mode
    would have refused, so an A/B run shows why the two differ."""
    _bind_unchanged(facts.built, facts.chain)
    disagreeing = facts.groups if facts.state_grid is None else ()
    _log(facts, messages.off_status(facts.findings, disagreeing), facts.state_grid)


def _audit(facts: Facts) -> None:
    """Stock schedules, counted: no stall guard needed. The audit is loaded
    only here."""
    from . import audit

    scheduler = facts.built
    observer = audit.install(
        scheduler, facts.grid, facts.body, facts.recognition.split, facts.retention
    )
    _bind_split(scheduler, observer)
    _log(facts, f"{audit.ACTIVE_STATUS}; {facts.retention.describe()}", facts.grid)


def _bind_vllms_split(facts: Facts) -> None:
    """Nothing to change on this scheduler: vLLM's own function, no layer."""
    scheduler = facts.built
    _bind_split(scheduler, facts.recognition.split.__get__(scheduler, type(scheduler)))
    _activated(facts, messages.schedules_as_vllm_note(facts.body.name))


def _bind_fix(facts: Facts) -> None:
    scheduler = facts.built
    route = state_grid_split(
        scheduler, facts.recognition.split, facts.policy, facts.retention, facts.body
    )
    _bind_split(scheduler, route)
    _activated(facts)


def _activated(facts: Facts, note: str = "") -> None:
    scheduler = facts.built
    setattr(scheduler, STATE_BLOCK_ATTRIBUTE, facts.grid)
    status = messages.active_status(
        facts.mode,
        facts.retention,
        facts.policy.yield_replay_to_checkpoint,
        facts.recognition.vllm_version,
        note,
    )
    _log(facts, status, facts.grid)


# The refusals' words are loaded only to refuse (a scheduler that starts never
# imports refusals.py).


def _refuse_disagreeing_groups(facts: Facts) -> MambaAlignError:
    from . import refusals

    listing = "; ".join(group.describe() for group in facts.groups)
    return refusals.refuse_disagreeing_groups(listing, facts.recognition.vllm_version)


def _refuse_unverified_layers(facts: Facts) -> MambaAlignError:
    from . import refusals

    return refusals.refuse_unverified_layers(
        facts.recognition, facts.chain, facts.findings
    )


def _refuse_unknown_code(facts: Facts) -> MambaAlignError:
    from . import refusals

    return refusals.refuse_unknown_code(facts.recognition)


def _refuse_subclass(facts: Facts) -> MambaAlignError:
    from . import refusals

    assert facts.subclass_problems is not None
    klass, reasons = facts.subclass_problems
    return refusals.refuse_subclass(facts.scheduler_class, klass, reasons)


def _refuse_stall(facts: Facts) -> MambaAlignError:
    from . import refusals

    budget, source = step_budget(facts.built)
    return refusals.refuse_stall(facts.body, facts.grid, budget, source)


DECISION: tuple[Row, ...] = (
    Row(
        "no_align_split",
        _no_align_split,
        Outcome.STAND_ASIDE,
        _inactive(messages.NO_ALIGN_SPLIT_STATUS),
    ),
    Row(
        "upstream_fix",
        lambda facts: facts.upstream,
        Outcome.STAND_ASIDE,
        _upstream_stands_aside,
    ),
    Row(
        "no_mamba_spec",
        _no_mamba_spec,
        Outcome.STAND_ASIDE,
        _inactive(messages.NO_MAMBA_SPEC_STATUS),
    ),
    # Mode off changes nothing, whatever the rows below would find.
    Row("off", lambda facts: facts.mode is Mode.OFF, Outcome.STAND_ASIDE, _off),
    Row(
        "disagreeing_groups",
        _groups_disagree,
        Outcome.REFUSE,
        _refuse_disagreeing_groups,
    ),
    Row(
        "unverified_layers",
        _has_unverified_layer,
        Outcome.REFUSE,
        _refuse_unverified_layers,
    ),
    Row(
        "unknown_code",
        lambda facts: facts.recognition.body is None,
        Outcome.REFUSE,
        _refuse_unknown_code,
    ),
    Row(
        "foreign_subclass",
        lambda facts: facts.subclass_problems is not None,
        Outcome.REFUSE,
        _refuse_subclass,
    ),
    Row("audit", lambda facts: facts.mode is Mode.AUDIT, Outcome.BIND, _audit),
    Row("stall", _stalls, Outcome.REFUSE, _refuse_stall),
    Row("as_vllm", _schedules_as_vllm, Outcome.BIND, _bind_vllms_split),
    Row("fix", lambda facts: True, Outcome.BIND, _bind_fix),
)
"""The decision, first row first: the first whose condition holds decides."""


# -- the upstream fix ----------------------------------------------------------


def upstream_fix_present(scheduler_class: type) -> bool:
    """Whether vLLM's own scheduler code derives ``mamba_state_block_size``
    itself (upstream's fix, PR #54076, is in this vLLM): some module of the
    class's MRO assigns that attribute.

    Read from the source, not an instance: the plugin sets the same attribute on
    the schedulers it fixes. Each file is parsed once per process.
    """
    for klass in scheduler_class.__mro__:
        module = sys.modules.get(klass.__module__)
        source_file = getattr(module, "__file__", None)
        if source_file and _assigns_state_block(source_file):
            return True
    return False


@functools.lru_cache(maxsize=16)
def _assigns_state_block(source_file: str) -> bool:
    try:
        tree = ast.parse(Path(source_file).read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    return any(
        isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and node.attr == STATE_BLOCK_ATTRIBUTE
        for node in ast.walk(tree)
    )


# -- binding and the start line ------------------------------------------------


def _bind_unchanged(scheduler: Scheduler, chain: Chain) -> None:
    """Mode off: this scheduler calls what vLLM would call without the plugin.

    Where this plugin's wrapper is the class's outermost layer, the scheduler is
    bound straight to what that wrapper wraps (vLLM's function, or another
    plugin's layer installed before this one), skipping the wrapper's frames.
    Otherwise (another plugin's layer above ours, a subclass's override) nothing
    is bound and vLLM calls that layer, which runs as its plugin wrote it.
    """
    below = chain.below_own_layer()
    if below is not None and type(below.target) is types.FunctionType:
        _bind_split(scheduler, below.target.__get__(scheduler, type(scheduler)))


def _bind_split(scheduler: Scheduler, route: SplitFunction) -> None:
    """Bind this scheduler's split calls straight to ``route``.

    vLLM calls ``self._mamba_block_aligned_split`` for every running request at
    every step, decodes included. The class-level wrapt wrapper would add its
    layers to each of those calls; an attribute on the scheduler instance shadows
    it, so this scheduler's calls go straight to the fix (or straight to vLLM's
    own function when there is nothing to fix). The class wrapper stays, and
    routes any call made through the class to the same place.
    """
    scheduler.__dict__[SPLIT_ATTRIBUTE] = route
    scheduler.__dict__[SPLIT_METHOD] = route


def _logger() -> Any:
    from vllm.logger import init_logger

    return init_logger("vllm.plugins.mamba_align")


def _log(facts: Facts, status: str, state_grid: int | None = None) -> None:
    scheduler = facts.built
    recognition = facts.recognition
    _logger().info(
        "%s",
        messages.start_line(scheduler, recognition, facts.mode, status, state_grid),
    )
    hazard.warn_known_defects(
        scheduler, recognition.vllm_version, _logger(), state_grid
    )
    metrics.publish_info(
        scheduler,
        mode=facts.mode.value,
        status=metrics.status_word(status),
        state_block=state_grid,
        vllm_version=recognition.vllm_version,
    )
