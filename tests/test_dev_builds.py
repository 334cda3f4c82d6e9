"""A dev, nightly or vendor build gets the facts of its code, not of its number.

People who meet the defect run builds of vLLM main (``0.1.dev20073+g8e685d198``,
``0.28.1rc1.dev524+g…``), whose version names no release. Everything the plugin
decides, and everything ``doctor`` reports, must come from the installed code:
relabelling the installed release with a dev version may change the version
the plugin prints, and nothing else.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import StartLines, cache_block_for

from vllm_mamba_align import activation, releases, settings
from vllm_mamba_align.cli import main
from vllm_mamba_align.retention import RETENTION_VARIABLE
from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt

DEV_LABEL = "0.1.dev1+g0000000"
"""A version that names no release, as a build of vLLM main reports one."""


BY_VERSION = ("serve_setting", "defects", "corrupting")
"""doctor's keys decided by the release number: vLLM's own defects outside the
split, read in each release's wheel (vllm_mamba_align/defects.py)."""


def _relabel(monkeypatch: pytest.MonkeyPatch) -> str:
    """Give the imported vLLM the dev label; returns the release's own version."""
    import vllm

    real = str(releases.installed_version())
    monkeypatch.setattr(vllm, "__version__", DEV_LABEL)
    assert releases.installed_version() == DEV_LABEL
    return real


def _as_release(text: str, release: str) -> str:
    """Text written under the dev label, with the label read as the release."""
    labelled = releases.describe_version(DEV_LABEL)
    described = releases.describe_version(release)  # a nightly build's says so
    return text.replace(labelled, described).replace(DEV_LABEL, release)


def _doctor(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    main(["doctor", "--json"])
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


@pytest.mark.parametrize("retention_variable", [None, "0"])
def test_doctor_reports_the_same_facts_for_a_dev_relabelled_build(
    retention_variable: str | None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Split body, refusal, retention, each mode's meaning under it, worker seed,
    batch invariance: identical. Only the version, the fingerprint the version
    would name and vLLM's own defects (read per release) differ. With
    ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL=0`` too (which vLLM reads on 0.23.0
    onwards; 0.27.0 and 0.28.0 apply it to Mamba states)."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv(settings.MODE_VARIABLE, raising=False)
    if retention_variable is None:
        monkeypatch.delenv(RETENTION_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(RETENTION_VARIABLE, retention_variable)
    released = _doctor(capsys)
    release = _relabel(monkeypatch)
    relabelled = _doctor(capsys)

    assert relabelled["vllm_version"] == DEV_LABEL
    assert relabelled["expected_fingerprint"] is None  # the label names no release
    assert released["split_verified"] and released["split_body"]
    as_release = {
        key: json.loads(_as_release(json.dumps(value), release))
        for key, value in relabelled.items()
        if key not in ("vllm_version", "expected_fingerprint", *BY_VERSION)
    }
    # vLLM's own defects are read per release (defects.py): a label that
    # names no release gets none claimed.
    assert {row["verdict"] for row in relabelled["defects"]} <= {
        "not read for this release",
        "reported upstream, not confirmed here",
    }
    assert relabelled["corrupting"] == []
    differing = {
        key: (released[key], value)
        for key, value in as_release.items()
        if released[key] != value
    }
    assert not differing


@pytest.mark.parametrize("mode", [None, "full", "grid", "audit", "off"])
def test_a_dev_relabelled_build_schedules_and_announces_as_its_release(
    mode: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same start line (version aside) and the same chunks, for a prompt that
    crosses several state blocks and a sibling that reuses its prefix."""
    block = 1648
    geometry = Geometry(
        cache_block=cache_block_for(block), state_block=block, budget=8192
    )
    if mode is None:
        monkeypatch.delenv(settings.MODE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(settings.MODE_VARIABLE, mode)
    tokens = prompt(7000, seed=1)
    sibling = tokens[:5000] + prompt(1500, seed=2)

    def schedule() -> tuple[list[str], dict[str, list[int]]]:
        lines = StartLines()
        monkeypatch.setattr(activation, "_logger", lambda: lines)
        sim = Simulation(geometry)
        sim.add("writer", tokens)
        sim.run()
        sim.add("sibling", sibling)
        sim.run()
        ends = {name: sim.chunk_ends(name) for name in ("writer", "sibling")}
        return lines.lines, ends

    released_lines, released_ends = schedule()
    release = _relabel(monkeypatch)
    relabelled_lines, relabelled_ends = schedule()

    assert released_lines, "no start line"
    assert [_as_release(line, release) for line in relabelled_lines] == (released_lines)
    assert relabelled_ends == released_ends
