"""The default mode (``lean``) and how the plugin names the mode in force.

Without ``VLLM_MAMBA_ALIGN_MODE`` a scheduler runs ``lean``: the cheapest mode
that publishes no wrong state and materializes the states vLLM keeps. The start
line, ``doctor`` and the info metric name it; vLLM's batch-invariant mode, which
decides whether ``full``'s bit-exactness can hold for batched traffic, is
recorded here as the installed vLLM answers it.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from helpers import (
    StartLines,
    cache_block_for,
    geometry_rule,
    run_python,
    scheduler_mode,
)

from vllm_mamba_align import activation, messages, metrics, settings
from vllm_mamba_align.batch_invariance import (
    mamba_backends_accepting_batch_invariance,
)
from vllm_mamba_align.batch_invariance import (
    refuses_batch_invariance_for_mamba as refuses_for_mamba,
)
from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt

C, B, H = 816, 1648, 16
SEED_PROMPT = 16764
"""The upstream report's prompt: C = 816, B = 1,648, budget 8,192."""


def seed_geometry(retention: int | str | None = "default") -> Geometry:
    return Geometry(
        cache_block=C, state_block=B, hash_block=H, budget=8192, retention=retention
    )


def run_seed_prompt(mode: str | None, retention: int | str | None) -> Simulation:
    """The seed's prompt, then a sibling sharing its first 9,000 tokens twice
    (the first makes vLLM keep the junction, the second reuses it)."""
    if mode is None:
        sim = Simulation(seed_geometry(retention))
    else:
        with scheduler_mode(mode):
            sim = Simulation(seed_geometry(retention))
    tokens = prompt(SEED_PROMPT, seed=1)
    sim.add("prompt", tokens)
    sim.run()
    for tail_seed, name in enumerate(("sibling1", "sibling2"), start=2):
        sim.add(name, tokens[:9000] + prompt(2000, seed=tail_seed))
        sim.run()
    return sim


def any_release_geometry(retention: int | str | None = "default") -> Geometry:
    """B = 1,648 with a cache block every release starts (C < B where it can)."""
    return Geometry(
        cache_block=cache_block_for(B), state_block=B, budget=8192, retention=retention
    )


@pytest.fixture
def unset_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.MODE_VARIABLE, raising=False)


@pytest.fixture
def start_lines(monkeypatch: pytest.MonkeyPatch) -> StartLines:
    recorder = StartLines()
    monkeypatch.setattr(activation, "_logger", lambda: recorder)
    return recorder


needs_c_below_b = pytest.mark.skipif(
    geometry_rule() != "any", reason="this vLLM refuses C=816 < B=1648 at startup"
)


def test_the_default_mode_is_lean(unset_mode: None) -> None:
    assert settings.read_mode() is settings.Mode.LEAN


@needs_c_below_b
@pytest.mark.parametrize("retention", ["default", None])
def test_unset_mode_schedules_the_seed_prompt_as_lean(
    unset_mode: None, retention: int | str | None
) -> None:
    """Same chunks as an explicit ``lean``, the same reuse as ``kept``; nothing
    wrong published."""
    default = run_seed_prompt(None, retention)
    lean = run_seed_prompt("lean", retention)
    kept = run_seed_prompt("kept", retention)
    assert default.chunk_ends("prompt") == lean.chunk_ends("prompt")
    assert len(default.poisoned) == 0 and len(default.wrong_reuse) == 0
    assert default.reused("sibling2") == kept.reused("sibling2") == 8240


@needs_c_below_b
def test_at_default_retention_the_default_spends_no_step_on_dropped_states(
    unset_mode: None,
) -> None:
    """vLLM's default retention (0 from 0.29.0) keeps the replay boundary and
    junctions only: the default mode ends chunks where stock does (8,160 and
    16,320: C-aligned, not B-aligned) but for the replay boundary 16,480 and
    vLLM's own stop at the prompt's tail after it, so it takes fewer prefill
    steps than ``full`` and keeps the same states."""
    from vllm_mamba_align.tools.installed import retention_in_kv_config

    if not retention_in_kv_config():
        pytest.skip("this vLLM keeps every state by default (kept is full here)")
    default = run_seed_prompt(None, "default")
    full = run_seed_prompt("full", "default")
    assert default.chunk_ends("prompt") == [8160, 16320, 16480, 16752, 16764]
    assert len(default.records["prompt"].chunks) == 5
    assert len(full.records["prompt"].chunks) == 12
    assert default.kept_writes == full.kept_writes
    assert not default.missing_kept
    assert default.reused("sibling2") == full.reused("sibling2")


def test_the_start_line_names_the_default_mode(
    unset_mode: None, start_lines: StartLines
) -> None:
    from vllm_mamba_align.tools.installed import retention_in_kv_config

    Simulation(any_release_geometry())
    (line,) = start_lines.lines
    assert "ACTIVE, mode=lean: " in line
    if retention_in_kv_config():  # vLLM's default retention is 0 (0.29.0+)
        assert "and on every B boundary vLLM keeps" in line


def test_under_dense_retention_the_start_line_says_lean_is_full(
    unset_mode: None, start_lines: StartLines
) -> None:
    Simulation(any_release_geometry(retention=None))
    (line,) = start_lines.lines
    assert "ACTIVE, mode=lean: " in line
    assert "lean, kept and full are the same here" in line


def test_the_info_metric_names_the_default_mode(unset_mode: None) -> None:
    pytest.importorskip("prometheus_client")
    info = metrics.process_info()
    assert info is not None
    info.clear()
    sim = Simulation(any_release_geometry())
    labels = metrics.scheduler_labels(sim.scheduler)
    modes = {
        (sample.labels["mode"], sample.labels["status"])
        for family in info.collect()
        for sample in family.samples
        if all(sample.labels[k] == v for k, v in labels.items())
    }
    assert modes == {("lean", "ACTIVE")}


# -- vLLM's batch-invariant mode ---------------------------------------------------

SELECT_MAMBA_BACKENDS = textwrap.dedent(
    """
    import json
    try:
        from vllm.v1.attention import selector
    except ImportError:
        from vllm.attention import selector
    kinds = getattr(selector, "MAMBA_TYPE_TO_BACKEND_MAP", None)
    if kinds is None:  # the backend enum: releases.SELECTOR_TAKES_BACKEND_ENUM
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        kinds = [m for m in MambaAttentionBackendEnum if m.name != "CUSTOM"]
    answers = {}
    for kind in kinds:
        name = getattr(kind, "name", kind)
        try:
            selector.get_mamba_attn_backend(kind)
            answers[name] = "accepted"
        except RuntimeError as error:
            refused = "batch_invariant mode is not supported" in str(error)
            answers[name] = "refused" if refused else f"error: {error}"
        except Exception as error:  # a backend this CPU build cannot import
            answers[name] = f"error: {type(error).__name__}"
    print("ANSWERS", json.dumps(answers))
    """
)


def test_vllm_answers_batch_invariance_for_mamba_as_releases_records() -> None:
    """With ``VLLM_BATCH_INVARIANT=1`` vLLM refuses the Mamba backends that do
    not declare batch-invariance support (every one through 0.33.0; all but the
    short-convolution backend on 0.34.0) on the releases of
    ``releases.SELECTOR_ASKS_BATCH_INVARIANCE`` and selects them all before; the
    plugin reads the same from vLLM's code."""
    result = run_python(SELECT_MAMBA_BACKENDS, VLLM_BATCH_INVARIANT="1")
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("ANSWERS "))
    answers = json.loads(line.removeprefix("ANSWERS "))
    selected = {name: a for name, a in answers.items() if not a.startswith("error")}
    assert selected, answers  # at least one backend imports on this CPU build
    accepting = set(mamba_backends_accepting_batch_invariance())
    expected = {
        name: "accepted" if name in accepting or not refuses_for_mamba() else "refused"
        for name in selected
    }
    assert selected == expected, answers
    assert "refused" in selected.values() or not refuses_for_mamba(), answers


def test_the_start_line_says_what_batch_invariance_means_here(
    unset_mode: None, start_lines: StartLines, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    Simulation(any_release_geometry())
    (line,) = start_lines.lines
    if refuses_for_mamba():
        assert "refuses batch-invariant mode for Mamba backends" in line
    else:  # before SELECTOR_ASKS_BATCH_INVARIANCE: dense retention, lean as full
        assert "accepts it for hybrid models): with mode=lean a continuation" in line


def test_without_batch_invariance_the_start_line_is_silent_about_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert messages.batch_invariance_note(settings.Mode.KEPT, False, "0.33.0") is None
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert messages.batch_invariance_note(settings.Mode.KEPT, False, "0.33.0") is None
