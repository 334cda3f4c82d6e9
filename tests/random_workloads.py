"""Random workloads on the real scheduler, and the invariants every mode holds.

One generator serves two drivers: the property tests draw through hypothesis
(shrinking, cross-mode comparisons), the sweep (``test_sweep.py``) through a
seeded ``random.Random`` (cheap enough for 10^5 workloads per split body). Both
see the same dimensions: geometry (C, B, hash block, budget, threshold, pool
size), vLLM's state retention, backend prefill checkpoints, a drafter, a KV
connector, async scheduling, staggered arrivals and preemption.
"""

from __future__ import annotations

import functools
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from helpers import (
    async_republishes_partial_tail,
    geometry_rule,
    installed_body,
    lost_kept_states,
    scheduler_mode,
    supports_retention_setting,
    vllm_refuses,
)

from vllm_mamba_align import MambaAlignError
from vllm_mamba_align.checkpoints import installed_manager_skips_scratch_move
from vllm_mamba_align.releases import InternalCheckpoint, PrefillRule
from vllm_mamba_align.retention import read_retention
from vllm_mamba_align.settings import DEFAULT_MODE
from vllm_mamba_align.tools.installed import (
    supports_hash_block,
    supports_lookahead_hashes,
)
from vllm_mamba_align.tools.modes import DEFAULT
from vllm_mamba_align.tools.sim import (
    MAX_MODEL_LEN,
    Geometry,
    KeepDecision,
    Simulation,
    available_checkpoint_backends,
    base_vllm_config,
    prompt,
    supports_admission_window,
)

T = TypeVar("T")

DRAFTER_ODDS = int(os.environ.get("MAMBA_ALIGN_TEST_DRAFTER_ODDS", "4"))
"""One drawn case in this many configures a drafter (1: every case)."""
CONNECTOR_ODDS = 4
"""One drawn case in this many (where vLLM has the API) loads a KV connector."""


class Draw(Protocol):
    """Where a workload's choices come from (hypothesis or a seeded RNG)."""

    def integer(self, low: int, high: int) -> int:
        """A whole number in [low, high]."""
        ...

    def choice(self, options: Sequence[T]) -> T: ...


class HypothesisDraw:
    """Choices drawn by hypothesis (so failures shrink)."""

    def __init__(self, draw: Any) -> None:
        from hypothesis import strategies as st

        self._draw = draw
        self._st = st

    def integer(self, low: int, high: int) -> int:
        return int(self._draw(self._st.integers(low, high)))

    def choice(self, options: Sequence[T]) -> T:
        return self._draw(self._st.sampled_from(list(options)))  # type: ignore[no-any-return]


class RandomDraw:
    """Choices from a seeded RNG (one seed per workload: each one reproducible)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def integer(self, low: int, high: int) -> int:
        return self._rng.randint(low, high)

    def choice(self, options: Sequence[T]) -> T:
        return self._rng.choice(list(options))


@dataclass(frozen=True)
class Workload:
    geometry: Geometry
    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[int]
    """Step at which each request is added (later arrivals hit the cache)."""
    held: list[list[int]] = field(default_factory=list)
    """Prefixes whose states the KV connector's store holds (its external hits)."""


class Unrunnable(Exception):
    """This release cannot run this drawn case at all (redraw it)."""


class VllmDefect(Exception):
    """vLLM itself failed this case, independently of the plugin (recorded with
    its reason, never dropped silently)."""


EXTERNAL_BLOCK_UNDERCOUNTED = (
    "vLLM undercounts the Mamba block of a KV connector's hit and crashes "
    "allocating it (stock too: test_connectors.py::"
    "test_vllm_undercounts_the_mamba_block_of_an_external_hit)"
)


CHECKPOINT_SLOT_FROM_CACHED_TOKENS = (
    "vLLM's Mamba manager finds a request's reserved checkpoint slot from the "
    "tokens it caches this step (cdiv(num_tokens, block_size) - 2) and asserts "
    "the slot exists; a step that caches too few tokens fails the assertion "
    "inside schedule() (stock too: test_checkpoints.py::"
    "test_stock_vllm_fails_the_checkpoint_slot_assertion)"
)


def checkpoint_slot_from_cached_tokens(error: BaseException) -> bool:
    """Whether ``error`` is the assertion of vLLM's
    ``MambaManager._cache_partial_tail_block`` on builds that compute the
    reserved checkpoint slot from the tokens cached in the step (nightly builds
    0.28.1.dev202609061028-0.28.1.dev202609081048; 0.30.0 keeps the slot it
    reserved): read off the failing call's innermost frame."""
    if not isinstance(error, AssertionError):
        return False
    trace = error.__traceback__
    while trace is not None and trace.tb_next is not None:
        trace = trace.tb_next
    return (
        trace is not None
        and trace.tb_frame.f_code.co_name == "_cache_partial_tail_block"
        and trace.tb_frame.f_code.co_filename.endswith(
            "single_type_kv_cache_manager.py"
        )
    )


CHECKPOINT_SLOT_MISKEYED = (
    "vLLM's Mamba manager keys the reserved checkpoint slot from the tokens "
    "it caches this step, floored to the hash block: a final chunk ending "
    "just past a boundary gets the column before the checkpoint's hashed as "
    "the checkpoint (stock publishes the same wrong state on the same chunks)"
)


@functools.cache
def manager_keys_checkpoint_slot_from_cached_tokens() -> bool:
    """Whether the installed Mamba manager finds the reserved checkpoint slot
    from the tokens cached in the step, ``cdiv(num_tokens, block_size) - 2``
    (read from its code: nightly builds 0.28.1.dev202609061028 to
    0.28.1.dev202609081048; 0.30.0 keeps the slot it reserved)."""
    import inspect

    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    method = getattr(MambaManager, "_cache_partial_tail_block", None)
    if method is None:
        return False
    source = "".join(inspect.getsource(method).split())
    return "checkpoint_idx=cdiv(num_tokens,self.block_size)-2" in source


def stock_publishes_alike(workload: Workload, sim: Simulation) -> bool:
    """Whether stock vLLM, on the same workload, ends the same chunks and
    publishes the same wrong states: then the wrong states are vLLM's own."""
    stock = simulate("stock", workload)
    return all(
        stock.chunk_ends(request) == sim.chunk_ends(request) for request in sim.records
    ) and {str(p) for p in stock.poisoned.values()} == {
        str(p) for p in sim.poisoned.values()
    }


def external_block_undercounted(error: BaseException) -> bool:
    """Whether ``error`` is vLLM's own block accounting defect with KV
    connectors (seen on 0.23.0-0.33.0): in align mode the Mamba manager's
    ``get_num_blocks_to_allocate`` asks one block for a request's chunk, but
    ``allocate_slots`` then takes two when the chunk runs past the external
    hit's block (``allocate_external_computed_blocks`` gives the hit its own
    block first), so with the pool at that margin ``get_new_blocks`` raises
    inside vLLM's ``schedule()``. The plugin only picks a chunk length vLLM's
    own check accepted; read off the failing call's frames."""
    if not isinstance(error, ValueError) or "free blocks from the pool" not in str(
        error
    ):
        return False
    frames = []
    trace = error.__traceback__
    while trace is not None:
        frames.append(trace.tb_frame)
        trace = trace.tb_next
    allocating = [f for f in frames if f.f_code.co_name == "allocate_slots"]
    mamba = [
        f
        for f in frames
        if f.f_code.co_name == "allocate_new_blocks"
        and type(f.f_locals.get("self")).__name__ == "MambaManager"
    ]
    return bool(
        allocating
        and mamba
        and allocating[-1].f_locals.get("num_external_computed_tokens", 0) > 0
    )


@functools.cache
def connector_path() -> str | None:
    """The test connector's ``module:Class`` where vLLM serves a hybrid model's
    external hits: a V1 connector API for hybrid models (``SupportsHMA``, a
    ``kv_cache_config`` argument), and a split that takes external tokens
    (older releases assert there are none: measured by one stock run)."""
    import inspect

    try:
        from support import prefix_store_connector as module
    except ImportError:
        return None
    base = module.KVConnectorBase_V1
    if "kv_cache_config" not in inspect.signature(base.__init__).parameters:
        return None
    path = f"{module.MODULE}:{module.NAME}"
    tokens = prompt(40, seed=1)
    try:
        with scheduler_mode("stock"):
            sim = Simulation(Geometry(16, 16, kv_connector=path))
            sim.scheduler.connector.hold(tokens[:20])
            sim.add("probe", tokens)
            sim.run()
    except Exception as error:
        if vllm_refuses(error):
            return None
        raise
    assert ("probe", 20) in sim.store_loads, "the probe's external hit was not taken"
    if connector_hits_resume_from_null_blocks(path):
        return None  # vLLM's own defect (see there): not drawn on this release
    return path


@functools.cache
def connector_hits_resume_from_null_blocks(path: str) -> bool:
    """vLLM's own defect, measured on the installed release (0.24.0; not
    0.27.1, 0.33.0): after a request loaded 99 of its 100 tokens from a KV
    connector, a sibling sharing 60 of them gets a local hit of 48 whose Mamba
    block is the null block (the loaded request never wrote the states below
    its hit, yet vLLM caches them): it would resume from no state at all.
    Stock vLLM, with or without the plugin."""
    tokens = prompt(100, seed=1)
    with scheduler_mode("stock"):
        sim = Simulation(Geometry(16, 16, kv_connector=path))
        sim.scheduler.connector.hold(tokens[:99])
        sim.add("first", tokens)
        sim.run()
        sim.add("sibling", tokens[:60] + prompt(40, seed=2))
        sim.run()
    return any(w.endswith("holding nothing") for w in sim.wrong_reuse)


def divergent_hits_supported() -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "supports_divergent_local_hybrid_hits")


ALIGN_REFUSES_DRAFTERS = "is currently not compatible with speculative decoding"
"""What vLLM says when its config refuses a drafter in align mode (0.15.0-0.16.0,
model_executor/models/config.py); no later release has the refusal."""


@functools.cache
def drafters_build() -> bool:
    """Whether this vLLM builds a SpeculativeConfig (MTP and EAGLE-3) for the
    tests' tiny model. Decided by what vLLM does, not by its version: a config
    that refuses with :data:`ALIGN_REFUSES_DRAFTERS` builds none; any other
    failure is the tests' or vLLM's defect and is raised."""
    try:
        for method in ("mtp", "eagle"):
            base_vllm_config((method, 1))
    except Exception as error:
        if ALIGN_REFUSES_DRAFTERS in str(error):
            return False
        raise
    return True


def draw_workload(
    d: Draw, equal_geometry: bool = False, unset_hash_block: bool = False
) -> Workload:
    """One random case. ``unset_hash_block``: flashkda's checkpoint blocks with
    prefix_match_unit unset (vLLM picks the GCD of the groups' blocks)."""
    hash_block = d.choice([8, 16, 32])
    # Releases before 0.26.0 fix the hash block themselves (no prefix_match_unit).
    choose_hash = supports_hash_block()
    blocks = d.integer(1, 24)
    state_block = hash_block * blocks
    rule = "equal" if equal_geometry else geometry_rule()
    if rule == "any":
        cache_block = hash_block * d.integer(1, 24)
    elif rule == "divisor":
        divisors = [n for n in range(1, blocks + 1) if blocks % n == 0]
        cache_block = state_block // d.choice(divisors)
    else:
        cache_block = state_block
    # vLLM's own config check keeps the step budget at least one cache block.
    budget = d.integer(max(cache_block, 16), max(cache_block, 4 * state_block) + 64)
    # A threshold below one cache block stalls stock vLLM itself before 0.27.1.
    threshold = d.choice([0, 0, 0, max(cache_block, budget // 2)])
    base = prompt(d.integer(1, 8 * state_block), seed=d.integer(0, 9))
    prompts = []
    for index in range(d.integer(1, 4)):
        shared = d.integer(0, len(base))
        tail = d.integer(0 if shared else 1, 3 * state_block)
        prompts.append(base[:shared] + prompt(tail, seed=100 + index))
    count = len(prompts)
    # Long outputs grow the KV footprint during decode (preemption).
    max_tokens = [
        d.integer(1, 4) if d.choice([True, False]) else d.integer(40, 160)
        for _ in range(count)
    ]
    # vLLM's state retention: its default first, dense, and a legal interval R
    # (a multiple of the scheduler block, the LCM of the groups' blocks).
    retention: int | str | None = "default"
    if supports_retention_setting():
        retention = d.choice(["default", "default", None, "segments"])
        if retention == "segments":
            retention = math.lcm(cache_block, state_block) * d.integer(1, 3)
    # Backend prefill checkpoints (GPU GDN/Mamba2/KDA, 0.29.0+): one state
    # written inside a chunk vLLM checkpoints internally.
    checkpoint = None
    checkpoint_rule = installed_body().internal_checkpoint
    if checkpoint_rule is not InternalCheckpoint.NONE and choose_hash:
        # The backends with checkpoint blocks in this release (flashkda from
        # 0.29.0, Mamba2 from 0.32.0, GDN from 0.33.0). On 0.29.0 with
        # B % 16 == 8 vLLM would publish a flashkda checkpoint block its backend
        # never writes; the plugin routes around it.
        backends: list[str | None] = [None, *available_checkpoint_backends()]
        checkpoint = d.choice(backends)
    if unset_hash_block:
        checkpoint = "flashkda"
    # A drafter (MTP or EAGLE-3, k tokens per step), sparingly: each one builds
    # its own VllmConfig. On 0.33.0 also with vLLM's EAGLE last-block drop
    # (lookahead hashes off, as with a KV connector).
    speculative: tuple[str, int] | None = None
    block_drop = False
    if drafters_build() and d.integer(1, DRAFTER_ODDS) == 1:
        speculative = (d.choice(["mtp", "eagle"]), d.integer(1, 3))
        block_drop = supports_lookahead_hashes() and d.choice([True, False])
    drafts = speculative[1] if speculative else 0
    # A KV connector whose store holds states of prefixes of the shared base,
    # ending wherever they end (off both grids, mostly): not combined with a
    # drafter or async scheduling (not modelled together).
    connector = connector_path()
    kv_connector, kv_config, held = None, (), []
    if (
        connector is not None
        and speculative is None
        and not unset_hash_block
        and d.integer(1, CONNECTOR_ODDS) == 1
    ):
        kv_connector = connector
        divergent = divergent_hits_supported() and d.choice([True, False])
        kv_config = (
            ("divergent_hits", divergent),
            ("async_load", d.choice([True, False])),
        )
        held = [base[: d.integer(1, len(base))] for _ in range(d.integer(1, 2))]
    longest = max(len(p) + n for p, n in zip(prompts, max_tokens, strict=True))
    assert longest < MAX_MODEL_LEN  # at most 11 state blocks of at most 768 tokens
    # Blocks one request needs in both groups, so each request fits on its own
    # (vLLM cannot serve one that does not); scarce pools force preemption. A
    # drafter adds k lookahead slots and k speculative state blocks.
    need = -(-(longest + drafts) // cache_block) + -(-longest // state_block) + 4
    need += drafts
    # Cache-aware admission (0.34.0+, off by default): one case in three
    # reorders the waiting queue by cached prefix.
    admission = 0
    if supports_admission_window():
        admission = d.choice([0, 0, d.integer(1, 4)])
    geometry = Geometry(
        cache_block=cache_block,
        state_block=state_block,
        budget=budget,
        hash_block=hash_block if choose_hash and not unset_hash_block else None,
        long_prefill_threshold=threshold,
        max_num_seqs=d.integer(1, 4),
        # Scarce blocks force preemption: resumed requests replay their prefill.
        num_blocks=d.choice([need + 2, 2 * need, 4000]),
        reserve_full_input=d.choice([True, False]),
        retention=retention,
        prefill_checkpoint=checkpoint,
        speculative=speculative,
        eagle_block_drop=block_drop,
        kv_connector=kv_connector,
        kv_connector_config=kv_config,
        # Async scheduling: one step in flight, output placeholders. vLLM's
        # default (0.18.1+, also with an EAGLE or MTP drafter), so one case in
        # two; not with a connector (not modelled together); not where vLLM's
        # async scheduling publishes wrong states by itself.
        async_scheduling=kv_connector is None
        and not async_republishes_partial_tail()
        and d.choice([False, True]),
        admission_window=admission,
    )
    return Workload(
        geometry=geometry,
        prompts=prompts,
        max_tokens=max_tokens,
        arrivals=[d.integer(0, 40) for _ in range(count)],
        held=held,
    )


class RetentionWatch:
    """The plugin's model of vLLM's state retention (``retention.Retention``,
    which ``kept`` mode and the audit decide by) held against every decision
    vLLM takes on a Mamba slot, at the moment it takes it."""

    def __init__(self, sim: Simulation) -> None:
        self.model = read_retention(sim.scheduler, sim.state_block)
        self.decisions = 0
        self.wrong: list[str] = []
        sim.keep_decision_hooks.append(self)

    def __call__(self, request: Any, decision: KeepDecision) -> None:
        self.decisions += 1
        predicted = self.model.keeps(request, decision.boundary)
        if predicted != decision.kept:
            self.wrong.append(
                f"{decision.req_id}: vLLM {'keeps' if decision.kept else 'drops'} "
                f"state@{decision.boundary}, the plugin predicts it "
                f"{'keeps' if predicted else 'drops'} it "
                f"(P = {request.num_prompt_tokens}, junction "
                f"{getattr(request, 'shared_prefix_boundary', 0)})"
            )

    @staticmethod
    def of(sim: Simulation) -> RetentionWatch:
        return next(h for h in sim.keep_decision_hooks if isinstance(h, RetentionWatch))


def simulate(mode: str, workload: Workload) -> Simulation:
    """Run the workload in one mode, the plugin's retention model watched
    (:class:`RetentionWatch`); :class:`Unrunnable` where this release cannot
    run it."""
    with scheduler_mode(mode):
        try:
            sim = Simulation(workload.geometry)
            RetentionWatch(sim)
        except MambaAlignError as error:
            # The stall guard (0.15.1-0.26.0, B wider than the step budget) has
            # its own test; such a scheduler refuses to start, it never stalls.
            if "per-step prefill budget" in str(error):
                raise Unrunnable(str(error)) from error
            raise
        except Exception as error:
            if vllm_refuses(error):
                raise Unrunnable(str(error)) from error  # vLLM refuses this geometry
            raise
        for prefix in workload.held:
            sim.scheduler.connector.hold(prefix)
        drive(sim, workload)
    if resumed_requests_unsplit() and any(
        r.request.num_preemptions for r in sim.records.values()
    ):
        # 0.15.1-0.16.0 never split a resumed request's replayed prefill (vLLM's
        # own TODO, fixed in 0.17.1); the plugin keeps to what vLLM splits.
        raise Unrunnable("a resumed request's prefill is not split before 0.17.1")
    return sim


def drive(sim: Simulation, workload: Workload) -> None:
    """Add each request at its arrival step and run until all have finished;
    :class:`VllmDefect` where vLLM's own ``schedule()`` fails in a way stock
    vLLM fails too."""
    try:
        _drive(sim, workload)
    except (ValueError, AssertionError) as error:
        if external_block_undercounted(error):
            raise VllmDefect(EXTERNAL_BLOCK_UNDERCOUNTED) from error
        if checkpoint_slot_from_cached_tokens(error):
            raise VllmDefect(CHECKPOINT_SLOT_FROM_CACHED_TOKENS) from error
        raise


def _drive(sim: Simulation, workload: Workload) -> None:
    pending = sorted(
        zip(workload.arrivals, range(len(workload.prompts)), strict=True),
        reverse=True,
    )
    step = 0
    while pending or sim.busy():
        while pending and pending[-1][0] <= step:
            _, index = pending.pop()
            sim.add(f"r{index}", workload.prompts[index], workload.max_tokens[index])
        if sim.busy():
            sim.step()
        step += 1
        assert step < 20_000, "the scheduler stalled"


def check_mode(mode: str, workload: Workload, sim: Simulation) -> None:
    """What every fixed mode holds on its own: no wrong publication, no wrong
    reuse, no wrong state handed to a store, every prefill finished; ``full``,
    ``kept`` and ``lean`` materialize every boundary vLLM keeps (as vLLM decided it,
    slot by slot); ``full``'s kept states are canonical where one step can
    prefill a whole state block. And the plugin's retention model predicted
    every one of vLLM's keep-or-drop decisions."""
    assert not RetentionWatch.of(sim).wrong, RetentionWatch.of(sim).wrong[:5]
    if (
        sim.poisoned
        and manager_keys_checkpoint_slot_from_cached_tokens()
        and stock_publishes_alike(workload, sim)
    ):
        raise VllmDefect(CHECKPOINT_SLOT_MISKEYED)
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
    assert not sim.wrong_reuse, sim.wrong_reuse
    assert not sim.wrong_offloads, sim.wrong_offloads
    for record in sim.records.values():
        assert record.prefilled_at_step is not None
    if mode == DEFAULT:  # the plugin with VLLM_MAMBA_ALIGN_MODE unset
        mode = DEFAULT_MODE.value
    if mode in ("full", "kept", "lean"):
        assert lost_kept_states(sim, mode) == [], f"{mode} lost states vLLM keeps"
    if mode == "full" and one_block_per_step(workload.geometry):
        assert sim.noncanonical_kept == [], "full kept a non-canonical state"


def dimensions(workload: Workload, sim: Simulation) -> list[str]:
    """The labels of what this case exercised (for the sweep's shares and the
    property tests' statistics)."""
    geometry = workload.geometry
    interval = sim.retention_interval
    labels = [
        "C < B" if geometry.cache_block < geometry.state_block else "C = B",
        "retention dense"
        if keeps_every_boundary(workload, sim)
        else f"retention {'0' if interval == 0 else 'R > 0'}",
    ]
    if any(not d.kept for d in sim.keep_decisions):
        labels.append("vLLM dropped a boundary state")
    if geometry.speculative is not None:
        drop = " with EAGLE block drop" if sim.scheduler_drops_eagle else ""
        labels.append(f"drafter ({geometry.speculative[0]}){drop}")
        if sim.accepted_drafts:
            labels.append("drafts were verified in decode")
    if geometry.prefill_checkpoint is not None:
        labels.append(f"prefill checkpoints ({geometry.prefill_checkpoint})")
        if sim.checkpoint_writes:
            labels.append("the backend wrote an in-chunk checkpoint")
    if geometry.kv_connector is not None:
        labels.append("KV connector")
        if sim.store_loads:
            labels.append("a KV connector hit was loaded")
    if geometry.async_scheduling:
        labels.append("async scheduling")
    if geometry.admission_window:
        labels.append("cache-aware admission")
    if any(r.request.num_preemptions for r in sim.records.values()):
        labels.append("a request was preempted and resumed")
    if any(r.reused_tokens for r in sim.records.values()):
        labels.append("a request reused cached tokens")
    if sim.tail_resumed_kept:
        labels.append("resumed from vLLM's partial-tail checkpoint")
    if sim.same_step_reuse:
        labels.append("vLLM served a same-step hit (its own defect, before 0.17)")
    return labels


def keeps_every_boundary(workload: Workload, sim: Simulation) -> bool:
    """Whether vLLM's retention setting keeps every B boundary here: none
    (dense), or an interval R of which every B boundary is a multiple."""
    interval = sim.retention_interval
    return interval is None or (
        interval > 0 and workload.geometry.state_block % interval == 0
    )


def resumed_requests_unsplit() -> bool:
    """Whether this vLLM's split skips resumed requests (0.15.1-0.16.0)."""
    return installed_body().prefill is PrefillRule.NO_OUTPUT_YET


def one_block_per_step(geometry: Geometry) -> bool:
    """Whether one step may prefill a whole state block (else no mode can compute
    a state in one chunk, and canonical chunking is not possible)."""
    budget = geometry.budget
    if geometry.long_prefill_threshold:
        budget = min(budget, geometry.long_prefill_threshold)
    return geometry.state_block <= budget


def drafter_tail_unaligned(geometry: Geometry) -> bool:
    """A drafter on a release whose split leaves the last blocks unaligned
    (before 0.27.1: releases.SplitBody.aligns_drafter_tail, read from the
    split's code)."""
    return geometry.speculative is not None and not installed_body().aligns_drafter_tail


def unwritten_checkpoints_possible(geometry: Geometry) -> bool:
    """0.29.0's flashkda backend skips a checkpoint 16-misaligned from the chunk
    start, which only a state block B with B % 16 != 0 allows."""
    return (
        geometry.prefill_checkpoint is not None
        and installed_body().internal_checkpoint is InternalCheckpoint.ALIGNED_START
        and geometry.state_block % 16 != 0
    )


def scratch_blocks_published_possible(geometry: Geometry) -> bool:
    """0.30.0-0.31.0 with a drafter and backend checkpoints: vLLM leaves a
    running request's speculative scratch blocks inside a chunk it checkpoints
    internally and publishes them (read from its manager's code:
    checkpoints.installed_manager_skips_scratch_move)."""
    body = installed_body()
    return (
        geometry.prefill_checkpoint is not None
        and geometry.speculative is not None
        and body.internal_checkpoint is InternalCheckpoint.OBSERVED
        and installed_manager_skips_scratch_move()
    )
