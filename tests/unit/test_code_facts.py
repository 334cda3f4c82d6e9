"""Facts the plugin reads from vLLM's code rather than from a version number,
on code written here in the shapes vLLM's releases have."""

from __future__ import annotations

import importlib.util
import pathlib
import textwrap

import pytest

from vllm_mamba_align.checkpoints import (
    installed_manager_skips_scratch_move,
    rekeys_checkpoint_block,
    skips_scratch_move_in_checkpoint_steps,
)
from vllm_mamba_align.fingerprint import analyse_source
from vllm_mamba_align.unverified import (
    aligns_drafter_tail,
    stops_after_mid_block_start,
    unverified_body,
)

SPLIT = """
def _mamba_block_aligned_split(
    self, request, num_new_tokens, num_new_local_computed_tokens,
    num_external_computed_tokens,
):
    block_size = self.cache_config.block_size
    start = request.num_computed_tokens
    prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
    last_cache_position = prefill_end - prefill_end % block_size
    end = start + num_new_tokens
    {mid_block}
    if {guard}:
        num_new_tokens = end // block_size * block_size - start
    return num_new_tokens
"""
MID_BLOCK_STOP = """if start % block_size != 0:
        next_block_boundary = (start // block_size + 1) * block_size
        end = min(end, next_block_boundary)"""


@pytest.mark.parametrize(
    ("guard", "aligns"),
    [
        ("end < prefill_end", True),  # 0.27.1+
        ("end < prefill_end and not use_internal_checkpoint", True),  # 0.29.0
        ("end < last_cache_position", False),  # 0.26.0
        ("num_computed_tokens_after_sched < last_cache_position", False),  # ..0.25.1
    ],
)
@pytest.mark.parametrize("mid_block", [True, False])
def test_split_facts_come_from_the_body(
    guard: str, aligns: bool, mid_block: bool
) -> None:
    source = SPLIT.format(guard=guard, mid_block=MID_BLOCK_STOP if mid_block else "")
    shape = analyse_source(source)
    assert aligns_drafter_tail(shape) is aligns
    assert stops_after_mid_block_start(shape) is mid_block
    body = unverified_body(shape)
    assert body.aligns_drafter_tail is aligns
    assert body.stops_after_mid_block_start is mid_block


def test_a_comparison_with_prefill_end_elsewhere_is_not_the_floor_guard() -> None:
    clamp = "    if end < prefill_end:\n        end = prefill_end\n"
    source = SPLIT.format(guard="end < last_cache_position", mid_block="").replace(
        "    return num_new_tokens", clamp + "    return num_new_tokens"
    )
    assert not aligns_drafter_tail(analyse_source(source))


MANAGER = """
class MambaManager:
    def allocate_new_blocks(self, request_id, num_tokens):
        checkpoint_block = int(request_id in self._checkpoints)
        if num_required_blocks <= len(req_blocks) and not checkpoint_block:
            return []
        else:
            {move}
        return new_blocks
"""
SKIPPING = """if blocks_allocated and not checkpoint_block:
                for block_idx in range(first, last):
                    if block_idx < num_skipped_blocks:
                        self._relocate_speculative_block(req_blocks, block_idx)"""
MOVING = """if blocks_allocated:
                for block_idx in range(first, last):
                    if block_idx < num_skipped_blocks - checkpoint_block:
                        self._relocate_speculative_block(req_blocks, block_idx)"""


@pytest.mark.parametrize(
    ("move", "skips"),
    [
        (SKIPPING, True),  # 0.30.0, 0.31.0
        (MOVING, False),  # 0.32.0+ (the early return's "not" guards the else)
        ("pass", False),  # before 0.29.0: no scratch move at all
    ],
)
def test_the_scratch_move_fact_comes_from_the_manager(move: str, skips: bool) -> None:
    source = MANAGER.format(move=move)
    assert skips_scratch_move_in_checkpoint_steps(source) is skips
    indented = textwrap.indent(source, "    ")
    assert skips_scratch_move_in_checkpoint_steps(indented) is skips


REKEYING = """
    def _cache_partial_tail_block(self, request, num_tokens, retention_interval):
        checkpoint = self._checkpoints.get(request.request_id)
        if checkpoint is not None:
            position, column = checkpoint
            block = self.req_to_blocks[request.request_id][column]
            return self.block_pool.cache_partial_block(
                request=request,
                block=block,
                num_tokens=position,
                kv_cache_group_id=self.kv_cache_group_id,
                block_size=self.block_size,
                replace_existing_hashes=True,
            )
        return None
"""
TAIL_ONLY = """
    def _cache_partial_tail_block(self, request, num_tokens):
        block = self.req_to_blocks[request.request_id][num_tokens // self.block_size]
        return self.block_pool.cache_partial_block(
            request=request,
            block=block,
            num_tokens=num_tokens,
            kv_cache_group_id=self.kv_cache_group_id,
            block_size=self.block_size,
        )
"""


@pytest.mark.parametrize(
    ("source", "rekeys"),
    [
        (REKEYING, True),  # 0.30.0-0.33.0: the checkpoint block under its position
        (TAIL_ONLY, False),  # 0.29.0: a prompt's partial tail only
        (REKEYING.replace("replace_existing_hashes=True", "block_size=1"), False),
        (REKEYING.replace("self._checkpoints", "self._tails"), False),
    ],
)
def test_the_checkpoint_rekey_fact_comes_from_the_manager(
    source: str, rekeys: bool
) -> None:
    """Where the backend's in-chunk state is published when its position lies
    below its column's own boundary (audit.slots.own_slot_write)."""
    assert rekeys_checkpoint_block(source) is rekeys


PLATFORM = """
import functools


class PlatformManager(MambaManager):
    '''A platform's subclass whose own allocate_new_blocks runs.'''

    def allocate_new_blocks(self, request_id, num_tokens):
        checkpoint_block = int(request_id in self._checkpoints)
        if blocks_allocated and not checkpoint_block:
            self._relocate_speculative_block(req_blocks, 0)
        return new_blocks


class InheritingManager(MambaManager):
    '''A subclass that runs vLLM's allocate_new_blocks as it is.'''


class WrappingManager(MambaManager):
    '''A subclass whose allocate_new_blocks wraps vLLM's: the source
    inspect finds (through __wrapped__) is not the code that runs.'''

    @functools.wraps(MambaManager.allocate_new_blocks)
    def allocate_new_blocks(self, *args, **kwargs):
        return MambaManager.allocate_new_blocks(self, *args, **kwargs)
"""


def test_the_scratch_move_fact_is_read_from_the_class_the_scheduler_runs(
    tmp_path: pathlib.Path,
) -> None:
    """A platform's Mamba manager is read as its own code, not as vLLM's."""
    source = MANAGER.format(move=MOVING) + PLATFORM
    (tmp_path / "platform_manager.py").write_text(source)
    spec = importlib.util.spec_from_file_location(
        "platform_manager", tmp_path / "platform_manager.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert installed_manager_skips_scratch_move(module.MambaManager) is False
    assert installed_manager_skips_scratch_move(module.InheritingManager) is False
    assert installed_manager_skips_scratch_move(module.PlatformManager) is True
    assert installed_manager_skips_scratch_move(module.WrappingManager) is True


@pytest.mark.parametrize(
    ("stop", "stops"),
    [
        # 0.26.0+: a tuple of stops, the first for an off-grid start.
        (
            "next_block_boundary = (start // block_size + 1) * block_size\n"
            "    stops = (next_block_boundary if start % block_size != 0 else 0,)",
            True,
        ),
        # A nightly build of vLLM main between 0.25.1 and 0.26.0: other names.
        (
            "next_boundary = (num_computed_tokens // block_size + 1) * block_size\n"
            "    if num_computed_tokens % block_size != 0 and next_boundary < end:\n"
            "        num_new_tokens = next_boundary - num_computed_tokens",
            True,
        ),
        # The next boundary of one position, the off-grid test of another.
        (
            "next_boundary = (end // block_size + 1) * block_size\n"
            "    if start % block_size != 0:\n"
            "        num_new_tokens = next_boundary - start",
            False,
        ),
        # The next boundary with no off-grid test: not the mid-block stop.
        ("next_boundary = (start // block_size + 1) * block_size", False),
    ],
)
def test_the_mid_block_stop_is_read_by_shape_not_by_name(
    stop: str, stops: bool
) -> None:
    source = SPLIT.format(guard="end < prefill_end", mid_block=stop)
    assert stops_after_mid_block_start(analyse_source(source)) is stops
