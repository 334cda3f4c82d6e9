"""vLLM's own defects in align mode (vllm_mamba_align/defects.py) on the
installed release: each row's evidence is where the table says, the start line
warns once of a combination known to corrupt output, and doctor judges the
serve flags the operator intends.

The verdicts for every read release, flags or not, are tests/unit/
test_defects_table.py's (no vLLM needed); these check the table against the
installed wheel and the real scheduler.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import StartLines

from vllm_mamba_align import activation, defects, hazard
from vllm_mamba_align.cli import EXIT_CORRUPTS, EXIT_OK, main
from vllm_mamba_align.releases import installed_version, vllm_package_dir
from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt

RELEASE = installed_version()
read_here = pytest.mark.skipif(
    not defects.covers(RELEASE),
    reason=f"the defects table has not read vLLM {RELEASE}'s span",
)


def _v1_release() -> bool:
    """The installed vLLM has Model Runner V1 (before 0.34.0)."""
    return defects.default_runner(RELEASE, "0") == defects.V1


@pytest.mark.parametrize("key", [d.key for d in defects.DEFECTS])
def test_each_citation_is_in_the_installed_wheel(key: str) -> None:
    """Every line a row cites for the installed release holds its needle (a
    line 0 citation: the file is absent). A release the table has not read is
    skipped."""
    (defect,) = [d for d in defects.DEFECTS if d.key == key]
    cites = defect.evidence.get(str(RELEASE))
    if not cites:
        pytest.skip(f"{key}: nothing cited for vLLM {RELEASE}")
    root = vllm_package_dir()
    assert root is not None
    for cite in cites:
        path = Path(root) / cite.file
        if cite.line == 0:
            assert not path.exists(), cite
            continue
        line = path.read_text().splitlines()[cite.line - 1]
        assert cite.needle in line, (str(cite), line)


@pytest.fixture
def start_lines(monkeypatch: pytest.MonkeyPatch) -> StartLines:
    recorder = StartLines()
    monkeypatch.setattr(activation, "_logger", lambda: recorder)
    monkeypatch.setattr(hazard, "_warned", set())
    return recorder


def _start(asynchronous: bool, speculative: tuple[str, int] | None) -> Simulation:
    """Two schedulers of one engine setting, started and stepped, so a
    warning logged per scheduler rather than once would show twice."""
    geometry = Geometry(
        64, 64, 256, async_scheduling=asynchronous, speculative=speculative
    )
    for name in ("a", "b"):
        sim = Simulation(geometry)
        sim.add(name, prompt(100, seed=1), max_tokens=1)
        sim.run()
    return sim


def _choose_runner(monkeypatch: pytest.MonkeyPatch, runner: str) -> None:
    """``VLLM_USE_V2_MODEL_RUNNER`` where the release has V1 (0.34.0 refuses
    the variable other than 1: unset there)."""
    if _v1_release():
        monkeypatch.setenv(defects.RUNNER_VARIABLE, runner)
    else:
        monkeypatch.delenv(defects.RUNNER_VARIABLE, raising=False)


def _warnings(lines: StartLines) -> list[str]:
    return [line for line in lines.lines if "vLLM defect" in line]


@read_here
@pytest.mark.parametrize("runner", ["0", "1"], ids=["v1", "v2"])
def test_the_start_line_warns_once_of_async_drafting_on_v1(
    start_lines: StartLines, monkeypatch: pytest.MonkeyPatch, runner: str
) -> None:
    """#51571: Model Runner V1 with async scheduling and MTP in align mode.
    Where vLLM builds V1 (``VLLM_USE_V2_MODEL_RUNNER=0`` on 0.27.1-0.33.0)
    the start line warns once, naming ``--no-async-scheduling``; with V2, or
    on 0.34.0 (no V1), it does not."""
    _choose_runner(monkeypatch, runner)
    _start(True, ("mtp", 1))
    warned = _warnings(start_lines)
    if runner == "0" and _v1_release():
        assert len(warned) == 1, start_lines.lines
        assert "#51571" in warned[0] and "--no-async-scheduling" in warned[0]
    else:
        assert warned == [], warned


@read_here
@pytest.mark.parametrize(
    ("asynchronous", "speculative"),
    [(False, ("mtp", 1)), (True, None)],
    ids=["sync-mtp", "async-no-drafter"],
)
def test_no_warning_without_the_whole_combination(
    start_lines: StartLines,
    monkeypatch: pytest.MonkeyPatch,
    asynchronous: bool,
    speculative: tuple[str, int] | None,
) -> None:
    """Synchronous scheduling with MTP, or async without a drafter, on V1:
    no warning (and the table is not even imported for the second)."""
    _choose_runner(monkeypatch, "0")
    _start(asynchronous, speculative)
    assert _warnings(start_lines) == []
    assert any("vllm-mamba-align" in line for line in start_lines.lines)


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


@read_here
def test_doctor_judges_the_intended_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """Without flags doctor says what a drafter would bring (may apply) and
    ``--strict`` passes; with V1, async scheduling and MTP ``--strict``
    fails on 0.27.1-0.33.0 (exit 6, #51571 named with its setting), and
    ``--no-async-scheduling`` clears it; 0.34.0 has no V1 to fail on."""
    code, out = doctor(capsys, "--strict")
    assert code == EXIT_OK, out
    assert "vLLM defects    for " in out and "drafter not given" in out
    flags = ("--strict", "--runner", "v1", "--speculative-method", "mtp")
    code, out = doctor(capsys, *flags, "--async-scheduling")
    if _v1_release():
        assert code == EXIT_CORRUPTS, out
        assert "[!!] #51571 applies" in out and "--no-async-scheduling" in out
    else:
        assert code == EXIT_OK, out
        assert "#51571" not in out.split("does not apply:")[0].split("defects")[-1]
    code, out = doctor(capsys, *flags, "--no-async-scheduling")
    assert code == EXIT_OK, out
