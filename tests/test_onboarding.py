"""Onboarding a release drafts its real entry from the installed vLLM's code.

``maintainers/onboard/`` reads a release's code and drafts its release-table entry
(``maintainers.drafting``). Run on the installed release as if the
table did not know it, the draft must be the table's entry: the fingerprint,
the prefill rule, the internal-checkpoint rule, the wide-block exemption, the
extra parameter and the checkpoint grid, each read from the code alone.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import run_python
from packaging.version import Version

from maintainers import drafting
from maintainers.onboard import environment, wheels
from vllm_mamba_align import releases

vllm = pytest.importorskip("vllm")  # the suite collects without vLLM

REPO = Path(__file__).resolve().parent.parent
VLLM_DIR = Path(vllm.__file__).parent
RELEASE = Version(vllm.__version__).public
REAL = releases.expected_body(vllm.__version__)

known_release = pytest.mark.skipif(
    REAL is None, reason=f"vLLM {vllm.__version__} is not in the release table"
)


def release_wheel(folder: Path) -> Path:
    """A wheel of the installed release holding the files onboarding reads
    (the release's own files, byte for byte, and its metadata)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"vllm-{RELEASE}-cp38-abi3-linux_x86_64.whl"
    info = f"vllm-{RELEASE}.dist-info"
    files = {
        f"vllm/{path}": (VLLM_DIR / path).read_bytes()
        for path in sorted(drafting.wanted_files())
        if (VLLM_DIR / path).exists()
    }
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {RELEASE}\n"
    ).encode()
    record = [
        f"{name},sha256={hashlib.sha256(data).hexdigest()},{len(data)}"
        for name, data in files.items()
    ]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(wheel, "w") as out:
        for name, data in files.items():
            out.writestr(name, data)
    return wheel


@known_release
def test_the_installed_release_drafts_its_own_entry() -> None:
    assert REAL is not None
    code = drafting.read_release(VLLM_DIR)
    draft = drafting.draft_entry(code, RELEASE)
    assert drafting.entry_differences(draft.body, REAL) == []
    assert draft.open_questions == ()
    assert drafting.read_seed(code).known


@known_release
def test_onboarding_as_if_unknown_drafts_the_real_entry(tmp_path: Path) -> None:
    """``onboard RELEASE --pretend-unknown`` on the installed release: exit 0,
    and the entry it prints is the table's. A body of its own (0.29.0: the
    internal-checkpoint rule ALIGNED_START, the wide-block exemption) is drafted
    from the code; a shared body is recognized through its other releases."""
    assert REAL is not None
    folder = tmp_path / "wheels"
    release_wheel(folder)
    options = ["--pretend-unknown", "--no-env", "--offline", "--wheels", str(folder)]
    result = subprocess.run(
        [sys.executable, "-m", "maintainers.onboard", RELEASE, *options],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    if len(REAL.releases) == 1:
        assert f"Unknown split body (fingerprint {REAL.fingerprint})" in out
        assert f"The draft equals the table's entry {REAL.name}" in out
    else:  # named as the table knows it without this release
        table = drafting.table_without(RELEASE)
        known = drafting.known_body(REAL.fingerprint, table)
        assert known is not None
        assert f"Known split body {known.name} (fingerprint {REAL.fingerprint})" in out
    assert drafting.render_entry(REAL) in out.split("## Draft entry")[-1]
    assert "Not applied (--pretend-unknown" in out
    if RELEASE == "0.29.0":
        assert "internal_checkpoint=InternalCheckpoint.ALIGNED_START" in out
        assert "wide_block_exemption=True" in out


@known_release
def test_a_wheel_relabelled_with_a_local_version_is_recognized_by_its_code(
    tmp_path: Path,
) -> None:
    """A vendor or dev rebuild (``<release>+<tag>``) of a release's code."""
    wheel = release_wheel(tmp_path / "release")
    labelled = wheels.relabel_wheel(wheel, "vendor1", tmp_path / "vendor")
    version = f"{RELEASE}+vendor1"
    assert labelled.name.startswith(f"vllm-{version}-")
    with zipfile.ZipFile(labelled) as contents:
        metadata = contents.read(f"vllm-{version}.dist-info/METADATA").decode()
    assert f"Version: {version}" in metadata
    code = drafting.read_release(labelled)
    assert code.version == version
    draft = drafting.draft_entry(code)
    assert releases.body_for(draft.body.fingerprint) is REAL
    assert releases.expected_body(version) is REAL
    assert releases.describe_version(version) == f"{version} (dev/vendor build)"


@known_release
def test_the_smoke_check_passes_on_the_installed_release() -> None:
    """The procedure's smoke check, as ``onboard`` runs it in a release's
    environment: the default mode, at the retention the release applies by
    default, stops the smoke prompt at every boundary vLLM's own retention
    kept (its keep decisions, not the plugin's model), then at the end."""
    result = run_python(environment.SMOKE, VLLM_MAMBA_ALIGN_MODE="")
    lines = [line for line in result.stdout.splitlines() if line.startswith("SMOKE ")]
    assert lines, result.stderr[-2000:]
    answer = json.loads(lines[0].removeprefix("SMOKE "))
    assert answer["verified"] and answer["mode"] == "lean"
    assert answer["kept_by_vllm"], "vLLM keeps at least the replay boundary"
    assert answer["chunk_ends"] == environment.smoke_expectation(answer)
    assert answer["poisoned"] == 0
