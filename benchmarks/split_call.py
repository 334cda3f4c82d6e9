"""Per-call cost of `_mamba_block_aligned_split`, stock against every mode.

Run: ``python benchmarks/split_call.py`` in an environment with vLLM (CPU is fine).
Best of 5 runs of 50,000 calls on one request mid-prefill (C=816, B=1648); stock is
measured first and last to show the drift of the machine.
"""

from __future__ import annotations

import time

import vllm_mamba_align
from vllm_mamba_align.simulation import Geometry, Simulation, prompt, scheduler_mode

CALLS, RUNS = 50_000, 5


def per_call_us(mode: str) -> float:
    with scheduler_mode(mode):
        sim = Simulation(Geometry(cache_block=816, state_block=1648))
        request = sim.add("a", prompt(16764, 1))
        split = sim.scheduler._mamba_block_aligned_split
        best = float("inf")
        for _ in range(RUNS):
            began = time.perf_counter()
            for _ in range(CALLS):
                split(request, 8192, 0, 0)
            best = min(best, (time.perf_counter() - began) / CALLS)
    return best * 1e6


def main() -> None:
    vllm_mamba_align.register()
    modes = ["stock", "off", "grid", "full", "audit", "stock"]
    print(" | ".join(f"{m} {per_call_us(m):.2f} us" for m in modes))


if __name__ == "__main__":
    main()
