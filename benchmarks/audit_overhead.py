"""Overhead of audit mode: stock vs audit ``schedule()`` + ``update_from_output()``.

Runs the real vLLM scheduler on CPU (``vllm_mamba_align.simulation``; needs vLLM
and torch installed) in the heterogeneous geometry of the test suite (attention
block C = 816, Mamba state block B = 1648, step budget 8,192), with a steady batch
of 64 requests: a few long prompts in chunked prefill, the rest decoding, finished
requests replaced by new ones. Only the two scheduler calls are timed; the model's
output is a fixed token per finished prefill. Stock and audit runs alternate
(fresh scheduler each, same requests) so drift in the machine hits both alike.

    python benchmarks/audit_overhead.py [--rounds 12] [--steps 400]

Also measures ``off`` (plugin loaded, stock split): the plugin's class-level split
wrapper is on every split call in every mode, so audit / off isolates what
counting adds. Target: audit / stock <= 1.01.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

BATCH = 64
C, B, BUDGET = 816, 1648, 8192


@contextlib.contextmanager
def stock_vllm() -> Iterator[None]:
    """vLLM's own scheduler methods, with the plugin's wrappers taken off."""
    import vllm.v1.core.sched.scheduler as module

    from vllm_mamba_align.plugin import is_patched

    saved = []
    for name in ("__init__", "_mamba_block_aligned_split", "schedule", "shutdown"):
        current = vars(module.Scheduler).get(name)
        if is_patched(current):
            saved.append((name, current))
            setattr(module.Scheduler, name, current.__wrapped__)
    try:
        yield
    finally:
        for name, current in saved:
            setattr(module.Scheduler, name, current)


@contextlib.contextmanager
def plugin_mode(mode: str) -> Iterator[None]:
    previous = os.environ.get("VLLM_MAMBA_ALIGN_MODE")
    os.environ["VLLM_MAMBA_ALIGN_MODE"] = mode
    try:
        yield
    finally:
        if previous is None:
            del os.environ["VLLM_MAMBA_ALIGN_MODE"]
        else:
            os.environ["VLLM_MAMBA_ALIGN_MODE"] = previous


class Driver:
    """A scheduler kept at BATCH requests; times schedule() + update_from_output()."""

    def __init__(self) -> None:
        from vllm_mamba_align.simulation import Geometry, _init_hashing, build_scheduler

        geometry = Geometry(
            cache_block=C,
            state_block=B,
            budget=BUDGET,
            max_num_seqs=BATCH,
            num_blocks=20_000,
        )
        self.scheduler = build_scheduler(geometry)
        self.hash_fn = _init_hashing()
        self.next_id = 0

    def add(self) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        from vllm_mamba_align.simulation import prompt

        index = self.next_id
        self.next_id += 1
        # Mostly short prompts (quickly decoding), every 8th a long one.
        length = 9_000 + 977 * (index % 7) if index % 8 == 0 else 300 + 37 * index % 900
        hasher = get_request_block_hasher(self.scheduler.hash_block_size, self.hash_fn)
        request = Request(
            f"r{index}",
            prompt(length, seed=index),
            SamplingParams(max_tokens=64 + index % 64, ignore_eos=True),
            None,
            block_hasher=hasher,
        )
        self.scheduler.add_request(request)

    def step(self) -> int:
        """One timed step; returns its nanoseconds."""
        from vllm.v1.outputs import ModelRunnerOutput

        scheduler = self.scheduler
        begin = time.perf_counter_ns()
        output = scheduler.schedule()
        middle = time.perf_counter_ns()
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([7] if done else [])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        resume = time.perf_counter_ns()
        scheduler.update_from_output(output, runner_output)
        end = time.perf_counter_ns()
        while len(scheduler.requests) < BATCH:
            self.add()
        return (middle - begin) + (end - resume)


def run(mode: str, steps: int) -> tuple[list[int], str]:
    context = stock_vllm() if mode == "stock" else plugin_mode(mode)
    with context:
        driver = Driver()
        for _ in range(BATCH):
            driver.add()
        for _ in range(50):  # warm up into the steady mixed state
            driver.step()
        timings = [driver.step() for _ in range(steps)]
        from vllm_mamba_align.audit import snapshot

        found = snapshot(driver.scheduler)
        assert (found is None) == (mode != "audit"), f"{mode} run misconfigured"
    return timings, "" if found is None else found.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=400)
    options = parser.parse_args()

    import vllm_mamba_align

    vllm_mamba_align.register()
    import vllm.v1.core.sched.scheduler  # noqa: F401  (apply the wrappers)

    modes = ("stock", "off", "audit")
    per_round: dict[str, list[float]] = {mode: [] for mode in modes}
    summary = ""
    for index in range(options.rounds):
        order = modes if index % 2 == 0 else modes[::-1]
        for mode in order:
            timings, text = run(mode, options.steps)
            per_round[mode].append(statistics.median(timings) / 1000)
            summary = text or summary
    median = {mode: statistics.median(per_round[mode]) for mode in modes}
    print(f"batch {BATCH} requests, C={C}, B={B}, budget {BUDGET}")
    print(f"{options.rounds} interleaved rounds x {options.steps} steps per mode")
    for mode in modes:
        print(
            f"{mode:5}  schedule()+update_from_output(): "
            f"median {median[mode]:8.1f} us/step"
        )
    print(f"ratio audit / stock: {median['audit'] / median['stock']:.3f}")
    print(f"ratio off / stock:   {median['off'] / median['stock']:.3f}")
    print(f"ratio audit / off:   {median['audit'] / median['off']:.3f}")
    print(f"last audit run: {summary}")


if __name__ == "__main__":
    main()
