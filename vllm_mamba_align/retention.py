"""Which Mamba boundary states vLLM keeps: its prefix-cache state retention.

A chunk that ends on a B boundary writes that boundary's state, but vLLM publishes
(keeps) it only where its retention setting says so; an unkept state is dropped
when the request moves on. So a stop at a boundary pays a prefill step, and buys
a reusable state only when the boundary is kept. vLLM's rule, per release:

- before 0.24.0: no setting reaches Mamba states, every boundary is kept (dense;
  0.23.0 reads the variable below for sliding-window groups only);
- 0.24.0-0.28.0: ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` (default dense), read
  when the KV-cache coordinator is built; reachable positions are floored to the
  scheduler block; shared-prefix junctions are kept from 0.26.0;
- 0.29.0+: ``--prefix-cache-retention-interval``
  (``CacheConfig.prefix_cache_retention_interval``), **default 0** (0.29.0 only:
  dense for a hybrid model with an EAGLE drafter); the engine copies it into the
  ``KVCacheConfig``; reachable positions are floored to the hit alignment;
- 0.30.0+: with EAGLE, two replay positions on the scheduler block; 0.33.0+
  also keep the block below an EAGLE junction.

The mask rule itself (``MambaManager.reachable_block_mask``) is the same in every
release whose Mamba manager has one (``releases.RETENTION_FOR_MAMBA``), but for
the junction. Each of these facts is a row of ``releases.RELEASE_FACTS``;
:func:`read_retention` reads them off the coordinator and the Mamba manager the
scheduler built instead of looking its release up, because that object is what
publishes (a platform's subclass of the manager, a nightly or an opted-in
unverified build answer as their code does): tests/test_release_facts.py holds
each reading to its row on every release of the matrix.

``None`` keeps every boundary; ``0`` keeps only the *reachable* boundaries: the
prompt's replay boundary (where a re-ask or a longer sibling resumes) and a
detected shared-prefix junction (``request.shared_prefix_boundary``); ``R > 0``
also keeps every multiple of R (R is a multiple of the scheduler block, the LCM
of the groups' blocks, so of B). Reachable positions are floored to vLLM's hit
alignment (the hash block when partial hash hits are on, else the scheduler
block) and then to the state grid B.

The values are read from the scheduler's own KV-cache coordinator, where vLLM's
``MambaManager`` reads them when it publishes: nothing is re-derived from the
command line. ``tests/test_retention.py`` holds :meth:`Retention.keeps` against
vLLM's own ``MambaManager.reachable_block_mask`` on the installed release.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .protocols import Request, Scheduler

RETENTION_VARIABLE = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
"""Where 0.24.0-0.28.0 read the setting (later releases: the cache config)."""


@dataclass(frozen=True)
class Retention:
    """One scheduler's retention setting and the facts needed to apply it."""

    interval: int | None
    """None: dense; 0: reachable boundaries only; R > 0: also multiples of R."""
    state_block: int
    """B."""
    alignment: int
    """Token granularity reachable positions are floored to before flooring to B:
    the hash block when partial hash hits are on (0.29.0+), else the scheduler
    block."""
    source: str
    """Where the value came from, for the start line and ``doctor``."""
    replay: Callable[[Request], Sequence[int]] = lambda request: (
        request.num_prompt_tokens - 1,
    )
    """vLLM's replay positions of a request (where a re-ask or a longer sibling
    resumes): ``P - 1``, or vLLM's own EAGLE pair on releases that have one."""
    eagle_junction: bool = False
    """With EAGLE, the block below a junction is kept too
    (``releases.EAGLE_JUNCTION_BLOCK``)."""

    @property
    def dense(self) -> bool:
        """Whether every boundary is kept (also R at or below one state block)."""
        interval = self.interval
        return interval is None or (interval > 0 and interval // self.state_block <= 1)

    def keeps_segment(self, boundary: int) -> bool:
        """Whether ``boundary`` (a multiple of B) is kept for any request."""
        if self.dense:
            return True
        interval = self.interval
        return bool(interval) and boundary % interval == 0  # type: ignore[operator]

    def reachable(self, request: Request) -> tuple[int, ...]:
        """The B boundaries vLLM keeps for ``request`` whatever the segments say."""
        return self._boundaries([*self.replay(request), *self._junctions(request)])

    def _junctions(self, request: Request) -> list[int]:
        """vLLM's junction positions of a request: its detected shared-prefix
        boundary, and with EAGLE the block below it too where vLLM keeps that
        (:attr:`eagle_junction`)."""
        junction = int(getattr(request, "shared_prefix_boundary", 0) or 0)
        if not junction:
            return []
        if self.eagle_junction:
            return [junction, junction - self.state_block]
        return [junction]

    def replay_boundaries(self, request: Request) -> tuple[int, ...]:
        """The B boundaries of :meth:`reachable` that stand for the replay
        positions (the others are junctions)."""
        return self._boundaries(self.replay(request))

    def _boundaries(self, positions: Sequence[int]) -> tuple[int, ...]:
        """Positions floored to the alignment, then to B, as vLLM's mask does
        (``reachable_block_mask``); those below one block dropped."""
        grid = self.state_block
        kept = set()
        for position in positions:
            aligned = position // self.alignment * self.alignment
            boundary = aligned // grid * grid
            if boundary >= grid:
                kept.add(boundary)
        return tuple(sorted(kept))

    def kept_only_as_replay(self, request: Request, boundary: int) -> bool:
        """Whether vLLM keeps ``request``'s state at ``boundary`` for one reason
        only: it is a replay boundary (no junction, no multiple of the
        retention interval, not dense)."""
        if self.keeps_segment(boundary):
            return False
        if boundary not in self.replay_boundaries(request):
            return False
        return boundary not in self._boundaries(self._junctions(request))

    def keeps(self, request: Request, boundary: int) -> bool:
        """Whether vLLM publishes ``request``'s state at ``boundary`` (a multiple
        of B) when a chunk ends there."""
        return self.keeps_segment(boundary) or boundary in self.reachable(request)

    def first_kept_after(self, request: Request, start: int) -> int | None:
        """The first boundary above ``start`` vLLM keeps for ``request``, if any."""
        grid = self.state_block
        if self.dense:
            return (start // grid + 1) * grid
        candidates = [b for b in self.reachable(request) if b > start]
        interval = self.interval
        if interval:
            candidates.append((start // interval + 1) * interval)
        return min(candidates, default=None)

    def kept_in(self, request: Request, low: int, high: int) -> list[int]:
        """The boundaries ``low < b <= high`` vLLM keeps for ``request``, sorted."""
        grid = self.state_block
        first = (low // grid + 1) * grid
        if self.dense:
            return list(range(first, high + 1, grid))
        kept = {b for b in self.reachable(request) if low < b <= high}
        interval = self.interval
        if interval:
            kept.update(range((low // interval + 1) * interval, high + 1, interval))
        return sorted(kept)

    def count_kept_between(self, request: Request, low: int, high: int) -> int:
        """How many boundaries ``low < b < high`` vLLM keeps for ``request``."""
        grid = self.state_block
        if self.dense:
            return max(0, (high - 1) // grid - low // grid)
        kept = {b for b in self.reachable(request) if low < b < high}
        interval = self.interval
        if interval:
            kept.update(range((low // interval + 1) * interval, high, interval))
        return len(kept)

    def describe(self) -> str:
        """The setting and what it keeps, for log lines."""
        if self.interval is None:
            return f"state retention dense ({self.source}): every B boundary kept"
        if self.dense:
            return (
                f"state retention {self.interval} ({self.source}): at most one "
                "state block per segment, so every B boundary kept"
            )
        if self.interval == 0:
            return (
                f"state retention 0 ({self.source}): only replay boundaries and "
                "shared-prefix junctions kept"
            )
        return (
            f"state retention {self.interval} ({self.source}): every multiple of "
            f"{self.interval}, replay boundaries and junctions kept"
        )


def mamba_manager(coordinator: Any) -> Any:
    """The KV-cache coordinator's Mamba manager (None: no Mamba group): the
    object whose class decides what vLLM keeps, a platform's subclass included."""
    from vllm.v1.kv_cache_interface import MambaSpec

    for manager in getattr(coordinator, "single_type_managers", ()):
        if isinstance(getattr(manager, "kv_cache_spec", None), MambaSpec):
            return manager
    return None


def masks_by_retention(manager_class: type) -> bool:
    """Whether a Mamba manager class masks what it publishes by the retention
    setting: some class of its own, not vLLM's generic manager, defines
    ``reachable_block_mask`` (0.24.0+). 0.23.0's coordinator already holds a
    ``retention_interval``, but only its sliding-window manager reads it: its
    Mamba manager inherits the generic mask, which keeps every block."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    owner = next(
        (c for c in manager_class.__mro__ if "reachable_block_mask" in vars(c)), None
    )
    return owner is not None and owner is not SingleTypeKVCacheManager


def read_retention(scheduler: Scheduler, state_block: int) -> Retention:
    """The retention this scheduler's KV-cache manager applies, read where it
    reads it: the coordinator's ``retention_interval`` where the scheduler's
    Mamba manager masks by it (``releases.RETENTION_FOR_MAMBA``), the Mamba
    manager's hit alignment (``releases.HIT_ALIGNMENT``; the scheduler block
    before), vLLM's own replay positions (``releases.EAGLE_REPLAY_PAIR``).
    Read off the built objects, not looked up by release: see the module's
    docstring."""
    coordinator = scheduler.kv_cache_manager.coordinator
    manager = mamba_manager(coordinator)
    scheduler_block = int(
        getattr(coordinator, "scheduler_block_size", 0)
        or getattr(scheduler, "block_size", 0)
        or state_block
    )
    alignment = int(
        getattr(manager, "cache_hit_alignment_tokens", 0) or scheduler_block
    )
    if not hasattr(coordinator, "retention_interval"):  # before 0.23.0
        return Retention(None, state_block, alignment, "no retention setting")
    if manager is None or not masks_by_retention(type(manager)):  # 0.23.0
        return Retention(
            None, state_block, alignment, "no retention setting for Mamba states"
        )
    interval = coordinator.retention_interval
    eagle = bool(
        getattr(coordinator, "drop_eagle_group_ids", None)
        if hasattr(coordinator, "drop_eagle_group_ids")  # EAGLE_JUNCTION_BLOCK
        else getattr(coordinator, "eagle_group_ids", None)  # EAGLE_REPLAY_PAIR
    )
    return Retention(
        interval,
        state_block,
        alignment,
        _source(interval),
        _replay_rule(coordinator, scheduler_block, eagle),
        # The releases with drop_eagle_group_ids (releases.EAGLE_JUNCTION_BLOCK)
        # also keep the block below a junction when the Mamba manager drops
        # EAGLE's last block.
        eagle_junction=hasattr(coordinator, "drop_eagle_group_ids")
        and bool(getattr(manager, "use_eagle", False)),
    )


def _replay_rule(
    coordinator: Any, scheduler_block: int, eagle: bool
) -> Callable[[Request], Sequence[int]]:
    """vLLM's own replay positions for this coordinator (``P - 1`` before
    ``releases.EAGLE_REPLAY_PAIR``)."""
    method = getattr(coordinator, "get_replay_boundaries", None)
    if callable(method):  # before releases.REPLAY_BOUNDARIES_FUNCTION
        return method  # type: ignore[no-any-return]
    module = __import__(type(coordinator).__module__, fromlist=["replay_boundaries"])
    function = getattr(module, "replay_boundaries", None)
    if callable(function) and eagle:  # releases.REPLAY_BOUNDARIES_FUNCTION
        return lambda request: function(  # type: ignore[no-any-return]
            request.num_prompt_tokens, scheduler_block, use_eagle=True
        )
    return lambda request: (request.num_prompt_tokens - 1,)


def _source(interval: int | None) -> str:
    """Where a scheduler's retention value comes from, for messages."""
    default = default_interval()
    if default is NO_FIELD:  # 0.24.0-0.28.0
        raw = os.environ.get(RETENTION_VARIABLE)
        return (
            f"{RETENTION_VARIABLE}={raw}"
            if raw not in (None, "")
            else f"{RETENTION_VARIABLE} unset, vLLM's default"
        )
    name = "prefix_cache_retention_interval"
    return f"{name}={interval}" + (", vLLM's default" if interval == default else "")


NO_FIELD: Any = object()


def default_interval() -> Any:
    """vLLM's default ``prefix_cache_retention_interval`` (0.29.0+): an int or
    None; ``NO_FIELD`` where the cache config has no such field."""
    try:
        from vllm.config import CacheConfig
    except ImportError:
        return NO_FIELD
    field = getattr(CacheConfig, "__dataclass_fields__", {}).get(
        "prefix_cache_retention_interval"
    )
    if field is None:
        return NO_FIELD
    try:
        return CacheConfig().prefix_cache_retention_interval
    except Exception:  # a release whose CacheConfig() needs arguments
        return NO_FIELD
