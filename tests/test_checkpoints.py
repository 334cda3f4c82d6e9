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
from conftest import installed_body, scheduler_mode

from vllm_mamba_align.releases import (
    InternalCheckpoint,
    supports_hash_block,
    supports_retention_setting,
)
from vllm_mamba_align.tools.simulation import Geometry, Simulation, prompt

B = 256
HASH = 16
P = 2500
BUDGET = 1500


def _backend() -> str:
    if installed_body().internal_checkpoint is InternalCheckpoint.NONE:
        pytest.skip("this vLLM has no backend prefill checkpoints (0.29.0+)")
    if not supports_hash_block():
        pytest.skip("needs the hash block to be chosen")
    return "gdn-flashinfer"


def _siblings(mode: str, retention: int | str | None, length: int = P) -> Simulation:
    """A prompt, then siblings sharing 900 and 1,800 of its tokens."""
    backend = _backend()
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


def test_the_boundary_the_backend_writes_needs_no_stop() -> None:
    """P = 2,312: from 2,048 the final chunk's checkpoint is 2,304, its only
    boundary, written by the backend: no extra step for it."""
    if installed_body().internal_checkpoint is not InternalCheckpoint.OBSERVED:
        pytest.skip("0.29.0 stops at the prompt's hash tail (2,304) itself")
    sim = _siblings("full", None, length=2312)
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


@pytest.mark.parametrize("mode", ["full", "kept", "grid"])
def test_a_chunk_from_mid_block_stops_at_the_next_boundary(mode: str) -> None:
    """A partial hash hit resumes mid-block (8, B = 16, hash 8); vLLM decides to
    checkpoint the final chunk 8 -> 33 internally (at 32) and drops its
    mid-block stop, so the chunk crosses 16. The block it resumes in is 16's
    own slot: published as state@16 while it holds state@8 (grid before the
    fix; found by the property test). Every mode stops at 16. (Stock vLLM
    prefills the short prompt in one chunk here, so it has no hit at 8.)"""
    if installed_body().internal_checkpoint is not InternalCheckpoint.OBSERVED:
        pytest.skip("vLLM decides internal checkpoints from mid-block on 0.30.0+")
    geometry = Geometry(
        8, 16, 25, hash_block=8, retention=None, prefill_checkpoint="mamba2"
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
