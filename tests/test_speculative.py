"""Speculative decoding (issue 11, part): the fix with an MTP or EAGLE drafter.

Hybrids such as Qwen3-Next are served with MTP/EAGLE drafters. vLLM's scheduler
then derives ``use_eagle_block_drop`` (0.29.0: ``use_eagle``),
``num_prefill_lookahead`` and ``num_hash_lookahead_tokens`` from the speculative
config, which move where a chunk may end (``last_cache_position``, the partial
tail, the backend checkpoint position) and which replay boundaries vLLM keeps.
Here the real Scheduler is built from vLLM's own SpeculativeConfig (the
simulation's ``Geometry.speculative``): Qwen3-Next's MTP module with vLLM's
default lookahead block hashes, and an EAGLE-3 drafter with EAGLE's last-block
drop (0.33.0: lookahead hashes off, as with a KV connector; 0.29.0 always
drops). Decode verifies the drafts; the worker model moves their states as
vLLM's align-mode worker does.

Measured (0.33.0, C = 816, B = 1,648, P = 16,764, budget 8,192, hash 16): stock
ends the prompt's chunks at 8160, 16320, 16752, 16764 with MTP (lookahead
hashes) and at 8160, 15504, 16736, 16764 with EAGLE's drop; ``full`` at every
boundary up to 16480, then vLLM's partial tail (16752, or 16736 with the drop).
"""

from __future__ import annotations

import pytest
from helpers import (
    built_or_skipped,
    geometry_rule,
    installed_body,
    lost_kept_states,
    scheduler_mode,
    supports_retention_setting,
)
from random_workloads import drafters_build

from vllm_mamba_align.checkpoints import installed_manager_skips_scratch_move
from vllm_mamba_align.releases import InternalCheckpoint
from vllm_mamba_align.tools.installed import (
    supports_hash_block,
    supports_lookahead_hashes,
)
from vllm_mamba_align.tools.sim import (
    Geometry,
    Simulation,
    available_checkpoint_backends,
    prompt,
)

C, B, P, BUDGET, HASH = 816, 1648, 16764, 8192, 16
Drafter = tuple[tuple[str, int], bool]

DRAFTERS: list[Drafter] = [
    (("mtp", 2), False),  # vLLM's defaults: lookahead hashes on 0.33.0
    (("eagle", 3), True),  # EAGLE's last-block drop
    (("mtp", 1), True),
]


def _skip_unless_supported(drafter: Drafter) -> None:
    if geometry_rule() != "any":
        pytest.skip(
            "this vLLM does not start C = 816 next to B = 1,648 (C must equal B "
            "on 0.20.2-0.27.1 and divide it on 0.15.1-0.19.1)"
        )
    if not supports_hash_block():
        pytest.skip("needs the hash block to be chosen (0.26.0+)")
    (_, _), drop = drafter
    if not drop and not supports_lookahead_hashes():
        pytest.skip("this vLLM has no lookahead block hashes: it always drops")


def _siblings(mode: str, retention: int | str | None, drafter: Drafter) -> Simulation:
    """The domain's prompt, then siblings sharing 5,000 and 9,000 of its tokens;
    each decodes a few tokens with the drafter."""
    _skip_unless_supported(drafter)
    if retention != "default" and not supports_retention_setting():
        pytest.skip("this vLLM has no retention setting")
    speculative, drop = drafter
    geometry = Geometry(
        C,
        B,
        BUDGET,
        hash_block=HASH,
        retention=retention,
        speculative=speculative,
        eagle_block_drop=drop,
    )
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        base = prompt(P, seed=1)
        sim.add("first", base, max_tokens=12)
        sim.run()
        sim.add("sibling", base[:5000] + prompt(3000, seed=2), max_tokens=12)
        sim.run()
        sim.add("sibling-2", base[:9000] + prompt(3000, seed=3), max_tokens=12)
        sim.run()
    return sim


def _assert_sound(sim: Simulation, mode: str) -> None:
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
    assert not sim.wrong_reuse
    for record in sim.records.values():
        assert record.prefilled_at_step is not None
    if mode in ("full", "kept", "lean"):
        assert lost_kept_states(sim, mode) == []
    if mode == "full":
        assert sim.noncanonical_kept == []


@pytest.mark.parametrize("drafter", DRAFTERS, ids=lambda d: f"{d[0][0]}{d[0][1]}")
@pytest.mark.parametrize("retention", ["default", None], ids=["default", "dense"])
@pytest.mark.parametrize("mode", ["full", "kept", "grid", "lean"])
def test_the_fix_with_a_drafter(
    mode: str, retention: int | str | None, drafter: Drafter
) -> None:
    """No wrong publication, no wrong reuse, every prefill finishes; full and
    kept lose no kept state; full's kept states are canonical. Decode verified
    drafts (the worker moved their states) in every run."""
    sim = _siblings(mode, retention, drafter)
    _assert_sound(sim, mode)
    assert sim.accepted_drafts and sim.rejected_drafts
    assert sim.scheduler_drops_eagle == drafter[1] or not supports_lookahead_hashes()


@pytest.mark.parametrize("drafter", DRAFTERS, ids=lambda d: f"{d[0][0]}{d[0][1]}")
def test_stock_still_publishes_wrong_states_with_a_drafter(drafter: Drafter) -> None:
    """The control, at vLLM's default retention (dense on 0.29.0 with a
    drafter): stock ends chunks on the 816 grid and publishes Mamba hashes over
    states of other offsets (0.33.0: 3 with MTP, 1 with EAGLE's drop)."""
    sim = _siblings("off", "default", drafter)
    assert sim.poisoned
    assert 8160 in sim.chunk_ends("first")


@pytest.mark.parametrize("drafter", DRAFTERS, ids=lambda d: f"{d[0][0]}{d[0][1]}")
def test_full_stops_at_every_boundary_then_at_vllms_own_tail(drafter: Drafter) -> None:
    """With a drafter full's chunks still end at every B boundary; after the
    last one only vLLM's own stops remain (its partial tail: stock vLLM's chunk
    ends in the prompt's last block, no C-grid end falling there), then the
    prompt's end. On 0.30.0+ that tail is vLLM's helper's checkpoint position,
    one hash block lower under EAGLE's drop."""
    sim = _siblings("full", None, drafter)
    ends = sim.chunk_ends("first")
    boundaries = list(range(B, P, B))
    assert ends[: len(boundaries)] == boundaries
    assert sim.materialized_boundaries("first") == boundaries
    stock = _siblings("off", None, drafter).chunk_ends("first")
    assert not any(boundaries[-1] < c < P for c in range(C, P, C))
    own_stops = [e for e in stock if boundaries[-1] < e < P]
    assert ends[len(boundaries) :] == [*own_stops, P]
    tail = sim._partial_tail(P)  # vLLM's helper (0 where it has none)
    if tail and tail in own_stops:  # the split stops at the helper's position
        drops = sim.scheduler_drops_eagle
        assert tail == (P // HASH - 1) * HASH if drops else (P - 1) // HASH * HASH


# -- backend prefill checkpoints with a drafter -------------------------------------

CB, CP, CBUDGET = 256, 2500, 1500


def _checkpointed(
    mode: str, retention: int | str | None, drafter: Drafter, length: int = CP
) -> Simulation:
    """test_checkpoints' workload (a prompt, siblings sharing 900 and 1,800 of
    its tokens) with a backend saving a checkpoint in-chunk: GDN on FlashInfer
    (0.33.0+), else KDA on flashkda (0.29.0+; 0.29.0's scheduler ignores the
    checkpoint blocks with a drafter, scheduler.py:330-338, while its backend
    still writes inside an unaligned chunk)."""
    rule = installed_body().internal_checkpoint
    if rule is InternalCheckpoint.NONE:
        pytest.skip("this vLLM has no backend prefill checkpoints (0.29.0+)")
    backends = available_checkpoint_backends()
    backend = "gdn-flashinfer" if "gdn-flashinfer" in backends else "flashkda"
    _skip_unless_supported(drafter)
    speculative, drop = drafter
    geometry = Geometry(
        CB,
        CB,
        CBUDGET,
        hash_block=HASH,
        retention=retention,
        prefill_checkpoint=backend,
        speculative=speculative,
        eagle_block_drop=drop,
    )
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        assert sim.scheduler.mamba_has_prefill_checkpoint_blocks == (
            rule is InternalCheckpoint.OBSERVED
        )
        base = prompt(length, seed=1)
        sim.add("first", base, max_tokens=6)
        sim.run()
        sim.add("sibling", base[:900] + prompt(length - 900, seed=2), max_tokens=6)
        sim.run()
        sim.add("sibling-2", base[:1800] + prompt(length - 1800, seed=3), max_tokens=6)
        sim.run()
    return sim


@pytest.mark.parametrize("drafter", DRAFTERS, ids=lambda d: f"{d[0][0]}{d[0][1]}")
@pytest.mark.parametrize("retention", ["default", None], ids=["default", "dense"])
@pytest.mark.parametrize("mode", ["full", "kept", "grid", "lean"])
def test_backend_checkpoints_with_a_drafter(
    mode: str, retention: int | str | None, drafter: Drafter
) -> None:
    sim = _checkpointed(mode, retention, drafter)
    _assert_sound(sim, mode)


def test_the_checkpoint_the_backend_writes_with_eagles_drop_needs_no_stop() -> None:
    """EAGLE's drop moves vLLM's prompt checkpoint one hash block down:
    P = 2,325 checkpoints at floor(P / 16) * 16 - 16 = 2,304 (without the drop:
    2,320). From 2,048 the final chunk's only boundary is 2,304, which the
    backend writes: the split must reckon with the drop (it asks vLLM's helper
    with the scheduler's use_eagle_block_drop) and add no stop there. Read
    without the drop, it would stop at 2,304 for nothing."""
    if installed_body().internal_checkpoint is not InternalCheckpoint.OBSERVED:
        pytest.skip("the checkpoint position helper is 0.30.0+'s")
    drafter: Drafter = (("eagle", 2), True)
    sim = _checkpointed("full", None, drafter, length=2325)
    assert sim.scheduler.use_eagle_block_drop
    assert 2304 not in sim.chunk_ends("first")
    assert sim.checkpoint_writes
    assert 2304 in sim.materialized_boundaries("first")
    _assert_sound(sim, "full")


@pytest.mark.parametrize("mode", ["off", "kept", "grid"])
def test_scratch_blocks_in_a_checkpointed_chunk(mode: str) -> None:
    """vLLM's own defect on 0.30.0-0.31.0, recorded: in a step it checkpoints
    internally, its Mamba manager leaves a running request's speculative
    scratch blocks in the columns of the chunk's interior boundaries and
    publishes them as those states (B = 256, dense retention, EAGLE-3: stock's
    second chunk 1,280 -> 2,500 publishes the scratch blocks as state@1,536
    and on, holding nothing, and a sibling reuses one). 0.32.0 moves them
    (stock clean there). Every mode cuts such a chunk at its first boundary."""
    if installed_body().internal_checkpoint is not InternalCheckpoint.OBSERVED:
        pytest.skip("vLLM decides internal checkpoints in the split from 0.30.0")
    sim = _checkpointed(mode, None, (("eagle", 3), True))
    if mode == "off" and installed_manager_skips_scratch_move():
        assert any(p.held is None for p in sim.poisoned.values())
        assert sim.wrong_reuse
        return
    _assert_sound(sim, mode)


# -- multi-module MTP: vLLM's own stall -------------------------------------------


def test_multi_module_mtp_stalls_stock_vllm_not_the_fix() -> None:
    """Recorded, vLLM's own: with k MTP modules vLLM never ends a prefill chunk
    within k tokens of the prefill end (_reserve_prefill_lookahead, applied
    after the split). P = 1,025, B = C = 256, k = 3: vLLM's partial tail stops
    at 1,008, the next chunk's block stop (1,024) is cut back to 1,022, and
    from 1,022 the block stop leaves 2 tokens, cut to 0: the request never
    finishes its prefill, in stock vLLM (0.29.0, 0.33.0) and under ``off``.
    Every fixing mode runs 768 -> 1,025 instead (split.clear_of_lookahead:
    1,024 can be no chunk end), and P = 1,030 prefills everywhere."""
    if not supports_hash_block() or installed_body().internal_checkpoint is (
        InternalCheckpoint.NONE
    ):
        pytest.skip("checked on 0.29.0+ (partial tails, prefill lookahead)")
    geometry = Geometry(256, 256, 1024, hash_block=HASH, speculative=("multi-mtp", 3))
    for mode in ("off", "full", "lean"):
        with scheduler_mode(mode):
            sim = Simulation(geometry)
            sim.add("stalls", prompt(1025, seed=1))
            if mode == "off":
                with pytest.raises(AssertionError, match="stalled"):
                    sim.run()
                assert sim.records["stalls"].request.num_computed_tokens == 1022
            else:
                sim.run()
                assert sim.chunk_ends("stalls")[-2:] == [768, 1025]
                assert not sim.poisoned
            sim = Simulation(geometry)
            sim.add("prefills", prompt(1030, seed=1), max_tokens=4)
            sim.run()
            _assert_sound(sim, "grid")


# -- which states vLLM keeps with a drafter -----------------------------------------

B_SEGMENTS = 1632  # scheduler block lcm(816, 1632) = 1632: R = 4 * B is legal


@pytest.mark.parametrize("drafter", DRAFTERS, ids=lambda d: f"{d[0][0]}{d[0][1]}")
@pytest.mark.parametrize("retention", ["default", 0, 4 * B_SEGMENTS], ids=str)
def test_the_plugin_predicts_the_states_vllm_keeps_with_a_drafter(
    retention: int | str | None, drafter: Drafter
) -> None:
    """``kept`` mode and the oracle read vLLM's retention through the plugin
    (retention.py: EAGLE's replay pair on the scheduler block when vLLM drops,
    0.33.0's junction block). ``full`` writes every boundary, so what vLLM
    publishes is exactly what it keeps: the two must agree, with a drafter."""
    from vllm_mamba_align.retention import read_retention
    from vllm_mamba_align.tools.sim import cacheable_boundaries, state_id

    _skip_unless_supported(drafter)
    if retention != "default" and not supports_retention_setting():
        pytest.skip("this vLLM has no retention setting")
    speculative, drop = drafter
    geometry = Geometry(
        C,
        B_SEGMENTS,
        BUDGET,
        hash_block=HASH,
        retention=retention,
        speculative=speculative,
        eagle_block_drop=drop,
    )
    first = prompt(P, seed=1)
    requests = {
        "first": first,
        "re-ask": first,
        "sibling": first[:9000] + prompt(3000, seed=2),
        "sibling-2": first[:9000] + prompt(3000, seed=3),
    }
    with scheduler_mode("full"):
        sim = Simulation(geometry)
        for name, tokens in requests.items():
            sim.add(name, tokens)
            sim.run()
    published = {
        claimed
        for block, _, claimed in sim.published_mamba_blocks()
        if claimed[0] % B_SEGMENTS == 0 and sim.holds.get(block.block_id) == claimed
    }
    retention = read_retention(sim.scheduler, sim.state_block)
    predicted = {
        state_id(requests[name], b)
        for name, record in sim.records.items()
        for b in cacheable_boundaries(len(requests[name]), B_SEGMENTS)
        if retention.keeps(record.request, b)
    }
    assert published == predicted
    _assert_sound(sim, "full")


@pytest.mark.parametrize("mode", ["off", "grid", "kept", "full"])
def test_the_unaligned_drafter_tail_stops_at_the_boundary(mode: str) -> None:
    """Before 0.27.1 vLLM leaves the chunks of a drafted prompt's last blocks
    unaligned, and a chunk starting mid-block there runs past the next boundary
    (even on 0.26.0, which stops such a chunk elsewhere). C = B = 168, budget
    168, MTP: a one-token request decodes (two tokens with its draft) while a
    176-token prompt arrives: stock runs it 0 -> 166 -> 176 and publishes the
    block of 168 holding state@166 (found by the release matrix on 0.26.0).
    Every mode stops at 168; grid did not on 0.26.0 before the fix."""
    if not drafters_build():
        pytest.skip("this vLLM refuses speculative decoding in align mode")
    if installed_body().aligns_drafter_tail:
        pytest.skip("0.27.1+ align every non-final chunk with a drafter themselves")
    with scheduler_mode(mode), built_or_skipped():
        sim = Simulation(Geometry(168, 168, 168, speculative=("mtp", 1)))
        sim.add("short", prompt(1, seed=2), max_tokens=4)
        sim.step()
        sim.add("long", prompt(176, seed=1), max_tokens=1)
        sim.run()
    if mode == "off":  # recorded: vLLM's own
        assert sim.chunk_ends("long") == [166, 176]
        assert [str(p) for p in sim.poisoned.values()] == [
            f"block {next(iter(sim.poisoned.values())).block_id} hashed as "
            "state@168 holds state@166"
        ]
        return
    assert 168 in sim.chunk_ends("long")
    _assert_sound(sim, mode)


@pytest.mark.parametrize("mode", ["grid", "full"])
def test_a_squeezed_chunk_before_the_last_boundary_waits_in_full(mode: str) -> None:
    """Before 0.27.1 vLLM's split backs the last cacheable position off one
    block for an EAGLE/MTP drafter and leaves every chunk after it unaligned,
    boundaries inside included. B = 104, budget 104, MTP: a 318-token prompt,
    then in one step a 103-token request and a sibling hitting 208 of the
    prompt's tokens. The first takes 103 tokens, leaving one: vLLM's split on
    the B grid (``grid``) gives the sibling 208 -> 209, and its state@312 is
    computed in two chunks, unlike the prompt's (found by the sweep on 0.18.1;
    stock, on the C grid, has worse troubles). ``full`` waits for a whole
    block, as vLLM does for any other squeezed chunk."""
    if not drafters_build():
        pytest.skip("this vLLM refuses speculative decoding in align mode")
    if installed_body().aligns_drafter_tail:
        pytest.skip("0.27.1+ align every non-final chunk with a drafter themselves")
    cache_block = {"any": 8, "divisor": 8}.get(geometry_rule(), 104)
    geometry = Geometry(cache_block, 104, 104, speculative=("mtp", 1))
    base = prompt(318, seed=1)
    with scheduler_mode(mode), built_or_skipped():
        sim = Simulation(geometry)
        sim.add("first", base, max_tokens=2)
        sim.run()
        sim.add("other", prompt(103, seed=2), max_tokens=2)
        sim.add("sibling", base[:228] + prompt(90, seed=3), max_tokens=2)
        sim.run()
    hit = sim.reused("sibling")  # 208, or 104 where vLLM drops EAGLE's block
    assert hit in (104, 208)
    ends = sim.chunk_ends("sibling")
    if mode == "grid":
        if ends[0] != hit + 1:
            pytest.skip("this vLLM aligns the squeezed chunk itself")
        assert sim.noncanonical_kept != []
        return
    assert ends[0] == hit + 104, ends
    assert sim.noncanonical_kept == []
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
