"""The container recipe (``deploy/Dockerfile``), run without a container engine.

There is no Docker engine here, so the recipe's own steps run against the e2e
environment (vLLM's CPU build 0.32.0) as the image build would: its ``COPY``
lines copy the same files into a scratch root, its ``ARG`` defaults and its
``RUN`` line are executed with the container paths under that root, and
``python3`` is this environment's interpreter. The build step must pass here,
and must fail when vLLM would not load the plugin.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .release import E2E_RELEASE

# The in-process engines and the recipe run beside the servers (nox -s e2e
# runs two xdist workers, one a group).
pytestmark = pytest.mark.xdist_group("engines")

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "deploy" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of the recipe, comments and blanks dropped."""
    found = []
    for line in RECIPE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def build_step(root: Path) -> str:
    """Lay out the recipe's COPY lines under ``root``; return its RUN command."""
    args: dict[str, str] = {}
    runs = []
    for keyword, rest in instructions():
        if keyword == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "COPY":
            *sources, destination = shlex.split(rest)
            target = root / destination.lstrip("/")
            for source in sources:
                origin = REPO / source
                if origin.is_dir():
                    shutil.copytree(origin, target, ignore=_no_caches)
                elif destination.endswith("/"):
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target / origin.name)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target)
        elif keyword == "RUN":
            runs.append(rest)
    assert len(runs) == 1, f"the recipe should have one RUN step, found {runs}"
    # ${NAME}: the ARG defaults
    command = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), runs[0])
    return command.replace("/opt/", f"{root}/opt/")


def _no_caches(_: str, names: list[str]) -> list[str]:
    return [n for n in names if n in ("__pycache__", ".mypy_cache")]


def run_build_step(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    command = build_step(tmp_path / "image")
    child = dict(os.environ)
    child["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{child['PATH']}"
    child["PYTHON"] = sys.executable  # the image's python3
    child["HF_HUB_OFFLINE"] = "1"
    child.update(env)
    return subprocess.run(
        ["sh", "-c", command],
        env=child,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )


def test_the_recipe_pins_its_base_image_and_checks_the_plugin() -> None:
    steps = instructions()
    (base,) = [rest for keyword, rest in steps if keyword == "FROM"]
    assert base == "${VLLM_IMAGE}"
    (image,) = [rest for keyword, rest in steps if rest.startswith("VLLM_IMAGE=")]
    pinned = r"VLLM_IMAGE=vllm/vllm-openai:v\d+\.\d+\.\d+(@sha256:\w+)?"
    assert re.fullmatch(pinned, image)
    script = (REPO / "deploy" / "install-plugin.sh").read_text()
    assert "vllm_mamba_align doctor --strict" in script


def test_the_recipe_runs_the_default_mode() -> None:
    environment = " ".join(rest for keyword, rest in instructions() if keyword == "ENV")
    assert "VLLM_MAMBA_ALIGN_MODE" not in environment


def test_the_build_step_installs_and_passes_doctor(tmp_path: Path) -> None:
    done = run_build_step(tmp_path, VLLM_PLUGINS="cpu_e2e_workarounds,mamba_align")
    assert done.returncode == 0, done.stdout[-6000:]
    assert "verdict: [ok]" in done.stdout
    assert f"install-plugin: before: vllm {E2E_RELEASE}" in done.stdout


def test_the_build_step_fails_when_vllm_would_not_load_the_plugin(
    tmp_path: Path,
) -> None:
    # e.g. an image that sets VLLM_PLUGINS for its platform plugin only
    done = run_build_step(tmp_path, VLLM_PLUGINS="cpu_e2e_workarounds")
    assert done.returncode == 4, done.stdout[-6000:]
    assert "does not name mamba_align" in done.stdout
