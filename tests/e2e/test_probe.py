"""``vllm-mamba-align probe`` against real ``vllm serve`` servers (CPU engine).

The probe sees the servers only as an operator's client does: their address,
HTTP and ``/metrics``. Same model and geometry as ``test_serve.py`` (C = 8 <
B = 32, every state kept with ``--prefix-cache-retention-interval None``); the
probe runs on that module's servers, after their own scenario, so the default
mode's and stock's servers are started once for both modules. More servers
exist for the probe: ``full``, stock vLLM without the plugin loaded
(``VLLM_PLUGINS`` names only the CPU workarounds), the default mode at vLLM's
default retention (0), and prefix caching off.

Every server has the drafter (``extract_hidden_states``, C < B), so its decode
steps differ from one fresh run to the next on the CPU engine, and the probe
runs as an operator runs it, without ``--rounding``: it measures the rounding
beside a filler (no decode step, no cached state).

The claims: against stock scheduling (``off``, and without the plugin) the
probe exits 1 and names the cases that read a wrong state; with the fix
(default mode at either retention, ``full``) it exits 0 having read cached
states; with prefix caching off it exits 2, says why, and sends no completion.
On the bf16 emulation (``gpu-*``) the fix is never called wrong (every state
kept: bit-identical, 0) and stock is never passed (1 or 5).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from .probe_run import ProbeRun
from .test_serve import ServeRun

# One xdist group: the servers are started once per worker, and test_serve.py
# and test_probe.py read the same ones (conftest.served).
pytestmark = pytest.mark.xdist_group("serve")

SALT_PREFIX = "vllm-mamba-align-probe-"


def probed(get: Callable[[str], ServeRun], key: str) -> ProbeRun:
    run = get(key)
    assert run.probe is not None, f"the {key} server was not probed"
    return run.probe


def check_bounded(probe: ProbeRun) -> None:
    """Serial, within its bound, every request under a salt of its own."""
    report = probe.report
    assert report["requests_sent"] == report["workload"]["requests"] <= 53
    assert report["salt_prefix"].startswith(SALT_PREFIX)
    # The load it is about to send, stated before the first request, and no
    # progress line: stderr is not a terminal.
    (line,) = probe.stderr.splitlines()
    assert line.startswith(f"probe: sending {report['requests_sent']} completions")


def reused(probe: ProbeRun) -> list[str]:
    return [name for name, case in probe.cases().items() if case["cached_tokens"]]


THRESHOLD = 1e-5
"""The probe's default --threshold (its fp32 calibration)."""


def _identical(found: dict[str, Any]) -> bool:
    return found["max_abs_delta_logprob"] == 0 and found["parted_at"] is None


def check_measured_beside_the_filler(probe: ProbeRun) -> list[float]:
    """No ``--rounding``: the probe's account of its rounding samples, each
    re-derived here from the raw comparisons in its JSON (this judge is not
    the probe's code): a decode pair counts where its two runs agree (set
    aside where it leaves the prefill's top-k while the filler pair moved
    within it); a filler pair that moved counts beside a decode pair that
    counts, or below the threshold (fp32), else it is unverified; anything
    outside the top-k is distrusted; the rounding is measured where something
    counts and nothing is distrusted. Returns the beside-the-filler
    differences."""
    report = probe.report
    assert report["rounding_given"] is False
    assert len(report["rounding"]) == 2
    beside, decode_trusted, derived = [], [], []
    for number, pair in enumerate(report["rounding"]):
        found = pair["serial_vs_beside_filler"]
        beside.append(found["max_abs_delta_logprob"])
        moved = not _identical(found) and not found["outside_top_k"]
        agree = _identical(pair["decode_vs_decode"])
        departs = agree and pair["decode_vs_prefill"]["outside_top_k"] and moved
        assert pair["decode_departs_from_prefill"] is departs, pair
        assert pair["decode_used"] is (agree and not departs), pair
        if agree and not departs:
            outside = pair["decode_vs_prefill"]["outside_top_k"]
            derived.append((number, "decode vs prefill", outside))
            decode_trusted.append(not outside)
    for number, pair in enumerate(report["rounding"]):
        found = pair["serial_vs_beside_filler"]
        if not _identical(found):
            derived.append((number, "beside the filler", found))
    trusts = []
    for number, kind, what in derived:
        if kind == "decode vs prefill":
            trust = "distrusted" if what else "trusted"
        elif what["outside_top_k"]:
            trust = "distrusted"
        elif any(decode_trusted) or what["max_abs_delta_logprob"] < THRESHOLD:
            trust = "trusted"
        else:
            trust = "unverified"
        trusts.append((number, kind, trust))
    reported = [
        (s["prompt"], s["kind"], s["trust"]) for s in report["rounding_samples"]
    ]
    assert reported == trusts, (reported, trusts)
    measured = "trusted" in {t for *_, t in trusts} and "distrusted" not in {
        t for *_, t in trusts
    }
    assert report["rounding_measured"] is measured, report["rounding"]
    return beside


@pytest.mark.parametrize("key", ["default", "full"])
def test_probe_passes_a_server_with_the_fix_that_reuses_states(
    served: Callable[[str], ServeRun],
    key: str,
) -> None:
    probe = probed(served, key)
    assert probe.exit_code == 0, probe.report["verdict"]
    check_bounded(probe)
    report = probe.report
    (info,) = report["metrics_before"]["plugin"]
    assert info["mode"] == ("lean" if key == "default" else "full")
    assert report["workload"]["state_block"] == 32
    # Both siblings of every pair and the replay sibling read cached states ...
    assert {"pair2.second", "pair3.second", "replay", "reask"} <= set(reused(probe))
    # ... and, with serial requests and every state kept, continue bit for bit.
    for name, case in probe.cases().items():
        assert case["cached_vs_fresh"]["max_abs_delta_logprob"] == 0, name
        assert case["fresh_vs_fresh"]["max_abs_delta_logprob"] == 0, name
    assert report["verdict"].startswith("[ok] no wrong state served")
    check_measured_beside_the_filler(probe)


def test_probe_passes_the_fix_at_vllms_default_retention(
    served: Callable[[str], ServeRun],
) -> None:
    """Retention 0: each pair's first sibling writes the junction state, the
    second reads it; the replay sibling reads the writer's replay state."""
    probe = probed(served, "default-retention0")
    assert probe.exit_code == 0, probe.report["verdict"]
    check_bounded(probe)
    assert {"pair1.second", "pair2.second", "pair3.second", "replay"} <= set(
        reused(probe)
    )
    assert probe.diverged() == []
    check_measured_beside_the_filler(probe)


@pytest.mark.parametrize("key", ["off", "no-plugin"])
def test_probe_names_the_cases_stock_scheduling_serves_wrong(
    served: Callable[[str], ServeRun],
    key: str,
) -> None:
    probe = probed(served, key)
    assert probe.exit_code == 1, probe.report["verdict"]
    check_bounded(probe)
    report = probe.report
    plugin = report["metrics_before"]["plugin"]
    if key == "off":
        assert [info["mode"] for info in plugin] == ["off"]
    else:
        assert plugin == [] and "vllm-mamba-align" not in served(key).log
        source = report["workload"]["state_block_source"]
        assert source == "vllm:cache_config_info mamba_block_size", source
    assert report["workload"]["state_block"] == 32
    diverged = probe.diverged()
    assert diverged, report["cases"]
    deltas = []
    for name in diverged:
        case = probe.cases()[name]
        assert case["cached_tokens"] > 0, case  # it read a cached state ...
        assert case["fresh_vs_fresh"]["max_abs_delta_logprob"] == 0, case
        deltas.append(case["cached_vs_fresh"]["max_abs_delta_logprob"])
    # ... and the server's own fresh runs agree bit for bit: a cached state at
    # a wrong offset moves the first token's logprobs by 1e-3 and more.
    assert max(deltas) > 1e-3 and min(deltas) > 0, deltas
    # The cases whose state came from a chunk that ended on the B grid (written
    # by a sibling computed from scratch, or the writer's replay state at 4,000,
    # where its 1,000-token chunks end) continue exactly as fresh runs.
    cases = probe.cases()
    for name in ("pair1.second", "replay"):
        assert cases[name]["cached_tokens"] > 0, cases[name]
        assert cases[name]["verdict"] == "exact", cases[name]
    assert report["verdict"].startswith("[!!] wrong states served: ")
    assert (
        re.findall(r"(?:pair|short)\d\.\w+|replay|reask", report["verdict"]) == diverged
    )
    # The bound it judged by was measured, not given: fp32 on the CPU engine
    # rounds a prefill chunked elsewhere by 1e-6 at most, under the threshold.
    assert max(check_measured_beside_the_filler(probe)) < 1e-5
    assert report["bounds"]["wrong_state_beyond"] == 1e-5


def test_probe_keeps_its_salt_family_on_one_engine_of_a_data_parallel_server(
    served: Callable[[str], ServeRun],
) -> None:
    """X-data-parallel-rank: 0 on every request: all the probe's reuse is on
    engine 0's prefix cache (test_serve's scenario ran on both before it)."""
    probe = probed(served, "dp")
    report = probe.report
    assert probe.exit_code == 0, report["verdict"]
    before = report["metrics_before"]["prefix_cache_hits_by_engine"]
    after = report["metrics_after"]["prefix_cache_hits_by_engine"]
    assert sorted(after) == ["0", "1"]
    assert after["1"] == before["1"] and after["0"] > before["0"]
    assert {"pair2.second", "pair3.second", "replay", "reask"} <= set(reused(probe))
    check_bounded(probe)


# -- GPU rounding, emulated ----------------------------------------------------
# The gpu-* servers (test_serve.SETUPS): bf16 model, every stored Mamba state
# rounded to bf16 at every chunk end (MAMBA_ALIGN_E2E_BF16_STATES), step budget
# 1,000: cached and fresh runs are chunked differently, so correct states differ
# from fresh runs by rounding, as on a GPU.


def test_probe_measures_the_emulated_rounding_and_passes_correct_states(
    served: Callable[[str], ServeRun],
) -> None:
    """gpu-measure: no speculative method (C = B: stock's states are correct),
    so the probe's decode steps are reproducible on the CPU engine: both
    yardsticks measure the rounding, and agree in size."""
    probe = probed(served, "gpu-measure")
    report = probe.report
    assert probe.exit_code != 1, report["verdict"]
    beside = check_measured_beside_the_filler(probe)
    decode = []
    for pair in report["rounding"]:
        assert pair["decode_used"], pair
        decode.append(pair["decode_vs_prefill"]["max_abs_delta_logprob"])
    # The emulation's rounding is of a GPU's order (H200: 0.055-0.064) ...
    assert 3e-3 < report["rounding_floor"] < 0.2, report["rounding"]
    # ... by either yardstick, within a factor of 4 of each other ...
    assert max(beside) > 3e-3 and max(decode) > 3e-3, report["rounding"]
    assert max(beside) / 4 < max(decode) < 4 * max(beside), report["rounding"]
    # ... while two fresh runs chunked alike are bit-identical.
    assert report["noise_floor"] == 0
    check_bounded(probe)


@pytest.mark.parametrize("key", ["gpu-kept-retention0", "gpu-kept", "gpu-full"])
def test_probe_never_calls_the_fix_wrong_under_gpu_rounding(
    served: Callable[[str], ServeRun], key: str
) -> None:
    probe = probed(served, key)
    report = probe.report
    assert probe.exit_code != 1, report["verdict"]
    beside = check_measured_beside_the_filler(probe)
    assert probe.diverged() == []
    assert reused(probe), report["cases"]
    deltas = [
        case["cached_vs_fresh"]["max_abs_delta_logprob"]
        for case in probe.cases().values()
    ]
    if key == "gpu-kept-retention0":
        # Resumed at boundaries the fresh runs computed through, correct states
        # differ from them by the emulated rounding (without the emulation the
        # CPU engine is chunk-invariant, bf16 model or not: every case 0). The
        # drafter's decode runs differ, so the rounding rests on the prefills
        # beside the filler alone, which a client cannot verify moved a chunk
        # end: unverified, no bound is set and nothing is passed but what
        # --threshold passes: cannot tell (exit 5), never wrong. Where the
        # decode runs happen to agree, they verify it: exit 0.
        assert min(beside) > 0, report["rounding"]
        assert max(deltas) > 0, deltas
        if report["rounding_measured"]:
            assert probe.exit_code == 0, report["verdict"]
            assert max(deltas) <= report["bounds"]["within_rounding_up_to"], deltas
        else:
            assert probe.exit_code == 5, report["verdict"]
            assert "cannot verify moved a chunk end" in report["verdict"]
    else:
        # Every state kept: kept and full stop every run, fresh or beside a
        # filler or resumed, at every B boundary: chunked alike, equal, and a
        # continuation bit-identical to its fresh run needs no rounding.
        assert max(beside) == 0 and max(deltas) == 0, report["rounding"]
        assert probe.exit_code == 0, report["verdict"]
        assert "bit for bit" in report["verdict"]
    check_bounded(probe)


def test_probe_catches_stock_under_gpu_rounding(
    served: Callable[[str], ServeRun],
) -> None:
    """Stock with the drafter on the bf16 emulation: its wrong states are
    never passed. The rounding beside the filler is unverified (the decode
    runs differ), so they cannot be told (5); where the decode runs happen to
    agree and verify it, they are called wrong (1)."""
    probe = probed(served, "gpu-off")
    report = probe.report
    assert probe.exit_code in (1, 5), report["verdict"]
    assert min(check_measured_beside_the_filler(probe)) > 0
    bound = report["bounds"]["wrong_state_beyond"]
    reading = [c for c in probe.cases().values() if c["cached_tokens"]]
    assert max(c["cached_vs_fresh"]["max_abs_delta_logprob"] for c in reading) > 0
    if probe.exit_code == 1:
        diverged = probe.diverged()
        assert diverged and report["verdict"].startswith("[!!] wrong states served: ")
        for name in diverged:
            case = probe.cases()[name]
            assert case["cached_tokens"] > 0
            assert case["cached_vs_fresh"]["max_abs_delta_logprob"] > bound
    else:
        assert report["verdict"].startswith("[??] cannot tell"), report["verdict"]
        assert report["rounding_measured"] is False
    check_bounded(probe)


def test_probe_says_prefix_caching_is_off_and_sends_nothing(
    served: Callable[[str], ServeRun],
) -> None:
    probe = probed(served, "no-prefix-caching")
    assert probe.exit_code == 2
    report = probe.report
    assert "prefix caching is off" in report["problem"], report
    assert "--no-enable-prefix-caching" in report["problem"]
    assert report["requests_sent"] == 0 and report["cases"] == []


def probe_summary_lines(runs: dict[str, ServeRun]) -> list[str]:
    """Each probe's verdict, cases and time (printed after the tests)."""
    lines = []
    for key, run in runs.items():
        if run.probe is None:
            continue
        cases = ", ".join(
            f"{name} cached {case['cached_tokens']} "
            f"d {case['cached_vs_fresh']['max_abs_delta_logprob']:.2g}"
            for name, case in run.probe.cases().items()
        )
        report = run.probe.report
        rounding = f"{report['rounding_floor']:.2g}" + (
            " (given)"
            if report["rounding_given"]
            else " (measured)"
            if report["rounding_measured"]
            else " (not measured)"
        )
        lines.append(
            f"probe {key}: exit {run.probe.exit_code} in {run.probe.seconds:.1f} s, "
            f"{report['requests_sent']} requests, rounding {rounding}; {cases}"
        )
    return lines
