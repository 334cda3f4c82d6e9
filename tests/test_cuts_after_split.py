"""Chunks vLLM cuts after the split has answered.

vLLM's scheduler calls ``_mamba_block_aligned_split`` first, then lets the
encoder-input budget of a multimodal model (``_try_schedule_encoder_inputs``)
and the multi-module MTP lookahead reserve (``_reserve_prefill_lookahead``)
cut the chunk further (scheduler.py:877-905 and :1401-1443 in 0.34.0,
:861-889 and :1351-1392 in 0.33.0): an encoder input the step cannot encode
ends the chunk just before its first token, wherever that is; a chunk may not
end within k tokens of the prefill end. So a chunk may end off B.

Encoder inputs: the tiny hybrid of the witness (tests/witness) with a
multimodal model's encoder budget given to its real scheduler (the
scheduler's ``max_num_encoder_input_tokens`` and its ``EncoderCacheManager``,
which vLLM sizes from the model's ``MultiModalBudget``) and requests carrying
synthetic image features (``MultiModalFeatureSpec`` with a
``PlaceholderRange``, as the input processor makes them); judged by the
witness: nothing wrong published or read, prefill finished, and in ``lean``,
``kept`` and ``full`` every state vLLM keeps written. ``off`` and ``audit``
schedule as stock. Where vLLM's own behaviour differs: it leaves the replay
boundary of a prompt's final chunk to the backend's in-chunk checkpoint and then
cuts the chunk before an image, so nothing writes that state (B = 64, a
70-token prompt cut at 66: 64 lost); the fix stops at 64 (split.stays_whole).

Three MTP modules: the simulation (tools.sim) with vLLM's own speculative config,
judged by its oracle (see :func:`test_three_mtp_modules_hold_the_invariant`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from helpers import installed_body
from judged_runs import Run, run

from vllm_mamba_align.releases import InternalCheckpoint

B = 64
C = 16
ENCODER_BUDGET = 16
"""Embeddings the encoder computes per step: one image of 16 a step."""
MATERIALIZING = ("lean", "kept", "full")
FIXING = (*MATERIALIZING, "grid")
AS_STOCK = ("off", "audit")

# name: (prompt length, images as (offset, length), backend checkpoint alignment)
ENCODER_CASES: dict[str, tuple[int, tuple[tuple[int, int], ...], int | None]] = {
    # The second image cannot be encoded in the first step: the chunk ends at
    # 60, four tokens before the boundary.
    "cut-before-boundary": (200, ((8, 16), (60, 16)), None),
    # ... at 70: vLLM's own chunk (0 -> 192) is cut across 64.
    "cut-across-boundary": (200, ((8, 16), (70, 16)), None),
    # A backend that writes a state inside a chunk (alignment 1, as Mamba2):
    # the prompt's final chunk 0 -> 70 leaves 64 to the backend, then the
    # second image cuts it at 66: no longer final, nothing is checkpointed.
    "cut-after-checkpointed-chunk": (70, ((4, 16), (66, 2)), 1),
    # The cut at 48 (on the hash block) starts the final chunk 48 -> 200,
    # which vLLM checkpoints inside and so lets run past 64 from mid-block.
    "cut-then-checkpointed-chunk": (200, ((8, 16), (48, 16)), 1),
}


def _encoder_budget(scheduler: Any) -> None:
    """A multimodal model's encoder budget on the built scheduler: one image
    of :data:`ENCODER_BUDGET` embeddings per step, room for four."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    scheduler.max_num_encoder_input_tokens = ENCODER_BUDGET
    scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=4 * ENCODER_BUDGET)


def _with_images(
    images: tuple[tuple[int, int], ...],
) -> Callable[[Any, str, list[int]], Any]:
    """A request maker: the witness's request, carrying ``images``."""

    def make(scheduler: Any, name: str, tokens: list[int]) -> Any:
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from witness.engine import new_request

        request = new_request(scheduler, name, tokens, 2, 0)
        request.mm_features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=f"image-{offset}",
                mm_position=PlaceholderRange(offset=offset, length=length),
            )
            for offset, length in images
        ]
        return request

    return make


def _shape(alignment: int | None, retention: int | str | None) -> Any:
    from witness.engine import Shape

    checkpoint = {}
    if alignment is not None:
        checkpoint = {
            "num_prefill_checkpoint_blocks": 1,
            "prefill_checkpoint_alignment": alignment,
        }
    return Shape(
        state_block=B,
        attention_block=C,
        budget=2048,
        retention=retention,
        **checkpoint,
    )


def _encoder_run(mode: str, case: str, retention: int | str | None) -> Run:
    length, images, alignment = ENCODER_CASES[case]
    prompt = [random.Random(case).randrange(1, 500) for _ in range(length)]
    return run(
        mode,
        _shape(alignment, retention),
        [("first", prompt), ("re-ask", prompt)],
        prepare=_encoder_budget,
        request_of=_with_images(images),
    )


def _skip_unless_encoder_case(case: str) -> None:
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from witness.judge import mirrors_backend_checkpoints

    source = inspect.getsource(Scheduler.schedule)
    split = source.find("self._mamba_block_aligned_split(")
    if not 0 <= split < source.find("self._try_schedule_encoder_inputs("):
        # Before 0.28.0 the encoder budget cuts the chunk before the split.
        pytest.skip("this vLLM schedules encoder inputs before the split")
    if ENCODER_CASES[case][2] is None:
        return
    if installed_body().internal_checkpoint is not InternalCheckpoint.OBSERVED:
        pytest.skip("backend checkpoints with an alignment: vLLM 0.30.0+")
    if not mirrors_backend_checkpoints():
        pytest.skip("the witness mirrors backend checkpoints on 0.32.0-0.34.0")


@pytest.mark.parametrize("retention", ["default", None], ids=["default", "dense"])
@pytest.mark.parametrize("case", ENCODER_CASES)
def test_encoder_budget_cuts_hold_the_invariant(
    case: str, retention: int | str | None
) -> None:
    """Every fixing mode with an encoder-budget cut after the split: nothing
    wrong published or read, prefill finished; lean, kept and full write
    every state vLLM keeps. ``off`` and ``audit`` schedule as stock."""
    _skip_unless_encoder_case(case)
    stock = _encoder_run("stock", case, retention)
    cut = ENCODER_CASES[case][1][1][0]
    assert any(end == cut for _, end in stock.chunks["first"]), stock.chunks
    for mode in FIXING:
        result = _encoder_run(mode, case, retention)
        assert not result.sound(mode in MATERIALIZING), (mode, result.chunks)
    for mode in AS_STOCK:
        assert _encoder_run(mode, case, retention).chunks == stock.chunks, mode
    if case == "cut-after-checkpointed-chunk" and retention == "default":
        # vLLM's own: it left 64 to the backend, then cut the chunk at 66.
        assert stock.chunks["first"][0] == (0, 66)
        assert stock.findings.lost_kept_states == 1


# -- three MTP modules: the lookahead reserve ---------------------------------------

MTP_MODULES = 3


def _mtp_run(mode: str, length: int, retention: int | str | None) -> Any:
    """A prompt and its re-ask under k = 3 MTP modules (vLLM's own
    ``SpeculativeConfig`` for a checkpoint with three MTP layers), judged by
    the simulation's oracle (``tools.sim``: its worker model mirrors the
    verify steps)."""
    from helpers import scheduler_mode

    from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt

    geometry = Geometry(
        C,
        B,
        2048,
        hash_block=16,
        retention=retention,
        speculative=("multi-mtp", MTP_MODULES),
    )
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        assert sim.scheduler.num_prefill_lookahead == MTP_MODULES
        base = prompt(length, seed=length)
        for name in ("first", "re-ask"):
            sim.add(name, base, max_tokens=4)
            sim.run()
    return sim


def _skip_unless_multi_module_lookahead() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if not hasattr(Scheduler, "_reserve_prefill_lookahead"):
        pytest.skip("no multi-module MTP lookahead reserve in this vLLM")


@pytest.mark.parametrize("retention", ["default", None], ids=["default", "dense"])
@pytest.mark.parametrize("length", [129, 200])
def test_three_mtp_modules_hold_the_invariant(
    length: int, retention: int | str | None
) -> None:
    """k = 3, B = 64, C = 16. At 129 tokens the last boundary (128) lies
    within k of the end, where vLLM never lets a chunk end: every fixing mode
    ends the prompt's chunk before it at 64 and runs 64 -> 129 (a stop at 128
    is cut to 126 and stalls the request; a start at 112 would leave the state
    at 112 in 128's block, published as 128's): nothing wrong published or
    reused, prefill finished, every kept state written but 128 (written in no
    mode, by vLLM's rule). Stock's own chunks 0 -> 112 -> 129 publish the
    state at 112 as 128's and a re-ask reuses it (C < B). ``off`` and
    ``audit`` schedule as stock."""
    from helpers import lost_kept_states

    _skip_unless_multi_module_lookahead()
    stock = _mtp_run("stock", length, retention)
    window = [f"{r}: {(length - 1) // B * B} inside a chunk" for r in stock.records]
    for mode in FIXING:
        sim = _mtp_run(mode, length, retention)
        assert not sim.poisoned, (mode, [str(p) for p in sim.poisoned.values()])
        assert not sim.wrong_reuse, mode
        assert all(r.prefilled_at_step is not None for r in sim.records.values())
        if mode in MATERIALIZING:
            lost = lost_kept_states(sim, mode)
            assert [e for e in lost if e not in window] == [], (mode, lost)
        if length == 129:
            assert sim.chunk_ends("first")[-2:] == [64, 129], mode
    for mode in AS_STOCK:
        sim = _mtp_run(mode, length, retention)
        for name in stock.records:
            assert sim.chunk_ends(name) == stock.chunk_ends(name), mode
    if length == 129:
        assert stock.chunk_ends("first") == [112, 129]
        assert stock.poisoned and stock.wrong_reuse


def test_a_hit_inside_the_last_boundarys_block_stalls_as_on_stock() -> None:
    """vLLM's own stall, recorded, stock and fixed alike: with a backend that
    writes the prompt checkpoint (Mamba2, alignment 1) the first 129-token
    prompt publishes its state at 112 (under 112's hash, in 128's column); a
    re-ask hits 112, inside the block of 128, a boundary within k = 3 of the
    end. Its chunk can end neither at 128 (cut back to 126, then to nothing)
    nor past it without publishing the hit's state as 128's: every mode leaves
    it to vLLM, which never finishes its prefill, and nothing wrong is
    published (split.clear_of_lookahead)."""
    from helpers import scheduler_mode

    from vllm_mamba_align.tools.sim import (
        Geometry,
        Simulation,
        available_checkpoint_backends,
        prompt,
    )

    _skip_unless_multi_module_lookahead()
    if "mamba2" not in available_checkpoint_backends():
        pytest.skip("Mamba2 declares checkpoint blocks from vLLM 0.32.0")
    geometry = Geometry(
        C,
        B,
        2048,
        hash_block=16,
        speculative=("multi-mtp", MTP_MODULES),
        prefill_checkpoint="mamba2",
    )
    base = prompt(129, seed=129)
    for mode in ("stock", *FIXING):
        with scheduler_mode(mode):
            sim = Simulation(geometry)
            sim.add("first", base, max_tokens=4)
            sim.run()
            assert sim.chunk_ends("first")[-1] == 129
            sim.add("re-ask", base, max_tokens=4)
            with pytest.raises(AssertionError, match="stalled"):
                sim.run()
        assert sim.reused("re-ask") == 112, mode
        assert not sim.poisoned and not sim.wrong_reuse, mode
