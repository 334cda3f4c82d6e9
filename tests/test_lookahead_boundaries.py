"""vLLM pull request #57605 on the real scheduler: in align mode the Mamba
manager sizes a request's blocks by the main model's tokens alone
(single_type_kv_cache_manager.py:1736 on 0.33.0, :1741 on 0.34.0), so a chunk
ending exactly on a B boundary with lookahead tokens after it (MTP's
``num_lookahead_tokens``) gets no block past the boundary. The report says the
boundary's state then lands in a stale block.

The plugin's modes end more chunks exactly on B boundaries than stock does, so
if vLLM's worker wrote such a state into a stale block they would make it more
frequent. The witness (tests/witness: it mirrors the worker's Mamba writes of
vLLM 0.33.0 and 0.34.0 with drafts, and judges every published hash and every
read against them) runs the same loads in stock and every fixing mode: chunks
ending on B boundaries with lookahead after them, drafts verified and
rejected, a pool small enough that blocks are freed and handed out again, and
siblings reading what the first requests left.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from witness.engine import Shape
from witness.judge import Witness
from witness.workloads import STATE_BLOCK, Arrival, Workload, draft_setting, drive

from vllm_mamba_align.tools.modes import scheduler_mode

MODES = ("stock", "lean", "kept", "full", "grid")
"""Stock, then every fixing mode (``lean`` is the default)."""


def _arrivals() -> tuple[Arrival, ...]:
    """Prompts of whole B blocks or a few tokens past them, arriving over a
    few steps, then siblings extending two of them (read at a boundary)."""
    rng = random.Random(57605)
    lengths = [4 * STATE_BLOCK, 5 * STATE_BLOCK + 7, 3 * STATE_BLOCK, 6 * STATE_BLOCK]
    lengths += [2 * STATE_BLOCK + 1, 7 * STATE_BLOCK]
    base = [rng.randrange(1, 500) for _ in range(max(lengths))]
    arrivals = [
        Arrival(
            index,
            f"r{index}",
            tuple(base[: length - 40] + [rng.randrange(1, 500) for _ in range(40)])
            if index % 2
            else tuple(base[:length]),
            rng.choice([3, 9, 20]),
        )
        for index, length in enumerate(lengths)
    ]
    for parent in ("r0", "r3"):
        tokens = next(a.tokens for a in arrivals if a.req_id == parent)
        extra = tuple(rng.randrange(1, 500) for _ in range(STATE_BLOCK + 5))
        arrivals.append(
            Arrival(0, f"{parent}-sibling", tokens + extra, 4, after=parent)
        )
    return tuple(arrivals)


def _workloads() -> list[Workload]:
    """MTP with 3 draft tokens beside C = B (stock ends chunks on B too;
    every boundary state kept), and with 2 beside C = 64 < B (the fixing modes
    end more chunks on B than stock); a budget of two B blocks."""
    base = Shape(STATE_BLOCK, STATE_BLOCK, STATE_BLOCK, budget=2 * STATE_BLOCK)
    scarce = replace(base, num_blocks=30, reserve_full_input=False)
    return [
        Workload(
            "C = B, 3 drafts, dense",
            replace(scarce, drafts=3, retention=None),
            _arrivals(),
        ),
        Workload(
            "C = 64, 2 drafts", replace(scarce, drafter_block=64, drafts=2), _arrivals()
        ),
    ]


def _boundary_chunks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts, through the witness's step hook, the prefill chunks that end
    exactly on a B boundary while the scheduler reserves lookahead tokens."""
    seen = [0]
    run_step = Witness.run_step

    def counted(
        self: Witness,
        output: Any,
        chunks: dict[str, tuple[int, int]],
        accepted: Any = None,
    ) -> None:
        lookahead = getattr(self.scheduler, "num_lookahead_tokens", 0)
        for req_id, (_, end) in chunks.items():
            request = self.scheduler.requests[req_id]
            drafted = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
            if (
                lookahead
                and not drafted
                and end % self.state_block == 0
                and end <= request.num_prompt_tokens
            ):
                seen[0] += 1
        run_step(self, output, chunks, accepted)

    monkeypatch.setattr(Witness, "run_step", counted)
    return seen


def measure(mode: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, int]]:
    """One mode's counts, per workload."""
    seen = _boundary_chunks(monkeypatch)
    counts = {}
    keys = ("wrong_publications", "wrong_reads", "publications", "reads", "draft_steps")
    with scheduler_mode(mode):
        for workload in _workloads():
            before = seen[0]
            findings, events = drive(workload)
            assert events.unfinished == [], (mode, workload.name)
            counts[workload.name] = {k: getattr(findings, k) for k in keys} | {
                "cache_hits": events.cache_hits,
                "boundary_chunks": seen[0] - before,
            }
    return counts


@pytest.mark.random_workloads
@pytest.mark.parametrize("mode", MODES)
def test_chunks_ending_on_a_boundary_with_lookahead_publish_and_read_no_stale_state(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No published or read Mamba state comes from a stale block, in stock or
    any fixing mode, though every mode ends chunks exactly on B boundaries
    with lookahead tokens after them (counted), drafts are verified, and
    siblings hit the cache. Stock with C = 64 < B publishes wrong states of
    its own (chunks on C's grid, the defect the plugin fixes), not judged
    here."""
    if not draft_setting():
        pytest.skip("the witness mirrors drafts on vLLM 0.33.0 and 0.34.0 only")
    counts = measure(mode, monkeypatch)
    for name, found in counts.items():
        print(f"#57605 {mode:5} {name:22} {found}")
    total = {k: sum(c[k] for c in counts.values()) for k in next(iter(counts.values()))}
    assert total["boundary_chunks"] > 0, counts
    assert total["draft_steps"] > 0 and total["cache_hits"] > 0, counts
    assert total["publications"] > 0 and total["reads"] > 0, counts
    for name, found in counts.items():
        if mode == "stock" and name.startswith("C = 64"):
            continue
        assert found["wrong_publications"] == 0, (name, found)
        assert found["wrong_reads"] == 0, (name, found)
