"""KV connectors (issue 11, part "KV connectors"), on the real scheduler.

A KV connector (P/D disaggregation, offloading, a shared store) hands the
scheduler an external hit: ``num_external_computed_tokens`` goes into
``_mamba_block_aligned_split`` (scheduler.py:1350-1356 in 0.33.0) and the
request's first chunk starts wherever the hit ended, which need not be on the
state grid B, nor on the cache grid C. Its Mamba group gets one real block for
the hit, the running slot ``ceil(e / B) - 1``, into which the connector loads
the state after the hit (the simulation's worker model does that load, see
``Simulation._load_external_states``). Stores also receive this instance's
boundary states (``boundary_state_offloads``, 0.29.0+): a wrong one there would
be loaded by every instance that shares the store (``sim.wrong_offloads``).

The connector is a test-only third-party one (``tests/support/
prefix_store_connector.py``), loaded through ``kv_connector_module_path``.

Scenario: C = 816, B = 1,648 (upstream's), a 16,764-token prompt whose first
5,000 tokens (on neither grid), 4,896 (on C only) or 16,763 (P - 1: what a P/D
decode instance loads) are in the store; then a sibling sharing 9,000 tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import built_or_skipped, cache_block_for, installed_body, scheduler_mode
from random_workloads import (
    connector_hits_resume_from_null_blocks,
    external_block_undercounted,
)

from vllm_mamba_align.tools.installed import supports_hash_block
from vllm_mamba_align.tools.sim import (
    Geometry,
    Simulation,
    available_checkpoint_backends,
    prompt,
)

B = 1648
P = 16764
BUDGET = 8192
SHARED = 9000
OFF_BOTH_GRIDS = 5000
ON_C_ONLY = 4896
DECODE_SIDE = P - 1


def _connector() -> str:
    """The test connector's ``module:Class``, or skip where vLLM has no
    connector API it fits (V1 connectors with ``SupportsHMA`` and a
    ``kv_cache_config`` constructor argument, required for hybrid models)."""
    try:
        from support import prefix_store_connector as module
    except ImportError as error:
        pytest.skip(f"this vLLM has no V1 KV connector API for hybrid models: {error}")
    import inspect

    base = module.KVConnectorBase_V1
    if "kv_cache_config" not in inspect.signature(base.__init__).parameters:
        pytest.skip("this vLLM's connectors take no kv_cache_config")
    return f"{module.MODULE}:{module.NAME}"


def _divergent_supported() -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "supports_divergent_local_hybrid_hits")


def _run(
    mode: str,
    held: int,
    *,
    cache_block: int | None = None,
    divergent: bool = False,
    async_load: bool = False,
    retention: int | str | None = "default",
    backend: str | None = None,
) -> Simulation:
    """The prompt with ``held`` of its tokens in the store, then its sibling."""
    connector = _connector()
    if divergent and not _divergent_supported():
        pytest.skip("this vLLM has no supports_divergent_local_hybrid_hits")
    geometry = Geometry(
        cache_block_for(B) if cache_block is None else cache_block,
        B,
        BUDGET,
        hash_block=16 if supports_hash_block() else None,
        retention=retention,
        prefill_checkpoint=backend,
        kv_connector=connector,
        kv_connector_config=(("divergent_hits", divergent), ("async_load", async_load)),
    )
    base = prompt(P, seed=1)
    with scheduler_mode(mode), built_or_skipped():
        sim = Simulation(geometry)
        store: Any = sim.scheduler.connector
        assert store.supports_divergent_local_hybrid_hits is divergent
        store.hold(base[:held])
        sim.add("first", base)
        sim.run()
        sim.add("sibling", base[:SHARED] + prompt(P - SHARED, seed=2))
        sim.run()
    assert ("first", held) in sim.store_loads  # the hit was taken and loaded
    return sim


def _vllm_resumes_from_null_blocks() -> bool:
    """vLLM's own connector defect on this release (0.24.0):
    random_workloads.connector_hits_resume_from_null_blocks."""
    with built_or_skipped():  # before 0.20.2 vLLM asserts on any external hit
        return connector_hits_resume_from_null_blocks(_connector())


def _next_boundary(position: int) -> int:
    return min((position // B + 1) * B, P)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("divergent", [False, True], ids=["agreed", "divergent"])
@pytest.mark.parametrize("held", [OFF_BOTH_GRIDS, ON_C_ONLY, DECODE_SIDE])
@pytest.mark.parametrize("mode", ["full", "kept", "grid"])
def test_an_external_hit_off_the_grid_publishes_and_saves_only_right_states(
    mode: str, held: int, divergent: bool, async_load: bool
) -> None:
    """From a hit ending off the B grid the first chunk ends on the next B
    boundary; nothing wrong is published, reused or handed to the store; every
    prefill finishes; full and kept materialize every state vLLM keeps."""
    sim = _run(mode, held, divergent=divergent, async_load=async_load)
    ends = sim.chunk_ends("first")
    assert ends[0] == _next_boundary(held), ends
    # Below vLLM's own partial-tail stop (the prompt's last hash block) every
    # chunk ends on the B grid.
    tail = (P - 1) // B * B
    assert [e for e in ends if e < tail and e % B] == [], ends
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
    if _vllm_resumes_from_null_blocks():
        # vLLM's own defect here (stock alike, test below): a sibling's local
        # hit below the loaded prefix resumes from the null block.
        assert all(w.endswith("holding nothing") for w in sim.wrong_reuse)
    else:
        assert sim.wrong_reuse == []
    assert sim.wrong_offloads == []
    assert all(r.prefilled_at_step is not None for r in sim.records.values())
    if mode in ("full", "kept"):
        assert sim.missing_kept == []
    if mode == "full" and not sim.wrong_reuse:
        # States computed from the store's are counted apart, never as wrong
        # (those continued from vLLM's null-block resume are not the split's).
        assert sim.noncanonical_kept == []


@pytest.mark.parametrize("divergent", [False, True], ids=["agreed", "divergent"])
def test_stock_ends_chunks_after_an_external_hit_on_the_cache_grid(
    divergent: bool,
) -> None:
    """The control (mode off: stock scheduling). From the hit at 5,000 stock
    stops at the next C boundary (5,712), then ends chunks on the C grid: the
    block claiming the prompt's kept replay boundary (16,480) holds the state
    after 16,320, is published, and is handed to the store to save: every
    instance loading that prefix from the store would read it."""
    if cache_block_for(B) == B:
        pytest.skip("this vLLM refuses C < B at startup")
    sim = _run("off", OFF_BOTH_GRIDS, divergent=divergent)
    ends = sim.chunk_ends("first")
    assert ends[0] == 5712, ends
    wrong = [str(p) for p in sim.poisoned.values()]
    assert "state@16480 holds state@16320" in " ".join(wrong), wrong
    if sim.offloads:  # 0.29.0+ hands boundary states to the connector
        assert any(
            "saved as state@16480 holds state@16320" in w for w in sim.wrong_offloads
        ), sim.wrong_offloads


def test_stock_with_equal_blocks_stops_at_the_boundary_after_an_external_hit() -> None:
    """Where C == B stock already stops a chunk that starts mid-block at the next
    boundary (the hit's end is no worse than any other mid-block start): nothing
    wrong is published. It still runs later chunks across several boundaries,
    so under dense retention kept states go missing; full materializes them."""
    stock = _run("off", OFF_BOTH_GRIDS, cache_block=B, retention=None)
    if not installed_body().stops_after_mid_block_start:
        # Before 0.26.0 vLLM has no such stop: its chunk runs on to 11,592 and
        # stock publishes the hit's block as the next boundary's state; grid
        # adds the stop.
        assert stock.chunk_ends("first")[0] > 6592
        assert stock.poisoned
        grid = _run("grid", OFF_BOTH_GRIDS, cache_block=B, retention=None)
        assert grid.chunk_ends("first")[0] == 6592
        assert not grid.poisoned
        return
    assert stock.chunk_ends("first")[0] == 6592
    assert not stock.poisoned
    if not _vllm_resumes_from_null_blocks():
        assert stock.wrong_reuse == []
    assert stock.wrong_offloads == []
    assert stock.missing_kept != []
    fixed = _run("full", OFF_BOTH_GRIDS, cache_block=B, retention=None)
    assert fixed.missing_kept == []
    assert not fixed.poisoned


@pytest.mark.parametrize("mode", ["grid", "kept", "full"])
def test_a_hit_off_the_grid_is_stopped_at_its_boundary_also_when_checkpointed(
    mode: str,
) -> None:
    """A store hit ending at 13,008 (16-aligned, off the B grid) and a backend
    that checkpoints prefill states (Mamba2, alignment 1): 0.30.0+ decides to
    checkpoint the final chunk 13,008 -> 16,764 internally and drops its own
    stop at the boundary after a mid-block start (scheduler.py:645-649 in
    0.33.0). The block of 13,184 holds the loaded state@13,008 and is
    published (dense retention keeps it) as state@13,184, and handed to the
    store: stock and, before the fix, ``grid`` did exactly that. The backend
    writes one state, at 16,752, in another block."""
    if "mamba2" not in available_checkpoint_backends():
        pytest.skip("Mamba2 declares prefill checkpoint blocks from vLLM 0.32.0")
    held = 13008
    sim = _run(mode, held, backend="mamba2", retention=None)
    assert sim.chunk_ends("first")[0] == _next_boundary(held)
    assert not sim.poisoned, [str(p) for p in sim.poisoned.values()]
    assert sim.wrong_offloads == []
    assert sim.wrong_reuse == []


def test_vllm_own_null_block_resume_after_a_connector_load_is_recorded() -> None:
    """Where vLLM has it (0.24.0), the null-block resume is stock vLLM's own:
    the decode-side load (16,763 tokens) then a sibling sharing 9,000 tokens
    resumes at 8,240 from the null block, with the plugin off."""
    if not _vllm_resumes_from_null_blocks():
        pytest.skip("this vLLM resumes connector siblings from written blocks")
    sim = _run("off", DECODE_SIDE, cache_block=B)
    assert sim.wrong_reuse == ["sibling resumed at 8240 from block 0 holding nothing"]


@pytest.mark.parametrize("mode", ["off", "full"])
def test_vllm_undercounts_the_mamba_block_of_an_external_hit(mode: str) -> None:
    """vLLM's own defect (found by the long profile on 0.28.0, stock alike on
    0.23.0-0.33.0): C = B = 64, a pool of 4 blocks (3 free), a 150-token prompt
    whose first 64 tokens are in the store. vLLM's check asks 3 blocks for the
    chunk 64 -> 128 (attention 2, Mamba 1) and lets it through; allocating, the
    Mamba group takes 2 (the hit's own block, then the running one) and
    ``schedule()`` raises instead of waiting. The plugin only picks chunk
    lengths: stock and ``full`` fail alike, and the sweep records such a case
    as vLLM's (random_workloads.VllmDefect)."""
    geometry = Geometry(
        64,
        64,
        64,
        hash_block=16 if supports_hash_block() else None,
        num_blocks=4,
        reserve_full_input=False,
        kv_connector=_connector(),
        kv_connector_config=(("divergent_hits", False), ("async_load", False)),
    )
    base = prompt(150, seed=1)
    with scheduler_mode(mode), built_or_skipped():
        sim = Simulation(geometry)
        sim.scheduler.connector.hold(base[:64])
        sim.add("r", base)
        with pytest.raises(ValueError, match="free blocks from the pool") as raised:
            sim.run(max_steps=50)
    assert external_block_undercounted(raised.value)
    assert sim.store_loads == []  # it failed before its hit was loaded
