"""What `pip install vllm-mamba-align` does to a pinned vLLM image: nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OURS = ("vllm-mamba-align", "vllm_mamba_align")


def _pip(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def _freeze() -> list[str]:
    lines = _pip("freeze", "--all").splitlines()
    return sorted(line for line in lines if not line.lower().startswith(OURS))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = os.environ.get("MAMBA_ALIGN_WHEEL")
    if built:
        return Path(built)
    out = tmp_path_factory.mktemp("dist")
    _pip("wheel", "--no-deps", "-w", str(out), str(REPO))
    return next(out.glob("vllm_mamba_align-*.whl"))


def test_the_wheel_depends_on_wrapt_and_packaging_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        requires = [
            line.split(":", 1)[1].strip()
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
        points = next(n for n in names if n.endswith("entry_points.txt"))
        entry_points = archive.read(points).decode()
    assert sorted(r.split(">")[0].split("=")[0] for r in requires) == [
        "packaging",
        "wrapt",
    ]
    assert "[vllm.general_plugins]" in entry_points
    assert "mamba_align = vllm_mamba_align:register" in entry_points
    assert "vllm_mamba_align/py.typed" in names


def test_installing_the_wheel_leaves_vllm_and_torch_untouched(wheel: Path) -> None:
    _pip("uninstall", "-y", "vllm-mamba-align")
    before = _freeze()
    # vLLM's CPU and nightly builds install the package under another name.
    vllm = metadata.packages_distributions().get("vllm", [])
    installed = {line.split("==")[0].split(" @ ")[0] for line in before}
    assert installed & set(vllm)
    assert any(line.startswith("torch==") for line in before)
    _pip("install", str(wheel))
    after = _freeze()
    assert after == before
    assert "vllm-mamba-align" in _pip("list").lower().replace("_", "-")


def _tracked_files() -> list[str]:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), "ls-files"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of the files the sdist must hold")
    return done.stdout.splitlines()


def test_the_sdist_holds_every_tracked_file(tmp_path: Path) -> None:
    """Unpacked, the source distribution runs the tests and checks a clone runs:
    tests/ (conftest, unit, e2e, support), noxfile.py, envs/, maintainers/, docs/."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("setuptools before 77 does not read the SPDX license field")
    tracked = _tracked_files()
    source = tmp_path / "checkout"  # the build writes egg-info beside the sources
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    out = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; "
            "build_meta.build_sdist(sys.argv[1])",
            str(out),
        ],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (sdist,) = out.glob("vllm_mamba_align-*.tar.gz")
    with tarfile.open(sdist) as archive:
        held = {name.split("/", 1)[-1] for name in archive.getnames()}
    assert sorted(set(tracked) - held) == []
    for needed in ("tests/conftest.py", "tests/unit/test_probe.py", "noxfile.py"):
        assert needed in held
