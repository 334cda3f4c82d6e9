"""Backend prefill checkpoints (issue 11, first part), on the real scheduler.

GPU GDN/Mamba2/KDA layers declare ``MambaSpec.num_prefill_checkpoint_blocks``
(0.29.0+); vLLM then lets the final prefill chunk span several state blocks and
the backend writes ONE state inside it (the simulation's worker model writes it
as vLLM's backend code computes it). vLLM decides for its candidate final chunk,
before a junction stop may cut that chunk short. The fix may skip its boundary
stop only for a chunk that really ends the prefill, and only for the one
boundary whose state the backend writes.
"""

from __future__ import annotations

import pytest
from helpers import installed_body, scheduler_mode, supports_retention_setting

from vllm_mamba_align.releases import CheckpointGrid, InternalCheckpoint
from vllm_mamba_align.tools.installed import supports_hash_block
from vllm_mamba_align.tools.sim import (
    CHECKPOINT_BACKENDS,
    Geometry,
    Simulation,
    available_checkpoint_backends,
    prompt,
)

B = 256
HASH = 16
P = 2500
BUDGET = 1500


def _backend(wanted: str | None = None) -> str:
    """``wanted``, or GDN on FlashInfer where this vLLM has it (0.33.0+), else
    the first backend with checkpoint blocks (flashkda, 0.29.0+)."""
    if installed_body().internal_checkpoint is InternalCheckpoint.NONE:
        pytest.skip("this vLLM has no backend prefill checkpoints (0.29.0+)")
    if not supports_hash_block():
        pytest.skip("needs the hash block to be chosen")
    backends = available_checkpoint_backends()
    if wanted is not None:
        if wanted not in backends:
            pytest.skip(f"{wanted} declares no checkpoint blocks in this vLLM")
        return wanted
    return "gdn-flashinfer" if "gdn-flashinfer" in backends else backends[0]


def _siblings(
    mode: str, retention: int | str | None, length: int = P, backend: str | None = None
) -> Simulation:
    """A prompt, then siblings sharing 900 and 1,800 of its tokens."""
    backend = _backend(backend)
    if retention != "default" and not supports_retention_setting():
        pytest.skip("this vLLM has no retention setting")
    geometry = Geometry(
        B, B, BUDGET, hash_block=HASH, retention=retention, prefill_checkpoint=backend
    )
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        assert sim.scheduler.mamba_has_prefill_checkpoint_blocks
        base = prompt(length, seed=1)
        sim.add("first", base)
        sim.run()
        sim.add("sibling", base[:900] + prompt(length - 900, seed=2))
        sim.run()
        sim.add("sibling-2", base[:1800] + prompt(length - 1800, seed=3))
        sim.run()
    return sim


@pytest.mark.parametrize(
    ("mode", "retention"), [("full", "default"), ("full", None), ("kept", None)]
)
def test_a_chunk_cut_short_by_a_junction_stops_at_every_boundary(
    mode: str, retention: int | str | None
) -> None:
    """vLLM decides to checkpoint 1,024 -> 2,500 internally, then its junction
    stop (1,800 floored to 1,792) cuts the chunk: it is no longer final, and the
    backend writes nothing inside it. 1,280 and 1,536 must still be chunk ends."""
    sim = _siblings(mode, retention)
    assert sim.reused("sibling-2") % B == 0
    ends = sim.chunk_ends("sibling-2")
    start = sim.reused("sibling-2")
    assert [e for e in range(start + B, 1800, B) if e not in ends] == [], ends
    assert sim.missing_kept == []
    assert not sim.poisoned
    assert not sim.wrong_reuse


@pytest.mark.parametrize("mode", ["full", "kept"])
def test_every_kept_boundary_of_an_internally_checkpointed_final_chunk(
    mode: str,
) -> None:
    """The backend writes one state per chunk: the final chunk may not run
    across the boundaries it does not write (dense retention keeps them all)."""
    sim = _siblings(mode, None)
    assert sim.missing_kept == []
    for req_id in ("first", "sibling", "sibling-2"):
        assert len(sim.materialized_boundaries(req_id)) == (P - 1) // B
    assert not sim.poisoned


@pytest.mark.parametrize("backend", CHECKPOINT_BACKENDS)
def test_the_boundary_the_backend_writes_needs_no_stop(backend: str) -> None:
    """P = 2,312: from 2,048 the final chunk's checkpoint is 2,304, its only
    boundary, written by the backend: no extra step for it."""
    if installed_body().internal_checkpoint is not InternalCheckpoint.OBSERVED:
        pytest.skip("0.29.0 stops at the prompt's hash tail (2,304) itself")
    sim = _siblings("full", None, length=2312, backend=backend)
    assert 2304 not in sim.chunk_ends("first")
    assert sim.checkpoint_writes
    assert sim.missing_kept == []
    assert 2304 in sim.materialized_boundaries("first")
    assert not sim.poisoned


def test_full_aligns_a_chunk_that_vllm_leaves_to_the_backend() -> None:
    """0.29.0 leaves any chunk that starts on the grid unaligned when checkpoint
    blocks exist (it trusts the backend with the boundary inside). A chunk
    squeezed by another request's token to 0 -> 319 (B = 320) crosses no
    boundary: nothing is checkpointed, and 320 would be computed as 0 -> 319 ->
    320, not one block per chunk. ``full`` waits for a whole block instead, as
    vLLM itself does without checkpoint blocks."""
    _backend()
    geometry = Geometry(16, 320, 320, hash_block=16, prefill_checkpoint="flashkda")
    with scheduler_mode("full"):
        sim = Simulation(geometry)
        assert sim.scheduler.mamba_has_prefill_checkpoint_blocks
        sim.add("one-token", prompt(1, seed=1))
        sim.add("long", prompt(1000, seed=2))
        sim.run()
    ends = sim.chunk_ends("long")
    assert ends[:3] == [320, 640, 960]  # then vLLM's own stop at the hash tail
    assert sim.noncanonical_kept == []
    assert sim.missing_kept == []
    assert not sim.poisoned


@pytest.mark.parametrize("mode", ["grid", "kept", "full"])
def test_no_hash_over_a_checkpoint_the_backend_never_writes(mode: str) -> None:
    """0.29.0, flashkda, B = 24 (B % 16 == 8): a request resuming at vLLM's
    partial-tail checkpoint (496) reaches 504, then vLLM lets 504 -> 544 through
    as internally checkpointed. Its backend writes 16-aligned from the chunk
    start only (528 - 504 = 24: nothing written) while the block of 528 is
    published. Every mode ends that chunk on the grid at 528 instead."""
    if installed_body().internal_checkpoint is not InternalCheckpoint.ALIGNED_START:
        pytest.skip("0.29.0's flashkda rule only")
    geometry = Geometry(8, 24, 8192, hash_block=8, prefill_checkpoint="flashkda")
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        base = prompt(500, seed=1)
        sim.add("first", base)
        sim.run()
        sim.add("sibling", base[:300] + prompt(100, seed=2))
        sim.run()
        sim.add("longer", base + prompt(50, seed=3))
        sim.run()
    assert sim.reused("longer") == 496
    assert 528 in sim.chunk_ends("longer")
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
    assert not sim.wrong_reuse


def test_stock_publishes_the_checkpoint_its_backend_never_writes() -> None:
    """The control: stock 0.29.0 in equal geometry (C = B = 24) publishes the
    block of 528 over a slot that holds nothing (vLLM's defect)."""
    if installed_body().internal_checkpoint is not InternalCheckpoint.ALIGNED_START:
        pytest.skip("0.29.0's flashkda rule only")
    geometry = Geometry(24, 24, 8192, hash_block=8, prefill_checkpoint="flashkda")
    with scheduler_mode("off"):
        sim = Simulation(geometry)
        base = prompt(500, seed=1)
        sim.add("first", base)
        sim.run()
        sim.add("longer", base + prompt(50, seed=3))
        sim.run()
    assert sim.reused("longer") == 496
    assert (
        [str(p) for p in sim.poisoned.values()]
        == [
            f"block {p.block_id} hashed as state@528 holds nothing"
            for p in sim.poisoned.values()
        ]
        != []
    )


@pytest.mark.parametrize("mode", ["off", "grid", "kept", "full"])
def test_a_drafter_keeps_the_unwritten_checkpoint_block(mode: str) -> None:
    """0.29.0 with a drafter (MTP, one token): the scheduler turns its own
    ``mamba_has_prefill_checkpoint_blocks`` off, but the Mamba spec keeps
    flashkda's checkpoint block, so the manager still reserves and publishes
    it, and the backend still writes 16-aligned from the chunk start only.
    C = B = 24, a 40-token prompt, dense retention: stock runs 0 -> 40 and
    publishes the block of 24 holding nothing (vLLM's defect); every mode ends
    the chunk at 24 instead. Before the fix the guard read the scheduler's
    flag and ``grid`` published it too (the case the property tests had left
    out, found again by the sweep)."""
    if installed_body().internal_checkpoint is not InternalCheckpoint.ALIGNED_START:
        pytest.skip("0.29.0's flashkda rule only")
    geometry = Geometry(
        24,
        24,
        8192,
        hash_block=8,
        retention=None,
        prefill_checkpoint="flashkda",
        speculative=("mtp", 1),
    )
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        assert not sim.scheduler.mamba_has_prefill_checkpoint_blocks
        sim.add("first", prompt(40, seed=1), max_tokens=3)
        sim.run()
    wrong = [str(p) for p in sim.poisoned.values()]
    if mode == "off":
        assert sim.chunk_ends("first")[0] == 40
        assert any(w.endswith("hashed as state@24 holds nothing") for w in wrong)
        return
    assert sim.chunk_ends("first")[:2] == [24, 40]
    assert wrong == []
    assert sim.missing_kept == []


@pytest.mark.parametrize(
    ("mode", "retention"), [("full", "default"), ("kept", "default"), ("kept", 512)]
)
def test_a_backend_off_the_managers_hash_grid_gets_no_internal_checkpoint(
    mode: str, retention: int | str
) -> None:
    """0.30.0-0.31.0 with prefix_match_unit unset and C = 64 < B = 256: for a
    chunk spanning two state blocks the manager reserves the checkpoint block
    on the engine's hash grid (64) and keys it there (2,496 for the prompt's
    final chunk), while the backend writes another state into it (2,304: its
    grid is B). vLLM itself publishes that block wrong. The fix must not skip
    its stop for the state the backend writes, and kept must stop at every
    boundary too (with R = 512 its two-block chunks would be published as
    state@448, 960, ... holding 256, 768, ...): then no chunk is checkpointed
    internally."""
    _backend()
    if installed_body().checkpoint_grid is not CheckpointGrid.PREFIX_MATCH_UNIT:
        pytest.skip("0.32.0+ backends use the engine's hash grid")
    geometry = Geometry(
        64, B, BUDGET, retention=retention, prefill_checkpoint="flashkda"
    )
    runs = {}
    for run in ("stock", mode):
        with scheduler_mode(run):
            sim = runs[run] = Simulation(geometry)
            assert sim.hash_block == 64
            base = prompt(P, seed=1)
            sim.add("first", base)
            sim.run()
            sim.add("sibling", base[:1800] + prompt(P - 1800, seed=2))
            sim.run()
    assert any(
        p.claimed[0] == 2496 and p.held != p.claimed
        for p in runs["stock"].poisoned.values()
    ), "the control: stock publishes the backend's state@2,304 as 2,496"
    fixed = runs[mode]
    assert not fixed.poisoned, [str(p) for p in fixed.poisoned.values()]
    assert fixed.checkpoint_writes == 0
    assert fixed.missing_kept == []
    assert not fixed.wrong_reuse


def test_grid_leaves_a_squeezed_chunk_as_vllm_schedules_it() -> None:
    """The wait for a whole block is full's and kept's (canonical states), not
    grid's: under dense retention, too, grid on 0.29.0 schedules the squeezed
    chunk 0 -> 319 as stock does (C = B, nothing for grid to change). The
    property found it (C = B = 112, a one-token request beside a long one)."""
    _backend()
    if installed_body().internal_checkpoint is not InternalCheckpoint.ALIGNED_START:
        pytest.skip("only 0.29.0 leaves a chunk from the grid to its backend")
    if not supports_retention_setting():
        pytest.skip("this vLLM has no retention setting")
    geometry = Geometry(
        320, 320, 320, hash_block=16, retention=None, prefill_checkpoint="flashkda"
    )
    ends = {}
    for mode in ("stock", "grid"):
        with scheduler_mode(mode):
            sim = Simulation(geometry)
            sim.add("one-token", prompt(1, seed=1))
            sim.add("long", prompt(1000, seed=2))
            sim.run()
        ends[mode] = sim.chunk_ends("long")
    assert ends["stock"][0] == 319  # squeezed by the other request's token
    assert ends["grid"] == ends["stock"]


def test_grid_keeps_the_stop_after_a_partial_hit_that_vllm_checkpoints() -> None:
    """C = B = 128, Mamba2 (alignment 1), dense retention. A 1,350-token prompt
    resumes from the 1,072-token partial-tail hit of its 1,076-token prefix;
    0.30.0+ checkpoints 1,072 -> 1,350 internally and drops its stop at 1,152.
    The hit's copy in the block of 1,152 still holds state@1,072 when vLLM
    publishes it as state@1,152: stock does, grid did before the fix (found by
    the KV-connector sweep; a store hit off the grid is the same case)."""
    if "mamba2" not in available_checkpoint_backends():
        pytest.skip("Mamba2 declares prefill checkpoint blocks from vLLM 0.32.0")
    geometry = Geometry(
        128, 128, 1000, hash_block=16, retention=None, prefill_checkpoint="mamba2"
    )
    base = prompt(1350, seed=90)
    with scheduler_mode("grid"):
        sim = Simulation(geometry)
        sim.add("prefix", base[:1076])
        sim.run()
        sim.add("longer", base)
        sim.run()
    assert sim.reused("longer") == 1072
    assert sim.chunk_ends("longer")[0] == 1152


@pytest.mark.parametrize("mode", ["full", "kept", "grid", "lean"])
def test_a_chunk_from_mid_block_stops_at_the_next_boundary(mode: str) -> None:
    """A partial hash hit resumes mid-block (8, B = 16, hash 8); vLLM decides to
    checkpoint the final chunk 8 -> 33 internally (at 32) and drops its
    mid-block stop, so the chunk crosses 16. The block it resumes in is 16's
    own slot: published as state@16 while it holds state@8 (grid before the
    fix; found by the property test). Every mode stops at 16. (Stock vLLM
    prefills the short prompt in one chunk here, so it has no hit at 8.)"""
    if installed_body().internal_checkpoint is not InternalCheckpoint.OBSERVED:
        pytest.skip("vLLM decides internal checkpoints from mid-block on 0.30.0+")
    # Mamba2 (alignment 1) from 0.32.0; flashkda (16) before: the same case.
    backends = available_checkpoint_backends()
    backend = "mamba2" if "mamba2" in backends else _backend("flashkda")
    geometry = Geometry(
        8, 16, 25, hash_block=8, retention=None, prefill_checkpoint=backend
    )
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        base = prompt(9, seed=1)
        sim.add("short", base)
        sim.run()
        sim.add("long", base[:8] + prompt(25, seed=2))
        sim.run()
    assert sim.reused("long") == 8
    assert 16 in sim.chunk_ends("long")
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]


def test_stock_vllm_fails_the_checkpoint_slot_assertion() -> None:
    """Where vLLM's Mamba manager computes the reserved checkpoint slot from
    the tokens cached in the step, stock vLLM itself fails its assertion on
    this workload (the random-workload tests record such cases as vLLM's own
    defect, random_workloads.CHECKPOINT_SLOT_FROM_CACHED_TOKENS, never as the
    plugin's failure): one 17-token prompt, then three of one token."""
    from random_workloads import (
        CHECKPOINT_SLOT_FROM_CACHED_TOKENS,
        VllmDefect,
        Workload,
        manager_keys_checkpoint_slot_from_cached_tokens,
        simulate,
    )

    if not manager_keys_checkpoint_slot_from_cached_tokens():
        pytest.skip("this vLLM keeps the checkpoint slot it reserved")
    geometry = Geometry(
        cache_block=24,
        state_block=8,
        budget=24,
        hash_block=8,
        max_num_seqs=1,
        num_blocks=10,
        reserve_full_input=True,
        prefill_checkpoint="flashkda",
    )
    workload = Workload(
        geometry,
        prompts=[list(range(100, 117)), [596], [152], [732]],
        max_tokens=[1, 1, 1, 1],
        arrivals=[0, 0, 0, 0],
    )
    with pytest.raises(VllmDefect, match="reserved checkpoint slot") as raised:
        simulate("stock", workload)
    assert str(raised.value) == CHECKPOINT_SLOT_FROM_CACHED_TOKENS


def test_stock_vllm_keys_the_checkpoint_slot_a_column_early() -> None:
    """Where vLLM's Mamba manager keys the reserved checkpoint slot from the
    tokens it caches in the step (floored to the hash block), stock vLLM itself
    publishes the column before the checkpoint as the checkpoint's state: a
    161-token prompt, C = B = 80, its final chunk 80 -> 161 checkpointed at
    160. The plugin ends the same chunks, and the random-workload tests record
    such cases as vLLM's own (random_workloads.CHECKPOINT_SLOT_MISKEYED)."""
    from random_workloads import (
        CHECKPOINT_SLOT_MISKEYED,
        VllmDefect,
        Workload,
        check_mode,
        manager_keys_checkpoint_slot_from_cached_tokens,
        simulate,
    )

    if not manager_keys_checkpoint_slot_from_cached_tokens():
        pytest.skip("this vLLM keeps the checkpoint slot it reserved")
    geometry = Geometry(
        cache_block=80,
        state_block=80,
        budget=81,
        max_num_seqs=1,
        num_blocks=12,
        reserve_full_input=True,
        prefill_checkpoint="flashkda",
    )
    workload = Workload(
        geometry,
        prompts=[[150], [596], list(range(200, 361))],
        max_tokens=[1, 1, 1],
        arrivals=[0, 0, 0],
    )
    stock = simulate("stock", workload)
    assert [str(p) for p in stock.poisoned.values()] == [
        "block 2 hashed as state@160 holds state@80"
    ]
    kept = simulate("kept", workload)
    assert kept.chunk_ends("r2") == stock.chunk_ends("r2") == [80, 161]
    with pytest.raises(VllmDefect) as raised:
        check_mode("kept", workload, kept)
    assert str(raised.value) == CHECKPOINT_SLOT_MISKEYED
