"""The witness (tests/witness) inside served engines: concurrent load through
the OpenAI API of ``vllm serve`` (vLLM's CPU build), with clients that close
their connections in prefill and in decode, late high-priority requests under
``--scheduling-policy priority`` and a pool too small for every request at
once (the preemptions it causes are counted; this engine may admit only what
its pool holds, so the scheduler-level witness is where they are required).

Each engine core's scheduler is watched by the test-only plugin
``tests/support/witness_engine_plugin``, which runs the same judge as the
scheduler-level tests after every step the engine schedules: every hashed
Mamba block holds the state its hash names, every chunk reads its own
prefix's state, no state vLLM keeps is left unwritten. The judge shares no code
with the plugin; the plugin is loaded only by vLLM's loader.

CI runs one server (the default mode, :data:`SHORT`) and the drafter pair
(:data:`DRAFTER_PAIR`): stock vLLM beside the default mode on a server whose
drafter makes C < B (test_serve.py's geometry), where stock publishes wrong
states. Its load decodes a few tokens per request, so decode steps verify the
drafter's token (``extract_hidden_states`` drafts one per decode step) and the
witness mirrors them with the accepted counts the model runner returns
(witness/served.py), through the CPU build's stand-in for vLLM's copy after a
verify step (tests/support/cpu_e2e_workarounds, gap 2). ``nox -s e2e_witness``
runs :data:`LONG` as well: stock vLLM without a drafter (C = B: the judge runs
on stock's steps), ``full``, ``grid`` and the default with
``--data-parallel-size 2``.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from .server import SERVED_NAME, Server
from .test_engine import PLUGIN, WORKAROUNDS
from .test_serve import OMIT, SERVE_OPTIONS

pytestmark = pytest.mark.xdist_group("witness")

WITNESS_ENGINE = "witness_engine"  # tests/support/witness_engine_plugin
POST_STEP_TRACE = "MAMBA_ALIGN_E2E_POST_STEP_TRACE"
"""The CPU stand-in's trace of its copies after verify steps (cpu_e2e_workarounds)."""
TESTS = Path(__file__).resolve().parents[1]
LOAD_OPTIONS: dict[str, Any] = {
    "scheduling_policy": "priority",
    # A small step budget: prefills take several steps, shared with decodes
    # (a client can close its connection while its prompt is in prefill).
    "max_num_batched_tokens": 256,
    # Room for two or three of the load's requests at once: running ones get
    # preempted and resume.
    "max_model_len": 2048,
    "num_gpu_blocks_override": 128,
    # Admit a request when its first chunk fits, not its whole prompt (vLLM's
    # default): running prefills then outgrow the pool.
    "scheduler_reserve_full_isl": False,
    "max_num_seqs": 6,
    # No drafter here (C = B); the drafter pair adds one (WITH_DRAFTER). The
    # witness mirrors steps whose tokens are all known when they are
    # scheduled: no tokens in flight (async scheduling).
    "speculative_config": OMIT,
    "async_scheduling": False,
}


@dataclass(frozen=True)
class Deployment:
    mode: str | None
    """VLLM_MAMBA_ALIGN_MODE (None: unset); "stock": the plugin not loaded."""
    options: dict[str, Any]
    most_tokens: int | None = None
    """The most tokens a request that completes wants (None: the load's own,
    8 to 30): a few decode steps each, where the server's drafter has every
    one of them verify a draft token."""
    decode_across: int | None = None
    """Cut each completing request's prompt to 2 short of a multiple of this
    (B): its second token ends on a B boundary, reached by a decode step or
    by an accepted draft, and the worker copies the state there after the
    step (None: prompts as drawn)."""


SHORT = {"default": Deployment(None, {})}
WITH_DRAFTER: dict[str, Any] = {
    "speculative_config": SERVE_OPTIONS["speculative_config"],
    # Not a multiple of B (32): a chunk cut by the budget ends off B's grid
    # unless the split moves it there.
    "max_num_batched_tokens": 264,
    # The drafter's hidden-state group takes its share of every block: 128
    # blocks hold 768 tokens of a request here, 384 the 2,048 vLLM requires.
    "num_gpu_blocks_override": 384,
}
DRAFTER_DECODE = 6
"""Tokens each completing request of the drafter pair's load wants: prefills
dominate its time; up to five decode steps per request verify drafts."""
DRAFTER_STATE_BLOCK = 32
"""B on the drafter geometry (geometry.HETEROGENEOUS)."""
DRAFTER_PAIR = {
    "stock, drafter": Deployment(
        "stock", WITH_DRAFTER, DRAFTER_DECODE, DRAFTER_STATE_BLOCK
    ),
    "default, drafter": Deployment(
        None, WITH_DRAFTER, DRAFTER_DECODE, DRAFTER_STATE_BLOCK
    ),
}
LONG = {
    "stock": Deployment("stock", {}),
    "full": Deployment("full", {}),
    "grid": Deployment("grid", {}),
    "default, data parallel 2": Deployment(None, {"data_parallel_size": 2}),
}
LONG_SESSION = "MAMBA_ALIGN_E2E_WITNESS_LONG"
"""Set by ``nox -s e2e_witness``: run :data:`LONG` too."""


def _load(
    server: Server, most_tokens: int | None = None, decode_across: int | None = None
) -> dict[str, int]:
    """Concurrent requests: siblings of one base (cache hits), decodes sharing
    the budget, late high-priority requests, and clients that close their
    connection in prefill (a timeout of a third of the time an uncached
    prompt of theirs takes alone, measured first) or in decode (a stream closed after a
    few tokens). ``most_tokens``, ``decode_across``: as
    :class:`Deployment`'s. Returns what the clients saw."""
    rng = random.Random(7)
    base = [rng.randrange(3, 500) for _ in range(1400)]
    url = f"{server.base}/v1/completions"
    seen = {"completed": 0, "closed_in_prefill": 0, "closed_in_decode": 0}
    lock = threading.Lock()

    def body(prompt: list[int], max_tokens: int, priority: int) -> dict[str, Any]:
        return {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "priority": priority,
        }

    def complete(prompt: list[int], max_tokens: int, priority: int) -> None:
        if most_tokens is not None:
            max_tokens = min(max_tokens, most_tokens)
        if decode_across is not None:
            prompt = prompt[: len(prompt) - (len(prompt) + 2) % decode_across]
        response = httpx.post(url, json=body(prompt, max_tokens, priority), timeout=600)
        response.raise_for_status()
        with lock:
            seen["completed"] += 1

    # How long an uncached 1,900-token prompt takes alone on this server (its
    # own draws: the load's prompts stay the same; the faster of two, as a
    # fresh server's first request is slow). The clients that leave in prefill
    # time out at a third of it (their abort reaches the engine core later):
    # a fixed 0.4 s timeout, against a prompt that took 0.44 s alone, let no
    # client leave in prefill on an idle 2-core machine; at half of it, one
    # or two of the three left in prefill.
    draws = random.Random(8)
    alone = []
    for _ in range(2):
        prompt = [draws.randrange(3, 500) for _ in range(1900)]
        began = time.monotonic()
        httpx.post(url, json=body(prompt, 1, 0), timeout=600).raise_for_status()
        alone.append(time.monotonic() - began)
    prefill_timeout = max(0.05, min(alone) / 3)

    def close_in_prefill(prompt: list[int]) -> None:
        try:
            httpx.post(url, json=body(prompt, 4, 0), timeout=prefill_timeout)
        except httpx.TimeoutException:
            with lock:
                seen["closed_in_prefill"] += 1

    def close_in_decode(prompt: list[int]) -> None:
        request = {**body(prompt, 200, 0), "stream": True}
        with httpx.stream("POST", url, json=request, timeout=600) as response:
            for index, _ in enumerate(response.iter_lines()):
                if index >= 3:
                    break  # leaving the block closes the connection
        with lock:
            seen["closed_in_decode"] += 1

    def sibling() -> list[int]:
        shared = rng.randint(200, len(base))
        tail = [rng.randrange(3, 500) for _ in range(rng.randint(1, 300))]
        return base[:shared] + tail

    plan: list[tuple[float, Any, tuple[Any, ...]]] = []
    # A burst: the engine (tens of ms a step) would otherwise finish each
    # request before the next arrives, and nothing would compete for blocks.
    # The clients that leave in prefill come first: admitted at once, they are
    # still prefilling (1,900 uncached tokens, a step budget of 256 shared
    # with the others) when they leave.
    for index in range(3):
        long = [rng.randrange(3, 500) for _ in range(1900)]  # nothing cached
        plan.append((index * 0.01, close_in_prefill, (long,)))
        plan.append((0.15 + index * 0.1, close_in_decode, (sibling(),)))
    for index in range(10):
        plan.append((0.05 + index * 0.02, complete, (sibling(), 8 + index, 5)))
    for index in range(4):  # late, high priority (vLLM: lower value first)
        plan.append((0.4 + index * 0.1, complete, (sibling(), 30, -1)))
    threads = []
    started = time.monotonic()
    for at, action, arguments in sorted(plan, key=lambda p: p[0]):
        time.sleep(max(0.0, started + at - time.monotonic()))
        thread = threading.Thread(target=action, args=arguments)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=900)
    return seen


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@dataclass
class Verdict:
    engines: int
    totals: dict[str, int]
    clients: dict[str, int]
    log: str


_verdicts: dict[str, Verdict] = {}


def watched(key: str, deployment: Deployment, model: Path, workdir: Path) -> Verdict:
    """Serve ``deployment`` with the witness in its engine cores, run the load,
    stop the server, and sum what each engine core's witness wrote."""
    if key in _verdicts:
        return _verdicts[key]
    folder = workdir / f"{key.replace(' ', '-').replace(',', '')}-witness"
    folder.mkdir()
    post_step = folder.with_suffix(".post-step.jsonl")
    plugins = [WORKAROUNDS, WITNESS_ENGINE]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "MAMBA_ALIGN_WITNESS_DIR": str(folder),
        POST_STEP_TRACE: str(post_step),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    if deployment.mode != "stock":
        plugins.append(PLUGIN)
        if deployment.mode is not None:
            env["VLLM_MAMBA_ALIGN_MODE"] = deployment.mode
    env["VLLM_PLUGINS"] = ",".join(plugins)
    options = {**SERVE_OPTIONS, **LOAD_OPTIONS, **deployment.options}
    options = {key: value for key, value in options.items() if value is not OMIT}
    server = Server(model, options, env, folder.with_suffix(".log"))
    with server:
        clients = _load(server, deployment.most_tokens, deployment.decode_across)
    totals: dict[str, int] = {}
    files = sorted(folder.glob("witness-*.json"))
    for path in files:
        found = json.loads(path.read_text())
        for part in ("findings", "events"):
            for name, value in found[part].items():
                if isinstance(value, int):
                    totals[name] = totals.get(name, 0) + value
        for name in ("unmirrored_steps", "requests", "rows_after_finish"):
            totals[name] = totals.get(name, 0) + found[name]
    # The worker's side: the verify rows the CPU stand-in for vLLM's copy
    # after a step saw (gap 2), with the accepted drafts and copies it made.
    rows = [json.loads(line) for line in _lines(post_step)]
    totals["worker_verify_rows"] = len(rows)
    totals["worker_drafts_accepted"] = sum(row["accepted"] for row in rows)
    totals["worker_copies"] = sum(row["copy"] is not None for row in rows)
    verdict = Verdict(len(files), totals, clients, server.log())
    _verdicts[key] = verdict
    return verdict


def _check_fixed(verdict: Verdict, prefill_aborts: bool = True) -> None:
    """``prefill_aborts``: require a client to have left in prefill (where the
    mode stops at every boundary vLLM keeps, dense here, a 1,900-token prefill
    takes tens of steps; ``grid`` runs it in a few, often inside the client's
    timeout)."""
    totals = {**verdict.totals, "clients": verdict.clients}
    assert verdict.engines >= 1, verdict.log[-3000:]
    # Each message names its check first: CI's summary shows one line of it.
    assert totals["unmirrored_steps"] == 0, ("unmirrored_steps", totals)
    assert totals["publications"] > 0, ("publications", totals)
    assert totals["reads"] > 0, ("reads", totals)
    assert totals["wrong_publications"] == 0, ("wrong_publications", totals)
    assert totals["wrong_reads"] == 0, ("wrong_reads", totals)
    # The load happened in the engine: clients left in prefill and in decode.
    # (Preemptions are counted and shown; the scheduler-level witness is where
    # they are guaranteed: this engine admitted no more than its pool held.)
    if prefill_aborts:
        assert totals["aborts_in_prefill"] > 0, ("aborts_in_prefill", totals)
    assert totals["aborts_in_decode"] > 0, ("aborts_in_decode", totals)


@pytest.mark.parametrize("key", list(SHORT))
def test_served_engine_under_load_publishes_and_reads_only_right_states(
    key: str, served_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    verdict = watched(key, SHORT[key], served_model, tmp_path_factory.mktemp("w"))
    _check_fixed(verdict)
    lost = verdict.totals["lost_kept_states"]
    assert lost == 0, ("lost_kept_states", verdict.totals)


def test_served_drafter_stock_publishes_wrong_states_and_the_default_none(
    served_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Where a drafter makes C < B, stock vLLM serving the load publishes
    Mamba blocks as states they do not hold; the default mode on the same
    server and load publishes and reads none. Both verify draft tokens in
    their decode steps, every step mirrored (the worker's rule for
    speculative Mamba states, with the accepted counts the runner returned)."""
    found = {
        key: watched(key, deployment, served_model, tmp_path_factory.mktemp("w"))
        for key, deployment in DRAFTER_PAIR.items()
    }
    for key, verdict in found.items():
        totals = {**verdict.totals, "clients": verdict.clients, "server": key}
        assert verdict.engines >= 1, (key, verdict.log[-3000:])
        assert totals["unmirrored_steps"] == 0, ("unmirrored_steps", totals)
        assert totals["publications"] > 0, ("publications", totals)
        assert totals["reads"] > 0, ("reads", totals)
        assert totals["draft_steps"] > 0, ("draft_steps", totals)
        # One draft token per verify row (num_speculative_tokens = 1).
        verified = totals["drafts_accepted"] + totals["drafts_rejected"]
        assert verified == totals["draft_steps"], ("drafts", totals)
        # The worker's copy after each verify step (the CPU stand-in, run by
        # vLLM's model runner) saw the rows the judge mirrored, with the same
        # accepted counts, and copied where the judge's mirror of vLLM's rule
        # copies.
        for worker, judged in (
            ("worker_verify_rows", "draft_steps"),
            ("worker_drafts_accepted", "drafts_accepted"),
            ("worker_copies", "draft_step_copies"),
        ):
            assert totals[worker] == totals[judged], (worker, totals)
        assert totals["draft_step_copies"] > 0, ("draft_step_copies", totals)
    # (Clients closing in prefill or decode are sent, not required here: stock
    # prefills the load in a quarter of the default mode's steps, often within
    # their timeout.)
    stock, fixed = found["stock, drafter"].totals, found["default, drafter"].totals
    print(
        "served drafter pair:",
        {key: verdict.totals for key, verdict in found.items()},
    )
    assert stock["wrong_publications"] > 0, ("stock wrong_publications", stock)
    assert fixed["wrong_publications"] == 0, ("wrong_publications", fixed)
    assert fixed["wrong_reads"] == 0, ("wrong_reads", fixed)


@pytest.mark.parametrize("key", list(LONG))
def test_served_engines_under_load_long(
    key: str, served_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if not os.environ.get(LONG_SESSION):
        pytest.skip(
            "the served witness's long version (stock, full, grid, DP = 2): "
            "nox -s e2e_witness (not in CI's default list)"
        )
    deployment = LONG[key]
    verdict = watched(key, deployment, served_model, tmp_path_factory.mktemp("w"))
    if deployment.mode == "stock":
        # C = B here (no drafter, see LOAD_OPTIONS): stock's chunks end on the
        # state grid and it publishes right states too; what this server
        # shows is that the judge ran on stock's steps, every one mirrored.
        totals = verdict.totals
        assert totals["unmirrored_steps"] == 0 and totals["publications"] > 0, totals
        return
    _check_fixed(verdict, prefill_aborts=deployment.mode != "grid")
    if deployment.options.get("data_parallel_size"):
        assert verdict.engines == 2, verdict.engines
    if deployment.mode != "grid":
        assert verdict.totals["lost_kept_states"] == 0, verdict.totals
