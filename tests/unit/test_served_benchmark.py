"""The served benchmark's own parts (benchmarks/served_plan.py, served.py): which
arms it starts and with what, the multi-turn file it writes, and the arithmetic
of its record. No server runs here: `nox -s bench_serve` runs them."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from vllm_mamba_align.settings import MODE_VARIABLE, Mode

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def plan(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("served_plan")


@pytest.fixture
def runner(plan: ModuleType) -> Iterator[ModuleType]:
    """benchmarks/served.py, imported as the script imports its neighbours."""
    yield importlib.import_module("served")
    sys.modules.pop("served", None)


def a_run(plan: ModuleType, arm: str, throughput: float, **fields: object) -> object:
    values = {
        "workload": "unique",
        "arm": arm,
        "run": 0,
        "load_before": 0.5,
        "quiet": True,
        "request_throughput": throughput,
        "mean_ttft_ms": 100.0,
        "median_ttft_ms": 90.0,
        "completed": 160,
        "failed": 0,
        "seconds": 16.0,
    }
    values.update(fields)
    return plan.Run(**values)


# -- arms ---------------------------------------------------------------------


def test_the_arms_are_stock_first_and_the_default_leaves_the_mode_unset(
    plan: ModuleType,
) -> None:
    arms = {arm.name: arm for arm in plan.ARMS}
    assert plan.ARMS[0].name == "stock"
    assert list(arms) == [
        "stock",
        "default",
        "full",
        "grid",
        "no-prefix-caching",
        "budget",
    ]
    assert arms["stock"].environment() == {MODE_VARIABLE: Mode.OFF.value}
    assert arms["default"].environment() == {}, "the installed default, not a name"
    assert arms["full"].environment() == {MODE_VARIABLE: "full"}
    assert arms["grid"].environment() == {MODE_VARIABLE: "grid"}
    # Each mode an arm names is one the plugin accepts.
    for arm in plan.ARMS:
        if arm.mode is not None:
            assert Mode(arm.mode)
    assert arms["no-prefix-caching"].options == {"enable_prefix_caching": False}
    assert arms["budget"].budget_from_b and arms["budget"].mode == "off"


def test_choosing_arms_keeps_stock_and_the_default_the_budget_arm_reads(
    plan: ModuleType,
) -> None:
    assert plan.choose_arms(None) == plan.ARMS
    assert [arm.name for arm in plan.choose_arms(["full"])] == ["stock", "full"]
    chosen = plan.choose_arms(["budget"])
    assert [arm.name for arm in chosen] == ["stock", "default", "budget"]
    with pytest.raises(ValueError, match=r"unknown arm\(s\) kept: choose from stock"):
        plan.choose_arms(["kept"])


def test_rotation_puts_each_arm_first_once_in_as_many_runs(plan: ModuleType) -> None:
    arms = plan.ARMS
    firsts = [plan.rotated(arms, run)[0].name for run in range(len(arms))]
    assert sorted(firsts) == sorted(arm.name for arm in arms)
    for run in range(3 * len(arms)):
        assert sorted(a.name for a in plan.rotated(arms, run)) == sorted(
            a.name for a in arms
        )


def test_the_default_arms_server_drops_a_mode_set_in_the_calling_shell(
    runner: ModuleType,
    plan: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(MODE_VARIABLE, "full")
    arms = {arm.name: arm for arm in plan.ARMS}
    default = runner.server_for(arms["default"], tmp_path, tmp_path, 32)
    assert MODE_VARIABLE not in default.env
    stock = runner.server_for(arms["stock"], tmp_path, tmp_path, 32)
    assert stock.env[MODE_VARIABLE] == "off"


def test_the_budget_arm_serves_with_2b_minus_1_and_the_others_with_320(
    runner: ModuleType, plan: ModuleType, tmp_path: Path
) -> None:
    def budget(name: str, b: int | None) -> str:
        arm = next(arm for arm in plan.ARMS if arm.name == name)
        words = runner.server_for(arm, tmp_path, tmp_path, b).command
        return words[words.index("--max-num-batched-tokens") + 1]

    assert budget("budget", 64) == "127"  # the largest in [B, 2B)
    assert budget("stock", 64) == budget("default", None) == "320"
    with pytest.raises(RuntimeError, match="needs B"):
        budget("budget", None)
    arm = next(arm for arm in plan.ARMS if arm.name == "no-prefix-caching")
    command = shlex.join(runner.server_for(arm, tmp_path, tmp_path, 32).command)
    assert "--no-enable-prefix-caching" in command
    assert "--prefix-cache-retention-interval 0" in command
    assert "extract_hidden_states" in command


# -- workloads ----------------------------------------------------------------


def test_each_multiturn_turn_extends_its_conversations_previous_turn(
    plan: ModuleType,
) -> None:
    prompts = plan.multiturn_prompts(4, 3, 10, 5, seed=7)
    assert len(prompts) == 12
    words = [prompt.split() for prompt in prompts]
    # Turn-major: the four first turns, then the four second turns, ...
    assert [len(w) for w in words] == [10] * 4 + [15] * 4 + [20] * 4
    for turn in (1, 2):
        for conversation in range(4):
            now = words[turn * 4 + conversation]
            before = words[(turn - 1) * 4 + conversation]
            assert now[: len(before)] == before
    # Conversations share nothing: their first turns differ from the first word.
    assert len({w[0] + " " + w[1] for w in words[:4]}) == 4
    vocabulary = {f"t{i}" for i in range(3, 512)}
    assert all(set(w) <= vocabulary for w in words)
    assert plan.multiturn_prompts(4, 3, 10, 5, seed=7) == prompts
    assert plan.multiturn_prompts(4, 3, 10, 5, seed=8) != prompts


def test_every_workload_sends_what_it_says(plan: ModuleType) -> None:
    """More conversations than requests in flight (a turn finds its previous
    turn answered), and whole prefix groups (no repeats filled in)."""
    workloads = {workload.name: workload for workload in plan.WORKLOADS}
    mix = workloads["multiturn"]
    assert mix.conversations > plan.CONCURRENCY
    assert mix.requests == mix.conversations * mix.turns
    assert workloads["prefix"].requests % plan.PREFIXES == 0
    assert all(workload.requests >= 96 for workload in plan.WORKLOADS)


def test_the_multiturn_file_is_one_prompt_a_line_with_its_output_length(
    plan: ModuleType, tmp_path: Path
) -> None:
    (workload,) = plan.choose_workloads(["multiturn"])
    assert workload.requests == workload.conversations * workload.turns
    path = plan.write_multiturn(tmp_path / "mix.jsonl", workload, seed=1)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == workload.requests
    assert {tuple(sorted(line)) for line in lines} == {("output_tokens", "prompt")}
    assert {line["output_tokens"] for line in lines} == {workload.output_tokens}
    last = workload.first_words + (workload.turns - 1) * workload.words_per_turn
    assert len(lines[-1]["prompt"].split()) == last
    # Each run's prompts are new to the servers, which keep their caches.
    assert plan.run_seed(0) != plan.run_seed(1)


def test_an_unknown_workload_is_named_with_the_choices(plan: ModuleType) -> None:
    assert [w.name for w in plan.choose_workloads(None)] == [
        "unique",
        "prefix",
        "multiturn",
    ]
    with pytest.raises(ValueError, match=r"random: choose from unique, prefix"):
        plan.choose_workloads(["random"])


# -- the record ---------------------------------------------------------------


def test_a_spread_is_the_median_and_range_of_the_runs(plan: ModuleType) -> None:
    spread = plan.Spread.of([3.0, 1.0, 2.0, 10.0])
    assert (spread.median, spread.low, spread.high) == (2.5, 1.0, 10.0)
    assert plan.Spread.of([2.0, 4.0, 3.0]).within(spread)
    assert not plan.Spread.of([11.0]).within(spread)
    with pytest.raises(ValueError, match="no runs"):
        plan.Spread.of([])


def test_the_table_gives_each_arms_medians_and_their_ratio_to_stocks(
    plan: ModuleType,
) -> None:
    runs = [
        a_run(plan, "stock", 10.0, mean_ttft_ms=200.0),
        a_run(plan, "stock", 12.0, mean_ttft_ms=100.0),
        a_run(plan, "stock", 11.0, mean_ttft_ms=150.0, run=2),
        a_run(plan, "default", 9.0, mean_ttft_ms=150.0),
        a_run(plan, "default", 9.9, mean_ttft_ms=180.0, load_before=1.4, quiet=False),
        a_run(plan, "default", 13.0, mean_ttft_ms=165.0),
    ]
    stock, default = plan.workload_table(runs, ["stock", "default"])[2:]
    assert stock.startswith("| stock | 3 | 11.00 (10.00-12.00) | 1.00x | 150 (100-200)")
    # 9.9 / 11 and 165 / 150: the medians' ratios, not the means'.
    assert "| default | 3 | 9.90 (9.00-13.00) | 0.90x | 165 (150-180) | 1.10x |" in (
        default
    )
    assert "0.50 (0.50-1.40), 1 above the threshold" in default
    assert plan.default_against_stock(runs) == (
        "The default against stock: median throughput 9.90 requests/s, outside the "
        "range of stock's runs (10.00-12.00), 0.90x stock's median; TTFT 1.10x "
        "(mean) and 1.00x (median) stock's."
    )
    assert plan.default_against_stock(runs[:3]) is None


def test_run_by_run_ratios_pair_each_default_run_with_stocks_run_of_the_same_prompts(
    plan: ModuleType,
) -> None:
    runs = [
        a_run(plan, "stock", 10.0, run=0),
        a_run(plan, "stock", 20.0, run=1),
        a_run(plan, "stock", 16.0, run=2),
        a_run(plan, "default", 9.0, run=0),  # 0.90x
        a_run(plan, "default", 21.0, run=1),  # 1.05x
        a_run(plan, "default", 15.2, run=2),  # 0.95x
        a_run(plan, "default", 30.0, run=3),  # no stock run 3: unpaired
        a_run(plan, "full", 1.0, run=0),
    ]
    # Medians alone: 16.00 against 18.10, the default ahead; paired, behind.
    assert plan.paired_against_stock(runs) == (
        "Run by run (the same prompts to both): the default's throughput 0.95x "
        "stock's (median of 3 runs; 0.90-1.05), below stock's in 2 of 3."
    )
    assert plan.paired_against_stock(runs[:3]) is None


def test_a_result_without_the_fields_read_is_refused_by_name(
    plan: ModuleType,
) -> None:
    result = {
        "request_throughput": 9.5,
        "mean_ttft_ms": 120.0,
        "median_ttft_ms": 110.0,
        "completed": 160,
        "failed": 0,
        "duration": 16.8,
    }
    run = plan.Run.from_result("unique", "grid", 3, 0.7, True, result)
    assert (run.request_throughput, run.seconds, run.run) == (9.5, 16.8, 3)
    del result["median_ttft_ms"]
    with pytest.raises(ValueError, match="grid run 3 has no median_ttft_ms"):
        plan.Run.from_result("unique", "grid", 3, 0.7, True, result)


def test_the_users_budget_is_the_largest_in_b_to_2b_and_b_must_be_positive(
    plan: ModuleType,
) -> None:
    for b in (1, 32, 64, 1648):
        budget = plan.users_budget(b)
        assert b <= budget < 2 * b and budget + 1 == 2 * b
    with pytest.raises(ValueError, match="B must be positive"):
        plan.users_budget(0)


def test_a_run_waits_for_the_threshold_and_past_its_bound_says_it_was_loud(
    runner: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a fake clock: each poll sleeps 2 s and reads the next load."""
    clock = [0.0]
    loads: list[float] = []

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(runner.time, "sleep", sleep)
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (loads.pop(0), 0.0, 0.0))
    loads[:] = [3.0, 2.0, 0.9, 0.5]
    assert runner.wait_quiet(1.0, 60.0) == (0.9, True)
    assert clock[0] == 4.0 and loads == [0.5]
    clock[0] = 0.0
    loads[:] = [5.0] * 10
    assert runner.wait_quiet(1.0, 6.0) == (5.0, False)
    assert clock[0] == 6.0


def test_the_record_says_how_many_requests_the_runs_sent(
    plan: ModuleType,
) -> None:
    (workload,) = plan.choose_workloads(["unique"])
    header = plan.Header(
        command="python3 -m nox -s bench_serve -- --requests 32",
        commit="abc1234",
        machine="x86_64, 2 CPUs",
        vllm="0.32.0",
        plugin="0.1.0",
        date="2026-12-06 03:14 UTC",
        threshold=1.0,
        seconds=600.0,
        start_lines={"stock": "loaded, mode=off; C=8, B=32, hash block 8"},
        arms=plan.choose_arms(["default"]),
        workloads=[workload],
    )
    runs = [a_run(plan, "stock", 9.0, completed=32), a_run(plan, "default", 9.0)]
    text = plan.report(header, runs[:1])
    assert "\n32 requests a run.\n" in text, "what was sent, not the plan's 100"
    assert "| default | the plugin, VLLM_MAMBA_ALIGN_MODE unset | - |" in text
    assert "at commit abc1234" in text and "Runs that started above it: 0 of 1" in text
    assert "\n32-160 requests a run.\n" in plan.report(header, runs)


def test_too_little_memory_for_the_servers_is_refused_with_the_way_out(
    runner: ModuleType,
) -> None:
    runner.check_memory(6, 40.0)
    runner.check_memory(6, None)  # not Linux: nothing to read, nothing refused
    with pytest.raises(SystemExit, match=r"6 servers need about 19 GiB .* --arms"):
        runner.check_memory(6, 12.5)


def test_a_server_that_died_stops_the_benchmark_naming_its_log(
    runner: ModuleType, tmp_path: Path
) -> None:
    log = tmp_path / "full.log"
    log.write_text("INFO ready\n")
    process = SimpleNamespace(poll=lambda: None, returncode=None)
    server = SimpleNamespace(process=process, log_path=log, log=log.read_text)
    runner.check_alive("full", server)  # alive: nothing said
    log.write_text("ERROR Worker proc VllmWorker-0 died unexpectedly (exit code: -9)\n")
    with pytest.raises(RuntimeError, match=r"full server's engine died .*full\.log"):
        runner.check_alive("full", server)
    server.process = SimpleNamespace(poll=lambda: 1, returncode=1)
    with pytest.raises(RuntimeError, match="the full server exited with 1"):
        runner.check_alive("full", server)


# -- servers taking turns -----------------------------------------------------


@pytest.fixture
def turns(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/turns.py, imported as served.py imports it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("turns")


@pytest.fixture
def group_members(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The e2e tests' reader of a process group's members from /proc."""
    monkeypatch.syspath_prepend(str(BENCHMARKS.parent / "tests"))
    return importlib.import_module("e2e.server").group_members


@pytest.fixture
def groups() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Two process groups standing in for two arms' servers: a leader with a
    child, as a server's API server has its engine core."""
    script = (
        "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    )
    started = {
        name: subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
        for name in ("stock", "default")
    }
    yield started
    for process in started.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_only_the_measured_arms_server_runs_and_all_resume_on_the_way_out(
    groups: dict[str, subprocess.Popen[bytes]],
    turns: ModuleType,
    group_members: Any,
) -> None:
    pids = {name: process.pid for name, process in groups.items()}
    deadline = time.monotonic() + 10
    while any(len(group_members(pid)) < 2 for pid in pids.values()):
        assert time.monotonic() < deadline, "the children did not start"
        time.sleep(0.05)

    def states(name: str) -> set[str]:
        """The state letters of the arm's processes (T: stopped)."""
        time.sleep(0.1)  # signals are delivered asynchronously
        return {member.state for member in group_members(pids[name])}

    with (
        pytest.raises(RuntimeError, match="a run failed"),
        turns.Turns(pids) as taking_turns,
    ):
        assert states("stock") == {"T"} and states("default") == {"T"}
        with taking_turns.turn("default"):
            assert "T" not in states("default"), "the measured arm runs"
            assert states("stock") == {"T"}, "every other arm is stopped"
        assert states("default") == {"T"}, "paused again after its turn"
        with taking_turns.turn("stock"):
            raise RuntimeError("a run failed")
    # Every way out resumes every server (a stopped one cannot handle SIGINT).
    assert "T" not in states("stock") | states("default")
