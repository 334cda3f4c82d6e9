"""Benefit and cost of the plugin, measured on the installed vLLM's real scheduler.

Run: ``python benchmarks/bench.py [--output benchmarks/RESULTS.md] [--quick]``
(or ``nox -s bench``). Prints one markdown report. Every mode of
``settings.Mode`` is measured next to stock vLLM, so a new mode shows up by itself.
``measure.py`` measures (functions that return data); ``report.py`` writes the
markdown; this script runs the one, then the other.

How it measures (CPU only, no weights; see ``vllm_mamba_align/tools/sim/``):

- hot path: at 64, 256 and 1,024 running requests, all decoding or mixed with
  prefills, the plugin's own time per step (split calls per step times each
  call's extra cost over stock's, plus audit's look at each step's output) as a
  share of a stock step, and the wall time of ``schedule()`` +
  ``update_from_output()``, each mode's scheduler stepped alternately with its
  own stock scheduler (the order of modes rotated each round, which of the pair
  is built first alternated). Per split call: ``_mamba_block_aligned_split``
  called in a tight loop on a decoding request and on a request mid-prefill, in
  blocks alternating with stock; per mode the geometric mean of the rounds'
  paired ratios, with their range. The oracle is not running.
- benefit and cost: the Mamba state oracle on a workload of varied prompts and
  budgets, each prompt followed by an immediate re-ask and two shared-prefix
  siblings, at vLLM's default state retention, dense, and one interval R > 0.
- scaling: prefill steps of a lone request (its time to first token, in steps)
  against prompt length and budget / B, and steps for N concurrent prefills.
- what users do instead: the same varied workload, served concurrently, by
  stock vLLM, with prefix caching off, with a one-state-block step budget, and
  by the plugin's fixing modes (and with the mode unset), at vLLM's default
  retention and dense (``maintainers/matrix.py`` copies that section into
  docs/modes.md).
- concurrent load (``--load``, counts only, its own report): requests arriving
  over time with decodes sharing each step's budget, unique prompts, prefix
  families, KV pressure and preemption, with and without a backend's in-chunk
  prefill checkpoint; steps, time to first token in steps, chunks, reuse and
  the oracle's verdicts per mode and seed. Counts do not depend on the
  machine's load, so this report is written whatever the load.
- register(): timed inside fresh interpreters, with and without vLLM's scheduler
  module already imported (0.33.0 imports it before plugins run, so the patch and
  the code fingerprint happen inside register()); medians.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import measure
import report

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "maintainers"
    ),
)
import vllm_mamba_align
from matrix import commit


def busy(load: float, own: int) -> bool:
    """Whether the machine is too busy for wall-time figures anyone can
    reproduce: a 1-minute load average above half the cores, plus ``own``
    (the benchmark's own process, once it has run)."""
    return load > (os.cpu_count() or 1) / 2 + own


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--output", help="also write the markdown report here")
    parser.add_argument(
        "--quick", action="store_true", help="fewer rounds (a smoke run)"
    )
    parser.add_argument(
        "--hot-path",
        action="store_true",
        help="measure only the hot path (the plugin's own time per step); "
        "not with --output",
    )
    parser.add_argument(
        "--load",
        action="store_true",
        help="count only the concurrent-load workloads (deterministic: written "
        "whatever the machine's load)",
    )
    args = parser.parse_args()
    if args.load:
        return load_report(args.output)
    if args.hot_path and args.output:
        parser.error("--hot-path measures one section: it writes no report")
    load_before = os.getloadavg()[0]
    if args.output and busy(load_before, own=0):
        measure.log(
            f"refusing to measure for {args.output}: the 1-minute load average is "
            f"{load_before:.2f} on {os.cpu_count()} CPUs (busy: above half the "
            "cores). Wait for an idle machine, or run without --output to see "
            "figures that will not be committed."
        )
        return 2
    import vllm

    vllm_mamba_align.register()
    revision = commit()  # before this run writes its files
    began = time.monotonic()
    quick = args.quick
    count = 8 if quick else 16
    runs = 3 if quick else 15
    overhead = measure.measure_overhead(
        rounds=1 if quick else 4,
        calls=2000 if quick else 10000,
        shapes=measure.BATCHES[:1] if quick else measure.BATCHES,
    )
    if args.hot_path:
        print("\n".join(report.overhead_section(overhead)))
        return 0
    benefit = measure.measure_benefit(count)
    alternatives = measure.measure_alternatives(count)
    scaling = measure.measure_scaling(quick)
    register = measure.measure_register(runs)
    elapsed = time.monotonic() - began
    text = report.render(
        report.header(
            vllm.__version__,
            vllm_mamba_align.__version__,
            os.cpu_count(),
            elapsed / 60,
            quick,
            revision,
            (load_before, os.getloadavg()[0]),
        ),
        [
            report.overhead_section(overhead),
            report.benefit_section(count, benefit),
            report.alternatives_section(count, alternatives),
            report.scaling_section(scaling),
            report.register_section(runs, register),
        ],
    )
    print(text)
    load_after = os.getloadavg()[0]
    if args.output and busy(load_after, own=1):
        measure.log(
            f"not writing {args.output}: the 1-minute load average rose to "
            f"{load_after:.2f} during the run (busy: above half the cores plus the "
            "benchmark's own one)"
        )
        return 3
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    measure.log(f"done in {elapsed:.0f}s")
    return 0


def load_report(output: str | None) -> int:
    """The concurrent-load counts, alone (``--load``)."""
    import vllm

    vllm_mamba_align.register()
    revision = commit()
    began = time.monotonic()
    load_before = os.getloadavg()[0]
    results, ablations = measure.measure_load()
    elapsed = time.monotonic() - began
    text = report.render(
        (
            f"## Concurrent load (vLLM {vllm.__version__}, vllm-mamba-align "
            f"{vllm_mamba_align.__version__})\n\n"
            "Produced by `benchmarks/bench.py --load` (what `python3 -m nox -s "
            f"bench_load` runs) at commit {revision}, {elapsed / 60:.1f} minutes "
            f"on {os.cpu_count()} CPUs (1-minute load average {load_before:.2f} "
            f"before, {os.getloadavg()[0]:.2f} after: counts do not depend on it)."
        ),
        [
            report.load_section(measure.LOAD_SEEDS, results),
            report.ablation_section(ablations),
        ],
    )
    print(text)
    if output:
        with open(output, "w") as f:
            f.write(text)
    measure.log(f"done in {elapsed:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
