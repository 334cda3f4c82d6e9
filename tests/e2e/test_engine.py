"""A real vLLM engine (CPU build) with the plugin loaded through its entry point.

Geometry: a tiny NemotronH (Mamba2 + attention) with the
``extract_hidden_states`` speculative method, whose hidden-state KV group gets a
smaller block than the Mamba state block, so the engine runs with C < B. Every
engine runs in a fresh interpreter (``engine_run.py``), in vLLM's default
multiprocess mode or in-process, with exactly the ``VLLM_PLUGINS`` of the test.

What is compared: the first generated token's top-20 logprobs of a
``max_tokens=1`` request (the prefill's output), against the same prompt run
fresh after ``reset_prefix_cache()``. The prefill is what prefix caching
changes; later tokens are not compared (they were seen to be unstable with
speculative decoding and Mamba2 on CPU).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .geometry import HETEROGENEOUS, LOG_LINE, PLUGIN, WORKAROUNDS
from .models import VOCAB
from .release import E2E_RELEASE

# The in-process engines and the recipe run beside the servers (nox -s e2e
# runs two xdist workers, one a group).
pytestmark = pytest.mark.xdist_group("engines")

HERE = Path(__file__).parent

PROMPT_TOKENS = 3000
SHARED_TOKENS = 1030  # the sibling shares this prefix of the first prompt
SIBLING_TOKENS = 1530
BUDGET = 1000  # --max-num-batched-tokens: the first prompt needs several chunks

COMMON: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "dtype": "float32",
    "seed": 0,
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "max_model_len": 4096,
    "max_num_batched_tokens": BUDGET,
}
HYBRID: dict[str, Any] = {
    "mamba_cache_mode": "align",
    # Dense state retention. vLLM 0.32.0's default (0) keeps a Mamba state only
    # at a prompt's replay boundary or a detected shared-prefix junction, so a
    # sibling would never reuse anything and there would be nothing to check.
    "prefix_cache_retention_interval": None,
}


def prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(1)
    first = [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)]
    tail = [rng.randrange(3, VOCAB) for _ in range(SIBLING_TOKENS - SHARED_TOKENS)]
    return first, first[:SHARED_TOKENS] + tail


def steps() -> list[dict[str, Any]]:
    first, sibling = prompts()
    return [
        {"name": "first", "prompt": first},
        {"name": "sibling", "prompt": sibling},
        {"name": "reask", "prompt": first},
        {"name": "sibling_fresh", "prompt": sibling, "reset_cache": True},
        {"name": "reask_fresh", "prompt": first, "reset_cache": True},
    ]


@dataclass
class EngineRun:
    log: str
    start_seconds: float
    steps: dict[str, dict[str, Any]]
    chunks: list[dict[str, int]]  # one per prefill chunk, in schedule order
    resolved: dict[str, Any] = field(default_factory=dict)  # the engine's settings

    def geometry(self) -> dict[str, str]:
        lines = [m for m in LOG_LINE.finditer(self.log)]
        assert len(lines) == 1, f"expected one plugin line, got {len(lines)}"
        return lines[0].groupdict()

    def chunk_ends(self, step: str) -> list[int]:
        # The scheduler knows the request as "<id>-<random suffix>".
        request = self.steps[step]["request_id"]
        return [
            c["end"]
            for c in self.chunks
            if c["request"] == request or c["request"].startswith(f"{request}-")
        ]

    def cached(self, step: str) -> int:
        return int(self.steps[step]["num_cached_tokens"])

    def logprobs(self, step: str) -> dict[str, float]:
        return {t: float(v) for t, v in self.steps[step]["logprobs"].items()}


def max_delta(run: EngineRun, step: str, other: str) -> float:
    """Largest |Δ logprob| over the tokens both top-20 lists contain."""
    a, b = run.logprobs(step), run.logprobs(other)
    return max(abs(a[t] - b[t]) for t in set(a) & set(b))


def run_engine(
    workdir: Path,
    model: Path,
    engine: dict[str, Any],
    *,
    plugins: str,
    mode: str | None = None,
    multiprocess: bool = True,
    run_steps: list[dict[str, Any]] | None = None,
) -> EngineRun:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.json"
    result = workdir / "result.json"
    trace = workdir / "chunks.jsonl"
    spec.write_text(
        json.dumps(
            {
                "model": str(model),
                "engine": {**COMMON, **engine},  # the geometry's settings win
                "steps": run_steps if run_steps is not None else steps(),
                "logprobs": 20,
            }
        )
    )
    env = dict(os.environ)
    env.update(
        VLLM_PLUGINS=plugins,
        VLLM_CPU_KVCACHE_SPACE="1",
        MAMBA_ALIGN_E2E_TRACE=str(trace),
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
        HF_HUB_OFFLINE="1",
    )
    env.pop("VLLM_MAMBA_ALIGN_MODE", None)
    if mode is not None:
        env["VLLM_MAMBA_ALIGN_MODE"] = mode
    done = subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), str(spec), str(result)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    (workdir / "engine.log").write_text(done.stdout)
    assert done.returncode == 0, done.stdout[-6000:]
    report = json.loads(result.read_text())
    chunks = (
        [json.loads(line) for line in trace.read_text().splitlines()]
        if trace.exists()
        else []
    )
    return EngineRun(
        done.stdout,
        report["start_seconds"],
        report["steps"],
        chunks,
        report.get("resolved", {}),
    )


_runs: dict[tuple[Any, ...], EngineRun] = {}


@pytest.fixture(scope="session")
def engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``engine(model, geometry, plugins, mode, multiprocess)``: run once, reuse."""

    def get(
        model: str,
        geometry: str,
        plugins: str,
        mode: str | None = None,
        multiprocess: bool = True,
    ) -> EngineRun:
        key = (model, geometry, plugins, mode, multiprocess)
        if key not in _runs:
            name = "-".join(str(k) for k in key).replace(",", "+")
            settings = HYBRID if model == "nemotron_h" else {}
            if geometry == "heterogeneous":
                settings = {**settings, **HETEROGENEOUS}
            _runs[key] = run_engine(
                tmp_path_factory.mktemp(name),
                models[model],
                settings,
                plugins=plugins,
                mode=mode,
                multiprocess=multiprocess,
            )
        return _runs[key]

    return get


ENGINE_MODES = [
    pytest.param(True, id="multiprocess"),
    pytest.param(False, id="in-process"),
]


@pytest.mark.parametrize("multiprocess", ENGINE_MODES)
def test_log_shows_plugin_active_with_the_geometry_it_found(
    engine: Any, multiprocess: bool
) -> None:
    run = engine(
        "nemotron_h", "heterogeneous", f"{WORKAROUNDS},{PLUGIN}", None, multiprocess
    )
    found = run.geometry()
    assert found["vllm"] == E2E_RELEASE
    assert found["status"].startswith("ACTIVE, mode=lean")  # the default
    cache_block, state_block = int(found["c"]), int(found["b"])
    assert cache_block < state_block, found  # the heterogeneous geometry
    # ... and it is the geometry the scheduler works with while it schedules.
    assert {c["cache_block"] for c in run.chunks} == {cache_block}


def _allowed_off_grid_ends(prompt: int, hash_block: int) -> set[int]:
    # The prompt's end, and vLLM's own stop at the prompt's last hash-block
    # boundary (its partial-tail checkpoint).
    return {prompt, (prompt - 1) // hash_block * hash_block}


@pytest.mark.parametrize("multiprocess", ENGINE_MODES)
def test_prefill_chunks_end_on_the_state_grid(engine: Any, multiprocess: bool) -> None:
    run = engine(
        "nemotron_h", "heterogeneous", f"{WORKAROUNDS},{PLUGIN}", None, multiprocess
    )
    found = run.geometry()
    state_block, hash_block = int(found["b"]), int(found["h"])
    assert run.chunks
    for chunk in run.chunks:
        if chunk["end"] in _allowed_off_grid_ends(chunk["prompt"], hash_block):
            continue
        assert chunk["end"] % state_block == 0, chunk
    # The default (lean: kept under dense retention) stops at every boundary the first
    # prompt crosses, as full does
    ends = run.chunk_ends("first")
    grid = list(range(state_block, PROMPT_TOKENS, state_block))
    assert [e for e in ends if e % state_block == 0] == grid


@pytest.mark.parametrize("multiprocess", ENGINE_MODES)
def test_sibling_and_reask_reuse_what_the_fix_promises_and_match_fresh_runs(
    engine: Any, multiprocess: bool
) -> None:
    run = engine(
        "nemotron_h", "heterogeneous", f"{WORKAROUNDS},{PLUGIN}", None, multiprocess
    )
    found = run.geometry()
    state_block, hash_block = int(found["b"]), int(found["h"])
    assert run.cached("first") == 0
    assert run.cached("sibling_fresh") == 0 and run.cached("reask_fresh") == 0
    # The sibling resumes from the last state boundary inside the shared prefix.
    assert run.cached("sibling") == SHARED_TOKENS // state_block * state_block
    # A re-ask resumes from vLLM's partial-tail checkpoint.
    assert run.cached("reask") == (PROMPT_TOKENS - 1) // hash_block * hash_block
    # Bit for bit what a fresh prefill gives.
    assert run.logprobs("sibling") == run.logprobs("sibling_fresh")
    assert run.logprobs("reask") == run.logprobs("reask_fresh")
    assert run.logprobs("reask") == run.logprobs("first")


@pytest.mark.parametrize("multiprocess", ENGINE_MODES)
def test_with_the_fix_off_the_same_checks_detect_the_wrong_state(
    engine: Any, multiprocess: bool
) -> None:
    """Stock vLLM's split: the sibling continues from a wrong state.

    Proves the checks above can fail: chunks end off the B grid, and the
    sibling's first token logprobs differ from a fresh run.
    """
    run = engine(
        "nemotron_h", "heterogeneous", f"{WORKAROUNDS},{PLUGIN}", "off", multiprocess
    )
    found = run.geometry()
    assert found["status"].startswith("loaded, mode=off")
    state_block, hash_block = int(found["b"]), int(found["h"])
    off_grid = [
        c
        for c in run.chunks
        if c["end"] % state_block
        and c["end"] not in _allowed_off_grid_ends(c["prompt"], hash_block)
    ]
    assert off_grid
    assert run.cached("sibling") > 0  # stock does reuse a state here ...
    assert run.logprobs("sibling") != run.logprobs("sibling_fresh")  # ... a wrong one
    assert max_delta(run, "sibling", "sibling_fresh") > 1e-3


def test_non_hybrid_model_runs_unchanged(engine: Any) -> None:
    without = engine("llama", "equal", WORKAROUNDS)
    with_plugin = engine("llama", "equal", f"{WORKAROUNDS},{PLUGIN}")
    assert (
        "inactive (no Mamba layers in align mode)" in with_plugin.geometry()["status"]
    )
    assert with_plugin.steps.keys() == without.steps.keys()
    for step in without.steps:
        assert with_plugin.cached(step) == without.cached(step), step
        assert with_plugin.logprobs(step) == without.logprobs(step), step
    assert [c["end"] for c in with_plugin.chunks] == [c["end"] for c in without.chunks]


def test_hybrid_model_in_equal_geometry_gives_identical_outputs(engine: Any) -> None:
    """C == B: the same tokens and logprobs, bit for bit, with and without.

    Only reuse may differ, in the plugin's favour: stock chunks run across state
    boundaries without saving them (its first chunk ends at the budget's last
    boundary), while the default (lean, kept under dense retention) saves every one
    the prompt crosses.
    """
    without = engine("nemotron_h", "equal", WORKAROUNDS)
    with_plugin = engine("nemotron_h", "equal", f"{WORKAROUNDS},{PLUGIN}")
    found = with_plugin.geometry()
    assert found["status"].startswith("ACTIVE, mode=lean")
    assert found["c"] == found["b"]
    state_block = int(found["b"])
    for step in without.steps:
        assert with_plugin.steps[step]["token"] == without.steps[step]["token"]
        assert with_plugin.logprobs(step) == without.logprobs(step), step
        assert with_plugin.cached(step) >= without.cached(step), step
    assert with_plugin.cached("sibling") == SHARED_TOKENS // state_block * state_block


def summary_lines() -> list[str]:
    """What the engines of this run measured (printed after the tests)."""
    lines = []
    for (model, geometry, plugins, mode, multiprocess), run in sorted(
        _runs.items(), key=str
    ):
        found = LOG_LINE.search(run.log)
        where = "multiprocess" if multiprocess else "in-process"
        name = f"{model} {geometry} {where} plugins={plugins} mode={mode or 'default'}"
        geometry_found = f"C={found['c']} B={found['b']}" if found else "no plugin line"
        lines.append(
            f"{name}: start {run.start_seconds:.1f} s, {geometry_found}, "
            f"cached sibling {run.cached('sibling')} re-ask {run.cached('reask')}, "
            f"max |dlogprob| vs fresh: sibling "
            f"{max_delta(run, 'sibling', 'sibling_fresh'):.3g}, "
            f"re-ask {max_delta(run, 'reask', 'reask_fresh'):.3g}"
        )
    return lines
