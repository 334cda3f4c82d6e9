"""Checking a draft: the release's environment, the staged plugin, the tests.

A draft is only as good as a real scheduler's verdict on it: this part
builds the release's CPU environment (and its pinned file, from a
neighbour's for a new release), installs the plugin from a copy of the
checkout holding the drafted table, runs the smoke check and, if asked, the
whole suite, and says what each failing test suggests about the entry.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from maintainers import drafting
from maintainers.onboard import REPO, OnboardError

ENVS = REPO / "envs"
PLATFORM_PLUGINS = {
    "cpu_platform": REPO / "tests" / "support" / "cpu_platform_plugin",
    "cpu_without_triton": REPO / "tests" / "support" / "cpu_without_triton_plugin",
}
"""The test-only plugins a pinned file's ``# PLATFORM:`` line may name (the
noxfile installs the same ones)."""
TEST_PLUGINS = ("vllm-test-cpu-platform", "vllm-test-cpu-without-triton")
"""Their distributions' names."""
WITHOUT_TRITON = "cpu_without_triton"
TRITON_REFUSAL = "requires Triton (triton-cpu)"
"""vLLM 0.34.0+'s CPU platform on x86 without triton-cpu: the smoke check adds
the :data:`WITHOUT_TRITON` plugin by trial when it meets this refusal."""
TEST_TOOLS = ("pytest>=8", "hypothesis>=6.100")
DEFAULT_TORCH = "torch==2.13.0"
STAGE_IGNORE = shutil.ignore_patterns(
    ".git", ".nox", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
)

# What a failing test file suggests about the drafted entry (tests/…).
SUGGESTIONS = {
    "test_split_invariants.py": "the grid redirection or the stop: check the split "
    "body's diff, prefill and wide_block_exemption",
    "test_checkpoints.py": "vLLM's in-chunk checkpoint: check internal_checkpoint, "
    "checkpoint_grid and the checkpoint helpers' diff",
    "test_retention.py": "which states vLLM keeps: check the retention mask and "
    "replay-boundary diffs (retention.py reads them)",
    "test_worker_seed.py": "the worker seed: check its site and SEED_BODIES",
    "test_speculative.py": "the drafter tail and scratch blocks: check the body's "
    "drafter handling and the Mamba allocation diff (aligns_drafter_tail, and "
    "the manager's skips_scratch_move, both read from the code)",
    "test_connectors.py": "external hits: check the body's external-token handling",
    "test_async.py": "async scheduling: check the partial-tail publication",
    "test_audit.py": "the audit's counts: audit/ reads the same facts as the fix",
    "test_fail_closed.py": "recognition and refusals: check the fingerprint and "
    "the stall guard (wide_block_exemption)",
    "test_property.py": "a random workload broke an invariant: reproduce it, then "
    "see the split and allocation diffs",
    "test_sweep.py": "a random workload broke an invariant: rerun it with "
    "MAMBA_ALIGN_SWEEP_ONLY=<index>",
    "test_release_table.py": "the table's own consistency: counts and ranges the "
    "tests pin (update them with the new entry)",
    "test_python_versions.py": "fingerprints across interpreters",
    "test_packaging.py": "the environment: vLLM and torch must be installed as "
    "releases (pip freeze: vllm==X, torch==Y)",
}


def _marker(pinned_text: str, name: str) -> list[str]:
    return [
        word
        for line in pinned_text.splitlines()
        if line.startswith(f"# {name}:")
        for word in line.split(":", 1)[1].split("(")[0].split()
    ]


def _pinned_version(path: Path) -> Version:
    try:
        return Version(path.stem.removeprefix("vllm-"))
    except InvalidVersion:
        return Version("0")


def newest_pinned(before: str | None = None) -> Path:
    """The pinned file a release's environment starts from: the newest one
    older than ``before``; for a release older than every pinned file, the
    oldest (the nearest release's stack, not the newest's); without
    ``before``, the newest of all."""
    files = sorted(ENVS.glob("vllm-*.txt"), key=_pinned_version)
    if not files:
        raise OnboardError(f"no pinned file in {ENVS} to start from")
    if before is None:
        return files[-1]
    older = [p for p in files if _pinned_version(p) < Version(before)]
    return older[-1] if older else files[0]


def _pins(pinned_text: str) -> dict[str, str]:
    """Distribution (canonical name) -> version, of a pinned file's stack and
    its NODEPS line."""
    lines = [line for line in pinned_text.splitlines() if not line.startswith("#")]
    return {
        _distribution(pin): pin.split("==", 1)[1].strip()
        for pin in [*lines, *_marker(pinned_text, "NODEPS")]
        if "==" in pin
    }


def requirement_conflicts(wheel: Path, pinned_text: str) -> list[str]:
    """The release's own requirements (its wheel's metadata, markers as on this
    machine) that ``pinned_text`` pins another version of."""
    with zipfile.ZipFile(wheel) as contents:
        name = next(
            n
            for n in contents.namelist()
            if n.endswith(".dist-info/METADATA") and n.count("/") == 1
        )
        metadata = contents.read(name).decode()
    pins = _pins(pinned_text)
    conflicts = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if requirement.marker is not None and not requirement.marker.evaluate(
            {"extra": ""}
        ):
            continue
        version = pins.get(canonicalize_name(requirement.name))
        if version is not None and not requirement.specifier.contains(
            version, prereleases=True
        ):
            conflicts.append(f"{requirement.name}=={version} ({requirement.specifier})")
    return conflicts


def template_for(release: str, wheel: Path) -> tuple[Path, list[str]]:
    """The pinned file a release without one starts from: of its two
    neighbours, the newest older release's and the oldest newer one's, the
    first whose pins meet the release's requirements (0.20.0 takes 0.20.2's:
    0.19.1's pins apache-tvm-ffi 0.1.11, 0.20.0 requires 0.1.9); when neither
    does, the newest older release's (:func:`newest_pinned`), whose
    contradicted pins are then installed as vLLM requires. Returns it and why
    each neighbour was passed over."""
    files = sorted(ENVS.glob("vllm-*.txt"), key=_pinned_version)
    older = [p for p in files if _pinned_version(p) < Version(release)]
    newer = [p for p in files if _pinned_version(p) > Version(release)]
    passed_over: list[str] = []
    for candidate in (*older[-1:], *newer[:1]):
        conflicts = requirement_conflicts(wheel, candidate.read_text())
        if not conflicts:
            return candidate, passed_over
        passed_over.append(f"`{candidate.name}`: {', '.join(conflicts)}")
    return newest_pinned(before=release), passed_over


# The scheduler's import path, the plugin on it, and a prompt through the fix.
SMOKE = """
import json, os
os.environ.pop("VLLM_MAMBA_ALIGN_MODE", None)  # the default mode, as users get it
import vllm
import vllm.v1.core.sched.scheduler as module
import vllm_mamba_align
from vllm_mamba_align import settings
from vllm_mamba_align.recognition import recognize
from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt
vllm_mamba_align.register()
recognition = recognize(module.Scheduler)
sim = Simulation(Geometry(cache_block=1648, state_block=1648))
sim.add("a", prompt(5000, 1))
sim.run()
print("SMOKE " + json.dumps({
    "vllm": vllm.__version__,
    "verified": recognition.verified,
    "body": recognition.body.name if recognition.body else None,
    "mode": settings.read_mode().value,
    "chunk_ends": sim.chunk_ends("a"),
    "kept_by_vllm": sorted(
        {d.boundary for d in sim.keep_decisions if d.req_id == "a" and d.kept}
    ),
    "poisoned": len(sim.poisoned),
}))
"""
SMOKE_PROMPT = 5000
"""The smoke check's prompt: C = B = 1648, three boundaries inside it."""


def smoke_expectation(answer: dict[str, object]) -> list[int]:
    """The chunk ends the default mode must give the smoke prompt: a stop at
    every boundary vLLM's own retention kept (its keep decisions, watched in
    the smoke run: the judge is vLLM, not the plugin's retention model), then
    the prompt's end. Dense retention keeps 1648, 3296 and 4944; vLLM's
    default retention (0, from 0.29.0) keeps the replay boundary 4944 only."""
    kept = [int(b) for b in answer.get("kept_by_vllm") or []]  # type: ignore[attr-defined]
    return [b for b in kept if b < SMOKE_PROMPT] + [SMOKE_PROMPT]


_MISSING = re.compile(r"No module named '([A-Za-z0-9_]+)")
_CONFLICT = re.compile(
    r"^vllm \S+ has requirement (?P<requirement>[^;]+?)(?:;.*)?, but you have "
    r"(?P<name>\S+) (?P<version>\S+)\.$",
    re.M,
)


def vllm_conflicts(check: str, pinned_text: str) -> list[tuple[str, str, str]]:
    """(requirement without its marker, distribution, installed version) for
    each of vLLM's requirements that ``pip check`` (its output ``check``) finds
    contradicted by a version ``pinned_text`` pins. A package left out on
    purpose is "not installed", no conflict; torch, installed before the
    pinned stack (its CPU build), is not the pinned file's to change."""
    pinned = _pins(pinned_text)
    return [
        (m["requirement"].strip(), m["name"], m["version"])
        for m in _CONFLICT.finditer(check)
        if _distribution(m["name"]) in pinned
    ]


# Import names whose distribution is called otherwise.
DISTRIBUTIONS = {
    "yaml": "pyyaml",
    "PIL": "pillow",
    "zmq": "pyzmq",
    "cpuinfo": "py-cpuinfo",
    "google": "protobuf",
    "sentencepiece": "sentencepiece",
    "tvm_ffi": "apache-tvm-ffi",
    "partial_json_parser": "partial-json-parser",
    "openai_harmony": "openai-harmony",
}


class Environment:
    """One release's onboarding environment (a venv under ``.nox``)."""

    def __init__(self, release: str, location: Path) -> None:
        self.release = release
        self.location = location
        self.python = str(location / "bin" / "python")
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
        self.env.pop("VLLM_PLUGINS", None)
        self.log: list[str] = []
        self.platform_plugins: list[str] = []

    def pip(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = [self.python, "-m", "pip", "install", "-q", *args]
        self.log.append(" ".join(["pip install", *args]))
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise OnboardError(
                f"pip install {' '.join(args)} failed in {self.location}: "
                f"{result.stderr.strip()[-800:]}"
            )
        return result

    def create(self, torch: str) -> None:
        if not Path(self.python).exists():
            subprocess.run(
                [sys.executable, "-m", "venv", str(self.location)], check=True
            )
            self.pip("--upgrade", "pip")
        self.pip(torch)

    def install(self, wheel: Path, pinned_text: str) -> list[str]:
        """vLLM and the pinned stack; returns the platform plugin names needed."""
        self.install_vllm(wheel)
        nodeps = _marker(pinned_text, "NODEPS")
        if nodeps:
            self.pip("--no-deps", *nodeps)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as stack:
            stack.write(pinned_text)
        self.pip("--no-deps", "-r", stack.name)
        # A kept environment may hold a test-only plugin an earlier run added
        # by trial: start from none, so the smoke check finds the need again
        # and the pinned file written says so.
        subprocess.run(
            [self.python, "-m", "pip", "uninstall", "-q", "-y", *TEST_PLUGINS],
            capture_output=True,
        )
        platform = _marker(pinned_text, "PLATFORM")
        for name in platform:
            self.add_platform_plugin(name)
        return platform

    def add_platform_plugin(self, name: str) -> None:
        """Install the test-only plugin ``name`` (:data:`PLATFORM_PLUGINS`) and
        name it to the tests, as the noxfile does for a pinned file's line."""
        self.pip("--no-deps", str(PLATFORM_PLUGINS[name]))
        self.platform_plugins.append(name)
        self.env["MAMBA_ALIGN_TEST_PLATFORM_PLUGINS"] = ",".join(self.platform_plugins)

    def install_vllm(self, wheel: Path) -> None:
        """vLLM from ``wheel``, installed as a release is (``pip freeze`` says
        ``vllm==<version>``, not a file URL: tests/test_packaging.py reads it)."""
        version = drafting.read_release(wheel).version
        if f"vllm=={version}" in self.freeze():
            return
        self.pip(
            "--no-deps",
            "--force-reinstall",
            "--no-index",
            "--find-links",
            str(wheel.parent),
            f"vllm=={version}",
        )

    def run(self, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.python, "-c", code],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=cwd,
        )

    def smoke(self, cwd: Path, rounds: int = 8) -> tuple[dict[str, object], list[str]]:
        """Run SMOKE, adding each missing module (by trial); returns its answer
        and the distributions added."""
        added: list[str] = []
        for _ in range(rounds):
            result = self.run(SMOKE, cwd)
            for line in result.stdout.splitlines():
                if line.startswith("SMOKE "):
                    answer: dict[str, object] = json.loads(line[len("SMOKE ") :])
                    return answer, added
            refused = TRITON_REFUSAL in result.stderr
            if refused and WITHOUT_TRITON not in self.platform_plugins:
                self.add_platform_plugin(WITHOUT_TRITON)
                added.append(f"the test-only plugin {WITHOUT_TRITON}")
                continue
            missing = _MISSING.search(result.stderr)
            if missing is None:
                raise OnboardError(
                    "the scheduler does not start in the release's environment; "
                    f"its last words:\n{result.stderr.strip()[-1500:]}\nAdjust the "
                    f"pinned file and run again ({self.location} is kept)."
                )
            module = missing.group(1)
            distribution = DISTRIBUTIONS.get(module, module.replace("_", "-"))
            if distribution in added:
                raise OnboardError(
                    f"installing {distribution} did not provide module {module}: "
                    "add the right distribution to the pinned file by hand"
                )
            self.pip("--no-deps", distribution)
            added.append(distribution)
        raise OnboardError(f"still missing modules after adding {', '.join(added)}")

    def meet_vllm_requirements(self, pinned_text: str, change: bool) -> list[str]:
        """vLLM's requirements the pinned stack contradicts (an older release's
        pins); with ``change``, each is installed as vLLM requires it (without
        dependencies, as the stack is)."""
        check = subprocess.run(
            [self.python, "-m", "pip", "check"], capture_output=True, text=True
        )
        found = []
        for requirement, name, version in vllm_conflicts(check.stdout, pinned_text):
            if change:
                self.pip("--no-deps", requirement)
            found.append(f"{name} {version} (vLLM requires {requirement})")
        return found

    def freeze(self) -> list[str]:
        result = subprocess.run(
            [self.python, "-m", "pip", "freeze", "--exclude-editable"],
            capture_output=True,
            text=True,
            check=True,
        )
        return result.stdout.splitlines()


def pinned_text_for(
    release: str,
    template: str,
    frozen: list[str],
    torch: str,
    platform: list[str] | None = None,
) -> str:
    """A pinned file for ``release`` from an environment's ``pip freeze``;
    ``platform``: the test-only plugins its environment needed (its
    ``# PLATFORM:`` line), when they differ from the template's."""
    skip = {"torch", "vllm", "vllm-mamba-align", "pip", "setuptools", "wheel"}
    skip |= {"pytest", "hypothesis", "iniconfig", "pluggy", "sortedcontainers"}
    nodeps = _marker(template, "NODEPS")
    skip |= {word.split("==")[0].lower() for word in nodeps}
    skip |= set(TEST_PLUGINS)
    header = [
        line.replace(_template_release(template), release)
        for line in template.splitlines()
        if line.startswith("#")
    ]
    header[0] = (
        f"# vLLM {release} scheduler stack on CPU ({torch.replace('==', ' ')} CPU "
        "build), exact versions."
    )
    if platform is not None and platform != _marker(template, "PLATFORM"):
        header = [line for line in header if not line.startswith("# PLATFORM:")]
        if platform:
            why = "; ".join(PLATFORM_WHY[name] for name in platform)
            header.append(f"# PLATFORM: {' '.join(platform)}  ({why})")
    installed = {_distribution(line): line for line in frozen if "==" in line}
    for word in nodeps:  # the versions the environment has (vLLM's requirements)
        header = [
            line.replace(word, installed.get(_distribution(word), word))
            if line.startswith("# NODEPS:")
            else line
            for line in header
        ]
    packages = sorted(
        (line for line in frozen if "==" in line and _distribution(line) not in skip),
        key=str.lower,
    )
    return "\n".join([*header, *packages]) + "\n"


PLATFORM_WHY = {
    "cpu_platform": "vLLM < 0.28.0 selects no CPU platform by itself: "
    "tests/support/cpu_platform_plugin",
    "cpu_without_triton": "vLLM 0.34.0+ on x86 refuses a config without "
    "triton-cpu: tests/support/cpu_without_triton_plugin",
}
"""Why a pinned file names each test-only plugin (its ``# PLATFORM:`` line)."""


def _distribution(pin: str) -> str:
    return canonicalize_name(pin.split("==")[0])


def _template_release(template: str) -> str:
    match = re.search(r"vllm==([0-9][^ )]*)", template)
    return match.group(1) if match else "?"


# -- staging the plugin with the drafted table ----------------------------------------


def stage_checkout(releases_text: str, into: Path) -> Path:
    """A copy of this checkout whose releases.py holds the draft."""
    if into.exists():
        shutil.rmtree(into)
    shutil.copytree(REPO, into, ignore=STAGE_IGNORE)
    (into / "vllm_mamba_align" / "releases.py").write_text(releases_text)
    return into


def install_staged_plugin(environment: Environment, staged: Path) -> None:
    out = Path(tempfile.mkdtemp(prefix="onboard-plugin-"))
    build = [environment.python, "-m", "pip", "wheel", "-q", "--no-deps", "-w"]
    subprocess.run(
        [*build, str(out), str(staged)],
        check=True,
        capture_output=True,
    )
    wheel = next(out.glob("vllm_mamba_align-*.whl"))
    environment.pip("wrapt>=1.14", "packaging>=21")
    environment.pip("--force-reinstall", "--no-deps", str(wheel))


def run_suite(
    environment: Environment, staged: Path, pytest_args: list[str]
) -> tuple[int, list[tuple[str, str]], str]:
    """pytest in the environment against the draft: (tests, failures, summary)."""
    environment.pip(*TEST_TOOLS)
    junit = staged / "onboard-junit.xml"
    pytest = [environment.python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*pytest, f"--junitxml={junit}", *pytest_args],
        capture_output=True,
        text=True,
        env=environment.env,
        cwd=staged,
    )
    failures: list[tuple[str, str]] = []
    tests = 0
    if junit.exists():
        root = ET.parse(junit).getroot()
        for case in root.iter("testcase"):
            tests += 1
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            if problem is not None:
                name = f"{case.get('classname', '')}.{case.get('name', '')}"
                failures.append((name, (problem.get("message") or "")[:300]))
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    return tests, failures, summary


def suggestion(test: str) -> str:
    for file, meaning in SUGGESTIONS.items():
        if file.removesuffix(".py") in test:
            return meaning
    return "read the test's docstring: it names the invariant it holds"
